"""Operators' patterns against writers' text (cdc_relay.patterns, the allow-list, the transforms):
time linear in the text, the meaning of Python's ``re`` wherever both engines accept a pattern,
and a refusal at start, naming the setting and why, for what only backtracking can do."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdc_relay import cli
from cdc_relay.column_json import _JSON_NUMBER
from cdc_relay.column_transform import compile_transform
from cdc_relay.config import _LEGAL_TOPIC, load_settings
from cdc_relay.errors import ConfigError
from cdc_relay.outbox import _SPACE
from cdc_relay.patterns import MAX_PROGRAM, PatternError, compile_pattern
from cdc_relay.publisher import ProduceRefused
from cdc_relay.topics import TopicRules
from cdc_relay.value_text import _BYTEA_ESCAPE

REQUIRED = {"database_url": "postgresql://relay@db/app", "kafka_bootstrap_servers": "k:9092"}
FAST = 0.25  # seconds: RE2 takes microseconds here; Python's re took seconds to forever


def _seconds(work: Callable[[], object]) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


class _Admin:
    """Every topic exists: only the allow-list decides."""

    def ensure_topic(self, *_args: Any, **_kwargs: Any) -> bool:
        return False


def _allowlist_refuses(allowlist: str, topic: str) -> bool:
    rules = TopicRules(load_settings(**REQUIRED, topic_allowlist=allowlist))
    try:
        rules.ensure(_Admin(), topic, event=True, serve=lambda: None)
    except ProduceRefused as exc:
        refused = str(exc)
    else:
        return False
    assert "CDC_RELAY_TOPIC_ALLOWLIST" in refused
    return True


# -- the findings: patterns that backtracked for seconds to forever ----------------------------


def test_the_allowlist_refuses_a_hostile_topic_in_linear_time() -> None:
    # 2^n steps for Python's re: n = 25 took ~5 s, the 40 of the report forever (a wedged relay).
    allowlist = r"outbox\.event\.([a-z0-9]+[_-]?)+"
    for n in (25, 40, 235):  # 235: the longest legal name
        topic = "outbox.event." + "a" * n + "."  # a legal topic name that does not match
        took = _seconds(partial(_allowlist_refuses, allowlist, topic))
        assert took < FAST, f"{n}: {took:.3f} s"
        assert _allowlist_refuses(allowlist, topic)
    assert not _allowlist_refuses(allowlist, "outbox.event.order_line-v2")


def test_a_transform_the_old_guard_passed_matches_in_linear_time() -> None:
    # A "?" atom was not counted as a repetition: 'a' * 34 + '!' took 1 s, each character x1.6.
    transform = compile_transform("([a-z0-9][a-z0-9-]?)+::(.*)", "$2")
    for value in ("a" * 36 + "!", "a" * 1024 + "!", "a" * 1000 + "::key"):
        took = _seconds(partial(transform.apply, value))
        assert took < FAST, f"{len(value)}: {took:.3f} s"
    assert transform.apply("a" * 36 + "!") is None
    assert transform.apply("shop-eu::order-7") == "order-7"


def test_an_exponential_counted_pattern_matches_in_linear_time() -> None:
    for n in (25, 1000):
        transform = compile_transform(f"(?:a?){{{n}}}(a{{{n}}})", "$1")
        took = _seconds(partial(transform.apply, "a" * n))
        assert took < FAST, f"{n}: {took:.3f} s"
        assert transform.apply("a" * n) == "a" * n
        assert transform.apply("a" * (2 * n + 1)) is None


# -- linear time, as a property ----------------------------------------------------------------

# Nested repetitions: the shapes that make a backtracking engine exponential.
_INNER = st.sampled_from(
    ["a", "a+", "a*", "a?", "[a-z0-9]+", "[a-z]", "(?:a|aa)", "a+[_-]?", r"\w"]
)
_OUTER = st.sampled_from(["+", "*", "{2,}", "{1,200}", "+?"])
_TAIL = st.sampled_from(["", "b", "::(.*)", "$", "!x"])

ADVERSARIAL = 10_000  # characters of text that a backtracking engine could not finish
STEP = 100e-9  # seconds, generous: RE2 measured 1-15 ns per byte and program instruction


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_INNER, _INNER, _OUTER, _TAIL, st.sampled_from(["!", ".", "", "ab"]))
def test_nested_repetitions_match_in_linear_time(
    first: str, second: str, outer: str, tail: str, end: str
) -> None:
    regex = f"(?:({first})({second})){outer}{tail}"
    try:
        pattern = compile_pattern(regex)
    except PatternError:
        with pytest.raises(PatternError, match=f"more than {MAX_PROGRAM}"):
            compile_pattern(regex)
        return
    data = ("a" * ADVERSARIAL + end).encode()
    took = _seconds(lambda: pattern.spans(data))
    bound = 0.05 + STEP * len(data) * pattern.program_size
    assert took < bound, f"{pattern.regex} against {len(data)} bytes: {took:.3f} s"


@pytest.mark.parametrize(
    ("regex", "text"),
    [
        (r"outbox\.event\.([a-z0-9]+[_-]?)+", "outbox.event." + "a" * ADVERSARIAL + "!"),
        ("([a-z0-9][a-z0-9-]?)+::(.*)", "a" * ADVERSARIAL + "!"),
        ("(?:a?){1000}a{1000}", "a" * ADVERSARIAL),
        ("(a|aa)*c", "a" * ADVERSARIAL),
        ("(.*)(.*)(.*)(.*)x", "a" * ADVERSARIAL),
    ],
)
def test_the_reported_families_at_ten_thousand_characters(regex: str, text: str) -> None:
    pattern = compile_pattern(regex)
    assert _seconds(lambda: pattern.fullmatch(text)) < 1.0
    assert not pattern.fullmatch(text) or regex.startswith("(?:a?)")


# The relay's own fixed patterns that meet row data stay on Python's re: each is unambiguous
# (one way to match any text), so it never backtracks more than once per character.
_OWN: list[tuple[str, Callable[[int], object]]] = [
    ("bytea escape", lambda n: _BYTEA_ESCAPE.sub(b"", b"\\\\" * n + b"\\9")),
    ("json number", lambda n: _JSON_NUMBER.fullmatch(b"1" * n + b".1e1x")),
    ("json space", lambda n: _SPACE.match(" \t" * n + "x")),
    ("legal topic", lambda n: _LEGAL_TOPIC.match("a" * n)),
]


@pytest.mark.parametrize(("name", "match"), _OWN, ids=[name for name, _ in _OWN])
def test_the_relays_own_patterns_on_row_data_take_linear_time(
    name: str, match: Callable[[int], object]
) -> None:
    def best(n: int) -> float:
        return min(_seconds(partial(match, n)) for _ in range(3))

    small, large = best(100_000), best(400_000)
    assert large < 8 * small + 0.05, f"{name}: {small:.4f} s, 4x the text: {large:.4f} s"


# -- the meaning of Python's re where both accept a pattern ------------------------------------


_REPEATING = ("*", "+", "{2}", "{1,3}", "{0,2}", "*?", "+?")

# (regex, whether a repeated group's body can match the empty text). There the engines keep
# different captures (Python an empty last iteration, RE2 the last non-empty one); whether the
# text matches, they agree on.
_Tree = tuple[str, bool]


def _pattern_family() -> st.SearchStrategy[_Tree]:
    atoms = st.sampled_from(["a", "b", "[ab]", "[^a]", ".", r"\d", "-", "[a-c1]", r"\."])
    quantifiers = st.sampled_from(["", "", "?", *_REPEATING])

    def group(opening: str, inner: _Tree, quantifier: str) -> _Tree:
        regex, empty_repeated = inner
        nullable = re.fullmatch(regex.replace("(?P<g>", "("), "") is not None
        return (
            f"{opening}{regex}){quantifier}",
            empty_repeated or (nullable and quantifier in _REPEATING),
        )

    def extend(inner: st.SearchStrategy[_Tree]) -> st.SearchStrategy[_Tree]:
        return st.one_of(
            st.tuples(inner, inner).map(lambda t: (t[0][0] + t[1][0], t[0][1] or t[1][1])),
            st.tuples(inner, inner).map(lambda t: (f"{t[0][0]}|{t[1][0]}", t[0][1] or t[1][1])),
            st.builds(group, st.sampled_from(["(", "(?:", "(?P<g>"]), inner, quantifiers),
        )

    leaves = st.tuples(atoms, quantifiers).map(lambda t: (t[0] + t[1], False))
    return st.recursive(leaves, extend, max_leaves=8).filter(lambda t: t[0].count("(?P<g>") <= 1)


@settings(max_examples=500, deadline=None)
@given(_pattern_family(), st.text(alphabet="ab1-.c", max_size=12))
def test_matches_agree_with_python_re(tree: _Tree, text: str) -> None:
    regex, empty_repeated = tree
    expected = re.fullmatch(regex, text)
    pattern = compile_pattern(regex)
    spans = pattern.spans(text.encode())  # ASCII text: byte offsets are character offsets
    assert (spans is None) == (expected is None), (regex, text)
    assert pattern.groups == re.compile(regex).groups
    if expected is not None and spans is not None and not empty_repeated:
        assert pattern.groupindex == expected.re.groupindex
        assert [text[slice(*span)] for span in spans[1:]] == list(expected.groups("")), (
            regex,
            text,
        )


@settings(max_examples=200, deadline=None)
@given(
    st.text(st.characters(codec="utf-8", exclude_characters=":"), min_size=1, max_size=30),
    st.text(st.characters(codec="utf-8"), max_size=30),
)
def test_transforms_agree_with_python_re_on_any_text(head: str, rest: str) -> None:
    regex = r"(?s)([^:]+)::(.*)"
    value = f"{head}::{rest}"
    expected = re.fullmatch(regex, value)
    assert expected is not None
    assert compile_transform(regex, "$2|$1").apply(value) == f"{expected[2]}|{expected[1]}"


# -- hostile pattern text: a Pattern or a PatternError, nothing else --------------------------


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80), st.text(max_size=40))
def test_any_pattern_text_compiles_or_is_refused_with_a_reason(regex: str, text: str) -> None:
    try:
        pattern = compile_pattern(regex)
    except PatternError as exc:
        refused = str(exc)
    else:
        assert isinstance(pattern.fullmatch(text), bool)  # lone surrogates included
        return
    assert refused, "a refusal says why"


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=r"ab()[]|*+?{}\.^$-:0123456789PZzCwd<>=!#", max_size=40), st.text())
def test_any_compiled_transform_returns_text_or_refuses(regex: str, value: str) -> None:
    try:
        transform = compile_transform(regex, "$0")
    except PatternError:
        return
    result = transform.apply(value)
    assert result is None or isinstance(result, str)


# -- refused at start, with the setting and the reason ----------------------------------------


@pytest.mark.parametrize(
    ("regex", "reason"),
    [
        (r"(a)\1", "backreferences are not supported"),
        (r"(?P<x>a)(?P=x)", "backreferences are not supported"),
        (r"(?<x>a)\k<x>", "backreferences are not supported"),
        (r"a(?=b)", "lookahead"),
        (r"a(?!b)", "negative lookahead"),
        (r"(?<=a)b", "lookbehind"),
        (r"(?<!a)b", "negative lookbehind"),
        (r"(?>a+)", "atomic groups"),
        (r"a*+", "possessive quantifiers"),
        (r"a{2}+", "possessive quantifiers"),
        (r"(a)?(?(1)b|c)", "conditionals"),
        (r"a\Z", r"\Z is written \z"),
        (r"\C", r"\C (a single byte"),
        (r"(?x) a", "verbose mode"),
        ("(?:a?){1001}", "may repeat at most 1000 times"),
        ("(", "does not compile: missing )"),
        (r"\p{L}{1,100}", f"more than {MAX_PROGRAM}"),
        ("a" * 2000, "longer than 1024"),
    ],
)
def test_what_needs_backtracking_is_refused_with_the_reason(regex: str, reason: str) -> None:
    with pytest.raises(PatternError, match=re.escape(reason)):
        compile_pattern(regex)
    message = _config_error(topic_allowlist=regex)
    assert message.startswith("invalid configuration: CDC_RELAY_TOPIC_ALLOWLIST: ")
    assert reason in message
    message = _config_error(
        outbox_columns={"key_from": {"column": "k", "regex": regex, "replacement": "$0"}}
    )
    assert message.startswith("invalid configuration: CDC_RELAY_OUTBOX_COLUMNS: ")
    assert reason in message


def test_the_relay_exits_2_naming_the_setting(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CDC_RELAY_DATABASE_URL", REQUIRED["database_url"])
    monkeypatch.setenv("CDC_RELAY_KAFKA_BOOTSTRAP_SERVERS", REQUIRED["kafka_bootstrap_servers"])
    monkeypatch.setenv("CDC_RELAY_TOPIC_ALLOWLIST", r"outbox\.(\w+)\.\1")

    def forbidden(_settings: object) -> int:
        raise AssertionError("the relay must not start")

    monkeypatch.setattr(cli, "run", forbidden)
    assert cli.main(["run"]) == 2
    err = capsys.readouterr().err
    assert "CDC_RELAY_TOPIC_ALLOWLIST" in err
    assert "backreferences are not supported (linear-time matching)" in err


def test_python_and_java_named_groups_and_the_allowlists_in_use() -> None:
    assert compile_transform("(?<routedByValue>.*)", "x.${routedByValue}").apply("Order") == (
        "x.Order"
    )
    assert compile_transform("(?P<v>.*)", "x.${v}").apply("Order") == "x.Order"
    assert _allowlist_refuses(r"outbox\.event\.(order|invoice)", "outbox.event.evil")
    assert not _allowlist_refuses(r"outbox\.event\.(order|invoice)", "outbox.event.invoice")
    assert not _allowlist_refuses(r"(?i)OUTBOX\..*", "outbox.x")


def _config_error(**overrides: object) -> str:
    with pytest.raises(ConfigError) as info:
        load_settings(**{**REQUIRED, **overrides})
    return str(info.value)
