"""Property tests of both decoders: whatever value PostgreSQL stores, the decoder returns its text
exactly as the server sent it; whatever bytes arrive instead, it raises DecodeError, nothing else.

Values (tests/hostile_values.py): numeric with up to PostgreSQL's 131,072 + 16,383 digits (far past
Python's 4,300-digit int conversion limit), NaN and ±Infinity, -0, floats at their limits, huge
and unusual text, bytea, nested arrays with NULLs, deep json, timestamps at ±infinity, NULL in
every column. For pgoutput both readers are checked: the C extension's and the Python reference.
"""

from __future__ import annotations

import contextlib
import json
import struct
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdc_relay.decode import pgoutput
from cdc_relay.decode.messages import UNCHANGED_TOAST, DecodeError, Delete, Insert, Relation, Update
from cdc_relay.decode.pgoutput import PgOutputDecoder
from cdc_relay.decode.wal2json import Wal2JsonDecoder
from tests.built_extension import load_tuple_reader
from tests.hostile_values import NUMBER_OIDS, pg_values

# wal2json 2.5 prints the number types (NUMBER_OIDS) as bare JSON numbers, NaN and ±Infinity as
# null; booleans as true/false.
_NOT_A_NUMBER = frozenset({"NaN", "Infinity", "-Infinity"})
_BOOL_OID, _BYTEA_OID = 16, 17

Column = tuple[str, int, str | None]  # type name, type OID, text (None: NULL)

ROWS = st.lists(pg_values(), min_size=1, max_size=5)
VALUE_SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# -- wal2json -------------------------------------------------------------------------------------


def _wal2json_value(oid: int, text: str | None) -> str:
    """The JSON wal2json 2.5 writes for a value (format-version 2)."""
    if text is None:
        return "null"
    if oid in NUMBER_OIDS:
        return "null" if text in _NOT_A_NUMBER else text
    if oid == _BOOL_OID:
        return "true" if text == "t" else "false"
    if oid == _BYTEA_OID:
        return json.dumps(text[2:])  # without the \x
    return json.dumps(text, ensure_ascii=False)


def _wal2json_columns(columns: list[Column]) -> str:
    return (
        "["
        + ",".join(
            f'{{"name":"c{i}","type":{json.dumps(name)},"typeoid":{oid},'
            f'"value":{_wal2json_value(oid, text)}}}'
            for i, (name, oid, text) in enumerate(columns)
        )
        + "]"
    )


def _decoded_by_wal2json(oid: int, text: str | None) -> bytes | None:
    """What the decoder must return: the server's text, except what wal2json itself loses."""
    if text is None or (oid in NUMBER_OIDS and text in _NOT_A_NUMBER):
        return None
    return text.encode()


@VALUE_SETTINGS
@given(ROWS)
def test_wal2json_returns_every_value_as_the_server_printed_it(columns: list[Column]) -> None:
    decoder = Wal2JsonDecoder()
    head = '"schema":"public","table":"t"'
    values = _wal2json_columns(columns)
    expected = tuple(_decoded_by_wal2json(oid, text) for _, oid, text in columns)

    relation, insert = decoder.decode(f'{{"action":"I",{head},"columns":{values}}}'.encode(), 0)
    assert isinstance(relation, Relation)
    assert insert == Insert(relation.relation_id, expected, None)

    # The same values as an Update's and a Delete's identity (REPLICA IDENTITY FULL).
    (update,) = decoder.decode(
        f'{{"action":"U",{head},"columns":{values},"identity":{values}}}'.encode(), 0
    )
    assert update == Update(relation.relation_id, expected, None, expected, None)
    (delete,) = decoder.decode(f'{{"action":"D",{head},"identity":{values}}}'.encode(), 0)
    assert delete == Delete(relation.relation_id, expected, None, None)


def test_a_numeric_past_pythons_int_digit_limit_is_its_exact_text() -> None:
    """4,400 digits: orjson refuses it (beyond a double) and the standard parser's int() refuses it
    (sys.get_int_max_str_digits): still the value, exactly, not an exception out of the decoder."""
    digits = "9" * 4_400
    columns: list[Column] = [("numeric", 1700, digits), ("numeric", 1700, "-" + digits + ".5")]
    data = f'{{"action":"I","schema":"s","table":"t","columns":{_wal2json_columns(columns)}}}'
    _, insert = Wal2JsonDecoder().decode(data.encode(), 0)
    assert isinstance(insert, Insert)
    assert insert.new == (digits.encode(), b"-" + digits.encode() + b".5")


class _Raw(str):
    """A JSON number written as it is (json.dumps would write a string or refuse it)."""


# Fields of wal2json messages, each either what the server sends or something hostile in its place.
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=6),
    st.sampled_from(["9" * 4_400, "1e400", "-0", "1" * 30 + ".5", "0." + "0" * 400 + "1"]).map(
        _Raw
    ),
)


def _json(value: Any) -> str:
    if isinstance(value, _Raw):
        return str(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{_json(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(map(_json, value)) + "]"
    return json.dumps(value)


_COLUMN = st.fixed_dictionaries(
    {
        "name": st.one_of(st.sampled_from(["a", "b"]), _SCALARS),
        "type": st.one_of(st.sampled_from(["numeric", "text", "bytea", "integer"]), _SCALARS),
        "typeoid": st.one_of(st.sampled_from([1700, 25, 17, 23, 701]), _SCALARS),
        "value": st.one_of(_SCALARS, st.lists(_SCALARS, max_size=2)),
    }
)
_MESSAGE = st.fixed_dictionaries(
    {"action": st.sampled_from([*"BCIUDTM", "X"])},
    optional={
        "schema": st.one_of(st.just("s"), _SCALARS),
        "table": st.one_of(st.just("t"), _SCALARS),
        "columns": st.one_of(st.lists(_COLUMN, max_size=3), _SCALARS),
        "identity": st.one_of(st.lists(_COLUMN, max_size=2), _SCALARS),
        "xid": st.one_of(st.integers(0, 2**32), _SCALARS),
        "lsn": st.one_of(st.just("0/1"), _SCALARS),
        "nextlsn": st.one_of(st.just("0/2"), _SCALARS),
        "timestamp": st.one_of(st.just("2020-01-01 00:00:00+00"), _SCALARS),
        "transactional": _SCALARS,
        "prefix": _SCALARS,
        "content": _SCALARS,
    },
)


@settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.lists(_MESSAGE, min_size=1, max_size=3),
    st.sampled_from([0, 0, 0, 1_000, 1_030, 3_000]),
    st.binary(max_size=4),
)
def test_wal2json_raises_only_decode_error_for_anything_else(
    messages: list[dict[str, Any]], depth: int, noise: bytes
) -> None:
    """Wrong shapes and types, numbers past every limit, nesting past the parsers' (orjson 1,024,
    the standard library's recursion limit), invalid UTF-8: a DecodeError or messages."""
    decoder = Wal2JsonDecoder()
    for message in messages:
        text = _json(message)
        if depth:
            text = text[:-1] + ',"deep":' + "[" * depth + "1.5" + "]" * depth + "}"
        for data in (text.encode(), text.encode() + noise, noise + text.encode()):
            with contextlib.suppress(DecodeError):
                decoder.decode(data, 0)


# -- pgoutput -------------------------------------------------------------------------------------

_READER = load_tuple_reader()


def _cstring(text: str) -> bytes:
    return text.encode() + b"\x00"


def _relation(relation_id: int, columns: list[Column]) -> bytes:
    body = b"".join(
        b"\x00" + _cstring(f"c{i}") + struct.pack(">Ii", oid, -1)
        for i, (_, oid, _) in enumerate(columns)
    )
    head = b"R" + struct.pack(">I", relation_id) + _cstring("public") + _cstring("t") + b"d"
    return head + struct.pack(">H", len(columns)) + body


def _tuple(values: list[bytes | None]) -> bytes:
    parts = [
        b"n" if value is None else b"t" + struct.pack(">I", len(value)) + value for value in values
    ]
    return struct.pack(">H", len(values)) + b"".join(parts)


@VALUE_SETTINGS
@given(ROWS, st.integers(1, 2**32 - 1))
def test_pgoutput_returns_every_value_as_the_server_sent_it(
    columns: list[Column], relation_id: int
) -> None:
    values = [None if text is None else text.encode() for _, _, text in columns]
    decoder = PgOutputDecoder()
    relation = decoder.decode(_relation(relation_id, columns))
    assert isinstance(relation, Relation)
    assert [c.type_oid for c in relation.columns] == [oid for _, oid, _ in columns]

    insert = b"I" + struct.pack(">I", relation_id) + b"N" + _tuple(values)
    expected = Insert(relation_id, tuple(values), None)
    assert decoder.decode(insert) == expected  # the Python handlers (C tuple reader if built)
    frame = memoryview(b"w" + bytes(24) + insert)
    assert decoder.decode_xlog(frame) == (expected,)  # the C message reader if built
    # The C reader and the Python reference read the same tuple.
    assert pgoutput._read_tuple_pure(insert, 6) == (tuple(values), len(insert))
    assert _READER.read_tuple(insert, 6, UNCHANGED_TOAST) == (tuple(values), len(insert))

    update = b"U" + struct.pack(">I", relation_id) + b"O" + _tuple(values) + b"N" + _tuple(values)
    assert decoder.decode(update) == Update(relation_id, tuple(values), None, tuple(values), None)


@pytest.mark.parametrize("in_stream", [False, True])
@settings(max_examples=1_500, deadline=None)
@given(type_byte=st.sampled_from(sorted(pgoutput._HANDLERS)), body=st.binary(max_size=48))
def test_pgoutput_raises_only_decode_error_for_anything_else(
    in_stream: bool, type_byte: int, body: bytes
) -> None:
    """Any body after any message type byte, in and out of a stream block: a message or a
    DecodeError, and the frame reader (C where built) agrees with the reference."""
    data = bytes([type_byte]) + body

    def decoder() -> PgOutputDecoder:
        fresh = PgOutputDecoder()
        if in_stream:
            fresh.decode(b"S" + struct.pack(">IB", 1, 1))
        return fresh

    def outcome(read: Any) -> object:
        try:
            return read()
        except DecodeError as exc:
            return (DecodeError, str(exc))

    reference = outcome(lambda: (decoder().decode(data),))
    framed = outcome(lambda: decoder().decode_xlog(memoryview(b"w" + bytes(24) + data)))
    assert framed == reference
