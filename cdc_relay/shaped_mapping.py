"""The general outbox mapping: topics and keys from expressions over columns, an optional aggregate
type, and values shaped as the payload, the whole row or an envelope.

Why this module exists: tables written by other software (Debezium's outbox, frameworks' units of
work) carry routing and metadata in other shapes than ``sql/001_outbox.sql``. Everything such a
table needs is decided once per Relation here, so the plain mapping
(:class:`cdc_relay.outbox.OutboxMapping`, the relay's hot path) does no per-event work for
options it does not use: :func:`outbox_mapping` picks the plain mapping whenever it suffices.

The record, per row (the README's "Adopting an existing outbox" says the same for users):

* key: the ``key`` column when not NULL, else ``key_from``'s transform of its column, else the
  aggregate id; nothing to take it from (NULL, no match) → the row is refused;
* topic: the ``topic`` column when not NULL or empty, else ``topic_from``'s transform, else the
  template. A transform's result must match nowhere else than in full, and be a legal Kafka topic
  name (:func:`cdc_relay.config.legal_topic`) — otherwise the row is refused with the reason; it
  is never altered into a legal name (two streams must not merge silently). A template that uses
  ``{aggregate_type}`` refuses a row whose aggregate type is NULL.
* headers: ``id``, ``event_type``, ``aggregate_type`` (empty when the table has none or the row's
  is NULL: the header keeps its place before ``traceparent``), ``traceparent``, the ``headers``
  column's entries, ``header_columns``, then the ``column:header[:alias]`` placements (a NULL
  column sends no header);
* value: a NULL or empty payload is a tombstone (value null) with
  ``tombstone_on_empty_payload``, refused otherwise. ``payload``: as the plain mapping sends it;
  ``row``: every column of the row (:mod:`cdc_relay.column_json` renders them); ``envelope``:
  ``{"payload": …}`` plus the ``column:envelope[:alias]`` placements. In ``row`` and ``envelope``
  a json/jsonb payload is embedded; a text or bytea payload is a JSON string (base64 for bytea),
  or, with ``expand_json_payload``, checked and embedded as JSON.
"""

from __future__ import annotations

import orjson

from cdc_relay.column_json import JSON_OIDS, Render, expanded_renderer, renderer, text
from cdc_relay.column_transform import ColumnTransform
from cdc_relay.config import (
    ColumnExpression,
    OutboxColumns,
    Placement,
    ValueShape,
    legal_topic,
    needs_aggregate_type,
)
from cdc_relay.decode.messages import Relation, TupleData
from cdc_relay.outbox import OutboxMapping, OutboxRecord
from cdc_relay.value_text import BYTEA_OID, MalformedEvent, bytea_bytes, check_json


def outbox_mapping(
    relation: Relation, topic_template: str, traceparent_column: str, columns: OutboxColumns
) -> OutboxMapping:
    """The mapping for one outbox relation: the plain one when the columns and template allow."""
    if columns.plain() and needs_aggregate_type(topic_template):
        return OutboxMapping(relation, topic_template, traceparent_column, columns)
    return ShapedMapping(relation, topic_template, traceparent_column, columns)


class ShapedMapping(OutboxMapping):
    """The general mapping; its per-row work is only what the table's options ask for."""

    def _resolve(
        self, relation: Relation, columns: OutboxColumns, positions: dict[str, int]
    ) -> None:
        # Called by OutboxMapping.__init__ once it has set what every mapping reads; the plain
        # mapping's positions assume its columns, so these are resolved here instead.
        self.map = self.map_fields = self._map_shaped
        self._template_needs_type = needs_aggregate_type(self._template)
        if self.missing:
            return
        types = [column.type_oid for column in relation.columns]

        def at(name: str | None) -> int | None:
            return None if name is None else positions[name]

        self._id_at = positions[columns.id]
        self._event_type_at = positions[columns.event_type]
        self._payload_at = positions[columns.payload]
        self._payload_type = types[self._payload_at]
        self._aggregate_type_at = at(columns.aggregate_type)
        self._aggregate_id_at = at(columns.aggregate_id)
        self._topic_at = at(columns.topic)
        self._key_at = at(columns.key)
        self._topic_from = _expression(columns.topic_from, positions)
        self._key_from = _expression(columns.key_from, positions)
        placements = columns.placements
        self._header_at = [(name, positions[name]) for name in columns.header_columns]
        self._header_at += [
            (alias, positions[column])
            for column, place, alias in placements
            if place is Placement.HEADER
        ]
        self._shape = columns.value
        payload_render = (
            expanded_renderer(self._payload_type, columns.payload)
            if columns.expand_json_payload
            else renderer(self._payload_type, columns.payload)
        )
        self._fields: list[tuple[str, int, Render]] = []
        if self._shape is ValueShape.ROW:
            self._fields = [
                (
                    column.name,
                    i,
                    payload_render
                    if i == self._payload_at
                    else renderer(column.type_oid, column.name),
                )
                for i, column in enumerate(relation.columns)
            ]
        elif self._shape is ValueShape.ENVELOPE:
            self._fields = [("payload", self._payload_at, payload_render)]
            self._fields += [
                (alias, positions[column], renderer(types[positions[column]], column))
                for column, place, alias in placements
                if place is Placement.ENVELOPE
            ]

    def _map_shaped(self, row: TupleData) -> OutboxRecord:
        if self.missing:
            raise MalformedEvent(
                f"{self.table} has no column(s) {', '.join(self.missing)}", self._event_id(row)
            )
        if len(row) < len(self.relation.columns):
            raise MalformedEvent("the row has fewer columns than its relation", self._event_id(row))
        columns = self._columns
        raw_id = _required(row, self._id_at, columns.id, None)
        event_id = text(raw_id, columns.id, None)
        event_type = _required(row, self._event_type_at, columns.event_type, event_id)
        aggregate_type = _optional(row, self._aggregate_type_at, columns.aggregate_type, event_id)
        headers, traceparent = self._first_headers(
            row, raw_id, event_type, aggregate_type or b"", event_id
        )
        for name, index in self._header_at:
            value = row[index]
            if type(value) is bytes:
                headers.append((name, value))
        return OutboxRecord(
            self._route(row, aggregate_type, event_type, event_id),
            self._key_of(row, event_id),
            self._value(row, event_id),
            headers,
            event_id,
            traceparent,
        )

    def _key_of(self, row: TupleData, event_id: str) -> bytes:
        columns = self._columns
        key = _optional(row, self._key_at, columns.key, event_id)
        if key is not None:
            return key
        if self._key_from is not None:
            return _transformed(row, self._key_from, "key_from", event_id).encode()
        key = _optional(row, self._aggregate_id_at, columns.aggregate_id, event_id)
        if key is None:
            what = columns.aggregate_id or "aggregate_id (not mapped)"
            raise MalformedEvent(f"column {what} is NULL", event_id)
        return key

    def _route(
        self, row: TupleData, aggregate_type: bytes | None, event_type: bytes, event_id: str
    ) -> str:
        columns = self._columns
        topic = _optional(row, self._topic_at, columns.topic, event_id)
        if topic:
            return text(topic, columns.topic or "topic", event_id)
        if self._topic_from is not None:
            routed = _transformed(row, self._topic_from, "topic_from", event_id)
            if not legal_topic(routed):
                raise MalformedEvent(
                    f"topic_from gives {routed[:300]!r}, not a legal Kafka topic name "
                    "(1-249 of [a-zA-Z0-9._-], not . or ..)",
                    event_id,
                )
            return routed
        if aggregate_type is None and self._template_needs_type:
            raise MalformedEvent(
                f"column {columns.aggregate_type} is NULL and the topic template needs it",
                event_id,
            )
        cached = self._topics.get((aggregate_type or b"", event_type))
        return cached or self._topic(aggregate_type or b"", event_type)

    def _value(self, row: TupleData, event_id: str) -> bytes | None:
        payload = row[self._payload_at]
        if self._columns.tombstone_on_empty_payload and (
            payload is None
            or payload == b""
            or (payload == b"\\x" and self._payload_type == BYTEA_OID)
        ):
            return None
        payload = _required(row, self._payload_at, self._columns.payload, event_id)
        if self._shape is ValueShape.PAYLOAD:
            if self._payload_type == BYTEA_OID:
                return bytea_bytes(payload, event_id)
            if self._payload_type not in JSON_OIDS and self._payload_type != 0:
                check_json(payload, "payload", event_id)
            return payload
        fields: dict[str, object] = {}
        for name, index, render in self._fields:
            value = row[index]
            if value is None:
                fields[name] = None
            elif type(value) is bytes:
                fields[name] = render(value, event_id)
            else:
                raise MalformedEvent(f"column {name} is an unchanged TOAST value", event_id)
        return orjson.dumps(fields)


def _expression(
    expression: ColumnExpression | None, positions: dict[str, int]
) -> tuple[int, str, ColumnTransform] | None:
    if expression is None:
        return None
    return positions[expression.column], expression.column, expression.compile()


def _transformed(
    row: TupleData, expression: tuple[int, str, ColumnTransform], setting: str, event_id: str
) -> str:
    index, column, transform = expression
    value = text(_required(row, index, column, event_id), column, event_id)
    result = transform.apply(value)
    if result is None:
        raise MalformedEvent(
            f"column {column} does not match {setting}.regex (or is longer than it may be)",
            event_id,
        )
    return result


def _required(row: TupleData, index: int, name: str, event_id: str | None) -> bytes:
    value = row[index]
    if type(value) is not bytes:
        what = "NULL" if value is None else "an unchanged TOAST value"
        raise MalformedEvent(f"column {name} is {what}", event_id)
    return value


def _optional(row: TupleData, index: int | None, name: str | None, event_id: str) -> bytes | None:
    if index is None:
        return None
    value = row[index]
    if value is None or type(value) is bytes:
        return value
    raise MalformedEvent(f"column {name} is an unchanged TOAST value", event_id)
