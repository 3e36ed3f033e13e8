"""Whether the publication filters the outbox tables' rows as the settings say, and the fix.

PostgreSQL 15+ filters rows in the publication (``FOR TABLE t WHERE (...)``), so pgoutput never
sends a row the filter leaves out. An existing publication may have been created with another
filter, or none: the relay reads each table's filter back (``pg_publication_tables.rowfilter``,
PostgreSQL's rendering, read with :func:`cdc_relay.row_filter.parse_deparsed`) and compares. The
relay also applies the filter itself to every row it decodes (wal2json ignores publications;
PostgreSQL 14 has no row filters; rows committed before a filter changed were decoded under the
old one), so a publication's filter only spares it the work — but the sweeper relies on the
settings alone, and a publication filtering differently would leave rows unpublished: the relay
fixes it when its role owns the publication and refuses to start otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import psycopg

from cdc_relay.config import OutboxTable
from cdc_relay.ddl import set_row_filters_statement
from cdc_relay.errors import SourceSetupError
from cdc_relay.row_filter import parse_deparsed

ROW_FILTER_SERVER_VERSION = 150000  # publications with row filters (FOR TABLE t WHERE ...)

Connection = psycopg.Connection[tuple[object, ...]]


@dataclass(frozen=True)
class FilterMismatch:
    """The outbox tables whose publication filter differs from the setting, and the fix."""

    publication: str
    tables: tuple[OutboxTable, ...]
    found: tuple[str | None, ...]  # each table's filter as PostgreSQL renders it (None: none)
    owned: bool  # the relay's role owns the publication (it may fix it)

    def describe(self) -> str:
        parts = []
        for table, found in zip(self.tables, self.found, strict=True):
            wanted = table.filter
            parts.append(
                f"{table.table} is published with "
                f"{'row filter ' + found if found else 'no row filter'}, the setting says "
                f"{str(wanted) if wanted else 'none'}"
            )
        return "; ".join(parts)

    def fix(self, conn: Connection | None) -> str:
        statement = set_row_filters_statement(self.publication, self.tables)
        return statement.as_string(conn) + ";"


def row_filters_supported(conn: Connection) -> bool:
    return conn.info.server_version >= ROW_FILTER_SERVER_VERSION


def find_mismatch(
    conn: Connection, publication: str, tables: Sequence[OutboxTable]
) -> FilterMismatch | None:
    """One catalog query: the published outbox tables whose filter is not the setting's (None:
    all agree, the publication does not exist, or the server has no row filters)."""
    if not row_filters_supported(conn):
        return None
    rows = conn.execute(
        "SELECT t.schemaname || '.' || t.tablename, t.rowfilter, "
        "pg_has_role(p.pubowner, 'USAGE'), p.puballtables FROM pg_publication_tables t "
        "JOIN pg_publication p ON p.pubname = t.pubname WHERE t.pubname = %s",
        (publication,),
    ).fetchall()
    if rows and rows[0][3]:
        return None  # FOR ALL TABLES takes no row filter: the relay's own filtering does it all
    found = {str(name): (None if text is None else str(text)) for name, text, _, _ in rows}
    owned = bool(rows and rows[0][2])
    wrong = []
    for table in tables:
        if table.table not in found:
            continue  # not published at all: the coverage check says so
        text = found[table.table]
        wanted = table.filter
        have = None if text is None else parse_deparsed(text)
        agree = text is None if wanted is None else have is not None and have.same_as(wanted)
        if not agree:
            wrong.append(table)
    if not wrong:
        return None
    return FilterMismatch(publication, tuple(wrong), tuple(found[t.table] for t in wrong), owned)


def fix_mismatch(conn: Connection, mismatch: FilterMismatch) -> None:
    """Set the tables' filters as the settings say, in one transaction; SourceSetupError when
    the role may not (it must own the publication and the tables)."""
    statement = set_row_filters_statement(mismatch.publication, mismatch.tables)
    if not mismatch.owned:
        raise SourceSetupError(_refusal(conn, mismatch))
    try:
        with conn.transaction():
            conn.execute(statement)
    except psycopg.errors.InsufficientPrivilege as exc:
        raise SourceSetupError(f"{_refusal(conn, mismatch)} ({exc.diag.message_primary})") from None


def _refusal(conn: Connection, mismatch: FilterMismatch) -> str:
    return (
        f"publication {mismatch.publication} does not filter rows as the settings say: "
        f"{mismatch.describe()}. The relay fixes it only as the publication's owner: run, as "
        f"its owner, {mismatch.fix(conn)}"
    )
