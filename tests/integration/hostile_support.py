"""Outbox tables of every payload type ``check`` accepts, for tests that write hostile rows.

Each table has the outbox columns without constraints (any of them may be NULL), the payload type
in its name, and a ``json`` (not ``jsonb``) or ``text`` headers column, which keeps whatever text it
was given (lone surrogate escapes, duplicate keys, deep nesting).
"""

from __future__ import annotations

import json

import psycopg
from psycopg import sql

# table -> (id type, payload type, headers type); every payload type
# prerequisites.tables.PAYLOAD_TYPES accepts and every id type prerequisites.tables.ID_TYPES
# accepts.
TABLES = {
    "t_jsonb": ("uuid", "jsonb", "json"),
    "t_json": ("text", "json", "json"),
    "t_text": ("character varying", "text", "text"),
    "t_bytea": ("text", "bytea", "jsonb"),
    "t_varchar": ("text", "character varying", "json"),  # Debezium's outbox_text shape
}
# A table whose other columns have "wrong" types: their text forms travel.
ODD_TABLE = "t_odd"
ODD_DDL = (
    "CREATE TABLE t_odd (id text, aggregate_type integer, aggregate_id numeric, "
    "event_type boolean, payload jsonb, headers jsonb)"
)


def create_tables(database_url: str) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        for table, (id_type, payload_type, headers_type) in TABLES.items():
            conn.execute(
                sql.SQL(
                    "CREATE TABLE {} (id {}, aggregate_type text, aggregate_id text, "
                    "event_type text, payload {}, headers {}, probe text)"
                ).format(
                    sql.Identifier(table),
                    sql.SQL(id_type),
                    sql.SQL(payload_type),
                    sql.SQL(headers_type),
                )
            )
        conn.execute(ODD_DDL)


def outbox_tables_setting() -> str:
    """CDC_RELAY_OUTBOX_TABLES for all the tables above."""
    return json.dumps([{"table": f"public.{name}"} for name in [*TABLES, ODD_TABLE]])


def insert(
    conn: psycopg.Connection[tuple[object, ...]],
    table: str,
    values: dict[str, object],
) -> None:
    """One INSERT of ``values`` (column -> value; bytes for bytea, str otherwise) into ``table``."""
    columns = list(values)
    conn.execute(
        sql.SQL("INSERT INTO {} ({}) VALUES ({})").format(
            sql.Identifier(table),
            sql.SQL(", ").join(map(sql.Identifier, columns)),
            sql.SQL(", ").join(sql.Placeholder() * len(columns)),
        ),
        [values[c] for c in columns],
    )


# Tables whose rows carry a column of every type in tests.hostile_values.PG_TYPES (v_<type>) beside
# the outbox columns: t_values maps them plainly (the decoders read every column, the record has
# the payload), t_values_row with value: row (every column rendered as JSON). t_numeric has a
# numeric payload and a numeric aggregate id.
VALUE_TABLES = ("t_values", "t_values_row", "t_numeric")


def value_column(type_name: str) -> str:
    """The column of ``type_name`` in the value tables: v_numeric, v_integer_array …"""
    return "v_" + type_name.replace("[]", "_array").replace(" ", "_")


def create_value_tables(database_url: str, type_names: list[str]) -> None:
    typed = sql.SQL(", ").join(
        sql.SQL("{} {}").format(sql.Identifier(value_column(name)), sql.SQL(name))
        for name in type_names
    )
    with psycopg.connect(database_url, autocommit=True) as conn:
        for table in VALUE_TABLES[:2]:
            conn.execute(
                sql.SQL(
                    "CREATE TABLE {} (id uuid, aggregate_type text, aggregate_id text, "
                    "event_type text, payload jsonb, headers jsonb, {})"
                ).format(sql.Identifier(table), typed)
            )
        conn.execute(
            "CREATE TABLE t_numeric (id uuid, aggregate_type text, aggregate_id numeric, "
            "event_type text, payload numeric, headers jsonb)"
        )


def value_tables_setting() -> str:
    """CDC_RELAY_OUTBOX_TABLES for the value tables."""
    return json.dumps(
        [
            {"table": "public.t_values"},
            {"table": "public.t_values_row", "columns": {"value": "row"}},
            {"table": "public.t_numeric"},
        ]
    )
