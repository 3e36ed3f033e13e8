"""A position record the server cannot have — ahead of its WAL, written by another cluster or on a
timeline not in its history — stops the relay (exit 4) and ``sweep`` before either acts on it:
the slot keeps its position, no row is deleted, the events written meanwhile still arrive once
the operator decides. Run as the least-privileged role the README documents (sql/005)."""

from __future__ import annotations

import psycopg
import pytest

from tests.conftest import KafkaBroker
from tests.integration.relay_support import (
    RelayProcess,
    new_event,
    relay_env,
    scalar,
    slot_confirmed_lsn,
    write_transactions,
)
from tests.integration.test_admin import cdc_relay
from tests.integration.test_least_privilege import PUBLICATION, least_privilege  # noqa: F401
from tests.kafka_helpers import consume_all

pytestmark = pytest.mark.integration

QUICK = {"confirm_interval": "0.2", "idle_confirm_interval": "0.3", "topic_partitions": "1"}


@pytest.mark.parametrize(
    ("tampering", "named"),
    [
        # The finding: a record moved ahead of the WAL end (WAL end ~0/2000000 here).
        ("confirmed_lsn = '0/F0000000'", "ahead of the server's WAL end"),
        # A record restored from another cluster's backup.
        ("system_identifier = '1234'", "written on the cluster with system identifier 1234"),
        # Written on a timeline this server (timeline 1, never promoted) never had.
        ("timeline_id = 7", "written on timeline 7, and this server is on timeline 1"),
    ],
)
def test_a_record_the_server_cannot_have_stops_the_relay_and_the_sweeper(
    database: str,
    broker: KafkaBroker,
    unique: str,
    least_privilege: tuple[str, str],  # noqa: F811
    tampering: str,
    named: str,
) -> None:
    relay_url, _owner = least_privilege
    env = relay_env(relay_url, broker.bootstrap_servers, unique, publication_name=PUBLICATION)
    env.update({f"CDC_RELAY_{k.upper()}": v for k, v in QUICK.items()})
    slot = env["CDC_RELAY_SLOT_NAME"]
    topic = f"{unique}.order"
    broker.create_topic(topic, partitions=1)
    first = [new_event("order", "o-1", "created", {"n": n}) for n in range(2)]
    later = [new_event("order", "o-1", "paid", {"n": n}) for n in range(3)]

    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        write_transactions(database, [first])
        consume_all(broker.bootstrap_servers, topic, len(first), 30)
        assert relay.stop() == 0, relay.logs()
    finally:
        relay.close()
    stamped = scalar(
        database,
        "SELECT system_identifier = (SELECT system_identifier::text FROM pg_control_system()) "
        "AND timeline_id = 1 FROM cdc_relay.slot_position WHERE slot_name = %s",
        slot,
    )
    assert stamped is True, "each write stamps the record with the server it was written on"
    slot_before = slot_confirmed_lsn(database, slot)
    with psycopg.connect(database, autocommit=True) as conn:  # as a superuser, a restore would
        conn.execute(
            f"UPDATE cdc_relay.slot_position SET {tampering} WHERE slot_name = %s".encode(), (slot,)
        )

    refused = RelayProcess(env).start()
    try:
        code = refused.wait(60)
    finally:
        refused.close()
    write_transactions(database, [later])
    sweep = cdc_relay(env, "sweep", "--once", "--wait", "3")
    checked = cdc_relay(env, "check")
    slot_after = slot_confirmed_lsn(database, slot)
    rows = scalar(database, "SELECT count(*) FROM outbox")

    reset = RelayProcess({**env, "CDC_RELAY_ALLOW_SLOT_RESET": "true"}).start()
    try:
        reset.wait_streaming()
        records = consume_all(broker.bootstrap_servers, topic, len(first) + len(later), 30)
        assert reset.stop() == 0, reset.logs()
    finally:
        reset.close()

    assert code == 4, refused.logs()
    logs = refused.logs()
    assert named in logs
    assert "CDC_RELAY_ALLOW_SLOT_RESET=true" in logs, "the fix is named"
    assert "start_lsn" not in logs, "it never streamed"
    assert slot_after == slot_before, "the slot is untouched"
    assert sweep.returncode == 4, sweep.stdout + sweep.stderr
    assert named in sweep.stderr
    assert rows == len(first) + len(later), "the sweeper deleted nothing"
    assert checked.returncode == 1
    assert any(
        line.startswith("FAIL slot") and named in line for line in checked.stdout.splitlines()
    ), checked.stdout
    arrived = [r.header("id") for r in records]
    assert arrived[len(first) :] == [e.id.encode() for e in later], "no event lost"
    assert "starting anyway because slot reset is allowed" in reset.logs()
    restamped = scalar(
        database,
        "SELECT system_identifier = (SELECT system_identifier::text FROM pg_control_system()) "
        "AND timeline_id = 1 AND confirmed_lsn < '0/F0000000' FROM cdc_relay.slot_position "
        "WHERE slot_name = %s",
        slot,
    )
    assert restamped is True, "recorded afresh"


def test_an_installed_state_table_gains_the_new_columns_and_its_record_is_stamped(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    """An install from before the stamps: the relay (here as the table's owner) adds the
    columns at start, trusts the unstamped record by its position, and stamps it."""
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE outbox (id uuid PRIMARY KEY, aggregate_type text NOT NULL, "
            "aggregate_id text NOT NULL, event_type text NOT NULL, payload jsonb NOT NULL, "
            "headers jsonb, created_at timestamptz NOT NULL DEFAULT now())"
        )
    env = relay_env(database, broker.bootstrap_servers, unique, **QUICK)
    slot = env["CDC_RELAY_SLOT_NAME"]
    topic = f"{unique}.order"
    broker.create_topic(topic, partitions=1)
    events = [new_event("order", "o-1", "created", {"n": n}) for n in range(4)]
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        write_transactions(database, [events[:2]])
        consume_all(broker.bootstrap_servers, topic, 2, 30)
        assert relay.stop() == 0, relay.logs()
    finally:
        relay.close()
    with psycopg.connect(database, autocommit=True) as conn:  # as the earlier version left it
        conn.execute(
            "ALTER TABLE cdc_relay.slot_position DROP COLUMN system_identifier, "
            "DROP COLUMN timeline_id, DROP COLUMN row_filters"
        )
    write_transactions(database, [events[2:]])
    relay = RelayProcess({**env, "CDC_RELAY_SWEEP_INTERVAL": "0.2"}).start()
    try:
        relay.wait_streaming()
        records = consume_all(broker.bootstrap_servers, topic, 4, 30)
        assert relay.stop() == 0, relay.logs()
    finally:
        relay.close()
    assert [r.header("id") for r in records][2:] == [e.id.encode() for e in events[2:]]
    row = scalar(
        database,
        "SELECT system_identifier = (SELECT system_identifier::text FROM pg_control_system()) "
        "AND timeline_id = 1 AND row_filters = '{\"public.outbox\": null}'::jsonb "
        "FROM cdc_relay.slot_position WHERE slot_name = %s",
        slot,
    )
    assert row is True


def test_a_revoked_pg_control_system_stops_the_relay_naming_the_grant(
    database: str,
    broker: KafkaBroker,
    unique: str,
    least_privilege: tuple[str, str],  # noqa: F811
) -> None:
    """The stamps need pg_control_system(), PUBLIC's by default: where a hardening revoked it,
    the relay stops at start (exit 3) with the GRANT, and check says so."""
    relay_url, _owner = least_privilege
    env = relay_env(relay_url, broker.bootstrap_servers, unique, publication_name=PUBLICATION)
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("REVOKE EXECUTE ON FUNCTION pg_control_system() FROM PUBLIC")
    relay = RelayProcess(env).start()
    try:
        code = relay.wait(60)
    finally:
        relay.close()
    checked = cdc_relay(env, "check")
    assert code == 3, relay.logs()
    grant = "GRANT EXECUTE ON FUNCTION pg_control_system() TO relay"
    assert grant in relay.logs()
    assert checked.returncode == 1
    assert grant in checked.stdout
