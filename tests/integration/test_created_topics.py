"""How many topics rows can have the relay create, over restarts.

``CDC_RELAY_MAX_CREATED_TOPICS`` counts the topics one process created: a restart starts afresh
(documented). What bounds the topics for good is ``CDC_RELAY_TOPIC_ALLOWLIST``: no run creates a
topic outside it. ``check`` says which of the two bounds a configuration has.
"""

from __future__ import annotations

import psycopg
import pytest
from confluent_kafka import Consumer

from tests.conftest import KafkaBroker
from tests.integration.relay_support import (
    Event,
    RelayProcess,
    create_outbox,
    insert_events,
    new_event,
    relay_env,
)
from tests.integration.test_admin import cdc_relay, lines_of
from tests.kafka_helpers import consume_with_grace

pytestmark = pytest.mark.integration


def _topics(bootstrap: str, prefix: str) -> set[str]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "meta"})
    try:
        return {t for t in consumer.list_topics(timeout=10).topics if t.startswith(prefix)}
    finally:
        consumer.close()


def test_check_names_what_bounds_the_topics_rows_can_create(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    create_outbox(database)
    env = relay_env(database, broker.bootstrap_servers, unique, max_created_topics="7")
    line = lines_of(cdc_relay(env, "check"))["topics"]
    assert line.startswith("ok   topics: "), line
    assert "each run of the relay creates up to 7 new ones" in line, line
    assert "CDC_RELAY_MAX_CREATED_TOPICS counts per process, afresh at each start" in line, line
    assert "set CDC_RELAY_TOPIC_ALLOWLIST to bound them for good" in line, line

    env["CDC_RELAY_TOPIC_ALLOWLIST"] = rf"{unique}\.(order|invoice)"
    line = lines_of(cdc_relay(env, "check"))["topics"]
    assert "new topics only as CDC_RELAY_TOPIC_ALLOWLIST allows, up to 7 per run" in line, line

    env["CDC_RELAY_MISSING_TOPICS"] = "fail"
    assert "new topics" not in lines_of(cdc_relay(env, "check"))["topics"]


def _run(
    env: dict[str, str], database: str, events: list[Event], bootstrap: str, expect: dict[str, int]
) -> None:
    """One relay process: write ``events``, wait until ``expect`` (topic -> records in all) has
    arrived, stop."""
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        with psycopg.connect(database) as conn:
            insert_events(conn, events)
            conn.commit()
        for topic, count in expect.items():
            assert len(consume_with_grace(bootstrap, [topic], count, 30, grace=0)) == count
        assert relay.stop() == 0, relay.logs()
    finally:
        relay.close()


def test_the_allowlist_bounds_created_topics_across_restarts(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    create_outbox(database)
    dead_letter = f"{unique}.dead_letter"
    broker.create_topic(dead_letter, partitions=1)
    env = relay_env(
        database,
        broker.bootstrap_servers,
        unique,
        topic_allowlist=rf"{unique}\.(a|b)",
        max_created_topics="1",
    )
    first = [new_event("a"), new_event("evil"), new_event("b")]
    _run(env, database, first, broker.bootstrap_servers, {f"{unique}.a": 1, dead_letter: 2})
    assert _topics(broker.bootstrap_servers, unique) == {f"{unique}.a", dead_letter}

    second = [new_event("b"), new_event("evil2")]  # a new process: its own count of one
    _run(env, database, second, broker.bootstrap_servers, {f"{unique}.b": 1, dead_letter: 3})
    assert _topics(broker.bootstrap_servers, unique) == {f"{unique}.a", f"{unique}.b", dead_letter}

    dead = consume_with_grace(broker.bootstrap_servers, [dead_letter], 3, 30)
    refused = {r.header("cdc_relay.event_id"): r.header("cdc_relay.error") or b"" for r in dead}
    assert set(refused) == {first[1].id.encode(), first[2].id.encode(), second[1].id.encode()}
    assert b"CDC_RELAY_MAX_CREATED_TOPICS" in refused[first[2].id.encode()]
    assert b"CDC_RELAY_TOPIC_ALLOWLIST" in refused[second[1].id.encode()]
