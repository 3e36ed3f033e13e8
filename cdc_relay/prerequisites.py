"""What the relay needs of its database, checked in one place for its two callers.

Each prerequisite is a method of :class:`Prerequisites` that returns what it found (an ``ok`` line's
detail) or raises :class:`Unmet` with what to do about it:

* the relay's start (and ``setup``) calls :func:`require`: the prerequisites it cannot stream
  without (server, role, tables, an existing publication's coverage), in order, stopping at the
  first unmet one with the project's error (exit 3);
  :func:`require_usable_slot` then judges the slot it found;
* ``python -m cdc_relay check`` runs every check and prints one line each (:func:`outcome`).

Messages about the slot that only the relay's own record can explain (a slot dropped or advanced
behind the relay's back) belong to :mod:`cdc_relay.checkpoint`, which decides where to start.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import psycopg
from psycopg import sql

from cdc_relay.checkpoint import (
    LEASE_TABLE,
    PostgresCheckpointStore,
    check_missing_slot,
    resolve_start,
)
from cdc_relay.config import OutboxTable, Plugin, Settings, sql_name
from cdc_relay.ddl import EMIT_SQL, OUTBOX_SQL, create_publication_statement
from cdc_relay.errors import (
    ConfigError,
    PositionMismatch,
    RelayError,
    SlotInUse,
    SourceSetupError,
)
from cdc_relay.leadership import foreign_holder
from cdc_relay.lsn import format_lsn
from cdc_relay.publication_filter import find_mismatch, row_filters_supported
from cdc_relay.record_origin import history_switches, problem, refusal
from cdc_relay.replication.failover import describe, promotion_note
from cdc_relay.replication.source import (
    MIN_SERVER_VERSION,
    Connection,
    SlotState,
    connect,
    missing_columns,
    missing_table_hint,
    plugin_missing,
    relation_oid,
    scalar,
    slot_state,
)
from cdc_relay.replication.stream import timeline_history
from cdc_relay.row_key import resolve_row_key

log = logging.getLogger(__name__)

PROBE_TIMEOUT = "5s"
# The functions (p: pg_proc) whose callers can write a table-less event: every overload of
# pg_logical_emit_message, and an outbox_emit running as its owner (sql/004_outbox_emit.sql).
_EMITTERS = sql.SQL(
    "(p.proname = 'pg_logical_emit_message' AND p.pronamespace = 'pg_catalog'::regnamespace) "
    "OR (p.proname = 'outbox_emit' AND p.prosecdef)"
)
MAX_ROLES_SHOWN = 10

ID_TYPES = frozenset({"uuid", "text", "character varying"})
PAYLOAD_TYPES = frozenset({"jsonb", "json", "text", "character varying", "bytea"})
CONDITION_TYPES = frozenset({"text", "character varying"})
TIME_TYPES = frozenset({"timestamp with time zone", "timestamp without time zone", "date"})
# PostgreSQL's first OID of objects created after initdb: a collation at or above it is
# user-defined, which a publication's row filter may not use.
FIRST_NORMAL_OBJECT_ID = 16384


class Unmet(Exception):
    """A prerequisite that does not hold. ``fix`` says what to do; ``error`` is what the relay
    raises for it."""

    def __init__(self, fix: str, error: type[RelayError] = SourceSetupError) -> None:
        super().__init__(fix)
        self.fix = fix
        self.error = error


@dataclass(frozen=True)
class CheckResult:
    """One check's verdict: ``ok   <name>: <what was found>`` or ``FAIL <name>: <what to do>``."""

    name: str
    ok: bool
    detail: str

    def __str__(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'} {self.name}: {self.detail}"


def outcome(name: str, probe: Callable[[], str | None]) -> CheckResult | None:
    """Run one check for a report; None when it does not apply to these settings."""
    try:
        detail = probe()
    except Unmet as exc:
        return CheckResult(name, False, exc.fix)
    except (RelayError, psycopg.Error) as exc:
        return CheckResult(name, False, str(exc).strip())
    return None if detail is None else CheckResult(name, True, detail)


def require(conn: Connection, settings: Settings) -> None:
    """The relay's start: what it cannot stream without, in order; raises at the first unmet
    prerequisite (SourceSetupError, exit 3) with the statement that fixes it."""
    checks = Prerequisites(conn, settings)
    steps: list[tuple[str, Callable[[], object]]] = [
        ("server version", checks.server_version),
        ("wal_level", checks.wal_level),
        ("privileges", checks.replication_role),
    ]
    steps += [(f"table {t.table}", partial(checks.table_columns, t)) for t in checks.tables]
    steps.append(("publication", checks.publication_covers))
    if settings.messages:
        steps.append(("messages", checks.messages))
    for name, probe in steps:
        try:
            probe()
        except Unmet as exc:
            raise exc.error(f"{name}: {exc.fix}") from None
    if not settings.messages and checks.emit_functions():
        log.warning(
            "table-less messages are off, yet outbox_emit exists: what it writes is not relayed",
            extra={"fields": {"fix": "set CDC_RELAY_MESSAGES=true if writers use it"}},
        )


def require_usable_slot(conn: Connection, settings: Settings, slot: SlotState) -> None:
    """The slot the relay is about to stream: for its plugin, in this database, held by nobody
    (SlotInUse, retried later, when another process streams from it)."""
    checks = Prerequisites(conn, settings)
    try:
        checks.slot_kind(slot)
        checks.slot_free(slot)
    except Unmet as exc:
        raise exc.error(f"slot: {exc.fix}") from None


class Prerequisites:
    """The checks of the source database, on one connection; each returns what it found or
    raises :class:`Unmet`."""

    def __init__(self, conn: Connection, settings: Settings) -> None:
        self.conn = conn
        self.settings = settings
        self.tables = settings.tables()
        # What the first checks read, in one round trip: each round trip delays the relay's start.
        row = conn.execute(
            "SELECT current_user, current_setting('server_version_num'), "
            "current_setting('server_version'), current_setting('wal_level'), "
            "r.rolsuper, r.rolreplication FROM pg_roles r WHERE r.rolname = current_user"
        ).fetchone()
        if row is None:  # no pg_roles row for the session's role: it was just dropped
            raise SourceSetupError("the connection's role does not exist (any more)")
        self.user = str(row[0])
        self._version_num = int(str(row[1]))
        self._version = str(row[2]).split()[0]
        self._wal_level = str(row[3])
        self._superuser, self._replication = bool(row[4]), bool(row[5])

    def _slot(self) -> SlotState | None:
        return slot_state(self.conn, self.settings.slot_name)

    def server_version(self) -> str:
        number, version = self._version_num, self._version
        if number < MIN_SERVER_VERSION:
            raise Unmet(f"PostgreSQL {version} is too old: cdc-relay needs 14 or newer")
        return f"PostgreSQL {version}"

    def wal_level(self) -> str:
        level = self._wal_level
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

    def replication_role(self) -> str:
        """The role may stream the WAL (REPLICATION, or a superuser)."""
        superuser, replication = self._superuser, self._replication
        if not (superuser or replication):
            raise Unmet(
                f"role {self.user} may not stream the WAL: run ALTER ROLE {self.user} WITH "
                "REPLICATION"
            )
        return "superuser" if superuser else "REPLICATION"

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

    def table_columns(self, table: OutboxTable) -> str:
        """The table exists and has every mapped column (what the relay's start requires)."""
        missing = self._missing_columns(table)
        if missing:
            raise Unmet(missing)
        problems: list[str] = []
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

    def _missing_columns(self, table: OutboxTable) -> str | None:
        missing = missing_columns(self.conn, table)
        if missing is None:
            raise Unmet(
                f"does not exist{missing_table_hint(self.conn, table)}: create it "
                f"(sql/{OUTBOX_SQL}, or python -m cdc_relay setup --create-outbox), or point "
                "CDC_RELAY_OUTBOX_TABLE / CDC_RELAY_OUTBOX_TABLES at your table"
            )
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

    def state_table(self) -> str:
        # Exactly what the relay's start does (PostgresCheckpointStore.ensure_table): no DDL when
        # the table is complete, the file's DDL when not, which only some roles may run.
        states = self._store().inspect_all()
        incomplete = [s for s in states if not s.exists or s.missing_columns]
        if not incomplete:
            for state in states:
                if state.lacking_privileges:
                    raise Unmet(state.grant_hint(self.user))
            try:  # as the relay reads it: with the server's identity (record_origin)
                record = self._store().load_record()
            except SourceSetupError as exc:
                raise Unmet(str(exc)) from None
            recorded = record.stamp.position if record.stamp is not None else None
            where = f"recorded position {format_lsn(recorded)}" if recorded else "no record yet"
            return f"{', '.join(s.name for s in states)}, {where}"
        for state in incomplete:
            if not state.may_create:
                raise Unmet(state.create_hint(self.user))
        what = "; ".join(
            f"{s.name} lacks column(s) {', '.join(s.missing_columns)}"
            if s.exists
            else f"{s.name} does not exist yet"
            for s in incomplete
        )
        return f"{what}; setup or the relay's first start creates it"

    def _store(self) -> PostgresCheckpointStore:
        return PostgresCheckpointStore(
            self.conn, self.settings.state_schema, self.settings.slot_name
        )

    def leadership(self) -> str:
        """Who leads the slot now, and whether this role could take over from it if it hung:
        that ends the leader's backends (pg_terminate_backend), allowed for backends of a role
        whose privileges this one has, or with pg_signal_backend; a superuser's only to one."""
        lease = sql.Identifier(self.settings.state_schema, LEASE_TABLE)
        slot = self.settings.slot_name
        try:
            squatter = foreign_holder(self.conn, self.settings.state_schema, slot)
        except (psycopg.errors.UndefinedTable, psycopg.errors.InsufficientPrivilege):
            squatter = None  # no lease table to tell relays by: the state table check says why
        if squatter is not None:
            raise Unmet(
                f"the leader lock is held by a session that is no relay ({squatter.describe()}): "
                f"no relay can lead while it holds it; {squatter.fix(slot)}"
            )
        try:
            row = self.conn.execute(
                sql.SQL(
                    "SELECT l.holder, l.expires_at > now(), r.rolname, "
                    "r.oid IS NULL OR ((NOT r.rolsuper OR me.rolsuper) AND "
                    "(pg_has_role(r.oid, 'USAGE') OR pg_has_role('pg_signal_backend', 'USAGE'))) "
                    "FROM {} l JOIN pg_roles me ON me.rolname = current_user "
                    "LEFT JOIN pg_stat_activity a ON a.pid = l.lock_pid "
                    "LEFT JOIN pg_roles r ON r.oid = a.usesysid WHERE l.slot_name = %s"
                ).format(lease),
                (self.settings.slot_name,),
            ).fetchone()
        except (psycopg.errors.UndefinedTable, psycopg.errors.InsufficientPrivilege):
            return "no relay has led this slot yet (the state table above says why)"
        if row is None:
            return "no relay has led this slot yet; the first to start leads, others stand by"
        holder, valid, role, may_end = row
        state = "leads" if valid else "held the lease, expired"
        if not may_end:
            raise Unmet(
                f"relay {holder} {state} as role {role}, whose connections {self.user} may not "
                "end: it could not take over if that relay hung. Run every relay of a slot as "
                f"one role, or GRANT pg_signal_backend TO {self.user}"
            )
        who = f" as role {role}" if role else ""
        return f"relay {holder} {state}{who}; {self.user} may take over from it"

    def messages(self) -> str:
        """Table-less messages: off, or on with only roles the operator chose able to write one.
        Any role that may execute ``pg_logical_emit_message`` can publish an event, and PostgreSQL
        lets PUBLIC; so may anyone allowed to call a SECURITY DEFINER ``outbox_emit``."""
        if not self.settings.messages:
            emit = self.emit_functions()
            if emit:
                return (
                    f"off; function {', '.join(emit)} exists, but what it writes is not relayed: "
                    "set CDC_RELAY_MESSAGES=true if writers use it (or drop it)"
                )
            return "off (CDC_RELAY_MESSAGES): table-less messages are not relayed"
        rows = self.conn.execute(
            sql.SQL(
                "SELECT p.oid::regprocedure::text FROM pg_proc p WHERE ({}) "
                "AND has_function_privilege('public', p.oid, 'EXECUTE') ORDER BY 1"
            ).format(_EMITTERS)
        ).fetchall()
        if rows:
            public = [str(r[0]) for r in rows]
            revokes = " ".join(f"REVOKE EXECUTE ON FUNCTION {f} FROM PUBLIC;" for f in public)
            raise Unmet(
                f"CDC_RELAY_MESSAGES is on and PUBLIC may execute {', '.join(public)}: any role "
                "could publish an event. Run python -m cdc_relay setup as a superuser "
                f"(sql/{EMIT_SQL}), or as a superuser: {revokes} Then grant writers "
                f"EXECUTE on outbox_emit only"
            )
        roles = [
            str(r[0])
            for r in self.conn.execute(
                sql.SQL(
                    "SELECT DISTINCT r.rolname FROM pg_roles r, pg_proc p WHERE NOT r.rolsuper "
                    "AND r.rolname !~ '^pg_' AND ({}) "
                    "AND has_function_privilege(r.oid, p.oid, 'EXECUTE') ORDER BY 1"
                ).format(_EMITTERS)
            ).fetchall()
        ]
        shown = ", ".join(roles[:MAX_ROLES_SHOWN]) or "none"
        if len(roles) > MAX_ROLES_SHOWN:
            shown += f" and {len(roles) - MAX_ROLES_SHOWN} more"
        prefix = self.settings.message_prefix
        return f"on, prefix {prefix!r}; roles that may emit besides superusers: {shown}"

    def emit_functions(self) -> list[str]:
        rows = self.conn.execute(
            "SELECT oid::regprocedure::text FROM pg_proc WHERE proname = 'outbox_emit' ORDER BY 1"
        ).fetchall()
        return [str(r[0]) for r in rows]

    def _recorded(self) -> int | None:
        try:
            return self._store().load()
        except (psycopg.errors.UndefinedTable, psycopg.errors.InsufficientPrivilege):
            return None  # reported by the state table check

    def _record_problem(self, slot_confirmed: int) -> str | None:
        """Why the position record cannot be this server's (cdc_relay.record_origin), if so."""
        try:
            record = self._store().load_record()
        except (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn):
            return None  # reported by the state table check
        except SourceSetupError as exc:
            return str(exc)
        if record.stamp is None:
            return None
        url = self.settings.source_url()

        def history(timeline: int) -> list[tuple[int, int]]:
            try:
                return history_switches(timeline_history(url, timeline))
            except RelayError:
                return []  # unreadable: the stamp's timeline counts as not in it

        reason = problem(record.stamp, record.server, history)
        if reason is None:
            return None
        settings = self.settings
        return refusal(reason, settings.state_schema, settings.slot_name, slot_confirmed)

    def publication(self) -> str:
        name = self.settings.publication_name
        wanted = [t.table for t in self.tables]
        create = create_publication_statement(
            name, self.tables, self.conn, row_filters_supported(self.conn)
        )
        row = self.conn.execute(
            "SELECT puballtables, pubinsert, pubupdate, pubdelete, pubtruncate, "
            "pg_get_userbyid(pubowner) FROM pg_publication WHERE pubname = %s",
            (name,),
        ).fetchone()
        if row is None:
            if self._may_create_publication():
                raise Unmet(
                    f"{name} does not exist: run python -m cdc_relay setup (the relay also "
                    f"creates it when it starts), or as the tables' owner: {create}"
                )
            raise Unmet(
                f"{name} does not exist, and {self.user} may not create it (that needs CREATE "
                f"on the database and ownership of the tables): as the tables' owner run {create}"
            )
        *flags, owner = row
        all_tables, insert, update, delete, truncate = (bool(v) for v in flags)
        if all_tables:
            raise Unmet(
                f"{name} publishes ALL TABLES (Debezium's default), so every write of the "
                "database is decoded and sent to the relay, which drops all but the outbox "
                f"inserts: replace it in one transaction (no gap for the slot): BEGIN; DROP "
                f"PUBLICATION {name}; {create} COMMIT;"
            )
        filtered = ""
        if any(t.row_filter for t in self.tables):
            filtered = (
                ", rows filtered in the publication and by the relay"
                if row_filters_supported(self.conn)
                else ", rows filtered by the relay (this server has no publication row filters)"
            )
        published = self._published_tables(name)
        problems = self._coverage(name, published, insert)
        extra = sorted(published - set(wanted))
        if extra:
            problems.append(
                f"it also publishes {', '.join(extra)}: run ALTER PUBLICATION {name} DROP TABLE "
                f"{', '.join(extra)}"
            )
        others = [
            a for a, on in (("update", update), ("delete", delete), ("truncate", truncate)) if on
        ]
        if others:
            problems.append(
                f"it publishes {', '.join(others)}; the relay needs inserts only (the sweeper's "
                f"deletes must not stream): run ALTER PUBLICATION {name} SET (publish = 'insert')"
            )
        mismatch = find_mismatch(self.conn, name, self.tables)
        if mismatch is not None:
            who = "the relay sets them when it starts" if mismatch.owned else "as its owner"
            problems.append(
                f"its row filters differ from the settings ({mismatch.describe()}): {who} run "
                f"{mismatch.fix(self.conn)}"
            )
        if problems:
            raise Unmet(f"{name}: " + "; ".join(problems))
        return f"{name} (owner {owner}) publishes inserts of {', '.join(wanted)} only{filtered}"

    def publication_covers(self) -> str:
        """The publication, if it exists, streams the inserts of every outbox table — what the
        relay's start requires (it creates a missing one; ``check`` asks for more)."""
        name = self.settings.publication_name
        insert = scalar(self.conn, "SELECT pubinsert FROM pg_publication WHERE pubname = %s", name)
        if insert is None:
            return f"{name} does not exist yet"
        problems = self._coverage(name, self._published_tables(name), bool(insert))
        if problems:
            raise Unmet(f"{name}: " + "; ".join(problems))
        return f"{name} publishes the inserts of every outbox table"

    def _published_tables(self, name: str) -> set[str]:
        rows = self.conn.execute(
            "SELECT schemaname || '.' || tablename FROM pg_publication_tables WHERE pubname = %s",
            (name,),
        ).fetchall()
        return {str(r[0]) for r in rows}

    def _coverage(self, name: str, published: set[str], insert: bool) -> list[str]:
        problems: list[str] = []
        missing = [t.table for t in self.tables if t.table not in published]
        if missing:
            problems.append(
                f"it lacks {', '.join(missing)}: run ALTER PUBLICATION {name} ADD TABLE "
                f"{', '.join(missing)}"
            )
        if not insert:
            problems.append(
                "it does not publish inserts, which the relay streams: run ALTER PUBLICATION "
                f"{name} SET (publish = 'insert')"
            )
        return problems

    def _may_create_publication(self) -> bool:
        if not scalar(self.conn, "SELECT has_database_privilege(current_database(), 'CREATE')"):
            return False
        for table in self.tables:
            oid = relation_oid(self.conn, table)
            owned = oid is not None and scalar(
                self.conn,
                "SELECT pg_has_role(relowner, 'USAGE') FROM pg_class WHERE oid = %s",
                oid,
            )
            if not owned:
                return False
        return True

    def slot(self) -> str:
        """The slot as ``check`` judges it: usable by this relay, healthy, where the record is."""
        settings = self.settings
        name = settings.slot_name
        slot = self._slot()
        recorded = self._recorded()
        if slot is None:
            warning = check_missing_slot(name, recorded, settings.allow_slot_reset)
            created = (
                f"{name} does not exist yet: setup or the relay's first start creates it "
                "(events are relayed from then on)"
            )
            return f"{created}; {warning}" if warning else created
        problems: list[str] = []
        leader = self._streaming_leader(slot)  # a standby design: the leader streams, fine
        for probe in (self.slot_kind,) if leader else (self.slot_kind, self.slot_free):
            try:
                probe(slot)
            except Unmet as exc:
                problems.append(exc.fix)
        if slot.wal_status == "lost":
            problems.append(
                f"{name} has lost WAL it needed (wal_status 'lost', see max_slot_wal_keep_size): "
                "it can no longer stream, and events in the lost WAL were not relayed. Drop it; "
                "then start the relay once with CDC_RELAY_ALLOW_SLOT_RESET=true and re-publish "
                "what is missing"
            )
        confirmed = slot.confirmed_flush or 0
        origin = self._record_problem(confirmed)
        if origin is not None:
            problems.append(origin)
        promoted = promotion_note(self.conn, settings, slot, recorded)
        try:
            _, warning = resolve_start(
                name, confirmed, recorded, settings.allow_slot_reset, promoted
            )
        except PositionMismatch as exc:
            problems.append(str(exc))
            warning = None
        if problems:
            raise Unmet("; ".join(problems))
        retained = _size(slot.retained_wal) if slot.retained_wal is not None else "unknown"
        detail = (
            f"{name} ({slot.plugin}) {leader or 'idle'}, confirmed {format_lsn(confirmed)}, "
            f"retained WAL {retained}, wal_status {slot.wal_status}"
        )
        if slot.wal_status == "unreserved":
            detail += " (beyond max_wal_size: at risk of being lost; is the relay running?)"
        if warning:
            detail += f"; {warning}"
        return detail

    def _streaming_leader(self, slot: SlotState) -> str | None:
        """Who streams the slot, when that is the leading relay: its walsender is the one its
        valid lease names. None when the slot is idle or held by anything else."""
        if slot.active_pid is None:
            return None
        lease = sql.Identifier(self.settings.state_schema, LEASE_TABLE)
        try:
            row = self.conn.execute(
                sql.SQL(
                    "SELECT l.holder, a.backend_start, l.expires_at FROM {} l "
                    "LEFT JOIN pg_stat_activity a ON a.pid = l.stream_pid "
                    "WHERE l.slot_name = %s AND l.stream_pid = %s AND l.expires_at > now()"
                ).format(lease),
                (self.settings.slot_name, slot.active_pid),
            ).fetchone()
        except (psycopg.errors.UndefinedTable, psycopg.errors.InsufficientPrivilege):
            return None
        if row is None:
            return None
        holder, since, expires = row
        return (
            f"streamed by the leading relay {holder} (walsender {slot.active_pid}, streaming "
            f"since {since or 'unknown'}; lease valid until {expires})"
        )

    def failover(self) -> str:
        """Whether the slot follows a promotion (PostgreSQL 17+), and whether standbys are held
        back until they have what the relay reads (``synchronized_standby_slots``)."""
        try:
            return describe(self.conn, self.settings, self._slot())
        except SourceSetupError as exc:
            raise Unmet(str(exc)) from None

    def slot_kind(self, slot: SlotState) -> str:
        """A logical slot for the configured plugin, in this database."""
        wanted = self.settings.plugin.value
        here = str(scalar(self.conn, "SELECT current_database()"))
        if slot.kind != "logical" or slot.plugin != wanted or slot.database != here:
            raise Unmet(
                f"{slot.name} is a {slot.kind} slot for plugin {slot.plugin!r} in database "
                f"{slot.database!r}, but this relay needs a logical {wanted!r} slot in {here!r} "
                "(CDC_RELAY_PLUGIN): drop it (after stopping whatever uses it) or choose another "
                "CDC_RELAY_SLOT_NAME"
            )
        return f"logical {wanted} slot in {here}"

    def slot_free(self, slot: SlotState) -> str:
        """No other process streams from the slot (SlotInUse: that may end, so it is retried)."""
        if slot.active_pid is not None:
            raise Unmet(self._holder(slot.name, slot.active_pid), SlotInUse)
        return "idle"

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
        url = self.settings.source_url()
        with connect(url) as probe:
            probe.execute(sql.SQL("SET statement_timeout = {}").format(sql.Literal(PROBE_TIMEOUT)))
            try:
                probe.execute(
                    "SELECT pg_create_logical_replication_slot(%s, 'wal2json', true)",
                    (probe_name,),
                )
            except psycopg.errors.UndefinedFile:
                major = int(str(scalar(self.conn, "SHOW server_version_num"))) // 10000
                raise Unmet(plugin_missing(Plugin.WAL2JSON.value, major)) from None
            except psycopg.errors.QueryCanceled:
                # The plugin loaded; creating the slot then waits for running transactions.
                return "installed (the probe slot was still waiting for a long transaction)"
            except psycopg.Error as exc:
                slot = self._slot()
                if slot is not None and slot.plugin == Plugin.WAL2JSON.value:
                    return f"slot {self.settings.slot_name} uses it"
                raise Unmet(
                    f"cannot tell whether wal2json is installed: creating a probe slot failed: "
                    f"{exc.diag.message_primary or exc}"
                ) from None
            probe.execute("SELECT pg_drop_replication_slot(%s)", (probe_name,))
        return "installed"


def _size(value: int) -> str:
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"
