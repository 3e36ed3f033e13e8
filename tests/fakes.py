"""Stand-ins for the collaborators of the session, the start and the relay, so unit tests can
drive the real code.

:class:`~cdc_relay.session.Session` talks to a replication source, a Kafka sink and a position
store through small Protocols. These fakes implement them in memory: captured pgoutput messages
become the source's frames, the sink acknowledges (or refuses) on ``poll`` the way librdkafka's
delivery reports do, and every write to the store and every status update to the slot lands in
one shared ``journal``, so a test can assert the order of the two.

:class:`~cdc_relay.start.StartSequence` asks PostgreSQL through :class:`FakeStartDatabase` (a
server, its slot and the position record in memory, every step in its ``journal``), and
:class:`~cdc_relay.relay.Relay` leads through :class:`FakeLeadership` and starts sessions through
:class:`FakeStart`.
"""

from __future__ import annotations

import json
import struct
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psycopg
from confluent_kafka import KafkaError, KafkaException
from psycopg import sql

from cdc_relay.checkpoint import Record as PositionRecord
from cdc_relay.checkpoint import fenced
from cdc_relay.config import OutboxTable
from cdc_relay.errors import RelayError
from cdc_relay.leadership import ForeignHolder, require_lease
from cdc_relay.lsn import parse_lsn
from cdc_relay.publication_filter import FilterMismatch
from cdc_relay.publication_stamp import (
    Change,
    PublicationStamp,
    change_error,
    parse,
    unrelayed_changes,
)
from cdc_relay.publisher import ANY_PARTITION, NO_TIMESTAMP, refusal
from cdc_relay.reconcile import Offsets, Reconciliation
from cdc_relay.record_origin import Server, Stamp
from cdc_relay.recovery.plan import Cause, Plan
from cdc_relay.replication.source import SlotState
from cdc_relay.start import Started
from cdc_relay.sweep_boundary import NO_HORIZON
from cdc_relay.sweep_queries import Eligible
from cdc_relay.transaction_errors import transaction_failure

PGOUTPUT_FIXTURES = Path(__file__).resolve().parent / "fixtures" / "pgoutput"
_XLOG_HEADER = struct.Struct(">cQQQ")
_KEEPALIVE = struct.Struct(">cQQB")


def xlog_frame(payload: bytes, lsn: int) -> bytes:
    """A CopyData XLogData frame around one pgoutput message, as the walsender sends it."""
    return _XLOG_HEADER.pack(b"w", lsn, lsn, 0) + payload


def keepalive_frame(wal_end: int, reply: bool = False) -> bytes:
    return _KEEPALIVE.pack(b"k", wal_end, 0, int(reply))


def captured_frames(case: str, capture: str = "v1") -> list[bytes]:
    """Every message of a captured pgoutput fixture, in order, as XLogData frames."""
    fixture = json.loads((PGOUTPUT_FIXTURES / f"{case}.json").read_text())
    return [
        xlog_frame(bytes.fromhex(m["hex"]), parse_lsn(m["lsn"]))
        for m in fixture["messages"]
        if m["capture"] == capture
    ]


@dataclass
class FakeOwner:
    """The relay as a session sees it."""

    stopping: bool = False
    failure: RelayError | None = None
    leading: bool = True

    @property
    def failed(self) -> bool:
        return self.failure is not None

    def require_leading(self) -> None:
        require_lease(self.leading, "nothing more confirmed")

    def fail(self, error: RelayError) -> None:
        self.failure = error
        self.stopping = True


class FakeSource:
    """Hands out ``frames`` one per read; once they run out (or after ``stop_after`` of them),
    asks ``owner`` to stop."""

    def __init__(
        self,
        frames: list[bytes],
        owner: FakeOwner,
        journal: list[Any],
        stop_after: int | None = None,
    ) -> None:
        self.frames = list(frames)
        self._owner = owner
        self._journal = journal
        self._stop_after = stop_after  # frames read before a stop is requested
        self.read_count = 0
        self.statuses: list[tuple[int, int]] = []

    def stop_after(self, frames: int | None) -> None:
        """Ask for a stop once ``frames`` frames have been read in all (None: when they run out)."""
        self._stop_after = frames

    def read(self) -> memoryview | None:
        if not self.frames or self.read_count == self._stop_after:
            self._owner.stopping = True
        if not self.frames:
            return None
        self.read_count += 1
        return memoryview(self.frames.pop(0))

    def wait(self, timeout: float) -> bool:
        return bool(self.frames)

    def send_status(self, written: int, flushed: int, reply: bool = False) -> None:
        self.statuses.append((written, flushed))
        self._journal.append(("slot", flushed))


class FakeStore:
    def __init__(self, journal: list[Any]) -> None:
        self._journal = journal
        self.saved: list[int] = []
        self.noted: dict[tuple[str, int], int] = {}
        self.offsets: list[dict[tuple[str, int], int]] = []
        # Writes after this many find another publication (None: never), as the real one would.
        self.changed_after: int | None = None
        self.attempts = 0

    def save(self, lsn: int, offsets: Mapping[tuple[str, int], int] | None = None) -> None:
        self.attempts += 1
        if self.changed_after is not None and len(self.saved) >= self.changed_after:
            now = publication_stamp(rel=["17000", "900"])
            raise change_error(None, publication_stamp(), now, None)
        self.saved.append(lsn)
        self.offsets.append(dict(offsets or {}))
        self._journal.append(("record", lsn))

    def note_written_from(self, offsets: Mapping[tuple[str, int], int]) -> None:
        self.noted = dict(offsets)


class DeliveredMessage:
    """What a delivery report's ``msg`` offers."""

    def __init__(self, record: Record) -> None:
        self._record = record

    def key(self) -> bytes | None:
        return self._record.key

    def value(self) -> bytes | None:
        return self._record.value

    def topic(self) -> str:
        return self._record.topic

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return self._record.offset


class DeliveryError:
    def __init__(self, code: int, reason: str) -> None:
        self._code, self._reason = code, reason

    def code(self) -> int:
        return self._code

    def str(self) -> str:
        return self._reason


@dataclass
class Record:
    topic: str
    value: bytes | None
    key: bytes | None
    headers: list[tuple[str, bytes]]
    on_delivery: Callable[[Any, Any], None] = field(repr=False)
    offset: int = 0

    def header(self, name: str) -> bytes | None:
        return next((v for n, v in self.headers if n == name), None)


class FakeSink:
    """A Kafka producer in memory: records wait in flight until ``poll`` acknowledges them.

    ``acknowledging`` False holds every record in flight (a broker that does not answer);
    ``refuse_topics`` maps a topic to the librdkafka error code produce raises for it.
    """

    def __init__(self) -> None:
        self.acknowledging = True
        self.refuse_topics: dict[str, int] = {}
        self.in_flight_records: list[Record] = []
        self.delivered: list[Record] = []
        self.topics_checked: list[str] = []
        # The transactional side (CDC_RELAY_EXACTLY_ONCE): the calls made, in order; records
        # produced since the last begin; those of committed transactions; the code the next
        # commit fails with (None: it commits).
        self.transaction_calls: list[str] = []
        self.uncommitted: list[Record] = []
        self.committed: list[Record] = []
        self.commit_fails_with: int | None = None

    def partition_ends(self, topic: str) -> dict[int, int]:
        return {0: sum(1 for r in self.delivered if r.topic == topic)}

    def produce_raw(
        self,
        topic: str,
        value: bytes | None,
        key: bytes | None,
        partition: int,
        on_delivery: Callable[[Any, Any], None],
        on_delivery_alias: None,
        timestamp: int,
        headers: list[tuple[str, bytes]],
    ) -> None:
        """confluent-kafka's positional order (see :data:`cdc_relay.publisher.ANY_PARTITION`)."""
        assert (partition, on_delivery_alias, timestamp) == (ANY_PARTITION, None, NO_TIMESTAMP)
        code = self.refuse_topics.get(topic)
        if code is not None:
            raise KafkaException(KafkaError(code, f"refused by the fake for {topic}"))
        record = Record(topic, value, key, list(headers), on_delivery)
        self.in_flight_records.append(record)
        if self.transaction_calls:
            assert self.transaction_calls[-1] == "begin", "produced outside a Kafka transaction"
            self.uncommitted.append(record)

    def produce(
        self,
        topic: str,
        value: bytes | None,
        key: bytes | None,
        headers: list[tuple[str, bytes]],
        on_delivery: Callable[[Any, Any], None],
    ) -> None:
        try:
            self.produce_raw(
                topic, value, key, ANY_PARTITION, on_delivery, None, NO_TIMESTAMP, headers
            )
        except KafkaException as exc:
            raise refusal(exc) from None

    def poll(self, timeout: float = 0) -> int:
        if not self.acknowledging:
            return 0
        served = self.in_flight_records
        self.in_flight_records = []
        for record in served:
            record.offset = len(self.delivered)
            self.delivered.append(record)
            record.on_delivery(None, DeliveredMessage(record))
        return len(served)

    def fail_in_flight(self, code: int, reason: str) -> None:
        """The broker refuses every record in flight (delivery reports with an error)."""
        served = self.in_flight_records
        self.in_flight_records = []
        for record in served:
            record.on_delivery(DeliveryError(code, reason), DeliveredMessage(record))

    def in_flight(self) -> int:
        return len(self.in_flight_records)

    def check_fatal(self) -> None:
        return None

    def begin_transaction(self) -> None:
        assert not self.transaction_calls or self.transaction_calls[-1] != "begin"
        self.transaction_calls.append("begin")

    def commit_transaction(self, serve: Callable[[], None]) -> None:
        assert self.transaction_calls[-1] == "begin"
        serve()
        self.poll()  # a commit delivers what is queued first
        code = self.commit_fails_with
        if code is not None:
            self.commit_fails_with = None
            raise transaction_failure(KafkaError(code, "refused by the fake"), "committing")
        self.transaction_calls.append("commit")
        self.committed.extend(self.uncommitted)
        self.uncommitted = []

    def abort_transaction(self) -> bool:
        self.transaction_calls.append("abort")
        self.uncommitted = []
        return True

    def ensure_topic(
        self,
        topic: str,
        create: bool,
        partitions: int,
        replication_factor: int,
        may_create: Callable[[], None] | None = None,
    ) -> bool:
        self.topics_checked.append(topic)
        return False

    def on_topic(self, topic: str) -> list[Record]:
        return [r for r in self.delivered if r.topic == topic]


# -- the start and the relay's lifecycle ---------------------------------------------------------

SYSTEM = "7300000000000000001"


def slot_at(confirmed: int, active_pid: int | None = None, name: str = "cdc_relay") -> SlotState:
    return SlotState(name, "logical", "pgoutput", "app", active_pid, confirmed, "reserved", 0)


class FakeLeadership:
    """The leadership: ``leading`` as the test sets it, or lost after ``looks_left`` more looks
    (the lease running out while the relay does something else)."""

    def __init__(self, leading: bool = True) -> None:
        self._leading = leading
        self.looks_left: int | None = None
        self.became_leader = threading.Event()
        if leading:
            self.became_leader.set()
        self.leader_seen: str | None = None
        self.foreign_holder: ForeignHolder | None = None
        self.predecessor_stream_pid: int | None = None
        self.resigned = 0
        self.released = 0
        self.on_resign: Callable[[], None] | None = None  # e.g. the test stops the relay

    @property
    def leading(self) -> bool:
        if self.looks_left is not None:
            if self.looks_left == 0:
                self.lose()
            else:
                self.looks_left -= 1
        return self._leading

    def lose(self) -> None:
        self._leading = False
        self.looks_left = None
        self.became_leader.clear()

    def start(self) -> None:
        return None

    def lose_after(self, looks: int) -> None:
        """Still leading for ``looks`` more looks, then the lease has run out."""
        self.looks_left = looks

    def resign(self) -> None:
        self.resigned += 1
        self.lose()
        if self.on_resign is not None:
            self.on_resign()

    def release(self) -> None:
        self.released += 1


class FakeStream:
    """A replication stream that START_REPLICATION opened at ``start``."""

    def __init__(self, start: int, timeline: tuple[str, int], pid: int = 4242) -> None:
        self.start = start
        self.timeline: tuple[str, int] | None = timeline
        self.statuses: list[tuple[int, int]] = []
        self.closed = False
        self._pid = pid

    @property
    def backend_pid(self) -> int:
        return self._pid

    def read(self) -> memoryview | None:
        return None

    def wait(self, timeout: float) -> bool:
        return False

    def send_status(self, written: int, flushed: int, reply: bool = False) -> None:
        self.statuses.append((written, flushed))

    def close(self) -> None:
        self.closed = True


def publication_stamp(
    *,
    oid: str | None = "16400",
    rel: list[str] | None = None,
    pub: list[str] | None = None,
    type_xmin: str = "700",
    table: str = "public.outbox",
    plugin: str = "pgoutput",
) -> PublicationStamp:
    """A stamp as :mod:`cdc_relay.publication_stamp` reads one: the publication's row and one
    outbox table (pgoutput: with its row in the publication)."""
    schema, name = table.split(".")
    entry: dict[str, object] = {
        "table": table, "schema": schema, "name": name, "oid": oid,
        "kind": "r" if oid is not None else None, "type": type_xmin,
    }  # fmt: skip
    data: dict[str, object] = {"plugin": plugin, "publication": "cdc_relay_outbox"}
    if plugin == "pgoutput":
        entry["rel"] = rel if rel is not None else ["16401", "731"]
        data["pub"] = pub if pub is not None else ["16396", "726"]
        data["schemas"] = []
    data["tables"] = [entry]
    return PublicationStamp(data)


class FakeStartStore:
    """The position record, fenced by the lease like the real one, and once verified by the
    publication's stamp (``database.publication``) like the real one."""

    def __init__(self, database: FakeStartDatabase) -> None:
        self._db = database

    def ensure_table(self) -> bool:
        self._db.journal.append("ensure_table")
        return False

    def restart_sweep_boundary(self, gap: Plan | None = None) -> int | None:
        self._db.journal.append("restart_sweep_boundary")
        if gap is not None:
            self._db.recovery = gap.to_json()
        return self._db.next_xid

    def verify(self, stamp: PublicationStamp) -> None:
        self._db.verified = stamp
        self._db.journal.append("verify")

    def _checked(self) -> None:
        db = self._db
        if db.verified is None:
            return
        if db.publication.data != db.verified.data:
            raise change_error(None, db.verified, db.publication, None)
        db.recorded_stamp = db.verified.data
        db.checked_xid = db.next_xid

    def load_record(self) -> PositionRecord:
        db = self._db
        stamp = None if db.recorded is None else Stamp(db.recorded, SYSTEM, db.recorded_timeline)
        return PositionRecord(
            stamp,
            None,
            db.row_filters,
            Server(SYSTEM, db.timeline_id, db.wal_end),
            db.recorded_stamp,
            db.checked_xid,
            "2026-01-01 00:00:00+00",
            recovery=db.recovery,
        )

    def save(
        self,
        lsn: int,
        offsets: Mapping[tuple[str, int], int] | None = None,
        new_slot: bool = False,
    ) -> None:
        db = self._db
        fenced(1 if db.lease_ours else 0, "the position was not recorded")
        self._checked()
        db.recorded = lsn
        db.recorded_timeline = db.timeline_id
        if offsets is not None or new_slot:
            db.offsets = dict(offsets) if offsets is not None else None
        db.journal.append(("save", lsn, None if offsets is None else dict(offsets), new_slot))

    def record_row_filters(self, filters: Mapping[str, str | None], changed: bool) -> None:
        fenced(1 if self._db.lease_ours else 0, "nothing was recorded")
        self._checked()
        self._db.row_filters = dict(filters)
        self._db.journal.append(("row_filters", changed))

    def load_offsets(self) -> tuple[Offsets | None, Offsets | None]:
        return self._db.offsets, self._db.noted

    def note_written_from(self, offsets: Mapping[tuple[str, int], int]) -> None:
        fenced(1 if self._db.lease_ours else 0, "nothing was noted")
        self._db.noted = dict(offsets)
        self._db.journal.append(("noted", dict(offsets)))


class FakeStartDatabase:
    """A server as a start sees it, in memory: its timeline, the slot, the position record.

    ``holders``: the slot's ``active_pid`` at each look while the start waits for the slot (the
    last one stays); ``leadership``: the lease, for the walsender's note.
    """

    def __init__(self, leadership: FakeLeadership, *, slot: SlotState | None = None) -> None:
        self.leadership = leadership
        self.journal: list[Any] = []
        self.slot_state = slot
        self.holders: list[int | None] = []
        self.recorded: int | None = None
        self.recorded_timeline: int | None = 1
        self.offsets: Offsets | None = None
        self.noted: Offsets | None = None
        self.row_filters: object = None
        # The publication now, the one the start verified, the one recorded with the position.
        self.publication = publication_stamp()
        self.verified: PublicationStamp | None = None
        self.recorded_stamp: object = None
        self.checked_xid: int | None = None
        self.next_xid = 1000
        self.system = SYSTEM
        self.timeline_id = 1
        self.wal_end: int | None = 0x10_000_000
        self.promoted_at: int | None = None  # where timeline_id began (a promotion)
        self.lease_ours = True
        self.recovery: object = None  # a recovery's plan as recorded (JSON)
        self.streams: list[FakeStream] = []
        self.closed = False

    def require(self) -> None:
        self.journal.append("require")

    def wants_failover(self) -> bool:
        return False

    def ensure_publication(self) -> bool:
        self.journal.append("ensure_publication")
        return False

    def ensure_row_filters(self) -> FilterMismatch | None:
        return None

    def publication_stamp(self) -> PublicationStamp:
        self.journal.append("publication_stamp")
        return self.publication

    def unrelayed(self, recorded: object, found: PublicationStamp) -> list[Change]:
        return unrelayed_changes(None, parse(recorded), found)

    def store(self) -> FakeStartStore:
        return FakeStartStore(self)

    def slot(self) -> SlotState | None:
        if self.slot_state is not None and self.holders:
            pid = self.holders.pop(0) if len(self.holders) > 1 else self.holders[0]
            self.slot_state = replace(self.slot_state, active_pid=pid)
        return self.slot_state

    def create_slot(self, failover: bool) -> SlotState:
        self.slot_state = slot_at(self.wal_end or 0)
        self.journal.append("create_slot")
        return self.slot_state

    def drop_slot(self) -> None:
        self.journal.append("drop_slot")
        self.slot_state = None

    def recover(self, record: PositionRecord, cause: Cause, failover: bool) -> SlotState:
        """A recovery: the new slot at the WAL's end, its start recorded."""
        self.slot_state = slot_at(self.wal_end or 0)
        self.recorded = self.slot_state.confirmed_flush
        self.journal.append(("recover", cause.value))
        return self.slot_state

    def end_backend(self, pid: int) -> None:
        self.journal.append(("end_backend", pid))
        self.holders = [None]

    def require_usable_slot(self, slot: SlotState) -> None:
        if slot.active_pid is not None:
            from cdc_relay.errors import SlotInUse  # noqa: PLC0415

            raise SlotInUse(f"replication slot is in use by pid {slot.active_pid}")

    def ensure_failover(self, slot: SlotState) -> None:
        return None

    def promotion_note(self, slot: SlotState, recorded: int | None) -> str | None:
        return None

    def timeline(self) -> tuple[str, int]:
        return self.system, self.timeline_id

    def timeline_start(self, timeline_id: int, since: int) -> int | None:
        return self.promoted_at

    def history_switches(self, timeline_id: int) -> list[tuple[int, int]]:
        return [] if self.promoted_at is None else [(timeline_id - 1, self.promoted_at)]

    def open_stream(self, start: int) -> FakeStream:
        stream = FakeStream(start, (self.system, self.timeline_id))
        self.streams.append(stream)
        self.journal.append(("START_REPLICATION", start))
        return stream

    def note_stream(self, pid: int) -> None:
        require_lease(self.leadership.leading, "streaming not begun")
        fenced(1 if self.lease_ours else 0, "streaming not begun")
        self.journal.append(("note_stream", pid))

    def heartbeat(self) -> None:
        return None

    def retained_wal(self) -> int | None:
        return 0

    def close(self) -> None:
        self.closed = True


class FakeStart:
    """The start of sessions as the relay sees it: each session's start raises the next of
    ``failures`` (a callable makes it, e.g. after asking the relay to stop); one more start than
    the test expects fails it with IndexError."""

    def __init__(self, failures: list[BaseException | Callable[[], BaseException]]) -> None:
        self.failures = list(failures)
        self.sessions = 0
        self.checked = 0
        self.forgotten = 0
        self.closed = False
        self.resume_position = 0
        self.resumes_carried = False

    def check_database(self) -> None:
        self.checked += 1

    def drop_stale(self) -> None:
        return None

    def close(self) -> None:
        self.closed = True

    @contextmanager
    def session(self) -> Iterator[Started]:
        self.sessions += 1
        failure = self.failures.pop(0)
        raise failure if isinstance(failure, BaseException) else failure()
        yield  # never: every fake start fails

    def read_back(
        self, started: Started, meanwhile: Callable[[], None]
    ) -> tuple[Reconciliation | None, Offsets | None]:
        raise AssertionError("a fake start never streams")

    def carry(self, position: int, offsets: Offsets) -> None:
        self.resume_position = position

    def forget(self) -> None:
        self.forgotten += 1


def eligible_since(
    conn: psycopg.Connection[tuple[object, ...]], table: str, since: int
) -> Eligible:
    """What the sweeper's statements may take of ``table`` (a plain table): rows of transactions
    from ``since`` on, with no horizon (as if it had looked at it and found no older row)."""
    row = conn.execute("SELECT %s::regclass::oid::int8", (table,)).fetchone()
    assert row is not None
    return Eligible((int(str(row[0])),), (since,), (NO_HORIZON,))


@dataclass
class SweptTableStub:
    """A table as the sweeper holds it (:class:`cdc_relay.sweep_queries.SweptTable`), for
    driving the sweeper's queries directly."""

    table: OutboxTable
    key: tuple[str, ...]
    key_types: list[sql.Composable]
    condition: sql.Composable | None = None
