"""The outbox rows a recovery owes, read in one snapshot in commit order, as the stream would
have sent them. SQL only through ``psycopg.sql``.

*Which rows* (:class:`Scope`, the argument is :mod:`cdc_relay.recovery`'s): of a transaction at or
after the sweep boundary, matching the table's row filter (and, adopting a table, the adoption's
condition), not proven published by the horizon (a transaction id below its snapshot's ``xmin``),
and — in a recovery started again without the exported snapshot — visible in that snapshot
(``pg_visible_in_snapshot``: the exported snapshot lists every transaction it does not see,
subtransactions included). A row's 64-bit transaction id is derived from its 32-bit ``xmin`` and
the statement's next id, exact for rows younger than 2^32 transactions (as the sweeper's boundary
is, :mod:`cdc_relay.sweep_queries`).

*In which order*: by commit time (``pg_xact_commit_timestamp``, with ``track_commit_timestamp``
on), else by transaction id; within a transaction by the command that inserted the row
(``cmin``), then by its place in the table (``ctid``), as a multi-row ``INSERT`` wrote it. Several
outbox tables are merged into one order (:func:`merged`).

*As what*: each column's text is its type's output function's (``concat()``), read in a session
of the same database URL: what pgoutput's text format sends. The relation is built from the
catalog the way pgoutput announces one: every column that is not dropped nor generated, within the
publication's column list if it has one, in column order, with its type's oid.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql
from psycopg.adapt import Loader

from cdc_relay.config import OutboxTable
from cdc_relay.decode.messages import Relation, RelationColumn, TupleData
from cdc_relay.errors import SourceSetupError
from cdc_relay.recovery.horizon import Snapshot
from cdc_relay.replication.source import missing_table_hint, relation_oid
from cdc_relay.row_filter import Condition

Connection = psycopg.Connection[Any]

FETCH_ROWS = 2000  # rows per round trip of a server-side cursor
COLUMN_LIST_VERSION = 150000  # pg_publication_rel.prattrs
GENERATED_COLUMNS_VERSION = 180000  # pg_publication.pubgencols

# The statement's next transaction id, read once (an InitPlan), and a row's 64-bit id from it.
_NEXT = sql.SQL("(SELECT pg_snapshot_xmax(pg_current_snapshot())::text::int8)")
_IMAGE = sql.SQL(
    "({next} - (mod({next} - t.xmin::text::int8 + 4294967295, 4294967296) + 1))"
).format(next=_NEXT)


class _RawText(Loader):
    """A text value as its bytes, undecoded: the bytes pgoutput would send."""

    def load(self, data: Any) -> bytes:
        return bytes(data)


@dataclass(frozen=True)
class Scope:
    """Which rows a recovery owes (see the module docstring)."""

    boundary: int
    proven_below: int | None  # rows of transactions below this are proven published
    snapshot: Snapshot | None  # without the exported snapshot: the rows it sees
    commit_timestamps: bool
    condition: Condition | None = None  # adopting a table: the rows still to publish
    below: int | None = None  # a publication gap: rows of transactions below this
    # More of each table's conditions, by table (a replay's selection), with their parameters.
    extra: Mapping[str, tuple[sql.Composable, tuple[object, ...]]] = field(default_factory=dict)


@dataclass(frozen=True)
class Source:
    """One outbox table as a recovery reads it."""

    table: OutboxTable
    relation: Relation


def commit_timestamps(conn: Connection) -> bool:
    """Whether the server records commit timestamps (``track_commit_timestamp``)."""
    row = conn.execute("SELECT current_setting('track_commit_timestamp')").fetchone()
    return bool(row and row[0] == "on")


def relation_of(conn: Connection, table: OutboxTable, publication: str) -> Relation:
    """The relation pgoutput would announce for ``table`` (see the module docstring)."""
    oid = relation_oid(conn, table)
    if oid is None:
        raise SourceSetupError(
            f"outbox table {table.table} does not exist{missing_table_hint(conn, table)}"
        )
    version = conn.info.server_version
    columns = sql.SQL(
        "(SELECT r.prattrs::int2[] FROM pg_publication_rel r JOIN pg_publication p "
        "ON p.oid = r.prpubid WHERE p.pubname = %(pub)s AND r.prrelid = c.oid)"
        if version >= COLUMN_LIST_VERSION
        else "NULL::int2[]"
    )
    generated = sql.SQL(
        "coalesce((SELECT p.pubgencols = 's' FROM pg_publication p WHERE p.pubname = %(pub)s), "
        "false)"
        if version >= GENERATED_COLUMNS_VERSION
        else "false"
    )
    rows = conn.execute(
        sql.SQL(
            "SELECT n.nspname, c.relname, c.relreplident::text, a.attname, a.atttypid::int8, "
            "a.atttypmod FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped "
            "WHERE c.oid = %(oid)s AND (a.attgenerated = '' OR {generated}) "
            "AND coalesce(a.attnum = ANY(({columns})::int2[]), true) ORDER BY a.attnum"
        ).format(columns=columns, generated=generated),
        {"oid": oid, "pub": publication},
    ).fetchall()
    if not rows:
        raise SourceSetupError(f"outbox table {table.table} has no columns the stream would send")
    return Relation(
        relation_id=oid,
        namespace=str(rows[0][0]),
        name=str(rows[0][1]),
        replica_identity=str(rows[0][2]),
        columns=tuple(
            RelationColumn(0, str(name), int(str(type_oid)), int(str(modifier)))
            for _, _, _, name, type_oid, modifier in rows
        ),
        xid=None,
    )


def _conditions(source: Source, scope: Scope) -> tuple[sql.Composable, list[object]]:
    conditions: list[sql.Composable] = [sql.SQL("{} >= %s").format(_IMAGE)]
    params: list[object] = [scope.boundary]
    for bound, op in ((scope.proven_below, ">="), (scope.below, "<")):
        if bound is not None:
            conditions.append(sql.SQL("{} {} %s").format(_IMAGE, sql.SQL(op)))
            params.append(bound)
    if scope.snapshot is not None:
        conditions.append(
            sql.SQL("pg_visible_in_snapshot({}::text::xid8, %s::pg_snapshot)").format(_IMAGE)
        )
        params.append(scope.snapshot.text)
    for condition in (source.table.filter, scope.condition):
        if condition is not None:
            conditions.append(condition.render())
    extra = scope.extra.get(source.table.table)
    if extra is not None:
        conditions.append(extra[0])
        params.extend(extra[1])
    return sql.SQL(" AND ").join(conditions), params


def count_statement(source: Source, scope: Scope) -> tuple[sql.Composed, list[object]]:
    where, params = _conditions(source, scope)
    table = sql.Identifier(*source.table.schema_and_name)
    return sql.SQL("SELECT count(*) FROM {} AS t WHERE {}").format(table, where), params


def rows_statement(source: Source, scope: Scope) -> tuple[sql.Composed, list[object]]:
    """The rows in order: commit time (microseconds, or 0), 64-bit id, cmin, then the relation's
    columns as text."""
    where, params = _conditions(source, scope)
    committed = (
        sql.SQL(
            "coalesce((extract(epoch FROM pg_xact_commit_timestamp(t.xmin)) * 1000000)::int8, 0)"
        )
        if scope.commit_timestamps
        else sql.SQL("0::int8")
    )
    texts = sql.SQL(", ").join(
        sql.SQL("CASE WHEN t.{column} IS NULL THEN NULL ELSE concat(t.{column}) END").format(
            column=sql.Identifier(column.name)
        )
        for column in source.relation.columns
    )
    order = (
        sql.SQL("1, 3, 2, t.tableoid, t.ctid")
        if scope.commit_timestamps
        else sql.SQL("2, 3, t.tableoid, t.ctid")
    )
    statement = sql.SQL(
        "SELECT {committed}, {image}, t.cmin::text::int8, {texts} FROM {table} AS t "
        "WHERE {where} ORDER BY {order}"
    ).format(
        committed=committed,
        image=_IMAGE,
        texts=texts,
        table=sql.Identifier(*source.table.schema_and_name),
        where=where,
        order=order,
    )
    return statement, params


def filenodes(conn: Connection, sources: Sequence[Source]) -> dict[str, int]:
    """Each outbox table's storage (its leaf partitions' too): oid -> relfilenode. A rewrite
    (``VACUUM FULL``, ``CLUSTER``, ``ALTER ... TYPE``) changes it, and with it the rows' places,
    which break ties in the recovery's order."""
    found: dict[str, int] = {}
    for source in sources:
        rows = conn.execute(
            "SELECT c.oid::int8, c.relfilenode::int8 FROM pg_class c WHERE c.oid = %s "
            "OR c.oid IN (SELECT relid FROM pg_partition_tree(%s::oid::regclass))",
            (source.relation.relation_id, source.relation.relation_id),
        ).fetchall()
        found |= {str(oid): int(str(node)) for oid, node in rows}
    return found


def count_rows(conn: Connection, sources: Sequence[Source], scope: Scope) -> int:
    total = 0
    for source in sources:
        statement, params = count_statement(source, scope)
        row = conn.execute(statement, params).fetchone()
        total += int(str(row[0])) if row else 0
    return total


@dataclass(frozen=True)
class Row:
    """One owed row, in the recovery's order: its ordinal, table and values (pgoutput's text)."""

    ordinal: int
    source: Source
    xid: int
    values: TupleData


def _rows(
    conn: Connection, index: int, source: Source, scope: Scope
) -> Iterator[tuple[tuple[int, int, int, int, int], int, tuple[Any, ...]]]:
    """One table's rows, keyed for the merge: (commit time, id, cmin, table, place)."""
    statement, params = rows_statement(source, scope)
    with conn.cursor(name=f"cdc_relay_recovery_{index}") as cursor:
        cursor.adapters.register_loader("text", _RawText)
        cursor.itersize = FETCH_ROWS
        cursor.execute(statement, params)
        for place, row in enumerate(cursor):
            committed, xid, cmin = int(row[0]), int(row[1]), int(row[2])
            key = (
                (committed, xid, cmin, index, place)
                if scope.commit_timestamps
                else (0, xid, cmin, index, place)
            )
            yield key, index, tuple(row[3:])


def merged(conn: Connection, sources: Sequence[Source], scope: Scope) -> Iterator[Row]:
    """Every owed row of every table, in one order, numbered from 1 (one server-side cursor per
    table, in ``conn``'s open transaction: memory for a fetch of each, whatever the count)."""
    streams = [_rows(conn, index, source, scope) for index, source in enumerate(sources)]
    for ordinal, (key, index, values) in enumerate(heapq.merge(*streams), start=1):
        yield Row(ordinal, sources[index], key[1], values)
