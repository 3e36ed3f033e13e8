"""The start sequence: what runs before a session streams, in the order it runs.

See :mod:`cdc_relay.start` for the order. Everything the sequence asks PostgreSQL goes through
:class:`StartDatabase`, and the read-back from Kafka is a function it is given, so the unit tests
drive it with fakes (``tests/fakes.py``); :mod:`cdc_relay.start.adapters` holds the real ones.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import orjson

from cdc_relay.checkpoint import Record, check_missing_slot, resolve_start
from cdc_relay.config import OnSlotLoss, Settings, env_name
from cdc_relay.errors import PositionMismatch, SourceUnavailable
from cdc_relay.lsn import format_lsn
from cdc_relay.observability import launch
from cdc_relay.observability.stats import RelayStats
from cdc_relay.publication_filter import FilterMismatch
from cdc_relay.publication_stamp import Change, PublicationStamp, unrelayed_message
from cdc_relay.record_origin import problem, refusal
from cdc_relay.recovery.loss import (
    ON_LOSS,
    RECOVER,
    in_progress,
    interrupted,
    publication_gap,
    slot_loss,
    what_happened,
)
from cdc_relay.recovery.loss import refusal as loss_refusal
from cdc_relay.recovery.plan import Cause, Plan
from cdc_relay.relayed_filters import differences, recorded_form
from cdc_relay.replication.source import SlotState

if TYPE_CHECKING:
    from cdc_relay.reconcile import Offsets, Reconciliation

log = logging.getLogger(__name__)

Timeline = tuple[str, int]  # (system identifier, timeline id)

CHECKED_FRESH = 5.0  # seconds the start-up check stands for the first session's
SLOT_RELEASE_POLL = 0.05
KEEPALIVE_INTERVAL = 1.0  # seconds between standby status updates while the session prepares


class StartStore(Protocol):
    """The position record (:class:`~cdc_relay.checkpoint.PostgresCheckpointStore`), fenced by
    the lease."""

    def ensure_table(self) -> bool: ...

    def restart_sweep_boundary(self, gap: Plan | None = None) -> int | None: ...

    def verify(self, stamp: PublicationStamp) -> None:
        """Every later write requires the publication still to be ``stamp`` (and records it)."""

    def load_record(self) -> Record: ...

    def save(
        self,
        lsn: int,
        offsets: Mapping[tuple[str, int], int] | None = None,
        new_slot: bool = False,
    ) -> None: ...

    def record_row_filters(self, filters: Mapping[str, str | None], changed: bool) -> None: ...

    def load_offsets(self) -> tuple[Offsets | None, Offsets | None]: ...

    def note_written_from(self, offsets: Mapping[tuple[str, int], int]) -> None: ...


class StartedStream(Protocol):
    """The replication connection once ``START_REPLICATION`` was accepted."""

    timeline: Timeline | None  # the server's, read when it opened

    @property
    def backend_pid(self) -> int: ...

    def read(self) -> memoryview | None: ...

    def wait(self, timeout: float) -> bool: ...

    def send_status(self, written: int, flushed: int, reply: bool = False) -> None: ...

    def close(self) -> None: ...


class StartDatabase(Protocol):
    """What a start asks PostgreSQL, on one connection (:class:`PostgresStart`)."""

    def require(self) -> None:
        """The prerequisites, in order; SourceSetupError at the first unmet one."""

    def wants_failover(self) -> bool: ...

    def ensure_publication(self) -> bool: ...

    def ensure_row_filters(self) -> FilterMismatch | None: ...

    def publication_stamp(self) -> PublicationStamp:
        """The publication and outbox tables as they are now, then verified to stream every
        outbox insert (SourceSetupError naming the fix when they do not)."""

    def unrelayed(self, recorded: object, found: PublicationStamp) -> list[Change]:
        """What changed since ``recorded`` (the record's stamp) that can have kept rows from the
        slot (:func:`cdc_relay.publication_stamp.unrelayed_changes`)."""

    def store(self) -> StartStore: ...

    def slot(self) -> SlotState | None: ...

    def create_slot(self, failover: bool) -> SlotState: ...

    def drop_slot(self) -> None:
        """Drop the (invalidated) slot: a start that accepts the gap creates it again."""

    def recover(self, record: Record, cause: Cause, failover: bool) -> SlotState:
        """Recover the lost slot (:mod:`cdc_relay.recovery`): the new slot, once the position
        record has its start."""

    def end_backend(self, pid: int) -> None: ...

    def require_usable_slot(self, slot: SlotState) -> None: ...

    def ensure_failover(self, slot: SlotState) -> None: ...

    def promotion_note(self, slot: SlotState, recorded: int | None) -> str | None: ...

    def timeline(self) -> Timeline: ...

    def timeline_start(self, timeline_id: int, since: int) -> int | None: ...

    def history_switches(self, timeline_id: int) -> list[tuple[int, int]]: ...

    def open_stream(self, start: int) -> StartedStream: ...

    def note_stream(self, pid: int) -> None:
        """Write the walsender's pid into the lease (LeadershipLost when it is no longer ours)."""

    def heartbeat(self) -> None: ...

    def retained_wal(self) -> int | None: ...

    @property
    def closed(self) -> bool: ...

    def close(self) -> None: ...


class StartLeadership(Protocol):
    """The leadership, as a start sees it."""

    @property
    def predecessor_stream_pid(self) -> int | None:
        """The walsender of the leader this one replaced (ended when it lingers on the slot)."""


@dataclass
class Started:
    """A session's start, done: where it streams from and what it streams with."""

    database: StartDatabase
    store: StartStore
    stream: StartedStream
    start: int
    offsets: Offsets | None  # acknowledged offsets recorded with the position
    noted: Offsets | None  # where partitions without one ended before their first write
    table_oids: Mapping[int, str] = field(default_factory=dict)  # outbox tables by oid


@dataclass
class Acknowledged:
    """What the previous session of this leadership had acknowledged, carried to the next."""

    position: int
    offsets: Offsets | None  # the acknowledged offset per partition at ``position``


ReadBack = Callable[[int, "Offsets | None", "Offsets | None"], "Reconciliation | None"]


class StartSequence:
    """The start of every session, and what one session hands the next."""

    def __init__(
        self,
        settings: Settings,
        stats: RelayStats,
        leadership: StartLeadership,
        *,
        connect: Callable[[], StartDatabase],
        read_back: ReadBack,
        stopping: Callable[[], bool],
        sleep: Callable[[float], object],
    ) -> None:
        self.settings = settings
        self.stats = stats
        self.leadership = leadership
        self._connect = connect
        self._read_back = read_back
        self._stopping = stopping
        self._sleep = sleep
        self.acknowledged: Acknowledged | None = None
        self._timeline: Timeline | None = None  # where the last session read its stream
        # The start-up check's connection, handed to the first session if this process leads at
        # once: that session then neither connects nor checks again.
        self._checked: StartDatabase | None = None
        self._checked_at = 0.0
        # This session resumes where the previous one of this leadership left off.
        self.resumes_carried = False
        self._table_oids: Mapping[int, str] = {}  # the outbox tables as the last start found them

    # -- before standing by --------------------------------------------------------------------

    def check_database(self) -> None:
        """The database is usable and the state tables exist (SourceUnavailable: retry)."""
        database = self._connect()
        try:
            database.require()
            database.store().ensure_table()
        except BaseException:
            database.close()
            raise
        self._checked, self._checked_at = database, time.monotonic()

    def drop_stale(self) -> None:
        """A standby keeps no idle connection: the check's, once it is no longer fresh."""
        if self._checked is not None and time.monotonic() - self._checked_at > CHECKED_FRESH:
            self.close()

    def close(self) -> None:
        database = self._take_checked()
        if database is not None:
            database.close()

    def _take_checked(self) -> StartDatabase | None:
        """The start-up check's connection while its checks are fresh, else None."""
        database, self._checked = self._checked, None
        if database is None or database.closed:
            return None
        if time.monotonic() - self._checked_at > CHECKED_FRESH:
            database.close()  # stood by meanwhile: the session connects and checks again
            return None
        return database

    # -- between sessions ----------------------------------------------------------------------

    def carry(self, position: int, offsets: Offsets) -> None:
        """A session ended: the next one starts from what it acknowledged."""
        self.acknowledged = Acknowledged(position, offsets)

    def forget(self) -> None:
        """The leadership was lost: the next leader's record is the truth now."""
        self.acknowledged = None

    @property
    def resume_position(self) -> int:
        return self.acknowledged.position if self.acknowledged is not None else 0

    # -- one session's start -------------------------------------------------------------------

    @contextmanager
    def session(self) -> Iterator[Started]:
        """Prepare, then ``START_REPLICATION``; the stream and its connection close on exit."""
        checked = self._take_checked()
        database = checked or self._connect()
        try:
            start = self.prepare(database, checked=checked is not None)
            store = database.store()
            offsets, noted = store.load_offsets()
            stream = database.open_stream(start)
            try:
                self._note_stream(database, stream)
                yield Started(database, store, stream, start, offsets, noted, self._table_oids)
            finally:
                stream.close()
        finally:
            database.close()

    def _note_stream(self, database: StartDatabase, stream: StartedStream) -> None:
        """START_REPLICATION was sent and accepted: note where, and when (the first time)."""
        self._timeline = stream.timeline
        database.note_stream(stream.backend_pid)
        if self.stats.start_replication_monotonic is None:
            instant = launch.now()
            self.stats.start_replication_monotonic = instant.monotonic
            self.stats.start_replication_after_launch_s = instant.since_launch

    def prepared(self) -> int:
        """Prepare on a connection of its own, closed after: ``cdc-relay recover``'s start."""
        database = self._connect()
        try:
            return self.prepare(database)
        finally:
            database.close()

    def prepare(self, database: StartDatabase, *, checked: bool = False) -> int:
        """Check the database, create what is missing, and decide where to start.

        ``checked``: ``database`` is the one the start-up check has just run on (the
        prerequisites and the state tables): not done twice.
        """
        settings = self.settings
        if not checked:
            database.require()
        failover = database.wants_failover()  # exit 3 for "true" on PostgreSQL < 17
        if database.ensure_publication():
            log.info(
                "created publication", extra={"fields": {"publication": settings.publication_name}}
            )
        changed = database.ensure_row_filters()  # exit 3 naming the fix when it may not
        store = database.store()
        if not checked:
            store.ensure_table()
        if changed is not None:
            log.warning(
                "set the publication's row filters as configured; rows committed before are "
                "not swept",
                extra={"fields": {"publication": settings.publication_name,
                                  "was": changed.describe()}},
            )  # fmt: skip
            store.restart_sweep_boundary()
        stamp = database.publication_stamp()  # exit 3 naming the fix when it cannot stream
        record = store.load_record()
        unrelayed = database.unrelayed(record.publication_stamp, stamp)
        store.verify(stamp)  # every write from here on proves it unchanged
        self._table_oids = stamp.table_oids()
        if unrelayed:
            gap = publication_gap(record)
            self._name_unrelayed(unrelayed, record, store.restart_sweep_boundary(gap))
            if gap is not None:
                record = store.load_record()  # with the gap's recovery planned
        recorded, reset = self._trusted_position(database, record)
        # Acknowledged under a publication that has changed since: resumed from the record.
        carried = None if unrelayed else self._carried_position(database)
        self.resumes_carried = False
        if carried is not None and (recorded is None or carried > recorded):
            # What the previous session had acknowledged but not yet recorded.
            # The offsets belong to the acknowledged position: not to one capped below it.
            acknowledged = self.acknowledged
            assert acknowledged is not None
            store.save(carried, acknowledged.offsets if carried == acknowledged.position else None)
            recorded = carried
        slot = database.slot()
        slot, recorded = self._lost_slot(database, record, slot, recorded, failover)
        if slot is None:
            warning = check_missing_slot(settings.slot_name, recorded, settings.allow_slot_reset)
            slot = database.create_slot(failover)
            log.info(
                "created replication slot",
                extra={"fields": {"slot": slot.name, "failover": failover}},
            )
            start = slot.confirmed_flush or 0
            store.save(start, new_slot=True)
            recorded = start
            reset = False
        else:
            slot = self._await_free_slot(database, slot)
            database.require_usable_slot(slot)
            database.ensure_failover(slot)
            start, warning = resolve_start(
                settings.slot_name,
                slot.confirmed_flush or 0,
                recorded,
                settings.allow_slot_reset,
                database.promotion_note(slot, recorded),
            )
        if warning:
            log.warning(warning)
        acknowledged = self.acknowledged
        self.resumes_carried = (
            carried is not None and acknowledged is not None and start == acknowledged.position
        )
        if recorded != start or reset:
            store.save(start, new_slot=reset)  # a refused record's boundary and offsets go too
        filters = recorded_form(settings.tables())
        refiltered = (
            record.row_filters is not None
            and differences(record.row_filters, settings.tables()) != []
        )
        if refiltered:
            log.warning(
                "the row filters differ from those the relay last relayed with; rows committed "
                "before are not swept",
                extra={"fields": {"was": orjson.dumps(record.row_filters).decode()[:4096]}},
            )
        store.record_row_filters(filters, refiltered)
        self.stats.confirmed_lsn = start
        return start

    def _lost_slot(
        self,
        database: StartDatabase,
        record: Record,
        slot: SlotState | None,
        recorded: int | None,
        failover: bool,
    ) -> tuple[SlotState | None, int | None]:
        """A slot dropped or invalidated after the relay used it, or a recovery not yet ended:
        refused (exit 4, naming ``cdc-relay recover``), recovered (``CDC_RELAY_ON_SLOT_LOSS=
        recover``), or — with ``CDC_RELAY_ALLOW_SLOT_RESET`` — an invalidated slot dropped, so
        that a new one is created over the gap. The slot and recorded position to go on with."""
        settings = self.settings
        plan = in_progress(record.recovery)
        adopted = self._adoption(
            database, record, plan, slot is None and recorded is None, failover
        )
        if adopted is not None:
            return adopted, adopted.confirmed_flush
        cause = slot_loss(slot, recorded)
        if cause is None and plan is not None and plan.cause is Cause.PUBLICATION:
            self._publication_gap(database, record, plan, failover)
            plan = None  # the slot streams on
        self.stats.slot_lost = cause is not None or plan is not None
        if cause is None and plan is None:
            return slot, recorded
        if settings.allow_slot_reset:
            if slot is not None and cause is not None:
                log.warning(what_happened(settings.slot_name, cause, recorded or 0, slot))
                database.drop_slot()
                return None, recorded
            return slot, recorded
        if settings.on_slot_loss is OnSlotLoss.REFUSE:
            if cause is not None:
                raise PositionMismatch(loss_refusal(settings.slot_name, cause, recorded or 0, slot))
            assert plan is not None
            raise PositionMismatch(interrupted(settings.slot_name, plan))
        if cause is not None:
            log.error(
                f"{what_happened(settings.slot_name, cause, recorded or 0, slot)}: recovering "
                f"({env_name('on_slot_loss')}=recover)"
            )
        recovered = database.recover(
            record, cause or (plan.cause if plan else Cause.DROPPED), failover
        )
        self.stats.slot_lost = False
        return recovered, recovered.confirmed_flush

    def _adoption(
        self,
        database: StartDatabase,
        record: Record,
        plan: Plan | None,
        first: bool,
        failover: bool,
    ) -> SlotState | None:
        """A first start (``first``: no slot, no record) told to adopt the table's rows, or an
        adoption not yet ended: its new slot, once done. None: nothing to adopt."""
        condition = self.settings.adopt_condition
        if plan is not None and plan.cause is Cause.ADOPTED:
            return database.recover(record, Cause.ADOPTED, failover)  # an adoption resumed
        if not first or condition is None:
            return None
        log.info(
            "adopting the outbox: publishing the rows already there that match "
            f"{env_name('adopt_condition')} before streaming",
            extra={"fields": {"condition": condition}},
        )
        return database.recover(record, Cause.ADOPTED, failover)

    def _publication_gap(
        self, database: StartDatabase, record: Record, plan: Plan, failover: bool
    ) -> None:
        """Rows a publication change may have kept from the slot, planned for recovery: published
        now (``CDC_RELAY_ON_SLOT_LOSS=recover``), or left for ``cdc-relay recover`` (the relay
        streams on meanwhile; no sweep deletes them)."""
        if self.settings.on_slot_loss is OnSlotLoss.RECOVER:
            database.recover(record, Cause.PUBLICATION, failover)
            return
        log.warning(
            "outbox rows a change of the publication may have kept from the slot are still "
            f"unpublished: run `{RECOVER}` (with the relays stopped) to publish those not in "
            f"Kafka, or start with {ON_LOSS}",
            extra={"fields": {"from_xid": plan.boundary, "to_xid": plan.below}},
        )

    def _name_unrelayed(
        self, unrelayed: list[Change], record: Record, boundary: int | None
    ) -> None:
        """The rows the slot may never have streamed, for the operator (an ERROR), now that no
        sweep deletes them (the boundary was taken afresh)."""
        message, fields = unrelayed_message(
            unrelayed,
            self.settings.tables(),
            from_xid=record.stamp_checked_xid,
            to_xid=boundary,
            since=record.updated_at,
        )
        log.error(message, extra={"fields": fields})
        self.stats.rows_in_doubt = fields

    def _trusted_position(self, database: StartDatabase, record: Record) -> tuple[int | None, bool]:
        """The recorded position, refused (PositionMismatch, exit 4, before anything streams or
        the slot is touched) when the server cannot have it (:mod:`cdc_relay.record_origin`);
        with CDC_RELAY_ALLOW_SLOT_RESET, dropped instead: (None, True), to be recorded afresh
        (a new sweep boundary, no offsets)."""
        settings = self.settings
        if record.stamp is None:
            return None, False
        reason = problem(record.stamp, record.server, database.history_switches)
        if reason is None:
            return record.stamp.position, False
        slot = database.slot()
        message = refusal(
            reason,
            settings.state_schema,
            settings.slot_name,
            slot.confirmed_flush if slot is not None else None,
        )
        if not settings.allow_slot_reset:
            raise PositionMismatch(message)
        log.warning(f"{message}; starting anyway because slot reset is allowed")
        return None, True

    def _await_free_slot(self, database: StartDatabase, slot: SlotState) -> SlotState:
        """The slot as it is once its previous leader's walsender has let go of it.

        The predecessor's walsender (its pid is in the lease) is ended; another holder gets up
        to the lease timeout to let go (a relay that lost its lock stops within a renewal), and
        is then reported by require_usable_slot (SlotInUse).
        """
        deadline = time.monotonic() + self.settings.leader_lease_timeout
        current: SlotState | None = slot
        while current is not None and current.active_pid is not None:
            if current.active_pid == self.leadership.predecessor_stream_pid:
                log.warning(
                    "ending the previous leader's walsender",
                    extra={"fields": {"pid": current.active_pid}},
                )
                database.end_backend(current.active_pid)
            if time.monotonic() >= deadline or self._stopping():
                break
            self._sleep(SLOT_RELEASE_POLL)
            current = database.slot()
        if current is None:
            raise SourceUnavailable("the replication slot disappeared while waiting for it")
        return current

    def _carried_position(self, database: StartDatabase) -> int | None:
        """The previous session's acknowledged position, as far as it holds on this server.

        A multi-host URL may have brought the relay to a promoted standby since. Its history is
        the old primary's only up to the point where its timeline began: a position beyond that
        was read from WAL this server never had, and its own transactions there must be streamed.
        """
        acknowledged = self.acknowledged
        if acknowledged is None:
            return None
        position, previous = acknowledged.position, self._timeline
        if previous is None:
            return position  # not known where it was read: nothing to ask
        current = database.timeline()
        if previous == current:
            return position
        if previous[0] != current[0]:
            log.warning("the database URL now leads to another cluster: not carrying the position")
            return None
        switch = database.timeline_start(current[1], previous[1])
        if switch is not None and position > switch:
            log.warning(
                "the server was promoted before the relay's last position: resuming from the "
                "promotion point",
                extra={
                    "fields": {
                        "acknowledged": format_lsn(position),
                        "promoted_at": format_lsn(switch),
                    }
                },
            )
            return switch
        return position

    # -- while the server decodes its way to the start -----------------------------------------

    def read_back(
        self, started: Started, meanwhile: Callable[[], None]
    ) -> tuple[Reconciliation | None, Offsets | None]:
        """What an earlier incarnation already delivered after the start (None: not asked to),
        read on a thread of its own while ``meanwhile`` runs here; and the partitions' notes,
        moved on where the read found nothing of ours."""
        from cdc_relay.topics import in_background, wait_serving  # noqa: PLC0415 - late, see README

        reading = in_background(
            self._read_back, started.start, started.offsets, started.noted, name="reconcile"
        )
        meanwhile()
        reconciliation = wait_serving(reading, Keepalive(started.stream, started.start))
        noted = started.noted
        if reconciliation is not None and noted and reconciliation.renoted:
            noted = {**noted, **reconciliation.renoted}
            started.store.note_written_from(noted)
        return reconciliation, noted


class Keepalive:
    """While the session waits for the read-back, the walsender still hears from the relay: a
    status update at the start position (recorded already) every second, so that a slow
    read-back (up to CDC_RELAY_RECONCILE_TIMEOUT) never trips wal_sender_timeout."""

    def __init__(self, stream: StartedStream, start: int) -> None:
        self._stream = stream
        self._start = start
        self._next = time.monotonic() + KEEPALIVE_INTERVAL

    def __call__(self) -> None:
        now = time.monotonic()
        if now >= self._next:
            self._next = now + KEEPALIVE_INTERVAL
            self._stream.send_status(self._start, self._start)
