"""``python -m cdc_relay setup`` and ``python -m cdc_relay check``.

``setup`` creates, idempotently, what the relay needs in the database — the outbox table (on
request), the relay's state table, the ``outbox_emit`` SQL helper, the publication and the slot —
and prints one line per item (``created …`` / ``exists …``).

``check`` is the preflight an operator runs before (or next to) the relay: one line per check,
``ok   <check>: <detail>`` or ``FAIL <check>: <what to do>``; the exit code is non-zero when any
check failed. It changes nothing (the wal2json probe creates a temporary slot and drops it).
"""

from __future__ import annotations

import os
import re
import string
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import psycopg
from psycopg import sql

from cdc_relay.checkpoint import PostgresCheckpointStore, resolve_start
from cdc_relay.config import (
    MissingTopics,
    OutboxColumns,
    OutboxTable,
    Plugin,
    Settings,
    redact_url,
    sql_name,
)
from cdc_relay.ddl import OUTBOX_SQL, emit_function_ddl, packaged_sql
from cdc_relay.errors import PositionMismatch, RelayError, SourceSetupError
from cdc_relay.lsn import format_lsn, parse_lsn
from cdc_relay.publisher import admin_config
from cdc_relay.replication.source import (
    MIN_SERVER_VERSION,
    SourceDatabase,
    connect,
    missing_columns,
    missing_table_hint,
    relation_oid,
)
from cdc_relay.sweeper import has_unique_id

Connection = psycopg.Connection[tuple[object, ...]]
Output = Callable[[str], None]

DEFAULT_OUTBOX_TABLE = "public.outbox"
EMIT_SIGNATURE = "outbox_emit(text, text, text, jsonb, jsonb)"

EXIT_CHECK_FAILED = 1
EXIT_SLOT_LOST = PositionMismatch.exit_code
BROKER_TIMEOUT = 5.0
PROBE_TIMEOUT = "5s"

ID_TYPES = frozenset({"uuid", "text", "character varying"})
PAYLOAD_TYPES = frozenset({"jsonb", "json", "text", "bytea"})
TIME_TYPES = frozenset({"timestamp with time zone", "timestamp without time zone", "date"})


# -- setup -----------------------------------------------------------------------------------


class _SetupFailed(Exception):
    """Ends setup: ``line`` is printed after ``FAIL``, ``exit_code`` returned."""

    def __init__(self, line: str, exit_code: int) -> None:
        super().__init__(line)
        self.line = line
        self.exit_code = exit_code


def setup(settings: Settings, create_outbox: bool = False, out: Output = print) -> int:
    """Create what is missing; one line per item. Returns the exit code."""
    try:
        if create_outbox and not _default_outbox(settings):
            raise _SetupFailed(
                f"table: --create-outbox creates {DEFAULT_OUTBOX_TABLE} as in sql/{OUTBOX_SQL}, "
                "for the default single-table configuration only; create "
                f"{', '.join(t.table for t in settings.tables())} yourself and run setup "
                "without it",
                2,
            )
        with connect(settings.database_url.get_secret_value()) as conn:
            _Setup(conn, settings, out).run(create_outbox)
    except _SetupFailed as exc:
        out(f"FAIL {exc.line}")
        return exc.exit_code
    except RelayError as exc:
        out(f"FAIL {exc}")
        return exc.exit_code
    return 0


class _Setup:
    def __init__(self, conn: Connection, settings: Settings, out: Output) -> None:
        self.conn = conn
        self.settings = settings
        self.out = out
        self.store = PostgresCheckpointStore(conn, settings.state_schema, settings.slot_name)
        self.source = SourceDatabase(
            conn,
            settings.tables(),
            settings.publication_name,
            settings.slot_name,
            settings.plugin.value,
        )

    def report(self, created: bool, item: str) -> None:
        self.out(f"{'created' if created else 'exists':<7} {item}")

    def run(self, create_outbox: bool) -> None:
        conn, settings = self.conn, self.settings
        if create_outbox:
            exists = _relation_exists(conn, "public", "outbox")
            if not exists:
                conn.execute(packaged_sql(OUTBOX_SQL).encode())  # our own trusted DDL
            self.report(not exists, f"table {DEFAULT_OUTBOX_TABLE}")

        try:
            created = self.store.ensure_table()
        except SourceSetupError as exc:
            raise _SetupFailed(f"state table: {exc}", exc.exit_code) from None
        self.report(created, f"state table {self.store.inspect().name}")

        exists = _scalar(conn, "SELECT to_regprocedure(%s) IS NOT NULL", EMIT_SIGNATURE) is True
        if not exists:
            conn.execute(emit_function_ddl(settings.message_prefix, conn))
        prefix = settings.message_prefix
        self.report(not exists, f"function {EMIT_SIGNATURE} (message prefix {prefix!r})")

        try:
            self.source.preflight()
        except SourceSetupError as exc:
            raise _SetupFailed(f"prerequisites: {exc}", exc.exit_code) from None
        try:
            created = self.source.ensure_publication()
        except SourceSetupError as exc:
            raise _SetupFailed(
                f"publication {settings.publication_name}: {exc}", exc.exit_code
            ) from None
        tables = ", ".join(t.table for t in settings.tables())
        self.report(created, f"publication {settings.publication_name} ({tables}; inserts)")
        self.slot()

    def slot(self) -> None:
        settings = self.settings
        name = settings.slot_name
        slot = self.source.slot()
        if slot is None:
            recorded = self.store.load()
            if recorded is not None:
                raise _SetupFailed(
                    f"replication slot {name}: missing, but the relay recorded position "
                    f"{format_lsn(recorded)} in {self.store.inspect().name}: it was "
                    "dropped after the relay used it, and events committed since may never have "
                    "been published. setup will not paper over that by creating a new slot. "
                    "Re-publish those events yourself (or accept the gap), then start the relay "
                    "once with CDC_RELAY_ALLOW_SLOT_RESET=true",
                    EXIT_SLOT_LOST,
                )
            try:
                slot = self.source.create_slot()
            except SourceSetupError as exc:
                raise _SetupFailed(f"replication slot {name}: {exc}", exc.exit_code) from None
            start = slot.confirmed_flush or 0
            # As the relay does after creating its slot: from now on a lost slot is detected.
            self.store.save(start, new_slot=True)
            self.report(True, f"replication slot {name} ({slot.plugin}) at {format_lsn(start)}")
            return
        here = str(_scalar(self.conn, "SELECT current_database()"))
        if slot.plugin != settings.plugin.value or slot.database != here:
            raise _SetupFailed(
                f"replication slot {name}: exists for plugin {slot.plugin!r} in database "
                f"{slot.database!r}, but this relay needs {settings.plugin.value!r} in "
                f"{here!r}: drop it (after stopping whatever uses it) or choose another "
                "CDC_RELAY_SLOT_NAME",
                SourceSetupError.exit_code,
            )
        confirmed = format_lsn(slot.confirmed_flush or 0)
        self.report(False, f"replication slot {name} ({slot.plugin}) at {confirmed}")


def _default_outbox(settings: Settings) -> bool:
    return (
        not settings.outbox_tables
        and settings.outbox_table == DEFAULT_OUTBOX_TABLE
        and settings.outbox_columns == OutboxColumns()
    )


# -- check -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckLine:
    name: str
    ok: bool
    detail: str

    def __str__(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'} {self.name}: {self.detail}"


class _Failed(Exception):
    """Raised inside a check: its message is the FAIL line's text."""


def check(settings: Settings, out: Output = print) -> int:
    """Run every check, print one line each; 0 when all passed."""
    lines = run_checks(settings, lambda line: out(str(line)))
    return 0 if all(line.ok for line in lines) else EXIT_CHECK_FAILED


def run_checks(settings: Settings, emit: Callable[[CheckLine], None]) -> list[CheckLine]:
    lines: list[CheckLine] = []

    def run(name: str, probe: Callable[[], str | None]) -> None:
        try:
            detail = probe()
        except _Failed as exc:
            line = CheckLine(name, False, str(exc))
        except (RelayError, psycopg.Error) as exc:
            line = CheckLine(name, False, str(exc).strip())
        else:
            if detail is None:
                return  # not applicable
            line = CheckLine(name, True, detail)
        lines.append(line)
        emit(line)

    url = settings.database_url.get_secret_value()
    connected: list[Connection] = []

    def connection() -> str:
        connected.append(connect(url))
        user = _scalar(connected[0], "SELECT current_user")
        return f"{redact_url(url)} as {user}"

    run("connection", connection)
    if connected:
        with connected[0] as conn:
            checks = _DatabaseChecks(conn, settings)
            run("server version", checks.server_version)
            run("wal_level", checks.wal_level)
            run("replication slots", checks.replication_slots)
            run("wal senders", checks.wal_senders)
            run("privileges", checks.privileges)
            for table in settings.tables():
                run(f"table {table.table}", partial(checks.table, table))
            run("state table", checks.state_table)
            run("publication", checks.publication)
            run("slot", checks.slot)
            run("wal2json", checks.wal2json)
    metadata: list[Any] = []
    run("broker", lambda: _broker(settings, metadata))
    if metadata:
        run("topics", lambda: _topics(settings, metadata[0]))
    return lines


class _DatabaseChecks:
    def __init__(self, conn: Connection, settings: Settings) -> None:
        self.conn = conn
        self.settings = settings
        self.tables = settings.tables()
        self.user = str(_scalar(conn, "SELECT current_user"))

    def _slot_row(self) -> tuple[object, ...] | None:
        return self.conn.execute(
            "SELECT plugin, database, active_pid, confirmed_flush_lsn::text, wal_status, "
            "pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint, slot_type "
            "FROM pg_replication_slots WHERE slot_name = %s",
            (self.settings.slot_name,),
        ).fetchone()

    def server_version(self) -> str:
        number = int(str(_scalar(self.conn, "SHOW server_version_num")))
        version = str(_scalar(self.conn, "SHOW server_version")).split()[0]
        if number < MIN_SERVER_VERSION:
            raise _Failed(f"PostgreSQL {version} is too old: cdc-relay needs 14 or newer")
        return f"PostgreSQL {version}"

    def wal_level(self) -> str:
        level = str(_scalar(self.conn, "SHOW wal_level"))
        if level != "logical":
            raise _Failed(
                f"wal_level is {level!r}, logical decoding needs 'logical': run ALTER SYSTEM SET "
                "wal_level = logical; then restart PostgreSQL"
            )
        return "logical"

    def replication_slots(self) -> str:
        limit = int(str(_scalar(self.conn, "SHOW max_replication_slots")))
        used = int(str(_scalar(self.conn, "SELECT count(*) FROM pg_replication_slots")))
        name = self.settings.slot_name
        if self._slot_row() is not None:
            return f"{used} of {limit} in use, {name} among them"
        if used >= limit:
            raise _Failed(
                f"all {limit} in use (max_replication_slots) and {name} does not exist yet: drop "
                "an unused slot (SELECT pg_drop_replication_slot('<name>')) or raise "
                "max_replication_slots (needs a restart)"
            )
        return f"{used} of {limit} in use, {limit - used} free for {name}"

    def wal_senders(self) -> str:
        limit = int(str(_scalar(self.conn, "SHOW max_wal_senders")))
        used = int(
            str(
                _scalar(
                    self.conn,
                    "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'walsender'",
                )
            )
        )
        row = self._slot_row()
        if row is not None and row[2] is not None:
            return f"{used} of {limit} in use, one of them streaming {self.settings.slot_name}"
        if used >= limit:
            raise _Failed(
                f"all {limit} in use (max_wal_senders): raise max_wal_senders (needs a restart) "
                "or stop an unused replication client"
            )
        return f"{used} of {limit} in use"

    def privileges(self) -> str:
        row = self.conn.execute(
            "SELECT rolsuper, rolreplication FROM pg_roles WHERE rolname = current_user"
        ).fetchone()
        superuser, replication = bool(row and row[0]), bool(row and row[1])
        problems: list[str] = []
        if not (superuser or replication):
            problems.append(
                f"role {self.user} may not stream the WAL: run ALTER ROLE {self.user} WITH "
                "REPLICATION"
            )
        # The relay reads rows through the slot only; the sweeper needs SELECT to find
        # published rows and DELETE to remove them.
        needed = ["SELECT", "DELETE"] if self.settings.sweep_interval > 0 else []
        granted: list[str] = []
        for table in self.tables:
            oid = relation_oid(self.conn, table)
            if oid is None:
                continue  # reported by the table check
            schema = table.schema_and_name[0]
            if needed and not _scalar(
                self.conn, "SELECT has_schema_privilege(%s, 'USAGE')", schema
            ):
                problems.append(f"run GRANT USAGE ON SCHEMA {sql_name(schema)} TO {self.user}")
            lacking = [
                p
                for p in needed
                if not _scalar(self.conn, "SELECT has_table_privilege(%s::oid, %s)", oid, p)
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
            raise _Failed("; ".join(problems))
        role = "superuser" if superuser else "REPLICATION"
        on = f"; {', '.join(needed)} on {', '.join(granted)}" if granted and needed else ""
        return f"{self.user}: {role}{on}"

    def table(self, table: OutboxTable) -> str:
        missing = missing_columns(self.conn, table)
        if missing is None:
            raise _Failed(
                f"does not exist{missing_table_hint(self.conn, table)}: create it "
                f"(sql/{OUTBOX_SQL}, or python -m cdc_relay setup --create-outbox), or point "
                "CDC_RELAY_OUTBOX_TABLE / CDC_RELAY_OUTBOX_TABLES at your table"
            )
        rows = self.conn.execute(
            "SELECT attname, format_type(atttypid, NULL) FROM pg_attribute "
            "WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped",
            (relation_oid(self.conn, table),),
        ).fetchall()
        types = {str(name): str(kind) for name, kind in rows}
        columns = table.columns
        problems: list[str] = []
        if missing:
            problems.append(
                f"lacks column(s) {', '.join(missing)}: add them, or map the names with "
                "CDC_RELAY_OUTBOX_COLUMNS"
            )
        for column, allowed in ((columns.id, ID_TYPES), (columns.payload, PAYLOAD_TYPES)):
            kind = types.get(column)
            if kind is not None and kind not in allowed:
                problems.append(
                    f"column {column} is {kind}; expected one of {', '.join(sorted(allowed))}"
                )
        if (
            self.settings.sweep_interval > 0
            and columns.id in types
            and not has_unique_id(self.conn, table)
        ):
            problems.append(
                f"column {columns.id} has no unique index, and the sweeper deletes by id: run "
                f"CREATE UNIQUE INDEX ON {table.sql_name} ({columns.id}) (or "
                "CDC_RELAY_SWEEP_INTERVAL=0)"
            )
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
            raise _Failed("; ".join(problems))
        return (
            f"{columns.id} {types[columns.id]}, {columns.payload} {types[columns.payload]}, "
            f"all {len(columns.required)} required columns present"
        )

    def state_table(self) -> str:
        # Exactly what the relay's start does (PostgresCheckpointStore.ensure_table): no DDL when
        # the table is complete, the file's DDL when not, which only some roles may run.
        state = self._store().inspect()
        if state.exists and not state.missing_columns:
            if state.lacking_privileges:
                raise _Failed(state.grant_hint(self.user))
            recorded = self._recorded()
            where = f"recorded position {format_lsn(recorded)}" if recorded else "no record yet"
            return f"{state.name}, {where}"
        if not state.may_create:
            raise _Failed(state.create_hint(self.user))
        what = (
            "lacks column(s) " + ", ".join(state.missing_columns)
            if state.exists
            else ("does not exist yet")
        )
        return f"{state.name} {what}; setup or the relay's first start creates it"

    def _store(self) -> PostgresCheckpointStore:
        return PostgresCheckpointStore(
            self.conn, self.settings.state_schema, self.settings.slot_name
        )

    def _recorded(self) -> int | None:
        try:
            return self._store().load()
        except (psycopg.errors.UndefinedTable, psycopg.errors.InsufficientPrivilege):
            return None  # reported by the state table check

    def publication(self) -> str:
        name = self.settings.publication_name
        wanted = [t.table for t in self.tables]
        create = (
            f"CREATE PUBLICATION {sql_name(name)} FOR TABLE "
            f"{', '.join(t.sql_name for t in self.tables)} WITH (publish = 'insert')"
        )
        row = self.conn.execute(
            "SELECT puballtables, pubinsert, pubupdate, pubdelete, pubtruncate, "
            "pg_get_userbyid(pubowner) FROM pg_publication WHERE pubname = %s",
            (name,),
        ).fetchone()
        if row is None:
            if self._may_create_publication():
                raise _Failed(
                    f"{name} does not exist: run python -m cdc_relay setup (the relay also "
                    f"creates it when it starts), or as the tables' owner: {create}"
                )
            raise _Failed(
                f"{name} does not exist, and {self.user} may not create it (that needs CREATE "
                f"on the database and ownership of the tables): as the tables' owner run {create}"
            )
        *flags, owner = row
        all_tables, insert, update, delete, truncate = (bool(v) for v in flags)
        if all_tables:
            raise _Failed(
                f"{name} publishes ALL TABLES, every write of the database would be decoded: "
                f"DROP PUBLICATION {name}; {create}"
            )
        rows = self.conn.execute(
            "SELECT schemaname || '.' || tablename FROM pg_publication_tables WHERE pubname = %s",
            (name,),
        ).fetchall()
        published = {str(r[0]) for r in rows}
        problems: list[str] = []
        extra = sorted(published - set(wanted))
        if extra:
            problems.append(
                f"it also publishes {', '.join(extra)}: run ALTER PUBLICATION {name} DROP TABLE "
                f"{', '.join(extra)}"
            )
        missing = [t for t in wanted if t not in published]
        if missing:
            problems.append(
                f"it lacks {', '.join(missing)}: run ALTER PUBLICATION {name} ADD TABLE "
                f"{', '.join(missing)}"
            )
        others = [
            a for a, on in (("update", update), ("delete", delete), ("truncate", truncate)) if on
        ]
        if not insert or others:
            what = f"publishes {', '.join(others)}" if others else "does not publish inserts"
            problems.append(
                f"it {what}; the relay needs inserts only (the sweeper's deletes must not "
                f"stream): run ALTER PUBLICATION {name} SET (publish = 'insert')"
            )
        if problems:
            raise _Failed(f"{name}: " + "; ".join(problems))
        return f"{name} (owner {owner}) publishes inserts of {', '.join(wanted)} only"

    def _may_create_publication(self) -> bool:
        if not _scalar(self.conn, "SELECT has_database_privilege(current_database(), 'CREATE')"):
            return False
        for table in self.tables:
            oid = relation_oid(self.conn, table)
            owned = oid is not None and _scalar(
                self.conn,
                "SELECT pg_has_role(relowner, 'USAGE') FROM pg_class WHERE oid = %s",
                oid,
            )
            if not owned:
                return False
        return True

    def slot(self) -> str:
        settings = self.settings
        name = settings.slot_name
        row = self._slot_row()
        recorded = self._recorded()
        if row is None:
            if recorded is not None:
                raise _Failed(
                    f"{name} is missing, but the relay recorded position {format_lsn(recorded)}: "
                    "the slot was dropped after the relay used it, and events committed since "
                    "may never have been published. The relay refuses to start (exit code 4); "
                    "re-publish those events (or accept the gap), then start it once with "
                    "CDC_RELAY_ALLOW_SLOT_RESET=true"
                )
            return (
                f"{name} does not exist yet: setup or the relay's first start creates it "
                "(events are relayed from then on)"
            )
        plugin, database, pid, confirmed, wal_status, retained, kind = row
        here = str(_scalar(self.conn, "SELECT current_database()"))
        problems: list[str] = []
        if kind != "logical" or plugin != settings.plugin.value or database != here:
            problems.append(
                f"{name} is a {kind} slot for plugin {plugin!r} in database {database!r}, but "
                f"this relay needs a logical {settings.plugin.value!r} slot in {here!r} "
                "(CDC_RELAY_PLUGIN): drop it or choose another CDC_RELAY_SLOT_NAME"
            )
        if pid is not None:
            problems.append(self._holder(name, int(str(pid))))
        if wal_status == "lost":
            problems.append(
                f"{name} has lost WAL it needed (wal_status 'lost', see max_slot_wal_keep_size): "
                "it can no longer stream, and events in the lost WAL were not relayed. Drop it; "
                "then start the relay once with CDC_RELAY_ALLOW_SLOT_RESET=true and re-publish "
                "what is missing"
            )
        confirmed_lsn = parse_lsn(str(confirmed)) if confirmed is not None else 0
        try:
            _, warning = resolve_start(name, confirmed_lsn, recorded, settings.allow_slot_reset)
        except PositionMismatch as exc:
            problems.append(str(exc))
            warning = None
        if problems:
            raise _Failed("; ".join(problems))
        retained_text = _size(int(str(retained))) if retained is not None else "unknown"
        detail = (
            f"{name} ({plugin}) idle, confirmed {confirmed}, retained WAL {retained_text}, "
            f"wal_status {wal_status}"
        )
        if wal_status == "unreserved":
            detail += " (beyond max_wal_size: at risk of being lost; is the relay running?)"
        if warning:
            detail += f"; {warning}"
        return detail

    def _holder(self, name: str, pid: int) -> str:
        row = self.conn.execute(
            "SELECT application_name, client_addr::text, usename FROM pg_stat_activity "
            "WHERE pid = %s",
            (pid,),
        ).fetchone()
        who = ""
        if row is not None:
            app, client, user = row
            where = f" from {client}" if client else ""
            who = f" (application_name {app!r}, user {user}{where})"
        return (
            f"{name} is in use by process {pid}{who}: another relay or replication client is "
            "streaming from it. Stop it before starting this relay, or give this relay its own "
            "CDC_RELAY_SLOT_NAME"
        )

    def wal2json(self) -> str | None:
        if self.settings.plugin is not Plugin.WAL2JSON:
            return None
        probe_name = f"cdc_relay_check_{os.getpid()}"
        url = self.settings.database_url.get_secret_value()
        with connect(url) as probe:
            probe.execute(sql.SQL("SET statement_timeout = {}").format(sql.Literal(PROBE_TIMEOUT)))
            try:
                probe.execute(
                    "SELECT pg_create_logical_replication_slot(%s, 'wal2json', true)",
                    (probe_name,),
                )
            except psycopg.errors.UndefinedFile:
                major = int(str(_scalar(self.conn, "SHOW server_version_num"))) // 10000
                raise _Failed(
                    "the wal2json output plugin is not installed on the server: install it "
                    f"(Debian/Ubuntu: apt-get install postgresql-{major}-wal2json) or use "
                    "CDC_RELAY_PLUGIN=pgoutput, which is built in"
                ) from None
            except psycopg.errors.QueryCanceled:
                # The plugin loaded; creating the slot then waits for running transactions.
                return "installed (the probe slot was still waiting for a long transaction)"
            except psycopg.Error as exc:
                row = self._slot_row()
                if row is not None and row[0] == "wal2json":
                    return f"slot {self.settings.slot_name} uses it"
                raise _Failed(
                    f"cannot tell whether wal2json is installed: creating a probe slot failed: "
                    f"{exc.diag.message_primary or exc}"
                ) from None
            probe.execute("SELECT pg_drop_replication_slot(%s)", (probe_name,))
        return "installed"


def _broker(settings: Settings, metadata: list[Any]) -> str:
    from confluent_kafka import KafkaException  # noqa: PLC0415 - only this command needs Kafka
    from confluent_kafka.admin import AdminClient  # noqa: PLC0415

    errors: list[Any] = []
    config: dict[str, Any] = admin_config(settings.producer_config())
    config["log_level"] = 0  # errors are collected and reported in one line instead
    config["error_cb"] = errors.append
    bootstrap = settings.kafka_bootstrap_servers
    try:
        admin = AdminClient(config)
    except KafkaException as exc:
        raise _Failed(
            f"invalid Kafka client configuration: {_kafka_reason(exc.args[0] if exc.args else exc)}"
        ) from None
    try:
        found = admin.list_topics(timeout=BROKER_TIMEOUT)
    except KafkaException as exc:
        detail = _kafka_reason(exc.args[0] if exc.args else exc)
        admin.poll(0)  # serves error_cb: the reason, e.g. "Connection refused"
        reasons = [_kafka_reason(e) for e in errors if "brokers are down" not in str(e)]
        if reasons:
            detail = reasons[0]
        raise _Failed(
            f"cannot reach Kafka at {bootstrap} within {BROKER_TIMEOUT:g}s: {detail}. Check "
            "CDC_RELAY_KAFKA_BOOTSTRAP_SERVERS and the security properties in "
            "CDC_RELAY_KAFKA_PRODUCER_CONFIG"
        ) from None
    metadata.append(found)
    cluster = f", cluster {found.cluster_id}" if found.cluster_id else ""
    return f"{len(found.brokers)} broker(s) at {bootstrap}{cluster}"


def _topics(settings: Settings, metadata: Any) -> str:
    topics: dict[str, Any] = metadata.topics
    wanted = [("dead-letter topic", settings.dead_letter_topic)]
    templates = {settings.topic_template} | {
        t.topic_template for t in settings.tables() if t.topic_template
    }
    for template in sorted(templates):
        if not any(name for _, name, _, _ in string.Formatter().parse(template)):
            wanted.append(("topic", template))  # a fixed topic name, no per-row fields
    allowlist = settings.topic_allowlist
    refused = [
        topic
        for role, topic in wanted
        if role == "topic" and allowlist is not None and not re.fullmatch(allowlist, topic)
    ]
    if refused:
        raise _Failed(
            f"topic {', '.join(refused)} does not match CDC_RELAY_TOPIC_ALLOWLIST: every event "
            "would be refused; fix the template or the allow-list"
        )
    present: list[str] = []
    absent: list[str] = []
    for role, topic in wanted:
        info = topics.get(topic)
        if info is not None and info.error is None:
            present.append(f"{role} {topic} exists ({len(info.partitions)} partitions)")
        else:
            absent.append(f"{role} {topic}")
    if absent and settings.missing_topics is MissingTopics.FAIL:
        raise _Failed(
            f"{', '.join(absent)} does not exist and CDC_RELAY_MISSING_TOPICS=fail: create it "
            "(kafka-topics.sh --create --topic <name>), or let the relay create topics with "
            "CDC_RELAY_MISSING_TOPICS=create"
        )
    later = [f"{name} is created when first needed" for name in absent]
    return "; ".join(present + later)


def _kafka_reason(error: Any) -> str:
    text = error.str() if hasattr(error, "str") else str(error)
    return str(text)


# -- helpers ---------------------------------------------------------------------------------


def _scalar(conn: Connection, query: str, *params: object) -> object:
    row = conn.execute(query.encode(), params or None).fetchone()
    return row[0] if row else None


def _relation_exists(conn: Connection, schema: str, name: str) -> bool:
    return (
        _scalar(
            conn,
            "SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %s AND c.relname = %s",
            schema,
            name,
        )
        is not None
    )


def _size(value: int) -> str:
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"
