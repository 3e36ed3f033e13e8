"""Checks of the outbox tables: the mapped columns and their types, the row filter's and sweep
condition's columns and collations, the key the sweeper deletes by, and the output plugin's
reading of a partitioned one."""

from __future__ import annotations

from cdc_relay.config import OutboxTable, Plugin, sql_name
from cdc_relay.ddl import OUTBOX_SQL
from cdc_relay.errors import ConfigError
from cdc_relay.prerequisites.probe import Checks, Unmet
from cdc_relay.publication_filter import row_filters_supported
from cdc_relay.replication.source import (
    missing_columns,
    missing_table_hint,
    relation_oid,
    scalar,
)
from cdc_relay.row_key import resolve_row_key

ID_TYPES = frozenset({"uuid", "text", "character varying"})
PAYLOAD_TYPES = frozenset({"jsonb", "json", "text", "character varying", "bytea"})
CONDITION_TYPES = frozenset({"text", "character varying"})
TIME_TYPES = frozenset({"timestamp with time zone", "timestamp without time zone", "date"})
TABLE_KINDS = frozenset({"r", "p"})  # pg_class.relkind of a table, of a partitioned table
RELATION_KINDS = {"v": "a view", "m": "a materialized view", "f": "a foreign table"}
# PostgreSQL's first OID of objects created after initdb: a collation at or above it is
# user-defined, which a publication's row filter may not use.
FIRST_NORMAL_OBJECT_ID = 16384


class TableChecks(Checks):
    """The outbox tables: columns, types, conditions' columns and collations, the row key."""

    def table_columns(self, table: OutboxTable) -> str:
        """The table exists and has every mapped column (what the relay's start requires)."""
        missing = self._missing_columns(table)
        if missing:
            raise Unmet(missing)
        problems: list[str] = self._plugin_reads(table)
        if table.row_filter or table.sweep_condition:
            problems += self._condition_columns(table, self._column_types(table))
        if self.settings.sweep_interval > 0 and table.columns.row_key:
            key = resolve_row_key(self.conn, table)
            if key.problem is not None:
                problems.append(key.problem)
        if problems:
            raise Unmet("; ".join(problems))
        collations = self._condition_collations(table)
        if collations:
            raise Unmet("; ".join(collations), ConfigError)
        return "all mapped columns present"

    def _plugin_reads(self, table: OutboxTable) -> list[str]:
        """wal2json names each row by the partition it landed in, and is asked for the outbox
        table's rows only (``add-tables``): it would send none of a partitioned outbox's."""
        if self.settings.plugin is not Plugin.WAL2JSON:
            return []
        kind = scalar(
            self.conn,
            "SELECT relkind::text FROM pg_class WHERE oid = %s",
            relation_oid(self.conn, table),
        )
        if kind != "p":
            return []
        return [
            "it is partitioned, and wal2json sends each row as a row of its partition, which the "
            "relay does not ask it for: a partitioned outbox is relayed with pgoutput (its "
            "publication publishes the rows as the outbox's): set CDC_RELAY_PLUGIN=pgoutput"
        ]

    def _column_types(self, table: OutboxTable) -> dict[str, str]:
        rows = self.conn.execute(
            "SELECT attname, format_type(atttypid, NULL) FROM pg_attribute "
            "WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped",
            (relation_oid(self.conn, table),),
        ).fetchall()
        return {str(name): str(kind) for name, kind in rows}

    def _condition_columns(self, table: OutboxTable, types: dict[str, str]) -> list[str]:
        """The row filter's and sweep condition's columns exist and are compared as text."""
        problems: list[str] = []
        for setting, condition in (
            ("row filter", table.filter),
            ("sweep condition", table.sweep_filter),
        ):
            for column in condition.columns if condition is not None else ():
                kind = types.get(column)
                if kind is None:
                    problems.append(f"the {setting} names column {column}, which it lacks")
                elif kind not in CONDITION_TYPES:
                    problems.append(
                        f"the {setting} compares column {column} as text, but it is {kind}: "
                        f"conditions take {' or '.join(sorted(CONDITION_TYPES))} columns"
                    )
        return problems

    def _condition_collations(self, table: OutboxTable) -> list[str]:
        """The conditions' columns have collations the relay and PostgreSQL compare alike.

        The relay compares a condition's text byte for byte, as PostgreSQL does under any
        deterministic collation; under a nondeterministic one (case-insensitive, say) the
        publication and the sweeper's DELETE would take other spellings as equal. And PostgreSQL
        15+ refuses a user-defined collation in a publication's row filter.
        """
        conditions = [("row filter", table.filter), ("sweep condition", table.sweep_filter)]
        columns = {c for _, cond in conditions if cond is not None for c in cond.columns}
        oid = relation_oid(self.conn, table) if columns else None
        if oid is None:
            return []
        rows = self.conn.execute(
            "SELECT a.attname, n.nspname, c.collname, c.collisdeterministic, c.oid >= %s, "
            "format_type(a.atttypid, a.atttypmod) FROM pg_attribute a "
            "JOIN pg_collation c ON c.oid = a.attcollation "
            "JOIN pg_namespace n ON n.oid = c.collnamespace "
            "WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped "
            "AND a.attname = ANY(%s)",
            (FIRST_NORMAL_OBJECT_ID, oid, sorted(columns)),
        ).fetchall()
        found = {
            str(r[0]): (sql_name(str(r[1]), str(r[2])), bool(r[3]), bool(r[4]), str(r[5]))
            for r in rows
        }
        published = row_filters_supported(self.conn)
        problems: list[str] = []
        for setting, condition in conditions:
            for column in condition.columns if condition is not None else ():
                if column not in found:
                    continue  # not a collatable column: the type check says so
                collation, deterministic, user_defined, kind = found[column]
                fix = (
                    f"ALTER TABLE {table.sql_name} ALTER COLUMN {sql_name(column)} TYPE {kind} "
                    'COLLATE "C" (or "default"), or a condition on another column'
                )
                if not deterministic:
                    problems.append(
                        f"the {setting} compares column {column} byte for byte, but its "
                        f"collation {collation} is nondeterministic: PostgreSQL would take other "
                        f"spellings as equal. Give it a deterministic collation: {fix}"
                    )
                elif user_defined and published and setting == "row filter":
                    problems.append(
                        f"the row filter compares column {column}, whose collation {collation} "
                        "is user-defined: PostgreSQL refuses it in a publication's row filter. "
                        f"Give it a built-in collation: {fix}"
                    )
        return problems

    def table_kind(self, table: OutboxTable) -> str:
        """The name is a table's (a view keeping a renamed outbox's name streams nothing)."""
        oid = relation_oid(self.conn, table)
        kind = None
        if oid is not None:
            kind = scalar(self.conn, "SELECT relkind::text FROM pg_class WHERE oid = %s", oid)
        if kind is None:
            raise Unmet(
                f"does not exist{missing_table_hint(self.conn, table)}: create it "
                f"(sql/{OUTBOX_SQL}, or python -m cdc_relay setup --create-outbox), or point "
                "CDC_RELAY_OUTBOX_TABLE / CDC_RELAY_OUTBOX_TABLES at your table"
            )
        if kind not in TABLE_KINDS:
            what = RELATION_KINDS.get(str(kind), f"a relation of kind {kind}")
            raise Unmet(
                f"is {what}, not a table: the relay streams a table's inserts. If it keeps the "
                "name of a renamed outbox, point CDC_RELAY_OUTBOX_TABLE / CDC_RELAY_OUTBOX_TABLES "
                "at the table itself (docs/operations/dba-changes.md)"
            )
        return "a table"

    def _missing_columns(self, table: OutboxTable) -> str | None:
        self.table_kind(table)
        missing = missing_columns(self.conn, table)
        if missing is None:
            raise Unmet(f"does not exist{missing_table_hint(self.conn, table)}")
        if not missing:
            return None
        return (
            f"lacks column(s) {', '.join(missing)}: add them, or map the names with "
            "CDC_RELAY_OUTBOX_COLUMNS"
        )

    def table(self, table: OutboxTable) -> str:
        """The table as ``check`` judges it: columns, their types, what the sweeper needs."""
        missing = self._missing_columns(table)
        types = self._column_types(table)
        columns = table.columns
        problems = [missing] if missing else []
        problems += self._plugin_reads(table)
        for column, allowed in ((columns.id, ID_TYPES), (columns.payload, PAYLOAD_TYPES)):
            kind = types.get(column)
            if kind is not None and kind not in allowed:
                problems.append(
                    f"column {column} is {kind}; expected one of {', '.join(sorted(allowed))}"
                )
        problems += self._condition_columns(table, types)
        problems += self._condition_collations(table)
        if self.settings.sweep_interval > 0:
            key = resolve_row_key(self.conn, table)
            if key.problem is not None:
                problems.append(key.problem)
        if self.settings.sweep_retention_seconds > 0:
            created_at = columns.created_at
            if created_at is None or created_at not in types:
                problems.append(
                    f"CDC_RELAY_SWEEP_RETENTION_SECONDS needs a creation-time column, and "
                    f"{created_at or 'none'!s} is not one of its columns: add it (created_at "
                    "timestamptz NOT NULL DEFAULT now()) or map it in CDC_RELAY_OUTBOX_COLUMNS"
                )
            elif types[created_at] not in TIME_TYPES:
                problems.append(f"column {created_at} is {types[created_at]}, not a timestamp")
        if problems:
            raise Unmet("; ".join(problems))
        return (
            f"{columns.id} {types[columns.id]}, {columns.payload} {types[columns.payload]}, "
            f"all {len(columns.required)} required columns present"
        )
