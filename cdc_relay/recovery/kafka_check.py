"""Which owed rows are in Kafka already: the read-back of a recovery.

Two kinds of this slot's records can stand for an owed row (by its event id), and one read of the
partitions finds both (:func:`read_back`, through :func:`cdc_relay.reconcile.read_partitions`):

- the *earlier* ones — of the stream before the loss, of an earlier recovery — for the rows the
  horizon does not prove: each such row committed after the horizon's read-back position, so its
  record, if there is one, lies after the horizon's offsets (or notes) in its partition. Their ids
  are counted (:class:`Earlier`); a row whose id is counted takes one count, in the recovery's
  order (each record stands for one row). Kept within :data:`~cdc_relay.reconcile.RETAINED_BUDGET`;
  past it, or when the read fails, none is taken for published: those rows are published again
  (a duplicate, never a loss), and the recovery says so.
- the recovery's *own*, of a run that was interrupted: their position header is the plan's, with
  the row's ordinal, so a row is in Kafka when the record of its ordinal carries its id
  (:class:`Own`: 16 bytes per owed row). They lie after the plan's progress offsets and notes.
  Rows deleted from the table since the plan was made move the ordinals of those after them: the
  run then finds its own records by id alone, read from the plan's notes.

A dead letter counts as its row's record (its ``cdc_relay.event_id``), as at a start's read-back.
"""

from __future__ import annotations

import logging
from array import array
from bisect import bisect_left
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from hashlib import blake2b
from typing import Any

from confluent_kafka import OFFSET_BEGINNING

from cdc_relay.dead_letter import text_bytes
from cdc_relay.reconcile import (
    ENTRY_OVERHEAD,
    POSITION_HEADER,
    RETAINED_BUDGET,
    Offsets,
    ReadBack,
    parse_position,
    read_partitions,
    read_starts,
)

log = logging.getLogger(__name__)


def id_hash(event_id: bytes) -> int:
    """A non-zero 64-bit digest of an event id (zero marks an ordinal with no record)."""
    return int.from_bytes(blake2b(event_id, digest_size=8).digest(), "big") | 1


@dataclass
class Earlier:
    """Event ids of this slot's earlier records, each with how many records carry it."""

    counts: dict[bytes, int] = field(default_factory=dict)
    retained: int = 0
    doubt: str | None = None  # nothing is taken for published

    def add(self, event_id: bytes, budget: int) -> None:
        if self.doubt is not None:
            return
        if event_id not in self.counts:
            self.retained += len(event_id) + ENTRY_OVERHEAD
            if self.retained > budget:
                self.give_up(
                    f"more of this slot's records after the horizon than the read-back keeps "
                    f"({budget / 2**20:g} MiB of event ids)"
                )
                return
        self.counts[event_id] = self.counts.get(event_id, 0) + 1

    def give_up(self, reason: str) -> None:
        self.doubt = reason
        self.counts = {}

    def take(self, event_id: str) -> bool:
        """A record with ``event_id`` stands for this row (and for no other one now)."""
        key = text_bytes(event_id)
        left = self.counts.get(key, 0)
        if left <= 0:
            return False
        self.counts[key] = left - 1
        return True


class Own:
    """The hash of the event id of each of this recovery's records found, by ordinal — and all
    of them, sorted, for a run whose ordinals moved (rows deleted since the plan was made)."""

    def __init__(self, rows: int) -> None:
        self._found = array("Q", bytes(8 * (rows + 1)))
        self._ids = array("Q")
        self._sorted = True
        # By id: the records of earlier runs, whose ordinals may exceed today's rows; bounded
        # (past it a record is not found by id: sent again, never lost).
        self._id_budget = 4 * (rows + 1) + 65536

    def add(self, ordinal: int, event_id: bytes) -> None:
        digest = id_hash(event_id)
        if 0 < ordinal < len(self._found):
            self._found[ordinal] = digest
        if ordinal > 0 and len(self._ids) < self._id_budget:
            self._ids.append(digest)
            self._sorted = False

    def has(self, ordinal: int, event_id: str) -> bool:
        return 0 < ordinal < len(self._found) and self._found[ordinal] == id_hash(
            text_bytes(event_id)
        )

    def has_id(self, event_id: str) -> bool:
        """A record of this recovery carries ``event_id``, whatever its ordinal."""
        if not self._sorted:
            self._ids = array("Q", sorted(self._ids))
            self._sorted = True
        digest = id_hash(text_bytes(event_id))
        at = bisect_left(self._ids, digest)
        return at < len(self._ids) and self._ids[at] == digest

    @property
    def found(self) -> int:
        return sum(1 for value in self._found if value)


@dataclass
class RecoveryCheck:
    """Fed by :func:`~cdc_relay.reconcile.read_partitions`: sorts this slot's records into
    :class:`Earlier` and :class:`Own` (``own_lsn``: the LSN of the plan's position headers)."""

    slot: str
    own_lsn: int
    starts: dict[tuple[str, int], int]
    earlier: Earlier
    own: Own
    budget: int = RETAINED_BUDGET
    records_read: int = 0
    _reading: set[tuple[str, int]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self._reading = set(self.starts)

    @property
    def done(self) -> bool:
        return not self._reading

    def add(self, record: ReadBack) -> None:
        if (record.topic, record.partition) not in self._reading:
            return
        self.records_read += 1
        position = event_id = metadata_id = None
        for name, value in record.headers:
            if name == POSITION_HEADER:
                position = value
            elif name == "id":
                event_id = value
            elif name == "cdc_relay.event_id":
                metadata_id = value
        parsed = None if position is None else parse_position(position)
        if parsed is None or parsed[0] != self.slot:
            return  # another producer's, or another slot's
        found = event_id if event_id is not None else metadata_id
        if not found:
            return  # nothing to know its row by
        if parsed[1] == self.own_lsn:
            self.own.add(parsed[2], found)
        else:
            self.earlier.add(found, self.budget)

    def end(self, topic: str, partition: int) -> None:
        self._reading.discard((topic, partition))


def starts_for(
    earlier: Mapping[tuple[str, int], int] | None,
    own: Mapping[tuple[str, int], int],
    everything: set[tuple[str, int]],
) -> dict[tuple[str, int], int]:
    """Where to read each partition from: the lower of the two starts; a partition known to hold
    this slot's records (``everything``) but with no start, from its beginning."""
    starts = dict(own)
    for key, offset in (earlier or {}).items():
        starts[key] = min(offset, starts.get(key, offset))
    for key in everything - set(starts):
        starts[key] = OFFSET_BEGINNING
    return starts


def horizon_starts(offsets: Offsets, noted: Offsets) -> dict[tuple[str, int], int]:
    """The horizon's read starts (its offsets, else its notes), as at a start's read-back."""
    return read_starts(offsets, noted)


def read_back(
    client_config: Mapping[str, Any],
    check: RecoveryCheck,
    timeout: float,
    stopping: Callable[[], bool],
    committed_only: bool,
) -> str | None:
    """Read every partition of ``check`` to its end; an error when the read went wrong."""
    error = read_partitions(client_config, check, timeout, stopping, committed_only)
    if error is None and not check.done:
        error = "not every partition was read to its end in time"
    if error is not None:
        check.earlier.give_up(f"reading failed: {error}")
    return error
