"""Structured logging: one line per event of note, as ``key=value`` text or as JSON.

Call sites pass their fields as ``extra={"fields": {...}}``; the formatters render them. Values are
never secrets: settings are logged through :meth:`Settings.describe`.

Messages and field values may carry row values (an event id, an error naming a column): one record
is one line whatever they hold. The plain format escapes every non-printable character (newlines,
other line separators, terminal escapes, lone surrogates) and quotes values that need it; the lines
of a traceback after the record's first line are indented, so a line only ever starts with a
timestamp when it is a record of its own.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

import orjson

_ROOT = "cdc_relay"


def fields_of(record: logging.LogRecord) -> dict[str, Any]:
    value = getattr(record, "fields", None)
    return value if isinstance(value, dict) else {}


class PlainFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = datetime.fromtimestamp(record.created, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3]
        parts = [f"{stamp}Z", record.levelname, f"{record.name}:", _printable(record.getMessage())]
        parts.extend(
            f"{_printable(str(key))}={_plain(value)}" for key, value in fields_of(record).items()
        )
        line = " ".join(parts)
        if record.exc_info:
            trace = self.formatException(record.exc_info)
            line += "".join(f"\n  {_printable(text)}" for text in trace.splitlines())
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            **fields_of(record),
        }
        if record.exc_info:
            data["exc"] = self.formatException(record.exc_info)
        try:
            return orjson.dumps(data, default=str).decode()
        except TypeError:  # a str orjson cannot encode (a lone surrogate): escape it
            return orjson.dumps(_encodable(data), default=str).decode()


def _encodable(value: Any) -> Any:
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode()
    if isinstance(value, dict):
        return {_encodable(str(k)): _encodable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_encodable(v) for v in value]
    return _encodable(str(value)) if not isinstance(value, int | float | bool | None) else value


_NEEDS_QUOTES = frozenset(' "=\\')


def _plain(value: object) -> str:
    text = str(value)
    if text and text.isprintable() and not _NEEDS_QUOTES.intersection(text):
        return text
    # Quoted and escaped as a JSON string (then any non-printable JSON leaves as it is): one line.
    return _printable(json.dumps(text, ensure_ascii=False))


def _printable(text: str) -> str:
    """``text`` with each non-printable character as its Python escape (``\\n``, ``\\x1b``)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def configure(level: str = "INFO", fmt: str = "plain") -> None:
    """Send cdc_relay's logs to stderr in the chosen format (idempotent)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else PlainFormatter())
    root = logging.getLogger(_ROOT)
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
