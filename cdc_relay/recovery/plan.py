"""A recovery's plan and progress, as the position record keeps it (``slot_position.recovery``).
Pure: :mod:`cdc_relay.recovery.record` reads and writes it, :mod:`cdc_relay.recovery.run` acts.

The plan is what makes a recovery resumable without a duplicate: the new slot's start and the
snapshot of that moment (which rows the recovery owes: those the snapshot sees and the slot never
decodes), the horizon it began with (which of them are proven published), and — as it goes — how
far Kafka acknowledged its records (``done``, by ordinal) and where in each partition its records
begin (``noted``, taken before its first record there). A recovery started again reads the same
rows in the same order (their ordinals, and so their position headers, are the same) and reads its
own records back from there (:mod:`cdc_relay.recovery.kafka_check`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum

import orjson

from cdc_relay.lsn import format_lsn, parse_lsn
from cdc_relay.reconcile import Offsets, decode_offsets, encode_offsets, position_prefix
from cdc_relay.recovery.horizon import Horizon, Snapshot, horizon_from_json
from cdc_relay.row_filter import ConditionError
from cdc_relay.row_filter import parse as parse_condition


class Cause(StrEnum):
    """Why rows are published from the table: the slot was lost, or a table is adopted."""

    DROPPED = "dropped"  # the slot is gone
    INVALIDATED = "invalidated"  # the server gave up its WAL (max_slot_wal_keep_size, idle time)
    ADOPTED = "adopted"  # the first start publishes the rows already there (CDC_RELAY_ADOPT_...)
    # The publication or an outbox table changed under the relay: rows committed after the
    # change, before its start, may never have been decoded (cdc_relay.publication_stamp).
    PUBLICATION = "publication"


class State(StrEnum):
    CREATING = "creating"  # the new slot may exist; its snapshot is not recorded yet
    PUBLISHING = "publishing"  # the slot and snapshot are recorded: rows are being published
    DONE = "done"  # every row owed was published; the relay streams from the new slot


@dataclass(frozen=True)
class Plan:
    cause: Cause
    state: State
    boundary: int  # the sweep boundary: rows of older transactions are not the relay's to owe
    lost_at: int  # the position recorded before the loss
    horizon: Horizon | None  # what the record proved when the recovery began (None: nothing)
    slot_lsn: int = 0  # the new slot's consistent point (a publication gap: the WAL's end then)
    snapshot: Snapshot | None = None  # the new slot's exported snapshot
    commit_order: str = "xid"  # "commit_timestamp" when track_commit_timestamp was on
    rows: int = 0  # rows the snapshot sees that the horizon does not prove published
    done: int = 0  # ordinals Kafka acknowledged, each with every one before it
    offsets: Offsets = field(default_factory=dict)  # acknowledged at ``done``
    noted: Offsets = field(default_factory=dict)  # partition ends before its first record
    published: int = 0
    dead_lettered: int = 0
    in_kafka: int = 0  # rows found in Kafka (published before the loss, or by an earlier run)
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    condition: str | None = None  # adopted: the rows it publishes (the row filter's grammar)
    below: int | None = None  # a publication gap: rows of transactions from ``boundary`` to this
    # Rows owed were deleted since the plan was made: ordinals (and ``done``) name other rows
    # than they did, so its own records are found by id (cdc_relay.recovery.kafka_check).
    moved: bool = False
    filenodes: Mapping[str, int] = field(default_factory=dict)  # the tables' storage, when made

    @property
    def replaces_slot(self) -> bool:
        """It creates a new slot (a publication gap publishes beside the one there)."""
        return self.cause is not Cause.PUBLICATION

    @property
    def record_lsn(self) -> int:
        """The LSN its records' position headers carry: below the slot's start, and never the
        start of a WAL record (those are 8-byte aligned), so never a commit's position — a
        recovery's records are told from the stream's, and from another recovery's."""
        return max(((self.slot_lsn >> 3) << 3) - 1, 7)

    def position_prefix(self, slot: str) -> bytes:
        return position_prefix(slot, self.record_lsn)

    @property
    def seconds(self) -> float:
        return round((self.finished_at or time.time()) - self.started_at, 3)

    def progressed(self, **changes: object) -> Plan:
        return replace(self, **changes)  # type: ignore[arg-type]

    def to_json(self) -> dict[str, object]:
        return {
            "cause": self.cause.value,
            "state": self.state.value,
            "boundary": str(self.boundary),
            "lost_at": format_lsn(self.lost_at),
            "horizon": None if self.horizon is None else self.horizon.to_json(),
            "slot_lsn": format_lsn(self.slot_lsn),
            "snapshot": None if self.snapshot is None else self.snapshot.text,
            "commit_order": self.commit_order,
            "rows": self.rows,
            "done": self.done,
            "offsets": orjson.loads(encode_offsets(self.offsets)),
            "noted": orjson.loads(encode_offsets(self.noted)),
            "published": self.published,
            "dead_lettered": self.dead_lettered,
            "in_kafka": self.in_kafka,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "condition": self.condition,
            "below": None if self.below is None else str(self.below),
            "moved": self.moved,
            "filenodes": dict(self.filenodes),
        }

    @property
    def text(self) -> str:
        return orjson.dumps(self.to_json()).decode()

    def summary(self) -> dict[str, object]:
        """What ``status`` and ``/status`` show of it."""
        return {
            "state": self.state.value,
            "cause": self.cause.value,
            "rows": self.rows,
            "done": self.done,
            "published": self.published,
            "dead_lettered": self.dead_lettered,
            "in_kafka": self.in_kafka,
            "seconds": self.seconds,
            "slot_lsn": format_lsn(self.slot_lsn),
            "commit_order": self.commit_order,
        }


_COUNTS = ("rows", "done", "published", "dead_lettered", "in_kafka")
MAX_TABLES = 65536  # outbox tables and their partitions in a recorded plan, at most


def parsed_condition(text: str) -> bool:
    """``text`` is a condition of the row filter's grammar (parsed in linear time)."""
    try:
        parse_condition(text)
    except ConditionError:
        return False
    return True


def _need(condition: bool) -> None:
    if not condition:
        raise ValueError("not a recorded plan")


def plan_from_json(value: object) -> Plan | None:
    """A recorded plan; None for anything that is not one."""
    try:
        if isinstance(value, (bytes, str)):
            value = orjson.loads(value)
        _need(isinstance(value, Mapping))
        assert isinstance(value, Mapping)
        boundary = value.get("boundary")
        _need(isinstance(boundary, str) and boundary.isdigit())
        counts = {name: value.get(name) for name in _COUNTS}
        _need(all(type(c) is int and c >= 0 for c in counts.values()))
        lost_at, slot_lsn = value.get("lost_at"), value.get("slot_lsn")
        _need(isinstance(lost_at, str) and isinstance(slot_lsn, str))
        snapshot_text = value.get("snapshot")
        snapshot = None if snapshot_text is None else Snapshot.parse(snapshot_text)
        _need(snapshot_text is None or snapshot is not None)
        horizon_value = value.get("horizon")
        horizon = None if horizon_value is None else horizon_from_json(horizon_value)
        offsets, noted = decode_offsets(value.get("offsets")), decode_offsets(value.get("noted"))
        started, finished = value.get("started_at"), value.get("finished_at")
        _need(offsets is not None and noted is not None and type(started) in (int, float))
        _need(finished is None or type(finished) in (int, float))
        order = value.get("commit_order")
        condition = value.get("condition")
        _need(condition is None or (isinstance(condition, str) and parsed_condition(condition)))
        below = value.get("below")
        _need(below is None or (isinstance(below, str) and below.isdigit()))
        moved = value.get("moved", False)
        _need(isinstance(moved, bool))
        nodes = value.get("filenodes", {})
        _need(isinstance(nodes, Mapping) and len(nodes) <= MAX_TABLES)
        assert isinstance(nodes, Mapping)
        _need(all(str(k).isdigit() and type(v) is int for k, v in nodes.items()))
        return Plan(
            cause=Cause(str(value.get("cause"))),
            state=State(str(value.get("state"))),
            boundary=int(str(boundary)),
            lost_at=parse_lsn(str(lost_at)),
            horizon=horizon,
            slot_lsn=parse_lsn(str(slot_lsn)),
            snapshot=snapshot,
            commit_order=order if order in ("xid", "commit_timestamp") else "xid",
            offsets=offsets or {},
            noted=noted or {},
            started_at=float(str(started)),
            finished_at=None if finished is None else float(str(finished)),
            condition=None if condition is None else str(condition),
            below=None if below is None else int(str(below)),
            moved=bool(moved),
            filenodes={str(k): int(str(v)) for k, v in nodes.items()},
            **{name: int(str(count)) for name, count in counts.items()},
        )
    except (ValueError, orjson.JSONDecodeError):
        return None
