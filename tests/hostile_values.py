"""Hypothesis strategies for what a hostile writer can put in an outbox row or logical message.

Shared by the unit property tests of the mapping and the integration property tests that write
the same kinds of values through a real PostgreSQL.
"""

from __future__ import annotations

import base64
import re

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


# -- values at PostgreSQL's extremes, type by type ----------------------------------------------

# numeric's limits: up to 131,072 digits before the decimal point and 16,383 after.
NUMERIC_MAX_INTEGER_DIGITS = 131_072
NUMERIC_MAX_SCALE = 16_383
# Python refuses to convert an integer of more digits than this to int (sys.get_int_max_str_digits).
PYTHON_INT_DIGITS = 4_300


def numeric_texts() -> st.SearchStrategy[str]:
    """``numeric`` values as PostgreSQL prints them: exact digits up to its limits, NaN, ±Infinity.

    The texts are also valid input that PostgreSQL prints back unchanged."""
    integer_digits = st.sampled_from(
        [
            1,
            20,
            309,
            PYTHON_INT_DIGITS,
            PYTHON_INT_DIGITS + 1,
            4_400,
            20_000,
            NUMERIC_MAX_INTEGER_DIGITS,
        ]
    )
    scales = st.sampled_from([0, 0, 0, 2, 400, NUMERIC_MAX_SCALE])

    @st.composite
    def number(draw: st.DrawFn) -> str:
        digits = draw(integer_digits)
        first = draw(st.sampled_from("123456789"))
        whole = first + draw(st.sampled_from("09")) * (digits - 1)
        if draw(st.integers(0, 7)) == 0:
            whole = "0"
        scale = draw(scales)
        fraction = "" if scale == 0 else "." + draw(st.sampled_from(["0", "9", "1"])) * scale
        sign = "-" if draw(st.booleans()) and (whole != "0" or fraction.strip(".0")) else ""
        return sign + whole + fraction

    return st.one_of(
        number(),
        number(),
        st.decimals(allow_nan=False, allow_infinity=False).map(
            lambda d: format(d, "f").replace("-0", "0", 1) if d == 0 else format(d, "f")
        ),
        st.sampled_from(["NaN", "Infinity", "-Infinity", "0", "1.10"]),
    )


def float_texts() -> st.SearchStrategy[str]:
    """``real``/``double precision`` texts: exact digits, -0, the limits, NaN, ±Infinity."""
    return st.one_of(
        st.floats(allow_nan=False, allow_infinity=False).map(lambda f: repr(f).removesuffix(".0")),
        st.sampled_from(
            [
                "NaN",
                "Infinity",
                "-Infinity",
                "-0",
                "1.7976931348623157e+308",
                "5e-324",
                "2.2250738585072014e-308",
                "3.4028235e+38",
                "1e-45",
                "1e+20",
            ]
        ),
    )


def unicode_texts() -> st.SearchStrategy[str]:
    """Text PostgreSQL can hold at its edges: any code point but NUL, the largest, combining marks,
    direction overrides, the BOM, noncharacters, line separators."""
    return st.one_of(
        texts(),
        st.sampled_from(
            [
                "\U0010ffff",
                "\uffff\ufffe",
                "e\u0301\u0301\u0301",
                "\u202etxet",
                "\ufeffbom",
                "\u2028\u2029",
                "\x7f\x01\x1f",
                '"\\',
                "\\x41",
                "\U0001f680" * 1000,
            ]
        ),
    )


def big_texts() -> st.SearchStrategy[str]:
    """Large values: beyond a TOAST page, librdkafka's 1 MB message.max.bytes, a few megabytes."""
    sizes = st.sampled_from([10_000, 300_000, 1_100_000, 3_000_000])
    return sizes.map(lambda n: "\u00e9" * (n // 2))  # n bytes of UTF-8


def array_texts() -> st.SearchStrategy[str]:
    """``integer[]`` texts: empty, nested, with NULLs, explicit bounds, large."""
    return st.one_of(
        st.sampled_from(
            [
                "{}",
                "{NULL}",
                "{{1,NULL},{NULL,4}}",
                "[0:1]={7,8}",
                "{{{1}}}",
                "{" + ",".join(["NULL"] * 10_000) + "}",
                "{" + ",".join(map(str, range(50_000))) + "}",
            ]
        ),
        st.lists(st.one_of(st.none(), st.integers(-(2**31), 2**31 - 1)), max_size=20).map(
            lambda items: "{" + ",".join("NULL" if i is None else str(i) for i in items) + "}"
        ),
    )


def text_array_texts() -> st.SearchStrategy[str]:
    """``text[]`` texts with the quoting PostgreSQL prints: quotes, backslashes, NULL, braces."""

    def element(value: str | None) -> str:
        if value is None:
            return "NULL"
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'

    return st.lists(st.one_of(st.none(), texts(10), st.just("NULL")), max_size=8).map(
        lambda items: "{" + ",".join(element(i) for i in items) + "}"
    )


def json_value_texts() -> st.SearchStrategy[str]:
    """``json``/``jsonb`` values: deep nesting, numbers of any size, large strings."""
    return st.one_of(
        json_texts(json_only=False),
        st.sampled_from(
            [
                '{"n": ' + "9" * 5_000 + "}",
                '{"n": 1e400, "m": -0, "k": 1.10}',
                "[" * 3_000 + "]" * 3_000,
                '{"big": "' + "x" * 300_000 + '"}',
            ]
        ),
    )


def timestamp_texts(*, zone: bool) -> st.SearchStrategy[str]:
    """Timestamps at ±infinity and at the ends of PostgreSQL's range (4713 BC to 294276 AD)."""
    offset = "+00" if zone else ""
    return st.sampled_from(
        [
            "infinity",
            "-infinity",
            f"4713-01-01 00:00:00{offset} BC",
            f"294276-12-31 23:59:59.999999{offset}",
            f"2000-01-01 00:00:00{offset}",
            f"1999-12-31 23:59:59.000001{offset}",
        ]
    )


def bytea_texts() -> st.SearchStrategy[str]:
    """``bytea`` as PostgreSQL prints it (hex): empty, any bytes, large."""
    return st.one_of(
        st.binary(max_size=64),
        st.sampled_from([b"", b"\x00", b"\xff" * 200_000]),
    ).map(lambda raw: "\\x" + raw.hex())


# type name -> (type OID, texts of that type). Each text is valid input of its type, and the text
# form a decoder may receive (PostgreSQL prints most of them back unchanged; jsonb normalises).
PG_TYPES: dict[str, tuple[int, st.SearchStrategy[str]]] = {
    "numeric": (1700, numeric_texts()),
    "double precision": (701, float_texts()),
    "real": (700, float_texts()),
    "bigint": (20, st.integers(-(2**63), 2**63 - 1).map(str)),
    "smallint": (21, st.integers(-(2**15), 2**15 - 1).map(str)),
    "boolean": (16, st.sampled_from(["t", "f"])),
    "text": (25, st.one_of(unicode_texts(), big_texts())),
    "bytea": (17, bytea_texts()),
    "integer[]": (1007, array_texts()),
    "text[]": (1009, text_array_texts()),
    "json": (114, json_value_texts()),
    "jsonb": (3802, json_value_texts()),
    "timestamp with time zone": (1184, timestamp_texts(zone=True)),
    "timestamp without time zone": (1114, timestamp_texts(zone=False)),
    "date": (1082, st.sampled_from(["infinity", "-infinity", "4713-01-01 BC", "5874897-12-31"])),
    "uuid": (2950, st.uuids().map(str)),
}


def pg_values() -> st.SearchStrategy[tuple[str, int, str | None]]:
    """(type name, type OID, a text of it or None for NULL), for every type in :data:`PG_TYPES`."""
    names = [*sorted(PG_TYPES), "numeric", "numeric", "double precision"]  # the numbers: twice
    return st.sampled_from(names).flatmap(
        lambda name: st.tuples(
            st.just(name), st.just(PG_TYPES[name][0]), st.one_of(st.none(), PG_TYPES[name][1])
        )
    )


NUMBER_OIDS = frozenset({20, 21, 23, 26, 700, 701, 1700})
_JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")


def rendered(oid: int, text: str | None) -> object:
    """What ``value: row`` must make of one column's text (cdc_relay.column_json's rule, spelled
    out), as a value for orjson.dumps: a number's exact digits, NaN/Infinity as a string, a
    boolean, json embedded as it is, bytea in base64, any other text as a string, NULL null."""
    if text is None:
        return None
    if oid in NUMBER_OIDS:
        return orjson.Fragment(text) if _JSON_NUMBER.fullmatch(text) else text
    if oid == 16:  # boolean
        return text == "t"
    if oid in (114, 3802):  # json, jsonb
        return orjson.Fragment(text)
    if oid == 17:  # bytea, hex text
        return base64.b64encode(bytes.fromhex(text[2:])).decode()
    return text
