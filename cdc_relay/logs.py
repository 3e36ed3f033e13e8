"""Structured logging: one line per event of note, as ``key=value`` text or as JSON.

Call sites pass their fields as ``extra={"fields": {...}}``; the formatters render them. Values are
never secrets: settings are logged through :meth:`Settings.describe`, secrets are ``SecretStr``
(which renders masked).

Messages and field values may carry row values (an event id, a topic, an error naming a column):
one record is one line whatever they hold. The plain format escapes every non-printable character
(newlines, other line separators, terminal escapes, lone surrogates) and quotes values that need
it; the lines of a traceback after the record's first line are indented, so a line only ever
starts with a timestamp when it is a record of its own.

And one record is short whatever they hold: each value (the message, a field, the traceback) is
cut after :data:`MAX_VALUE_CHARS` characters with a visible marker (``…[cut 4,995,904 chars]``),
and the whole record, its newline included, stays within :data:`MAX_LINE_BYTES` of UTF-8: each
value gets at most the room left, counted at the longest a character can render to; a field that
finds no room is left out and counted (``cut_fields``). This holds for every call site, so none
has to remember it; a call site with a row's text still cuts it (:func:`cut`) before building a
message around it, so that no multi-megabyte string is built only to be cut here.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, overload

import orjson

_ROOT = "cdc_relay"

MAX_LINE_BYTES = 64 * 1024  # one record's output, its newline included, in UTF-8 bytes
MAX_VALUE_CHARS = 4096  # characters of one value before it is cut
_MAX_NAME_CHARS = 128  # of a field's name, the level, the logger
# The most bytes one character renders to: ``\U000e0001`` in the plain format (in JSON: 7, a lone
# surrogate's escape with its backslash escaped).
_BYTES_PER_CHAR = 10
_MARKER_BYTES = 48  # the cut marker(s) of one value
_CUT_FIELDS = "cut_fields"
_RESERVED_BYTES = 32  # room for the count of fields left out


@overload
def cut(text: str, limit: int = MAX_VALUE_CHARS) -> str: ...
@overload
def cut(text: None, limit: int = MAX_VALUE_CHARS) -> None: ...
def cut(text: str | None, limit: int = MAX_VALUE_CHARS) -> str | None:
    """``text`` with what follows its first ``limit`` characters replaced by a marker."""
    if text is None or len(text) <= limit:
        return text
    return f"{text[:limit]}…[cut {len(text) - limit:,} chars]"


def cut_middle(text: str, limit: int) -> str:
    """``text`` cut to its first and last characters, ``limit`` in all (a traceback's tail
    names the error)."""
    if len(text) <= limit:
        return text
    tail = limit // 2
    return f"{text[: limit - tail]}…[cut {len(text) - limit:,} chars]…{text[len(text) - tail :]}"


def fields_of(record: logging.LogRecord) -> dict[str, Any]:
    value = getattr(record, "fields", None)
    return value if isinstance(value, dict) else {}


def _room(left: int, overhead: int) -> int:
    """How many characters of a value fit in ``left`` bytes besides ``overhead``; < 0: none."""
    return min(MAX_VALUE_CHARS, (left - overhead - _MARKER_BYTES) // _BYTES_PER_CHAR)


def _text(value: object) -> str:
    try:
        return value if isinstance(value, str) else str(value)
    except Exception:  # an int of more digits than str() allows, a broken __str__
        return f"<{type(value).__name__} that cannot be shown>"


class PlainFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = datetime.fromtimestamp(record.created, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3]
        level = _printable(cut(_text(record.levelname), _MAX_NAME_CHARS))
        name = _printable(cut(_text(record.name), _MAX_NAME_CHARS))
        parts = [f"{stamp}Z {level} {name}:"]
        left = MAX_LINE_BYTES - 1 - _RESERVED_BYTES - _size(parts[0])

        def add(piece: str) -> None:
            nonlocal left
            parts.append(piece)
            left -= _size(piece)

        room = _room(left, 1)
        if room >= 0:
            add(" " + _printable(cut(record.getMessage(), room)))
        # The traceback gets its room before the fields (it says what failed), and goes last:
        # its lines are indented continuation lines of the first.
        trace = ""
        if record.exc_info:
            room = _room(left, 0)
            if room >= 0:
                text = cut_middle(self.formatException(record.exc_info), room)
                trace = "".join(f"\n  {_printable(line)}" for line in text.splitlines())
                left -= _size(trace)
        dropped = 0
        for key, value in fields_of(record).items():
            prefix = f" {_printable(cut(_text(key), _MAX_NAME_CHARS))}="
            room = _room(left, _size(prefix) + 2)  # 2: the quotes
            if room < 0:
                dropped += 1
                continue
            add(prefix + _plain(cut(_text(value), room)))
        if dropped:
            parts.append(f" {_CUT_FIELDS}={dropped}")
        parts.append(trace)
        return "".join(parts)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        data: dict[Any, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": cut(_text(record.levelname), _MAX_NAME_CHARS),
            "logger": cut(_text(record.name), _MAX_NAME_CHARS),
            "msg": record.getMessage(),
        }
        if record.exc_info:  # its room before the fields': it says what failed
            data["exc"] = self.formatException(record.exc_info)
        for key, value in fields_of(record).items():
            if key != "exc" or "exc" not in data:
                data[key] = value
        pieces: list[bytes] = []
        left = MAX_LINE_BYTES - 1 - 2 - _RESERVED_BYTES  # the newline, the braces
        dropped = 0
        for key, value in data.items():
            name = _json_str(cut(_text(key), _MAX_NAME_CHARS)) + b":"
            if isinstance(value, str):
                text = value
                encoded = _json_str(value) if len(value) <= MAX_VALUE_CHARS else None
            else:
                encoded = _json_value(value)
                text = encoded.decode() if encoded is not None else _text(value)
                if encoded is not None and len(encoded) > MAX_VALUE_CHARS:
                    encoded = None
            if encoded is None or len(name) + len(encoded) + 1 > left:
                room = _room(left, len(name) + 3)  # 3: the quotes, the comma
                if room < 0:
                    dropped += 1
                    continue
                shorten: Callable[[str, int], str] = cut_middle if key == "exc" else cut
                encoded = _json_str(shorten(text, room))
            pieces.append(name + encoded)
            left -= len(name) + len(encoded) + 1
        if dropped and _CUT_FIELDS not in data:
            pieces.append(b'"%s":%d' % (_CUT_FIELDS.encode(), dropped))
        return (b"{" + b",".join(pieces) + b"}").decode()


def _json_str(text: str) -> bytes:
    try:
        return orjson.dumps(text)
    except TypeError:  # a lone surrogate, which orjson refuses: its escape instead
        return orjson.dumps(text.encode("utf-8", "backslashreplace").decode())


def _json_value(value: object) -> bytes | None:
    """``value`` (not a str) as JSON; None if it cannot be."""
    try:
        return orjson.dumps(value, default=str)
    except TypeError:  # a lone surrogate, a key that is not a str, an int beyond 64 bits
        try:
            return orjson.dumps(_encodable(value), default=str)
        except Exception:
            return None
    except Exception:
        return None


def _encodable(value: Any) -> Any:
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode()
    if isinstance(value, dict):
        return {_encodable(_text(k)): _encodable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_encodable(v) for v in value]
    if isinstance(value, bool | float | None):
        return value
    if isinstance(value, int) and -(2**63) <= value < 2**64:
        return value
    return _encodable(_text(value))


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


def _size(text: str) -> int:
    return len(text.encode())


def configure(level: str = "INFO", fmt: str = "plain") -> None:
    """Send cdc_relay's logs to stderr in the chosen format (idempotent)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else PlainFormatter())
    root = logging.getLogger(_ROOT)
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
