"""The real collaborators of the start sequence: PostgreSQL (:class:`PostgresStart`) and the
read-back from Kafka (:func:`kafka_read_back`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from cdc_relay.checkpoint import PostgresCheckpointStore, Record
from cdc_relay.config import Settings
from cdc_relay.decode import plugin_options_for
from cdc_relay.errors import SourceUnavailable
from cdc_relay.leadership import Leadership, require_lease, terminate_backend
from cdc_relay.observability.stats import RelayStats
from cdc_relay.prerequisites import require, require_usable_slot
from cdc_relay.publication_filter import FilterMismatch
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
        stats: RelayStats | None = None,
        stopping: Callable[[], bool] = lambda: False,
    ) -> None:
        self._settings = settings
        self._leadership = leadership
        self._stats = stats or RelayStats()
        self._stopping = stopping
        self._url = settings.source_url()
        self._conn = connect(self._url)
        self._source = SourceDatabase(
            self._conn,
            settings.tables(),
            settings.publication_name,
            settings.slot_name,
            settings.plugin.value,
        )
        self._heartbeats = Heartbeats(self._conn)

    def require(self) -> None:
        require(self._conn, self._settings)

    def wants_failover(self) -> bool:
        return wants_failover(self._conn, self._settings)

    def ensure_publication(self) -> bool:
        return self._source.ensure_publication()

    def ensure_row_filters(self) -> FilterMismatch | None:
        return self._source.ensure_row_filters()

    def store(self) -> PostgresCheckpointStore:
        """The position record, written only while this process holds the leader lease."""
        settings = self._settings
        return PostgresCheckpointStore(
            self._conn, settings.state_schema, settings.slot_name, holder=self._leadership.holder
        )

    def slot(self) -> SlotState | None:
        return slot_state(self._conn, self._settings.slot_name)

    def create_slot(self, failover: bool) -> SlotState:
        return self._source.create_slot(failover)

    def drop_slot(self) -> None:
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
            stopping=self._stopping,
            require_leading=lambda: require_lease(leadership.leading, "the recovery stops"),
            on_progress=shown,
        ).run(record, cause, failover)
        slot = self.slot()
        if slot is None:
            raise SourceUnavailable("the recovered slot disappeared")
        return slot

    def end_backend(self, pid: int) -> None:
        terminate_backend(self._conn, pid)

    def require_usable_slot(self, slot: SlotState) -> None:
        require_usable_slot(self._conn, self._settings, slot)

    def ensure_failover(self, slot: SlotState) -> None:
        ensure_failover(self._conn, self._settings, slot)

    def promotion_note(self, slot: SlotState, recorded: int | None) -> str | None:
        return promotion_note(self._conn, self._settings, slot, recorded)

    def timeline(self) -> Timeline:
        return timeline(self._url)

    def timeline_start(self, timeline_id: int, since: int) -> int | None:
        return timeline_start(self._url, timeline_id, since=since)

    def history_switches(self, timeline_id: int) -> list[tuple[int, int]]:
        return history_switches(timeline_history(self._url, timeline_id))

    def open_stream(self, start: int) -> ReplicationStream:
        settings = self._settings
        stream = ReplicationStream(
            self._url,
            settings.slot_name,
            start,
            plugin_options_for(settings),
            coalesce=settings.read_coalesce_ms / 1000,
        )
        stream.open()
        return stream

    def note_stream(self, pid: int) -> None:
        self._leadership.record_stream(self._conn, pid)

    def heartbeat(self) -> None:
        self._heartbeats()

    def retained_wal(self) -> int | None:
        return retained_wal(self._conn, self._settings.slot_name)

    @property
    def closed(self) -> bool:
        return self._conn.closed

    def close(self) -> None:
        self._conn.close()
