"""Property tests of the outbox mapping: whatever a row or logical message holds, mapping it returns
a record librdkafka can take or raises MalformedEvent — no other exception, never a header name
that would crash or be cut by librdkafka."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdc_relay.dead_letter import header_name_ok
from cdc_relay.decode.messages import UNCHANGED_TOAST, Relation, RelationColumn, Value
from cdc_relay.outbox import MessageMapping, OutboxMapping, OutboxRecord
from cdc_relay.shaped_mapping import ShapedMapping
from cdc_relay.value_text import MalformedEvent
from tests.hostile_values import json_texts

COLUMNS = (
    "id",
    "aggregate_type",
    "aggregate_id",
    "event_type",
    "payload",
    "headers",
    "traceparent",
)
TEXT, UUID, JSONB, JSON, BYTEA, UNKNOWN = 25, 2950, 3802, 114, 17, 0
PAYLOAD_TYPES = (JSONB, JSON, TEXT, BYTEA, UNKNOWN)
TEMPLATE = "outbox.{aggregate_type}.{event_type}"


def _relation(payload_type: int, headers_type: int) -> Relation:
    types = {"id": UUID, "payload": payload_type, "headers": headers_type}
    return Relation(
        1,
        "public",
        "outbox",
        "d",
        tuple(RelationColumn(0, name, types.get(name, TEXT), -1) for name in COLUMNS),
        None,
    )


_TEXTS = json_texts(json_only=True, invalid=True).map(str.encode)
_VALUES: st.SearchStrategy[Value] = st.one_of(
    st.none(),
    st.just(UNCHANGED_TOAST),
    st.binary(max_size=40),
    _TEXTS,
    st.sampled_from([b"\\x7b7d", b"\\x7", b"a\\000", b"\xff\xfe", b"\xed\xa0\x80", b"null", b""]),
)


def _check_record(record: OutboxRecord) -> None:
    assert isinstance(record.topic, str)
    assert isinstance(record.key, bytes)
    assert isinstance(record.value, bytes)
    for name, value in record.headers:
        assert header_name_ok(name), name
        assert isinstance(value, bytes)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    payload_type=st.sampled_from(PAYLOAD_TYPES),
    headers_type=st.sampled_from((JSONB, JSON, TEXT)),
    values=st.lists(_VALUES, min_size=0, max_size=len(COLUMNS) + 1),
)
def test_a_row_maps_to_a_record_or_a_malformed_event(
    payload_type: int, headers_type: int, values: list[Value]
) -> None:
    mapping = OutboxMapping(_relation(payload_type, headers_type), TEMPLATE)
    row = tuple(values)
    try:
        record = mapping.map(row)
    except MalformedEvent:
        assert isinstance(mapping.describe_row(row), bytes)  # its dead-letter value
        return
    _check_record(record)


@settings(max_examples=400, deadline=None)
@given(
    payload_type=st.sampled_from(PAYLOAD_TYPES),
    payload=_VALUES,
    headers=st.one_of(st.none(), _TEXTS),
)
def test_a_well_formed_row_with_hostile_payload_and_headers(
    payload_type: int, payload: Value, headers: bytes | None
) -> None:
    mapping = OutboxMapping(_relation(payload_type, JSON), TEMPLATE)
    row = (b"e-1", b"order", b"o-1", b"created", payload, headers, None)
    try:
        record = mapping.map(row)
    except MalformedEvent as exc:
        event_id = exc.event_id
        assert event_id == "e-1", "the refusal names the row"
        return
    _check_record(record)


@settings(max_examples=400, deadline=None)
@given(
    content=st.one_of(
        st.binary(max_size=60),
        _TEXTS,
        st.fixed_dictionaries(
            {},
            optional={
                name: st.one_of(st.text(max_size=8), st.integers(), st.none(), st.just(""))
                for name in ("id", "aggregate_type", "aggregate_id", "event_type", "traceparent")
            },
        ).flatmap(
            lambda event: st.tuples(st.just(event), st.one_of(st.none(), _TEXTS), _TEXTS).map(
                lambda parts: _message(*parts)
            )
        ),
    )
)
def test_a_logical_message_maps_to_a_record_or_a_malformed_event(content: bytes) -> None:
    mapping = MessageMapping("outbox", TEMPLATE)
    try:
        record = mapping.map(content)
    except MalformedEvent:
        return
    _check_record(record)
    assert mapping.map_fields(content) == tuple(record)  # what the session publishes


def _message(event: Mapping[str, object], headers: bytes | None, payload: bytes) -> bytes:
    """A message's JSON object text with hostile ``payload`` and ``headers`` texts spliced in."""
    parts = [f"{json.dumps(name)}: {json.dumps(value)}" for name, value in event.items()]
    parts.append(f'"payload": {payload.decode()}')
    if headers is not None:
        parts.append(f'"headers": {headers.decode()}')
    return ("{" + ", ".join(parts) + "}").encode()


# Header names as a writer might spell the relay's own: exact, in other cases, with the relay's
# prefix, and near misses that are not reserved.
_NAME_TEXT = st.text(
    st.characters(exclude_categories=["Cs"], exclude_characters="\x00"), max_size=12
)
_HEADER_NAMES = st.one_of(
    _NAME_TEXT,
    st.sampled_from(
        [
            "id",
            "ID",
            "Id",
            "event_type",
            "EVENT_TYPE",
            "aggregate_type",
            "cdc_relay.position",
            "CDC_RELAY.POSITION",
            "cdc_relay.error",
            "cdc_relay.",
            "cdc_relay",
            "cdc_relayx",
            "ids",
            " id",
            "event-type",
            "traceparent",
            "tenant",
        ]
    ),
    _NAME_TEXT.map(lambda tail: "Cdc_Relay." + tail),
)
_RELAY_SET = ("id", "event_type", "aggregate_type")


def _is_reserved(name: str) -> bool:
    folded = name.casefold()
    return folded in _RELAY_SET or folded.startswith("cdc_relay.")


@settings(max_examples=300, deadline=None)
@given(
    entries=st.dictionaries(_HEADER_NAMES, st.one_of(st.text(max_size=5), st.integers())),
    message=st.booleans(),
)
def test_a_row_never_sends_a_header_name_the_relay_sets(
    entries: dict[str, object], message: bool
) -> None:
    headers = json.dumps(entries).encode()
    try:
        if message:
            record = MessageMapping("outbox", TEMPLATE).map(
                _message(
                    {"id": "e-1", "aggregate_type": "order", "aggregate_id": "o-1"}
                    | {"event_type": "created"},
                    headers,
                    b"{}",
                )
            )
        else:
            row = (b"e-1", b"order", b"o-1", b"created", b"{}", headers, None)
            record = OutboxMapping(_relation(JSONB, JSONB), TEMPLATE).map(row)
    except MalformedEvent as exc:
        refusal, event_id = str(exc), exc.event_id
        assert any(_is_reserved(name) for name in entries), refusal
        assert "reserved" in refusal
        assert event_id == "e-1"
        return
    assert not any(_is_reserved(name) for name in entries)
    names = [name for name, _ in record.headers]
    assert names[:3] == list(_RELAY_SET)
    assert names[3:] == list(entries)  # the row's own, each once, after the relay's
    assert record.headers[0] == ("id", b"e-1")


def _outcome(
    mapping: Callable[[tuple[Value, ...]], tuple[object, ...]], row: tuple[Value, ...]
) -> object:
    try:
        return tuple(mapping(row))
    except MalformedEvent as exc:
        return (str(exc), exc.event_id)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    payload_type=st.sampled_from(PAYLOAD_TYPES),
    shaped=st.booleans(),
    values=st.lists(_VALUES, min_size=0, max_size=len(COLUMNS) + 1),
)
def test_the_session_publishes_the_record_map_returns(
    payload_type: int, shaped: bool, values: list[Value]
) -> None:
    """map_fields (the session's, a plain tuple) is map's record field for field, or the same
    refusal, whatever the payload's type and for the general mapping too."""
    kind = ShapedMapping if shaped else OutboxMapping
    mapping = kind(_relation(payload_type, JSONB), TEMPLATE)
    row = tuple(values)
    assert _outcome(mapping.map_fields, row) == _outcome(mapping.map, row)
