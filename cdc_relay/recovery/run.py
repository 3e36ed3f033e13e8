"""One recovery, from a lost slot to a new one the relay streams from: the steps, in order.

1. The plan is written first (``creating``), so that a slot created by a run that dies before it
   recorded the slot's snapshot is known for the recovery's own, dropped and created again.
2. The lost slot is dropped; the new one is created with an exported snapshot
   (:mod:`cdc_relay.replication.exported_slot`), imported at once by a reading connection
   (``REPEATABLE READ``, ``SET TRANSACTION SNAPSHOT``); its start and snapshot go into the plan
   (``publishing``), with the number of rows owed.
3. Kafka is read back (:mod:`cdc_relay.recovery.kafka_check`): the earlier records of rows in
   doubt, and the records of an interrupted run.
4. The rows owed are read in order (:mod:`cdc_relay.recovery.rows`) and published
   (:mod:`cdc_relay.recovery.publishing`), progress written as Kafka acknowledges.
5. The end is recorded (:mod:`cdc_relay.recovery.record`): the relay streams from the new slot.

A run started again with the plan ``publishing`` and its slot there reads the same rows without
the exported snapshot: those the plan's snapshot sees (:class:`~cdc_relay.recovery.rows.Scope`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from cdc_relay.checkpoint import Record
from cdc_relay.config import Settings
from cdc_relay.errors import PositionMismatch, RelayError, SourceUnavailable
from cdc_relay.lsn import format_lsn
from cdc_relay.observability.stats import RelayStats
from cdc_relay.postgres_errors import During, mapped
from cdc_relay.reconcile import read_starts
from cdc_relay.recovery.horizon import Snapshot
from cdc_relay.recovery.kafka_check import Earlier, Own, RecoveryCheck, read_back, starts_for
from cdc_relay.recovery.loss import in_progress, slot_loss
from cdc_relay.recovery.plan import Cause, Plan, State
from cdc_relay.recovery.record import RecoveryRecord
from cdc_relay.recovery.rows import (
    Scope,
    Source,
    commit_timestamps,
    count_rows,
    filenodes,
    relation_of,
)
from cdc_relay.replication.exported_slot import SlotWithSnapshot
from cdc_relay.replication.source import connect, drop_slot, slot_state
from cdc_relay.row_filter import parse as parse_condition
from cdc_relay.waits import SLOT_MEANS, START_MEANS, WaitWatch, Watched, unwatched

log = logging.getLogger(__name__)

READ_BACK_TIMEOUT = 600.0  # seconds the read-back may take; then rows in doubt are sent again
LOG_INTERVAL = 10.0  # seconds between progress lines
RECOVERY_MEANS = "the recovery reads the outbox table: nothing is published until it can"

Connection = psycopg.Connection[Any]


class RecoveryStopped(SourceUnavailable):
    """A stop was requested during a recovery: it ended cleanly, and resumes at the next start."""


@dataclass(frozen=True)
class Owed:
    """What a run publishes: the plan's rows, their tables and scope."""

    plan: Plan
    sources: list[Source]
    scope: Scope


@dataclass(frozen=True)
class InKafka:
    """What the read-back found: the earlier records' ids, the run's own records, and where in
    each partition the read began."""

    earlier: Earlier
    own: Own
    starts: dict[tuple[str, int], int]


class Recovery:
    """A recovery of ``settings``' slot, on ``conn`` (autocommit: the plan's writes) and a
    reading connection of its own; ``holder`` fences every write by the leader lease."""

    def __init__(
        self,
        settings: Settings,
        conn: Connection,
        *,
        holder: str | None,
        stats: RelayStats,
        stopping: Callable[[], bool],
        require_leading: Callable[[], None],
        on_progress: Callable[[Plan], None] = lambda plan: None,
        waits: WaitWatch | None = None,
        watched: Watched = unwatched,
    ) -> None:
        self.settings = settings
        self.conn = conn
        self.waits = waits
        self.watched = watched
        self.stats = stats
        self.stopping = stopping
        self.require_leading = require_leading
        self.on_progress = on_progress
        self.record = RecoveryRecord(
            conn, settings.state_schema, settings.slot_name, holder, watched
        )
        self._failure: RelayError | None = None
        self._logged_at = time.monotonic()

    # -- the steps -----------------------------------------------------------------------------

    def run(self, record: Record, cause: Cause, failover: bool) -> Plan:
        """Recover; the plan as it ended (its new slot's start is the recorded position, but for
        a publication gap, which publishes beside the slot there)."""
        plan = in_progress(record.recovery)
        gap = plan if plan is not None and not plan.replaces_slot else None
        if gap is not None and cause is Cause.PUBLICATION:
            reader = self._reader(None)
            try:
                return self._publish(reader, gap)
            finally:
                reader.close()
        if gap is not None:
            plan = None  # the slot is lost too: its recovery covers the gap's rows (_plan)
        if plan is not None and plan.state is State.PUBLISHING:
            found = slot_state(self.conn, self.settings.slot_name)
            if (
                found is None
                or found.confirmed_flush != plan.slot_lsn
                or slot_loss(found, plan.slot_lsn)
            ):
                log.warning(
                    "the slot of the interrupted recovery is not as it left it: recovering again "
                    "with a new one",
                    extra={"fields": {"slot_lsn": format_lsn(plan.slot_lsn)}},
                )
                plan = None
        if plan is None:
            plan = self._plan(record, cause, gap)
        self._report(plan)
        if plan.state is State.CREATING:
            if plan.cause is Cause.ADOPTED:
                self.record.begin(plan)  # the first start: no record yet
            else:
                self.record.write(plan)
            self._drop_slot()
            with SlotWithSnapshot(
                self.settings.source_url(),
                self.settings.slot_name,
                self.settings.plugin.value,
                failover,
                stopping=self.stopping,
                watching=self._watching_creation,
            ) as created:
                reader = self._reader(created.snapshot_name)
            plan = plan.progressed(state=State.PUBLISHING, slot_lsn=created.consistent_point)
            log.info(
                "created the new replication slot with a snapshot of its start",
                extra={"fields": {"slot": created.name, "start": format_lsn(plan.slot_lsn)}},
            )
        else:
            reader = self._reader(None)
        try:
            return self._publish(reader, plan)
        finally:
            reader.close()

    def _plan(self, record: Record, cause: Cause, gap: Plan | None = None) -> Plan:
        if cause is Cause.ADOPTED:
            # Every row of the table is the relay's to judge: the condition says which are owed.
            return Plan(
                cause=cause,
                state=State.CREATING,
                boundary=0,
                lost_at=0,
                horizon=None,
                condition=self.settings.adopt_condition,
            )
        if record.stamp is None:
            raise PositionMismatch("there is no recorded position to recover from")
        if record.sweep_from_xid is None:
            raise PositionMismatch(
                "the position record has no sweep boundary (a relay of this version records "
                "it): which rows predate the slot is not known, so none can be recovered"
            )
        horizon = record.horizon
        if horizon is not None and horizon.boundary != record.sweep_from_xid:
            horizon = None
        boundary = record.sweep_from_xid
        if gap is not None and gap.boundary < boundary:
            # A publication gap not yet recovered lies below the boundary taken after it.
            boundary, horizon = gap.boundary, gap.horizon
        return Plan(
            cause=cause,
            state=State.CREATING,
            boundary=boundary,
            lost_at=record.stamp.position,
            horizon=horizon,
        )

    def _watching_creation(self, conn: Connection) -> AbstractContextManager[None]:
        if self.waits is None:
            return nullcontext()
        what = f"creating replication slot {self.settings.slot_name} with a snapshot"
        return self.waits.watching(conn, what, SLOT_MEANS)

    def _drop_slot(self) -> None:
        slot = slot_state(self.conn, self.settings.slot_name)
        if slot is None:
            return
        log.warning(
            "dropping the replication slot to create it again",
            extra={"fields": {"slot": slot.name, "wal_status": slot.wal_status}},
        )
        with self.watched("dropping the lost replication slot", START_MEANS):
            drop_slot(self.conn, slot.name)

    def _reader(self, snapshot_name: str | None) -> Connection:
        """A connection in a ``REPEATABLE READ`` transaction: in the exported snapshot, if named."""
        reader = connect(self.settings.source_url())
        try:
            with mapped(During.STATEMENT, "cannot read in the slot's snapshot"):
                reader.execute("SET application_name = 'cdc-relay recovery'")
                reader.execute("SET client_encoding = 'UTF8'")  # as the replication connection
                reader.autocommit = False
                reader.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
                reader.read_only = True
                # The transaction's first statement: it reads in the slot's snapshot from here.
                reader.execute(
                    sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot_name))
                    if snapshot_name is not None
                    else sql.SQL("SELECT 1")
                )
        except BaseException:
            reader.close()
            raise
        return reader

    def _publish(self, reader: Connection, plan: Plan) -> Plan:
        with (
            mapped(During.STATEMENT, "cannot read the outbox"),
            self.reading(reader, "counting the outbox rows owed"),
        ):
            if plan.snapshot is None:  # in the exported snapshot: note it, and what is owed
                row = reader.execute("SELECT pg_current_snapshot()::text").fetchone()
                snapshot = Snapshot.parse(str(row[0]) if row else None)
                assert snapshot is not None
                ordered = commit_timestamps(reader)
                plan = plan.progressed(
                    snapshot=snapshot, commit_order="commit_timestamp" if ordered else "xid"
                )
                scope = self._scope(plan, in_snapshot=True)
                sources = self._sources(reader)
                plan = plan.progressed(
                    rows=count_rows(reader, sources, scope), filenodes=filenodes(reader, sources)
                )
                self.record.write(plan)
            else:
                scope = self._scope(plan, in_snapshot=False)
                sources = self._sources(reader)
                plan = self._recounted(
                    plan, count_rows(reader, sources, scope), filenodes(reader, sources)
                )
        log.info(
            "recovering the outbox rows the relay has not provably published",
            extra={
                "fields": {
                    "rows": plan.rows,
                    "done_before": plan.done,
                    "commit_order": plan.commit_order,
                    "proven_below_xid": scope.proven_below,
                }
            },
        )
        from cdc_relay.recovery.sending import send  # noqa: PLC0415 - Kafka's client: late

        return send(self, reader, Owed(plan, sources, scope))

    def _recounted(self, plan: Plan, rows: int, nodes: dict[str, int]) -> Plan:
        """A run without the exported snapshot counts the rows again: a publication gap's first
        run takes the count; a count that fell since (rows owed deleted: by hand, or by a
        sweeper that does not know the plan), or a table rewritten (its rows' places, which break
        ties in the order, may have moved), means the ordinals moved: the run forgets its
        progress and finds its own records by id alone."""
        if not plan.replaces_slot and plan.rows == 0 and plan.done == 0:
            plan = plan.progressed(rows=rows, filenodes=nodes)
            self.record.write(plan)
        elif rows != plan.rows or (plan.filenodes and nodes != plan.filenodes):
            log.warning(
                "outbox rows the recovery owed were deleted, or their table rewritten, since it "
                "began: it finds the records it sent by their event id, and sends the rest (the "
                "deleted rows' events it had not sent are lost)",
                extra={"fields": {"rows_then": plan.rows, "rows_now": rows}},
            )
            plan = plan.progressed(rows=rows, done=0, offsets={}, moved=True, filenodes=nodes)
            self.record.write(plan)
        return plan

    def reading(self, reader: Connection, what: str) -> AbstractContextManager[None]:
        """The reading connection's statements, named while they wait (a lock on the outbox
        table: an ALTER TABLE waiting behind the recovery's own share lock is not one)."""
        if self.waits is None:
            return nullcontext()
        return self.waits.watching(reader, what, RECOVERY_MEANS)

    def _scope(self, plan: Plan, *, in_snapshot: bool) -> Scope:
        horizon = plan.horizon
        return Scope(
            boundary=plan.boundary,
            proven_below=None if horizon is None else horizon.snapshot.xmin,
            snapshot=None if in_snapshot else plan.snapshot,
            commit_timestamps=plan.commit_order == "commit_timestamp",
            condition=None if plan.condition is None else parse_condition(plan.condition),
            below=plan.below,
        )

    def _sources(self, reader: Connection) -> list[Source]:
        settings = self.settings
        return [
            Source(table, relation_of(reader, table, settings.publication_name))
            for table in settings.tables()
        ]

    def read_back(self, plan: Plan) -> InKafka:
        """The earlier records of rows in doubt, and this plan's own (see kafka_check); with
        exactly once, read after the fence (``read_committed``), as a start's read-back is."""
        from cdc_relay.publisher import admin_config  # noqa: PLC0415 - Kafka's client: late

        settings = self.settings
        horizon = plan.horizon
        adopting = plan.cause is Cause.ADOPTED  # nothing of this slot was published before
        recorded = set() if adopting else self._recorded_partitions()
        earlier_starts = None if horizon is None else read_starts(horizon.offsets, horizon.noted)
        own_starts = read_starts(plan.offsets, plan.noted)
        everything = recorded | set(own_starts) | set(earlier_starts or {})
        starts = starts_for(earlier_starts, own_starts, everything)
        earlier, own = Earlier(), Own(plan.rows)
        check = RecoveryCheck(settings.slot_name, plan.record_lsn, starts, earlier, own)
        started = time.monotonic()
        error = read_back(
            admin_config(settings.producer_config()),
            check,
            READ_BACK_TIMEOUT,
            self.alive,
            committed_only=settings.exactly_once,
        )
        if self.stopping():
            raise RecoveryStopped("a stop was requested during the recovery's read-back")
        if horizon is None and plan.rows and not adopting:
            earlier.give_up(
                "the position record proves nothing published (no horizon of this sweep "
                "boundary: the relay that wrote it predates it, or its boundary was taken anew)"
            )
        fields: dict[str, object] = {
            "partitions": len(starts),
            "records_read": check.records_read,
            "earlier_ids": len(earlier.counts),
            "own_found": own.found,
            "seconds": round(time.monotonic() - started, 3),
        }
        if earlier.doubt is not None:
            log.warning(
                "rows in doubt are published again: none of them is taken for published",
                extra={"fields": {**fields, "reason": earlier.doubt, "error": error}},
            )
        else:
            log.info("read back what is in Kafka already", extra={"fields": fields})
        return InKafka(earlier, own, starts)

    def _recorded_partitions(self) -> set[tuple[str, int]]:
        """Partitions the record says hold this slot's records (offsets, notes)."""
        from cdc_relay.checkpoint import PostgresCheckpointStore  # noqa: PLC0415

        store = PostgresCheckpointStore(
            self.conn, self.settings.state_schema, self.settings.slot_name
        )
        offsets, noted = store.load_offsets()
        return set(offsets or {}) | set(noted or {})

    # -- reporting -----------------------------------------------------------------------------

    def alive(self) -> bool:
        """The recovery goes on (a liveness probe must not take it for a stuck relay: /healthz);
        whether a stop was requested."""
        self.stats.last_loop = time.monotonic()
        return self.stopping()

    def progressed(self, plan: Plan) -> None:
        """``plan``'s progress, written (fenced by the lease), shown and, now and then, logged."""
        self.record.write(plan)
        self._report(plan)

    def _report(self, plan: Plan) -> None:
        self.on_progress(plan)
        now = time.monotonic()
        if now - self._logged_at >= LOG_INTERVAL:
            self._logged_at = now
            log.info("recovering", extra={"fields": plan.summary()})

    def fail(self, error: RelayError) -> None:
        """The poison policy ``stop`` met a row: the recovery stops without finishing."""
        self._failure = error

    @property
    def failure(self) -> RelayError | None:
        return self._failure
