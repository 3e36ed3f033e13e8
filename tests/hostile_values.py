"""Hypothesis strategies for what a hostile writer can put in an outbox row or logical message.

Shared by the unit property tests of the mapping and the integration property tests that write
the same kinds of values through a real PostgreSQL.
"""

from __future__ import annotations

import orjson
from hypothesis import strategies as st

# Numbers at the edges: beyond a double, beyond 64 bits, exact decimals, negative zero.
EXTREME_NUMBERS = ["1e400", "-0", "123456789012345678901234567890", "1.10", "-1e-400", "1E+308"]
# Escapes PostgreSQL's json type keeps as text but jsonb refuses: lone surrogates and NUL.
JSON_ONLY_STRINGS = ['"\\ud800"', '"\\udc00x"', '"\\u0000"']
JSON_ONLY_KEYS = ['"\\ud800"', '"a\\u0000b"', '"\\udfff"']
NOT_JSON = ["NaN", "Infinity", "{", "[1,]", "'single'", '{"a" 1}', "01"]


def json_texts(*, json_only: bool = True, invalid: bool = False) -> st.SearchStrategy[str]:
    """JSON texts; ``json_only`` adds what only the json type keeps, ``invalid`` adds non-JSON."""
    strings = ['"a\\"b"', '"\\ud83d\\ude80"', '"line\\nbreak"', '"\\u001b[2K"']
    keys = ['""', '"id"', '"cdc_relay.error"', '"traceparent"', '"a\\nb"']
    if json_only:
        strings += JSON_ONLY_STRINGS
        keys += JSON_ONLY_KEYS
    scalars = st.one_of(
        st.sampled_from(["null", "true", "false", *EXTREME_NUMBERS, *strings]),
        st.integers().map(str),
        st.floats(allow_nan=False, allow_infinity=False).map(lambda f: orjson.dumps(f).decode()),
        st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=20).map(
            lambda s: orjson.dumps(s).decode()
        ),
    )
    if invalid:
        scalars = st.one_of(scalars, st.sampled_from(NOT_JSON))
    key_texts = st.one_of(
        st.sampled_from(keys),
        st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=10).map(
            lambda s: orjson.dumps(s).decode()
        ),
    )
    nested = st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4).map(lambda items: "[" + ", ".join(items) + "]"),
            st.lists(st.tuples(key_texts, inner), max_size=4).map(
                lambda pairs: "{" + ", ".join(f"{k}: {v}" for k, v in pairs) + "}"
            ),
        ),
        max_leaves=12,
    )
    return st.one_of(nested, deep_json())


def deep_json() -> st.SearchStrategy[str]:
    """An object nested around the limits that parsers have (1,000, orjson's 1,024) and beyond."""
    return st.sampled_from([900, 1000, 1025, 3000]).map(
        lambda n: '{"k": ' + "[" * n + "]" * n + "}"
    )


def json_objects(*, json_only: bool = True) -> st.SearchStrategy[str]:
    """Mostly JSON objects (what a headers column should hold), sometimes any other JSON."""
    keys = ['"k"', '"id"', '"a\\nb"', *(JSON_ONLY_KEYS if json_only else [])]
    entries = st.tuples(st.sampled_from(keys), json_texts(json_only=json_only))
    return st.one_of(
        st.lists(entries, max_size=3).map(
            lambda pairs: "{" + ", ".join(f"{k}: {v}" for k, v in pairs) + "}"
        ),
        json_texts(json_only=json_only),
    )


def texts(max_size: int = 40) -> st.SearchStrategy[str]:
    """Text PostgreSQL can hold (no NUL, no lone surrogate): control characters, line breaks,
    terminal escapes, non-ASCII."""
    return st.one_of(
        st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=max_size),
        st.sampled_from(["", "a\nforged line", "\x1b[31m", "a\u2028b", "x" * 300, " "]),
    )


def sizes() -> st.SearchStrategy[int]:
    """Sizes of a large value: mostly small, sometimes past librdkafka's 1 MB message.max.bytes."""
    return st.sampled_from([0, 1, 100, 300_000, 1_100_000])
