"""Publishing a recovery's rows exactly as the stream publishes: the same parts, another loop.

A row becomes its record by the table's outbox mapping (:mod:`cdc_relay.shaped_mapping`, built from
the relation :mod:`cdc_relay.recovery.rows` reads from the catalog); a row that breaks the contract,
or a record Kafka refuses for good, goes the poison policy's way (:mod:`cdc_relay.poison`: the
dead-letter topic, or a stop); topics are checked and created by the relay's rules
(:mod:`cdc_relay.topics`); publishing exactly once, records go in Kafka transactions
(:mod:`cdc_relay.kafka_transaction`). Every record carries the ``id`` header and a position header
of its own: the plan's LSN and the row's ordinal (:meth:`cdc_relay.recovery.plan.Plan.record_lsn`).

Rows go in *batches* of :data:`BATCH_ROWS`, each a :class:`~cdc_relay.watermark.PendingTransaction`
whose "LSN" is its last ordinal: the watermark (:mod:`cdc_relay.watermark`) then says up to which
ordinal Kafka acknowledged every record (a skipped row counts as acknowledged), and the offsets
there — the plan's progress, written every :data:`PROGRESS_INTERVAL`. Before its first record to
a topic, where each partition of it ends is noted in the plan (:data:`Noting`): a recovery started
again reads its own records back from there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from types import MethodType
from typing import Protocol

from cdc_relay.config import Settings
from cdc_relay.errors import LeadershipLost, RelayError, SinkUnavailable, StopSession
from cdc_relay.kafka_transaction import KafkaTransaction, Resend, transactional
from cdc_relay.logs import cut
from cdc_relay.observability.stats import RelayStats
from cdc_relay.outbox import OutboxMapping, RecordFields
from cdc_relay.poison import PoisonPolicyHandler, RefusedRecord
from cdc_relay.publisher import DeliveryTracker, ProduceRefused, Publisher
from cdc_relay.reconcile import POSITION_HEADER, Offsets
from cdc_relay.recovery.rows import Row, Source
from cdc_relay.shaped_mapping import outbox_mapping
from cdc_relay.topics import TopicRules
from cdc_relay.transaction_errors import Outcome, outcome
from cdc_relay.value_text import MalformedEvent
from cdc_relay.watermark import PendingTransaction, Watermark

log = logging.getLogger(__name__)

BATCH_ROWS = 1000  # rows per batch: the unit of progress
PROGRESS_INTERVAL = 1.0  # seconds between writes of the plan's progress
POLL_EVERY = 256  # rows between serving the producer's delivery reports
DRAIN_POLL = 0.05


class Noting(Protocol):
    """Where the plan keeps the partitions' ends before its first record to them."""

    def __call__(self, noted: Offsets) -> None: ...


class RecoveryPublisher:
    """One run's publishing: rows in, records out, the acknowledged ordinal and offsets known."""

    def __init__(
        self,
        settings: Settings,
        stats: RelayStats,
        sink: Publisher,
        topic_rules: TopicRules,
        *,
        prefix: bytes,
        done: int,
        offsets: Offsets,
        noted: Offsets,
        note: Noting,
        progress: Callable[[int, Offsets], None],
        fail: Callable[[RelayError], None],
        require_leading: Callable[[], None],
        stopping: Callable[[], bool],  # also says the recovery is alive (Recovery.alive)
    ) -> None:
        self.settings = settings
        self.stats = stats
        self.sink = sink
        self.topic_rules = topic_rules
        self.prefix = prefix
        self.tracker = DeliveryTracker(stats)
        self.watermark = Watermark(done, offsets)
        self.noted: Offsets = dict(noted)
        self._note = note
        self._progress = progress
        self._require_leading = require_leading
        self._stopping = stopping
        self._progressed_at = time.monotonic()
        self._recorded = done
        self.window: KafkaTransaction | None = transactional(
            settings, sink, Resend(), self.serve, self.tracker
        )
        self.poison = PoisonPolicyHandler(
            settings,
            sink,
            self.tracker,
            ensure_topic=lambda topic: self.ensure_topic(topic, event=False),
            fail=fail,
            wait_for_room=self.wait_for_room,
        )
        self.known_topics: set[str] = set()
        self.mappings: dict[int, OutboxMapping] = {}
        self.batch: PendingTransaction | None = None
        self.last_ordinal = done
        self.published = 0
        self.since_poll = 0

    # -- rows ----------------------------------------------------------------------------------

    def mapping(self, source: Source) -> OutboxMapping:
        relation = source.relation
        mapping = self.mappings.get(relation.relation_id)
        if mapping is None:
            table = source.table
            mapping = outbox_mapping(
                relation,
                table.topic_template or self.settings.topic_template,
                self.settings.traceparent_column,
                table.columns,
            )
            self.mappings[relation.relation_id] = mapping
        return mapping

    def position(self, ordinal: int) -> bytes:
        return b"%b%d" % (self.prefix, ordinal)

    def skip(self, row: Row) -> None:
        """A row already in Kafka: nothing is sent, and its ordinal counts as acknowledged."""
        self._batch(row.ordinal)
        self._rows_passed()

    def publish(self, row: Row, mapping: OutboxMapping, record: RecordFields) -> None:
        """Send ``record`` (``mapping.map_fields(row.values)``), or dead-letter what cannot go."""
        txn = self._batch(row.ordinal)
        topic, key, value, headers, _event_id, _traceparent = record
        headers.append((POSITION_HEADER, self.position(row.ordinal)))
        table = mapping.table
        if topic not in self.known_topics:
            try:
                self.ensure_topic(topic)
            except ProduceRefused as missing:
                self.poison.refuse(RefusedRecord.of_record(txn, table, record, missing))
                self._rows_passed()
                return
        on_delivery = MethodType(self.tracker.on_delivery, (txn, table, topic, headers))
        while True:
            try:
                self.sink.produce(topic, value, key, headers, on_delivery)
            except BufferError:
                self.wait_for_room()
                continue
            except ProduceRefused as refused:
                if not refused.permanent:
                    raise SinkUnavailable(f"producing failed: {refused.reason}") from None
                self.poison.refuse(RefusedRecord.of_record(txn, table, record, refused))
                self._rows_passed()
                return
            break
        txn.produced()
        self.published += 1
        self._rows_passed()

    def refuse(self, row: Row, mapping: OutboxMapping, reason: str, event_id: str | None) -> None:
        """A row that breaks the outbox contract: dead-lettered as it is (or a stop)."""
        txn = self._batch(row.ordinal)
        self.poison.refuse(
            RefusedRecord.malformed(
                txn, mapping, row.values, reason, event_id=event_id,
                position=self.position(row.ordinal),
            )
        )  # fmt: skip
        self._rows_passed()

    def map(self, row: Row) -> tuple[OutboxMapping, RecordFields | None, str | None, str | None]:
        """The row's mapping and record, or why it cannot be mapped (and its event id)."""
        mapping = self.mapping(row.source)
        try:
            record = mapping.map_fields(row.values)
        except MalformedEvent as malformed:
            return mapping, None, str(malformed), malformed.event_id
        except Exception as exc:  # whatever a hostile row provokes, it refuses only that row
            reason = f"the row cannot be mapped: {type(exc).__name__}: {cut(str(exc))}"
            return mapping, None, reason, None
        return mapping, record, None, record[4]

    # -- batches, topics, progress -------------------------------------------------------------

    def _batch(self, ordinal: int) -> PendingTransaction:
        """The batch ``ordinal`` belongs to (the previous one sealed when it is full)."""
        if ordinal <= self.last_ordinal:
            raise AssertionError("rows come in order, each once")
        txn = self.batch
        if txn is not None and ordinal - txn.commit_lsn >= BATCH_ROWS:
            self._seal()
            txn = None
        if txn is None:
            txn = self.watermark.open(ordinal, time.time(), self.prefix)
            if self.window is not None:
                self.window.join(txn)
            self.batch = txn
        self.last_ordinal = ordinal
        return txn

    def _seal(self) -> None:
        txn = self.batch
        if txn is None:
            return
        self.batch = None
        self.watermark.seal(txn, self.last_ordinal)
        if self.window is not None and self.window.sealed(txn):
            self.window.commit()
        self.serve(between_batches=True)

    def _rows_passed(self) -> None:
        self.since_poll += 1
        if self.since_poll >= POLL_EVERY:
            self.since_poll = 0
            self.serve()

    def ensure_topic(self, topic: str, event: bool = True) -> None:
        """``topic`` may be used and exists; where its partitions end is noted first."""
        self.topic_rules.ensure(self.sink, topic, event=event, serve=self.serve)
        ends = self.sink.partition_ends(topic)
        fresh = {
            (topic, partition): end
            for partition, end in ends.items()
            if (topic, partition) not in self.noted
        }
        if fresh:
            self.noted = {**self.noted, **fresh}
            self._note(self.noted)
        self.known_topics.add(topic)

    def serve(self, between_batches: bool = False) -> None:
        """Delivery reports, failures, the lease; the Kafka transaction; the plan's progress;
        and that the recovery is alive, stopped or not (``stopping``)."""
        self._stopping()
        sink = self.sink
        sink.poll(0)
        if self.tracker.failures:
            self.handle_failures()
        sink.check_fatal()
        if self.window is not None and between_batches:
            self.window.tick()
        confirmed = self.watermark.advance()
        now = time.monotonic()
        if confirmed > self._recorded and now - self._progressed_at >= PROGRESS_INTERVAL:
            self._require_leading()
            self._progress(confirmed, dict(self.watermark.offsets))
            self._recorded = confirmed
            self._progressed_at = now

    def wait_for_room(self) -> None:
        """The producer's queue is full: serve it until it drains (a stop ends the wait)."""
        self.sink.poll(DRAIN_POLL)
        self.serve()
        if self._stopping():
            raise StopSession

    def handle_failures(self) -> None:
        if self.window is not None:
            self.window.failed()
        for failure in self.tracker.take_failures():
            if outcome(failure.code) is Outcome.FENCED:
                raise LeadershipLost(f"fenced: {failure.reason}")
            self.poison.delivery_failed(failure)

    def finish(self, stall_timeout: float) -> tuple[int, Offsets]:
        """Seal the last batch, commit, and wait until Kafka acknowledged every record; the
        acknowledged ordinal and offsets. SinkUnavailable when deliveries stop progressing."""
        self._seal()
        if self.window is not None and self.window.held:
            self.window.commit()
        last_progress = time.monotonic()
        acked = -1
        while self.watermark.advance() < self.last_ordinal:
            self.sink.poll(DRAIN_POLL)
            self.serve()
            if self.tracker.acked != acked:
                acked, last_progress = self.tracker.acked, time.monotonic()
            elif time.monotonic() - last_progress > stall_timeout:
                raise SinkUnavailable(
                    f"Kafka acknowledged nothing for {stall_timeout:g}s while the recovery "
                    "waited for its last records"
                )
        return self.watermark.confirmed, dict(self.watermark.offsets)

    def abandon(self) -> None:
        """An interrupted run: its open Kafka transaction is aborted (best effort)."""
        if self.window is not None:
            self.window.abandon()
