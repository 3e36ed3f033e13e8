"""Column values as JSON, from the text form both decoders deliver (``row``/``envelope`` values).

Why this module exists: a record value that is the whole row, or an envelope of the payload plus
chosen columns, must say in JSON what PostgreSQL said in text, without rounding or guessing. The
rule, by the column's type (its OID in the Relation, which pgoutput and wal2json both give):

* ``smallint``, ``integer``, ``bigint``, ``oid``, ``real``, ``double precision``, ``numeric``:
  a JSON number holding PostgreSQL's exact text (``1.10``, ``123456789012345678901234567890``
  stay as they are); ``NaN`` and ``[-]Infinity``, which JSON has no number for, a JSON string;
* ``boolean``: ``true`` / ``false``;
* ``json`` / ``jsonb``: embedded as JSON (PostgreSQL checked it);
* ``bytea``: a JSON string of the bytes in standard base64 (RFC 4648, with padding);
* everything else (text, varchar, uuid, timestamps, dates, enums, arrays, domains …): a JSON
  string of the text, as PostgreSQL printed it with the session's settings (timestamps in the
  server's DateStyle/TimeZone);
* SQL NULL: ``null``.

A text that is not UTF-8 is refused (MalformedEvent naming the column), never replaced.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable

import orjson

from cdc_relay.value_text import BYTEA_OID, MalformedEvent, bytea_bytes, check_json

JsonValue = orjson.Fragment | str | bool | None
Render = Callable[[bytes, str | None], JsonValue]

_NUMBER_OIDS = frozenset({20, 21, 23, 26, 700, 701, 1700})
_BOOL_OID = 16
JSON_OIDS = frozenset({114, 3802})

# RFC 8259's number grammar; PostgreSQL's numbers match it except NaN and [-]Infinity.
_JSON_NUMBER = re.compile(rb"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")


def renderer(type_oid: int, name: str) -> Render:
    """How a column of this type becomes a JSON value; chosen once per column."""
    if type_oid in _NUMBER_OIDS:
        return lambda value, event_id: _number(value, name, event_id)
    if type_oid == _BOOL_OID:
        return lambda value, event_id: _boolean(value, name, event_id)
    if type_oid in JSON_OIDS:
        return lambda value, event_id: orjson.Fragment(value)
    if type_oid == BYTEA_OID:
        return lambda value, event_id: base64.b64encode(bytea_bytes(value, event_id)).decode()
    return lambda value, event_id: text(value, name, event_id)


def expanded_renderer(type_oid: int, name: str) -> Render:
    """A payload column read as JSON whatever its type (``expand_json_payload``): checked first."""
    if type_oid in JSON_OIDS:
        return lambda value, event_id: orjson.Fragment(value)

    def expand(value: bytes, event_id: str | None) -> JsonValue:
        data = bytea_bytes(value, event_id) if type_oid == BYTEA_OID else value
        check_json(data, name, event_id)
        return orjson.Fragment(data)

    return expand


def text(value: bytes, name: str, event_id: str | None) -> str:
    try:
        return value.decode()
    except UnicodeDecodeError:
        raise MalformedEvent(f"column {name} is not valid UTF-8", event_id) from None


def _number(value: bytes, name: str, event_id: str | None) -> JsonValue:
    if _JSON_NUMBER.fullmatch(value):
        return orjson.Fragment(value)
    return text(value, name, event_id)  # NaN, Infinity, -Infinity


def _boolean(value: bytes, name: str, event_id: str | None) -> JsonValue:
    if value == b"t":
        return True
    if value == b"f":
        return False
    raise MalformedEvent(f"column {name} is not a boolean's text (t or f)", event_id)
