"""Unit tests for cdc_relay.logs: the plain and JSON formatters and configure()."""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from cdc_relay.logs import JsonFormatter, PlainFormatter, configure, fields_of

CREATED = datetime(2024, 5, 1, 12, 34, 56, 789_000, tzinfo=UTC).timestamp()


@pytest.fixture(autouse=True)
def _restore_logger() -> Iterator[None]:
    logger = logging.getLogger("cdc_relay")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = saved


def make_record(
    msg: str = "slot confirmed %s",
    args: tuple[object, ...] = ("0/16B374D8",),
    level: int = logging.INFO,
    fields: Any = None,
    exc: bool = False,
) -> logging.LogRecord:
    attrs: dict[str, Any] = {
        "name": "cdc_relay.relay",
        "levelno": level,
        "levelname": logging.getLevelName(level),
        "msg": msg,
        "args": args,
        "created": CREATED,
    }
    if fields is not None:
        attrs["fields"] = fields
    if exc:
        try:
            raise ValueError("boom")
        except ValueError:
            attrs["exc_info"] = sys.exc_info()
    return logging.makeLogRecord(attrs)


def test_fields_of() -> None:
    assert fields_of(make_record(fields={"a": 1})) == {"a": 1}
    assert fields_of(make_record()) == {}
    assert fields_of(make_record(fields="not a dict")) == {}


# -- JSON -----------------------------------------------------------------------------------------


def test_json_line_has_level_message_and_fields() -> None:
    line = JsonFormatter().format(
        make_record(
            level=logging.WARNING,
            fields={
                "slot": "cdc_relay",
                "lag": 3,
                "ok": True,
                "ratio": 0.5,
                "none": None,
                "nested": {"a": [1, 2]},
            },
        )
    )
    assert "\n" not in line
    data = json.loads(line)
    assert data == {
        "ts": data["ts"],
        "level": "WARNING",
        "logger": "cdc_relay.relay",
        "msg": "slot confirmed 0/16B374D8",
        "slot": "cdc_relay",
        "lag": 3,
        "ok": True,
        "ratio": 0.5,
        "none": None,
        "nested": {"a": [1, 2]},
    }
    assert datetime.fromisoformat(data["ts"]) == datetime.fromtimestamp(CREATED, UTC)


def test_json_without_fields() -> None:
    data = json.loads(JsonFormatter().format(make_record(level=logging.ERROR)))
    assert set(data) == {"ts", "level", "logger", "msg"}
    assert data["level"] == "ERROR"


def test_json_renders_unknown_types_as_text() -> None:
    data = json.loads(
        JsonFormatter().format(make_record(fields={"path": Path("/tmp/x"), "kind": ValueError}))
    )
    assert data["path"] == "/tmp/x"
    assert data["kind"] == str(ValueError)


def test_json_escapes_quotes_and_newlines_in_the_message() -> None:
    line = JsonFormatter().format(make_record(msg='he said "hi"\nthen left', args=()))
    assert "\n" not in line
    assert json.loads(line)["msg"] == 'he said "hi"\nthen left'


def test_json_includes_the_exception() -> None:
    data = json.loads(JsonFormatter().format(make_record(exc=True)))
    assert "Traceback" in data["exc"]
    assert "ValueError: boom" in data["exc"]


# -- plain ----------------------------------------------------------------------------------------


def test_plain_line_renders_key_value_fields() -> None:
    line = PlainFormatter().format(
        make_record(
            fields={
                "slot": "cdc_relay",
                "lag": 3,
                "ok": True,
                "note": "two words",
                "empty": "",
                "none": None,
            }
        )
    )
    assert line == (
        "2024-05-01T12:34:56.789Z INFO cdc_relay.relay: slot confirmed 0/16B374D8 "
        'slot=cdc_relay lag=3 ok=True note="two words" empty="" none=None'
    )


def test_plain_line_without_fields() -> None:
    line = PlainFormatter().format(make_record(level=logging.DEBUG))
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z DEBUG cdc_relay\.relay: slot confirmed 0/16B374D8",
        line,
    )


def test_plain_includes_the_exception_after_the_line() -> None:
    first, *rest = PlainFormatter().format(make_record(exc=True, fields={"a": 1})).splitlines()
    assert first.endswith("slot confirmed 0/16B374D8 a=1")
    assert rest[0] == "  Traceback (most recent call last):"  # indented: never a record's start
    assert rest[-1] == "  ValueError: boom"


# -- configure ------------------------------------------------------------------------------------


def test_configure_json_writes_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    configure("DEBUG", "json")
    logging.getLogger("cdc_relay.test").debug("hello %d", 5, extra={"fields": {"k": "v"}})
    captured = capsys.readouterr()
    assert captured.out == ""
    data = json.loads(captured.err)
    assert data["msg"] == "hello 5"
    assert data["level"] == "DEBUG"
    assert data["logger"] == "cdc_relay.test"
    assert data["k"] == "v"


def test_configure_plain_filters_by_level(capsys: pytest.CaptureFixture[str]) -> None:
    configure("WARNING", "plain")
    log = logging.getLogger("cdc_relay.test")
    log.info("hidden")
    log.warning("shown", extra={"fields": {"n": 1}})
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1
    assert lines[0].endswith("WARNING cdc_relay.test: shown n=1")


def test_configure_is_idempotent() -> None:
    configure()
    configure("ERROR", "json")
    logger = logging.getLogger("cdc_relay")
    assert len(logger.handlers) == 1
    assert isinstance(logger.handlers[0].formatter, JsonFormatter)
    assert logger.level == logging.ERROR
    assert logger.propagate is False


# -- hostile values (issue 11, item 13) -----------------------------------------------------------

STAMP = re.compile(r"\d{4}-\d\d-\d\dT")
FORGERIES = [
    "x\n2024-05-01T12:34:56.789Z INFO cdc_relay.relay: forged",
    "x\r\n2024-05-01T12:34:56.789Z INFO forged",
    "x\r2024-05-01T12:34:56.789Z INFO forged",
    "x\u2028forged",
    "x\u2029forged",
    "x\x85forged",
    "x\x0bforged\x0cforged\x1cforged\x1dforged\x1eforged",
    "x\x1b[2K\rforged",  # a terminal escape that erases the line
    "x\ud800",  # a lone surrogate
    'x" forged=1 y="',
    "x\\nforged",  # a literal backslash-n: quoted, so it is not read as an escape
]


@pytest.mark.parametrize("value", FORGERIES)
def test_plain_field_values_cannot_forge_lines_or_fields(value: str) -> None:
    line = PlainFormatter().format(make_record(fields={"event_id": value, "after": 1}))
    assert len(line.splitlines()) == 1
    assert line.isprintable()
    assert line.endswith(" after=1")
    rendered = line.split(" event_id=", 1)[1].removesuffix(" after=1")
    assert rendered.startswith('"')
    if value.isprintable():  # quoted as a JSON string: reads back exactly
        assert json.loads(rendered) == value


@pytest.mark.parametrize("value", FORGERIES)
def test_plain_message_cannot_forge_lines(value: str) -> None:
    # A RelayError's text is the message of the exit line; it may name an event id.
    line = PlainFormatter().format(make_record(msg=f"Kafka refused event {value}", args=()))
    assert len(line.splitlines()) == 1
    assert line.isprintable()


def test_plain_exception_text_cannot_start_a_line_of_its_own() -> None:
    try:
        raise ValueError("bad row\n2024-05-01T12:34:56.789Z INFO cdc_relay.relay: forged")
    except ValueError:
        record = make_record()
        record.exc_info = sys.exc_info()
    first, *rest = PlainFormatter().format(record).splitlines()
    assert STAMP.match(first)
    assert rest
    assert not any(STAMP.match(line) for line in rest)
    assert all(line.startswith("  ") for line in rest)


def test_plain_keeps_printable_unicode_readable() -> None:
    line = PlainFormatter().format(make_record(fields={"city": "Zürich", "note": "東京 🚀"}))
    assert line.endswith('city=Zürich note="東京 🚀"')


def test_json_line_with_a_lone_surrogate_is_still_one_json_line() -> None:
    line = JsonFormatter().format(make_record(msg="event \ud800", args=(), fields={"id": "\udc80"}))
    data = json.loads(line)
    assert data["msg"] == "event \\ud800"
    assert data["id"] == "\\udc80"
    assert "\n" not in line
