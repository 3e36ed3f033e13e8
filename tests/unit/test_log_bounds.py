"""Every log record is one bounded line, whatever its message, fields or exception hold.

A row reaches log lines through event ids, topics, error texts: a 5 MB ``aggregate_type`` made one
5 MB line. The formatters cut each long value with a visible marker and keep the whole record
under :data:`MAX_LINE_BYTES`, in both formats, without ever showing a secret.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from typing import Any
from unittest.mock import Mock

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import SecretStr

from cdc_relay.config import load_settings
from cdc_relay.database_url import redact_url
from cdc_relay.errors import RelayError, StopSession
from cdc_relay.logs import (
    MAX_LINE_BYTES,
    MAX_VALUE_CHARS,
    JsonFormatter,
    PlainFormatter,
    configure,
    cut,
)
from cdc_relay.observability.stats import RelayStats
from cdc_relay.poison import PoisonPolicyHandler, RefusedRecord
from cdc_relay.publisher import ProduceRefused, Publisher
from cdc_relay.topics import TopicRules
from cdc_relay.watermark import Watermark

FORMATTERS = [PlainFormatter(), JsonFormatter()]
STAMP = re.compile(r"\d{4}-\d\d-\d\dT")
SECRET = "pw-Qx7Zk2Lr9Vb4"
CUT_MARKER = re.compile(r"…\[cut [\d,]+ chars\]")


def _record(
    msg: str, fields: dict[str, Any] | None = None, exc: BaseException | None = None
) -> logging.LogRecord:
    attrs: dict[str, Any] = {"name": "cdc_relay.poison", "levelno": logging.ERROR}
    attrs |= {"levelname": "ERROR", "msg": msg, "args": ()}
    if fields is not None:
        attrs["fields"] = fields
    if exc is not None:
        try:
            raise exc
        except BaseException:
            attrs["exc_info"] = sys.exc_info()
    return logging.makeLogRecord(attrs)


def _size(line: str) -> int:
    """Bytes the handler writes for ``line``: the line and its newline."""
    return len(line.encode("utf-8", "surrogatepass")) + 1


def test_a_poison_record_with_a_huge_topic_is_one_short_line() -> None:
    topic = "outbox.event." + "a" * 5_000_000
    fields = {"event_id": "e-1", "table": "public.outbox", "topic": topic, "error": "too large"}
    for formatter in FORMATTERS:
        line = formatter.format(
            _record("poison record, sending it to the dead-letter topic", fields)
        )
        assert _size(line) <= MAX_LINE_BYTES
        assert f"…[cut {len(topic) - MAX_VALUE_CHARS:,} chars]" in line
        assert "too large" in line  # the fields after it are kept
        if isinstance(formatter, JsonFormatter):
            data = json.loads(line)
            assert data["topic"].startswith("outbox.event.aaaa")
            assert data["error"] == "too large"


def test_cut_keeps_short_text_and_marks_what_it_cut() -> None:
    assert cut("abc", 3) == "abc"
    assert cut("abcdef", 3) == "abc…[cut 3 chars]"
    assert cut(None) is None


def test_a_huge_exception_is_cut_in_its_middle() -> None:
    exc = ValueError("row " + "x" * 1_000_000 + " the end")
    for formatter in FORMATTERS:
        line = formatter.format(_record("session failed", {"a": 1}, exc))
        assert _size(line) <= MAX_LINE_BYTES
        assert "Traceback" in line  # its head
        assert "the end" in line  # and its tail, where the error is
        assert CUT_MARKER.search(line)


def test_many_long_fields_still_make_one_bounded_line() -> None:
    fields = {f"field{i}": "\x00" * MAX_VALUE_CHARS for i in range(100)}
    for formatter in FORMATTERS:
        line = formatter.format(_record("m" * 100_000, fields))
        assert _size(line) <= MAX_LINE_BYTES
        if isinstance(formatter, JsonFormatter):
            data = json.loads(line)
            assert data["level"] == "ERROR"
            assert data["cut_fields"] > 0  # what did not fit is counted
        else:
            assert "cut_fields=" in line


# -- any record -----------------------------------------------------------------------------------

# Any character, lone surrogates, line breaks and terminal escapes included. Long texts are built
# by repetition: hypothesis draws the piece, not megabytes of it.
chars = st.characters(exclude_categories=())
texts = st.one_of(
    st.text(chars, max_size=40),
    st.builds(
        lambda piece, times: piece * times,
        st.text(chars, min_size=1, max_size=8),
        st.integers(0, 40_000),
    ),
)
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), texts, st.just(SecretStr(SECRET))
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(chars, max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=75, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    msg=texts,
    fields=st.dictionaries(texts, values, max_size=12),
    exc_text=st.none() | texts,
    url=st.text(min_size=1, max_size=20),  # printable or not, libpq parses it or not
)
@example(  # long fields after a long message: the traceback still has its room
    msg="0\x1f\U00018cd6" * 1355,
    fields={"": ["\x1f\x1f\x1f" * 350], "00": "\U0003134b" * 3990},
    exc_text="",
    url="0",
)
def test_any_record_is_one_bounded_line_without_secrets(
    msg: str, fields: dict[str, Any], exc_text: str | None, url: str
) -> None:
    fields = {**fields, "database_url": redact_url(f"postgresql://relay:{SECRET}@{url}/app")}
    exc = None if exc_text is None else RuntimeError(exc_text)
    for formatter in FORMATTERS:
        line = formatter.format(_record(msg, fields, exc))
        assert _size(line) <= MAX_LINE_BYTES
        assert SECRET not in line
        if isinstance(formatter, JsonFormatter):
            assert "\n" not in line
            assert "\r" not in line
            data = json.loads(line)
            assert data["level"] == "ERROR"
            assert data["logger"] == "cdc_relay.poison"
        else:
            first, *rest = line.split("\n")
            assert STAMP.match(first)
            assert first.isprintable()
            # The traceback's lines, indented: never the start of a record of their own.
            assert all(text.startswith("  ") and text.isprintable() for text in rest)
            assert bool(rest) == (exc is not None)


@pytest.mark.parametrize("formatter", FORMATTERS, ids=["plain", "json"])
def test_a_short_record_is_not_touched(formatter: logging.Formatter) -> None:
    line = formatter.format(_record("slot confirmed", {"lsn": "0/16B374D8", "n": 3}))
    assert "cut" not in line
    assert "0/16B374D8" in line


# -- the call sites that quote a row's text ------------------------------------------------------

HUGE_TOPIC = "outbox.event." + "a" * 5_000_000 + "!"


def test_a_poison_record_with_a_huge_topic_logs_and_fails_in_short_text(
    capsys: pytest.CaptureFixture[str],
) -> None:
    logger = logging.getLogger("cdc_relay")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    failures: list[RelayError] = []
    settings = load_settings(
        database_url="postgresql://relay@db/app",
        kafka_bootstrap_servers="k:9092",
        poison_policy="stop",
    )
    handler = PoisonPolicyHandler(
        settings,
        Mock(),
        Mock(),
        ensure_topic=lambda topic: None,
        fail=failures.append,
        wait_for_room=lambda: None,
    )
    refused = RefusedRecord(
        txn=Watermark(0).open(100),
        table="public.outbox",
        reason=f"topic {HUGE_TOPIC!r} is not allowed",  # as a caller that did not cut it
        code="POLICY_VIOLATION",
        event_id="e-" + "1" * 1_000_000,
        topic=HUGE_TOPIC,
        headers=[],
    )
    try:
        configure("INFO", "json")
        with pytest.raises(StopSession):
            handler.refuse(refused)
        lines = capsys.readouterr().err.splitlines()
    finally:
        logger.handlers[:], logger.level, logger.propagate = saved
    assert len(lines) == 1
    assert _size(lines[0]) <= MAX_LINE_BYTES
    assert json.loads(lines[0])["topic"].startswith("outbox.event.aaa")
    assert len(str(failures[0])) < 4 * MAX_VALUE_CHARS


def test_a_refused_topic_is_quoted_cut() -> None:
    """The allow-list matches legal names only; the illegal name is refused, quoted cut."""
    settings = load_settings(
        database_url="postgresql://relay@db/app",
        kafka_bootstrap_servers="k:9092",
        topic_allowlist=r"outbox\.event\.[a-z]+",
    )
    publisher = Publisher({"bootstrap.servers": "127.0.0.1:9"}, RelayStats())
    try:
        with pytest.raises(ProduceRefused) as refused:
            TopicRules(settings).ensure(publisher, HUGE_TOPIC, event=True, serve=lambda: None)
    finally:
        publisher.close()
    assert refused.value.reason.startswith("invalid topic name")
    assert len(refused.value.reason) < 2 * MAX_VALUE_CHARS
    assert "…[cut " in refused.value.reason
