"""The sweeper's statements, each run on a connection it is given: SQL only through ``psycopg.sql``.

Which rows may be deleted, and why, is answered once, in :mod:`cdc_relay.sweeper`'s
documentation, which also decides when each statement runs. This module only spells its rules
in SQL: the page of candidates (the fence read in the same statement, the sweep boundary, the
retention, the row filter and sweep condition), the delete that checks them again, and the
catalog reads around them. A table's row key names its rows: one column is compared with
``= ANY(array)``, several with one array per column, each of its type.

Keys travel as text (read with ``::text``, cast back to the column's type in the statements that
name rows): a candidate then costs one ``str``, which the cycle collector does not track. Read
as ``uuid.UUID`` objects, the tens of thousands of candidates waiting between passes filled the
collector's young generation, and collecting it stopped the relay's loop for 15-70 ms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import orjson
import psycopg
from psycopg import sql

from cdc_relay.config import OutboxTable
from cdc_relay.lsn import parse_lsn
from cdc_relay.replication.source import relation_oid
from cdc_relay.sweep_boundary import Leaf, Scan

Connection = psycopg.Connection[tuple[object, ...]]


class SweptTable(Protocol):
    """A table as the sweeper holds it: its row key (resolved each pass) and the condition a
    row must match to be deleted at all (its row filter and sweep condition)."""

    table: OutboxTable
    key: tuple[str, ...]
    key_types: list[sql.Composable]  # each key column's, for casting its text back
    condition: sql.Composable | None


@dataclass(frozen=True)
class Eligible:
    """Per leaf (the table itself, or each leaf partition), the rows a statement may take: of
    transactions from ``since`` on, while the statement's next id is below ``until``
    (:mod:`cdc_relay.sweep_boundary`). A row of any other leaf is never taken."""

    oids: tuple[int, ...] = ()
    since: tuple[int, ...] = ()
    until: tuple[int, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.oids)


# The statement's next transaction id, read once (an InitPlan): every row it sees is older.
_NOW = sql.SQL("(SELECT pg_snapshot_xmax(pg_current_snapshot())::text::int8)")
# The distance from it back to a row's 32-bit xmin, in 1..2^32: the row's 64-bit id is NOW minus
# it while the row is younger than 2^32 transactions (cdc_relay.sweep_boundary).
_DISTANCE = sql.SQL("mod({now} - t.xmin::text::int8 + 4294967295, 4294967296) + 1").format(now=_NOW)


def _eligible(eligible: Eligible) -> tuple[sql.Composable, list[object]]:
    """The condition a row must meet (its leaf's ``since`` and ``until``), and its parameters.

    One comparison (the distance is at least 1): the planner then estimates it as it did
    ``age(xmin) <= age(boundary)`` and reads a page along the key's index; as two, it took them
    for rarer, read the whole table and sorted it (a page of 1,000 of 20,000 rows: 19 ms of the
    server against 0.6). A table that is not partitioned (one leaf) compares with plain numbers:
    the arrays' lookups cost more than the comparison (that page: 0.76 ms with arrays, 0.63
    without, 0.54 as age() compared)."""
    leaf_is: sql.Composable
    until: sql.Composable
    since: sql.Composable
    if len(eligible.oids) == 1:
        leaf_is = sql.SQL("t.tableoid = %s::int8::oid AND ")
        until = since = sql.SQL("%s")
        params: list[object] = [eligible.oids[0], eligible.until[0], eligible.since[0]]
    else:
        leaf = sql.SQL("array_position(%s::int8[]::oid[], t.tableoid)")
        leaf_is = sql.SQL("")
        until = sql.SQL("(%s::int8[])[{}]").format(leaf)
        since = sql.SQL("(%s::int8[])[{}]").format(leaf)
        oids = list(eligible.oids)
        params = [list(eligible.until), oids, list(eligible.since), oids]
    condition = sql.SQL(
        "{leaf_is}{distance} <= CASE WHEN {now} < {until} THEN {now} - {since} ELSE 0 END"
    ).format(leaf_is=leaf_is, distance=_DISTANCE, now=_NOW, until=until, since=since)
    return condition, params


def select_page(
    conn: Connection,
    swept: SweptTable,
    after: object,
    eligible: Eligible,
    *,
    created_at: sql.Composable | None,
    limit: int,
) -> tuple[int, list[object]]:
    """Up to ``limit`` candidate keys after ``after`` (None: from the first), in key order, and
    the fence they were read below (0 when there are none). Keys as text (see above)."""
    statement, params = page_statement(swept, after, eligible, created_at=created_at, limit=limit)
    rows = conn.execute(statement, params).fetchall()
    if not rows:
        return 0, []
    # Every row read the WAL's insert position, nearly always the same: each text parsed once.
    fence = min(parse_lsn(text) for text in {str(row[0]) for row in rows})
    if len(swept.key) == 1:
        return fence, [row[1] for row in rows]
    return fence, [tuple(row[1:]) for row in rows]


def page_statement(
    swept: SweptTable,
    after: object,
    eligible: Eligible,
    *,
    created_at: sql.Composable | None,
    limit: int,
) -> tuple[sql.Composed, list[object]]:
    """:func:`select_page`'s statement and parameters: the fence and the key's text, in key
    order along the key's index, so that a page reads about ``limit`` rows whatever the
    table's size."""
    key = [sql.Identifier(c) for c in swept.key]
    # Qualified: in ORDER BY a bare name is first the output column of that name, here the
    # key's text, which no index orders (every page a scan of the whole table and a sort) and
    # whose order is not the key's (an integer key's next page would skip "2" after "10").
    columns = sql.SQL(", ").join(sql.SQL("t.{}").format(c) for c in key)
    texts = sql.SQL(", ").join(sql.SQL("t.{}::text").format(c) for c in key)
    # Only rows of transactions the slot is sure to have streamed (cdc_relay.sweep_boundary).
    condition, params = _eligible(eligible)
    conditions: list[sql.Composable] = [condition]
    if after is not None:
        after_values = list(after) if len(key) > 1 else [after]  # type: ignore[call-overload]
        conditions.append(
            sql.SQL("({}) > ({})").format(
                columns, sql.SQL(", ").join(sql.SQL("%s::{}").format(t) for t in swept.key_types)
            )
        )
        params.extend(after_values)
    if created_at is not None:
        conditions.append(created_at)
    if swept.condition is not None:
        conditions.append(swept.condition)
    # One statement: its snapshot precedes the fence, which it reads once per row returned
    # (each reading is after the snapshot, so the lowest will do).
    statement = sql.SQL(
        "SELECT pg_current_wal_insert_lsn()::text, {texts} FROM {table} AS t "
        "WHERE {where} ORDER BY {columns} LIMIT %s"
    ).format(
        texts=texts,
        columns=columns,
        table=sql.Identifier(*swept.table.schema_and_name),
        where=sql.SQL(" AND ").join(conditions),
    )
    params.append(limit)
    return statement, params


def delete_batch(
    conn: Connection, swept: SweptTable, ids: tuple[object, ...], eligible: Eligible
) -> tuple[object, ...]:
    """Delete the rows of ``ids`` that ``eligible`` still allows and that still match the
    table's condition, in one short transaction (the sweeper's connection
    autocommits); return the keys deleted (a text per row for a one-column key, a tuple of
    texts for a longer one)."""
    key = [sql.Identifier(c) for c in swept.key]
    table = sql.Identifier(*swept.table.schema_and_name)
    columns = sql.SQL(", ").join(sql.SQL("t.{}").format(c) for c in key)
    returning = sql.SQL(", ").join(sql.SQL("t.{}::text").format(c) for c in key)
    if len(key) == 1:
        match = sql.SQL("t.{} = ANY(%b::{}[])").format(key[0], swept.key_types[0])
        params: list[object] = [list(ids)]
    else:
        # One array per key column, each cast to the column's type.
        match = sql.SQL("({}) IN (SELECT * FROM unnest({}))").format(
            columns,
            sql.SQL(", ").join(sql.SQL("%b::{}[]").format(t) for t in swept.key_types),
        )
        params = [[row[i] for row in ids] for i in range(len(key))]  # type: ignore[index]
    condition, eligible_params = _eligible(eligible)
    match = sql.SQL("{} AND {}").format(match, condition)
    params.extend(eligible_params)
    if swept.condition is not None:
        match = sql.SQL("{} AND {}").format(match, swept.condition)
    statement = sql.SQL("DELETE FROM {} AS t WHERE {} RETURNING {}").format(table, match, returning)
    rows = conn.execute(statement, params).fetchall()
    if len(key) == 1:
        return tuple(row[0] for row in rows)
    return tuple(tuple(row) for row in rows)


def retention(conn: Connection, table: OutboxTable, seconds: float, zone: str) -> sql.Composable:
    """The retention condition's left side, read as an absolute time: the creation-time column
    older than ``seconds``; a ``timestamp without time zone`` or ``date`` column read in
    ``zone``."""
    assert table.columns.created_at is not None  # a retention has its column: config.py
    column = sql.Identifier(table.columns.created_at)
    row = conn.execute(
        "SELECT format_type(atttypid, NULL) FROM pg_attribute WHERE attrelid = %s "
        "AND attname = %s AND NOT attisdropped",
        (relation_oid(conn, table), table.columns.created_at),
    ).fetchone()
    cutoff = sql.SQL("now() - make_interval(secs => {})").format(sql.Literal(seconds))
    if row is not None and row[0] in ("timestamp without time zone", "date"):
        # The cutoff as a wall-clock time in the column's zone: the column itself is
        # compared as stored, so an index on it still serves.
        return sql.SQL("{} < ({}) AT TIME ZONE {}").format(column, cutoff, sql.Literal(zone))
    return sql.SQL("{} < {}").format(column, cutoff)


def live_rows(conn: Connection, table: OutboxTable) -> int:
    """The table's live rows by the statistics (may lag), its partitions' for a partitioned
    one: an estimate of what is left."""
    row = conn.execute(
        "SELECT sum(greatest(n_live_tup, 0)) FROM pg_stat_user_tables WHERE relid = %s "
        "OR relid IN (SELECT relid FROM pg_partition_tree(%s::oid::regclass) WHERE isleaf)",
        (relation_oid(conn, table),) * 2,
    ).fetchone()
    return int(str(row[0])) if row and row[0] is not None else 0


# The outbox's leaves: itself (a table), or its leaf partitions (partitions of partitions too),
# each with its parent in the tree, the xmin of the pg_inherits row attaching it there, its
# relfilenode and its pg_class row's xmin; with the statement's next transaction id.
_LEAVES = (
    "WITH tree AS (SELECT relid, parentrelid, isleaf FROM pg_partition_tree(%(root)s::regclass) "
    "  UNION ALL SELECT %(root)s::regclass, NULL, true "
    "  WHERE NOT EXISTS (SELECT FROM pg_partition_tree(%(root)s::regclass))) "
    "SELECT (SELECT pg_snapshot_xmax(pg_current_snapshot())::text::int8), t.relid::oid::int8, "
    "t.relid::regclass::text, t.parentrelid::oid::int8, t.isleaf, c.relfilenode::int8, "
    "c.xmin::text::int8, i.xmin::text::int8 FROM tree t JOIN pg_class c ON c.oid = t.relid "
    "LEFT JOIN pg_inherits i ON i.inhrelid = t.relid AND i.inhparent = t.parentrelid "
    "AND t.relid <> %(root)s::regclass"
)


def leaves(conn: Connection, oid: int) -> tuple[int, list[Leaf]]:
    """The next transaction id and the leaves of the table ``oid``, in one statement."""
    rows = conn.execute(_LEAVES, {"root": oid}).fetchall()
    now = int(str(rows[0][0])) if rows else 0
    nodes = {int(str(r[1])): r for r in rows}
    found: list[Leaf] = []
    for row in rows:
        if not row[4]:
            continue
        attached: list[int] = []
        node = row
        while int(str(node[1])) != oid and node[7] is not None:
            attached.append(int(str(node[7])))
            node = nodes[int(str(node[3]))]
        found.append(
            Leaf(int(str(row[1])), str(row[2]), tuple(attached), int(str(row[5])), int(str(row[6])))
        )
    return now, found


def scan(conn: Connection, table: OutboxTable, looks: dict[int, int]) -> dict[int, Scan]:
    """Per leaf of ``looks`` (oid -> since): its rows older than ``since``, the smallest image
    among them and the rows taken for younger, with the next id and the oldest running
    transaction, all in one snapshot. Reads every row of those leaves (through the table, so a
    partition needs no privilege of its own)."""
    oids = list(looks)
    since = [looks[o] for o in oids]
    rows = conn.execute(
        sql.SQL(
            "WITH s AS MATERIALIZED (SELECT "
            "pg_snapshot_xmax(pg_current_snapshot())::text::int8 AS now, "
            "pg_snapshot_xmin(pg_current_snapshot())::text::int8 AS running), "
            "r AS (SELECT t.tableoid AS leaf, "
            "s.now - (mod(s.now - t.xmin::text::int8 + 4294967295, 4294967296) + 1) AS image, "
            "(%s::int8[])[array_position(%s::int8[]::oid[], t.tableoid)] AS since "
            "FROM {table} t, s WHERE t.tableoid = ANY(%s::int8[]::oid[])) "
            "SELECT s.now, s.running, l.leaf::int8, "
            "count(r.leaf) FILTER (WHERE r.image < r.since), "
            "min(r.image) FILTER (WHERE r.image < r.since), "
            "count(r.leaf) FILTER (WHERE r.image >= r.since) "
            "FROM s CROSS JOIN unnest(%s::int8[]::oid[]) l(leaf) LEFT JOIN r ON r.leaf = l.leaf "
            "GROUP BY s.now, s.running, l.leaf"
        ).format(table=sql.Identifier(*table.schema_and_name)),
        (since, oids, oids, oids),
    ).fetchall()
    return {
        int(str(leaf)): Scan(
            int(str(now)),
            int(str(running)),
            int(str(older)),
            None if oldest is None else int(str(oldest)),
            int(str(younger)),
        )
        for now, running, leaf, older, oldest, younger in rows
    }


def older_rows(table: OutboxTable, leaf: int, since: int) -> sql.Composed:
    """A query for an operator: the rows of ``leaf`` older than ``since``, which the sweeper
    never deletes (valid while they are younger than 2^32 transactions)."""
    return sql.SQL(
        "SELECT * FROM {table} t WHERE t.tableoid = {leaf} AND {distance} > {now} - {since}"
    ).format(
        table=sql.Identifier(*table.schema_and_name),
        leaf=sql.Literal(leaf),
        distance=_DISTANCE,
        now=_NOW,
        since=sql.Literal(since),
    )


def load_horizons(conn: Connection, schema: str, slot: str) -> object:
    """The horizons the sweepers of this slot have kept (``slot_position.sweep_horizons``)."""
    row = conn.execute(
        sql.SQL("SELECT sweep_horizons FROM {} WHERE slot_name = %s").format(
            sql.Identifier(schema, "slot_position")
        ),
        (slot,),
    ).fetchone()
    return row[0] if row else None


def save_horizons(
    conn: Connection, schema: str, slot: str, boundary: int, entries: dict[str, object]
) -> bool:
    """Keep ``entries`` (leaf oid -> horizon) beside those of the same boundary another sweeper
    kept, dropping any other boundary's; only while the record's boundary is ``boundary``.
    True if written."""
    cursor = conn.execute(
        sql.SQL(
            "UPDATE {} SET sweep_horizons = coalesce((SELECT jsonb_object_agg(e.key, e.value) "
            "FROM jsonb_each(CASE WHEN jsonb_typeof(sweep_horizons) = 'object' "
            "THEN sweep_horizons END) e WHERE jsonb_typeof(e.value) = 'object' "
            "AND e.value->>'b' = %s), '{{}}'::jsonb) || %s::jsonb "
            "WHERE slot_name = %s AND sweep_from_xid = %s::text::xid8"
        ).format(sql.Identifier(schema, "slot_position")),
        (str(boundary), orjson.dumps(entries).decode(), slot, str(boundary)),
    )
    return cursor.rowcount == 1


def published_tables(conn: Connection, publication: str) -> set[str]:
    """The tables whose inserts ``publication`` publishes, as ``schema.name``."""
    rows = conn.execute(
        "SELECT t.schemaname || '.' || t.tablename FROM pg_publication_tables t "
        "JOIN pg_publication p ON p.pubname = t.pubname "
        "WHERE t.pubname = %s AND p.pubinsert",
        (publication,),
    ).fetchall()
    return {str(r[0]) for r in rows}
