"""Unit tests for cdc_relay.shaped_mapping: the general mapping's options (issue 14), on decoded
rows as both decoders deliver them (text bytes, None for NULL)."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from cdc_relay.config import OutboxColumns, OutboxTable, legal_topic, load_settings
from cdc_relay.decode.messages import UNCHANGED_TOAST, Relation, RelationColumn, TupleData, Value
from cdc_relay.errors import ConfigError
from cdc_relay.outbox import OutboxMapping, OutboxRecord
from cdc_relay.shaped_mapping import ShapedMapping, outbox_mapping
from cdc_relay.value_text import MalformedEvent

VARCHAR, TEXT, UUID, JSON, JSONB, BYTEA, INT4, BOOL, NUMERIC, TIMESTAMP = (
    1043,
    25,
    2950,
    114,
    3802,
    17,
    23,
    16,
    1700,
    1114,
)
STREAM = r"([^:]+)::([^-]+)-(.*)"
AGGREGATE = "5f0c1e2a-0b7d-4c55-8e0f-0a1b2c3d4e5f"

# A framework's unit-of-work table (issue 14).
FRAMEWORK = {
    "id": VARCHAR,
    "message_id": VARCHAR,
    "stream_name": VARCHAR,
    "type": VARCHAR,
    "data": JSON,
    "metadata_": BYTEA,
    "correlation_id": VARCHAR,
    "causation_id": VARCHAR,
    "status": VARCHAR,
    "target_broker": VARCHAR,
    "created_at": TIMESTAMP,
}
FRAMEWORK_ROW: dict[str, Value] = {
    "id": b"row-1",
    "message_id": b"msg-1",
    "stream_name": f"shop::order-{AGGREGATE}".encode(),
    "type": b"Shop.OrderPlaced.v1",
    "data": b'{"total": 12.50}',
    "metadata_": b"\\x" + b"\x00\xffmeta".hex().encode(),
    "correlation_id": b"corr-1",
    "causation_id": None,
    "status": b"pending",
    "target_broker": b"kafka",
    "created_at": b"2026-11-23 16:00:00.123456",
}
FRAMEWORK_COLUMNS: dict[str, Any] = {
    "id": "message_id",
    "aggregate_type": None,
    "aggregate_id": None,
    "event_type": "type",
    "payload": "data",
    "headers": None,
    "topic_from": {"column": "stream_name", "regex": STREAM, "replacement": "$1.$2"},
    "key_from": {"column": "stream_name", "regex": STREAM, "replacement": "$3"},
    "value": "envelope",
    "additional_placement": [
        "correlation_id:header",
        "causation_id:header",
        "type:envelope:type",
        "stream_name:envelope:stream",
        "metadata_:envelope:metadata",
    ],
}

# Debezium's documented outbox table.
DEBEZIUM = {
    "id": UUID,
    "aggregatetype": VARCHAR,
    "aggregateid": VARCHAR,
    "type": VARCHAR,
    "payload": JSONB,
}
DEBEZIUM_ROW: dict[str, Value] = {
    "id": b"6f1c1f0e-5d2b-4a8e-9b7a-0c4d2e1f3a5b",
    "aggregatetype": b"Order",
    "aggregateid": b"o-1",
    "type": b"OrderCreated",
    "payload": b'{"n": 1}',
}
DEBEZIUM_COLUMNS: dict[str, Any] = {
    "aggregate_type": "aggregatetype",
    "aggregate_id": "aggregateid",
    "event_type": "type",
    "headers": None,
    "created_at": None,
}


def relation(types: dict[str, int]) -> Relation:
    columns = tuple(RelationColumn(0, name, oid, -1) for name, oid in types.items())
    return Relation(16_400, "public", "outbox", "d", columns, None)


def mapping(
    types: dict[str, int], columns: dict[str, Any], template: str = "t.{aggregate_type}"
) -> OutboxMapping:
    return outbox_mapping(
        relation(types), template, "traceparent", OutboxColumns.model_validate(columns)
    )


def tuple_of(types: dict[str, int], values: dict[str, Value], **changes: Value) -> TupleData:
    merged = {**values, **changes}
    return tuple(merged.get(name) for name in types)


def framework(**changes: Value) -> OutboxRecord:
    return mapping(FRAMEWORK, FRAMEWORK_COLUMNS).map(tuple_of(FRAMEWORK, FRAMEWORK_ROW, **changes))


def refused(mapper: OutboxMapping, row: TupleData, reason: str) -> None:
    with pytest.raises(MalformedEvent, match=reason):
        mapper.map(row)


def test_framework_row_topic_per_category_bare_key_event_id_envelope() -> None:
    record = framework()
    assert record.topic == "shop.order"
    assert record.key == AGGREGATE.encode()
    assert record.event_id == "msg-1"
    headers = dict(record.headers)
    assert headers["id"] == b"msg-1"
    assert headers["event_type"] == b"Shop.OrderPlaced.v1"
    assert headers["correlation_id"] == b"corr-1"
    assert "causation_id" not in headers, "a NULL column sends no header"
    assert orjson.loads(record.value or b"") == {
        "payload": {"total": 12.5},
        "type": "Shop.OrderPlaced.v1",
        "stream": f"shop::order-{AGGREGATE}",
        "metadata": base64.b64encode(b"\x00\xffmeta").decode(),
    }
    assert b'"payload":{"total": 12.50}' in (record.value or b""), (
        "json embedded as PostgreSQL wrote it"
    )


def test_a_value_that_does_not_match_is_refused_not_routed() -> None:
    mapper = mapping(FRAMEWORK, FRAMEWORK_COLUMNS)
    refused(
        mapper,
        tuple_of(FRAMEWORK, FRAMEWORK_ROW, stream_name=b"no-separator"),
        "column stream_name does not match topic_from.regex",
    )
    refused(
        mapper,
        tuple_of(FRAMEWORK, FRAMEWORK_ROW, stream_name=None),
        "column stream_name is NULL",
    )


def test_a_transformed_topic_must_be_legal() -> None:
    columns = {**FRAMEWORK_COLUMNS, "topic_from": {**FRAMEWORK_COLUMNS["topic_from"]}}
    columns["topic_from"]["replacement"] = "$1::$2"
    refused(
        mapping(FRAMEWORK, columns),
        tuple_of(FRAMEWORK, FRAMEWORK_ROW),
        "topic_from gives 'shop::order', not a legal Kafka topic name",
    )
    refused(
        mapping(FRAMEWORK, FRAMEWORK_COLUMNS),
        tuple_of(FRAMEWORK, FRAMEWORK_ROW, stream_name="shop::ördér-1".encode()),
        "not a legal Kafka topic name",
    )


def test_whole_row_value_renders_types() -> None:
    types = {**DEBEZIUM, "n": INT4, "amount": NUMERIC, "ok": BOOL, "blob": BYTEA, "at": TIMESTAMP}
    values = {
        **DEBEZIUM_ROW,
        "n": b"-7",
        "amount": b"123456789012345678901234567890.10",
        "ok": b"f",
        "blob": b"\\x0001",
        "at": None,
    }
    record = mapping(types, {**DEBEZIUM_COLUMNS, "value": "row"}).map(tuple_of(types, values))
    assert orjson.loads(record.value or b"") == {
        "id": "6f1c1f0e-5d2b-4a8e-9b7a-0c4d2e1f3a5b",
        "aggregatetype": "Order",
        "aggregateid": "o-1",
        "type": "OrderCreated",
        "payload": {"n": 1},
        "n": -7,
        "amount": 1.2345678901234568e29,
        "ok": False,
        "blob": "AAE=",
        "at": None,
    }
    assert b'"amount":123456789012345678901234567890.10' in (record.value or b"")


def test_tombstones_only_when_configured() -> None:
    plain = mapping(DEBEZIUM, DEBEZIUM_COLUMNS)
    refused(plain, tuple_of(DEBEZIUM, DEBEZIUM_ROW, payload=None), "column payload is NULL")
    tombstones = mapping(DEBEZIUM, {**DEBEZIUM_COLUMNS, "tombstone_on_empty_payload": True})
    assert isinstance(tombstones, ShapedMapping)
    record = tombstones.map(tuple_of(DEBEZIUM, DEBEZIUM_ROW, payload=None))
    assert record.value is None
    assert record.key == b"o-1"
    assert record.topic == "t.Order"
    assert dict(record.headers)["id"] == DEBEZIUM_ROW["id"]
    assert tombstones.map(tuple_of(DEBEZIUM, DEBEZIUM_ROW)).value == b'{"n": 1}'
    text_payload = {**DEBEZIUM, "payload": TEXT}
    texts = mapping(text_payload, {**DEBEZIUM_COLUMNS, "tombstone_on_empty_payload": True})
    assert texts.map(tuple_of(text_payload, DEBEZIUM_ROW, payload=b"")).value is None
    refused(texts, tuple_of(text_payload, DEBEZIUM_ROW, payload=b"{"), "payload is not valid JSON")


def test_expand_json_payload_in_the_envelope() -> None:
    types = {**DEBEZIUM, "payload": TEXT}
    columns = {**DEBEZIUM_COLUMNS, "value": "envelope", "additional_placement": ["type:envelope"]}
    as_string = mapping(types, columns).map(tuple_of(types, DEBEZIUM_ROW))
    assert orjson.loads(as_string.value or b"") == {"payload": '{"n": 1}', "type": "OrderCreated"}
    expanded = mapping(types, {**columns, "expand_json_payload": True})
    record = expanded.map(tuple_of(types, DEBEZIUM_ROW))
    assert orjson.loads(record.value or b"") == {"payload": {"n": 1}, "type": "OrderCreated"}
    refused(expanded, tuple_of(types, DEBEZIUM_ROW, payload=b"nope"), "payload is not valid JSON")


def test_aggregate_type_optional_when_the_topic_does_not_need_it() -> None:
    without = {k: v for k, v in DEBEZIUM.items() if k != "aggregatetype"}
    columns = {**DEBEZIUM_COLUMNS, "aggregate_type": None}
    record = mapping(without, columns, "events.{table}").map(tuple_of(without, DEBEZIUM_ROW))
    assert record.topic == "events.outbox"
    assert record.headers[2] == ("aggregate_type", b"")
    # The column exists but is NULL in a row: fine for a template without it ...
    nullable = mapping(DEBEZIUM, DEBEZIUM_COLUMNS, "events.{event_type}")
    assert nullable.map(tuple_of(DEBEZIUM, DEBEZIUM_ROW, aggregatetype=None)).topic == (
        "events.OrderCreated"
    )
    # ... refused, saying why, when the template needs it.
    needs = mapping(DEBEZIUM, {**DEBEZIUM_COLUMNS, "tombstone_on_empty_payload": True})
    refused(
        needs,
        tuple_of(DEBEZIUM, DEBEZIUM_ROW, aggregatetype=None),
        "aggregatetype is NULL and the topic template needs it",
    )


def test_traceparent_keeps_its_header_place() -> None:
    types = {**DEBEZIUM, "traceparent": TEXT}
    trace = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    columns = {**DEBEZIUM_COLUMNS, "aggregate_type": None, "value": "row"}
    without = {k: v for k, v in types.items() if k != "aggregatetype"}
    record = mapping(without, columns, "x").map(tuple_of(without, DEBEZIUM_ROW, traceparent=trace))
    assert record.headers[3] == ("traceparent", trace)
    assert record.traceparent == trace


def test_missing_columns_unchanged_toast_and_short_rows_are_refused() -> None:
    lacking = {k: v for k, v in FRAMEWORK.items() if k != "correlation_id"}
    refused(
        mapping(lacking, FRAMEWORK_COLUMNS),
        tuple_of(lacking, FRAMEWORK_ROW),
        "has no column\\(s\\) correlation_id",
    )
    mapper = mapping(FRAMEWORK, FRAMEWORK_COLUMNS)
    refused(
        mapper, tuple_of(FRAMEWORK, FRAMEWORK_ROW, stream_name=UNCHANGED_TOAST), "unchanged TOAST"
    )
    refused(mapper, tuple_of(FRAMEWORK, FRAMEWORK_ROW)[:-1], "fewer columns")
    refused(
        mapper, tuple_of(FRAMEWORK, FRAMEWORK_ROW, type=b"\xff"), "column type is not valid UTF-8"
    )


def test_the_plain_mapping_is_kept_for_plain_settings() -> None:
    assert type(mapping(DEBEZIUM, DEBEZIUM_COLUMNS)) is OutboxMapping
    assert type(mapping(DEBEZIUM, DEBEZIUM_COLUMNS, "fixed")) is ShapedMapping
    assert type(mapping(FRAMEWORK, FRAMEWORK_COLUMNS)) is ShapedMapping


_TEXT = st.binary(max_size=12) | st.none()


@given(
    st.fixed_dictionaries(
        {
            "id": _TEXT,
            "aggregatetype": _TEXT | st.just(UNCHANGED_TOAST),
            "aggregateid": _TEXT,
            "type": _TEXT,
            "payload": st.sampled_from([b"{}", b"[1, 2.50]", b"", b"{", None]),
            "headers": st.sampled_from([None, b'{"a": "b", "n": 1}', b"[]"]),
            "tenant": _TEXT,
            "destination": st.sampled_from([None, b"", b"routed"]),
        }
    ),
    st.sampled_from([JSONB, TEXT, BYTEA]),
)
def test_for_plain_settings_the_general_mapping_is_the_plain_one(
    values: dict[str, Value], payload_type: int
) -> None:
    """The same record, or a refusal for the same row, whichever mapping runs."""
    types = {**DEBEZIUM, "payload": payload_type, "headers": JSONB, "tenant": TEXT}
    types["destination"] = TEXT
    columns = OutboxColumns.model_validate(
        {
            **DEBEZIUM_COLUMNS,
            "headers": "headers",
            "header_columns": ["tenant"],
            "topic": "destination",
        }
    )
    row = tuple_of(types, values)
    outcomes: list[OutboxRecord | str | None] = []
    for kind in (OutboxMapping, ShapedMapping):
        try:
            outcomes.append(kind(relation(types), "t.{aggregate_type}", "tp", columns).map(row))
        except MalformedEvent:
            outcomes.append(None)
        except Exception as exc:
            outcomes.append(type(exc).__name__)
    plain, general = outcomes
    if values["aggregatetype"] is None and isinstance(general, OutboxRecord):
        # The one difference: a NULL aggregate type is refused by the plain mapping only, and the
        # general one accepts it only where the topic did not need it (a topic column).
        assert plain is None
        assert general.topic == "routed"
        assert general.headers[2] == ("aggregate_type", b"")
    else:
        assert plain == general


@pytest.mark.parametrize(
    ("columns", "reason"),
    [
        ({"topic_from": {"column": "s", "regex": "(", "replacement": ""}}, "does not compile"),
        ({"key_from": {"column": "s", "regex": "(a)\\1", "replacement": "$1"}}, "backreferences"),
        ({"key_from": {"column": "s", "regex": "(a)", "replacement": "$3"}}, "group 3"),
        ({"topic": "t", "topic_from": {"column": "s", "regex": "x", "replacement": ""}}, "both"),
        ({"aggregate_id": None}, "key or key_from"),
        ({"additional_placement": ["a:partition"]}, "header or envelope"),
        ({"additional_placement": ["a:envelope"]}, '"value": "envelope"'),
        ({"value": "envelope", "additional_placement": ["a:envelope:payload"]}, "not named"),
        ({"aggregate_type": None}, "has no aggregate_type column"),
    ],
)
def test_invalid_mapping_settings_exit_naming_the_setting(
    columns: dict[str, Any], reason: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CDC_RELAY_OUTBOX_COLUMNS", orjson.dumps(columns).decode())
    with pytest.raises(ConfigError, match="CDC_RELAY_OUTBOX_COLUMNS") as info:
        load_settings(database_url="postgresql://h/db", kafka_bootstrap_servers="k:9092")
    assert reason in str(info.value)
    assert info.value.exit_code == 2


def test_per_table_settings_in_outbox_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    tables = [{"table": "public.events", "columns": FRAMEWORK_COLUMNS}]
    monkeypatch.setenv("CDC_RELAY_OUTBOX_TABLES", orjson.dumps(tables).decode())
    settings = load_settings(database_url="postgresql://h/db", kafka_bootstrap_servers="k:9092")
    (table,) = settings.tables()
    assert isinstance(table, OutboxTable)
    assert table.columns.key_from is not None
    assert "stream_name" in table.columns.mapped
    bad = [{"table": "public.events", "columns": {"aggregate_type": None}}]
    monkeypatch.setenv("CDC_RELAY_OUTBOX_TABLES", orjson.dumps(bad).decode())
    with pytest.raises(ConfigError, match="CDC_RELAY_OUTBOX_TABLES"):
        load_settings(database_url="postgresql://h/db", kafka_bootstrap_servers="k:9092")


_ANY_VALUE = st.none() | st.just(UNCHANGED_TOAST) | st.binary(max_size=40)
_PART = st.text("abc._", min_size=1, max_size=6) | st.text("ab.:-_ü", max_size=6)
_STREAMISH = st.builds(lambda a, b, c: f"{a}::{b}-{c}".encode(), _PART, _PART, st.text(max_size=8))


# Typical values with a few hostile ones; a json column holds JSON (PostgreSQL checked it) or NULL.
_HOSTILE = st.dictionaries(
    st.sampled_from([name for name in FRAMEWORK if name != "data"]), _ANY_VALUE, max_size=3
)
_FRAMEWORK_VALUES = st.builds(
    lambda hostile, data: {**FRAMEWORK_ROW, **hostile, "data": data},
    _HOSTILE,
    st.sampled_from([FRAMEWORK_ROW["data"], None, b"[]", b'"x"', b"1.50", b"{}"]),
)


@given(
    _FRAMEWORK_VALUES,
    _STREAMISH | _STREAMISH | _ANY_VALUE,
    st.sampled_from(["payload", "row", "envelope"]),
    st.booleans(),
    st.booleans(),
)
def test_any_row_is_a_record_or_a_malformed_event(
    values: dict[str, Value], stream: Value, shape: str, expand: bool, tombstones: bool
) -> None:
    """Hostile rows: the general mapping publishes (a legal topic, JSON or a tombstone as the
    value) or refuses with MalformedEvent; nothing else escapes."""
    columns = {
        **FRAMEWORK_COLUMNS,
        "value": shape,
        "expand_json_payload": expand,
        "tombstone_on_empty_payload": tombstones,
    }
    if shape != "envelope":
        columns["additional_placement"] = ["correlation_id:header", "causation_id:header"]
    mapper = mapping(FRAMEWORK, columns)
    try:
        record = mapper.map(tuple_of(FRAMEWORK, values, stream_name=stream))
    except MalformedEvent:
        event("refused")
        return
    event("published" if record.value is not None else "tombstone")
    assert legal_topic(record.topic)
    assert isinstance(record.key, bytes)
    if record.value is not None and shape != "payload":
        orjson.loads(record.value)


def _documented_example(marker: str) -> dict[str, Any]:
    """The JSON of CDC_RELAY_OUTBOX_COLUMNS in the documented example after ``marker``."""
    page = Path(__file__).resolve().parents[2] / "docs" / "how-to" / "adopt-existing-outbox.md"
    text = page.read_text()
    block = text[text.index(marker) :]
    start = block.index("CDC_RELAY_OUTBOX_COLUMNS='") + len("CDC_RELAY_OUTBOX_COLUMNS='")
    parsed: dict[str, Any] = orjson.loads(block[start : block.index("'", start)])
    return parsed


def test_the_documented_examples_do_what_the_docs_say() -> None:
    debezium = mapping(DEBEZIUM, _documented_example("**Debezium's documented table**"))
    record = debezium.map(tuple_of(DEBEZIUM, DEBEZIUM_ROW))
    assert record.topic == "outbox.event.Order"
    assert dict(record.headers)["eventType"] == b"OrderCreated"
    assert orjson.loads(record.value or b"") == {"payload": {"n": 1}, "eventType": "OrderCreated"}
    assert debezium.map(tuple_of(DEBEZIUM, DEBEZIUM_ROW, payload=None)).value is None

    framework = mapping(FRAMEWORK, _documented_example("**A framework's unit-of-work table**"))
    placed = framework.map(
        tuple_of(FRAMEWORK, FRAMEWORK_ROW, created_at=b"2026-11-23 16:00:00.5", causation_id=b"c")
    )
    assert placed.topic == "shop.order"
    assert placed.key == AGGREGATE.encode()
    assert [name for name, _ in placed.headers] == [
        "id",
        "event_type",
        "aggregate_type",
        "correlation_id",
        "causation_id",
    ]
    assert dict(placed.headers)["id"] == b"msg-1"
    assert orjson.loads(placed.value or b"") == {
        "payload": {"total": 12.5},
        "type": "Shop.OrderPlaced.v1",
        "stream": f"shop::order-{AGGREGATE}",
        "metadata": base64.b64encode(b"\x00\xffmeta").decode(),
        "created_at": "2026-11-23 16:00:00.5",
    }


def test_a_refused_setting_says_where_in_the_json(monkeypatch: pytest.MonkeyPatch) -> None:
    tables = [
        {"table": "a.b", "columns": {"key_from": {"column": "s", "regex": "(", "replacement": ""}}}
    ]
    monkeypatch.setenv("CDC_RELAY_OUTBOX_TABLES", orjson.dumps(tables).decode())
    with pytest.raises(ConfigError) as info:
        load_settings(database_url="postgresql://h/db", kafka_bootstrap_servers="k:9092")
    assert str(info.value).startswith(
        "invalid configuration: CDC_RELAY_OUTBOX_TABLES: [0].columns.key_from: regex does not "
    )


def test_the_general_mapping_refuses_a_row_header_the_relay_sets_itself() -> None:
    types = {**DEBEZIUM, "headers": JSONB}
    mapper = mapping(types, {**DEBEZIUM_COLUMNS, "headers": "headers"}, "t.{event_type}")
    assert isinstance(mapper, ShapedMapping)
    for forged in (
        b'{"id": "other"}',
        b'{"x": "1", "Event_Type": "y"}',
        b'{"cdc_relay.position": "s/1/1"}',
    ):
        refused(mapper, tuple_of(types, DEBEZIUM_ROW, headers=forged), "reserved")
    record = mapper.map(tuple_of(types, DEBEZIUM_ROW, headers=b'{"tenant": "t1"}'))
    assert [name for name, _ in record.headers] == ["id", "event_type", "aggregate_type", "tenant"]
