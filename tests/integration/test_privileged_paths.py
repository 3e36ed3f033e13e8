"""Who can get an event published, and who can hold the leadership: roles the operator did not
choose cannot. Attackers here are LOGIN-only roles (CONNECT from PUBLIC, nothing else), as any
application role of the database would be."""

from __future__ import annotations

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


@pytest.mark.usefixtures("plugin")
def test_a_login_only_role_cannot_get_a_message_published(
    database: str, broker: KafkaBroker, unique: str, login_role: MakeRole
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
        records = consume_all(broker.bootstrap_servers, [topic], 2, 10, grace=1.0)
        assert relay.stop() == 0, relay.logs()
    finally:
        relay.close()
    assert [(r.header("id") or b"").decode() for r in records] == [real.id], (
        "the forged message was published"
    )


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


def test_a_squatted_leader_lock_is_reported_not_waited_on_silently(
    database: str, broker: KafkaBroker, unique: str, login_role: MakeRole
) -> None:
    """A LOGIN-only role holds the leader's advisory lock: the relay says who, where and how to fix
    it (log, /status, check), and leads as soon as the squatter is gone."""
    create_outbox(database)
    squatter = login_role("squatter")
    slot = f"slot_{unique}"
    port = free_port()
    env = relay_env(
        database, broker.bootstrap_servers, unique, http_port=str(port), log_level="INFO"
    )
    with psycopg.connect(squatter, autocommit=True) as held:
        pid = held.info.backend_pid
        held.execute("SELECT pg_advisory_lock(%s, hashtext(%s))", (LOCK_CLASS, slot))
        relay = RelayProcess(env).start()
        try:
            relay.wait_for_log("the leader lock is held by a session that is no relay", 30)
            assert f"squatter_{unique}" in relay.logs()
            status = orjson.loads(http_get(port, "/status")[1])
            assert status["role"] == "standby"
            assert status["leader_lock_held_by"] == {"pid": pid, "role": f"squatter_{unique}"}
            checked = cdc_relay(env, "check")
            line = failed(checked).get("leadership", "")
            assert f"squatter_{unique}" in line, checked.stdout
            assert str(pid) in line, checked.stdout
            assert "pg_terminate_backend" in line
        except BaseException:
            relay.close()
            raise
    try:
        relay.wait_streaming()  # the squatter's session ended: its lock went with it
        assert orjson.loads(http_get(port, "/status")[1])["leader_lock_held_by"] is None
        event = new_event("order", "o-1", "created", {"n": 1})
        write_transactions(database, [[event]])
        records = consume_all(broker.bootstrap_servers, [f"{unique}.order"], 1, 30)
        assert relay.stop() == 0, relay.logs()
    finally:
        relay.close()
    assert [(r.header("id") or b"").decode() for r in records] == [event.id]
