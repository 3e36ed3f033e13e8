"""Reconciliation with Kafka at a session's start: what an earlier incarnation already delivered.

A session resumes at the recorded position P and replays every transaction after it. Some of those
events may already be in Kafka: an earlier incarnation produced them, Kafka acknowledged them, and
it died (or lost its connection) before it recorded a position past them. Re-publishing them is a
duplicate. This module finds them, so that the session counts them as delivered instead.

How. Every record the relay publishes (event or dead letter) carries the header
``cdc_relay.position`` = ``<slot>/<commit LSN hex>/<ordinal in the transaction>``, unique in the
WAL. With P the relay records, per topic-partition it has written, the offset of the last record
Kafka acknowledged at or below P (:attr:`cdc_relay.watermark.Watermark.offsets`). At the start,
for each such partition, the reader fetches from that offset to the end of the partition (fetching,
not ListOffsets: see the test broker's notes) and keeps the records of *this* slot positioned after
P. Reading costs the unconfirmed window, not the topic. The end is the high watermark (the read is
``read_uncommitted``), which every record Kafka acknowledged with ``acks=all`` lies below; offsets
need only increase, since Apache Kafka leaves gaps a consumer never sees (transaction markers of
other producers, records removed by compaction).

The rule that wins every trade-off: **never skip an event that is not provably in Kafka**. An event
is skipped only when a record with its exact position *and* its event id was read back from its
partition. Anything unexpected — a partition shorter than recorded, the record at the recorded
offset missing or not ours (a broker that lost data, a topic recreated), an end not reached in
time, a read error — makes the whole reconciliation skip nothing, and says so: at-least-once is
the fallback, never a gap.

A partition the relay had no acknowledged record in at P (a topic created since, a partition never
written): before a session first writes a topic, it notes for each such partition an offset at or
below its end (ListOffsets "latest": exact on Kafka, lower on some brokers — reading a little more
is harmless), and the start reads those partitions from there.

What it does not see (those events are published again: a duplicate, never a loss): records a
hung earlier incarnation writes after this read, records of a partition whose note could not be
taken, dead letters whose headers were cut to fit, anything when the read is in doubt.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from cdc_relay.dead_letter import text_bytes
from cdc_relay.lsn import format_lsn

log = logging.getLogger(__name__)

POSITION_HEADER = "cdc_relay.position"
_ID_HEADERS = ("id", "cdc_relay.event_id")  # an event's id header; a dead letter's metadata one
# consume() returns at its timeout unless it has a full batch: short, so that the last partition's
# end is acted on at once (with 0.2 s, every start paid ~0.2 s for a window of a few records).
POLL_TIMEOUT = 0.01

Offsets = dict[tuple[str, int], int]


def position_prefix(slot: str, commit_lsn: int) -> bytes:
    """The position of a transaction's events, up to their ordinal."""
    return b"%s/%X/" % (slot.encode(), commit_lsn)


def parse_position(value: bytes) -> tuple[str, int, int] | None:
    """(slot, commit LSN, ordinal) of a position header; None when it is not one."""
    try:
        slot, lsn, ordinal = value.decode("ascii").rsplit("/", 2)
        parsed = (slot, int(lsn, 16), int(ordinal))
    except (UnicodeDecodeError, ValueError):
        return None
    if (
        not slot
        or parsed[1] < 0
        or parsed[2] < 1
        or value != position_prefix(slot, parsed[1]) + (b"%d" % parsed[2])
    ):
        return None  # not in the canonical spelling the relay writes
    return parsed


# -- the record of acknowledged offsets -----------------------------------------------------------


def encode_offsets(offsets: Mapping[tuple[str, int], int]) -> bytes:
    """``{"topic": {"partition": offset}}``: the JSON the state table keeps."""
    nested: dict[str, dict[str, int]] = {}
    for (topic, partition), offset in offsets.items():
        nested.setdefault(topic, {})[str(partition)] = offset
    return orjson.dumps(nested)


def decode_offsets(value: object) -> Offsets | None:
    """The recorded offsets; None when missing or not what :func:`encode_offsets` writes (then
    nothing can be reconciled: the safe answer)."""
    if value is None:
        return None
    if isinstance(value, (bytes, str)):
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError:
            return None
    if not isinstance(value, dict):
        return None
    offsets: Offsets = {}
    for topic, partitions in value.items():
        if not isinstance(topic, str) or not isinstance(partitions, dict):
            return None
        for partition, offset in partitions.items():
            if (
                not isinstance(partition, str)
                or not partition.isdigit()
                or type(offset) is not int
                or offset < 0
            ):
                return None
            offsets[topic, int(partition)] = offset
    return offsets


# -- the pure core ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReadBack:
    """One record read back from a partition: where it is, and its headers."""

    topic: str
    partition: int
    offset: int
    headers: tuple[tuple[str, bytes], ...]


@dataclass
class Reconciliation:
    """Positions of this slot's events found in Kafka after the recorded position.

    ``found`` maps a position header to the event id its record carried (None: no id header).
    Empty when nothing can be skipped, with ``doubt`` saying why when something was unexpected.
    """

    found: dict[bytes, bytes | None] = field(default_factory=dict)
    highest_lsn: int = 0  # the newest commit LSN in ``found``: past it, nothing is looked up
    doubt: str | None = None
    partitions: int = 0
    records_read: int = 0
    # Noted partitions read to their end without a record of ours after the recorded position:
    # their note may move to where the read ended (anything later was written after it).
    renoted: dict[tuple[str, int], int] = field(default_factory=dict)

    def in_kafka(self, position: bytes, event_id: str | None) -> bool:
        """Whether the event at ``position`` with ``event_id`` was read back from Kafka (a record
        without an id never matches). An event id is compared as its record spells it: the
        ``id`` header, or a dead letter's ``cdc_relay.event_id`` ("" when it had none)."""
        found = self.found.get(position)
        return found is not None and found == text_bytes(event_id or "")


def _header(headers: Iterable[tuple[str, bytes | None]], name: str) -> bytes | None:
    value = None
    for key, header_value in headers:
        if key == name:
            value = header_value  # the last one: a dead letter's metadata follows the record's
    return value


def read_starts(
    offsets: Mapping[tuple[str, int], int], noted: Mapping[tuple[str, int], int]
) -> dict[tuple[str, int], int]:
    """Where to start reading each partition: at its acknowledged offset (that record is read
    too, to check it), else at the offset noted before the relay first wrote it."""
    return {**{k: v for k, v in noted.items() if k not in offsets}, **offsets}


def reconcile(
    slot: str,
    recorded_lsn: int,
    offsets: Mapping[tuple[str, int], int],
    read: Mapping[tuple[str, int], list[ReadBack]],
    ended: Iterable[tuple[str, int]],
    *,
    noted: Mapping[tuple[str, int], int] | None = None,
) -> Reconciliation:
    """Which positions are provably in Kafka, from what was read.

    ``offsets``: the recorded acknowledged offset per partition; ``noted``: for partitions with
    none, an offset at or below the relay's first record there (noted before it wrote there);
    ``read``: what was fetched from each partition from :func:`read_starts`; ``ended``: the
    partitions read to their end. The record at an acknowledged offset must be there and be this
    slot's, at or below ``recorded_lsn``: otherwise the partition is not what the relay left, and
    nothing at all is skipped.
    """
    starts = read_starts(offsets, noted or {})
    result = Reconciliation(partitions=len(starts))
    ended = set(ended)
    found: dict[bytes, bytes | None] = {}
    highest = 0
    for (topic, partition), start in starts.items():
        records = read.get((topic, partition), [])
        result.records_read += len(records)
        where = f"{topic}[{partition}]"
        if (topic, partition) not in ended:
            return _doubt(result, f"{where} was not read to its end")
        if (topic, partition) in offsets:
            if not records or records[0].offset != start:
                return _doubt(
                    result,
                    f"{where} has no record at the acknowledged offset {start}: "
                    "the broker lost data, or the topic was recreated",
                )
            first = _position(records[0], slot)
            if first is None or first[1] > recorded_lsn:
                return _doubt(
                    result,
                    f"{where}'s record at the acknowledged offset {start} is not this relay's "
                    f"(at or below {format_lsn(recorded_lsn)})",
                )
            candidates = records[1:]
            previous = start
        else:
            candidates = records
            previous = start - 1
        ours_before = len(found)
        for record in candidates:
            if record.offset <= previous or record.topic != topic:
                return _doubt(result, f"{where} returned records out of order")
            previous = record.offset
            position = _position(record, slot)
            if position is None or position[1] <= recorded_lsn:
                continue  # another producer's, another slot's, or already confirmed
            value = _header(record.headers, POSITION_HEADER)
            assert value is not None
            event_id = _header(record.headers, "id")
            if event_id is None:
                event_id = _header(record.headers, _ID_HEADERS[1])
            if value in found and found[value] != event_id:
                return _doubt(result, f"position {value.decode()} found twice with other ids")
            found[value] = event_id
            highest = max(highest, position[1])
        if (topic, partition) not in offsets and len(found) == ours_before:
            result.renoted[topic, partition] = max(start, previous + 1)
    result.found = found
    result.highest_lsn = highest
    return result


def _position(record: ReadBack, slot: str) -> tuple[str, int, int] | None:
    value = _header(record.headers, POSITION_HEADER)
    if value is None:
        return None
    parsed = parse_position(value)
    if parsed is None or parsed[0] != slot:
        return None
    return parsed


def _doubt(result: Reconciliation, reason: str) -> Reconciliation:
    result.found = {}
    result.renoted = {}
    result.highest_lsn = 0
    result.doubt = reason
    return result


# -- the Kafka reading adapter ---------------------------------------------------------------------


def read_partitions(
    client_config: Mapping[str, Any],
    offsets: Mapping[tuple[str, int], int],
    timeout: float,
    stopping: Callable[[], bool] = lambda: False,
) -> tuple[dict[tuple[str, int], list[ReadBack]], set[tuple[str, int]], str | None]:
    """Fetch each partition from its offset to its end (the partition-EOF event: the fetch
    response's high watermark, right even where ListOffsets is not). Returns what was read, the
    partitions that reached their end, and an error when the read went wrong.

    Only headers are kept; a plain consumer with no group commits (``read_uncommitted``: what
    an ordinary consumer sees).
    """
    read: dict[tuple[str, int], list[ReadBack]] = {key: [] for key in offsets}
    ended: set[tuple[str, int]] = set()
    if not offsets:
        return read, ended, None
    # Late: the position record (cdc_relay.checkpoint) uses this module without Kafka's client.
    from confluent_kafka import (  # noqa: PLC0415
        Consumer,
        KafkaError,
        KafkaException,
        TopicPartition,
    )

    consumer = Consumer(
        {
            **client_config,
            "group.id": f"cdc-relay-reconcile-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "enable.partition.eof": True,
            "auto.offset.reset": "error",
            "isolation.level": "read_uncommitted",
            "fetch.wait.max.ms": 20,  # the end is known when a fetch returns: don't linger
            "logger": logging.getLogger("cdc_relay.kafka"),
        }
    )
    error: str | None = None
    try:
        consumer.assign([TopicPartition(t, p, o) for (t, p), o in offsets.items()])
        deadline = time.monotonic() + timeout
        while len(ended) < len(offsets) and time.monotonic() < deadline and not stopping():
            messages = consumer.consume(1000, POLL_TIMEOUT)
            for message in messages:
                key = (str(message.topic()), int(message.partition() or 0))
                err = message.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        # The end when the read began, or later: what a killed incarnation
                        # wrote is all before it. Later records (other producers) don't matter.
                        ended.add(key)
                        continue
                    error = f"{key[0]}[{key[1]}]: {err.str()}"
                    return read, set(), error
                if key not in read or key in ended:
                    continue
                headers: list[tuple[str, bytes]] = [
                    (str(pair[0]), pair[1])
                    for pair in message.headers() or []
                    if isinstance(pair, tuple) and isinstance(pair[1], bytes)
                ]
                read[key].append(
                    ReadBack(key[0], key[1], int(message.offset() or 0), tuple(headers))
                )
    except KafkaException as exc:
        return read, set(), str(exc)
    finally:
        consumer.close()
    return read, ended, error


def reconcile_with_kafka(
    client_config: Mapping[str, Any],
    slot: str,
    recorded_lsn: int,
    *,
    offsets: Mapping[tuple[str, int], int] | None,
    noted: Mapping[tuple[str, int], int] | None,
    timeout: float,
    stopping: Callable[[], bool] = lambda: False,
) -> Reconciliation:
    """Read the unconfirmed window back from Kafka and decide (logs what it found or doubts)."""
    started = time.monotonic()
    if offsets is None and not noted:
        log.info("nothing to reconcile: no offsets recorded with the position")
        return Reconciliation()
    offsets = offsets or {}
    starts = read_starts(offsets, noted or {})
    read, ended, error = read_partitions(client_config, starts, timeout, stopping)
    if error is not None:
        result = _doubt(Reconciliation(partitions=len(starts)), f"reading failed: {error}")
    else:
        result = reconcile(slot, recorded_lsn, offsets, read, ended, noted=noted)
    fields = {
        "partitions": result.partitions,
        "records_read": sum(len(r) for r in read.values()),
        "in_kafka": len(result.found),
        "seconds": round(time.monotonic() - started, 3),
    }
    if result.doubt is not None:
        log.warning(
            "reconciliation with Kafka skips nothing: events after the recorded position are "
            "published again (at-least-once)",
            extra={"fields": {**fields, "reason": result.doubt}},
        )
    else:
        log.info("reconciled with Kafka", extra={"fields": fields})
    return result
