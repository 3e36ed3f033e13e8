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

from typing import Protocol

import psycopg
from psycopg import sql

from cdc_relay.config import OutboxTable
from cdc_relay.lsn import parse_lsn
from cdc_relay.replication.source import relation_oid

Connection = psycopg.Connection[tuple[object, ...]]


class SweptTable(Protocol):
    """A table as the sweeper holds it: its row key (resolved each pass) and the condition a
    row must match to be deleted at all (its row filter and sweep condition)."""

    table: OutboxTable
    key: tuple[str, ...]
    key_types: list[sql.Composable]  # each key column's, for casting its text back
    condition: sql.Composable | None


def _xid(boundary: int) -> str:
    """The sweep boundary as the 32-bit xid ``age()`` compares across wraparound."""
    return str(boundary & 0xFFFFFFFF)


def select_page(
    conn: Connection,
    swept: SweptTable,
    after: object,
    boundary: int,
    *,
    created_at: sql.Composable | None,
    limit: int,
) -> tuple[int, list[object]]:
    """Up to ``limit`` candidate keys after ``after`` (None: from the first), in key order, and
    the fence they were read below (0 when there are none). Keys as text (see above)."""
    statement, params = page_statement(swept, after, boundary, created_at=created_at, limit=limit)
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
    boundary: int,
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
    # Only rows of transactions the slot is sure to have streamed (see
    # PostgresCheckpointStore.load_sweep_boundary); age() compares 32-bit xids across
    # wraparound, and a frozen xmin has the greatest age, so it is never taken.
    conditions: list[sql.Composable] = [sql.SQL("age(xmin) <= age(%s::text::xid)")]
    params: list[object] = [_xid(boundary)]
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
    conn: Connection, swept: SweptTable, ids: tuple[object, ...], boundary: int
) -> tuple[object, ...]:
    """Delete the rows of ``ids`` that are of transactions at or after ``boundary`` and still
    match the table's condition, in one short transaction (the sweeper's connection
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
    match = sql.SQL("{} AND age(t.xmin) <= age(%s::text::xid)").format(match)
    params.append(_xid(boundary))
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
    """The table's live rows by the statistics (may lag): an estimate of what is left."""
    row = conn.execute(
        "SELECT greatest(n_live_tup, 0) FROM pg_stat_user_tables WHERE relid = %s",
        (relation_oid(conn, table),),
    ).fetchone()
    return int(str(row[0])) if row and row[0] is not None else 0


def published_tables(conn: Connection, publication: str) -> set[str]:
    """The tables whose inserts ``publication`` publishes, as ``schema.name``."""
    rows = conn.execute(
        "SELECT t.schemaname || '.' || t.tablename FROM pg_publication_tables t "
        "JOIN pg_publication p ON p.pubname = t.pubname "
        "WHERE t.pubname = %s AND p.pubinsert",
        (publication,),
    ).fetchall()
    return {str(r[0]) for r in rows}
