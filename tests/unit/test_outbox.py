"""Unit tests for cdc_relay.outbox: an outbox row (pgoutput tuple) becomes a Kafka record."""

from __future__ import annotations

import tracemalloc

import orjson
import pytest

from cdc_relay.decode.messages import UNCHANGED_TOAST, Relation, RelationColumn, TupleData, Value
from cdc_relay.outbox import MessageMapping, OutboxMapping, OutboxRecord
from cdc_relay.value_text import MalformedEvent

TEXT, UUID, JSONB = 25, 2950, 3802
TYPES = {"id": UUID, "payload": JSONB, "headers": JSONB}
DEFAULT_COLUMNS = (
    "id",
    "aggregate_type",
    "aggregate_id",
    "event_type",
    "payload",
    "headers",
    "created_at",
)
EVENT_ID = "6f1c1f0e-5d2b-4a8e-9b7a-0c4d2e1f3a5b"
TEMPLATE = "outbox.event.{aggregate_type}"


def relation(
    columns: tuple[str, ...] = DEFAULT_COLUMNS, namespace: str = "public", name: str = "outbox"
) -> Relation:
    return Relation(
        relation_id=16_385,
        namespace=namespace,
        name=name,
        replica_identity="d",
        columns=tuple(
            RelationColumn(
                flags=1 if column == "id" else 0,
                name=column,
                type_oid=TYPES.get(column, TEXT),
                type_modifier=-1,
            )
            for column in columns
        ),
        xid=None,
    )


def row(columns: tuple[str, ...] = DEFAULT_COLUMNS, /, **values: Value) -> TupleData:
    """A tuple in ``columns`` order; unspecified columns get a typical value."""
    typical: dict[str, Value] = {
        "id": EVENT_ID.encode(),
        "aggregate_type": b"order",
        "aggregate_id": b"order-42",
        "event_type": b"OrderPlaced",
        "payload": b'{"total": 12.50, "items": [1, 2]}',
        "headers": None,
        "created_at": b"2024-05-01 12:00:00+00",
    }
    typical.update(values)
    return tuple(typical.get(column) for column in columns)


def map_row(template: str = TEMPLATE, /, **values: Value) -> OutboxRecord:
    return OutboxMapping(relation(), template).map(row(**values))


def malformed(mapping: OutboxMapping, data: TupleData) -> MalformedEvent:
    with pytest.raises(MalformedEvent) as info:
        mapping.map(data)
    return info.value


# -- the contract ---------------------------------------------------------------------------------


def test_maps_a_typical_row() -> None:
    record = map_row()
    assert record == OutboxRecord(
        topic="outbox.event.order",
        key=b"order-42",
        value=b'{"total": 12.50, "items": [1, 2]}',
        headers=[
            ("id", EVENT_ID.encode()),
            ("event_type", b"OrderPlaced"),
            ("aggregate_type", b"order"),
        ],
        event_id=EVENT_ID,
    )


def test_payload_passes_through_byte_for_byte() -> None:
    payload = b'{"b": 1.10, "a": "\\u00e9", "n": 123456789012345678901234567890}'
    assert map_row(payload=payload).value == payload


def test_payload_that_is_not_an_object_passes_through() -> None:
    assert map_row(payload=b"null").value == b"null"
    assert map_row(payload=b'"text"').value == b'"text"'


def test_key_is_aggregate_id_utf8() -> None:
    key = "client-é-🎉".encode()
    assert map_row(aggregate_id=key).key == key


@pytest.mark.parametrize(
    ("template", "topic"),
    [
        ("outbox.event.{aggregate_type}", "outbox.event.order"),
        ("{event_type}", "OrderPlaced"),
        ("{schema}.{table}", "sales.events"),
        ("{schema}.{table}.{aggregate_type}.{event_type}", "sales.events.order.OrderPlaced"),
        ("static", "static"),
        ("x.{{literal}}.{aggregate_type}", "x.{literal}.order"),
    ],
)
def test_topic_template_fields(template: str, topic: str) -> None:
    mapping = OutboxMapping(relation(namespace="sales", name="events"), template)
    assert mapping.table == "sales.events"
    assert mapping.map(row()).topic == topic


def test_topic_follows_each_row() -> None:
    mapping = OutboxMapping(relation(), "{aggregate_type}.{event_type}")
    topics = [
        mapping.map(row(aggregate_type=a, event_type=e)).topic
        for a, e in [(b"order", b"Placed"), (b"invoice", b"Placed"), (b"order", b"Shipped")] * 2
    ]
    assert topics == [
        "order.Placed",
        "invoice.Placed",
        "order.Shipped",
        "order.Placed",
        "invoice.Placed",
        "order.Shipped",
    ]


def test_topic_stays_right_beyond_the_cache_limit() -> None:
    mapping = OutboxMapping(relation(), TEMPLATE)
    for i in range(4200):
        assert mapping.map(row(aggregate_type=f"agg{i}".encode())).topic == f"outbox.event.agg{i}"
    assert mapping.map(row(aggregate_type=b"agg0")).topic == "outbox.event.agg0"


def test_unicode_aggregate_type_in_topic() -> None:
    assert map_row(aggregate_type="zählung".encode()).topic == "outbox.event.zählung"


# -- headers --------------------------------------------------------------------------------------


def test_custom_headers_follow_the_standard_ones_in_order() -> None:
    headers = (
        b'{"traceparent": "00-abc-def-01", "tenant": "acme", "attempt": 3, "urgent": true, '
        b'"ratio": 0.5, "nothing": null, "tags": ["a", "b"], "ctx": {"k": "v"}, "empty": ""}'
    )
    record = map_row(headers=headers)
    assert record.headers == [
        ("id", EVENT_ID.encode()),
        ("event_type", b"OrderPlaced"),
        ("aggregate_type", b"order"),
        ("traceparent", b"00-abc-def-01"),
        ("tenant", b"acme"),
        ("attempt", b"3"),
        ("urgent", b"true"),
        ("ratio", b"0.5"),
        ("nothing", b"null"),
        ("tags", b'["a", "b"]'),  # the JSON text exactly as stored
        ("ctx", b'{"k": "v"}'),
        ("empty", b""),
    ]


def test_string_headers_are_raw_utf8_not_json() -> None:
    record = map_row(headers='{"who": "Zoë \\"the\\" admin", "esc": "\\u00e9"}'.encode())
    assert record.headers[3:] == [("who", 'Zoë "the" admin'.encode()), ("esc", "é".encode())]


def test_large_numeric_header_keeps_its_json_text() -> None:
    # jsonb numbers are arbitrary-precision numerics; the header must be the number's JSON text.
    record = map_row(headers=b'{"sequence": 123456789012345678901234567890}')
    assert record.headers[3:] == [("sequence", b"123456789012345678901234567890")]


def test_null_headers_column() -> None:
    assert len(map_row(headers=None).headers) == 3


def test_json_null_headers() -> None:
    assert len(map_row(headers=b"null").headers) == 3


def test_empty_headers_object() -> None:
    assert len(map_row(headers=b"{}").headers) == 3


def test_no_headers_column_at_all() -> None:
    columns = ("id", "aggregate_type", "aggregate_id", "event_type", "payload")
    mapping = OutboxMapping(relation(columns), TEMPLATE)
    assert mapping.missing == []
    record = mapping.map(row(columns))
    assert [name for name, _ in record.headers] == ["id", "event_type", "aggregate_type"]


@pytest.mark.parametrize("headers", [b"[1, 2]", b'"text"', b"42", b"true"])
def test_headers_not_an_object(headers: bytes) -> None:
    error = malformed(OutboxMapping(relation(), TEMPLATE), row(headers=headers))
    assert "headers" in str(error)
    assert "object" in str(error)
    assert error.event_id == EVENT_ID


def test_headers_not_json() -> None:
    error = malformed(OutboxMapping(relation(), TEMPLATE), row(headers=b"{not json"))
    assert "headers" in str(error)
    assert error.event_id == EVENT_ID


# -- column layout --------------------------------------------------------------------------------


def test_column_order_differs_from_the_default() -> None:
    columns = (
        "created_at",
        "headers",
        "payload",
        "event_type",
        "aggregate_id",
        "id",
        "aggregate_type",
    )
    mapping = OutboxMapping(relation(columns), TEMPLATE)
    record = mapping.map(row(columns, headers=b'{"h": "v"}'))
    assert record == OutboxRecord(
        topic="outbox.event.order",
        key=b"order-42",
        value=b'{"total": 12.50, "items": [1, 2]}',
        headers=[
            ("id", EVENT_ID.encode()),
            ("event_type", b"OrderPlaced"),
            ("aggregate_type", b"order"),
            ("h", b"v"),
        ],
        event_id=EVENT_ID,
    )


def test_extra_columns_are_ignored() -> None:
    columns = ("tenant", *DEFAULT_COLUMNS, "processed")
    mapping = OutboxMapping(relation(columns), TEMPLATE)
    assert mapping.map(row(columns, tenant=b"acme", processed=b"f")).key == b"order-42"


def test_missing_required_column_names_it_and_the_event() -> None:
    columns = ("id", "aggregate_type", "aggregate_id", "event_type", "headers")
    mapping = OutboxMapping(relation(columns), TEMPLATE)
    assert mapping.missing == ["payload"]
    error = malformed(mapping, row(columns))
    assert "public.outbox" in str(error)
    assert "payload" in str(error)
    assert error.event_id == EVENT_ID


def test_several_missing_columns_are_all_named() -> None:
    columns = ("id", "aggregate_type", "payload")
    mapping = OutboxMapping(relation(columns, namespace="app", name="events"), TEMPLATE)
    assert mapping.missing == ["aggregate_id", "event_type"]
    error = malformed(mapping, row(columns))
    assert str(error) == "app.events has no column(s) aggregate_id, event_type"
    assert error.event_id == EVENT_ID


def test_missing_id_column_gives_no_event_id() -> None:
    columns = ("aggregate_type", "aggregate_id", "event_type", "payload")
    mapping = OutboxMapping(relation(columns), TEMPLATE)
    assert mapping.missing == ["id"]
    error = malformed(mapping, row(columns))
    assert "id" in str(error)
    assert error.event_id is None


def test_missing_column_with_null_id_gives_no_event_id() -> None:
    columns = ("id", "aggregate_type", "aggregate_id", "event_type")
    error = malformed(OutboxMapping(relation(columns), TEMPLATE), row(columns, id=None))
    assert error.event_id is None


@pytest.mark.parametrize("column", ["aggregate_type", "aggregate_id", "event_type", "payload"])
def test_null_required_value(column: str) -> None:
    error = malformed(OutboxMapping(relation(), TEMPLATE), row(**{column: None}))
    assert str(error) == f"column {column} is NULL"
    assert error.event_id == EVENT_ID


def test_null_id() -> None:
    error = malformed(OutboxMapping(relation(), TEMPLATE), row(id=None))
    assert str(error) == "column id is NULL"
    assert error.event_id is None


def test_unchanged_toast_required_value() -> None:
    error = malformed(OutboxMapping(relation(), TEMPLATE), row(payload=UNCHANGED_TOAST))
    assert str(error) == "column payload is an unchanged TOAST value"
    assert error.event_id == EVENT_ID


def test_row_shorter_than_the_relation() -> None:
    error = malformed(OutboxMapping(relation(), TEMPLATE), row()[:3])
    assert "NULL" in str(error)
    assert error.event_id == EVENT_ID


def test_malformed_event_is_a_value_error() -> None:
    error = MalformedEvent("reason", "id-1")
    assert isinstance(error, ValueError)
    assert str(error) == "reason"
    assert error.event_id == "id-1"
    assert MalformedEvent("reason").event_id is None


@pytest.mark.parametrize("column", ["aggregate_type", "event_type", "id"])
def test_invalid_utf8_is_a_malformed_event(column: str) -> None:
    with pytest.raises(MalformedEvent):
        OutboxMapping(relation(), TEMPLATE).map(row(**{column: b"bad\xff\xfe"}))


# -- describe_row ---------------------------------------------------------------------------------


def test_describe_row() -> None:
    mapping = OutboxMapping(relation(), TEMPLATE)
    data = row(payload=UNCHANGED_TOAST, headers=None, aggregate_id=b"bad\xffbyte")
    described = mapping.describe_row(data)
    assert isinstance(described, bytes)
    parsed = orjson.loads(described)
    assert list(parsed) == list(DEFAULT_COLUMNS)
    assert parsed == {
        "id": EVENT_ID,
        "aggregate_type": "order",
        "aggregate_id": "bad\ufffdbyte",
        "event_type": "OrderPlaced",
        "payload": "<unchanged toast>",
        "headers": None,
        "created_at": "2024-05-01 12:00:00+00",
    }


def test_describe_row_keeps_json_columns_as_text() -> None:
    described = OutboxMapping(relation(), TEMPLATE).describe_row(row(headers=b'{"a": 1}'))
    parsed = orjson.loads(described)
    assert parsed["payload"] == '{"total": 12.50, "items": [1, 2]}'
    assert parsed["headers"] == '{"a": 1}'


def test_describe_row_of_a_short_row_and_a_malformed_relation() -> None:
    columns = ("id", "aggregate_type", "payload")
    mapping = OutboxMapping(relation(columns), TEMPLATE)
    assert orjson.loads(mapping.describe_row((b"e1",))) == {"id": "e1"}
    assert orjson.loads(mapping.describe_row(())) == {}


# -- hostile rows (issue 11) ----------------------------------------------------------------------


def test_deeply_nested_headers_are_a_malformed_event_not_a_recursion_error() -> None:
    deep = b'{"h": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    error = malformed(OutboxMapping(relation(), TEMPLATE), row(headers=deep))
    assert "nested too deeply" in str(error)
    assert error.event_id == EVENT_ID


@pytest.mark.parametrize(
    ("headers", "problem"),
    [
        (b'{"\\ud800": "x"}', "lone surrogate"),  # a json column keeps it; librdkafka segfaults
        (b'{"a\\u0000b": "x"}', "NUL"),  # librdkafka would cut the name at the NUL
        (b'{"ok": "\\udc00"}', "lone surrogate"),
    ],
)
def test_header_names_and_values_librdkafka_cannot_take_are_refused(
    headers: bytes, problem: str
) -> None:
    error = malformed(OutboxMapping(relation(), TEMPLATE), row(headers=headers))
    assert problem in str(error)
    assert error.event_id == EVENT_ID


def test_escaped_but_valid_header_names_pass() -> None:
    record = map_row(headers=b'{"caf\\u00e9": "\\ud83d\\ude80"}')
    assert record.headers[3:] == [("café", "🚀".encode())]


def _typed_relation(payload_oid: int) -> Relation:
    base = relation()
    columns = tuple(
        RelationColumn(c.flags, c.name, payload_oid if c.name == "payload" else c.type_oid, -1)
        for c in base.columns
    )
    return Relation(base.relation_id, base.namespace, base.name, "d", columns, None)


BYTEA, JSON = 17, 114


@pytest.mark.parametrize(
    ("text", "value"),
    [
        (b"\\x7b7d", b"{}"),
        (b"\\x", b""),
        (b"\\x00ff80", b"\x00\xff\x80"),
        (b"ab\\\\c\\000\\377", b"ab\\c\x00\xff"),  # bytea_output = escape
        (b"plain", b"plain"),
    ],
)
def test_bytea_payload_is_published_as_its_bytes(text: bytes, value: bytes) -> None:
    assert OutboxMapping(_typed_relation(BYTEA), TEMPLATE).map(row(payload=text)).value == value


@pytest.mark.parametrize("text", [b"\\x7", b"\\xzz", b"a\\9", b"\\x7b 7d", b"\\x7b7d\n"])
def test_bytea_payload_that_is_not_bytea_text_is_refused(text: bytes) -> None:
    error = malformed(OutboxMapping(_typed_relation(BYTEA), TEMPLATE), row(payload=text))
    assert "bytea" in str(error)


def test_a_large_bytea_payload_costs_no_more_memory_than_its_bytes() -> None:
    """A bytea of a few megabytes: its bytes, with memory for about its text and bytes, not the
    ~150 bytes per byte a backtracking regex keeps (4 MB took 636 MB; 200 MB exhausted 24 GB)."""
    size = 4 * 1024 * 1024
    text = b"\\x" + b"7b" * size
    mapping = OutboxMapping(_typed_relation(BYTEA), TEMPLATE)
    tracemalloc.start()
    try:
        value = mapping.map(row(payload=text)).value
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert value == b"{" * size
    assert peak < 2 * size, f"{peak / size:.0f} bytes of memory per byte of payload"


@pytest.mark.parametrize(
    "payload",
    [
        b'{"a": 1}',
        b"123456789012345678901234567890",  # beyond orjson: still JSON
        b"1e400",
        b'"\\ud800"',  # a lone surrogate escape is JSON text
        b"[" * 1000 + b"]" * 1000,
    ],
)
def test_text_payload_that_is_json_passes_through(payload: bytes) -> None:
    assert OutboxMapping(_typed_relation(TEXT), TEMPLATE).map(row(payload=payload)).value == payload


@pytest.mark.parametrize(
    ("payload", "problem"),
    [
        (b"{not json", "not valid JSON"),
        (b"", "not valid JSON"),
        (b"NaN", "not valid JSON"),
        (b'{"a": 1} trailing', "not valid JSON"),
        (b"\xff", "not valid UTF-8"),
        (b"[" * 1025 + b"]" * 1025, "nested"),
        (b"[" * 200_000, "nested"),
    ],
)
def test_text_payload_that_is_not_json_is_refused(payload: bytes, problem: str) -> None:
    error = malformed(OutboxMapping(_typed_relation(TEXT), TEMPLATE), row(payload=payload))
    assert problem in str(error)
    assert "payload" in str(error)
    assert error.event_id == EVENT_ID


def test_json_payload_passes_through_unchecked() -> None:
    # PostgreSQL checked a json column's text; the relay does not parse it again.
    mapping = OutboxMapping(_typed_relation(JSON), TEMPLATE)
    assert mapping.map(row(payload=b'{"a":1,"a":2}')).value == b'{"a":1,"a":2}'


def test_message_header_names_with_nul_are_refused() -> None:
    content = orjson.dumps(
        {
            "id": "e-1",
            "aggregate_type": "order",
            "aggregate_id": "o-1",
            "event_type": "created",
            "payload": {},
            "headers": {"a\u0000b": "x"},
        }
    )
    with pytest.raises(MalformedEvent, match="NUL"):
        MessageMapping("outbox", TEMPLATE).map(content)


@pytest.mark.parametrize("where", ["payload", "header"])
def test_a_logical_message_nested_too_deeply_to_write_back_is_malformed(where: str) -> None:
    # orjson reads 1,024 levels but writes 254: 300 levels parse and cannot be written back.
    deep = b"[" * 300 + b"]" * 300
    fields = b'{"id": "e1", "aggregate_type": "t", "aggregate_id": "a", "event_type": "x", '
    tail = (
        b'"payload": ' + deep + b"}"
        if where == "payload"
        else b'"payload": 1, "headers": {"h": ' + deep + b"}}"
    )
    with pytest.raises(MalformedEvent, match="nested too deeply"):
        MessageMapping("outbox", "{aggregate_type}").map(fields + tail)
