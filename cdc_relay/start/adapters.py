"""The real collaborators of the start sequence: PostgreSQL (:class:`PostgresStart`) and the
read-back from Kafka (:func:`kafka_read_back`).

Every statement :class:`PostgresStart` runs is watched (:mod:`cdc_relay.waits`): its connection has
a ``lock_timeout`` (:func:`~cdc_relay.waits.write_lock_timeout`), a wait is named within a second,
a stop cancels it, and a server that does not answer at all is given up on. Creating the slot is
the exception that waits as long as it must — named, and cancelled by a stop.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from cdc_relay.checkpoint import PostgresCheckpointStore, Record
from cdc_relay.config import Settings
from cdc_relay.decode import plugin_options_for
from cdc_relay.errors import SourceUnavailable
from cdc_relay.leadership import Leadership, require_lease, terminate_backend
from cdc_relay.observability.stats import RelayStats
from cdc_relay.prerequisites import require, require_usable_slot, verified_stamp
from cdc_relay.publication_filter import FilterMismatch
from cdc_relay.publication_stamp import Change, PublicationStamp, parse, unrelayed_changes
from cdc_relay.record_origin import history_switches
from cdc_relay.recovery.plan import Cause, Plan
from cdc_relay.replication.failover import ensure_failover, promotion_note, wants_failover
from cdc_relay.replication.source import (
    Heartbeats,
    SlotState,
    SourceDatabase,
    connect,
    drop_slot,
    retained_wal,
    slot_state,
)
from cdc_relay.replication.stream import (
    ReplicationStream,
    timeline,
    timeline_history,
    timeline_start,
)
from cdc_relay.start.sequence import ReadBack, Timeline
from cdc_relay.waits import (
    ANSWER_MARGIN,
    NOTICE_AFTER,
    PUBLICATION_MEANS,
    SLOT_MEANS,
    START_MEANS,
    WaitWatch,
    lock_timeout_statement,
    write_lock_timeout,
)

if TYPE_CHECKING:
    from cdc_relay.reconcile import Offsets, Reconciliation


def kafka_read_back(settings: Settings, stopping: Callable[[], bool]) -> ReadBack:
    """The read-back from Kafka (:mod:`cdc_relay.reconcile`), or None when it is turned off."""

    def read_back(
        start: int, offsets: Offsets | None, noted: Offsets | None
    ) -> Reconciliation | None:
        if not settings.reconcile:
            return None
        from cdc_relay.publisher import admin_config  # noqa: PLC0415
        from cdc_relay.reconcile import reconcile_with_kafka  # noqa: PLC0415

        # The previous incarnation is gone (killed, or this process's purged producer): what it
        # delivered after ``start`` is all in Kafka now.
        return reconcile_with_kafka(
            admin_config(settings.producer_config()),
            settings.slot_name,
            start,
            offsets=offsets,
            noted=noted,
            timeout=settings.reconcile_timeout,
            stopping=stopping,  # a stop does not wait for the read
            # Exactly once: after the fence, what committed (an aborted copy is sent again).
            committed_only=settings.exactly_once,
        )

    return read_back


class PostgresStart:
    """:class:`StartDatabase` on one psycopg connection (and the replication protocol's own)."""

    def __init__(
        self,
        settings: Settings,
        leadership: Leadership,
        waits: WaitWatch,
        stats: RelayStats | None = None,
    ) -> None:
        self._settings = settings
        self._leadership = leadership
        self._stats = stats or RelayStats()
        self._url = settings.source_url()
        self._waits = waits
        self._conn = connect(self._url)
        lock_timeout = write_lock_timeout(settings.leader_lease_timeout)
        # A statement here that waits on no lock yet is not answered within this long: the
        # server is taken for one that does not answer, and the statement is given up on.
        self._deadline = lock_timeout + ANSWER_MARGIN
        # Named well before its lock timeout ends it: the blocker is then still there to name.
        self._watched = waits.for_connection(
            self._conn, self._deadline, min(NOTICE_AFTER, lock_timeout / 2)
        )
        with self._watch("setting the start's lock timeout"):
            self._conn.execute(lock_timeout_statement(lock_timeout))
        self._source = SourceDatabase(
            self._conn,
            settings.tables(),
            settings.publication_name,
            settings.slot_name,
            settings.plugin.value,
        )
        self._heartbeats = Heartbeats(self._conn)
        # One store: once verified (see StartSequence.prepare) its writes check the publication.
        self._store = PostgresCheckpointStore(
            self._conn,
            settings.state_schema,
            settings.slot_name,
            holder=leadership.holder,
            watched=self._watched,
        )

    def _watch(self, what: str, means: str = START_MEANS) -> AbstractContextManager[None]:
        return self._watched(what, means)

    def require(self) -> None:
        with self._watch("checking the prerequisites"):
            require(self._conn, self._settings)

    def wants_failover(self) -> bool:
        with self._watch("reading the server's failover settings"):
            return wants_failover(self._conn, self._settings)

    def ensure_publication(self) -> bool:
        with self._watch("creating the publication", PUBLICATION_MEANS):
            return self._source.ensure_publication()

    def ensure_row_filters(self) -> FilterMismatch | None:
        with self._watch("setting the publication's row filters", PUBLICATION_MEANS):
            return self._source.ensure_row_filters()

    def publication_stamp(self) -> PublicationStamp:
        with self._watch("reading and verifying the publication"):
            return verified_stamp(self._conn, self._settings)

    def unrelayed(self, recorded: object, found: PublicationStamp) -> list[Change]:
        with self._watch("comparing the publication with the recorded one"):
            return unrelayed_changes(self._conn, parse(recorded), found)

    def store(self) -> PostgresCheckpointStore:
        """The position record, written only while this process holds the leader lease."""
        return self._store

    def slot(self) -> SlotState | None:
        with self._watch("reading the replication slot"):
            return slot_state(self._conn, self._settings.slot_name)

    def create_slot(self, failover: bool) -> SlotState:
        """On a connection of its own, without the lock timeout: the slot's creation waits for
        the transactions running when it begins, and a retry would wait for those running then
        (with a steady flow of overlapping transactions, for ever)."""
        settings = self._settings
        conn = connect(self._url)
        try:
            source = SourceDatabase(
                conn,
                settings.tables(),
                settings.publication_name,
                settings.slot_name,
                settings.plugin.value,
            )
            with self._waits.watching(
                conn, f"creating replication slot {settings.slot_name}", SLOT_MEANS
            ):
                return source.create_slot(failover)
        finally:
            conn.close()

    def drop_slot(self) -> None:
        with self._watch("dropping the invalidated replication slot"):
            drop_slot(self._conn, self._settings.slot_name)

    def recover(self, record: Record, cause: Cause, failover: bool) -> SlotState:
        from cdc_relay.recovery.run import Recovery  # noqa: PLC0415 - only after a loss

        leadership = self._leadership
        stats = self._stats

        def shown(plan: Plan) -> None:
            stats.recovery = plan.summary()

        Recovery(
            self._settings,
            self._conn,
            holder=leadership.holder,
            stats=stats,
            stopping=self._waits.stop_requested,
            require_leading=lambda: require_lease(leadership.leading, "the recovery stops"),
            on_progress=shown,
            waits=self._waits,
            watched=self._watched,
        ).run(record, cause, failover)
        slot = self.slot()
        if slot is None:
            raise SourceUnavailable("the recovered slot disappeared")
        return slot

    def end_backend(self, pid: int) -> None:
        with self._watch("ending the previous leader's walsender"):
            terminate_backend(self._conn, pid)

    def require_usable_slot(self, slot: SlotState) -> None:
        with self._watch("checking the replication slot"):
            require_usable_slot(self._conn, self._settings, slot)

    def ensure_failover(self, slot: SlotState) -> None:
        with self._watch("checking the slot's failover"):
            ensure_failover(self._conn, self._settings, slot)

    def promotion_note(self, slot: SlotState, recorded: int | None) -> str | None:
        with self._watch("reading the server's promotion"):
            return promotion_note(self._conn, self._settings, slot, recorded)

    def timeline(self) -> Timeline:
        return timeline(self._url, self._deadline)

    def timeline_start(self, timeline_id: int, since: int) -> int | None:
        return timeline_start(self._url, timeline_id, since=since, answer_timeout=self._deadline)

    def history_switches(self, timeline_id: int) -> list[tuple[int, int]]:
        return history_switches(timeline_history(self._url, timeline_id, self._deadline))

    def open_stream(self, start: int) -> ReplicationStream:
        settings = self._settings
        stream = ReplicationStream(
            self._url,
            settings.slot_name,
            start,
            plugin_options_for(settings),
            coalesce=settings.read_coalesce_ms / 1000,
            stopping=self._waits.stop_requested,
            answer_timeout=self._deadline,
        )
        stream.open()
        return stream

    def note_stream(self, pid: int) -> None:
        with self._watch("writing the walsender's pid into the leader lease"):
            self._leadership.record_stream(self._conn, pid)

    def heartbeat(self) -> None:
        with self._watch("emitting a heartbeat"):
            self._heartbeats()

    def retained_wal(self) -> int | None:
        with self._watch("reading the slot's retained WAL"):
            return retained_wal(self._conn, self._settings.slot_name)

    @property
    def closed(self) -> bool:
        return self._conn.closed

    def close(self) -> None:
        self._conn.close()
