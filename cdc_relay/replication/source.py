"""The source database on an ordinary (non-replication) connection: the publication, the slot.

What the relay finds here and creates when missing (the publication from ``sql/``, the slot); the
checks of what it needs live in :mod:`cdc_relay.prerequisites`. A failure becomes a
:class:`SourceSetupError` whose message says what to run to fix it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import psycopg
from psycopg import sql

from cdc_relay.config import OutboxTable
from cdc_relay.ddl import create_publication_statement, publication_ddl
from cdc_relay.errors import SourceSetupError, SourceUnavailable
from cdc_relay.lsn import parse_lsn
from cdc_relay.postgres_errors import connect_error, message
from cdc_relay.publication_filter import (
    FilterMismatch,
    find_mismatch,
    fix_mismatch,
    row_filters_supported,
)
from cdc_relay.replication.stream import APPLICATION_NAME

log = logging.getLogger(__name__)

MIN_SERVER_VERSION = 140000
FAILOVER_SERVER_VERSION = 170000  # failover slots, slot synchronisation
EMIT_FLUSH_SERVER_VERSION = 170000  # pg_logical_emit_message gained a 4th argument, flush

Connection = psycopg.Connection[tuple[object, ...]]


@dataclass(frozen=True)
class SlotState:
    name: str
    kind: str  # slot_type: "logical" or "physical"
    plugin: str
    database: str
    active_pid: int | None
    confirmed_flush: int | None
    wal_status: str | None
    retained_wal: int | None  # bytes the slot keeps on the server
    failover: bool | None = None  # a failover slot (None: PostgreSQL < 17 has none)
    synced: bool | None = None  # synchronised from a primary (kept after a promotion)
    # Why the server invalidated it (PostgreSQL 17+: wal_removed, idle_timeout, ...); None: valid
    invalidation: str | None = None


def connect(database_url: str) -> Connection:
    """An autocommit connection; connection failures become SourceUnavailable / SetupError.

    The relay passes :meth:`cdc_relay.config.Settings.source_url`: its timeouts are there."""
    try:
        return psycopg.connect(database_url, autocommit=True, application_name=APPLICATION_NAME)
    except psycopg.OperationalError as exc:
        raise connect_error(
            str(exc), exc.sqlstate, database_url, "cannot connect to PostgreSQL"
        ) from None
    except psycopg.Error as exc:
        # libpq refused the connection string itself; its message would quote it.
        raise connect_error(str(exc), None, "", "cannot connect to PostgreSQL") from None


def scalar(conn: Connection, query: sql.SQL | sql.Composed | str, *params: object) -> object:
    """The first column of the first row of ``query`` (None for no row)."""
    statement = query.encode() if isinstance(query, str) else query
    row = conn.execute(statement, params or None).fetchone()
    return row[0] if row else None


def slot_state(conn: Connection, slot_name: str) -> SlotState | None:
    """What ``pg_replication_slots`` says about ``slot_name`` (None: no such slot)."""
    failover = sql.SQL(
        "failover, synced, invalidation_reason"
        if conn.info.server_version >= FAILOVER_SERVER_VERSION
        else "NULL::bool, NULL::bool, NULL::text"
    )
    row = conn.execute(
        sql.SQL(
            "SELECT slot_type, plugin, database, active_pid, confirmed_flush_lsn::text, "
            "wal_status, pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint, {} "
            "FROM pg_replication_slots WHERE slot_name = %s"
        ).format(failover),
        (slot_name,),
    ).fetchone()
    if row is None:
        return None
    kind, plugin, database, pid, confirmed, wal_status, retained, is_failover, synced, why = row
    return SlotState(
        name=slot_name,
        kind=str(kind),
        plugin=str(plugin),
        database=str(database),
        active_pid=int(str(pid)) if pid is not None else None,
        confirmed_flush=parse_lsn(str(confirmed)) if confirmed is not None else None,
        wal_status=str(wal_status) if wal_status is not None else None,
        retained_wal=int(str(retained)) if retained is not None else None,
        failover=bool(is_failover) if is_failover is not None else None,
        synced=bool(synced) if synced is not None else None,
        invalidation=str(why) if why is not None else None,
    )


class SourceDatabase:
    """The publication and the slot the relay streams: found, or created from ``sql/``."""

    def __init__(
        self,
        conn: Connection,
        tables: Sequence[OutboxTable],
        publication_name: str,
        slot_name: str,
        plugin: str = "pgoutput",
    ) -> None:
        self._conn = conn
        self._plugin = plugin
        self._tables = tuple(tables)
        self._publication = publication_name
        self._slot = slot_name

    def ensure_publication(self) -> bool:
        """Create the insert-only publication of the outbox tables if missing. True if created.

        Whether an existing one publishes what the relay needs is a prerequisite
        (:meth:`cdc_relay.prerequisites.publication.PublicationChecks.publication_covers`), checked
        before."""
        exists = scalar(
            self._conn, "SELECT pubinsert FROM pg_publication WHERE pubname = %s", self._publication
        )
        if exists is None:
            row_filters = row_filters_supported(self._conn)
            try:
                self._conn.execute(
                    publication_ddl(self._publication, self._tables, self._conn, row_filters)
                )
            except psycopg.errors.InsufficientPrivilege as exc:
                statement = create_publication_statement(
                    self._publication, self._tables, self._conn, row_filters
                )
                raise SourceSetupError(
                    f"cannot create publication {self._publication}: {exc.diag.message_primary}. "
                    f"Ask the table owner to run: {statement}"
                ) from None
            return True
        return False  # what it publishes: cdc_relay.prerequisites, checked before

    def ensure_row_filters(self) -> FilterMismatch | None:
        """Give the outbox tables the publication's row filters the settings say (what it set,
        None when all agreed); SourceSetupError naming the fix when this role may not."""
        mismatch = find_mismatch(self._conn, self._publication, self._tables)
        if mismatch is not None:
            fix_mismatch(self._conn, mismatch)
        return mismatch

    def slot(self) -> SlotState | None:
        return slot_state(self._conn, self._slot)

    def create_slot(self, failover: bool = False) -> SlotState:
        """Create the slot; ``failover`` (PostgreSQL 17+, see :mod:`cdc_relay.replication.failover`)
        makes it one that standbys synchronise."""
        query = (
            sql.SQL(
                "SELECT pg_create_logical_replication_slot({}, {}, temporary => false, "
                "twophase => false, failover => true)"
            )
            if failover
            else sql.SQL("SELECT pg_create_logical_replication_slot({}, {})")
        ).format(sql.Literal(self._slot), sql.Literal(self._plugin))
        try:
            self._conn.execute(query)
        except psycopg.errors.UndefinedFile:
            raise SourceSetupError(plugin_missing(self._plugin)) from None
        except psycopg.errors.DuplicateObject:
            pass  # created concurrently; the checks below decide whether it is usable
        except psycopg.errors.ConfigurationLimitExceeded as exc:
            raise SourceSetupError(
                f"cannot create replication slot {self._slot!r}: {exc.diag.message_primary}. "
                "Raise max_replication_slots or drop an unused slot"
            ) from None
        except psycopg.errors.InsufficientPrivilege as exc:
            raise SourceSetupError(
                f"cannot create replication slot: {exc.diag.message_primary}"
            ) from None
        slot = self.slot()
        if slot is None:
            raise SourceSetupError(f"replication slot {self._slot!r} vanished after creation")
        return slot

    def current_wal_lsn(self) -> int:
        return parse_lsn(str(scalar(self._conn, "SELECT pg_current_wal_lsn()::text")))


def drop_slot(conn: Connection, slot_name: str) -> None:
    """Drop ``slot_name`` (an invalidated one, which can never stream again)."""
    try:
        conn.execute("SELECT pg_drop_replication_slot(%s)", (slot_name,))
    except psycopg.errors.UndefinedObject:
        return  # gone already
    except psycopg.OperationalError as exc:
        raise SourceUnavailable(f"cannot drop replication slot: {message(exc)}") from None
    except psycopg.Error as exc:
        raise SourceSetupError(
            f"cannot drop replication slot {slot_name!r}: {message(exc)}"
        ) from None


def plugin_missing(plugin: str, major: int | None = None) -> str:
    """The output plugin is not installed on the server: what to do."""
    version = str(major) if major is not None else "<major>"
    return (
        f"the output plugin {plugin!r} is not installed on the server: install it "
        f"(Debian/Ubuntu: apt-get install postgresql-{version}-{plugin}) or use "
        "CDC_RELAY_PLUGIN=pgoutput, which is built in"
    )


def retained_wal(conn: Connection, slot_name: str) -> int | None:
    """Bytes of WAL the slot keeps on the server (None if the slot is gone)."""
    try:
        row = conn.execute(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint "
            "FROM pg_replication_slots WHERE slot_name = %s",
            (slot_name,),
        ).fetchone()
    except psycopg.OperationalError as exc:
        raise SourceUnavailable(f"cannot read the slot's retained WAL: {message(exc)}") from None
    return int(str(row[0])) if row and row[0] is not None else None


def relation_oid(conn: Connection, table: OutboxTable) -> int | None:
    """The oid of ``table``, its schema and name matched exactly as configured.

    Names in settings are identifiers taken literally (as pgoutput reports them and as the DDL
    quotes them): ``public.Outbox`` is the table created as ``"Outbox"``, never ``outbox``.
    """
    schema, name = table.schema_and_name
    row = conn.execute(
        "SELECT c.oid FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s AND c.relname = %s",
        (schema, name),
    ).fetchone()
    return int(str(row[0])) if row else None


def missing_table_hint(conn: Connection, table: OutboxTable) -> str:
    """For a table that does not exist: the one that differs only in case, if any."""
    schema, name = table.schema_and_name
    rows = conn.execute(
        "SELECT n.nspname, c.relname FROM pg_class c JOIN pg_namespace n "
        "ON n.oid = c.relnamespace WHERE lower(n.nspname) = lower(%s) "
        "AND lower(c.relname) = lower(%s) AND c.relkind IN ('r', 'p') ORDER BY 1, 2 LIMIT 1",
        (schema, name),
    ).fetchall()
    if not rows:
        return ""
    return (
        f" (names are case-sensitive and taken as written: did you mean {rows[0][0]}.{rows[0][1]}?)"
    )


def missing_columns(conn: Connection, table: OutboxTable) -> list[str] | None:
    """The mapped columns ``table`` lacks, or None when the table does not exist."""
    oid = relation_oid(conn, table)
    if oid is None:
        return None
    rows = conn.execute(
        "SELECT attname FROM pg_attribute WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped",
        (oid,),
    ).fetchall()
    present = {str(r[0]) for r in rows}
    columns = table.columns
    return [c for c in columns.mapped if c not in present]


HEARTBEAT_PREFIX = "cdc_relay_heartbeat"


def emit_heartbeat(conn: Connection) -> None:
    """A little WAL of our own, so that keepalives move the confirmed position on databases whose
    other writes are invisible to the slot (e.g. managed services writing to other databases).
    Non-transactional and with its own prefix: never relayed."""
    try:
        conn.execute("SELECT pg_logical_emit_message(false, %s, '')", (HEARTBEAT_PREFIX,))
    except psycopg.OperationalError as exc:
        raise SourceUnavailable(f"cannot emit a heartbeat: {message(exc)}") from None


class Heartbeats:
    """:func:`emit_heartbeat` on one connection, until the role turns out not to be allowed to
    (``pg_logical_emit_message`` revoked from PUBLIC for table-less messages, and not granted to
    the relay's role): said once, then heartbeats are off — the relay works on without them."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.refused = False

    def __call__(self) -> None:
        if self.refused:
            return
        try:
            emit_heartbeat(self.conn)
        except psycopg.errors.InsufficientPrivilege:
            self.refused = True
            user = self.conn.info.user
            arguments = "boolean, text, text"
            if self.conn.info.server_version >= EMIT_FLUSH_SERVER_VERSION:
                arguments += ", boolean"
            log.warning(
                "heartbeats are off: this role may not execute pg_logical_emit_message",
                extra={
                    "fields": {
                        "fix": "as a superuser: GRANT EXECUTE ON FUNCTION pg_catalog."
                        f"pg_logical_emit_message({arguments}) TO {user} (or "
                        "CDC_RELAY_HEARTBEAT_INTERVAL=0)"
                    }
                },
            )
