"""Outbox mapping: a decoded outbox row becomes a Kafka record (topic, key, value, headers).

The contract: topic = the template applied to the row; key = ``aggregate_id`` (UTF-8); value =
``payload`` (a ``jsonb``/``json`` column's text, already valid JSON, passed through unparsed; a
``text`` column's text once it is checked to be JSON; a ``bytea`` column's bytes); headers ``id``,
``event_type``, ``aggregate_type``, then each top-level entry of the ``headers`` column (strings as
they are, other JSON values as their JSON text, exactly as PostgreSQL printed it; a name the relay
sets itself, :mod:`cdc_relay.reserved_headers`, refuses the row). A row that
cannot be mapped raises :class:`MalformedEvent`, which the relay dead-letters, never drops; the
mapping raises nothing else (header names librdkafka cannot take are refused here, before it sees
them).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from functools import partial
from typing import Final, NamedTuple, NoReturn, cast

import orjson
from mypy_extensions import mypyc_attr

from cdc_relay import c_extension
from cdc_relay.config import OutboxColumns
from cdc_relay.decode.messages import Relation, TupleData, UnchangedToast
from cdc_relay.reserved_headers import reserved
from cdc_relay.value_text import BYTEA_OID, MalformedEvent, bytea_bytes, check_json

DEFAULT_COLUMNS = OutboxColumns()

_TOPIC_CACHE_LIMIT = 4096

# Payload column types (pg_type.dat OIDs). jsonb and json were checked by PostgreSQL and pass
# through as they are (so does an unknown type, OID 0); bytea travels as its bytes; any other type
# (text, varchar, a domain) is checked to be JSON first (cdc_relay.value_text).
_JSON_OIDS = frozenset({3802, 114, 0})


class OutboxRecord(NamedTuple):
    topic: str
    key: bytes
    value: bytes | None  # None: a tombstone (tombstone_on_empty_payload)
    headers: list[tuple[str, bytes]]
    event_id: str
    traceparent: bytes | None = None  # also headers[3] when set


# OutboxRecord's constructor is a Python function; tuple.__new__ builds the same object in C.
_new: Final = tuple.__new__
# OutboxRecord's fields as a plain tuple: what the session publishes (``map_fields``), built
# without the ~900 instructions of making it an OutboxRecord.
RecordFields = tuple[str, bytes, bytes | None, list[tuple[str, bytes]], str, bytes | None]

TRACEPARENT_HEADER_INDEX = 3
DEBEZIUM_SPAN_CONTEXT = "tracingspancontext"

# The plain mapping of an ordinary row in one C call, where the extension is built (any other
# row: _record_fields, the reference, maps it or says what is wrong). cdc_relay.c_extension.
_fast_fields = c_extension.record_fields


@mypyc_attr(allow_interpreted_subclasses=True)  # ShapedMapping subclasses it, interpreted
class OutboxMapping:
    """The column positions of one outbox relation, resolved once per Relation message."""

    def __init__(
        self,
        relation: Relation,
        topic_template: str,
        traceparent_column: str = "traceparent",
        columns: OutboxColumns = DEFAULT_COLUMNS,
    ) -> None:
        # What every outbox mapping reads (describe_row, _event_id, _read_traceparent, _topic).
        self.relation = relation
        self.table = f"{relation.namespace}.{relation.name}"
        positions = {column.name: i for i, column in enumerate(relation.columns)}
        self.missing = [name for name in columns.mapped if name not in positions]
        self._columns = columns
        self._positions = positions
        self._template = topic_template
        self._topics: dict[tuple[bytes, bytes], str] = {}
        self._headers = positions.get(columns.headers) if columns.headers else None
        self._traceparent = positions.get(traceparent_column)
        self._span_context = positions.get(DEBEZIUM_SPAN_CONTEXT)
        self.map: Callable[[TupleData], OutboxRecord] = self._map
        # The session's: the same record as a plain tuple (set with ``map``, wherever it is set).
        self.map_fields: Callable[[TupleData], RecordFields] = self._record_fields
        # Where map_fields is the C record_fields: its arguments and the table, for the C
        # extension's Publisher (cdc_relay.session), which publishes an ordinary row in one call.
        self.fast_state: tuple[object, ...] | None = None
        self._payload_type = 0
        self._resolve(relation, columns, positions)

    def _resolve(
        self, relation: Relation, columns: OutboxColumns, positions: dict[str, int]
    ) -> None:
        """The plain mapping's column positions, and its ``map`` for the payload's type: chosen
        once per relation, so a jsonb payload pays nothing for the other types' checks.
        (:class:`cdc_relay.shaped_mapping.ShapedMapping` resolves its own columns.)"""
        if not self.missing:
            # OutboxColumns.plain(): both are set (shaped_mapping.outbox_mapping chooses).
            assert columns.aggregate_type is not None
            assert columns.aggregate_id is not None
            self._id = positions[columns.id]
            self._aggregate_type = positions[columns.aggregate_type]
            self._aggregate_id = positions[columns.aggregate_id]
            self._event_type = positions[columns.event_type]
            self._payload = positions[columns.payload]
            self._topic_override = positions[columns.topic] if columns.topic else None
            self._key = positions[columns.key] if columns.key else None
            self._header_columns = [(name, positions[name]) for name in columns.header_columns]
            self._has_overrides = bool(
                self._header_columns or self._topic_override is not None or self._key is not None
            )
        payload_index = positions.get(columns.payload)
        if payload_index is not None:
            self._payload_type = relation.columns[payload_index].type_oid
            if self._payload_type not in _JSON_OIDS:
                self.map = self.map_fields = self._map_converted
                return
        if (
            not self.missing
            and not self._has_overrides
            and self._traceparent is None
            and self._span_context is None
        ):
            headers = -1 if self._headers is None else self._headers
            self._fast_spec: tuple[int | str, ...] = (
                self._id, self._aggregate_type, self._aggregate_id, self._event_type,
                self._payload, headers, "id", "event_type", "aggregate_type",
            )  # fmt: skip
            # The last (aggregate_type, event_type, topic) found in the cache, for the C call.
            self._last_topic: list[object] = [None, None, None]
            if _fast_fields is not None:
                # _record_fields of an ordinary row in one C call, the reference for any other;
                # bound by partial, so no Python frame runs per row (a cycle: the mapping lives
                # as long as its relation, and the collector frees it after).
                self.map_fields = cast(
                    "Callable[[TupleData], RecordFields]",
                    partial(_fast_fields, self._fast_spec, self._topics, self._last_topic,
                            self._record_fields),
                )  # fmt: skip
                self.fast_state = (self._fast_spec, self._topics, self._last_topic, self.table)

    def _map_converted(self, row: TupleData) -> OutboxRecord:
        """:meth:`_map`, then a bytea payload decoded to its bytes or a text payload checked."""
        record = self._map(row)
        if self._payload_type == BYTEA_OID:
            value = bytea_bytes(record.value or b"", record.event_id)
        else:
            value = record.value or b""
            check_json(value, "payload", record.event_id)
        return record._replace(value=value)

    def _map(self, row: TupleData) -> OutboxRecord:
        return _new(OutboxRecord, self._record_fields(row))

    def _record_fields(self, row: TupleData) -> RecordFields:
        # The hot path: plain indexing, one type check; anything unusual takes the careful path,
        # which says exactly what is wrong.
        try:
            raw_id = row[self._id]
            aggregate_type = row[self._aggregate_type]
            aggregate_id = row[self._aggregate_id]
            event_type = row[self._event_type]
            payload = row[self._payload]
            if not (
                type(raw_id) is bytes
                and type(aggregate_type) is bytes
                and type(aggregate_id) is bytes
                and type(event_type) is bytes
                and type(payload) is bytes
            ):
                raise TypeError
            event_id = raw_id.decode()
        except (AttributeError, IndexError, TypeError, UnicodeDecodeError):
            self._raise_malformed(row)
        try:  # free in CPython 3.11+ unless it raises
            # _first_headers inlined, deliberately: calling it measured +2.7-4.3 % of the hot path's
            # instructions per event (python -m bench.replay --callgrind).
            headers: list[tuple[str, bytes]] = [
                ("id", raw_id),
                ("event_type", event_type),
                ("aggregate_type", aggregate_type),
            ]
            traceparent = None
            if self._traceparent is not None or self._span_context is not None:
                traceparent = self._read_traceparent(row)
                if traceparent is not None:
                    headers.append(("traceparent", traceparent))
            if self._headers is not None:
                extra = row[self._headers]
                if type(extra) is bytes:
                    headers.extend(header_entries(extra, event_id))
            key = aggregate_id
            topic = None
            if self._has_overrides:
                for name, index in self._header_columns:
                    value = row[index]
                    if isinstance(value, bytes):
                        headers.append((name, value))
                if self._key is not None:
                    override = row[self._key]
                    if isinstance(override, bytes):
                        key = override
                if self._topic_override is not None:
                    override = row[self._topic_override]
                    if isinstance(override, bytes) and override:
                        topic = _decode(override, self._columns.topic or "", event_id)
            if topic is None:
                topic = self._topics.get((aggregate_type, event_type)) or self._topic(
                    aggregate_type, event_type
                )
        except IndexError:  # an optional column beyond the row: not a row of this relation
            raise MalformedEvent("the row has fewer columns than its relation", event_id) from None
        return topic, key, payload, headers, event_id, traceparent

    def _first_headers(
        self,
        row: TupleData,
        raw_id: bytes,
        event_type: bytes,
        aggregate_type: bytes,
        event_id: str,
    ) -> tuple[list[tuple[str, bytes]], bytes | None]:
        """The headers every mapping sends first (id, event_type, aggregate_type, traceparent,
        the headers column's entries), and the traceparent; :meth:`_record_fields` inlines it."""
        headers: list[tuple[str, bytes]] = [
            ("id", raw_id),
            ("event_type", event_type),
            ("aggregate_type", aggregate_type),
        ]
        traceparent = None
        if self._traceparent is not None or self._span_context is not None:
            traceparent = self._read_traceparent(row)
            if traceparent is not None:
                headers.append(("traceparent", traceparent))
        if self._headers is not None:
            extra = row[self._headers]
            if type(extra) is bytes:
                headers.extend(header_entries(extra, event_id))
        return headers, traceparent

    def _raise_malformed(self, row: TupleData) -> NoReturn:
        """Why ``row`` breaks the contract, as a MalformedEvent."""
        if self.missing:
            raise MalformedEvent(
                f"{self.table} has no column(s) {', '.join(self.missing)}", self._event_id(row)
            )
        columns = self._columns
        event_id = _text(row, self._id, columns.id, None)
        for index, name in (
            (self._aggregate_type, columns.aggregate_type or "aggregate_type"),
            (self._aggregate_id, columns.aggregate_id or "aggregate_id"),
            (self._event_type, columns.event_type),
            (self._payload, columns.payload),
        ):
            _required(row, index, name, event_id)
        raise MalformedEvent("the row does not satisfy the outbox contract", event_id)

    def _read_traceparent(self, row: TupleData) -> bytes | None:
        if self._traceparent is not None:
            value = row[self._traceparent]
            if isinstance(value, bytes) and value:
                return value.strip()
        if self._span_context is not None:
            value = row[self._span_context]
            if isinstance(value, bytes):
                found = traceparent_from_span_context(value.decode("utf-8", "replace"))
                return found.encode() if found else None
        return None

    def describe_row(self, row: TupleData) -> bytes:
        """The row as a JSON object of column texts, for a dead-letter record."""
        named: dict[str, str | None] = {}
        for column, value in zip(self.relation.columns, row, strict=False):
            if isinstance(value, bytes):
                named[column.name] = value.decode("utf-8", "replace")
            elif isinstance(value, UnchangedToast):
                named[column.name] = "<unchanged toast>"
            else:
                named[column.name] = None
        return orjson.dumps(named)

    def _event_id(self, row: TupleData) -> str | None:
        index = self._positions.get(self._columns.id)
        value = row[index] if index is not None and index < len(row) else None
        return value.decode("utf-8", "replace") if isinstance(value, bytes) else None

    def _topic(self, aggregate_type: bytes, event_type: bytes) -> str:
        cache_key = (aggregate_type, event_type)
        topic = self._topics.get(cache_key)
        if topic is None:
            try:
                topic = self._template.format(
                    aggregate_type=aggregate_type.decode(),
                    event_type=event_type.decode(),
                    table=self.relation.name,
                    schema=self.relation.namespace,
                )
            except UnicodeDecodeError:
                raise MalformedEvent("aggregate_type or event_type is not valid UTF-8") from None
            if len(self._topics) >= _TOPIC_CACHE_LIMIT:
                self._topics.clear()
            self._topics[cache_key] = topic
        return topic


def _required(row: TupleData, index: int, name: str, event_id: str) -> bytes:
    value = row[index] if index < len(row) else None
    if not isinstance(value, bytes):
        raise MalformedEvent(f"column {name} is {_describe(value)}", event_id)
    return value


def _text(row: TupleData, index: int, name: str, event_id: str | None) -> str:
    value = row[index] if index < len(row) else None
    if not isinstance(value, bytes):
        raise MalformedEvent(f"column {name} is {_describe(value)}", event_id)
    return _decode(value, name, event_id)


def _decode(value: bytes, name: str, event_id: str | None) -> str:
    try:
        return value.decode()
    except UnicodeDecodeError:
        raise MalformedEvent(f"column {name} is not valid UTF-8", event_id) from None


def _describe(value: object) -> str:
    return "NULL" if value is None else "an unchanged TOAST value"


def header_entries(raw: bytes, event_id: str) -> list[tuple[str, bytes]]:
    """Top-level entries of the headers object; non-string values keep their exact JSON text.

    Values are sliced out of the text rather than parsed and re-serialised, so that a number
    like 123456789012345678901234567890 or 1.10 travels as PostgreSQL printed it.
    """
    try:
        text = raw.decode()
        entries = _header_entries_of(text, event_id)
    except RecursionError:
        raise MalformedEvent("column headers is nested too deeply", event_id) from None
    except UnicodeEncodeError:
        raise MalformedEvent(
            "column headers has a string value that is not Unicode (a lone surrogate)", event_id
        ) from None
    except (ValueError, UnicodeDecodeError) as exc:
        if isinstance(exc, MalformedEvent):
            raise
        raise MalformedEvent("column headers is not valid JSON", event_id) from None
    if "\\u" in text:  # only an escape can put a NUL or a lone surrogate in a decoded name
        check_headers(entries, event_id)
    return entries


def _header_entries_of(text: str, event_id: str) -> list[tuple[str, bytes]]:
    pos = _skip_space(text, 0)
    if text.startswith("null", pos):
        return []
    if not text.startswith("{", pos):
        raise MalformedEvent("column headers must be a JSON object", event_id)
    entries: list[tuple[str, bytes]] = []
    pos = _skip_space(text, pos + 1)
    if text.startswith("}", pos):
        return entries
    while True:
        name, pos = _JSON.raw_decode(text, pos)
        pos = _skip_space(text, pos)
        if not isinstance(name, str) or not text.startswith(":", pos):
            raise ValueError("expected a key")
        if reserved(name):
            _refuse_reserved(name, event_id)
        pos = _skip_space(text, pos + 1)
        value, end = _JSON.raw_decode(text, pos)
        entries.append((name, value.encode() if isinstance(value, str) else text[pos:end].encode()))
        pos = _skip_space(text, end)
        if text.startswith("}", pos):
            return entries
        if not text.startswith(",", pos):
            raise ValueError("expected , or }")
        pos = _skip_space(text, pos + 1)


# Numbers are never converted: a value is sliced from the text, and int() refuses more digits than
# sys.get_int_max_str_digits() (4,300), where a jsonb number may have 131,072.
_JSON = json.JSONDecoder(parse_int=str, parse_float=str)
_SPACE = re.compile(r"[ \t\n\r]*")


def _refuse_reserved(name: str, event_id: str | None) -> NoReturn:
    raise MalformedEvent(
        f"header name {name[:1024]!r} is reserved: the relay sets it itself (id, event_type, "
        "aggregate_type, cdc_relay.*, in any case)",
        event_id,
    )


def check_headers(headers: list[tuple[str, bytes]], event_id: str | None) -> None:
    """Refuse header names librdkafka cannot take: it crashes on a name that is not UTF-8
    (a lone surrogate) and cuts one at a NUL. Values are bytes, which it takes as they are."""
    for name, _ in headers:
        if "\x00" in name:
            raise MalformedEvent(f"header name {name[:1024]!r} contains NUL", event_id)
        try:
            name.encode()
        except UnicodeEncodeError:
            raise MalformedEvent(
                f"header name {name[:1024]!r} is not Unicode (a lone surrogate)", event_id
            ) from None


def _skip_space(text: str, pos: int) -> int:
    match = _SPACE.match(text, pos)
    return match.end() if match else pos


def traceparent_from_span_context(text: str) -> str | None:
    """Accept a bare ``traceparent`` or Debezium's ``tracingspancontext`` (properties text)."""
    text = text.strip()
    if "=" not in text:
        return text or None
    for line in text.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "traceparent":
            return value.strip() or None
    return None


class MessageMapping:
    """Table-less outbox: a transactional logical message (``pg_logical_emit_message``) whose
    content is a JSON object with ``id``, ``aggregate_type``, ``aggregate_id``, ``event_type``,
    ``payload`` and optional ``headers`` (and ``traceparent``) — the same contract as a row.

    In the topic template, ``{table}`` is the message prefix and ``{schema}`` is empty.
    """

    def __init__(self, prefix: str, topic_template: str) -> None:
        self.prefix = prefix
        self.table = f"message:{prefix}"
        self._template = topic_template

    def map_fields(self, content: bytes) -> RecordFields:
        """:meth:`map`'s record, as the session publishes it (:attr:`OutboxMapping.map_fields`)."""
        return self.map(content)

    def map(self, content: bytes) -> OutboxRecord:
        try:
            event = orjson.loads(content)
        except orjson.JSONDecodeError:
            raise MalformedEvent("logical message content is not valid JSON") from None
        if not isinstance(event, dict):
            raise MalformedEvent("logical message content must be a JSON object")
        event_id = event.get("id")
        event_id = event_id if isinstance(event_id, str) else None
        fields = {}
        for name in ("id", "aggregate_type", "aggregate_id", "event_type"):
            value = event.get(name)
            if not isinstance(value, str) or not value:
                raise MalformedEvent(f"logical message field {name} must be a string", event_id)
            fields[name] = value
        if "payload" not in event:
            raise MalformedEvent("logical message has no payload", event_id)
        headers: list[tuple[str, bytes]] = [
            ("id", fields["id"].encode()),
            ("event_type", fields["event_type"].encode()),
            ("aggregate_type", fields["aggregate_type"].encode()),
        ]
        traceparent = event.get("traceparent")
        traceparent_bytes = traceparent.encode() if isinstance(traceparent, str) else None
        if traceparent_bytes:
            headers.append(("traceparent", traceparent_bytes))
        extra = event.get("headers")
        if extra is not None:
            if not isinstance(extra, dict):
                raise MalformedEvent("logical message headers must be a JSON object", event_id)
            entries = [
                (name, value.encode() if isinstance(value, str) else _dumps(value, event_id))
                for name, value in extra.items()
            ]
            for name, _ in entries:
                if reserved(name):
                    _refuse_reserved(name, event_id)
            if b"\\u" in content:  # only an escape can put a NUL in a decoded name
                check_headers(entries, event_id)
            headers.extend(entries)
        topic = self._template.format(
            aggregate_type=fields["aggregate_type"],
            event_type=fields["event_type"],
            table=self.prefix,
            schema="",
        )
        return OutboxRecord(
            topic,
            fields["aggregate_id"].encode(),
            _dumps(event["payload"], event_id),
            headers,
            fields["id"],
            traceparent_bytes or None,
        )

    def describe_row(self, content: bytes) -> bytes:
        return content


def _dumps(value: object, event_id: str | None) -> bytes:
    """JSON text of a value orjson parsed; it parses deeper nesting than it writes."""
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:
        raise MalformedEvent("logical message content is nested too deeply", event_id) from None
