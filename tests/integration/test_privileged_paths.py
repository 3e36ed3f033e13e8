"""Who can get an event published, and who can hold the leadership: roles the operator did not
choose cannot. Attackers here are LOGIN-only roles (CONNECT from PUBLIC, nothing else), as any
application role of the database would be."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator

import orjson
import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from cdc_relay.leadership import LOCK_CLASS
from cdc_relay.local.lifetime import free_port
from tests.conftest import KafkaBroker
from tests.integration.relay_support import (
    RelayProcess,
    create_outbox,
    http_get,
    new_event,
    relay_env,
    write_transactions,
)
from tests.integration.test_admin import cdc_relay, failed, lines_of
from tests.kafka_helpers import consume_all

pytestmark = pytest.mark.integration

PASSWORD = "login-only-test-password"
EMIT_SIGNATURE = "outbox_emit(text, text, text, jsonb, jsonb)"
FORGED = {
    "id": "forged-1",
    "aggregate_type": "order",
    "aggregate_id": "acct-1",
    "event_type": "payment_approved",
    "payload": {"amount": 1000000},
}

MakeRole = Callable[[str], str]


@pytest.fixture
def login_role(database: str, unique: str) -> Iterator[MakeRole]:
    """Makes LOGIN-only roles (nothing granted) and yields their URLs; drops them afterwards."""
    made: list[str] = []

    def make(name: str) -> str:
        role = f"{name}_{unique}"
        with psycopg.connect(database, autocommit=True) as conn:
            conn.execute(
                sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                    sql.Identifier(role), sql.Literal(PASSWORD)
                )
            )
        made.append(role)
        params = conninfo_to_dict(database)
        params.update(user=role, password=PASSWORD)
        return make_conninfo("", **params)

    try:
        yield make
    finally:
        with psycopg.connect(database, autocommit=True) as conn:
            for role in made:
                conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                    (role,),
                )
                conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
                conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def _forge(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_logical_emit_message(true, 'outbox', %s)", (orjson.dumps(FORGED).decode(),)
        )


# -- table-less messages ----------------------------------------------------------------------


def test_a_login_only_role_cannot_get_a_message_published(
    database: str, broker: KafkaBroker, unique: str, login_role: MakeRole, plugin: str
) -> None:
    """Messages are off by default: a forged message, then a real row; only the row arrives."""
    create_outbox(database)
    attacker = login_role("attacker")
    topic = f"{unique}.order"
    broker.create_topic(topic, partitions=1)
    relay = RelayProcess(relay_env(database, broker.bootstrap_servers, unique)).start()
    try:
        relay.wait_streaming()
        _forge(attacker)
        real = new_event("order", "acct-1", "created", {"n": 1})
        write_transactions(database, [[real]])
        # The forged message commits first: published, it would come before the row in the one
        # partition, so it is read by the time the row is; the grace shows any later record.
        records = consume_all(broker.bootstrap_servers, [topic], 1, 10, grace=1.0)
        assert relay.stop() == 0, relay.logs()
    finally:
        relay.close()
    assert [(r.header("id") or b"").decode() for r in records] == [real.id], (
        "the forged message was published"
    )
    # pgoutput is asked for none; wal2json cannot be, so the session drops it and says so.
    dropped = "dropped a table-less message: CDC_RELAY_MESSAGES is off" in relay.logs()
    assert dropped == (plugin == "wal2json"), relay.logs()


def test_messages_on_only_granted_writers_can_emit(
    database: str, broker: KafkaBroker, unique: str, login_role: MakeRole
) -> None:
    """``setup`` with messages on: PUBLIC can no longer emit; a writer granted outbox_emit can."""
    create_outbox(database)
    attacker = login_role("attacker")
    writer = login_role("writer")
    env = relay_env(database, broker.bootstrap_servers, unique, messages="true")
    result = cdc_relay(env, "setup")
    assert result.returncode == 0, result.stdout + result.stderr
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            sql.SQL("GRANT EXECUTE ON FUNCTION {} TO {}").format(
                sql.SQL(EMIT_SIGNATURE), sql.Identifier(f"writer_{unique}")
            )
        )
    checked = cdc_relay(env, "check")
    assert "messages" in lines_of(checked), checked.stdout
    assert "messages" not in failed(checked), checked.stdout
    assert f"writer_{unique}" in lines_of(checked)["messages"]

    topic = f"{unique}.order"
    broker.create_topic(topic, partitions=1)
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            _forge(attacker)
        with (
            pytest.raises(psycopg.errors.InsufficientPrivilege),
            psycopg.connect(attacker, autocommit=True) as conn,
        ):
            conn.execute(
                f"SELECT {EMIT_SIGNATURE.split('(', maxsplit=1)[0]}('order', 'a', 'x', '{{}}')"
            )
        with psycopg.connect(writer, autocommit=True) as conn:
            row = conn.execute("SELECT outbox_emit('order', 'acct-1', 'created', '{}')").fetchone()
        assert row is not None
        records = consume_all(broker.bootstrap_servers, [topic], 1, 30, grace=1.0)
        assert relay.stop() == 0, relay.logs()
    finally:
        relay.close()
    assert [(r.header("id") or b"").decode() for r in records] == [str(row[0])]


def test_messages_on_while_any_role_can_emit_refuses_to_start(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    """PUBLIC may execute pg_logical_emit_message (the server's default): exit 3, naming the fix."""
    create_outbox(database)
    env = relay_env(database, broker.bootstrap_servers, unique, messages="true")
    checked = cdc_relay(env, "check")
    assert "messages" in failed(checked), checked.stdout
    assert "REVOKE EXECUTE ON FUNCTION pg_logical_emit_message" in failed(checked)["messages"]
    relay = RelayProcess(env).start()
    try:
        code = relay.wait(60)
    finally:
        relay.close()
    assert code == 3, relay.logs()
    assert "REVOKE EXECUTE ON FUNCTION pg_logical_emit_message" in relay.logs()


# -- the leader lock --------------------------------------------------------------------------


def test_a_squatted_leader_lock_is_reported_and_relays_lead_by_the_lease(
    database: str, broker: KafkaBroker, unique: str, login_role: MakeRole
) -> None:
    """A LOGIN-only role holds the leader's advisory lock: a relay leads by its lease alone and
    says who holds the lock, where and how to fix it (log, /status, check); a standby still takes
    over from a killed leader; once the squatter is gone the leader takes the lock back."""
    create_outbox(database)
    squatter = login_role("squatter")
    role = f"squatter_{unique}"
    slot = f"slot_{unique}"
    topic = f"{unique}.order"
    broker.create_topic(topic, partitions=1)
    ports = [free_port(), free_port()]
    envs = [
        relay_env(
            database,
            broker.bootstrap_servers,
            unique,
            http_port=str(port),
            log_level="INFO",
            leader_lease_timeout="4",
            leader_renew_interval="0.5",
        )
        for port in ports
    ]
    events = [new_event("order", "o-1", "created", {"n": n}) for n in range(2)]
    relays: list[RelayProcess] = []
    held = psycopg.connect(squatter, autocommit=True)
    try:
        pid = held.info.backend_pid
        held.execute("SELECT pg_advisory_lock(%s, hashtext(%s))", (LOCK_CLASS, slot))
        first = RelayProcess(envs[0]).start()
        relays.append(first)
        first.wait_streaming()
        assert "leading by the lease alone" in first.logs()
        assert "the leader lock is held by a session that is no relay" in first.logs()
        assert role in first.logs()
        status = orjson.loads(http_get(ports[0], "/status")[1])
        assert status["role"] == "leader"
        assert status["leader_lock_held_by"] == {"pid": pid, "role": role}
        checked = cdc_relay(envs[0], "check")
        line = failed(checked).get("leadership", "")
        assert role in line, checked.stdout
        assert str(pid) in line, checked.stdout
        assert "pg_terminate_backend" in line

        second = RelayProcess(envs[1]).start()
        relays.append(second)
        second.wait_for_log("the leader lock is held by a session that is no relay")
        write_transactions(database, [[events[0]]])
        assert len(consume_all(broker.bootstrap_servers, [topic], 1, 30)) == 1
        assert orjson.loads(http_get(ports[1], "/status")[1])["role"] == "standby"

        first.kill()  # its connections close: the standby sees its lease's backend gone
        second.wait_streaming(30)
        assert "leading by the lease alone" in second.logs()
        write_transactions(database, [[events[1]]])
        records = consume_all(broker.bootstrap_servers, [topic], 2, 30, grace=1.0)

        held.close()
        second.wait_for_log("the session that held the leader lock is gone", 30)
        assert orjson.loads(http_get(ports[1], "/status")[1])["leader_lock_held_by"] is None
        assert not failed(cdc_relay(envs[1], "check")).get("leadership"), "check is content"
        assert second.stop() == 0, second.logs()
    finally:
        held.close()
        for relay in relays:
            relay.close()
    ids = [(r.header("id") or b"").decode() for r in records]
    assert [i for i in dict.fromkeys(ids)] == [e.id for e in events], ids


def test_a_hung_leader_by_the_lease_is_replaced_when_its_lease_runs_out(
    database: str, broker: KafkaBroker, unique: str, login_role: MakeRole
) -> None:
    """The lock squatted, the leader (by its lease alone) hangs: the standby ends its connections
    once the lease has run out and leads; the woken leader confirms nothing and stands by."""
    create_outbox(database)
    squatter = login_role("squatter")
    slot = f"slot_{unique}"
    topic = f"{unique}.order"
    broker.create_topic(topic, partitions=1)
    env = relay_env(
        database,
        broker.bootstrap_servers,
        unique,
        log_level="INFO",
        leader_lease_timeout="4",
        leader_renew_interval="0.5",
    )
    event = new_event("order", "o-1", "created", {"n": 1})
    relays: list[RelayProcess] = []
    held = psycopg.connect(squatter, autocommit=True)
    try:
        held.execute("SELECT pg_advisory_lock(%s, hashtext(%s))", (LOCK_CLASS, slot))
        first = RelayProcess(env).start()
        relays.append(first)
        first.wait_streaming()
        second = RelayProcess(env).start()
        relays.append(second)
        second.wait_for_log("the leader lock is held by a session that is no relay")
        os.kill(first.pid, signal.SIGSTOP)
        hung = time.monotonic()
        try:
            second.wait_streaming(30)
            took = time.monotonic() - hung
        finally:
            os.kill(first.pid, signal.SIGCONT)
        assert "the leader's lease expired: ending its connections" in second.logs()
        assert 3.0 < took < 15.0, took  # the 4 s lease, not at once and not never
        write_transactions(database, [[event]])
        records = consume_all(broker.bootstrap_servers, [topic], 1, 30, grace=1.0)
        first.wait_for_log("now a standby", 30)
        assert second.stop() == 0, second.logs()
        assert first.stop() == 0, first.logs()
    finally:
        held.close()
        for relay in relays:
            relay.close()
    assert [(r.header("id") or b"").decode() for r in records] == [event.id]
