"""The checks the relay's start and ``check`` share, driven by a fake database.

:class:`FakeDatabase` stands in for the one thing the checks use of a psycopg connection:
``execute(query, params)`` with ``fetchone``/``fetchall``, and ``info.server_version``. Each test
scripts the catalog's answers by a fragment of the query's text; a query nobody scripted fails
the test, so every test also says which queries a check asks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import psycopg
import pytest
from psycopg import sql

from cdc_relay.config import Settings
from cdc_relay.errors import SlotInUse, SourceSetupError
from cdc_relay.prerequisites import (
    CheckResult,
    Prerequisites,
    Unmet,
    outcome,
    require,
    require_usable_slot,
)
from cdc_relay.replication.source import Connection, SlotState

Row = tuple[object, ...]
Answers = Mapping[str, Any]  # a fragment of a query's text -> its rows


class _Rows:
    def __init__(self, rows: Sequence[Row]) -> None:
        self._rows = list(rows)

    def fetchone(self) -> Row | None:
        return self._rows[0] if self._rows else None

    def fetchall(self) -> list[Row]:
        return self._rows


@dataclass
class _Info:
    server_version: int


@dataclass
class FakeDatabase:
    """Answers each query with the rows of the first scripted fragment its text contains."""

    answers: Answers
    info: _Info = field(default_factory=lambda: _Info(150000))
    asked: list[str] = field(default_factory=list)
    # What psycopg.sql's as_string() asks of a context: no connection, the default adapters.
    connection: None = None
    adapters: Any = psycopg.adapters

    def execute(self, query: Any, params: Sequence[object] | None = None) -> _Rows:
        text = query.as_string(None) if isinstance(query, sql.Composable) else query
        text = text.decode() if isinstance(text, bytes) else text
        self.asked.append(text)
        for fragment, rows in self.answers.items():
            if fragment in text:
                if isinstance(rows, Exception):
                    raise rows
                return _Rows(rows)
        raise AssertionError(f"unscripted query: {text}")

    def transaction(self) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()


ROLE_QUERY = "r.rolsuper, r.rolreplication, "


def first_row(
    version: int = 150004,
    wal_level: str = "logical",
    superuser: bool = False,
    replication: bool = True,
    rds_replication: bool = False,
) -> dict[str, Any]:
    return {
        ROLE_QUERY: [
            ("relay", str(version), "15.4 (Debian)", wal_level, superuser, replication,
             rds_replication)
        ]
    }  # fmt: skip


def settings(**values: object) -> Settings:
    base: dict[str, object] = {
        "database_url": "postgresql://relay@db.example/app",
        "kafka_bootstrap_servers": "kafka:9092",
        "publication_name": "outbox_pub",
        "outbox_table": "public.outbox",
        "slot_name": "cdc_relay",
    }
    base.update(values)
    return Settings.model_validate(base)


# The partitioned outbox tables and whether the publication publishes them as their root.
PARTITIONED = "pubviaroot FROM pg_publication"


def checks(answers: Answers, **values: object) -> Prerequisites:
    database = FakeDatabase({**first_row(), PARTITIONED: [], **answers})
    return Prerequisites(cast(Connection, database), settings(**values))


def unmet(probe: Any, *args: object) -> Unmet:
    with pytest.raises(Unmet) as caught:
        probe(*args)
    return caught.value


# -- server and role --------------------------------------------------------------------------


def test_server_version_passes_from_14_and_names_the_version() -> None:
    assert checks({}).server.server_version() == "PostgreSQL 15.4"


def test_server_version_fails_before_14() -> None:
    database = FakeDatabase(first_row(version=130011))
    prerequisites = Prerequisites(cast(Connection, database), settings())
    assert (
        "is too old: cdc-relay needs 14 or newer" in unmet(prerequisites.server.server_version).fix
    )


def test_wal_level_passes_when_logical_and_fails_with_the_statement_that_fixes_it() -> None:
    assert checks({}).server.wal_level() == "logical"
    database = FakeDatabase(first_row(wal_level="replica"))
    failed = unmet(Prerequisites(cast(Connection, database), settings()).server.wal_level)
    assert failed.fix == (
        "wal_level is 'replica', logical decoding needs 'logical': run ALTER SYSTEM SET "
        "wal_level = logical; then restart PostgreSQL"
    )


def test_replication_role_passes_for_replication_or_superuser_and_fails_with_alter_role() -> None:
    assert checks({}).server.replication_role() == "REPLICATION"
    database = FakeDatabase(first_row(superuser=True, replication=False))
    assert Prerequisites(cast(Connection, database), settings()).server.replication_role() == (
        "superuser"
    )
    database = FakeDatabase(first_row(replication=False))
    failed = unmet(Prerequisites(cast(Connection, database), settings()).server.replication_role)
    assert failed.fix == (
        "role relay may not stream the WAL: run ALTER ROLE relay WITH REPLICATION (on Amazon RDS "
        "and Aurora: GRANT rds_replication TO relay)"
    )


def test_replication_role_passes_for_a_member_of_rds_replication() -> None:
    """RDS and Aurora stream for members of rds_replication, rolreplication false."""
    database = FakeDatabase(first_row(replication=False, rds_replication=True))
    server = Prerequisites(cast(Connection, database), settings()).server
    assert server.replication_role() == "rds_replication"


PLUGIN_SETTING = "SELECT current_setting(%s, true)"


def test_output_plugin_says_nothing_where_the_server_restricts_no_plugin() -> None:
    assert checks({PLUGIN_SETTING: [(None,)]}).server.output_plugin() is None


def test_output_plugin_where_the_role_may_not_read_the_setting_says_what_must_hold() -> None:
    refused = psycopg.errors.InsufficientPrivilege(
        'permission denied to examine "output_plugin_libraries"'
    )
    assert checks({PLUGIN_SETTING: refused}).server.output_plugin() == (
        "pgoutput; this role may not read output_plugin_libraries (superusers and "
        "pg_read_all_settings may): the server must list pgoutput there if it restricts output "
        "plugins"
    )


def test_output_plugin_passes_when_listed_and_fails_with_the_statement_that_lists_it() -> None:
    listed = {PLUGIN_SETTING: [("pgoutput, test_decoding",)]}
    assert checks(listed).server.output_plugin() == (
        "pgoutput, which output_plugin_libraries lists"
    )
    failed = unmet(checks(listed, plugin="wal2json").server.output_plugin)
    assert failed.fix == (
        "the server lets no role decode through wal2json: output_plugin_libraries is "
        "'pgoutput, test_decoding'; as a superuser: ALTER SYSTEM SET output_plugin_libraries = "
        "'pgoutput', 'test_decoding', 'wal2json'; SELECT pg_reload_conf() (or use "
        "CDC_RELAY_PLUGIN=pgoutput)"
    )
    # A quoted name is one name, whatever it holds: "pgoutput, x" is not pgoutput.
    quoted = {PLUGIN_SETTING: [('"pgoutput, x", test_decoding',)]}
    failed = unmet(checks(quoted).server.output_plugin)
    assert (
        "ALTER SYSTEM SET output_plugin_libraries = 'pgoutput, x', 'test_decoding', 'pgoutput';"
    ) in failed.fix


def test_a_dropped_role_stops_before_any_check() -> None:
    database = FakeDatabase({ROLE_QUERY: []})
    with pytest.raises(SourceSetupError, match="role does not exist"):
        Prerequisites(cast(Connection, database), settings())


SLOT_QUERY = "FROM pg_replication_slots WHERE slot_name"


def test_replication_slots_pass_with_one_free_and_fail_when_all_are_used() -> None:
    free = {
        "SHOW max_replication_slots": [("10",)],
        "SELECT count(*) FROM pg_replication_slots": [("3",)],
        SLOT_QUERY: [],
    }
    assert checks(free).server.replication_slots() == "3 of 10 in use, 7 free for cdc_relay"
    full = {**free, "SELECT count(*) FROM pg_replication_slots": [("10",)]}
    failed = unmet(checks(full).server.replication_slots)
    assert failed.fix.startswith("all 10 in use (max_replication_slots) and cdc_relay does not")
    assert "SELECT pg_drop_replication_slot('<name>')" in failed.fix


def test_wal_senders_pass_with_one_free_and_fail_when_all_are_used() -> None:
    answers = {
        "SHOW max_wal_senders": [("4",)],
        "backend_type = 'walsender'": [("1",)],
        SLOT_QUERY: [],
    }
    assert checks(answers).server.wal_senders() == "1 of 4 in use"
    failed = unmet(checks({**answers, "backend_type = 'walsender'": [("4",)]}).server.wal_senders)
    assert failed.fix.startswith("all 4 in use (max_wal_senders): raise max_wal_senders")


PRIVILEGES = {
    "FROM pg_class c JOIN pg_namespace n": [(16400,)],
    "has_schema_privilege": [(True,)],
    "has_table_privilege": [(True,)],
}


def test_privileges_pass_with_the_sweepers_grants_and_name_what_is_missing() -> None:
    assert (
        checks(PRIVILEGES).server.privileges()
        == "relay: REPLICATION; SELECT, DELETE on public.outbox"
    )
    lacking = {**PRIVILEGES, "has_table_privilege": [(False,)]}
    failed = unmet(checks(lacking).server.privileges)
    assert failed.fix == (
        "run GRANT SELECT, DELETE ON public.outbox TO relay "
        "(DELETE: for the sweeper; or CDC_RELAY_SWEEP_INTERVAL=0)"
    )
    no_usage = {**PRIVILEGES, "has_schema_privilege": [(False,)]}
    assert (
        unmet(checks(no_usage).server.privileges).fix == "run GRANT USAGE ON SCHEMA public TO relay"
    )


# -- tables -----------------------------------------------------------------------------------

TABLE_OID = {
    "FROM pg_class c JOIN pg_namespace n": [(16400,)],
    "SELECT relkind::text FROM pg_class": [("r",)],
}
ALL_COLUMNS = [
    (name,) for name in ("id", "aggregate_type", "aggregate_id", "event_type", "payload", "headers")
]


def test_table_columns_pass_with_every_mapped_column() -> None:
    answers = {**TABLE_OID, "SELECT attname FROM pg_attribute": ALL_COLUMNS}
    prerequisites = checks(answers, sweep_interval=0)
    assert (
        prerequisites.outbox.table_columns(prerequisites.tables[0]) == "all mapped columns present"
    )


def test_table_columns_fail_for_a_missing_table_and_say_how_to_create_it() -> None:
    answers: Answers = {"FROM pg_class c JOIN pg_namespace n": [], "lower(n.nspname)": []}
    prerequisites = checks(answers, sweep_interval=0)
    failed = unmet(prerequisites.outbox.table_columns, prerequisites.tables[0])
    assert failed.fix == (
        "does not exist: create it (sql/001_outbox.sql, or python -m cdc_relay setup "
        "--create-outbox), or point CDC_RELAY_OUTBOX_TABLE / CDC_RELAY_OUTBOX_TABLES at your table"
    )


def test_table_columns_fail_for_missing_columns_and_say_how_to_map_them() -> None:
    answers = {**TABLE_OID, "SELECT attname FROM pg_attribute": ALL_COLUMNS[:3]}
    prerequisites = checks(answers, sweep_interval=0)
    failed = unmet(prerequisites.outbox.table_columns, prerequisites.tables[0])
    assert failed.fix == (
        "lacks column(s) event_type, payload: add them, or map the names with "
        "CDC_RELAY_OUTBOX_COLUMNS"
    )


def test_table_check_refuses_a_payload_of_another_type() -> None:
    types = [
        ("id", "uuid"),
        ("aggregate_type", "text"),
        ("aggregate_id", "text"),
        ("event_type", "text"),
        ("payload", "integer"),
        ("headers", "jsonb"),
    ]
    answers = {
        **TABLE_OID,
        "SELECT attname FROM pg_attribute": ALL_COLUMNS,
        "format_type(atttypid, NULL)": types,
    }
    prerequisites = checks(answers, sweep_interval=0, sweep_retention_seconds=0)
    failed = unmet(prerequisites.outbox.table, prerequisites.tables[0])
    assert failed.fix == (
        "column payload is integer; expected one of bytea, character varying, json, jsonb, text"
    )
    types[4] = ("payload", "jsonb")
    assert prerequisites.outbox.table(prerequisites.tables[0]) == (
        "id uuid, payload jsonb, all 5 required columns present"
    )


# -- publication ------------------------------------------------------------------------------

PUBLICATION_ROW = "pg_get_userbyid(pubowner) FROM pg_publication"
PUBLISHED = "FROM pg_publication_tables WHERE pubname"
ROW_FILTERS = "t.rowfilter"
COLUMN_LISTS = "attnames::text[]"
EVERY_COLUMN = [
    "id", "aggregate_type", "aggregate_id", "event_type", "payload", "headers", "created_at"
]  # fmt: skip


def test_publication_passes_when_it_publishes_exactly_the_outbox_inserts() -> None:
    answers = {
        PUBLICATION_ROW: [(False, True, False, False, False, "app")],
        PUBLISHED: [("public.outbox",)],
        ROW_FILTERS: [("public.outbox", None, True, False)],
        COLUMN_LISTS: [("public.outbox", EVERY_COLUMN)],
    }
    assert checks(answers).publication.publication() == (
        "outbox_pub (owner app) publishes inserts of public.outbox only"
    )


def test_publication_fails_for_all_tables_with_the_replacement_in_one_transaction() -> None:
    answers = {PUBLICATION_ROW: [(True, True, True, True, True, "app")]}
    failed = unmet(checks(answers).publication.publication)
    assert failed.fix.startswith("outbox_pub publishes ALL TABLES (Debezium's default)")
    assert failed.fix.endswith(
        'BEGIN; DROP PUBLICATION outbox_pub; CREATE PUBLICATION "outbox_pub" FOR TABLE '
        '"public"."outbox" WITH (publish = \'insert\', publish_via_partition_root = true); '
        "COMMIT;"
    )


def test_publication_fails_for_extra_tables_and_actions_with_each_fix() -> None:
    answers = {
        PUBLICATION_ROW: [(False, True, False, True, False, "app")],
        PUBLISHED: [("public.outbox",), ("public.orders",)],
        ROW_FILTERS: [("public.outbox", None, True, False), ("public.orders", None, True, False)],
        COLUMN_LISTS: [("public.outbox", EVERY_COLUMN), ("public.orders", ["id"])],
    }
    failed = unmet(checks(answers).publication.publication)
    assert failed.fix == (
        "outbox_pub: it also publishes public.orders: run ALTER PUBLICATION outbox_pub DROP "
        "TABLE public.orders; it publishes delete; the relay needs inserts only (the sweeper's "
        "deletes must not stream): run ALTER PUBLICATION outbox_pub SET (publish = 'insert')"
    )


def test_a_missing_publication_says_who_may_create_it() -> None:
    may_not = {PUBLICATION_ROW: [], "has_database_privilege": [(False,)]}
    failed = unmet(checks(may_not).publication.publication)
    assert failed.fix.startswith(
        "outbox_pub does not exist, and relay may not create it (that needs CREATE on the "
        "database and ownership of the tables): as the tables' owner run CREATE PUBLICATION"
    )
    may = {
        PUBLICATION_ROW: [],
        "has_database_privilege": [(True,)],
        **TABLE_OID,
        "pg_has_role(relowner, 'USAGE')": [(True,)],
    }
    assert unmet(checks(may).publication.publication).fix.startswith(
        "outbox_pub does not exist: run python -m cdc_relay setup"
    )


def test_publication_covers_passes_for_none_yet_and_fails_for_a_table_it_lacks() -> None:
    absent: Answers = {"SELECT pubinsert FROM pg_publication": []}
    assert checks(absent).publication.publication_covers() == "outbox_pub does not exist yet"
    lacking = {
        "SELECT pubinsert FROM pg_publication": [(True,)],
        PUBLISHED: [],
        COLUMN_LISTS: [],
    }
    assert unmet(checks(lacking).publication.publication_covers).fix == (
        "outbox_pub: it lacks public.outbox: run ALTER PUBLICATION outbox_pub ADD TABLE "
        "public.outbox"
    )
    covered = {
        "SELECT pubinsert FROM pg_publication": [(True,)],
        PUBLISHED: [("public.outbox",)],
        COLUMN_LISTS: [("public.outbox", EVERY_COLUMN)],
    }
    assert checks(covered).publication.publication_covers() == (
        "outbox_pub publishes the inserts of every outbox table"
    )


def test_a_column_list_without_a_column_the_relay_reads_fails_naming_the_fix() -> None:
    """Rows would arrive without the column, to be dead-lettered: the relay does not start."""
    answers = {
        "SELECT pubinsert FROM pg_publication": [(True,)],
        PUBLISHED: [("public.outbox",)],
        COLUMN_LISTS: [("public.outbox", ["id", "aggregate_type", "event_type", "created_at"])],
    }
    filtered = checks(answers, outbox_row_filter="event_type = 'x'")
    assert unmet(filtered.publication.publication_covers).fix == (
        "outbox_pub: its column list for public.outbox lacks aggregate_id, payload, which the "
        'relay reads: publish every column again: run ALTER PUBLICATION "outbox_pub" DROP '
        'TABLE "public"."outbox"; ALTER PUBLICATION "outbox_pub" ADD TABLE "public"."outbox" '
        "WHERE ((\"event_type\" = 'x'))"
    )


def test_a_view_under_the_outbox_tables_name_is_not_the_outbox() -> None:
    """A renamed outbox whose old name a view keeps: the relay streams tables only."""
    answers = {
        "FROM pg_class c JOIN pg_namespace n": [(16400,)],
        "SELECT relkind::text FROM pg_class": [("v",)],
    }
    prerequisites = checks(answers, sweep_interval=0)
    failed = unmet(prerequisites.outbox.table_columns, prerequisites.tables[0])
    assert failed.fix.startswith("is a view, not a table: the relay streams a table's inserts")


# -- slot -------------------------------------------------------------------------------------


def slot(**values: Any) -> SlotState:
    base: dict[str, Any] = {
        "name": "cdc_relay",
        "kind": "logical",
        "plugin": "pgoutput",
        "database": "app",
        "active_pid": None,
        "confirmed_flush": 0x1000,
        "wal_status": "reserved",
        "retained_wal": 2048,
    }
    base.update(values)
    return SlotState(**base)


def test_slot_kind_passes_for_a_logical_slot_of_the_plugin_and_fails_otherwise() -> None:
    answers = {"SELECT current_database()": [("app",)]}
    assert checks(answers).slot.slot_kind(slot()) == "logical pgoutput slot in app"
    failed = unmet(checks(answers).slot.slot_kind, slot(plugin="wal2json"))
    assert failed.fix.startswith(
        "cdc_relay is a logical slot for plugin 'wal2json' in database 'app', but this relay "
        "needs a logical 'pgoutput' slot in 'app'"
    )


def test_slot_free_passes_when_idle_and_names_the_holder_as_slot_in_use() -> None:
    answers = {"FROM pg_stat_activity WHERE pid": [("pg_recvlogical", "10.0.0.7", "relay")]}
    assert checks(answers).slot.slot_free(slot()) == "idle"
    failed = unmet(checks(answers).slot.slot_free, slot(active_pid=4242))
    assert failed.error is SlotInUse
    assert failed.fix.startswith(
        "cdc_relay is in use by process 4242 (application_name 'pg_recvlogical', user relay from "
        "10.0.0.7): another relay or replication client is streaming from it"
    )


def test_require_usable_slot_raises_the_checks_error() -> None:
    database = FakeDatabase(
        {
            **first_row(),
            "SELECT current_database()": [("app",)],
            "FROM pg_stat_activity WHERE pid": [],
        }
    )
    with pytest.raises(SlotInUse, match=r"^slot: cdc_relay is in use by process 7"):
        require_usable_slot(cast(Connection, database), settings(), slot(active_pid=7))


# -- messages ---------------------------------------------------------------------------------

EMIT_FUNCTIONS = "WHERE proname = 'outbox_emit'"
PUBLIC_EMITTERS = "has_function_privilege('public'"
EMITTING_ROLES = "SELECT DISTINCT r.rolname"


def test_messages_off_says_so_and_warns_about_an_unrelayed_outbox_emit() -> None:
    assert checks({EMIT_FUNCTIONS: []}).messages.messages() == (
        "off (CDC_RELAY_MESSAGES): table-less messages are not relayed"
    )
    assert (
        checks({EMIT_FUNCTIONS: [("outbox_emit(text)",)]})
        .messages.messages()
        .startswith("off; function outbox_emit(text) exists, but what it writes is not relayed")
    )


def test_messages_on_fails_while_public_may_emit_with_the_revokes() -> None:
    answers = {PUBLIC_EMITTERS: [("pg_logical_emit_message(boolean,text,text)",)]}
    failed = unmet(checks(answers, messages=True).messages.messages)
    assert "PUBLIC may execute pg_logical_emit_message(boolean,text,text)" in failed.fix
    assert (
        "REVOKE EXECUTE ON FUNCTION pg_logical_emit_message(boolean,text,text) FROM PUBLIC;"
        in failed.fix
    )


def test_messages_on_passes_and_lists_the_roles_that_may_emit() -> None:
    roles = [(f"writer{i:02}",) for i in range(12)]
    answers = {PUBLIC_EMITTERS: [], EMITTING_ROLES: roles}
    assert checks(answers, messages=True).messages.messages() == (
        "on, prefix 'outbox'; roles that may emit besides superusers: "
        + ", ".join(f"writer{i:02}" for i in range(10))
        + " and 2 more"
    )


# -- the relay's start and check's report -----------------------------------------------------


def test_require_stops_at_the_first_unmet_prerequisite_with_its_name() -> None:
    database = FakeDatabase({**first_row(wal_level="replica"), EMIT_FUNCTIONS: []})
    with pytest.raises(SourceSetupError, match=r"^wal_level: wal_level is 'replica'"):
        require(cast(Connection, database), settings())
    assert len(database.asked) == 1  # the first row only: nothing after the unmet one


def test_require_passes_on_a_ready_database() -> None:
    database = FakeDatabase(
        {
            **first_row(),
            **TABLE_OID,
            "SELECT attname FROM pg_attribute": ALL_COLUMNS,
            "SELECT pubinsert FROM pg_publication": [],
            EMIT_FUNCTIONS: [],
            PLUGIN_SETTING: [(None,)],
        }
    )
    require(cast(Connection, database), settings(sweep_interval=0))


def test_report_names_every_check_in_the_order_check_prints_them() -> None:
    names = [name for name, _ in checks({}).report()]
    assert names == [
        "server version",
        "wal_level",
        "replication slots",
        "wal senders",
        "privileges",
        "output plugin",
        "table public.outbox",
        "state table",
        "publication",
        "slot",
        "messages",
        "leadership",
        "waits",
        "failover",
        "wal2json",
    ]


def test_outcome_turns_a_check_into_a_line_or_nothing() -> None:
    def failing() -> str:
        raise Unmet("do this")

    assert str(outcome("x", lambda: "found")) == "ok   x: found"
    assert outcome("x", failing) == CheckResult("x", False, "do this")
    assert outcome("x", lambda: None) is None


# -- state tables and leadership --------------------------------------------------------------

LOCK_HOLDER = "FROM pg_locks k"
LEASE = "l.expires_at > now(), r.rolname"


def test_leadership_passes_when_this_role_may_take_over_from_the_leader() -> None:
    answers = {LOCK_HOLDER: [], LEASE: [("host/1/abc", True, "relay", True)]}
    assert checks(answers).state.leadership() == (
        "relay host/1/abc leads as role relay; relay may take over from it"
    )
    assert checks({LOCK_HOLDER: [], LEASE: []}).state.leadership() == (
        "no relay has led this slot yet; the first to start leads, others stand by"
    )


def test_leadership_fails_when_this_role_could_not_end_a_hung_leader() -> None:
    answers = {LOCK_HOLDER: [], LEASE: [("host/1/abc", False, "admin", False)]}
    assert unmet(checks(answers).state.leadership).fix == (
        "relay host/1/abc held the lease, expired as role admin, whose connections relay may not "
        "end: it could not take over if that relay hung. Run every relay of a slot as one role, "
        "or GRANT pg_signal_backend TO relay"
    )


def test_leadership_fails_while_a_session_that_is_no_relay_holds_the_lock() -> None:
    failed = unmet(checks({LOCK_HOLDER: [(77, "mallory")]}).state.leadership)
    assert failed.fix.startswith(
        "the leader lock is held by a session that is no relay (pid 77, role mallory): no relay "
        "can lead while it holds it; end it: as a superuser, SELECT pg_terminate_backend(77);"
    )


# -- the conditions' columns ------------------------------------------------------------------

COLUMN_TYPES = "format_type(atttypid, NULL)"


def test_a_row_filter_on_a_column_that_is_not_text_fails_with_the_types_it_takes() -> None:
    answers = {
        **TABLE_OID,
        "SELECT attname FROM pg_attribute": ALL_COLUMNS,
        COLUMN_TYPES: [("event_type", "integer")],
    }
    prerequisites = checks(answers, sweep_interval=0, outbox_row_filter="event_type = 'a'")
    assert unmet(prerequisites.outbox.table_columns, prerequisites.tables[0]).fix == (
        "the row filter compares column event_type as text, but it is integer: conditions take "
        "character varying or text columns"
    )
