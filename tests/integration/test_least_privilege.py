"""The documented least-privilege setup, proven: ``sql/001``-``003`` run by the outbox's owner,
``sql/005_relay_role.sql`` by a superuser, then relay, sweeper and ``check`` run as that
non-superuser role — which may not run any DDL — with the publication owned by another role."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import orjson
import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from cdc_relay.ddl import EMIT_SQL, ROLE_SQL, STATE_SQL, packaged_sql
from cdc_relay.replication.source import HEARTBEAT_PREFIX
from tests.conftest import KafkaBroker
from tests.integration.relay_support import (
    OUTBOX_DDL,
    RelayProcess,
    new_event,
    relay_env,
    scalar,
    wait_until,
    write_transactions,
)
from tests.integration.test_admin import cdc_relay, failed, lines_of
from tests.integration.test_partitioned_outbox import (
    PARTITIONED_DDL,
    partitioned_rows,
    write_partitioned,
)
from tests.kafka_helpers import consume_all

pytestmark = pytest.mark.integration

ROLE = "relay"  # as sql/005_relay_role.sql names it
PASSWORD = "relay-test-password"
PUBLICATION_SQL = "003_publication.sql"
PUBLICATION = "cdc_relay_outbox"  # as sql/003_publication.sql names it


def _as_role(url: str, user: str, password: str) -> str:
    params = conninfo_to_dict(url)
    params.update(user=user, password=password)
    return make_conninfo("", **params)


@pytest.fixture
def least_privilege(
    request: pytest.FixtureRequest, database: str, unique: str
) -> Iterator[tuple[str, str]]:
    """The database set up as the README says; yields (the relay role's URL, the owner role).
    Parametrized indirectly, the owner creates the outbox with that DDL instead."""
    outbox_ddl = str(getattr(request, "param", OUTBOX_DDL))
    owner = f"owner_{unique}"
    with psycopg.connect(database, autocommit=True) as conn:
        name = conn.info.dbname
        if scalar(database, "SELECT count(*) FROM pg_roles WHERE rolname = %s", ROLE):
            # Roles are the server's, not the test database's: this one is somebody else's.
            pytest.skip(
                f"the server already has a role named {ROLE}: sql/{ROLE_SQL} would change its "
                "attributes and this test its password; run against a server without it"
            )
        conn.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(owner)))
        # The owner may create schema objects and publications in this database.
        conn.execute(
            sql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(
                sql.Identifier(name), sql.Identifier(owner)
            )
        )
        conn.execute(sql.SQL("GRANT CREATE ON SCHEMA public TO {}").format(sql.Identifier(owner)))
        conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(owner)))
        conn.execute(outbox_ddl.encode())  # our own trusted files, run as an operator would
        conn.execute(packaged_sql(STATE_SQL).encode())
        conn.execute(packaged_sql(PUBLICATION_SQL).encode())
        conn.execute("RESET ROLE")
        conn.execute(packaged_sql(ROLE_SQL).encode())  # as a superuser
        conn.execute(
            sql.SQL("ALTER ROLE {} PASSWORD {}").format(sql.Identifier(ROLE), sql.Literal(PASSWORD))
        )
        attributes = conn.execute(
            "SELECT rolsuper, rolreplication, rolcreatedb, rolcreaterole FROM pg_roles "
            "WHERE rolname = %s",
            (ROLE,),
        ).fetchone()
        assert attributes == (False, True, False, False)
        owners = conn.execute(
            "SELECT (SELECT pg_get_userbyid(pubowner) FROM pg_publication WHERE pubname = %s), "
            "(SELECT pg_get_userbyid(relowner) FROM pg_class "
            "WHERE oid = 'public.outbox'::regclass)",
            (PUBLICATION,),
        ).fetchone()
        assert owners == (owner, owner)
    try:
        yield _as_role(database, ROLE, PASSWORD), owner
    finally:
        with psycopg.connect(database, autocommit=True) as conn:
            # The roles are the server's: take their privileges in this database back, drop them.
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(ROLE)))
            conn.execute(
                sql.SQL("REASSIGN OWNED BY {} TO CURRENT_USER").format(sql.Identifier(owner))
            )
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(owner)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(owner)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(ROLE)))


def test_relay_and_sweeper_run_as_the_documented_role(
    database: str, broker: KafkaBroker, unique: str, least_privilege: tuple[str, str]
) -> None:
    relay_url, _owner = least_privilege
    env = relay_env(
        relay_url,
        broker.bootstrap_servers,
        unique,
        publication_name=PUBLICATION,
        sweep_interval="0.2",
        confirm_interval="0.2",
        idle_confirm_interval="0.3",
        heartbeat_interval="0.2",
    )
    with (
        psycopg.connect(relay_url, autocommit=True) as conn,
        pytest.raises(psycopg.errors.InsufficientPrivilege),
    ):
        conn.execute("CREATE SCHEMA IF NOT EXISTS cdc_relay")  # the role may do no DDL

    result = cdc_relay(env, "check")
    lines = lines_of(result)
    assert not failed(result), result.stdout
    assert result.returncode == 0
    assert "REPLICATION; SELECT, DELETE on public.outbox" in lines["privileges"]
    assert lines["state table"].startswith("ok   state table: cdc_relay.slot_position")
    assert f"(owner owner_{unique})" in lines["publication"]
    assert lines["leadership"].startswith("ok   leadership: no relay has led this slot yet")

    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        events = [new_event("order", f"o-{i % 3}", "created", {"n": i}) for i in range(20)]
        write_transactions(database, [events[:10], events[10:]])  # as the writer, not the relay
        records = consume_all(broker.bootstrap_servers, f"{unique}.order", len(events), 30)
        wait_until(
            lambda: scalar(database, "SELECT count(*) FROM outbox") == 0,
            30,
            "the sweeper, as the relay's role, deleted the published rows",
        )
    finally:
        code = relay.stop()
        relay.close()
    assert code == 0, relay.logs()
    assert sorted(r.header("id") or b"" for r in records) == sorted(e.id.encode() for e in events)
    assert "swept published outbox rows" in relay.logs()
    assert "sweep failed" not in relay.logs()


def test_with_messages_trusted_the_documented_role_keeps_its_heartbeats(
    database: str, broker: KafkaBroker, unique: str, least_privilege: tuple[str, str]
) -> None:
    """sql/004 revokes every overload of pg_logical_emit_message from PUBLIC; the relay's role
    keeps the one its heartbeats call (sql/005 grants it by its signature on this server): the
    heartbeats reach the WAL, and a table-less event is published."""
    relay_url, _owner = least_privilege
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(packaged_sql(EMIT_SQL).encode())  # as a superuser
        public = conn.execute(
            "SELECT count(*) FROM pg_proc WHERE proname = 'pg_logical_emit_message' "
            "AND has_function_privilege('public', oid, 'EXECUTE')"
        ).fetchone()
        assert public == (0,)
        # A slot of the test's own that reads the WAL the heartbeats write (pgoutput sends
        # non-transactional logical messages when asked, whatever the publication).
        conn.execute(
            "SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (f"watch_{unique}",)
        )
    env = relay_env(
        relay_url, broker.bootstrap_servers, unique, publication_name=PUBLICATION,
        messages="true", heartbeat_interval="0.2",
    )  # fmt: skip
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        with psycopg.connect(database, autocommit=True) as conn:
            row = conn.execute("SELECT outbox_emit('order', 'o-1', 'created', '{}')").fetchone()
        records = consume_all(broker.bootstrap_servers, f"{unique}.order", 1, 30)
        time.sleep(1.0)  # a few heartbeats more
        code = relay.stop()
    finally:
        relay.close()
    assert code == 0, relay.logs()
    assert row is not None
    assert [r.header("id") for r in records] == [str(row[0]).encode()]
    assert "heartbeats are off" not in relay.logs()
    with psycopg.connect(database, autocommit=True) as conn:
        changes = conn.execute(
            "SELECT data FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, "
            "'proto_version', '1', 'publication_names', %s, 'messages', 'true')",
            (f"watch_{unique}", PUBLICATION),
        ).fetchall()
    heartbeats = [data for (data,) in changes if HEARTBEAT_PREFIX.encode() in bytes(data)]
    assert len(heartbeats) >= 3, f"{len(heartbeats)} heartbeats in {len(changes)} changes"


def test_check_names_each_missing_grant(
    database: str, broker: KafkaBroker, unique: str, least_privilege: tuple[str, str]
) -> None:
    relay_url, _owner = least_privilege
    env = relay_env(
        relay_url, broker.bootstrap_servers, unique, publication_name=PUBLICATION,
        sweep_interval="5",
    )  # fmt: skip
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("REVOKE DELETE ON public.outbox FROM relay")
        conn.execute("REVOKE UPDATE ON cdc_relay.slot_position FROM relay")
    result = cdc_relay(env, "check")
    failures = failed(result)
    assert result.returncode == 1
    assert (
        "GRANT DELETE ON public.outbox TO relay (DELETE: for the sweeper" in failures["privileges"]
    )
    assert "GRANT UPDATE ON cdc_relay.slot_position TO relay" in failures["state table"]

    # run agrees with check: it refuses to start (exit 3) with the same statement.
    relay = RelayProcess({**env, "CDC_RELAY_SWEEP_INTERVAL": "0"}).start()
    try:
        exit_code = relay.wait(60)
    finally:
        relay.close()
    assert exit_code == 3, relay.logs()
    assert "GRANT UPDATE ON cdc_relay.slot_position TO relay" in relay.logs()


def test_a_standby_of_the_same_role_takes_over_from_a_hung_leader(
    database: str, broker: KafkaBroker, unique: str, least_privilege: tuple[str, str]
) -> None:
    """Taking over ends the hung leader's backends (pg_terminate_backend): allowed between
    backends of the same role, with no grant beyond sql/005_relay_role.sql."""
    relay_url, _owner = least_privilege
    env = relay_env(
        relay_url, broker.bootstrap_servers, unique, publication_name=PUBLICATION,
        leader_lease_timeout="3", leader_renew_interval="0.5", log_level="INFO",
    )  # fmt: skip
    first = RelayProcess(env).start()
    second = RelayProcess(env).start()
    try:
        wait_until(
            lambda: "cdc_relay.relay: streaming" in first.logs() + second.logs(),
            30,
            "one relay to stream",
        )
        leader, standby = (first, second) if "relay: streaming" in first.logs() else (second, first)
        standby.wait_for_log("standby: another relay leads")
        result = cdc_relay(env, "check")
        assert lines_of(result)["leadership"].startswith("ok   leadership: relay "), result.stdout
        assert f"leads as role {ROLE}; {ROLE} may take over from it" in result.stdout
        os.kill(leader.pid, signal.SIGSTOP)
        try:
            standby.wait_for_log("cdc_relay.relay: streaming", 20)
            events = [new_event("order", f"o-{i}", "created", {"n": i}) for i in range(5)]
            write_transactions(database, [events])
            records = consume_all(broker.bootstrap_servers, f"{unique}.order", len(events), 30)
        finally:
            os.kill(leader.pid, signal.SIGCONT)
        leader.wait_for_log("lost the leadership", 15)
        time.sleep(0.5)
    finally:
        codes = [relay.stop() for relay in (first, second)]
        for relay in (first, second):
            relay.close()
    assert codes == [0, 0]
    assert "ending its connections and taking over" in standby.logs()
    assert "cannot end the hung leader's connections" not in standby.logs()
    assert {r.header("id") for r in records} == {e.id.encode() for e in events}


def test_a_publication_the_relay_does_not_own_keeps_its_filter_until_its_owner_fixes_it(
    database: str,
    broker: KafkaBroker,
    unique: str,
    least_privilege: tuple[str, str],
    row_filters_missing: str | None,
) -> None:
    if row_filters_missing:
        pytest.skip(row_filters_missing)
    relay_url, owner = least_privilege
    env = relay_env(
        relay_url, broker.bootstrap_servers, unique, publication_name=PUBLICATION,
        outbox_row_filter="aggregate_type IN ('order', 'invoice')",
    )  # fmt: skip
    result = cdc_relay(env, "check")
    assert result.returncode == 1
    problem = failed(result)["publication"]
    assert "public.outbox is published with no row filter" in problem, problem
    fix = problem.split("as its owner run ", 1)[1]
    assert fix.startswith(f'ALTER PUBLICATION "{PUBLICATION}" DROP TABLE'), fix

    relay = RelayProcess(env).start()
    try:
        exit_code = relay.wait(60)
    finally:
        relay.close()
    assert exit_code == 3, relay.logs()
    assert fix in relay.logs()

    # The statement named is the fix, run as the publication's owner.
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(owner)))
        with conn.transaction():
            conn.execute(fix.encode())
    assert not failed(cdc_relay(env, "check")).get("publication")
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        events = [new_event(kind, "a-1", "created", {"n": i}) for i, kind in
                  enumerate(["order", "shipment", "invoice", "order"])]  # fmt: skip
        write_transactions(database, [events])
        records = consume_all(
            broker.bootstrap_servers, [f"{unique}.order", f"{unique}.invoice"], 3, 30
        )
    finally:
        relay.close()
    relayed = [e.id.encode() for e in events if e.aggregate_type != "shipment"]
    assert sorted(r.header("id") or b"" for r in records) == sorted(relayed)


@pytest.mark.parametrize("least_privilege", [PARTITIONED_DDL], indirect=True)
def test_a_partitioned_outbox_is_relayed_and_swept_as_the_documented_role(
    database: str, broker: KafkaBroker, unique: str, least_privilege: tuple[str, str]
) -> None:
    """Grants on the partitioned outbox only (none on its partitions): the sweeper reads the
    partition tree and each partition's rows through the root, and keeps what it learnt in the
    state table; a table attached with rows of its own keeps them."""
    relay_url, owner = least_privilege
    env = relay_env(
        relay_url, broker.bootstrap_servers, unique, publication_name=PUBLICATION,
        sweep_interval="0.2", confirm_interval="0.2", idle_confirm_interval="0.3",
    )  # fmt: skip
    assert not failed(cdc_relay(env, "check"))
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(owner)))
        conn.execute("CREATE TABLE public.outbox_2024_03 (LIKE public.outbox INCLUDING ALL)")
    prefilled = write_partitioned(database, "03", 3, "prefilled", table="outbox_2024_03")
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        with psycopg.connect(database, autocommit=True) as conn:
            conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(owner)))
            conn.execute(
                "ALTER TABLE public.outbox ATTACH PARTITION public.outbox_2024_03 "
                "FOR VALUES FROM ('2024-03-01') TO ('2024-04-01')"
            )
        events = write_partitioned(database, "01", 6, "jan") + write_partitioned(
            database, "03", 6, "mar"
        )
        records = consume_all(broker.bootstrap_servers, f"{unique}.order", len(events), 30)
        wait_until(
            lambda: partitioned_rows(database) == {e.id for e in prefilled},
            30,
            "the sweeper, as the relay's role, deleted the published rows from the partitions",
        )
        horizons = scalar(database, "SELECT sweep_horizons::text FROM cdc_relay.slot_position")
    finally:
        code = relay.stop()
        relay.close()
    assert code == 0, relay.logs()
    assert sorted(r.header("id") or b"" for r in records) == sorted(e.id.encode() for e in events)
    assert "sweep failed" not in relay.logs()
    assert isinstance(horizons, str)
    assert len(orjson.loads(horizons)) == 4  # the partitions' looks, kept for later sweepers


def test_a_lost_slot_is_recovered_and_retained_rows_republished_as_the_documented_role(
    database: str, broker: KafkaBroker, unique: str, least_privilege: tuple[str, str]
) -> None:
    relay_url, _owner = least_privilege
    env = relay_env(
        relay_url,
        broker.bootstrap_servers,
        unique,
        publication_name=PUBLICATION,
        confirm_interval="0.2",
        idle_confirm_interval="0.3",
    )
    slot = f"slot_{unique}"
    before = [new_event("order", f"o-{i % 3}", "created", {"n": i}) for i in range(10)]
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        write_transactions(database, [before])
        consume_all(broker.bootstrap_servers, f"{unique}.order", 10, 30)
    finally:
        relay.kill()
        relay.close()
    lost = [new_event("order", f"o-{i % 3}", "created", {"n": 10 + i}) for i in range(10)]
    write_transactions(database, [lost])
    scalar(database, "SELECT pg_drop_replication_slot(%s)", slot)

    recovered = cdc_relay(env, "recover")
    assert recovered.returncode == 0, recovered.stdout + recovered.stderr
    replayed = cdc_relay(env, "republish", "--to-topic", f"{unique}.replay")
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    records = consume_all(broker.bootstrap_servers, f"{unique}.order", 20, 30, grace=1.0)
    assert sorted(r.header("id") or b"" for r in records) == sorted(
        e.id.encode() for e in before + lost
    )
    assert len(consume_all(broker.bootstrap_servers, f"{unique}.replay", 20, 30)) == 20
