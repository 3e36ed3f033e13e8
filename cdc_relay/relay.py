"""The relay loop: replication stream -> pgoutput decoder -> outbox mapping -> Kafka -> checkpoint.

One *session* is one replication connection. It starts at the relay's acknowledged position, reads
messages in commit order, publishes every outbox insert, and periodically confirms the contiguous
watermark (first to the relay's own record, then to the slot). A lost PostgreSQL connection or a
Kafka producer that stops making progress ends the session; the next one starts, after a backoff,
from the position everything before which Kafka acknowledged — so a failure costs duplicates of the
unconfirmed tail at most, never a lost event.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from functools import partial
from typing import Any, NoReturn, TypeVar

import psycopg
from confluent_kafka import KafkaError
from opentelemetry.trace import Span
from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector

from cdc_relay.backoff import Backoff
from cdc_relay.checkpoint import PostgresCheckpointStore, check_missing_slot, resolve_start
from cdc_relay.config import MissingTopics, PoisonPolicy, Settings
from cdc_relay.dead_letter import ERROR_HEADER, DeadLetter, text_bytes
from cdc_relay.decoding import decoder_for, plugin_options_for
from cdc_relay.errors import (
    ConfigError,
    PoisonRecordError,
    ProtocolError,
    RelayError,
    SinkUnavailable,
    SlotInUse,
    SourceUnavailable,
)
from cdc_relay.lsn import format_lsn
from cdc_relay.observability.http import HealthServer
from cdc_relay.observability.metrics import RelayMetrics
from cdc_relay.observability.stats import RelayStats
from cdc_relay.observability.tracing import Tracing
from cdc_relay.outbox import (
    TRACEPARENT_HEADER_INDEX,
    MalformedEvent,
    MessageMapping,
    OutboxMapping,
)
from cdc_relay.pgoutput import (
    Begin,
    Commit,
    DecodeError,
    Insert,
    LogicalMessage,
    Relation,
    StreamStart,
)
from cdc_relay.prerequisites import require, require_usable_slot
from cdc_relay.publisher import (
    DeliveryFailure,
    DeliveryTracker,
    ProduceRefused,
    ProducerException,
    Publisher,
    RefusedRecord,
    TransactionCallback,
    error_name,
)
from cdc_relay.replication.protocol import (
    PRIMARY_KEEPALIVE,
    XLOG_DATA,
    XLOG_DATA_HEADER,
    postgres_time_to_unix,
)
from cdc_relay.replication.source import (
    SourceDatabase,
    connect,
    emit_heartbeat,
    retained_wal,
)
from cdc_relay.replication.stream import ReplicationStream
from cdc_relay.sweeper import Sweeper
from cdc_relay.watermark import PendingTransaction, Watermark

log = logging.getLogger(__name__)
_T = TypeVar("_T")

READ_TIMEOUT = 0.05  # idle wake-up: serve delivery callbacks, confirm, send status
POLL_EVERY = 256  # messages between producer polls while streaming
HOUSEKEEPING_SPACING = 0.001  # at most this often when the received data runs out
STATUS_INTERVAL = 10.0  # a standby status update at least this often (wal_sender_timeout)
STALL_WARNING_AFTER = 10.0
_XLOG_PAYLOAD = 1 + XLOG_DATA_HEADER.size
_KEEPALIVE_WAL_END = slice(1, 9)
_XLOG_WAL_END = slice(9, 17)
READY_PROBE_TIMEOUT = 2.0
SWEEPER_JOIN_TIMEOUT = 10.0
READY_STALL_AFTER = 5.0  # seconds without an acknowledgement (records waiting) -> not ready
RETAINED_WAL_CHECK_INTERVAL = 10.0
UNPRODUCIBLE = "UNPRODUCIBLE_RECORD"  # error code of a record confluent-kafka refused to take


class _Stopping(Exception):
    """Raised inside a session when a stop was requested; unwinds to the shutdown path."""


class Relay:
    """Runs sessions until asked to stop; raises a RelayError for conditions it cannot fix."""

    def __init__(
        self,
        settings: Settings,
        *,
        tracing: Tracing | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.settings = settings
        self.stats = RelayStats()
        self.tracing = tracing or Tracing()
        self._registry = registry
        self._stop = threading.Event()
        self.stopping = False  # read once per message: a plain attribute, not a property
        self._fatal: RelayError | None = None
        self._confirmed: int | None = None  # acknowledged position carried across sessions
        self._publisher: Publisher | None = None
        allowlist = settings.topic_allowlist
        self.topic_allowlist = re.compile(allowlist) if allowlist is not None else None
        self.created_topics: set[str] = set()  # event topics this process created

    def request_stop(self) -> None:
        """Safe from a signal handler: the loop notices within one read timeout."""
        self.stopping = True
        self._stop.set()

    def fail(self, error: RelayError) -> None:
        """Stop after the current session's clean shutdown, then raise ``error`` from run()."""
        self._fatal = error
        self.request_stop()

    def readiness(self) -> tuple[bool, str]:
        """For /readyz: streaming, Kafka answering and acknowledging, lag under the bound."""
        stats = self.stats
        if not stats.streaming:
            return False, "not streaming from the replication slot"
        if stats.delivery_stalled:
            return False, "Kafka is not acknowledging records"
        lag = stats.lag_seconds()
        if lag > self.settings.ready_max_lag_seconds:
            return (
                False,
                f"lagging {lag:.0f}s behind (bound {self.settings.ready_max_lag_seconds:g}s)",
            )
        publisher = self._publisher
        if publisher is None:
            return False, "no Kafka producer"
        try:
            publisher.probe(READY_PROBE_TIMEOUT)
        except SinkUnavailable as exc:
            return False, str(exc)
        return True, "streaming"

    def run(self) -> None:
        """Serve metrics and health, sweep published rows, and relay, until stopped."""
        sweeper_thread = None
        if self.settings.sweep_interval > 0:
            sweeper = Sweeper(self.settings, self.stats)  # a bad retention setting fails here
            self.stats.sweeper = sweeper
            sweeper_thread = threading.Thread(
                target=sweeper.run, args=(self._stop,), name="cdc-relay-sweeper", daemon=True
            )
            sweeper_thread.start()
        metrics = RelayMetrics(self.stats, self._registry or _process_registry())
        server = None
        if self.settings.http_port:
            server = HealthServer(
                self.settings.http_port,
                self.stats,
                metrics.prometheus_text,
                self.readiness,
                self.settings.http_host,
            )
            server.start()
        try:
            self._run_sessions()
        finally:
            self.request_stop()  # also stops the sweeper
            if sweeper_thread is not None:
                sweeper_thread.join(SWEEPER_JOIN_TIMEOUT)
            if server is not None:
                server.stop()
            metrics.shutdown()
            self.tracing.shutdown()

    def _run_sessions(self) -> None:
        backoff = Backoff(0.5, self.settings.reconnect_max_backoff)
        first = True
        try:
            while not self.stopping:
                published_before = self.stats.published
                try:
                    self._session()
                except (SourceUnavailable, SinkUnavailable, SlotInUse) as exc:
                    self.stats.streaming = False
                    self.stats.reconnects += 1
                    if self.stats.published != published_before:
                        backoff.reset()  # the session did work: this is a new failure
                    if first and isinstance(exc, SlotInUse):
                        raise
                    if isinstance(exc, SinkUnavailable):
                        self._drop_publisher(purge=True)
                    # Only transient failures get here; permanent ones (ConfigError, a
                    # SourceSetupError such as failed authentication) end run() at once.
                    delay = backoff.delay()
                    log.warning(
                        "session ended, retrying from the confirmed position",
                        extra={
                            "fields": {
                                "transient": True,
                                "reason": str(exc),
                                "retry_in_s": round(delay, 2),
                                "resume_lsn": format_lsn(self._confirmed or 0),
                            }
                        },
                    )
                    self._stop.wait(delay)
                first = False
        finally:
            self._drop_publisher(purge=False)
        if self._fatal is not None:
            raise self._fatal

    # -- one session -----------------------------------------------------------------------

    def _session(self) -> None:
        settings = self.settings
        url = settings.database_url.get_secret_value()
        with connect(url) as conn:
            start = self._prepare(conn)
            store = PostgresCheckpointStore(conn, settings.state_schema, settings.slot_name)
            if self._publisher is None:
                self._publisher = Publisher(settings.producer_config(), self.stats)
            stream = ReplicationStream(
                url,
                settings.slot_name,
                start,
                plugin_options_for(settings),
                coalesce=settings.read_coalesce_ms / 1000,
            )
            stream.open()
            self.stats.sessions += 1
            self.stats.streaming = True
            log.info(
                "streaming",
                extra={"fields": {"slot": settings.slot_name, "start_lsn": format_lsn(start)}},
            )
            session = _Session(
                self, stream=stream, store=store, conn=conn, publisher=self._publisher, start=start
            )
            try:
                session.stream()
            except _Stopping:
                session.shutdown()
            except SourceUnavailable:
                # Deliveries still in flight count toward the position the next session resumes at.
                session.drain()
                raise
            finally:
                self._confirmed = session.watermark.advance()
                self.stats.streaming = False
                stream.close()

    def _prepare(self, conn: psycopg.Connection[tuple[object, ...]]) -> int:
        """Check the database, create what is missing, and decide where to start."""
        settings = self.settings
        source = SourceDatabase(
            conn,
            settings.tables(),
            settings.publication_name,
            settings.slot_name,
            settings.plugin.value,
        )
        require(conn, settings)
        if source.ensure_publication():
            log.info(
                "created publication", extra={"fields": {"publication": settings.publication_name}}
            )
        store = PostgresCheckpointStore(conn, settings.state_schema, settings.slot_name)
        store.ensure_table()
        recorded = store.load()
        if self._confirmed is not None and (recorded is None or self._confirmed > recorded):
            # What the previous session had acknowledged but not yet recorded.
            store.save(self._confirmed)
            recorded = self._confirmed
        slot = source.slot()
        if slot is None:
            warning = check_missing_slot(settings.slot_name, recorded, settings.allow_slot_reset)
            slot = source.create_slot()
            log.info("created replication slot", extra={"fields": {"slot": slot.name}})
            start = slot.confirmed_flush or 0
            store.save(start, new_slot=True)
            recorded = start
        else:
            require_usable_slot(conn, settings, slot)
            start, warning = resolve_start(
                settings.slot_name, slot.confirmed_flush or 0, recorded, settings.allow_slot_reset
            )
        if warning:
            log.warning(warning)
        if recorded != start:
            store.save(start)
        self.stats.confirmed_lsn = start
        return start

    def _drop_publisher(self, purge: bool) -> None:
        if self._publisher is not None:
            self._publisher.close(purge=purge)
            self._publisher = None


class _Session:
    """State of one replication connection; the hot loop lives in :meth:`stream`."""

    def __init__(
        self,
        relay: Relay,
        *,
        stream: ReplicationStream,
        store: PostgresCheckpointStore,
        conn: psycopg.Connection[tuple[object, ...]],
        publisher: Publisher,
        start: int,
    ) -> None:
        self.relay = relay
        self.settings = relay.settings
        self.stats = relay.stats
        self.stream_conn = stream
        self.store = store
        self.conn = conn
        self.publisher = publisher
        self.tracing = relay.tracing
        self.tracing_enabled = relay.tracing.enabled
        self.produce = publisher.produce_raw  # the hot path's one librdkafka call
        self.watermark = Watermark(start)
        self.tracker = DeliveryTracker(relay.stats)
        self.decode = decoder_for(self.settings)
        self.tables = {table.schema_and_name: table for table in self.settings.tables()}
        self.messages = MessageMapping(self.settings.message_prefix, self.settings.topic_template)
        self.known_topics: set[str] = set()
        self.mappings: dict[int, OutboxMapping] = {}
        self.ignored_relations: set[int] = set()
        self.received = start  # highest WAL position seen, reported as "written"
        self.sent_flush = start  # what the slot was last told
        now = time.monotonic()
        self.last_status = now
        self.last_confirm = now
        self.last_progress = now
        self.last_stall_warning = now
        self.delivered_at_last_check = 0
        self.delivered_at_confirm = 0
        self.last_retained_check = 0.0
        self.last_heartbeat = now
        self.last_housekeeping = now
        self.progress = _Progress(start, relay.stats.published)
        self.stop_deadline: float | None = None  # set when a stop finds a transaction open

    # -- reading -----------------------------------------------------------------------------

    def stream(self) -> None:
        relay = self.relay
        read = self.stream_conn.read
        wait = self.stream_conn.wait
        decode = self.decode
        watermark = self.watermark
        stats = self.stats
        observe_receive = stats.receive_latency.observe
        txn: PendingTransaction | None = None
        callback: TransactionCallback | None = None
        callback_table = ""
        counter = 0
        while True:
            if relay.stopping and (txn is None or self.stop_now()):
                raise _Stopping
            data = read()
            if data is None:
                # Everything received is handled: serve acknowledgements, confirm, then wait.
                if time.monotonic() - self.last_housekeeping >= HOUSEKEEPING_SPACING:
                    self.housekeeping()
                wait(READ_TIMEOUT)
                continue
            kind = data[0]
            if kind == XLOG_DATA:
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
                            if callback is None or callback_table is not mapping.table:
                                callback = self.tracker.callback(txn, mapping.table)
                                callback_table = mapping.table
                            self.publish(mapping, message.new, txn, callback)
                        else:
                            self.ignore(message.relation_id)
                    elif isinstance(message, Begin):
                        txn = watermark.open(
                            message.final_lsn, postgres_time_to_unix(message.commit_ts)
                        )
                        callback = None
                    elif isinstance(message, Commit):
                        if txn is None:
                            raise ProtocolError("Commit without Begin in the replication stream")
                        if callback is not None:  # the transaction had events
                            observe_receive(time.time() - txn.commit_time)
                        watermark.seal(txn, message.end_lsn)
                        stats.transactions += 1
                        txn = None
                        callback = None
                        self.received = max(self.received, message.end_lsn)
                        wal_end = int.from_bytes(data[_XLOG_WAL_END], "big")
                        stats.server_wal_end = max(stats.server_wal_end, wal_end)
                    elif isinstance(message, Relation):
                        self.on_relation(message)
                    elif isinstance(message, LogicalMessage):
                        if (
                            message.transactional
                            and txn is not None
                            and message.prefix == self.messages.prefix
                        ):
                            if callback is None or callback_table is not self.messages.table:
                                callback = self.tracker.callback(txn, self.messages.table)
                                callback_table = self.messages.table
                            self.publish(self.messages, message.content, txn, callback)
                    elif isinstance(message, StreamStart):
                        raise ProtocolError("received a streamed transaction, but streaming is off")
                    # Origin, Type, Update, Delete, Truncate: nothing to relay.
                counter += 1
                if counter >= POLL_EVERY:
                    counter = 0
                    self.housekeeping()
            elif kind == PRIMARY_KEEPALIVE:
                wal_end = int.from_bytes(data[_KEEPALIVE_WAL_END], "big")
                self.received = max(self.received, wal_end)
                stats.server_wal_end = max(stats.server_wal_end, wal_end)
                if txn is None:
                    watermark.idle(wal_end)
                if data[17]:  # the server asks for a reply now (wal_sender_timeout)
                    self.housekeeping(reply=True)
            else:
                raise ProtocolError(f"unknown replication message type {kind:#04x}")

    def on_relation(self, relation: Relation) -> None:
        table = self.tables.get((relation.namespace, relation.name))
        if table is None:
            self.mappings.pop(relation.relation_id, None)
            return
        mapping = OutboxMapping(
            relation,
            table.topic_template or self.settings.topic_template,
            self.settings.traceparent_column,
            table.columns,
        )
        if mapping.missing:
            log.error(
                "outbox table lacks required columns; its rows will be dead-lettered",
                extra={"fields": {"table": mapping.table, "missing": ",".join(mapping.missing)}},
            )
        self.mappings[relation.relation_id] = mapping

    def ignore(self, relation_id: int) -> None:
        if relation_id not in self.ignored_relations:
            self.ignored_relations.add(relation_id)
            log.warning(
                "ignoring inserts of a relation that is not the outbox table",
                extra={"fields": {"relation_id": relation_id}},
            )

    # -- publishing --------------------------------------------------------------------------

    def publish(
        self,
        mapping: OutboxMapping | MessageMapping,
        source: Any,  # the row's TupleData for a table, the content bytes for a message
        txn: PendingTransaction,
        callback: TransactionCallback,
    ) -> None:
        try:
            record = mapping.map(source)
        except MalformedEvent as exc:
            self.refuse_unmapped(mapping, source, txn, str(exc), exc.event_id)
            return
        except Exception as exc:  # whatever a hostile row provokes, it refuses only that row
            reason = f"the row cannot be mapped: {type(exc).__name__}: {exc}"
            self.refuse_unmapped(mapping, source, txn, reason, None)
            return
        topic, key, value, headers, event_id, traceparent = record
        if topic not in self.known_topics:
            try:
                self.ensure_topic(topic)
            except ProduceRefused as missing:
                self.poison(
                    RefusedRecord(
                        txn, mapping.table, missing.reason, error_name(missing.code),
                        event_id, topic, key, value, headers,
                    )
                )  # fmt: skip
                return
        if traceparent is not None and self.tracing_enabled:
            span, context = self.tracing.start_publish(traceparent, event_id, topic)
            headers[TRACEPARENT_HEADER_INDEX] = ("traceparent", context)
            on_delivery = partial(_traced, span, callback, topic, headers)
        else:
            on_delivery = partial(callback, topic, headers)
        while True:
            try:
                self.produce(topic, value, key, headers=headers, on_delivery=on_delivery)
                txn.pending += 1
                return
            except BufferError:
                self.wait_for_room()
            except ProducerException as exc:
                refused = ProduceRefused.from_exception(exc)
                if not refused.permanent:
                    raise SinkUnavailable(f"producing failed: {refused.reason}") from None
                self.poison(
                    RefusedRecord(
                        txn,
                        mapping.table,
                        refused.reason,
                        error_name(refused.code),
                        event_id,
                        topic,
                        key,
                        value,
                        headers,
                        too_large=refused.too_large,
                    )
                )
                return
            except Exception as exc:  # confluent-kafka refusing an argument (TypeError, ...)
                reason = f"the record cannot be produced: {type(exc).__name__}: {exc}"
                self.poison(
                    RefusedRecord(
                        txn, mapping.table, reason, UNPRODUCIBLE, event_id, topic, key, value,
                        headers,
                    )
                )  # fmt: skip
                return

    def refuse_unmapped(
        self,
        mapping: OutboxMapping | MessageMapping,
        source: Any,
        txn: PendingTransaction,
        reason: str,
        event_id: str | None,
    ) -> None:
        """A row (or message) that breaks the contract: its dead-letter value is the row itself."""
        try:
            row: bytes | None = mapping.describe_row(source)
        except Exception as exc:  # the row is hostile to describing too: say so instead
            row = None
            reason = f"{reason} (the row cannot be described: {type(exc).__name__})"
        self.poison(
            RefusedRecord(
                txn, mapping.table, reason, "MALFORMED_OUTBOX_ROW", event_id, None, None, row, []
            )
        )

    def poison(self, refused: RefusedRecord) -> None:
        """A record that can never be delivered as it is: dead-letter it, or stop."""
        settings = self.settings
        txn = refused.txn
        commit_lsn = format_lsn(txn.commit_lsn)
        fields = {
            "event_id": _cut(refused.event_id),
            "table": refused.table,
            "commit_lsn": commit_lsn,
            "topic": refused.topic,
            "error": _cut(refused.reason),
        }
        trace_id = _trace_id(refused.headers)
        if trace_id:
            fields["trace_id"] = trace_id
        if settings.poison_policy is PoisonPolicy.STOP:
            # The transaction can never complete, so the watermark never passes it.
            txn.pending += 1
            log.error("poison record, stopping (poison policy: stop)", extra={"fields": fields})
            self.relay.fail(
                PoisonRecordError(
                    f"Kafka refused event {_cut(refused.event_id)} of {refused.table} at commit "
                    f"{commit_lsn} for topic {refused.topic!r}: {_cut(refused.reason)}. The relay "
                    "stopped without confirming past it (CDC_RELAY_POISON_POLICY=stop)"
                )
            )
            raise _Stopping
        letter = DeadLetter.of(
            refused.key,
            refused.value,
            refused.headers,
            [
                (ERROR_HEADER, text_bytes(refused.reason)),
                ("cdc_relay.error_code", text_bytes(refused.code)),
                ("cdc_relay.commit_lsn", commit_lsn.encode()),
                ("cdc_relay.table", text_bytes(refused.table)),
                ("cdc_relay.event_id", text_bytes(refused.event_id or "")),
                ("cdc_relay.topic", text_bytes(refused.topic or "")),
            ],
        )
        if refused.too_large:
            letter = letter.smaller() or letter  # the value cannot travel; its size is recorded
        log.error("poison record, sending it to the dead-letter topic", extra={"fields": fields})
        if settings.dead_letter_topic not in self.known_topics:
            try:
                self.ensure_topic(settings.dead_letter_topic, event=False)
            except ProduceRefused as exc:
                self.dead_letter_unusable(txn, exc.reason)
        self.send_dead_letter(txn, refused.table, letter)

    def send_dead_letter(self, txn: PendingTransaction, table: str, letter: DeadLetter) -> None:
        """Produce ``letter``, smaller each time librdkafka refuses it, down to its metadata."""
        topic = self.settings.dead_letter_topic
        callback = self.tracker.callback(txn, table, dead_letter=True)
        while True:
            headers = letter.all_headers
            on_delivery = partial(_dead_letter_delivered, callback, topic, headers)
            try:
                self.publisher.produce(topic, letter.value, letter.key, headers, on_delivery)
                txn.pending += 1
                return
            except BufferError:
                self.publisher.poll(0.05)
                continue
            except ProduceRefused as exc:
                if not exc.permanent:
                    raise SinkUnavailable(
                        f"cannot write to the dead-letter topic {topic!r}: {exc.reason}"
                    ) from None
                reason = exc.reason
            except Exception as exc:  # a refused argument: the smaller form leaves it out
                reason = f"{type(exc).__name__}: {exc}"
            smaller = letter.smaller()
            if smaller is None:
                self.dead_letter_unusable(txn, reason)
            log.warning(
                "dead-letter record refused, sending a smaller one",
                extra={"fields": {"error": reason, "dropped": smaller.stage}},
            )
            letter = smaller

    def dead_letter_unusable(self, txn: PendingTransaction, reason: str) -> NoReturn:
        """Not even the metadata can be dead-lettered: stop without confirming past ``txn``."""
        txn.pending += 1  # the transaction can never complete, so the watermark never passes it
        self.relay.fail(
            ConfigError(
                f"the dead-letter topic {self.settings.dead_letter_topic!r} is unusable: "
                f"{reason} (CDC_RELAY_DEAD_LETTER_TOPIC)"
            )
        )
        raise _Stopping from None

    def ensure_topic(self, topic: str, event: bool = True) -> None:
        """First use of ``topic`` in this session: it must exist (created if the policy says).

        An event's topic (``event``; not the dead-letter topic) is chosen by a row, so by any
        writer: it must match CDC_RELAY_TOPIC_ALLOWLIST, and creating it counts against
        CDC_RELAY_MAX_CREATED_TOPICS. Metadata and creation run on a helper thread; meanwhile
        the loop serves deliveries, confirmations, the server's keepalives and a stop, but reads
        no further: the records after this one wait (keeping their order).
        """
        settings = self.settings
        relay = self.relay
        allowlist = relay.topic_allowlist
        if event and allowlist is not None and not allowlist.fullmatch(topic):
            raise ProduceRefused(
                KafkaError.POLICY_VIOLATION,
                f"topic {topic!r} is not allowed by CDC_RELAY_TOPIC_ALLOWLIST",
            )
        limit = settings.max_created_topics

        def may_create() -> None:
            if event and len(relay.created_topics) >= limit:
                raise ProduceRefused(
                    KafkaError.POLICY_VIOLATION,
                    f"topic {topic!r} does not exist, and the relay has created the "
                    f"{limit} topics CDC_RELAY_MAX_CREATED_TOPICS allows: create it yourself, or "
                    "raise the limit",
                )

        created = self.wait_for(
            _in_background(
                self.publisher.ensure_topic,
                topic,
                settings.missing_topics is MissingTopics.CREATE,
                settings.topic_partitions,
                settings.topic_replication_factor,
                may_create,
            )
        )
        if created and event:
            relay.created_topics.add(topic)
        self.known_topics.add(topic)

    def wait_for(self, future: Future[_T]) -> _T:
        """The result of work done off the loop, serving the loop's duties meanwhile."""
        while True:
            try:
                return future.result(timeout=READ_TIMEOUT)
            except FutureTimeout:
                pass
            self.housekeeping()
            if self.relay.stopping and self.stop_now():
                raise _Stopping

    def handle_failures(self) -> None:
        for failure in self.tracker.take_failures():
            self.on_failure(failure)

    def on_failure(self, failure: DeliveryFailure) -> None:
        if failure.dead_letter:
            if not failure.permanent:
                raise SinkUnavailable(
                    f"the dead-letter topic {failure.topic!r} refused a record: {failure.reason}"
                )
            # Kafka refused the dead-letter record itself: send a smaller one in its place.
            failure.txn.pending -= 1
            smaller = DeadLetter.split(failure.key, failure.value, failure.headers).smaller()
            if smaller is None:
                self.dead_letter_unusable(failure.txn, failure.reason)
            log.warning(
                "dead-letter record refused, sending a smaller one",
                extra={"fields": {"error": failure.reason, "dropped": smaller.stage}},
            )
            self.send_dead_letter(failure.txn, failure.table, smaller)
            return
        if not failure.permanent:
            raise SinkUnavailable(f"delivery to {failure.topic!r} failed: {failure.reason}")
        # The original produce counted one pending delivery; the dead-letter record takes it over.
        failure.txn.pending -= 1
        self.poison(failure.refused())

    def wait_for_room(self) -> None:
        """Backpressure: the producer queue is full, so stop reading until deliveries drain."""
        self.publisher.poll(0.05)
        self.handle_failures()
        self.housekeeping()
        if self.relay.stopping and self.stop_now():
            raise _Stopping

    def stop_now(self) -> bool:
        """A stop was requested inside a transaction: stop at once, or read on to its Commit?

        Reading on lets the stop confirm the whole transaction, so that a restart re-sends none
        of it. Bounded: past CDC_RELAY_SHUTDOWN_TIMEOUT (counted from the request) the relay stops
        anyway, leaving the transaction unconfirmed. A failure (e.g. the poison policy stop)
        stops at once.
        """
        if self.relay._fatal is not None:
            return True
        now = time.monotonic()
        if self.stop_deadline is None:
            self.stop_deadline = now + self.settings.shutdown_timeout
            log.info("stop requested: reading on to the end of the transaction")
        return now >= self.stop_deadline

    # -- periodic work -----------------------------------------------------------------------

    def housekeeping(self, reply: bool = False) -> None:
        """Serve delivery callbacks, detect stalls, confirm the watermark, keep the slot alive."""
        publisher = self.publisher
        publisher.poll(0)
        if self.tracker.failures:
            self.handle_failures()
        publisher.check_fatal()
        now = time.monotonic()
        self.last_housekeeping = now
        stats = self.stats
        stats.last_loop = now
        self.check_progress(now)
        watermark = self.watermark
        confirmed = watermark.advance()
        stats.last_acked_commit_time = watermark.confirmed_commit_time
        stats.caught_up = (
            watermark.pending_transactions == 0 and self.received >= stats.server_wal_end
        )
        self.progress.maybe_log(now, self.received, stats, self.settings.progress_interval)
        heartbeat = self.settings.heartbeat_interval
        if heartbeat and now - self.last_heartbeat >= heartbeat:
            self.last_heartbeat = now
            emit_heartbeat(self.conn)
        if now - self.last_retained_check >= RETAINED_WAL_CHECK_INTERVAL:
            self.last_retained_check = now
            stats.retained_wal_bytes = retained_wal(self.conn, self.settings.slot_name)
        if confirmed > self.sent_flush:
            published = self.tracker.acked
            if published != self.delivered_at_confirm:
                due = now - self.last_confirm >= self.settings.confirm_interval
            else:
                # Only the WAL moved (other tables, our own position record): confirm less often,
                # so that recording the position is not itself a busy loop.
                due = now - self.last_confirm >= self.settings.idle_confirm_interval
            if due:
                self.delivered_at_confirm = published
                self.confirm(confirmed)
                return
        if reply or now - self.last_status >= STATUS_INTERVAL:
            self.send_status()

    def check_progress(self, now: float) -> None:
        in_flight = self.publisher.in_flight()
        self.stats.in_flight = in_flight
        delivered = self.tracker.acked
        if in_flight == 0 or delivered != self.delivered_at_last_check:
            self.delivered_at_last_check = delivered
            self.last_progress = now
            self.stats.delivery_stalled = False
            return
        stalled = now - self.last_progress
        self.stats.delivery_stalled = stalled >= READY_STALL_AFTER
        if stalled >= self.settings.delivery_stall_timeout:
            raise SinkUnavailable(
                f"no Kafka delivery progress for {stalled:.0f}s with {in_flight} records in "
                "flight; rebuilding the producer"
            )
        warn_after = min(STALL_WARNING_AFTER, self.settings.delivery_stall_timeout / 2)
        if stalled >= warn_after and now - self.last_stall_warning >= warn_after:
            self.last_stall_warning = now
            log.warning(
                "Kafka is not acknowledging records; broker unreachable?",
                extra={"fields": {"in_flight": in_flight, "stalled_s": round(stalled, 1)}},
            )

    def confirm(self, lsn: int) -> None:
        """Record the position, then tell the slot: the record must never be behind the slot."""
        self.store.save(lsn)
        self.sent_flush = lsn
        self.relay.stats.confirmed_lsn = lsn
        self.relay._confirmed = lsn
        self.last_confirm = time.monotonic()
        self.send_status()
        log.debug("confirmed", extra={"fields": {"lsn": format_lsn(lsn)}})

    def send_status(self) -> None:
        self.stream_conn.send_status(max(self.received, self.sent_flush), self.sent_flush)
        self.last_status = time.monotonic()

    def drain(self) -> None:
        """Wait (bounded by the shutdown timeout) until the producer has nothing in flight."""
        deadline = self.stop_deadline or time.monotonic() + self.settings.shutdown_timeout
        publisher = self.publisher
        try:
            while publisher.in_flight() > 0 and time.monotonic() < deadline:
                publisher.poll(0.1)
                if self.tracker.failures:
                    self.handle_failures()
        except (SinkUnavailable, _Stopping) as exc:
            log.error("deliveries failed while draining", extra={"fields": {"error": str(exc)}})

    def shutdown(self) -> None:
        """Stop reading, wait (bounded) for in-flight deliveries, confirm what is acknowledged."""
        self.drain()
        publisher = self.publisher
        confirmed = self.watermark.advance()
        if confirmed > self.sent_flush:
            try:
                self.confirm(confirmed)
            except (SourceUnavailable, psycopg.Error) as exc:
                log.warning("could not confirm on shutdown", extra={"fields": {"error": str(exc)}})
        remaining = publisher.in_flight()
        log.info(
            "stopped",
            extra={
                "fields": {
                    "confirmed_lsn": format_lsn(self.sent_flush),
                    "published": self.stats.published,
                    "dead_lettered": self.stats.dead_lettered,
                    "unacknowledged": remaining,
                }
            },
        )


def _in_background(work: Callable[..., _T], *args: Any) -> Future[_T]:
    """Run ``work`` on a daemon thread (one that never delays the process's exit)."""
    future: Future[_T] = Future()

    def run() -> None:
        try:
            future.set_result(work(*args))
        except BaseException as exc:  # handed to the waiting loop, which re-raises it
            future.set_exception(exc)

    threading.Thread(target=run, name="cdc-relay-topic", daemon=True).start()
    return future


def _traced(  # noqa: PLR0917 - the delivery callback's shape, four of them bound by partial
    span: Span,
    callback: TransactionCallback,
    topic: str,
    headers: list[tuple[str, bytes]],
    err: Any,
    msg: Any,
) -> None:
    Tracing.end_publish(span, err, msg)
    callback(topic, headers, err, msg)


def _cut(text: str | None, limit: int = 1024) -> str | None:
    """A row-supplied text for a log line: a row cannot make the line megabytes long."""
    return text if text is None or len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def _dead_letter_delivered(
    callback: TransactionCallback,
    topic: str,
    headers: list[tuple[str, bytes]],
    err: Any,
    msg: Any,
) -> None:
    callback(topic, headers, err, msg)
    if err is None:
        event_id = next((v for n, v in reversed(headers) if n == "cdc_relay.event_id"), b"")
        log.info(
            "poison record sent to the dead-letter topic",
            extra={
                "fields": {
                    "event_id": _cut(event_id.decode("utf-8", "replace")),
                    "topic": topic,
                    "partition": msg.partition(),
                    "offset": msg.offset(),
                }
            },
        )


def _process_registry() -> CollectorRegistry:
    """A registry of our own (several relays may share a process in tests) with process metrics."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


class _Progress:
    """A progress line every few seconds while a backlog is read, so catch-up never looks hung."""

    BACKLOG_BYTES = 1024 * 1024  # below this the relay counts as keeping up

    def __init__(self, received: int, published: int) -> None:
        self.at = time.monotonic()
        self.received = received
        self.published = published

    def maybe_log(self, now: float, received: int, stats: RelayStats, interval: float) -> None:
        if now - self.at < interval:
            return
        remaining = max(stats.server_wal_end - received, 0)
        elapsed = now - self.at
        published = stats.published
        if remaining >= self.BACKLOG_BYTES:
            byte_rate = (received - self.received) / elapsed
            eta = remaining / byte_rate if byte_rate > 0 else None
            log.info(
                "catching up",
                extra={
                    "fields": {
                        "events_per_s": round((published - self.published) / elapsed),
                        "remaining_bytes": remaining,
                        "eta_s": round(eta, 1) if eta is not None else "unknown",
                    }
                },
            )
        self.at, self.received, self.published = now, received, published


def _trace_id(headers: list[tuple[str, bytes]]) -> str | None:
    """The W3C trace id of a record's ``traceparent`` header, for log lines."""
    for name, value in headers:
        if name == "traceparent":
            parts = value.decode("ascii", "replace").split("-")
            return parts[1] if len(parts) == 4 else None
    return None
