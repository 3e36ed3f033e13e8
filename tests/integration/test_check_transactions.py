"""``check``'s ``transactions`` line against a real PostgreSQL and broker: with exactly once on, it
asks the broker for an ``init_transactions`` on the relay's ``transactional.id`` when no relay
leads, and on ``<id>.check`` while the lease says one does — which is what lets it run beside a
leader: the relay's own id would fence it. The tests hold a transactional producer of the
relay's id, as a leading relay does, and look at what the probe did to it; one runs check beside
a relay that leads, and the relay keeps leading and publishing."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from confluent_kafka import KafkaException, Producer

from cdc_relay.commands.check import PROBE_SUFFIX
from cdc_relay.transaction_errors import Outcome, outcome
from cdc_relay.transactional_id import transactional_id
from tests.conftest import KafkaBroker
from tests.integration.relay_support import (
    RelayProcess,
    new_event,
    relay_env,
    scalar,
    write_transactions,
)
from tests.integration.test_admin import cdc_relay, lines_of
from tests.integration.test_least_privilege import PUBLICATION, least_privilege  # noqa: F401
from tests.kafka_helpers import consume_all

pytestmark = pytest.mark.integration

TIMEOUT = 10.0
# A lease holder as any role that may write the lease row could name it: a forged second line.
FORGED_HOLDER = "host/1/x\nFAIL forged: \x1b[2J"


@pytest.fixture
def env(database: str, broker: KafkaBroker, unique: str) -> dict[str, str]:
    env = relay_env(database, broker.bootstrap_servers, unique, exactly_once="true")
    result = cdc_relay(env, "setup", "--create-outbox")
    assert result.returncode == 0, result.stdout + result.stderr
    return env


@pytest.fixture
def least_privilege_env(
    broker: KafkaBroker,
    unique: str,
    least_privilege: tuple[str, str],  # noqa: F811
) -> dict[str, str]:
    """Exactly once on, as the documented non-superuser role that may run no DDL."""
    relay_url, _owner = least_privilege
    return relay_env(
        relay_url,
        broker.bootstrap_servers,
        unique,
        publication_name=PUBLICATION,
        exactly_once="true",
    )


@pytest.fixture
def topic(broker: KafkaBroker, unique: str) -> str:
    """The relay's topic for the ``order`` events, one partition."""
    name = f"{unique}.order"
    broker.create_topic(name, partitions=1)
    return name


@pytest.fixture
def relay_id(database: str, env: dict[str, str]) -> str:
    with psycopg.connect(database) as conn:
        row = conn.execute("SELECT system_identifier::text FROM pg_control_system()").fetchone()
    assert row is not None
    return transactional_id(str(row[0]), env["CDC_RELAY_SLOT_NAME"])


@pytest.fixture
def relay_producer(broker: KafkaBroker, relay_id: str) -> Iterator[Producer]:
    """A producer of the relay's id with a Kafka transaction open: what a leading relay holds."""
    producer = Producer(
        {"bootstrap.servers": broker.bootstrap_servers, "transactional.id": relay_id}
    )
    producer.init_transactions(TIMEOUT)
    producer.begin_transaction()
    yield producer
    producer.purge()
    producer.flush(1)


def _lease(database: str, slot: str, holder: str, valid_for: str) -> None:
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO cdc_relay.leader_lease (slot_name, holder, lock_pid, expires_at) "
            "VALUES (%s, %s, pg_backend_pid(), now() + %s::interval)",
            (slot, holder, valid_for),
        )


def test_with_no_relay_leading_check_probes_the_relays_own_id(
    database: str, topic: str, env: dict[str, str], relay_id: str, relay_producer: Producer
) -> None:
    # The last relay to lead hung: its lease ran out, so nothing alive holds the id.
    _lease(database, env["CDC_RELAY_SLOT_NAME"], "host/1/hung", "-1 second")

    result = cdc_relay(env, "check")
    assert result.returncode == 0, result.stdout + result.stderr
    # It was the relay's own id: the hung relay's producer is fenced.
    relay_producer.produce(topic, b"from the hung relay")
    with pytest.raises(KafkaException) as info:
        relay_producer.commit_transaction(TIMEOUT)
    assert outcome(info.value.args[0].code()) is Outcome.FENCED, info.value
    assert lines_of(result)["transactions"] == (
        f"ok   transactions: the broker accepts init_transactions for {relay_id}, the relay's "
        "own transactional.id (no relay leads the slot)"
    )


def test_beside_a_leading_relay_check_probes_the_check_id_and_fences_nothing(
    database: str,
    broker: KafkaBroker,
    topic: str,
    env: dict[str, str],
    relay_id: str,
    relay_producer: Producer,
) -> None:
    _lease(database, env["CDC_RELAY_SLOT_NAME"], FORGED_HOLDER, "1 minute")
    relay_producer.produce(topic, b"from the leader")

    result = cdc_relay(env, "check")
    assert result.returncode == 0, result.stdout + result.stderr
    # The leader was not fenced: its transaction commits, and its record is there.
    relay_producer.commit_transaction(TIMEOUT)
    records = consume_all(broker.bootstrap_servers, topic, 1, timeout=30)
    assert [r.value for r in records] == [b"from the leader"]
    line = lines_of(result)["transactions"]
    assert line.startswith(
        f"ok   transactions: the broker accepts init_transactions for {relay_id}{PROBE_SUFFIX}, "
        f"not the relay's {relay_id}: relay host/1/x\\nFAIL forged: \\x1b[2J leads (lease valid "
        "until "
    ), line
    assert line.endswith("), and its own id would fence it"), line
    assert not any(text.startswith("FAIL forged") for text in result.stdout.splitlines())


def test_with_exactly_once_off_check_says_so(database: str, broker: KafkaBroker) -> None:
    env = relay_env(database, broker.bootstrap_servers, "eos_off")
    result = cdc_relay(env, "check")
    assert lines_of(result)["transactions"] == (
        "ok   transactions: off (CDC_RELAY_EXACTLY_ONCE): at least once, consumers drop repeats "
        "by the id header"
    )


def test_as_the_documented_role_check_probes_the_relays_own_id(
    least_privilege_env: dict[str, str],
) -> None:
    line = lines_of(cdc_relay(least_privilege_env, "check"))["transactions"]
    assert line.startswith("ok   transactions: the broker accepts init_transactions for cdc-relay.")
    assert line.endswith(", the relay's own transactional.id (no relay leads the slot)"), line


def test_check_beside_a_running_leader_leaves_it_leading(
    database: str, broker: KafkaBroker, topic: str, env: dict[str, str], relay_id: str
) -> None:
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        holder = scalar(
            database,
            "SELECT holder FROM cdc_relay.leader_lease WHERE slot_name = %s",
            env["CDC_RELAY_SLOT_NAME"],
        )
        result = cdc_relay(env, "check")
        events = [new_event("order", "o-1", "created", {"n": n}) for n in range(3)]
        write_transactions(database, [[event] for event in events])
        records = consume_all(broker.bootstrap_servers, topic, len(events), timeout=30)
        assert relay.stop() == 0
    finally:
        relay.close()
    assert result.returncode == 0, result.stdout + result.stderr
    assert lines_of(result)["transactions"].startswith(
        f"ok   transactions: the broker accepts init_transactions for {relay_id}{PROBE_SUFFIX}, "
        f"not the relay's {relay_id}: relay {holder} leads (lease valid until "
    )
    assert [r.header("id") for r in records] == [event.id.encode() for event in events]
    assert "lost the leadership" not in relay.logs()


def test_as_a_role_that_cannot_read_the_lease_check_fences_nothing(
    database: str, least_privilege_env: dict[str, str]
) -> None:
    env = least_privilege_env
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("REVOKE SELECT ON cdc_relay.leader_lease FROM relay")
    line = lines_of(cdc_relay(env, "check"))["transactions"]
    assert line.startswith("ok   transactions: the broker accepts init_transactions for cdc-relay.")
    assert f"{PROBE_SUFFIX}, not the relay's cdc-relay." in line
    assert line.endswith(
        ": the leader lease cannot be read, so a relay may lead, and its own id would fence it"
    ), line

    # Without the system identifier there is no id to probe: the line says what to grant.
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("REVOKE EXECUTE ON FUNCTION pg_control_system() FROM PUBLIC")
    result = cdc_relay(env, "check")
    assert lines_of(result)["transactions"].startswith(
        "FAIL transactions: cannot read the database's system identifier, which the relay's "
        "transactional.id names: permission denied for function pg_control_system"
    ), result.stdout
    assert result.returncode == 1
