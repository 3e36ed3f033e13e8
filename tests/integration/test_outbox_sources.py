"""Where events come from: logical messages, Debezium-style tables, several tables; topic policy."""

from __future__ import annotations

import uuid

import orjson
import psycopg
import pytest
from confluent_kafka import Consumer

from tests.conftest import KafkaBroker
from tests.integration.relay_support import (
    RelayProcess,
    create_outbox,
    insert_events,
    new_event,
    relay_env,
    scalar,
    slot_confirmed_lsn,
    trust_messages,
    wait_until,
)
from tests.kafka_helpers import Record, consume_all

# Every test here runs for each output plugin (pgoutput, wal2json).
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("plugin")]


def _emit(conn: psycopg.Connection[tuple[object, ...]], event: dict[str, object]) -> None:
    conn.execute(
        "SELECT pg_logical_emit_message(true, 'outbox', %s)", (orjson.dumps(event).decode(),)
    )


def _ids(records: list[Record]) -> list[str]:
    return [(r.header("id") or b"").decode() for r in records]


def test_logical_messages_are_events_in_commit_order_with_rows(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    create_outbox(database)
    topic = f"{unique}.order"
    broker.create_topic(topic, partitions=1)
    env = {**relay_env(database, broker.bootstrap_servers, unique), **trust_messages(database)}
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        expected: list[str] = []
        with psycopg.connect(database) as conn:
            for n in range(3):
                with conn.transaction():
                    row = new_event(payload={"n": n, "via": "table"})
                    insert_events(conn, [row])
                    message_id = str(uuid.uuid4())
                    _emit(
                        conn,
                        {
                            "id": message_id,
                            "aggregate_type": "order",
                            "aggregate_id": "a-1",
                            "event_type": "message_event",
                            "payload": {"n": n, "via": "message", "text": "Zürich 東京"},
                            "headers": {"tenant": "acme", "attempt": 2},
                        },
                    )
                    last = new_event(payload={"n": n, "via": "table-after"})
                    insert_events(conn, [last])
                    expected += [row.id, message_id, last.id]
            # Ignored: a non-transactional message, another prefix, a rolled-back message.
            conn.execute("SELECT pg_logical_emit_message(false, 'outbox', '{\"id\": \"x\"}')")
            conn.execute("SELECT pg_logical_emit_message(true, 'other', '{\"id\": \"y\"}')")
            conn.commit()
            with conn.transaction():
                _emit(conn, {"id": "rolled-back", "aggregate_type": "order"})
                raise psycopg.Rollback()
        records = consume_all(broker.bootstrap_servers, [topic], len(expected), 30, grace=1.0)
        assert relay.stop() == 0
    finally:
        relay.close()
    assert _ids(records) == expected, "rows and messages keep their commit and insert order"
    message = records[1]
    assert message.key == b"a-1"
    assert message.header("event_type") == b"message_event"
    assert message.header("tenant") == b"acme"
    assert message.header("attempt") == b"2"
    assert orjson.loads(message.value or b"") == {"n": 0, "via": "message", "text": "Zürich 東京"}


DEBEZIUM_DDL = """
CREATE TABLE outboxevent (
    id uuid PRIMARY KEY,
    aggregatetype varchar(255) NOT NULL,
    aggregateid varchar(255) NOT NULL,
    type varchar(255) NOT NULL,
    payload jsonb,
    tenant text,
    destination text
)
"""


def test_debezium_style_table_by_configuration_only(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(DEBEZIUM_DDL.encode())
    routed = f"{unique}.routed"
    columns = {
        "aggregate_type": "aggregatetype",
        "aggregate_id": "aggregateid",
        "event_type": "type",
        "headers": None,
        "created_at": None,
        "topic": "destination",
        "header_columns": ["tenant"],
    }
    env = relay_env(
        database,
        broker.bootstrap_servers,
        unique,
        outbox_table="public.outboxevent",
        outbox_columns=orjson.dumps(columns).decode(),
        topic_template=f"{unique}.{{aggregate_type}}.{{table}}",
    )
    relay = RelayProcess(env).start()
    first, second = str(uuid.uuid4()), str(uuid.uuid4())
    try:
        relay.wait_streaming()
        with psycopg.connect(database, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO outboxevent VALUES (%s, 'Order', 'o-9', 'OrderCreated', "
                "'{\"total\": 3}', 'acme', NULL), (%s, 'Order', 'o-9', 'OrderPaid', '{}', "
                "'acme', %s)",
                (first, second, routed),
            )
        by_template = consume_all(
            broker.bootstrap_servers, [f"{unique}.Order.outboxevent"], 1, 30, grace=0.5
        )
        by_column = consume_all(broker.bootstrap_servers, [routed], 1, 30, grace=0.5)
        assert relay.stop() == 0
    finally:
        relay.close()
    (record,) = by_template
    assert _ids(by_template) == [first]
    assert record.key == b"o-9"
    assert record.header("event_type") == b"OrderCreated"
    assert record.header("aggregate_type") == b"Order"
    assert record.header("tenant") == b"acme"
    assert orjson.loads(record.value or b"") == {"total": 3}
    assert _ids(by_column) == [second], "a per-row topic column overrides the template"


def test_two_outbox_tables_share_one_slot(database: str, broker: KafkaBroker, unique: str) -> None:
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(b"CREATE SCHEMA sales; CREATE SCHEMA billing")
        for schema in ("sales", "billing"):
            conn.execute(
                f"CREATE TABLE {schema}.outbox (id uuid PRIMARY KEY, aggregate_type text NOT NULL,"
                " aggregate_id text NOT NULL, event_type text NOT NULL, payload jsonb NOT NULL,"
                " routing_key text)".encode()
            )
    tables = [
        {"table": "sales.outbox", "topic_template": f"{unique}.{{schema}}.{{aggregate_type}}"},
        {
            "table": "billing.outbox",
            "columns": {"key": "routing_key", "headers": None},
            "topic_template": f"{unique}.billing-events",
        },
    ]
    env = relay_env(
        database, broker.bootstrap_servers, unique, outbox_tables=orjson.dumps(tables).decode()
    )
    relay = RelayProcess(env).start()
    ids = [str(uuid.uuid4()) for _ in range(3)]
    try:
        relay.wait_streaming()
        with psycopg.connect(database) as conn:
            conn.execute(
                "INSERT INTO sales.outbox VALUES (%s, 'order', 'o-1', 'created', '{}', NULL)",
                (ids[0],),
            )
            conn.execute(
                "INSERT INTO billing.outbox VALUES (%s, 'invoice', 'i-1', 'issued', '{}', 'rk')",
                (ids[1],),
            )
            conn.execute(
                "INSERT INTO sales.outbox VALUES (%s, 'order', 'o-1', 'paid', '{}', NULL)",
                (ids[2],),
            )
            conn.commit()
        sales = consume_all(broker.bootstrap_servers, [f"{unique}.sales.order"], 2, 30, grace=0.5)
        billing = consume_all(broker.bootstrap_servers, [f"{unique}.billing-events"], 1, 30)
        assert relay.stop() == 0
    finally:
        relay.close()
    assert _ids(sales) == [ids[0], ids[2]]
    assert _ids(billing) == [ids[1]]
    assert billing[0].key == b"rk", "billing's key column replaces the aggregate id"
    publication = scalar(
        database,
        "SELECT string_agg(schemaname || '.' || tablename, ',' ORDER BY schemaname) "
        "FROM pg_publication_tables WHERE pubname = %s",
        f"pub_{unique}",
    )
    assert publication == "billing.outbox,sales.outbox"


def _partitions(bootstrap: str, topic: str) -> int:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "meta"})
    try:
        metadata = consumer.list_topics(topic, timeout=10)
        return len(metadata.topics[topic].partitions)
    finally:
        consumer.close()


def test_missing_topics_are_created_or_refused_by_policy(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    create_outbox(database)
    env = relay_env(database, broker.bootstrap_servers, unique, topic_partitions="5")
    relay = RelayProcess(env).start()
    created = new_event("created_by_relay")
    try:
        relay.wait_streaming()
        with psycopg.connect(database) as conn:
            insert_events(conn, [created])
            conn.commit()
        assert _ids(
            consume_all(broker.bootstrap_servers, [f"{unique}.created_by_relay"], 1, 30)
        ) == [created.id]
        assert relay.stop() == 0
    finally:
        relay.close()
    assert _partitions(broker.bootstrap_servers, f"{unique}.created_by_relay") == 5

    broker.create_topic(f"{unique}.dead_letter", partitions=1)
    refused = new_event("nobody_created_this")
    relay = RelayProcess({**env, "CDC_RELAY_MISSING_TOPICS": "fail"}).start()
    try:
        relay.wait_streaming()
        with psycopg.connect(database) as conn:
            insert_events(conn, [refused])
            conn.commit()
        (dead,) = consume_all(broker.bootstrap_servers, [f"{unique}.dead_letter"], 1, 30)
        assert relay.stop() == 0
    finally:
        relay.close()
    assert dead.header("cdc_relay.event_id") == refused.id.encode()
    assert f"{unique}.nobody_created_this" in (dead.header("cdc_relay.error") or b"").decode()
    assert b"CDC_RELAY_MISSING_TOPICS=fail" in (dead.header("cdc_relay.error") or b"")


def test_heartbeat_keeps_an_idle_slot_moving(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    create_outbox(database)
    slot = f"slot_{unique}"
    env = relay_env(
        database,
        broker.bootstrap_servers,
        unique,
        heartbeat_interval="0.5",
        idle_confirm_interval="1",
    )
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        first = slot_confirmed_lsn(database, slot)
        wait_until(
            lambda: slot_confirmed_lsn(database, slot) > first, 15, "a heartbeat to be confirmed"
        )
        second = slot_confirmed_lsn(database, slot)
        wait_until(
            lambda: slot_confirmed_lsn(database, slot) > second, 15, "the slot to keep moving"
        )
        assert relay.stop() == 0
        logs = relay.logs()
    finally:
        relay.close()
    assert "published=0" in logs, "heartbeats are never relayed as events"
