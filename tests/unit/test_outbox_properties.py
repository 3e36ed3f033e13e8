"""Property tests of the outbox mapping: whatever a row or logical message holds, mapping it returns
a record librdkafka can take or raises MalformedEvent — no other exception, never a header name
that would crash or be cut by librdkafka."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdc_relay.config import OutboxColumns, ValueShape
from cdc_relay.dead_letter import header_name_ok
from cdc_relay.decode.messages import UNCHANGED_TOAST, Relation, RelationColumn, Value
from cdc_relay.outbox import MessageMapping, OutboxMapping, OutboxRecord
from cdc_relay.shaped_mapping import ShapedMapping
from cdc_relay.value_text import MalformedEvent
from tests.hostile_values import json_texts, pg_values, rendered

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
    return _typed_relation({"id": UUID, "payload": payload_type, "headers": headers_type})


def _typed_relation(types: Mapping[str, int]) -> Relation:
    """The outbox relation with these columns' types; any other column is text."""
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


# -- values of every type, at PostgreSQL's extremes --------------------------------------------

_JSON_OIDS = frozenset({JSON, JSONB})


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


# RFC 8259 with numbers of any size (kept as text, never converted) and without NaN/Infinity.
_STRICT_JSON = json.JSONDecoder(parse_int=str, parse_float=str, parse_constant=_reject_constant)


def _is_json(text: str) -> bool | None:
    """Whether ``text`` is one JSON text; None when it nests deeper than this parser goes."""
    try:
        _STRICT_JSON.decode(text)
    except RecursionError:
        return None
    except ValueError:
        return False
    return True


# Header values a jsonb object may hold: numbers of any size and exactness, strings, nesting.
_HEADER_VALUES = st.one_of(
    json_texts(json_only=False),
    st.sampled_from(
        ["9" * 5_000, "-" + "9" * 4_301 + ".5", "1e400", "-0", "1.10", "0." + "0" * 400 + "1"]
    ),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    payload=pg_values(),
    aggregate_id=pg_values(),
    header_values=st.lists(_HEADER_VALUES, max_size=3),
)
def test_a_value_of_any_type_is_published_exactly_or_refused_for_its_reason(
    payload: tuple[str, int, str | None],
    aggregate_id: tuple[str, int, str | None],
    header_values: list[str],
) -> None:
    """The plain mapping publishes what PostgreSQL printed, byte for byte: the key is the
    aggregate id's text whatever its type, a json/jsonb payload its text, a bytea payload its
    bytes, any other payload its text when that is JSON (a numeric of 131,072 digits is; NaN is
    not), each headers entry its exact JSON text (a 5,000-digit number included). A refusal is a
    MalformedEvent naming what is wrong, and only for what is wrong."""
    _, payload_oid, payload_text = payload
    _, key_oid, key_text = aggregate_id
    headers = "{" + ", ".join(f'"h{i}": {v}' for i, v in enumerate(header_values)) + "}"
    mapping = OutboxMapping(
        _typed_relation({"payload": payload_oid, "aggregate_id": key_oid, "headers": JSONB}),
        TEMPLATE,
    )
    row = (
        b"e-1",
        b"order",
        None if key_text is None else key_text.encode(),
        b"created",
        None if payload_text is None else payload_text.encode(),
        headers.encode(),
        None,
    )
    try:
        record = mapping.map(row)
    except MalformedEvent as exc:
        reason, event_id = str(exc), exc.event_id
        assert event_id == "e-1"
        if key_text is None:
            assert reason == "column aggregate_id is NULL"
        elif payload_text is None:
            assert reason == "column payload is NULL"
        elif reason == "column headers is nested too deeply":
            assert _is_json(headers) is None
        else:
            assert payload_oid not in _JSON_OIDS | {BYTEA}, reason
            assert not _is_json(payload_text), reason
            assert "payload is" in reason
        return
    _check_record(record)
    assert key_text is not None
    assert payload_text is not None
    assert record.key == key_text.encode()
    if payload_oid == BYTEA:
        assert record.value == bytes.fromhex(payload_text[2:])
    else:
        assert record.value == payload_text.encode()
        if payload_oid not in _JSON_OIDS:
            assert _is_json(payload_text) is not False
    expected = [
        (f"h{i}", json.loads(v).encode() if v.startswith('"') else v.encode())
        for i, v in enumerate(header_values)
    ]
    assert record.headers[3:] == expected


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(columns=st.lists(pg_values(), min_size=1, max_size=4))
def test_a_row_shaped_value_says_in_json_exactly_what_postgresql_printed(
    columns: list[tuple[str, int, str | None]],
) -> None:
    """``value: row``: each column rendered by its type's rule (cdc_relay.column_json) — numbers
    with their exact digits however many (NaN/Infinity as strings), json embedded, bytea in
    base64, text as a string — or the row refused (MalformedEvent), nothing else."""
    names = [f"c{i}" for i in range(len(columns))]
    relation = Relation(
        1,
        "public",
        "outbox",
        "d",
        (
            RelationColumn(0, "id", TEXT, -1),
            RelationColumn(0, "event_type", TEXT, -1),
            RelationColumn(0, "payload", JSONB, -1),
            *(RelationColumn(0, n, oid, -1) for n, (_, oid, _) in zip(names, columns, strict=True)),
        ),
        None,
    )
    settings_columns = OutboxColumns(
        aggregate_type=None, aggregate_id=None, headers=None, key="id", value=ValueShape.ROW
    )
    mapping = ShapedMapping(relation, "events", "traceparent", settings_columns)
    row = (b"e-1", b"created", b"{}", *(None if t is None else t.encode() for _, _, t in columns))
    try:
        record = mapping.map(row)
    except MalformedEvent as exc:  # only a text that is not UTF-8 or a bad bytea/boolean
        raise AssertionError(f"refused a value PostgreSQL printed: {exc}") from None
    assert record.value is not None
    fields: dict[str, object] = {"id": "e-1", "event_type": "created"}
    fields["payload"] = orjson.Fragment(b"{}")
    for name, (_, oid, text) in zip(names, columns, strict=True):
        fields[name] = rendered(oid, text)
    assert record.value == orjson.dumps(fields)
