"""A column value's text, as PostgreSQL prints it, checked as JSON or decoded from bytea.

Why this module exists: the plain mapping (:mod:`cdc_relay.outbox`) and the column renderers of
the shaped one (:mod:`cdc_relay.column_json`) both take a text payload only once it is checked to
be JSON, and a bytea value only as the bytes its text stands for; both refuse what is not with
:class:`MalformedEvent`, the one error a mapping raises (the relay dead-letters the row).
"""

from __future__ import annotations

import binascii
import json
import re

import orjson

BYTEA_OID = 17  # pg_type.dat
MAX_JSON_DEPTH = 1024  # what orjson, the fast check, takes: nested deeper is refused


class MalformedEvent(ValueError):
    """The row does not satisfy the outbox contract; ``event_id`` is set when it could be read."""

    def __init__(self, reason: str, event_id: str | None = None) -> None:
        super().__init__(reason)
        self.event_id = event_id


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def _ignore_number(text: str) -> None:
    return None


# The strict RFC 8259 grammar with numbers of any size (not converted) and without NaN/Infinity.
_CHECKING_JSON = json.JSONDecoder(
    parse_float=_ignore_number, parse_int=_ignore_number, parse_constant=_reject_constant
)


def check_json(value: bytes, name: str, event_id: str | None) -> None:
    """Raise MalformedEvent unless ``value`` is one JSON text (UTF-8, not too deeply nested)."""
    try:
        orjson.loads(value)  # fast and strict; it also refuses what is merely beyond its limits
        return
    except orjson.JSONDecodeError:
        pass
    try:
        text = value.decode()
        if _depth_exceeds(text, MAX_JSON_DEPTH):
            raise MalformedEvent(f"{name} is nested deeper than {MAX_JSON_DEPTH} levels", event_id)
        _CHECKING_JSON.decode(text)
    except UnicodeDecodeError:
        raise MalformedEvent(f"{name} is not valid UTF-8", event_id) from None
    except RecursionError:
        raise MalformedEvent(f"{name} is nested too deeply", event_id) from None
    except ValueError as exc:  # JSONDecodeError (which says where) or a NaN/Infinity
        if isinstance(exc, MalformedEvent):
            raise
        raise MalformedEvent(f"{name} is not valid JSON: {exc}", event_id) from None


def _depth_exceeds(text: str, limit: int) -> bool:
    """Whether brackets outside strings nest deeper than ``limit`` (a bound, not a parser)."""
    depth = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > limit:
                return True
        elif char in "]}":
            depth -= 1
    return False


_BYTEA_ESCAPE = re.compile(rb"\\(\\|[0-3][0-7]{2})")


def bytea_bytes(text: bytes, event_id: str | None) -> bytes:
    """The bytes of a bytea value from its text form: hex (``\\x7b7d``, the default) or escape.

    Hex is read by binascii, which refuses an odd length or anything but hex digits (whitespace
    too) and needs no memory beyond the result: a value may be hundreds of megabytes."""
    if text.startswith(b"\\x"):
        try:
            return binascii.unhexlify(memoryview(text)[2:])
        except binascii.Error:
            raise MalformedEvent("payload is not a valid bytea hex text", event_id) from None
    if b"\\" not in text:
        return text
    if _BYTEA_ESCAPE.sub(b"", text).count(b"\\"):
        raise MalformedEvent("payload is not a valid bytea escape text", event_id)
    return _BYTEA_ESCAPE.sub(_unescape_octet, text)


def _unescape_octet(match: re.Match[bytes]) -> bytes:
    escaped = match.group(1)
    return b"\\" if escaped == b"\\" else bytes([int(escaped, 8)])
