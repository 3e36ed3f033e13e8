"""One replication session: read the stream in commit order, publish every outbox event.

This module keeps the hot loop and nothing else of note: it dispatches decoded messages
(:meth:`Session.stream`) and publishes each mapped row or logical message (:meth:`Session.publish`).
Everything else is somebody else's answer, called from here:

- when the slot is confirmed: :mod:`cdc_relay.confirmation` (:class:`Confirmer`);
- publishing exactly once, when a Kafka transaction commits: :mod:`cdc_relay.kafka_transaction`
  (told at Begin, Commit and housekeeping, never per record);
- which mapping a relation's inserts use: :mod:`cdc_relay.relations`;
- what happens to a poison row, and to a delivery the broker refused: :mod:`cdc_relay.poison`;
- which topics rows may use, and creating them: :mod:`cdc_relay.topics`;
- stalls, heartbeats, retained WAL, progress lines: :mod:`cdc_relay.monitors`;
- which replayed events an earlier incarnation already got into Kafka: :mod:`cdc_relay.reconcile`
  (every record carries its position header; an event found there is counted, not re-sent), and
  where a topic's partitions end before the first record to it: :mod:`cdc_relay.partition_notes`.

Its collaborators are typed as the small Protocols below (the replication stream, the Kafka
sink, the position store), so the unit tests drive the loop with fakes (``tests/fakes.py``).

A stop requested between transactions takes effect at once. Inside one, the session reads on to
its Commit so that the clean stop confirms the whole transaction (a restart then re-sends none of
it), bounded by ``CDC_RELAY_SHUTDOWN_TIMEOUT`` counted from the request; a recorded failure (the
poison policy ``stop``) stops at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from functools import partial
from types import MethodType
from typing import Any, Final, Protocol

from cdc_relay import c_extension
from cdc_relay.config import Plugin, Settings
from cdc_relay.confirmation import Confirmer, PositionStore
from cdc_relay.decode import decoder_for
from cdc_relay.decode.messages import (
    UNCHANGED_TOAST,
    Begin,
    Commit,
    DecodeError,
    Insert,
    LogicalMessage,
    Message,
    Relation,
    StreamStart,
)
from cdc_relay.errors import (
    LeadershipLost,
    ProtocolError,
    RelayError,
    SinkUnavailable,
    StopSession,
)
from cdc_relay.kafka_transaction import Resend, TransactionalSink, transactional
from cdc_relay.logs import cut
from cdc_relay.lsn import format_lsn
from cdc_relay.monitors import Monitors
from cdc_relay.observability.stats import RelayStats
from cdc_relay.observability.tracing import Tracing
from cdc_relay.outbox import (
    TRACEPARENT_HEADER_INDEX,
    MessageMapping,
    OutboxMapping,
    RecordFields,
)
from cdc_relay.partition_notes import PartitionNotes
from cdc_relay.poison import DeadLetterSink, PoisonPolicyHandler, RefusedRecord
from cdc_relay.publisher import (
    ANY_PARTITION,
    NO_TIMESTAMP,
    BoundRecord,
    DeliveryCallback,
    DeliveryTracker,
    ProduceRefused,
    TransactionCallback,
    refusal,
)
from cdc_relay.reconcile import ORDINALS, POSITION_HEADER, Reconciliation, position_prefix
from cdc_relay.relations import Relations
from cdc_relay.replication.protocol import (
    KEEPALIVE_REPLY_REQUESTED,
    KEEPALIVE_SIZE,
    KEEPALIVE_WAL_END,
    PRIMARY_KEEPALIVE,
    XLOG_DATA,
    XLOG_DATA_PAYLOAD_OFFSET,
    XLOG_WAL_END,
    postgres_time_to_unix,
)
from cdc_relay.session_stop import StopRule
from cdc_relay.topics import TopicAdmin, TopicRules
from cdc_relay.transaction_errors import Outcome, outcome
from cdc_relay.value_text import MalformedEvent
from cdc_relay.watermark import PendingTransaction

log = logging.getLogger(__name__)

# A record's BoundRecord bound to its delivery callback: types.MethodType, or the same from the C
# extension where it is built (without the type call's argument tuple; cdc_relay.c_extension).
# Final: a C static in the compiled build, where a plain global costs a dictionary lookup per event.
_Binder = Callable[[TransactionCallback, BoundRecord], DeliveryCallback]
_bind: Final[_Binder] = MethodType if c_extension.bind is None else c_extension.bind
# publish of an ordinary row in one C call, where the extension is built (Session.fast_publisher).
_PUBLISHER: Final = c_extension.Publisher

READ_TIMEOUT = 0.05  # idle wake-up: serve delivery callbacks, confirm, send status
# The wait while records are in flight: their acknowledgements are served only by polling the
# producer, so an acknowledgement that arrives while the loop waits on PostgreSQL's socket waits
# this long at most before it counts (and, with exactly once, before its transaction may commit).
IN_FLIGHT_WAIT = 0.002
POLL_EVERY = 256  # messages between producer polls while streaming
HOUSEKEEPING_SPACING = 0.001  # at most this often when the received data runs out


class ReplicationSource(Protocol):
    """The replication connection (:class:`~cdc_relay.replication.stream.ReplicationStream`)."""

    def read(self) -> memoryview | None: ...

    def wait(self, timeout: float) -> bool: ...

    def send_status(self, written: int, flushed: int, reply: bool = False) -> None: ...


class RecordSink(DeadLetterSink, TopicAdmin, TransactionalSink, Protocol):
    """The Kafka adapter (:class:`~cdc_relay.publisher.Publisher`)."""

    @property
    def produce_raw(self) -> Callable[..., None]:
        """The hot path's bound librdkafka call, arguments by position (see
        :data:`~cdc_relay.publisher.ANY_PARTITION`); raises what librdkafka raises."""

    def in_flight(self) -> int: ...

    def check_fatal(self) -> None: ...

    def partition_ends(self, topic: str) -> dict[int, int]: ...


class SessionOwner(Protocol):
    """The relay, as a session sees it: whether to stop, and how to report a failure."""

    stopping: bool  # read once per message: a plain attribute

    @property
    def failed(self) -> bool: ...

    def require_leading(self) -> None:
        """LeadershipLost unless still the leader (asked at housekeeping, never per message)."""

    def fail(self, error: RelayError) -> None: ...


class Session:
    """State of one replication connection; the hot loop lives in :meth:`stream`."""

    def __init__(
        self,
        owner: SessionOwner,
        settings: Settings,
        stats: RelayStats,
        tracing: Tracing,
        topic_rules: TopicRules,
        *,
        source: ReplicationSource,
        sink: RecordSink,
        store: PositionStore,
        start: int,
        heartbeat: Callable[[], None],
        retained_wal: Callable[[], int | None],
        offsets: dict[tuple[str, int], int] | None = None,
        reconciliation: Reconciliation | None = None,
        noted: dict[tuple[str, int], int] | None = None,
        resend: Resend | None = None,
        table_oids: Mapping[int, str] | None = None,
    ) -> None:
        self.owner = owner
        self.settings = settings
        self.stats = stats
        self.source = source
        self.sink = sink
        self.tracing = tracing
        self.tracing_enabled = tracing.enabled
        self.produce = sink.produce_raw  # the hot path's one librdkafka call
        self.tracker = DeliveryTracker(stats)
        self.confirmer = Confirmer(
            start,
            store,
            source,
            stats,
            confirm_interval=settings.confirm_interval,
            idle_confirm_interval=settings.idle_confirm_interval,
            offsets=offsets,
            on_changed=owner.fail,
        )
        self.watermark = self.confirmer.watermark
        self.store = store
        self.slot_name = settings.slot_name
        # Partitions without an acknowledged offset: where they ended before the first write.
        self.notes = (
            PartitionNotes(noted, store, sink, self.confirmer) if settings.reconcile else None
        )
        # Events of the replayed window already in Kafka; None once the stream is past them.
        self.in_kafka: Reconciliation | Resend | None = (
            reconciliation if reconciliation is not None and reconciliation.found else None
        )
        self.resend = (resend or Resend()).from_position(start)  # exactly once: see .window
        serve = self.serve_while_committing
        self.window = transactional(settings, sink, self.resend, serve, self.tracker)
        if self.window is not None and self.in_kafka is None and self.resend.found:
            self.in_kafka = self.resend
        self.topic_rules = topic_rules
        self.known_topics: set[str] = set()
        self.poison = PoisonPolicyHandler(
            settings,
            sink,
            self.tracker,
            ensure_topic=lambda topic: self.ensure_topic(topic, event=False),
            fail=owner.fail,
            wait_for_room=self.wait_for_dead_letter_room,
        )
        self.decode = decoder_for(settings)
        self.relations = Relations(settings, table_oids)
        self.messages = MessageMapping(settings.message_prefix, settings.topic_template)
        # The prefix of the messages relayed; None while they are off (no prefix equals it).
        self.message_prefix: str | None = settings.message_prefix if settings.messages else None
        self.mappings = self.relations.mappings  # filled by Relations, read per insert
        self.filtered = self.relations.filtered
        now = time.monotonic()
        self.last_housekeeping = now
        self.monitors = Monitors(
            settings, stats, start=start, heartbeat=heartbeat, retained_wal=retained_wal, now=now
        )
        self.stop = StopRule(owner, settings.shutdown_timeout)  # see cdc_relay.session_stop

    # -- reading -----------------------------------------------------------------------------

    def stream(self) -> None:
        """Read and dispatch until StopSession (a stop) or an error ends the session."""
        owner = self.owner
        read = self.source.read
        wait = self.source.wait
        in_flight = self.sink.in_flight
        decode = self.decode
        watermark = self.watermark
        confirmer = self.confirmer
        stats = self.stats
        observe_receive = stats.receive_latency.observe
        window = self.window
        delivered = self.tracker.on_delivery  # every event's delivery callback, bound per record
        fast = self.fast_publisher(delivered)
        # Looking up replayed events in Kafka: the C publish waits until the stream is past them.
        fast_later = fast is None and self.in_kafka is not None and _PUBLISHER is not None
        txn: PendingTransaction | None = None
        messages: tuple[Message, ...]
        counter = 0
        while True:
            if owner.stopping and (txn is None or self.stop.now()):
                raise StopSession
            data = read()
            if data is None:
                # Everything received is handled: serve acknowledgements, confirm, then wait.
                if time.monotonic() - self.last_housekeeping >= HOUSEKEEPING_SPACING:
                    self.housekeeping()
                wait(IN_FLIGHT_WAIT if in_flight() else READ_TIMEOUT)
                continue
            kind = data[0]
            if kind == XLOG_DATA:
                if fast is not None and fast(data, txn):
                    messages = ()  # an Insert's ordinary row, decoded and published in C
                else:
                    try:
                        messages = decode(data)
                    except DecodeError as exc:
                        raise ProtocolError(
                            f"cannot decode a {self.settings.plugin} message: {exc}"
                        ) from None
                for message in messages:
                    if isinstance(message, Insert):
                        mapping = self.mappings.get(message.relation_id)
                        if mapping is not None and txn is not None:
                            self.publish(mapping, message.new, txn, delivered)
                        else:
                            self.unmapped_insert(message, txn)
                    elif isinstance(message, Begin):
                        txn = watermark.open(
                            message.final_lsn,
                            postgres_time_to_unix(message.commit_ts),
                            position_prefix(self.slot_name, message.final_lsn),
                        )
                        if window is not None:
                            window.join(txn)
                    elif isinstance(message, Commit):
                        if txn is None:
                            raise ProtocolError("Commit without Begin in the replication stream")
                        if txn.events:
                            # PostgreSQL 14's pgoutput sends empty transactions too: not counted
                            observe_receive(time.time() - txn.commit_time)
                            stats.transactions += 1
                        watermark.seal(txn, message.end_lsn)
                        if window is not None and window.sealed(txn):
                            window.commit()
                        txn = None
                        if fast_later and self.in_kafka is None:
                            fast = self.fast_publisher(delivered)
                            fast_later = False
                        confirmer.received = max(confirmer.received, message.end_lsn)
                        wal_end = int.from_bytes(data[XLOG_WAL_END], "big")
                        stats.server_wal_end = max(stats.server_wal_end, wal_end)
                    elif isinstance(message, Relation):
                        self.relations.on_relation(message)
                    elif isinstance(message, LogicalMessage):
                        if (
                            message.transactional
                            and txn is not None
                            and message.prefix == self.message_prefix
                        ):
                            self.publish(self.messages, message.content, txn, delivered)
                        elif message.prefix == self.messages.prefix:
                            self.relations.dropped_message(message)
                    elif isinstance(message, StreamStart):
                        raise ProtocolError("received a streamed transaction, but streaming is off")
                    # Origin, Type, Update, Delete, Truncate: nothing to relay.
                counter += 1
                if counter >= POLL_EVERY:
                    counter = 0
                    self.housekeeping()
            elif kind == PRIMARY_KEEPALIVE:
                if len(data) < KEEPALIVE_SIZE:  # else a short one reads a wrong wal_end
                    raise ProtocolError("truncated replication message 'k'")
                wal_end = int.from_bytes(data[KEEPALIVE_WAL_END], "big")
                confirmer.received = max(confirmer.received, wal_end)
                stats.server_wal_end = max(stats.server_wal_end, wal_end)
                if txn is None:
                    watermark.idle(wal_end)
                if data[
                    KEEPALIVE_REPLY_REQUESTED
                ]:  # the server asks for a reply now (wal_sender_timeout)
                    self.housekeeping(reply=True)
            else:
                raise ProtocolError(f"unknown replication message type {kind:#04x}")

    def unmapped_insert(self, message: Insert, txn: PendingTransaction | None) -> None:
        """An insert the hot path has no mapping for: a row of a filtered outbox table, relayed
        when it matches the filter (the publication's filter already left out most others, but
        not on PostgreSQL 14, with wal2json, or for rows committed before it was set), or a row
        of another relation, ignored."""
        entry = self.filtered.get(message.relation_id)
        if entry is None or txn is None:
            self.relations.ignore(message.relation_id)
            return
        mapping, accepts = entry
        if accepts is None:
            txn.events += 1
            position = b"%b%d" % (txn.position, txn.events)
            reason = "the row lacks a column of the table's row filter"
            self.refuse_unmapped(mapping, message.new, txn, reason, None, position=position)
            return
        try:
            matched = accepts(message.new)
        except IndexError:  # fewer values than the relation has columns: not a row of it
            matched = True  # the mapping refuses it (dead letter), never silently drops it
        if matched:
            self.publish(mapping, message.new, txn, self.tracker.on_delivery)

    # -- publishing --------------------------------------------------------------------------

    def fast_publisher(
        self, callback: TransactionCallback
    ) -> Callable[[memoryview, PendingTransaction | None], bool] | None:
        """An XLogData frame decoded and, when it is an Insert's ordinary row (a mapping with a
        ``fast_state``, a known topic), published as :meth:`publish` does it, in one C call: the
        C extension's ``Publisher`` (a produce that raised goes to :meth:`produce_failed`, as
        from publish). It returns False, having changed nothing, for any other frame and any row
        that :meth:`publish` must publish. None without the extension, with wal2json, while
        replayed events are looked up in Kafka, and where PendingTransaction is compiled (mypyc:
        no slots to read)."""
        if (
            _PUBLISHER is None
            or self.in_kafka is not None
            or self.settings.plugin is Plugin.WAL2JSON
        ):
            return None
        try:
            return _PUBLISHER(
                getattr(self.decode, "__self__", None),  # the PgOutputDecoder of decode_xlog
                XLOG_DATA_PAYLOAD_OFFSET,
                PendingTransaction,
                self.relations.fast_states,
                self.known_topics,
                self.produce,
                self.produce_failed,
                callback,
                POSITION_HEADER,
                UNCHANGED_TOAST,
            )
        except TypeError:  # no slots to read
            return None

    def publish(
        self,
        mapping: OutboxMapping | MessageMapping,
        data: Any,  # what the mapping maps: a row's TupleData, a message's content bytes
        txn: PendingTransaction,
        callback: TransactionCallback,
    ) -> None:
        # The event's place in the WAL, unique per slot: counted for every event, mapped or not,
        # so that a replay numbers them the same.
        txn.events += 1
        ordinal = txn.events
        try:
            position = txn.position + ORDINALS[ordinal]
        except IndexError:
            position = b"%b%d" % (txn.position, ordinal)
        try:
            record = mapping.map_fields(data)
        except MalformedEvent as malformed:  # one name per exception type: mypyc types names
            event_id = malformed.event_id
            self.refuse_unmapped(mapping, data, txn, str(malformed), event_id, position=position)
            return
        except Exception as exc:  # whatever a hostile row provokes, it refuses only that row
            reason = f"the row cannot be mapped: {type(exc).__name__}: {cut(str(exc))}"
            self.refuse_unmapped(mapping, data, txn, reason, None, position=position)
            return
        topic, key, value, headers, event_id, traceparent = record
        headers.append((POSITION_HEADER, position))
        if self.in_kafka is not None and self.already_in_kafka(
            txn, position, event_id, mapping.table, record
        ):
            return
        if topic not in self.known_topics:
            try:
                self.ensure_topic(topic)
            except ProduceRefused as missing:
                self.poison.refuse(
                    RefusedRecord(
                        txn=txn, table=mapping.table, reason=missing.reason, code=missing.name,
                        event_id=event_id, topic=topic, key=key, value=value, headers=headers,
                    )
                )  # fmt: skip
                return
        on_delivery: DeliveryCallback
        if traceparent is not None and self.tracing_enabled:
            span, context = self.tracing.start_publish(traceparent, event_id, topic)
            headers[TRACEPARENT_HEADER_INDEX] = ("traceparent", context)
            on_delivery = partial(
                Tracing.traced, span, callback, (txn, mapping.table, topic, headers)
            )
        else:
            on_delivery = _bind(callback, (txn, mapping.table, topic, headers))
        try:
            self.produce(topic, value, key, ANY_PARTITION, on_delivery, None, NO_TIMESTAMP, headers)
        except Exception as exc:  # a full queue, librdkafka's error, an argument it refused
            table = mapping.table
            self.produce_failed(exc, txn, table, topic, key, value, headers, event_id, on_delivery)
            return
        txn.produced()

    def produce_failed(  # noqa: PLR0917 - called by position, from C too
        self,
        error: Exception,
        txn: PendingTransaction,
        table: str,
        topic: str,
        key: bytes,
        value: bytes | None,
        headers: list[tuple[str, bytes]],
        event_id: str,
        on_delivery: DeliveryCallback,
    ) -> None:
        """The record's produce raised ``error`` (in :meth:`publish`, or in the C extension's
        ``Publisher``): a full queue waits for room, then produces it again; a refusal for good
        dead-letters it; any other error ends the session."""
        while True:
            if isinstance(error, BufferError):
                self.wait_for_room()
                try:
                    self.produce(
                        topic, value, key, ANY_PARTITION, on_delivery, None, NO_TIMESTAMP, headers
                    )
                except Exception as exc:
                    error = exc
                    continue
                txn.produced()
                return
            refused = refusal(error)
            if not refused.permanent:
                if outcome(refused.code) is Outcome.FENCED:  # only a transactional producer
                    raise LeadershipLost(f"fenced: {refused.reason}") from None
                raise SinkUnavailable(f"producing failed: {refused.reason}") from None
            self.poison.refuse(
                RefusedRecord(
                    txn=txn, table=table, reason=refused.reason, code=refused.name,
                    event_id=event_id, topic=topic, key=key, value=value, headers=headers,
                    too_large=refused.too_large,
                )
            )  # fmt: skip
            return

    def refuse_unmapped(
        self,
        mapping: OutboxMapping | MessageMapping,
        data: Any,
        txn: PendingTransaction,
        reason: str,
        event_id: str | None,
        *,
        position: bytes,
    ) -> None:
        """A row (or message) that breaks the contract: dead-lettered as it is."""
        if self.in_kafka is not None and self.already_in_kafka(txn, position, event_id):
            return
        malformed = RefusedRecord.malformed(
            txn, mapping, data, reason, event_id=event_id, position=position
        )
        self.poison.refuse(malformed)

    def already_in_kafka(
        self,
        txn: PendingTransaction,
        position: bytes,
        event_id: str | None,
        table: str = "",
        record: RecordFields | None = None,
    ) -> bool:
        """In the replayed window: is the event in Kafka (read back, or a split's committed
        part)? Then it is not produced again. A re-sent ``record`` refused for good: poison."""
        found = self.in_kafka
        assert found is not None
        if txn.commit_lsn > found.highest_lsn:
            self.in_kafka = None  # past everything found: the hot path looks nothing up again
            log.info(
                "past the events found in Kafka at the start",
                extra={"fields": {"skipped": self.stats.skipped_in_kafka}},
            )
            return False
        if found.in_kafka(position, event_id):
            self.stats.skipped_in_kafka += 1
            return True
        refused = found.refused(position) if record is not None else None
        if refused is None or record is None:  # (record is None: a malformed row's dead letter)
            return False
        self.poison.refuse(RefusedRecord.of_record(txn, table, record, ProduceRefused(*refused)))
        return True

    def ensure_topic(self, topic: str, event: bool = True) -> None:
        """First use of ``topic`` in this session (see :mod:`cdc_relay.topics`)."""
        self.topic_rules.ensure(self.sink, topic, event=event, serve=self.serve_while_waiting)
        if self.notes is not None:
            self.notes.note(topic, self.serve_while_waiting)
        self.known_topics.add(topic)

    def serve_while_waiting(self) -> None:
        """The loop's duties while it cannot read on (a topic being created, a full queue)."""
        self.housekeeping(between_records=False)  # a record is half-way: no split now
        if self.owner.stopping and self.stop.now():
            raise StopSession

    def serve_while_committing(self) -> None:
        """The loop's duties while a Kafka commit waits. A stop ends the wait at its deadline
        (the commit's outcome is then unknown: the next start settles it)."""
        self.housekeeping(between_records=False)  # no commit or split from inside one
        if self.owner.stopping and self.stop.expired():
            raise StopSession

    def wait_for_room(self) -> None:
        """Backpressure: the producer queue is full, so stop reading until deliveries drain."""
        self.sink.poll(0.05)
        self.handle_failures()
        self.serve_while_waiting()

    def wait_for_dead_letter_room(self) -> None:
        """The queue is full while a dead letter waits to be produced: serve the producer, and
        stop or stand by when asked (the failures are not handled from inside the poison policy,
        which is handling one)."""
        self.sink.poll(0.05)
        self.owner.require_leading()
        if self.owner.stopping and self.stop.now():
            raise StopSession

    def handle_failures(self) -> None:
        if self.window is not None:
            self.window.failed()
        for failure in self.tracker.take_failures():
            self.poison.delivery_failed(failure)

    # -- periodic work -----------------------------------------------------------------------

    def housekeeping(self, reply: bool = False, between_records: bool = True) -> None:
        """Serve delivery callbacks, watch the deliveries, confirm, keep the slot alive (and,
        ``between_records``, commit or split the Kafka transaction)."""
        self.owner.require_leading()  # first: a leader that lost its lease confirms nothing
        sink = self.sink
        sink.poll(0)
        if self.tracker.failures:
            self.handle_failures()
        sink.check_fatal()
        now = time.monotonic()
        self.last_housekeeping = now
        self.stats.last_loop = now
        acked = self.tracker.acked
        self.monitors.tick(now, sink.in_flight(), acked, self.confirmer.received)
        if self.window is not None and between_records:
            self.window.tick()
        self.confirmer.tick(now, acked, reply)

    def drain(self) -> None:
        """Wait (bounded by the shutdown timeout) until the producer has nothing in flight."""
        self.stop.drain(self.sink, lambda: bool(self.tracker.failures), self.handle_failures)

    def shutdown(self) -> None:
        """Stop reading, wait (bounded) for in-flight deliveries, confirm what is acknowledged."""
        self.drain()
        if self.window is not None:
            self.window.end()
        self.confirmer.final()
        log.info(
            "stopped",
            extra={
                "fields": {
                    "confirmed_lsn": format_lsn(self.confirmer.confirmed),
                    "published": self.stats.published,
                    "dead_lettered": self.stats.dead_lettered,
                    "unacknowledged": self.sink.in_flight(),
                }
            },
        )
