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
partition. A partition that is not what the relay left — the record at the recorded offset
missing or not ours (a broker that lost data, a topic recreated), an end not reached in time —
contributes nothing, and says so: its events are published again. What was read back from the
other partitions is still in Kafka, so they still count: a partition that stays in doubt (its
record at the recorded offset will never be ours again) does not turn the read-back off for good.
A read error, or one position found with two ids, skips nothing at all: at-least-once is the
fallback, never a gap.

What the read costs in memory is bounded, whatever other producers wrote in the window: each
record is taken one at a time and looked at for three headers (the position, ``id`` and a dead
letter's ``cdc_relay.event_id``), then dropped; librdkafka's prefetch is capped; only this slot's
positions after P and their ids are kept, up to :data:`RETAINED_BUDGET` (past it, nothing is
skipped).

A partition the relay had no acknowledged record in at P (a topic created since, a partition never
written): before a session first writes a topic, it notes for each such partition an offset at or
below its end (ListOffsets "latest": exact on Kafka, lower on some brokers — reading a little more
is harmless), and the start reads those partitions from there.

What it does not see (those events are published again: a duplicate, never a loss): records a
hung earlier incarnation writes after this read, records of a partition whose note could not be
taken, a dead letter whose event id was cut to fit (longer than the metadata-only form keeps),
anything when the read is in doubt. A dead letter keeps its position in its metadata, which no
shrinking drops (:mod:`cdc_relay.poison`).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import orjson

from cdc_relay.dead_letter import text_bytes
from cdc_relay.lsn import format_lsn

log = logging.getLogger(__name__)

POSITION_HEADER: Final = "cdc_relay.position"
_ID_HEADERS = ("id", "cdc_relay.event_id")  # an event's id header; a dead letter's metadata one
# How long a poll waits for the next record: short, so that a stop is noticed at once.
POLL_TIMEOUT = 0.01

Offsets = dict[tuple[str, int], int]


def position_prefix(slot: str, commit_lsn: int) -> bytes:
    """The position of a transaction's events, up to their ordinal."""
    return b"%s/%X/" % (slot.encode(), commit_lsn)


# An event's position is its transaction's prefix and its ordinal, ``b"%d" % ordinal``: the
# ordinals of most transactions' events, as text once (indexing and joining cost a third of
# formatting, on the hot path of every event).
ORDINALS: Final = tuple(b"%d" % ordinal for ordinal in range(4096))


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

# What the read-back may keep of what it found: each of this slot's records after the recorded
# position costs its position, its event id and about this much bookkeeping. Past the budget it
# keeps nothing and skips nothing (a window that large is re-sent: duplicates, never a loss).
RETAINED_BUDGET = 16 * 1024 * 1024
ENTRY_OVERHEAD = 160
# The only headers the read-back looks at; every other header and every value is dropped as soon
# as a record is read.
NEEDED_HEADERS = frozenset({POSITION_HEADER, *_ID_HEADERS})


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
    ``doubted``: the partitions that were not what the relay left, and why; their records are
    not used (their events are published again), the other partitions' are.
    """

    found: dict[bytes, bytes | None] = field(default_factory=dict)
    highest_lsn: int = 0  # the newest commit LSN in ``found``: past it, nothing is looked up
    doubt: str | None = None
    doubted: dict[tuple[str, int], str] = field(default_factory=dict)
    partitions: int = 0
    records_read: int = 0
    retained_bytes: int = 0  # what ``found`` costs, by the budget's count
    # Noted partitions read to their end without a record of ours after the recorded position:
    # their note may move to where the read ended (anything later was written after it).
    renoted: dict[tuple[str, int], int] = field(default_factory=dict)

    def in_kafka(self, position: bytes, event_id: str | None) -> bool:
        """Whether the event at ``position`` with ``event_id`` was read back from Kafka (a record
        without an id never matches). An event id is compared as its record spells it: the
        ``id`` header, or a dead letter's ``cdc_relay.event_id`` ("" when it had none)."""
        found = self.found.get(position)
        return found is not None and found == text_bytes(event_id or "")

    def refused(self, position: bytes) -> tuple[int, str] | None:
        """A read-back knows of no refusal (the session asks a re-send's notes the same way)."""
        return None


def read_starts(
    offsets: Mapping[tuple[str, int], int], noted: Mapping[tuple[str, int], int]
) -> dict[tuple[str, int], int]:
    """Where to start reading each partition: at its acknowledged offset (that record is read
    too, to check it), else at the offset noted before the relay first wrote it."""
    return {**{k: v for k, v in noted.items() if k not in offsets}, **offsets}


@dataclass
class _Partition:
    start: int
    acknowledged: bool  # read from an acknowledged offset: its first record is checked
    previous: int
    first: bool = True
    ended: bool = False
    doubt: str | None = None
    found: dict[bytes, bytes | None] = field(default_factory=dict)
    highest: int = 0


class ReadBackCheck:
    """The reconciliation, fed one record at a time as it is read, keeping only this slot's
    positions after the recorded one (and their ids): what the read costs in memory is bounded
    by :data:`RETAINED_BUDGET`, not by what other producers wrote.

    ``offsets``: the recorded acknowledged offset per partition; ``noted``: for partitions with
    none, an offset at or below the relay's first record there. The record at an acknowledged
    offset must be there and be this slot's, at or below ``recorded_lsn``: otherwise that
    partition is not what the relay left, and none of its records is used.
    """

    def __init__(
        self,
        slot: str,
        recorded_lsn: int,
        offsets: Mapping[tuple[str, int], int],
        noted: Mapping[tuple[str, int], int] | None = None,
        budget: int = RETAINED_BUDGET,
    ) -> None:
        self._slot = slot
        self._recorded = recorded_lsn
        self._budget = budget
        self.starts = read_starts(offsets, noted or {})
        self._partitions = {
            key: _Partition(start, key in offsets, start if key in offsets else start - 1)
            for key, start in self.starts.items()
        }
        self._reading = len(self._partitions)  # not ended yet
        self.records_read = 0
        self.retained = 0
        self.doubt: str | None = None  # the whole read is in doubt: nothing is skipped

    @property
    def done(self) -> bool:
        """Nothing more to learn: every partition ended, or the whole read is in doubt."""
        return self.doubt is not None or not self._reading

    def add(self, record: ReadBack) -> None:
        """The next record read from its partition (only :data:`NEEDED_HEADERS` are looked at)."""
        key = (record.topic, record.partition)
        part = self._partitions.get(key)
        if part is None or part.ended or self.doubt is not None:
            return
        self.records_read += 1
        if part.doubt is not None:
            return
        value = event_id = metadata_id = None
        for name, header_value in record.headers:  # the last of each name
            if name == POSITION_HEADER:
                value = header_value
            elif name == "id":
                event_id = header_value
            elif name == _ID_HEADERS[1]:
                metadata_id = header_value
        position = _parsed(value, self._slot)
        if part.first and part.acknowledged:
            part.first = False
            where = f"{key[0]}[{key[1]}]"
            if record.offset != part.start:
                part.doubt = (
                    f"{where} has no record at the acknowledged offset {part.start}: "
                    "the broker lost data, or the topic was recreated"
                )
            elif position is None or position[1] > self._recorded:
                part.doubt = (
                    f"{where}'s record at the acknowledged offset {part.start} is not this "
                    f"relay's (at or below {format_lsn(self._recorded)})"
                )
            return
        part.first = False
        if record.offset <= part.previous:
            part.doubt = f"{key[0]}[{key[1]}] returned records out of order"
            return
        part.previous = record.offset
        if position is None or position[1] <= self._recorded:
            return  # another producer's, another slot's, or already confirmed
        assert value is not None
        if event_id is None:
            event_id = metadata_id
        if value in part.found:
            if part.found[value] != event_id:
                self._give_up(f"position {value.decode()} found twice with other ids")
            return
        part.found[value] = event_id
        part.highest = max(part.highest, position[1])
        self.retained += len(value) + len(event_id or b"") + ENTRY_OVERHEAD
        if self.retained > self._budget:
            self._give_up(
                f"more of this relay's records after the recorded position than the read-back "
                f"keeps ({self._budget / 2**20:g} MiB of positions and ids)"
            )

    def end(self, topic: str, partition: int) -> None:
        """The partition was read to its end (records after this are not looked at)."""
        part = self._partitions.get((topic, partition))
        if part is not None and not part.ended:
            part.ended = True
            self._reading -= 1

    def _give_up(self, reason: str) -> None:
        self.doubt = reason
        for part in self._partitions.values():
            part.found = {}

    def result(self) -> Reconciliation:
        """What is provably in Kafka, from what was read."""
        result = Reconciliation(
            partitions=len(self.starts), records_read=self.records_read, doubt=self.doubt
        )
        if self.doubt is not None:
            return result
        found: dict[bytes, bytes | None] = {}
        for (topic, partition), part in self._partitions.items():
            where = f"{topic}[{partition}]"
            if part.doubt is None and not part.ended:
                part.doubt = f"{where} was not read to its end"
            if part.doubt is None and part.acknowledged and part.first:
                part.doubt = (
                    f"{where} has no record at the acknowledged offset {part.start}: "
                    "the broker lost data, or the topic was recreated"
                )
            if part.doubt is not None:
                result.doubted[topic, partition] = part.doubt
                continue
            for value, event_id in part.found.items():
                if found.setdefault(value, event_id) != event_id:
                    return _doubt(result, f"position {value.decode()} found twice with other ids")
            result.highest_lsn = max(result.highest_lsn, part.highest)
            if not part.acknowledged and not part.found:
                result.renoted[topic, partition] = max(part.start, part.previous + 1)
        result.found = found
        result.retained_bytes = self.retained
        return result


def reconcile(
    slot: str,
    recorded_lsn: int,
    offsets: Mapping[tuple[str, int], int],
    read: Mapping[tuple[str, int], list[ReadBack]],
    ended: Iterable[tuple[str, int]],
    *,
    noted: Mapping[tuple[str, int], int] | None = None,
) -> Reconciliation:
    """Which positions are provably in Kafka, from what was read (:class:`ReadBackCheck` over
    whole lists): ``read`` is what was fetched from each partition from :func:`read_starts`,
    ``ended`` the partitions read to their end."""
    check = ReadBackCheck(slot, recorded_lsn, offsets, noted)
    for records in read.values():
        for record in records:
            check.add(record)
    for topic, partition in ended:
        check.end(topic, partition)
    return check.result()


def _parsed(value: bytes | None, slot: str) -> tuple[str, int, int] | None:
    """The parsed position header ``value`` when it is ``slot``'s."""
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

# The read-back consumer's prefetch: librdkafka queues up to this much (KiB) ahead of what the
# loop takes (its default is 64 MiB); fetch.max.bytes follows it (at least message.max.bytes),
# and a record larger than the fetch sizes still comes, alone. Records are taken one at a time:
# a batch (consume(n)) leaves the queue while it fills, so librdkafka fetches on and the batch
# holds up to n records with all their headers and values (with 300 records of 900 KB of
# headers: +19-37 MiB for batches of 100, +10-13 MiB one at a time).
QUEUED_KBYTES = 1024


class RecordCheck(Protocol):
    """What :func:`read_partitions` feeds: :class:`ReadBackCheck`, or a recovery's
    (:mod:`cdc_relay.recovery.kafka_check`)."""

    @property
    def starts(self) -> Mapping[tuple[str, int], int]: ...

    @property
    def done(self) -> bool: ...

    def add(self, record: ReadBack) -> None: ...

    def end(self, topic: str, partition: int) -> None: ...


def read_partitions(
    client_config: Mapping[str, Any],
    check: RecordCheck,
    timeout: float,
    stopping: Callable[[], bool] = lambda: False,
    committed_only: bool = False,
) -> str | None:
    """Fetch each partition of ``check`` from its start to its end (the partition-EOF event: the
    fetch response's high watermark, right even where ListOffsets is not), feeding ``check``.
    Returns an error when the read went wrong.

    Of each record only :data:`NEEDED_HEADERS` reach ``check``; a plain consumer with no group
    commits (``read_uncommitted``: what an ordinary consumer sees; ``committed_only``, publishing
    exactly once: ``read_committed``, what its consumers see, read after the fence).
    """
    starts = check.starts
    if not starts:
        return None
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
            "isolation.level": "read_committed" if committed_only else "read_uncommitted",
            "fetch.wait.max.ms": 20,  # the end is known when a fetch returns: don't linger
            "queued.max.messages.kbytes": QUEUED_KBYTES,
            # A full queue postpones the next fetch by this much (1 s by default, with which a
            # window of 50,000 small records takes 8 s to read; 0.3 s with 10 ms).
            "fetch.queue.backoff.ms": 10,
            "logger": logging.getLogger("cdc_relay.kafka"),
        }
    )
    try:
        consumer.assign([TopicPartition(t, p, o) for (t, p), o in starts.items()])
        deadline = time.monotonic() + timeout
        while not check.done and time.monotonic() < deadline and not stopping():
            message = consumer.poll(POLL_TIMEOUT)
            if message is None:
                continue
            topic, partition = str(message.topic()), int(message.partition() or 0)
            err = message.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    # The end when the read began, or later: what a killed incarnation wrote
                    # is all before it. Later records (other producers) don't matter.
                    check.end(topic, partition)
                    continue
                return f"{topic}[{partition}]: {err.str()}"
            headers = tuple(
                (str(pair[0]), pair[1])
                for pair in message.headers() or ()
                if isinstance(pair, tuple)
                and pair[0] in NEEDED_HEADERS
                and isinstance(pair[1], bytes)
            )
            check.add(ReadBack(topic, partition, int(message.offset() or 0), headers))
    except KafkaException as exc:
        return str(exc)
    finally:
        consumer.close()
    return None


def reconcile_with_kafka(
    client_config: Mapping[str, Any],
    slot: str,
    recorded_lsn: int,
    *,
    offsets: Mapping[tuple[str, int], int] | None,
    noted: Mapping[tuple[str, int], int] | None,
    timeout: float,
    stopping: Callable[[], bool] = lambda: False,
    committed_only: bool = False,
) -> Reconciliation:
    """Read the unconfirmed window back from Kafka and decide (logs what it found or doubts)."""
    started = time.monotonic()
    if offsets is None and not noted:
        log.info("nothing to reconcile: no offsets recorded with the position")
        return Reconciliation()
    check = ReadBackCheck(slot, recorded_lsn, offsets or {}, noted)
    error = read_partitions(client_config, check, timeout, stopping, committed_only)
    if error is not None:
        result = _doubt(Reconciliation(partitions=len(check.starts)), f"reading failed: {error}")
        result.records_read = check.records_read
    else:
        result = check.result()
    fields = {
        "partitions": result.partitions,
        "records_read": result.records_read,
        "in_kafka": len(result.found),
        "retained_bytes": result.retained_bytes,
        "seconds": round(time.monotonic() - started, 3),
    }
    if result.doubt is not None:
        log.warning(
            "reconciliation with Kafka skips nothing: events after the recorded position are "
            "published again (at-least-once)",
            extra={"fields": {**fields, "reason": result.doubt}},
        )
        return result
    if result.doubted:
        first = next(iter(result.doubted.values()))
        log.warning(
            "reconciliation with Kafka skips nothing in a partition that is not what the relay "
            "left: its events after the recorded position are published again (at-least-once)",
            extra={"fields": {"partitions_in_doubt": len(result.doubted), "reason": first}},
        )
    log.info("reconciled with Kafka", extra={"fields": fields})
    return result
