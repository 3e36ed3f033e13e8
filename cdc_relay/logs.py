"""Structured logging: one line per event of note, as ``key=value`` text or as JSON.

Call sites pass their fields as ``extra={"fields": {...}}``; the formatters render them. Values are
never secrets: settings are logged through :meth:`Settings.describe`.
"""

from __future__ import annotations

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
        parts = [f"{stamp}Z", record.levelname, f"{record.name}:", record.getMessage()]
        parts.extend(f"{key}={_plain(value)}" for key, value in fields_of(record).items())
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
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
        return orjson.dumps(data, default=str).decode()


def _plain(value: object) -> str:
    text = str(value)
    if not text or any(c in text for c in ' "=\n\r\t'):
        return orjson.dumps(text).decode()  # quoted and escaped: one event, one line
    return text


def configure(level: str = "INFO", fmt: str = "plain") -> None:
    """Send cdc_relay's logs to stderr in the chosen format (idempotent)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else PlainFormatter())
    root = logging.getLogger(_ROOT)
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
