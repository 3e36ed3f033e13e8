"""Checks of the server and the relay's role: what any streaming client needs (version,
``wal_level``, a free slot and WAL sender, REPLICATION, an output plugin the server lets it use)
and the sweeper's grants."""

from __future__ import annotations

import csv

import psycopg
from psycopg import sql

from cdc_relay.config import Plugin, sql_name
from cdc_relay.prerequisites.probe import Checks, Unmet
from cdc_relay.replication.source import MIN_SERVER_VERSION, relation_oid, scalar

# The output plugins a server lets roles decode through, where it restricts them (a setting of the
# newest minor releases; older servers have none and restrict nothing).
OUTPUT_PLUGIN_SETTING = "output_plugin_libraries"


def listed_plugins(value: str) -> list[str]:
    """The names in a list setting as PostgreSQL shows it: comma-separated, each optionally
    double-quoted (a quoted name may hold a comma; ``""`` is a quote in it)."""
    fields = next(csv.reader([value], skipinitialspace=True), [])
    return [name.strip() for name in fields if name.strip()]


class ServerChecks(Checks):
    """The server and the role: version, wal_level, free slots and WAL senders, privileges."""

    def server_version(self) -> str:
        number, version = self.probe.version_num, self.probe.version
        if number < MIN_SERVER_VERSION:
            raise Unmet(f"PostgreSQL {version} is too old: cdc-relay needs 14 or newer")
        return f"PostgreSQL {version}"

    def wal_level(self) -> str:
        level = self.probe.wal_level
        if level != "logical":
            raise Unmet(
                f"wal_level is {level!r}, logical decoding needs 'logical': run ALTER SYSTEM SET "
                "wal_level = logical; then restart PostgreSQL"
            )
        return "logical"

    def replication_slots(self) -> str:
        limit = int(str(scalar(self.conn, "SHOW max_replication_slots")))
        used = int(str(scalar(self.conn, "SELECT count(*) FROM pg_replication_slots")))
        name = self.settings.slot_name
        if self._slot() is not None:
            return f"{used} of {limit} in use, {name} among them"
        if used >= limit:
            raise Unmet(
                f"all {limit} in use (max_replication_slots) and {name} does not exist yet: drop "
                "an unused slot (SELECT pg_drop_replication_slot('<name>')) or raise "
                "max_replication_slots (needs a restart)"
            )
        return f"{used} of {limit} in use, {limit - used} free for {name}"

    def wal_senders(self) -> str:
        limit = int(str(scalar(self.conn, "SHOW max_wal_senders")))
        used = int(
            str(
                scalar(
                    self.conn,
                    "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'walsender'",
                )
            )
        )
        slot = self._slot()
        if slot is not None and slot.active_pid is not None:
            return f"{used} of {limit} in use, one of them streaming {self.settings.slot_name}"
        if used >= limit:
            raise Unmet(
                f"all {limit} in use (max_wal_senders): raise max_wal_senders (needs a restart) "
                "or stop an unused replication client"
            )
        return f"{used} of {limit} in use"

    def output_plugin(self) -> str | None:
        """The server lets roles decode through the relay's plugin (None: it restricts none)."""
        plugin = self.settings.plugin.value
        try:
            with self.conn.transaction():
                shown = scalar(self.conn, "SELECT current_setting(%s, true)", OUTPUT_PLUGIN_SETTING)
        except psycopg.errors.InsufficientPrivilege:
            # Readable by superusers and pg_read_all_settings only: creating or streaming from
            # the slot says it then, if the server does not list the plugin.
            return (
                f"{plugin}; this role may not read {OUTPUT_PLUGIN_SETTING} (superusers and "
                f"pg_read_all_settings may): the server must list {plugin} there if it restricts "
                "output plugins"
            )
        if shown is None:
            return None
        listed = listed_plugins(str(shown))
        if plugin in listed:
            return f"{plugin}, which {OUTPUT_PLUGIN_SETTING} lists"
        statement = sql.SQL("ALTER SYSTEM SET {} = {}").format(
            sql.SQL(OUTPUT_PLUGIN_SETTING),  # our own constant
            sql.SQL(", ").join(sql.Literal(name) for name in [*listed, plugin]),
        )
        other = "" if plugin == Plugin.PGOUTPUT else " (or use CDC_RELAY_PLUGIN=pgoutput)"
        raise Unmet(
            f"the server lets no role decode through {plugin}: {OUTPUT_PLUGIN_SETTING} is "
            f"{str(shown)!r}; as a superuser: {statement.as_string(self.conn)}; SELECT "
            f"pg_reload_conf(){other}"
        )

    def replication_role(self) -> str:
        """The role may stream the WAL (REPLICATION, a superuser, or on Amazon RDS and Aurora a
        member of rds_replication)."""
        probe = self.probe
        if probe.superuser:
            return "superuser"
        if probe.replication:
            return "REPLICATION"
        if probe.rds_replication:
            return "rds_replication"
        raise Unmet(
            f"role {self.user} may not stream the WAL: run ALTER ROLE {self.user} WITH "
            f"REPLICATION (on Amazon RDS and Aurora: GRANT rds_replication TO {self.user})"
        )

    def privileges(self) -> str:
        """What the relay's role needs: streaming, and the sweeper's grants on the outbox."""
        problems: list[str] = []
        try:
            role = self.replication_role()
        except Unmet as exc:
            problems.append(exc.fix)
        # The relay reads rows through the slot only; the sweeper needs SELECT to find
        # published rows and DELETE to remove them.
        needed = ["SELECT", "DELETE"] if self.settings.sweep_interval > 0 else []
        granted: list[str] = []
        for table in self.tables:
            oid = relation_oid(self.conn, table)
            if oid is None:
                continue  # reported by the table check
            schema = table.schema_and_name[0]
            if needed and not scalar(self.conn, "SELECT has_schema_privilege(%s, 'USAGE')", schema):
                problems.append(f"run GRANT USAGE ON SCHEMA {sql_name(schema)} TO {self.user}")
            lacking = [
                p
                for p in needed
                if not scalar(self.conn, "SELECT has_table_privilege(%s::oid, %s)", oid, p)
            ]
            if lacking:
                hint = (
                    " (DELETE: for the sweeper; or CDC_RELAY_SWEEP_INTERVAL=0)"
                    if "DELETE" in lacking
                    else ""
                )
                problems.append(
                    f"run GRANT {', '.join(lacking)} ON {table.sql_name} TO {self.user}{hint}"
                )
            else:
                granted.append(table.table)
        if problems:
            raise Unmet("; ".join(problems))
        on = f"; {', '.join(needed)} on {', '.join(granted)}" if granted and needed else ""
        return f"{self.user}: {role}{on}"
