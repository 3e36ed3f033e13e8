"""Unit and property tests for cdc_relay.column_transform and cdc_relay.column_json (parsing input:
patterns and replacements from settings, column values from rows)."""

from __future__ import annotations

import base64
import json
import re
import time
from decimal import Decimal

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cdc_relay.column_json import expanded_renderer, renderer
from cdc_relay.column_transform import MAX_INPUT, TransformError, compile_transform
from cdc_relay.value_text import MalformedEvent

STREAM = r"([^:]+)::([^-]+)-(.*)"
INT8, NUMERIC, FLOAT8, BOOL, JSONB, JSON, BYTEA, TEXT, TIMESTAMP = (
    20,
    1700,
    701,
    16,
    3802,
    114,
    17,
    25,
    1114,
)


def test_framework_stream_name_to_topic_and_key() -> None:
    topic = compile_transform(STREAM, "$1.$2")
    key = compile_transform(STREAM, "$3")
    stream = "shop::order-5f0c1e2a-0b7d-4c55-8e0f-0a1b2c3d4e5f"
    assert topic.apply(stream) == "shop.order"
    assert key.apply(stream) == "5f0c1e2a-0b7d-4c55-8e0f-0a1b2c3d4e5f"


def test_debezium_syntax_named_groups_and_escapes() -> None:
    routed = compile_transform("(?<routedByValue>.*)", "outbox.event.${routedByValue}")
    assert routed.apply("Order") == "outbox.event.Order"
    assert compile_transform("(a)(b)", r"$$1\$2\\$2").apply("ab") == "$1$2\\b"
    # Java's rule: $12 is group 12 only when it exists, else group 1 then "2".
    assert compile_transform("(a)(b)", "$12").apply("ab") == "a2"
    assert compile_transform("(?P<x>a)(b)", "{$0}{${x}}{}").apply("ab") == "{ab}{a}{}"


def test_the_whole_value_must_match_and_long_values_are_refused() -> None:
    transform = compile_transform("[a-z]+", "x")
    assert transform.apply("abc") == "x"
    assert transform.apply("abc1") is None, "a partial match is no match"
    assert transform.apply("a" * (MAX_INPUT + 1)) is None
    assert compile_transform("(a)|(b)", "[$1$2]").apply("b") == "[b]", "an unused group: nothing"


@pytest.mark.parametrize(
    ("regex", "replacement", "reason"),
    [
        ("(", "$1", "does not compile"),
        ("(a)", "$2", "group 2"),
        ("(a)", "${nope}", "'nope'"),
        ("(a)", "${", "without a group name"),
        ("(a)", "$x", "not followed by a group"),
        ("(a)", "end\\", "lone backslash"),
        (r"(a)\1", "$1", "backreferences are not supported"),
        ("a" * 2000, "", "longer than"),
    ],
)
def test_settings_that_are_refused(regex: str, replacement: str, reason: str) -> None:
    with pytest.raises(TransformError, match=re.escape(reason)):
        compile_transform(regex, replacement)


@pytest.mark.parametrize(
    ("regex", "matches"),
    [
        (STREAM, False),
        ("(ab)+", False),
        ("[(]+x", False),
        (r"\(a+\)+", False),
        ("(a+)+", True),
        ("(a|aa)*", True),
        (r"(?:\w*\s)*", False),
        (".*.*.*.*x", False),
    ],
)
def test_patterns_a_backtracking_engine_could_not_afford_are_accepted(
    regex: str, matches: bool
) -> None:
    transform = compile_transform(regex, "ok")
    started = time.perf_counter()
    assert transform.apply("a" * MAX_INPUT) == ("ok" if matches else None)
    assert transform.apply("a" * (MAX_INPUT - 1) + "!") is None
    assert time.perf_counter() - started < 0.25


_WORD = st.text(st.characters(blacklist_characters=":-", codec="utf-8"), min_size=1)


@given(_WORD, _WORD.filter(lambda s: "-" not in s), st.text(max_size=50))
def test_stream_names_split_into_their_parts(context: str, category: str, rest: str) -> None:
    stream = f"{context}::{category}-{rest}"
    # (?s): as in Java, "." matches a line break only in DOTALL mode.
    assert (
        compile_transform("(?s)" + STREAM, "$1|$2|$3").apply(stream)
        == f"{context}|{category}|{rest}"
    )


@given(st.text(max_size=100).filter(lambda s: "$" not in s and "\\" not in s), st.text())
def test_a_replacement_without_groups_is_its_text(replacement: str, value: str) -> None:
    result = compile_transform("(?s:.*)", replacement).apply(value)
    assert result == (replacement if len(value) <= MAX_INPUT else None)


# -- rendering column texts as JSON -----------------------------------------------------------


def _rendered(type_oid: int, value: bytes) -> object:
    return orjson.loads(orjson.dumps({"v": renderer(type_oid, "c")(value, None)}))["v"]


@given(st.integers() | st.decimals(allow_nan=False, allow_infinity=False))
def test_numbers_keep_their_exact_text(number: int | Decimal) -> None:
    text = str(number)
    if "E" in text or text in ("-0", "-0.0") or text.startswith("-0."):
        text = format(Decimal(text), "f")
    document = orjson.dumps({"v": renderer(NUMERIC, "c")(text.encode(), None)})
    parsed = json.loads(document, parse_float=Decimal, parse_int=Decimal)["v"]
    assert parsed == Decimal(text)
    assert text.encode() in document, "the digits as PostgreSQL printed them"


@pytest.mark.parametrize("special", [b"NaN", b"Infinity", b"-Infinity"])
def test_numbers_json_cannot_hold_are_strings(special: bytes) -> None:
    assert _rendered(FLOAT8, special) == special.decode()


@given(st.text(st.characters(codec="utf-8")))
def test_text_round_trips(text: str) -> None:
    raw = text.encode()
    assert _rendered(TEXT, raw) == text
    assert _rendered(TIMESTAMP, raw) == text, "timestamps travel as their text"


@given(st.binary(max_size=200))
def test_bytea_is_base64(data: bytes) -> None:
    hex_text = b"\\x" + data.hex().encode()
    assert base64.b64decode(str(_rendered(BYTEA, hex_text))) == data


def test_booleans_json_and_invalid_text() -> None:
    assert _rendered(BOOL, b"t") is True
    assert _rendered(BOOL, b"f") is False
    assert _rendered(JSONB, b'{"a": [1, 2.50]}') == {"a": [1, 2.5]}
    with pytest.raises(MalformedEvent, match="column c is not a boolean"):
        renderer(BOOL, "c")(b"yes", None)
    with pytest.raises(MalformedEvent, match="column c is not valid UTF-8"):
        renderer(TEXT, "c")(b"\xff", "e-1")


def test_expanded_payloads_are_checked_json() -> None:
    expand = expanded_renderer(TEXT, "data")
    assert orjson.loads(orjson.dumps(expand(b'{"n": 1}', None))) == {"n": 1}
    with pytest.raises(MalformedEvent, match="data is not valid JSON"):
        expand(b"{not json", "e-1")
    from_bytea = expanded_renderer(BYTEA, "data")
    assert orjson.loads(orjson.dumps(from_bytea(b"\\x" + b"[1]".hex().encode(), None))) == [1]
    assert orjson.loads(orjson.dumps(expanded_renderer(JSON, "data")(b"[2]", None))) == [2]
