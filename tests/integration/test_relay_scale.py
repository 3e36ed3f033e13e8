"""Resource bounds: an idle outbox must not pin WAL; a huge transaction is never held whole."""

from __future__ import annotations

import time

import psycopg
import pytest
from confluent_kafka import Consumer, TopicPartition

from tests.conftest import KafkaBroker
from tests.integration.relay_support import (
    RelayProcess,
    create_outbox,
    new_event,
    relay_env,
    scalar,
    slot_confirmed_lsn,
    wait_until,
    write_transactions,
)
from tests.kafka_helpers import consume_all

# Every test here runs for each output plugin (pgoutput, wal2json).
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("plugin")]

MB = 1024 * 1024


def _retained_wal(url: str, slot: str) -> int:
    value = scalar(
        url,
        "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint "
        "FROM pg_replication_slots WHERE slot_name = %s",
        slot,
    )
    return int(str(value))


def test_idle_outbox_does_not_pin_wal(database: str, broker: KafkaBroker, unique: str) -> None:
    create_outbox(database)
    topic = f"{unique}.order"
    broker.create_topic(topic, partitions=1)
    slot = f"slot_{unique}"
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("CREATE TABLE filler (id bigserial PRIMARY KEY, pad text)")
    # The idle confirmation is the code path under test; its interval only sets how long the
    # test waits for it (the default 10 s, twice, since the slot moves in two steps: see below).
    env = relay_env(database, broker.bootstrap_servers, unique, idle_confirm_interval="1")
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        write_transactions(database, [[new_event()]])
        event_end = int(str(scalar(database, "SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn")))
        consume_all(broker.bootstrap_servers, [topic], 1, 30)
        # The event's acknowledgement is confirmed first, so that only the idle confirmation can
        # move the slot past what follows (it would otherwise ride on that confirmation).
        wait_until(
            lambda: slot_confirmed_lsn(database, slot) >= event_end, 30, "the event confirmed"
        )

        start = int(str(scalar(database, "SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")))
        with psycopg.connect(database, autocommit=True) as conn:
            for _ in range(11):  # 11 transactions of ~5 MB of WAL each, none in the outbox
                conn.execute(
                    "INSERT INTO filler (pad) SELECT repeat(md5(i::text), 30) "
                    "FROM generate_series(1, 5000) i"
                )
        written = int(str(scalar(database, "SELECT pg_current_wal_lsn() - '0/0'::pg_lsn"))) - start
        assert written >= 50 * MB
        # A logical slot's restart_lsn moves only to a running-transactions snapshot the relay has
        # confirmed past; the server logs one every 15 s on its own, a checkpoint logs one now.
        with psycopg.connect(database, autocommit=True) as conn:
            conn.execute("CHECKPOINT")

        began = time.monotonic()
        wait_until(
            lambda: _retained_wal(database, slot) < 16 * MB,
            60,
            "the slot to release the WAL written while the outbox was idle",
        )
        print(
            f"\nidle outbox: {written / MB:.1f} MB of WAL written, slot retains "
            f"{_retained_wal(database, slot) / MB:.1f} MB after {time.monotonic() - began:.1f}s"
        )
        assert relay.stop() == 0
    finally:
        relay.close()


def _count_ids(
    bootstrap: str, topic: str, partitions: int, expected: int, timeout: float
) -> set[bytes]:
    """Distinct event ids on ``topic``, reading in batches (a million Record objects is slow)."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"count-{topic}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "fetch.wait.max.ms": 50,
        }
    )
    consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    ids: set[bytes] = set()
    deadline = time.monotonic() + timeout
    try:
        while len(ids) < expected and time.monotonic() < deadline:
            for message in consumer.consume(10_000, 0.5):
                if message.error() is None:
                    headers = message.headers()
                    assert isinstance(headers, list)
                    event_id = headers[0][1]
                    assert isinstance(event_id, bytes)
                    ids.add(event_id)
    finally:
        consumer.close()
    return ids


@pytest.mark.parametrize("exactly_once", ["false", "true"])
def test_huge_transaction_streams_with_bounded_memory(
    database: str, broker: KafkaBroker, unique: str, exactly_once: str
) -> None:
    # Wide rows make the transaction big at a fraction of the per-row cost of a million small ones.
    rows = 200_000
    create_outbox(database)
    topic = f"{unique}.order"
    broker.create_topic(topic, partitions=3)
    # Exactly once: the transaction is split over Kafka transactions (past 100,000 events).
    env = relay_env(database, broker.bootstrap_servers, unique, exactly_once=exactly_once)
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        with psycopg.connect(database, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) "
                "SELECT gen_random_uuid(), 'order', 'a-' || (i %% 1000), 'created', "
                "jsonb_build_object('n', i, 'pad', repeat('x', 1500)) "
                "FROM generate_series(1, %s) i",
                (rows,),
            )
        ids = _count_ids(broker.bootstrap_servers, topic, 3, rows, 240)
        peak = relay.peak_rss_mb()
        assert relay.stop() == 0
    finally:
        relay.close()
    assert len(ids) == rows
    print(f"\n{rows}-row transaction (exactly once: {exactly_once}): relay peak RSS {peak:.0f} MiB")
    # The producer queue is bounded (20k records / 64 MiB); the transaction itself is ~330 MB of
    # records, so staying far below that proves it was never held whole.
    assert peak < 150
