"""Outboxes written by other software, relayed by configuration only (issue 14): Debezium's
documented outbox table with the Outbox Event Router's options, and a framework's unit-of-work
table (topic per category, bare aggregate id as key, envelope value). Real PostgreSQL, the real
test broker, both output plugins."""

from __future__ import annotations

import base64
import uuid
from typing import Any

import orjson
import psycopg
import pytest

from tests.conftest import KafkaBroker
from tests.integration.framework_support import framework_columns
from tests.integration.relay_support import RelayProcess, relay_env
from tests.kafka_helpers import Record, consume_all

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("plugin")]

# Debezium's documented outbox table (its docs: "Outbox table structure"), and one with a text
# payload, which table.expand.json.payload is for.
DEBEZIUM_DDL = """
CREATE TABLE outbox (
    id uuid PRIMARY KEY,
    aggregatetype varchar(255) NOT NULL,
    aggregateid varchar(255) NOT NULL,
    type varchar(255) NOT NULL,
    payload jsonb
);
CREATE TABLE outbox_text (
    id uuid PRIMARY KEY,
    aggregatetype varchar(255) NOT NULL,
    aggregateid varchar(255) NOT NULL,
    type varchar(255) NOT NULL,
    payload varchar
);
"""

# The framework's table as issue 14 describes it.
FRAMEWORK_DDL = """
CREATE TABLE message_outbox (
    id varchar PRIMARY KEY,
    message_id varchar NOT NULL,
    stream_name varchar NOT NULL,
    type varchar NOT NULL,
    data json NOT NULL,
    metadata_ bytea,
    correlation_id varchar,
    causation_id varchar,
    status varchar NOT NULL DEFAULT 'pending',
    target_broker varchar NOT NULL,
    created_at timestamp without time zone NOT NULL DEFAULT now(),
    retry_count integer NOT NULL DEFAULT 0,
    UNIQUE (message_id, target_broker)
);
"""


def _debezium_columns(**options: Any) -> dict[str, Any]:
    """table.field.event.id/key/type/payload: Debezium's column names; the rest: the options."""
    return {
        "id": "id",
        "aggregate_type": "aggregatetype",
        "aggregate_id": "aggregateid",
        "event_type": "type",
        "payload": "payload",
        "headers": None,
        "created_at": None,
        **options,
    }


def test_debezium_outbox_with_the_event_router_options(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(DEBEZIUM_DDL.encode())
    # route.by.field=aggregatetype, route.topic.regex/replacement: Debezium's defaults, verbatim
    # but for the test's topic prefix.
    route = {
        "column": "aggregatetype",
        "regex": "(?<routedByValue>.*)",
        "replacement": f"{unique}.outbox.event.${{routedByValue}}",
    }
    tables = [
        {
            "table": "public.outbox",
            "columns": _debezium_columns(
                topic_from=route,
                tombstone_on_empty_payload=True,  # route.tombstone.on.empty.payload
                value="envelope",
                additional_placement=[  # table.fields.additional.placement
                    "type:header:eventType",
                    "type:envelope:eventType",
                    "aggregateid:envelope",
                ],
            ),
        },
        {
            "table": "public.outbox_text",
            "columns": _debezium_columns(
                topic_from=route,
                value="envelope",
                expand_json_payload=True,  # table.expand.json.payload
                additional_placement=["type:envelope:eventType"],
            ),
        },
    ]
    env = relay_env(
        database,
        broker.bootstrap_servers,
        unique,
        outbox_tables=orjson.dumps(tables).decode(),
    )
    order_topic = f"{unique}.outbox.event.Order"
    broker.create_topic(order_topic, partitions=1)
    broker.create_topic(f"{unique}.dead_letter", partitions=1)
    created, deleted, expanded, illegal = (str(uuid.uuid4()) for _ in range(4))
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        with psycopg.connect(database, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO outbox VALUES "
                "(%s, 'Order', 'o-1', 'OrderCreated', '{\"total\": 12.50}'), "
                "(%s, 'Order', 'o-1', 'OrderDeleted', NULL)",
                (created, deleted),
            )
            conn.execute(
                "INSERT INTO outbox_text VALUES (%s, 'Order', 'o-2', 'OrderNoted', "
                '\'{"note": "Zürich", "n": 1.10}\')',
                (expanded,),
            )
            # The route gives an illegal topic name: dead-lettered, never renamed.
            conn.execute(
                "INSERT INTO outbox VALUES (%s, 'Order::x', 'o-3', 'OrderOdd', '{}')", (illegal,)
            )
        records = consume_all(broker.bootstrap_servers, [order_topic], 3, 30, grace=0.5)
        dead = consume_all(broker.bootstrap_servers, [f"{unique}.dead_letter"], 1, 30, grace=0.5)
        assert relay.stop() == 0
    finally:
        relay.close()
    by_id = {(r.header("id") or b"").decode(): r for r in records}
    assert list(by_id) == [created, deleted, expanded]

    first = by_id[created]
    assert first.key == b"o-1"
    assert first.header("eventType") == b"OrderCreated"
    assert orjson.loads(first.value or b"") == {
        "payload": {"total": 12.50},
        "eventType": "OrderCreated",
        "aggregateid": "o-1",
    }
    tombstone = by_id[deleted]
    assert tombstone.value is None, "a NULL payload is a tombstone"
    assert tombstone.key == b"o-1"
    assert tombstone.header("event_type") == b"OrderDeleted"
    text = by_id[expanded]
    assert orjson.loads(text.value or b"") == {
        "payload": {"note": "Zürich", "n": 1.10},
        "eventType": "OrderNoted",
    }
    assert b'"n": 1.10' in (text.value or b""), "the payload's text is embedded as it was"

    (letter,) = dead
    assert letter.header("cdc_relay.event_id") == illegal.encode()
    reason = (letter.header("cdc_relay.error") or b"").decode()
    assert "not a legal Kafka topic name" in reason


def test_framework_outbox_topic_per_category_and_envelope(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(FRAMEWORK_DDL.encode())
    columns = framework_columns(
        unique,
        [
            "correlation_id:header",
            "causation_id:header",
            "type:envelope",
            "stream_name:envelope:stream",
            "metadata_:envelope:metadata",
            "created_at:envelope:occurred_at",
        ],
    )
    env = relay_env(
        database,
        broker.bootstrap_servers,
        unique,
        outbox_table="public.message_outbox",
        outbox_columns=orjson.dumps(columns).decode(),
    )
    topics = [f"{unique}.order", f"{unique}.payment"]
    for topic in topics:
        broker.create_topic(topic, partitions=1)
    order, payment = str(uuid.uuid4()), str(uuid.uuid4())
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        with psycopg.connect(database, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO message_outbox (id, message_id, stream_name, type, data, metadata_,"
                " correlation_id, causation_id, target_broker, created_at) VALUES"
                " ('row-1', 'msg-1', %s, 'Shop.OrderPlaced.v1', '{\"total\": 3}',"
                "  '\\x00ff'::bytea, 'corr-1', NULL, 'kafka', '2026-11-23 16:00:00.5'),"
                " ('row-2', 'msg-2', %s, 'Shop.PaymentTaken.v1', '[1, 2]',"
                "  NULL, 'corr-1', 'msg-1', 'kafka', '2026-11-23 16:00:01')",
                (f"shop::order-{order}", f"shop::payment-{payment}"),
            )
        received = consume_all(broker.bootstrap_servers, topics, 2, 30, grace=0.5)
        assert relay.stop() == 0
    finally:
        relay.close()
    by_topic: dict[str, Record] = {r.topic: r for r in received}
    assert sorted(by_topic) == sorted(topics), "one topic per category"
    placed = by_topic[f"{unique}.order"]
    assert placed.key == order.encode(), "the key is the bare aggregate id"
    assert placed.header("id") == b"msg-1", "the id header is the event id, not the row id"
    assert placed.header("event_type") == b"Shop.OrderPlaced.v1"
    assert placed.header("correlation_id") == b"corr-1"
    assert placed.header("causation_id") is None, "a NULL column sends no header"
    assert orjson.loads(placed.value or b"") == {
        "payload": {"total": 3},
        "type": "Shop.OrderPlaced.v1",
        "stream": f"shop::order-{order}",
        "metadata": base64.b64encode(b"\x00\xff").decode(),
        "occurred_at": "2026-11-23 16:00:00.5",
    }
    taken = by_topic[f"{unique}.payment"]
    assert taken.key == payment.encode()
    assert taken.header("causation_id") == b"msg-1"
    assert orjson.loads(taken.value or b"")["payload"] == [1, 2]
    assert orjson.loads(taken.value or b"")["metadata"] is None


def test_whole_row_value_renders_column_types_alike_with_both_plugins(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            b"CREATE TABLE typed_outbox (id uuid PRIMARY KEY, kind text,"
            b" aggregate_id text NOT NULL, event_type text NOT NULL, payload jsonb, n integer,"
            b" big numeric, ratio float8,"
            b" ok boolean, raw bytea, at timestamptz, tags text[])"
        )
    columns = {"aggregate_type": None, "headers": None, "created_at": None, "value": "row"}
    env = relay_env(
        database,
        broker.bootstrap_servers,
        unique,
        outbox_table="public.typed_outbox",
        outbox_columns=orjson.dumps(columns).decode(),
        topic_template=f"{unique}.{{table}}",
    )
    topic = f"{unique}.typed_outbox"
    broker.create_topic(topic, partitions=1)
    event_id = str(uuid.uuid4())
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        with psycopg.connect(database, autocommit=True) as conn:
            conn.execute("SET TimeZone = 'UTC'")
            conn.execute(
                "INSERT INTO typed_outbox VALUES (%s, NULL, 'a-1', 'Typed', '{\"k\": [1, 2.50]}',"
                " -7, 123456789012345678901234567890.10, 1.5, true, '\\x00ff'::bytea,"
                " '2026-11-23 16:00:00+00', ARRAY['a', 'b c'])",
                (event_id,),
            )
        (record,) = consume_all(broker.bootstrap_servers, [topic], 1, 30, grace=0.5)
        assert relay.stop() == 0
    finally:
        relay.close()
    assert record.key == b"a-1"
    value = record.value or b""
    row = orjson.loads(value)
    assert row["id"] == event_id
    assert row["kind"] is None
    assert row["payload"] == {"k": [1, 2.5]}
    assert row["n"] == -7
    assert b'"big":123456789012345678901234567890.10' in value, "numeric digits as written"
    assert row["ratio"] == 1.5
    assert row["ok"] is True
    assert base64.b64decode(row["raw"]) == b"\x00\xff"
    assert row["at"].startswith("2026-11-23 16:00:00"), "a timestamp travels as its text"
    assert row["tags"] == '{a,"b c"}', "an array travels as its text"
