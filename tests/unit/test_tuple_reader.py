"""The C tuple reader (``cdc_relay/decode/_tuple_reader.c``) returns exactly what the pure one
(``pgoutput._read_tuple_pure``, the reference) returns, and refuses (None) whatever the pure one
would not read, so that the careful reader names the error in both builds.

The extension is loaded from its file, past ``CDC_RELAY_PURE_PYTHON=1`` (which only keeps the
decoder from using it): every tier tests it. setup.py builds it wherever a compiler exists
(``pip install -e .``); a checkout without it fails here rather than skip.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cdc_relay._hot_path import C_EXTENSIONS, c_extensions_loaded
from cdc_relay.decode import pgoutput
from cdc_relay.decode.messages import (
    UNCHANGED_TOAST,
    Begin,
    Commit,
    Insert,
    Relation,
    RelationColumn,
)
from cdc_relay.decode.pgoutput import PgOutputDecoder
from cdc_relay.outbox import OutboxMapping
from cdc_relay.value_text import MalformedEvent
from tests.built_extension import load_tuple_reader

READER = load_tuple_reader()


def read_c(buf: bytes, pos: int) -> Any:
    """What the decoder does with the C reader: its result, or the careful reader's verdict."""
    found = READER.read_tuple(buf, pos, UNCHANGED_TOAST)
    return found if found is not None else pgoutput._read_tuple_checked(buf, pos)


def outcome(reader: Any, buf: bytes, pos: int) -> object:
    try:
        return reader(buf, pos)
    except Exception as exc:
        return (type(exc), str(exc))


def column(kind: str, value: bytes) -> bytes:
    if kind in "tb":
        return kind.encode() + struct.pack(">I", len(value)) + value
    return kind.encode()


COLUMNS = st.tuples(st.sampled_from("tbnu"), st.binary(max_size=40))


@settings(max_examples=500, deadline=None)
@given(st.lists(COLUMNS, max_size=12), st.binary(max_size=8), st.binary(max_size=5))
def test_well_formed_tuples_read_the_same(
    columns: list[tuple[str, bytes]], before: bytes, after: bytes
) -> None:
    """Text, binary, NULL and unchanged-TOAST columns, at any offset, trailing bytes ignored."""
    body = struct.pack(">H", len(columns)) + b"".join(column(k, v) for k, v in columns)
    buf = before + body + after
    found = READER.read_tuple(buf, len(before), UNCHANGED_TOAST)
    expected = pgoutput._read_tuple_pure(buf, len(before))
    assert found == expected
    assert found is not None
    assert found[1] == len(before) + len(body)
    for value, (kind, raw) in zip(found[0], columns, strict=True):
        if kind in "tb":
            assert value == raw
            assert type(value) is bytes
        else:
            assert value is (None if kind == "n" else UNCHANGED_TOAST)


_PARTS = st.one_of(
    st.tuples(st.sampled_from("tbnu"), st.binary(max_size=12)).map(lambda c: column(*c)),
    st.sampled_from([b"t", b"b\x00\x00", b"x", b"t\xff\xff\xff\xfb", b"b\x7f\xff\xff\xff", b""]),
    st.binary(max_size=6),
)


@settings(max_examples=1000, deadline=None)
@given(st.lists(_PARTS, max_size=8), st.integers(-3, 8), st.integers(0, 6), st.integers(0, 3))
def test_any_bytes_read_the_same_or_fail_the_same(
    parts: list[bytes], declared_extra: int, cut: int, pos: int
) -> None:
    """Malformed input (bad kinds, lengths past the end, negative lengths, truncation, a column
    count that lies, an offset past the end): the same values or the same error."""
    body = struct.pack(">H", max(len(parts) + declared_extra, 0)) + b"".join(parts)
    buf = b"I" * pos + body[: max(len(body) - cut, 0)]
    assert outcome(read_c, buf, pos) == outcome(pgoutput._read_tuple_pure, buf, pos)
    assert outcome(read_c, buf, pos + 3) == outcome(pgoutput._read_tuple_pure, buf, pos + 3)


def test_it_takes_only_bytes_and_an_offset() -> None:
    with pytest.raises(TypeError):
        READER.read_tuple(bytearray(b"\x00\x00"), 0, UNCHANGED_TOAST)
    with pytest.raises(TypeError):
        READER.read_tuple(b"\x00\x00", 0)
    assert READER.read_tuple(b"\x00\x00", -1, UNCHANGED_TOAST) is None


def test_the_decoder_uses_it_unless_pure_python_is_asked_for() -> None:
    """CDC_RELAY_PURE_PYTHON=1 (CI's pure tier): the Python reader; otherwise the C one."""
    import os  # noqa: PLC0415

    pure = os.environ.get("CDC_RELAY_PURE_PYTHON") == "1"
    assert c_extensions_loaded() == ([] if pure else list(C_EXTENSIONS))
    assert (vars(pgoutput)["_read_row"] is None) == pure
    row = b"I" + struct.pack(">IB", 7, 0x4E) + struct.pack(">H", 2) + column("t", b"x") + b"u"
    message = PgOutputDecoder().decode(row)
    assert message.new == (b"x", UNCHANGED_TOAST)  # type: ignore[union-attr]


def read_message(frame: bytes | bytearray | memoryview | str, offset: int) -> Any:
    """The C reader of Insert, Begin and Commit frames, with the decoder's message types."""
    return READER.read_message(frame, offset, Insert, Begin, Commit, UNCHANGED_TOAST)


def read_message_c(frame: bytes, offset: int) -> Any:
    """What PgOutputDecoder.decode_xlog does with the C reader: its message, or decode's verdict."""
    found = read_message(memoryview(frame), offset)
    return found if found is not None else PgOutputDecoder().decode(frame[offset:])


def read_message_pure(frame: bytes, offset: int) -> Any:
    return PgOutputDecoder().decode(frame[offset:])


def insert(relation_id: int, marker: bytes, tuple_data: bytes) -> bytes:
    return b"I" + struct.pack(">I", relation_id) + marker + tuple_data


@settings(max_examples=500, deadline=None)
@given(
    st.integers(0, 2**32 - 1),
    st.lists(COLUMNS, max_size=12),
    st.binary(max_size=25),
    st.binary(max_size=5),
)
def test_well_formed_inserts_read_the_same(
    relation_id: int, columns: list[tuple[str, bytes]], header: bytes, after: bytes
) -> None:
    """An Insert read straight from its frame (the XLogData header before it, trailing bytes
    after it ignored) is exactly the message the reference decoder returns, of the same type."""
    body = struct.pack(">H", len(columns)) + b"".join(column(k, v) for k, v in columns)
    frame = header + insert(relation_id, b"N", body) + after
    found = read_message(memoryview(frame), len(header))
    expected = read_message_pure(frame, len(header))
    assert found == expected
    assert type(found) is Insert
    assert found.relation_id == relation_id
    assert found.xid is None
    assert [type(v) for v in found.new] == [type(v) for v in expected.new]


_MESSAGES = st.one_of(
    st.tuples(
        st.integers(0, 2**32 - 1), st.sampled_from([b"N", b"K", b"O", b""]), st.binary(max_size=30)
    ).map(lambda m: insert(*m)),
    st.binary(max_size=30),
    st.sampled_from([b"I", b"B" + bytes(20), b"C" + bytes(25)]),
    st.tuples(st.just(b"B"), st.binary(min_size=20, max_size=20)).map(b"".join),
    st.tuples(st.just(b"C"), st.binary(min_size=25, max_size=25)).map(b"".join),
)


@settings(max_examples=1000, deadline=None)
@given(_MESSAGES, st.lists(_PARTS, max_size=6), st.integers(0, 6), st.integers(0, 4))
def test_any_message_decodes_the_same_or_fails_the_same(
    message: bytes, parts: list[bytes], cut: int, offset: int
) -> None:
    """Any message, not only an Insert, malformed ones included (a bad marker, a tuple that lies,
    truncation, an offset past the end): the same message or the same error as the reference."""
    frame = b"w" * offset + (message + b"".join(parts))[: max(len(message) + 8 - cut, 0)]
    assert outcome(read_message_c, frame, offset) == outcome(read_message_pure, frame, offset)
    found = outcome(read_message_c, frame, offset)
    assert type(found) is type(outcome(read_message_pure, frame, offset))
    assert read_message(frame, len(frame) + 1) is None
    assert read_message(frame, len(frame)) is None


def test_read_message_takes_a_buffer_and_tuple_types() -> None:
    frame = insert(7, b"N", struct.pack(">H", 1) + column("t", b"x"))
    assert read_message(frame, 0) == (7, (b"x",), None)
    assert read_message(bytearray(frame), 0) == (7, (b"x",), None)
    with pytest.raises(TypeError):
        read_message("I", 0)
    for types in ((dict, Begin, Commit), (Insert, dict, Commit), (Insert, Begin, dict)):
        with pytest.raises(TypeError):
            READER.read_message(frame, 0, *types, UNCHANGED_TOAST)
    with pytest.raises(TypeError):
        READER.read_message(frame, 0, Insert, Begin, Commit)
    assert read_message(frame, -1) is None


def test_begin_and_commit_are_read_whole_from_the_frame() -> None:
    """The largest values of each field, signed and unsigned as the reference reads them."""
    begin = b"w" * 25 + b"B" + struct.pack(">QqI", 2**64 - 1, -(2**63), 2**32 - 1) + b"tail"
    commit = b"w" * 25 + b"C" + struct.pack(">BQQq", 255, 2**64 - 1, 2**63, -1)
    for frame in (begin, commit):
        found = read_message(memoryview(frame), 25)
        assert found == read_message_pure(frame, 25)
        assert type(found) is type(read_message_pure(frame, 25))
    assert read_message(begin[:45], 25) is None  # one byte short: the reference names the error
    assert read_message(commit[:50], 25) is None


def test_the_decoder_reads_inserts_from_the_frame_unless_pure_python_is_asked_for() -> None:
    import os  # noqa: PLC0415

    pure = os.environ.get("CDC_RELAY_PURE_PYTHON") == "1"
    assert (vars(pgoutput)["_READ_MESSAGE"] is None) == pure
    frame = b"w" * 25 + insert(7, b"N", struct.pack(">H", 2) + column("t", b"x") + b"n")
    (message,) = PgOutputDecoder().decode_xlog(memoryview(frame))
    assert message == Insert(7, (b"x", None), None)
    assert type(message) is Insert


def test_inside_a_stream_block_an_insert_carries_its_xid() -> None:
    """Between Stream Start and Stream Stop an Insert begins with an xid: the frame reader, which
    knows only the plain layout, is not asked then."""
    decoder = PgOutputDecoder()
    decoder.decode(b"S" + struct.pack(">IB", 99, 1))
    body = struct.pack(">H", 1) + column("t", b"x")
    frame = b"w" * 25 + b"I" + struct.pack(">IIB", 99, 7, 0x4E) + body
    assert decoder.decode_xlog(memoryview(frame)) == (Insert(7, (b"x",), 99),)


def test_bind_is_method_type() -> None:
    """The session binds every record's BoundRecord with it: a bound method, as MethodType makes,
    refusing what MethodType refuses."""
    from types import MethodType  # noqa: PLC0415

    from cdc_relay import session  # noqa: PLC0415

    def callback(record: object, err: object, msg: object) -> tuple[object, ...]:
        return record, err, msg

    record = ("txn", "public.outbox", "topic", [("id", b"1")])
    bound = READER.bind(callback, record)
    assert type(bound) is MethodType
    assert bound == MethodType(callback, record)
    assert bound.__self__ is record
    assert bound(None, "msg") == (record, None, "msg")
    for arguments in ((1, record), (callback, None), (callback,)):
        with pytest.raises(TypeError):
            READER.bind(*arguments)
        with pytest.raises(TypeError):
            MethodType(*arguments)
    import os  # noqa: PLC0415

    pure = os.environ.get("CDC_RELAY_PURE_PYTHON") == "1"
    assert (vars(session)["_bind"] is MethodType) == pure


def _outbox_relation(columns: tuple[str, ...]) -> Relation:
    types = {"id": 2950, "payload": 3802, "headers": 3802}
    return Relation(
        1,
        "public",
        "outbox",
        "d",
        tuple(RelationColumn(0, name, types.get(name, 25), -1) for name in columns),
        None,
    )


_PLAIN = ("id", "aggregate_type", "aggregate_id", "event_type", "payload", "headers", "created_at")
_VALUES = st.one_of(
    st.binary(max_size=6),
    st.sampled_from([b"order", b"\xff\xfe", b"caf\xc3\xa9", b"\xc3", b"", None, UNCHANGED_TOAST]),
)


def mapped(mapping: Callable[[Any], Any], row: Any) -> object:
    try:
        return mapping(row)
    except Exception as exc:
        return (type(exc), str(exc), getattr(exc, "event_id", None))


@settings(max_examples=1000, deadline=None)
@given(
    st.sampled_from([_PLAIN, _PLAIN[:5], ("payload", "event_type", "id", "aggregate_id",
                                          "aggregate_type", "headers")]),
    st.lists(_VALUES, min_size=4, max_size=8).map(tuple),
    st.booleans(),
    st.booleans(),
)  # fmt: skip
def test_the_plain_mapping_maps_every_row_as_its_reference(
    columns: tuple[str, ...], row: tuple[Any, ...], as_list: bool, prime: bool
) -> None:
    """The plain mapping of a row in one C call (record_fields, anything unusual left to the
    reference: NULL or unchanged columns, a short row, an id that is not UTF-8, a headers column
    to parse, a topic not cached yet, a row that is not a tuple) maps every row exactly as
    OutboxMapping._record_fields does, or fails the same way; the topic cache filled or not."""
    mapping = OutboxMapping(_outbox_relation(columns), "outbox.{aggregate_type}.{event_type}")
    fast = READER.record_fields
    spec = mapping._fast_spec
    data: Any = list(row) if as_list else row
    other = {"aggregate_type": b"other", "event_type": b"kind", "payload": b"{}", "headers": None}
    for _ in range(2):  # another row's types and topic remembered as the last ones found
        mapping.map_fields(tuple(other.get(name, b"x") for name in columns))
    if prime:  # the row's topic cached by an earlier row of the same types, whatever this one holds
        types = [
            row[i] if len(row) > i else None
            for i in (columns.index("aggregate_type"), columns.index("event_type"))
        ]
        aggregate_type, event_type = types
        if isinstance(aggregate_type, bytes) and isinstance(event_type, bytes):
            with contextlib.suppress(MalformedEvent):
                mapping._topic(aggregate_type, event_type)
    for _ in range(2):  # the first maps with the cache as it was, the second with it filled
        expected = mapped(mapping._record_fields, data)
        assert mapped(mapping.map_fields, data) == expected
        found = fast(spec, mapping._topics, mapping._last_topic, None, data)
        if found is not None:
            assert found == expected
            assert [type(v) for v in found] == [type(v) for v in expected]  # type: ignore[attr-defined]


def test_the_plain_mapping_uses_it_unless_pure_python_is_asked_for() -> None:
    import os  # noqa: PLC0415

    pure = os.environ.get("CDC_RELAY_PURE_PYTHON") == "1"
    mapping = OutboxMapping(_outbox_relation(_PLAIN), "outbox.event.{aggregate_type}")
    row = (b"e-1", b"order", b"o-1", b"created", b"{}", None, b"now")
    assert mapping.map_fields(row) == mapping._record_fields(row)
    uses_c = getattr(getattr(mapping.map_fields, "func", None), "__name__", "") == "record_fields"
    assert uses_c != pure
    assert READER.record_fields(mapping._fast_spec, mapping._topics, [None] * 3, None, row) == (
        "outbox.event.order", b"o-1", b"{}",
        [("id", b"e-1"), ("event_type", b"created"), ("aggregate_type", b"order")], "e-1", None,
    )  # fmt: skip
    arguments: tuple[Any, ...]
    for arguments in (
        ((), mapping._topics, [None] * 3, None, row),
        (mapping._fast_spec, [], [None] * 3, None, row),
        (mapping._fast_spec, mapping._topics, [], None, row),
        (mapping._fast_spec, mapping._topics, [None] * 3, 1, row),
        (mapping._fast_spec, mapping._topics, [None] * 3, None),
    ):
        with pytest.raises(TypeError):
            READER.record_fields(*arguments)
    # Any row it does not map itself goes to the reference, given one: the mapping's own.
    reference = mapping._record_fields
    assert READER.record_fields(mapping._fast_spec, {}, [None] * 3, reference, row) == (
        mapping._record_fields(row)
    )
    with pytest.raises(MalformedEvent):
        READER.record_fields(mapping._fast_spec, {}, [None] * 3, reference, (None,) * 7)
