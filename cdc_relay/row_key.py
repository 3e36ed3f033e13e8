"""Which columns name one outbox row: what the sweeper deletes by, apart from the event id.

The event id (the ``id`` header) need not name a row: a framework that writes one row per
destination repeats it. The sweeper deletes by the table's row key instead: the columns configured
as ``"row_key"`` (checked to be unique: some unique index covers only columns of the key), else
the primary key, else — as before the setting existed — the id column when a unique index covers
it alone. Without one the table is not swept: a delete by a non-unique key could also hit a later
row that is not yet published.
"""

from __future__ import annotations

from dataclasses import dataclass

from psycopg import sql

from cdc_relay.config import OutboxTable, env_name
from cdc_relay.replication.source import Connection, relation_oid

# Unique, valid, not partial, not on expressions: such an index makes its key columns name a row.
# Its key columns in order, with whether it is the primary key.
_UNIQUE_INDEXES = (
    "SELECT i.indisprimary, array(SELECT a.attname::text "
    "  FROM unnest(i.indkey::int2[]) WITH ORDINALITY k(attnum, n) "
    "  JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum "
    "  WHERE k.n <= i.indnkeyatts ORDER BY k.n) "
    "FROM pg_index i WHERE i.indrelid = %s AND i.indisunique AND i.indisvalid "
    "AND i.indpred IS NULL AND i.indexprs IS NULL ORDER BY NOT i.indisprimary, i.indexrelid"
)


@dataclass(frozen=True)
class RowKey:
    """The key columns, or why there are none (``problem``: what to do about it)."""

    columns: tuple[str, ...]
    problem: str | None = None


def resolve_row_key(conn: Connection, table: OutboxTable) -> RowKey:
    """The columns the sweeper may delete ``table``'s rows by (one catalog query)."""
    oid = relation_oid(conn, table)
    if oid is None:
        return RowKey((), f"{table.table} does not exist")
    indexes = [
        (bool(primary), tuple(str(c) for c in columns) if isinstance(columns, list) else ())
        for primary, columns in conn.execute(_UNIQUE_INDEXES, (oid,)).fetchall()
    ]
    configured = table.columns.row_key
    if configured:
        if any(columns and set(columns) <= set(configured) for _, columns in indexes):
            return RowKey(configured)
        return RowKey(
            (),
            f"row_key ({', '.join(configured)}) is not unique: no unique index covers only "
            f"these columns, so a key could name more than one row: run CREATE UNIQUE INDEX ON "
            f'{table.sql_name} ({", ".join(configured)}), or set another "row_key" in '
            f"{env_name('outbox_columns')} (or CDC_RELAY_SWEEP_INTERVAL=0)",
        )
    for primary, columns in indexes:
        if primary and columns:
            return RowKey(columns)
    id_column = table.columns.id
    if any(columns == (id_column,) for _, columns in indexes):
        return RowKey((id_column,))
    return RowKey(
        (),
        f"{table.table} has no primary key and column {id_column} no unique index, and the "
        'sweeper deletes by a key that names one row: add a primary key, set "row_key" '
        f"to unique columns in {env_name('outbox_columns')}, or run CREATE UNIQUE INDEX ON "
        f"{table.sql_name} ({id_column}) (or CDC_RELAY_SWEEP_INTERVAL=0)",
    )


def key_types(
    conn: Connection, table: OutboxTable, columns: tuple[str, ...]
) -> list[sql.Composable]:
    """Each key column's type as a name for a cast (schema-qualified, without its modifier):
    keys travel as text (:mod:`cdc_relay.sweep_queries`), cast back to these types."""
    rows = conn.execute(
        "SELECT n.nspname, t.typname FROM unnest(%s::text[]) WITH ORDINALITY c(name, n) "
        "JOIN pg_attribute a ON a.attrelid = %s AND a.attname = c.name "
        "JOIN pg_type t ON t.oid = a.atttypid JOIN pg_namespace n ON n.oid = t.typnamespace "
        "ORDER BY c.n",
        (list(columns), relation_oid(conn, table)),
    ).fetchall()
    return [sql.Identifier(str(schema), str(name)) for schema, name in rows]
