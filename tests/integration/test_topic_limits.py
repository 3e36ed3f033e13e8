"""Topics chosen by rows: an allow-list and a limit on how many the relay creates, and topic
creation that runs off the streaming loop (a stop is honoured while a broker does not answer)."""

from __future__ import annotations

import json
import time

import psycopg
import pytest
from confluent_kafka import Consumer

from cdc_relay.local import LocalBroker
from tests.conftest import KafkaBroker
from tests.integration.relay_support import (
    RelayProcess,
    create_outbox,
    insert_events,
    new_event,
    relay_env,
)
from tests.integration.test_admin import cdc_relay, failed
from tests.kafka_helpers import consume_all, consume_with_grace

pytestmark = pytest.mark.integration


def _existing_topics(bootstrap: str) -> set[str]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "meta"})
    try:
        return set(consumer.list_topics(timeout=10).topics)
    finally:
        consumer.close()


def test_topics_outside_the_allowlist_or_over_the_limit_are_refused(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    create_outbox(database)
    dead_letter = f"{unique}.dead_letter"
    broker.create_topic(dead_letter, partitions=1)
    env = relay_env(
        database,
        broker.bootstrap_servers,
        unique,
        topic_allowlist=rf"{unique}\.(order|invoice|extra)",
        max_created_topics="2",
    )
    events = [
        new_event("order"),  # created: 1 of 2
        new_event("evil"),  # not in the allow-list
        new_event("invoice"),  # created: 2 of 2
        new_event("extra"),  # allowed, but a third topic to create
        new_event("order"),  # exists now
    ]
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        with psycopg.connect(database) as conn:
            insert_events(conn, events)
            conn.commit()
        dead = consume_with_grace(broker.bootstrap_servers, [dead_letter], 2, 30)
        orders = consume_with_grace(broker.bootstrap_servers, [f"{unique}.order"], 2, 30)
        invoices = consume_all(broker.bootstrap_servers, [f"{unique}.invoice"], 1, 30)
        assert relay.stop() == 0, relay.logs()
    finally:
        relay.close()
    assert [r.header("id") for r in orders] == [events[0].id.encode(), events[4].id.encode()]
    assert [r.header("id") for r in invoices] == [events[2].id.encode()]
    by_id = {r.header("cdc_relay.event_id"): r for r in dead}
    assert set(by_id) == {events[1].id.encode(), events[3].id.encode()}
    evil = by_id[events[1].id.encode()]
    assert b"CDC_RELAY_TOPIC_ALLOWLIST" in (evil.header("cdc_relay.error") or b"")
    assert evil.header("cdc_relay.error_code") == b"POLICY_VIOLATION"
    assert evil.header("cdc_relay.topic") == f"{unique}.evil".encode()
    extra = by_id[events[3].id.encode()]
    assert b"CDC_RELAY_MAX_CREATED_TOPICS" in (extra.header("cdc_relay.error") or b"")
    topics = _existing_topics(broker.bootstrap_servers)
    assert f"{unique}.evil" not in topics
    assert f"{unique}.extra" not in topics


def test_patterns_that_would_backtrack_neither_wedge_the_relay_nor_pass_a_row(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    """The allow-list and a key transform of shapes Python's re took forever on: the hostile
    rows are dead-lettered, and the rows after them arrive, within seconds."""
    create_outbox(database)
    dead_letter = f"{unique}.dead_letter"
    broker.create_topic(dead_letter, partitions=1)
    key_from = {
        "column": "aggregate_id",
        "regex": "([a-z0-9][a-z0-9-]?)+::(.*)",
        "replacement": "$2",
    }
    env = relay_env(
        database,
        broker.bootstrap_servers,
        unique,
        topic_allowlist=rf"{unique}\.([a-z0-9]+[_-]?)+",
        outbox_columns=json.dumps({"key_from": key_from}),
    )
    events = [
        new_event("a" * 40 + "!", "shop::k1"),  # the report's row: not even a legal topic
        new_event("a" * 40 + ".", "shop::k2"),  # legal, and the allow-list must say no
        new_event("order", "a" * 40 + "!"),  # the key transform must say no
        new_event("order", "shop-eu::k4"),  # the row after them
    ]
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        with psycopg.connect(database) as conn:
            insert_events(conn, events)
            conn.commit()
        orders = consume_with_grace(broker.bootstrap_servers, [f"{unique}.order"], 1, 30)
        dead = consume_with_grace(broker.bootstrap_servers, [dead_letter], 3, 30)
        assert relay.stop(timeout=30) == 0, relay.logs()
    finally:
        relay.close()
    assert [(r.header("id"), r.key) for r in orders] == [(events[3].id.encode(), b"k4")]
    by_id = {r.header("cdc_relay.event_id"): r for r in dead}
    assert set(by_id) == {e.id.encode() for e in events[:3]}
    assert b"invalid topic name" in (by_id[events[0].id.encode()].header("cdc_relay.error") or b"")
    refused = by_id[events[1].id.encode()]
    assert b"CDC_RELAY_TOPIC_ALLOWLIST" in (refused.header("cdc_relay.error") or b"")
    assert refused.header("cdc_relay.error_code") == b"POLICY_VIOLATION"
    assert b"key_from.regex" in (by_id[events[2].id.encode()].header("cdc_relay.error") or b"")


def test_a_stop_is_honoured_while_a_topic_is_being_created(
    database: str, local_broker: LocalBroker, unique: str
) -> None:
    create_outbox(database)
    env = relay_env(database, local_broker.bootstrap_servers, unique, shutdown_timeout="2")
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        local_broker.pause()  # metadata and CreateTopics now wait for their timeouts (10 s, 20 s)
        with psycopg.connect(database) as conn:
            insert_events(conn, [new_event("never_created")])
            conn.commit()
        time.sleep(1.0)  # the relay is waiting for the topic
        stopped = time.monotonic()
        code = relay.stop(timeout=30)
        took = time.monotonic() - stopped
    finally:
        relay.close()
        local_broker.resume()
    assert code == 0, relay.logs()
    assert "stop requested: reading on to the end of the transaction" in relay.logs()
    # Within the shutdown timeout, not after the blocked metadata request (10 s).
    assert took < 6, f"stopped after {took:.1f}s:\n{relay.logs()}"


def test_check_fails_for_a_fixed_topic_outside_the_allowlist(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    create_outbox(database)
    env = relay_env(
        database,
        broker.bootstrap_servers,
        unique,
        topic_template="orders",
        topic_allowlist=rf"{unique}\..*",
    )
    result = cdc_relay(env, "check")
    assert "topic orders does not match CDC_RELAY_TOPIC_ALLOWLIST" in failed(result)["topics"]
