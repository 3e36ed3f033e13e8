"""The Kafka side: an idempotent confluent-kafka producer and the accounting of its deliveries.

confluent-kafka reports each record's fate in a delivery callback served by ``poll()``. Successes
are acknowledged to their transaction (see :mod:`cdc_relay.watermark`); failures are queued
and classified here as *permanent* for that record (dead-letter or stop) or *transient* (rebuild and
resume). librdkafka's exceptions are mapped here, in :func:`refusal`, to the project's own errors;
the one place they surface unmapped is the hot path's bound ``produce_raw``, whose caller hands
whatever it raises straight to :func:`refusal`. Publishing exactly once, the producer is
transactional: its transactional calls' errors are mapped by :mod:`cdc_relay.transaction_errors`.

The callbacks never raise (they only count and queue). What a call that *serves* them raises —
``poll``, ``flush``, the transactional calls — is librdkafka's fatal error (a fenced producer):
confluent-kafka raises it from inside its error callback, and when the same call then serves
another callback (a flush serves every delivery report) that one returns with the error still
set, so the call raises ``SystemError`` from it. :func:`kafka_error` finds the librdkafka error
behind either; :class:`Publisher` records a fatal one and maps it where it calls, and its close
never raises.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from confluent_kafka import KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    NewTopic,
    OffsetSpec,
)

from cdc_relay import c_extension
from cdc_relay.config import legal_topic
from cdc_relay.errors import RelayError, SinkUnavailable
from cdc_relay.logs import cut
from cdc_relay.observability.stats import RelayStats
from cdc_relay.transaction_errors import resumable, transaction_failure
from cdc_relay.watermark import PendingTransaction

log = logging.getLogger(__name__)

# The event's delivery callback in C (cdc_relay.c_extension); _callbacks' on_delivery is the
# reference and the fallback.
_deliveries: Final = c_extension.Deliveries

DeliveryCallback = Callable[[Any, Any], None]
# Delivery reports do not carry headers, so each record's transaction, table, topic and headers
# are bound to the session's one delivery function, as one tuple, by types.MethodType: two
# objects per record, where functools.partial makes three (itself, its arguments and an empty
# keyword dictionary), and no function made per transaction (a closure and its cells cost more
# than the record's four-tuple saves). The topic also saves asking the report for it.
BoundRecord = tuple[PendingTransaction, str, str, list[tuple[str, bytes]]]
TransactionCallback = Callable[[BoundRecord, Any, Any], None]
# The hot path passes produce_raw's arguments by position, in confluent-kafka's order: topic,
# value, key, partition, callback, on_delivery (an alias: None), timestamp, headers. Passed by
# keyword they cost the binding a dictionary lookup per known keyword, ~4,000 instructions a record.
ANY_PARTITION: Final = -1  # librdkafka's RD_KAFKA_PARTITION_UA: the partitioner chooses
NO_TIMESTAMP: Final = 0  # the record's timestamp is the time of producing

# Errors that concern one record and will not go away by retrying it.
PERMANENT_ERRORS = frozenset(
    {
        KafkaError.MSG_SIZE_TOO_LARGE,
        KafkaError.TOPIC_EXCEPTION,
        KafkaError.RECORD_LIST_TOO_LARGE,
        KafkaError.INVALID_RECORD,
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError._UNKNOWN_TOPIC,
        KafkaError._INVALID_ARG,
    }
)
_SIZE_ERRORS = frozenset({KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE})
# Our own teardown: the records are re-sent by the next session.
_PURGED = frozenset({KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT})
_ERROR_LOG_INTERVAL = 10.0
UNPRODUCIBLE = "UNPRODUCIBLE_RECORD"  # error code of a record confluent-kafka refused to take
METADATA_TIMEOUT = 10.0
# How long a closed producer's destruction waits for a metadata call of another thread.
CLOSE_WAIT = METADATA_TIMEOUT + 1.0
PURGED_REPORTS_WAIT = 1.0  # close() serves the purged records' reports this long at most
# A transactional call waits at most this long at a time; a timed-out call is called again
# (librdkafka resumes it) after the caller's duties (the slot's status, the lease) are served.
TRANSACTION_CALL_TIMEOUT = 0.1
INIT_TRANSACTIONS_LIMIT = 30.0  # then the session ends and the start is retried
ABORT_LIMIT = 1.0  # a best effort: the next producer's fence aborts what this one left open
# Connection and security properties: all an AdminClient needs (it refuses producer ones).
_CLIENT_PROPERTY_PREFIXES = (
    "bootstrap.servers",
    "client.id",
    "client.dns.lookup",
    "security.",
    "sasl.",
    "ssl.",
    "ssl_",
    "enable.ssl.",
    "enable.sasl.",
    "https.",
    "socket.",
    "broker.address.",
    "broker.version.fallback",
    "api.version",
    "reconnect.backoff",
    "retry.backoff",
    "connections.max.idle.ms",
)


def admin_config(producer_config: dict[str, str]) -> dict[str, str | int | float | bool]:
    """The producer configuration minus what an AdminClient refuses: how to reach the cluster."""
    return {
        key: value
        for key, value in producer_config.items()
        if any(key == p or key.startswith(p) for p in _CLIENT_PROPERTY_PREFIXES)
    }


def error_name(code: int) -> str:
    """librdkafka's symbolic name of an error code, e.g. ``TOPIC_EXCEPTION``."""
    try:
        return str(KafkaError(code).name())
    except Exception:  # an unknown code still gets a name
        return str(code)


@dataclass(frozen=True)
class DeliveryFailure:
    """A record Kafka did not accept, with enough context to dead-letter it."""

    txn: PendingTransaction
    table: str
    dead_letter: bool  # the failed record was itself a dead-letter record
    code: int
    reason: str
    topic: str
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]

    @property
    def permanent(self) -> bool:
        return self.code in PERMANENT_ERRORS

    @property
    def too_large(self) -> bool:
        return self.code in _SIZE_ERRORS


@dataclass
class DeliveryTracker:
    """Counts acknowledgements and collects failures; callbacks only touch plain attributes."""

    stats: RelayStats
    failures: list[DeliveryFailure] = field(default_factory=list)
    # The relay's acknowledgements before this session: acked counts from there.
    acked_before: int = field(init=False, default=0)
    # The delivery callbacks (see _callbacks), made once per session.
    on_delivery: TransactionCallback = field(init=False, repr=False)
    on_dead_letter_delivery: TransactionCallback = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.acked_before = self.stats.published + self.stats.dead_lettered
        self.on_delivery, self.on_dead_letter_delivery = self._callbacks()

    @property
    def acked(self) -> int:
        """This session's acknowledgements, published or dead-lettered. Read from the relay's
        counters at housekeeping, so that a delivery report counts its record once, not twice."""
        return self.stats.published + self.stats.dead_lettered - self.acked_before

    def _callbacks(self) -> tuple[TransactionCallback, TransactionCallback]:
        """The delivery callbacks of every record of the session, of events and of dead letters;
        each record binds its :data:`BoundRecord` to one (``types.MethodType``).

        Runs once per record, so it does the least it can: a success counts the record and
        notes its offset; the latency histogram is fed once per transaction, when the last
        record in flight is acknowledged (its time stands for the events acknowledged since:
        an upper bound, off by at most one poll of the producer). An event's callback is the C
        extension's ``Deliveries`` where it is built: ``on_delivery``'s steps for an ordinary
        success, without a Python frame per acknowledgement; anything else is ``on_delivery``.
        """
        failures = self.failures
        stats = self.stats
        by_topic = stats.published_by_topic
        observe = stats.latency.observe
        now = time.time

        def failed(record: BoundRecord, dead_letter: bool, err: Any, msg: Any) -> None:
            if err.code() not in _PURGED:
                stats.producer_errors += 1
                txn, table, topic, headers = record
                failures.append(
                    DeliveryFailure(
                        txn, table, dead_letter, err.code(), err.str(), topic, msg.key(),
                        msg.value(), headers,
                    )
                )  # fmt: skip

        def on_delivery(record: BoundRecord, err: Any, msg: Any) -> None:
            if err is not None:
                failed(record, False, err, msg)
                return
            txn = record[0]
            topic = record[2]
            # In order per partition: the last report is the transaction's highest offset.
            txn.offsets[topic, msg.partition()] = msg.offset()
            by_topic[topic] += 1
            if txn.acknowledged():
                txn.unobserved += 1
            else:
                observe(now() - txn.commit_time, txn.unobserved + 1)
                txn.unobserved = 0

        def on_dead_letter_delivery(record: BoundRecord, err: Any, msg: Any) -> None:
            if err is not None:
                failed(record, True, err, msg)
                return
            txn = record[0]
            txn.offsets[record[2], msg.partition()] = msg.offset()
            stats.dead_lettered += 1
            if not txn.acknowledged() and txn.unobserved:  # the events acknowledged before it
                observe(now() - txn.commit_time, txn.unobserved)
                txn.unobserved = 0

        if _deliveries is not None:
            try:
                fast = _deliveries(PendingTransaction, by_topic, observe, now, on_delivery)
            except TypeError:  # PendingTransaction compiled (mypyc): no slots to read
                pass
            else:
                return fast, on_dead_letter_delivery
        return on_delivery, on_dead_letter_delivery

    def take_failures(self) -> list[DeliveryFailure]:
        failures = self.failures[:]
        self.failures.clear()
        return failures


class ProduceRefused(Exception):
    """A record (or its topic) refused before any broker answered: by librdkafka when producing
    (e.g. larger than message.max.bytes), by confluent-kafka (an argument it cannot take), or by
    the relay's own topic rules."""

    def __init__(self, code: int, reason: str, name: str | None = None) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason
        self.name = name or error_name(code)  # the error code a dead letter carries

    @property
    def permanent(self) -> bool:
        return self.code in PERMANENT_ERRORS

    @property
    def too_large(self) -> bool:
        return self.code in _SIZE_ERRORS

    @classmethod
    def policy(cls, reason: str) -> ProduceRefused:
        """A topic the relay's own rules refuse (allow-list, creation limit)."""
        return cls(KafkaError.POLICY_VIOLATION, reason)


# The one table mapping what producing can raise to the project's terms. The hot path catches
# ``Exception`` around the bound produce (no extra Python frame per record) and asks here.
def refusal(exc: Exception) -> ProduceRefused:
    """What a failed produce means: librdkafka's error, or an argument confluent-kafka refused."""
    if isinstance(exc, KafkaException):
        error = exc.args[0] if exc.args else None
        if isinstance(error, KafkaError):
            return ProduceRefused(error.code(), error.str())
        return ProduceRefused(-1, str(exc))
    return ProduceRefused(
        KafkaError._INVALID_ARG,
        f"the record cannot be produced: {type(exc).__name__}: {exc}",
        UNPRODUCIBLE,
    )


def kafka_error(raised: BaseException) -> KafkaError | None:
    """The librdkafka error behind what a producer call raised: a KafkaException's, or the one a
    SystemError was raised from (a fatal error left set while another callback was served: see
    the module's docstring). None for anything else: an exception of ours is no Kafka error."""
    seen: BaseException | None = raised
    while isinstance(seen, SystemError):
        seen = seen.__cause__ or seen.__context__
    if isinstance(seen, KafkaException) and seen.args and isinstance(seen.args[0], KafkaError):
        return seen.args[0]
    return None


# Producers being destroyed (Publisher.close), each on a thread of its own.
_closing: list[threading.Thread] = []


def await_closed(timeout: float) -> bool:
    """Before the process exits: wait (at most ``timeout`` seconds in all) until every closed
    producer's librdkafka client is destroyed. False when one is still being destroyed (an
    unresponsive broker): the process then exits with it, as it must exit in time."""
    deadline = time.monotonic() + timeout
    for closing in _closing:
        closing.join(max(0.0, deadline - time.monotonic()))
    _closing[:] = [closing for closing in _closing if closing.is_alive()]
    return not _closing


class Publisher:
    """A thin, typed wrapper of one idempotent Producer."""

    __deletable__ = ("_producer", "produce_raw", "poll")  # close() drops them (mypyc allows it)

    def __init__(
        self, config: dict[str, str], stats: RelayStats, transactional_id: str | None = None
    ) -> None:
        self._stats = stats
        self._last_error_log = 0.0
        self.fatal_error: str | None = None
        self._fatal: Any = None  # the fatal KafkaError, mapped when the loop checks
        self._config = config
        self._admin: AdminClient | None = None
        # Metadata calls in progress on other threads (a topic's helper thread, the readiness
        # probe): close() destroys the client only once they returned.
        self._metadata_calls = 0
        self._metadata_done = threading.Condition()
        self.transactional = transactional_id is not None
        own = {} if transactional_id is None else {"transactional.id": transactional_id}
        # How long a transaction's commit may be resumed: the broker aborts it after this.
        self.transaction_timeout = (
            int(config.get("transaction.timeout.ms", "60000")) / 1000 if self.transactional else 0
        )
        self._producer = Producer(
            {
                **config,
                **own,
                "error_cb": self._on_error,
                "logger": logging.getLogger("cdc_relay.kafka"),
            }
        )
        # Bound once: it sits on the hot path. produce_raw raises librdkafka's own exceptions:
        # its caller maps them with refusal().
        self.produce_raw: Callable[..., None] = self._producer.produce
        # A poll raises the producer's fatal error (fenced, for a transactional one): mapped.
        self.poll: Callable[[float], int] = self._poll

    def produce(
        self,
        topic: str,
        value: bytes | None,
        key: bytes | None,
        headers: list[tuple[str, bytes]],
        on_delivery: DeliveryCallback,
    ) -> None:
        """Queue one record. BufferError means the queue is full: poll, then try again."""
        try:
            self.produce_raw(
                topic, value, key, ANY_PARTITION, on_delivery, None, NO_TIMESTAMP, headers
            )
        except BufferError:
            raise
        except Exception as exc:
            raise refusal(exc) from None

    def in_flight(self) -> int:
        return len(self._producer)

    def check_fatal(self) -> None:
        if self.fatal_error is not None:
            raise self._fatal_failure(self._fatal, "publishing")

    def _fatal_failure(self, error: KafkaError, doing: str) -> RelayError:
        """A fatal error, recorded: fenced, stand by; else the producer is rebuilt."""
        self.fatal_error, self._fatal = error.str(), error
        if self.transactional:
            return transaction_failure(error, doing)
        return SinkUnavailable(f"the Kafka producer failed fatally: {error.str()}")

    def _failure(self, raised: Exception, doing: str) -> RelayError:
        """What a producer call raised, in the relay's terms (a fatal error recorded). What is
        no librdkafka error (a bug of ours) is raised again as it is."""
        error = kafka_error(raised)
        if error is None:
            if isinstance(raised, KafkaException):
                return SinkUnavailable(f"{doing} failed: {raised}")
            raise raised
        if error.fatal():
            return self._fatal_failure(error, doing)
        if self.transactional:
            return transaction_failure(error, doing)
        return SinkUnavailable(f"{doing} failed: {error.str()}")

    # -- Kafka transactions (CDC_RELAY_EXACTLY_ONCE) -------------------------------------------

    def init_transactions(self, serve: Callable[[], None]) -> None:
        """The fence: the broker refuses every older producer of this transactional.id from now
        on (and aborts its open transaction). ``serve`` runs between the resumed waits."""
        self._resumed(self._producer.init_transactions, "init_transactions", serve,
                      INIT_TRANSACTIONS_LIMIT)  # fmt: skip

    def begin_transaction(self) -> None:
        """Local and cheap: the next records belong to a new Kafka transaction."""
        try:
            self._producer.begin_transaction()
        except KafkaException as exc:
            raise self._failure(exc, "beginning a Kafka transaction") from None

    def commit_transaction(self, serve: Callable[[], None]) -> None:
        """Deliver what is queued and commit; resumed while it times out, up to the transaction
        timeout (then the broker has aborted it). SinkUnavailable when it must be aborted."""
        self._resumed(self._producer.commit_transaction, "committing a Kafka transaction", serve,
                      self.transaction_timeout)  # fmt: skip

    def abort_transaction(self) -> bool:
        """A best effort (bounded): True when the broker confirmed the abort."""
        try:
            self._producer.abort_transaction(ABORT_LIMIT)
        except Exception as exc:  # a KafkaException, or a fatal error served with reports
            self._failure(exc, "aborting a Kafka transaction")  # recorded when fatal
            return False
        return True

    def _poll(self, timeout: float) -> int:
        try:
            return int(self._producer.poll(timeout))
        except Exception as exc:  # the fatal error, alone or served with reports
            raise self._failure(exc, "publishing") from None

    def _resumed(
        self, call: Callable[[float], None], doing: str, serve: Callable[[], None], limit: float
    ) -> None:
        deadline = time.monotonic() + limit
        while True:
            try:
                call(TRANSACTION_CALL_TIMEOUT)
                return
            except Exception as exc:  # a KafkaException, or a fatal error served with reports
                error = kafka_error(exc)
                if error is not None and resumable(error) and time.monotonic() < deadline:
                    serve()
                    continue
                raise self._failure(exc, doing) from None

    def close(self) -> None:
        """Drop what is still queued or in flight (the next session re-sends it: late duplicates
        at most) and destroy the producer.

        Its librdkafka client is destroyed whoever still holds a bound method of it: the session
        keeps ``produce_raw`` for its hot path, and the first session is frozen by the collector
        (:func:`cdc_relay.collector.settled`), never freed. Dropping our reference alone would
        leave that client running, threads and broker connections, for the life of the process:
        through the interpreter's finalization and the C library's exit handlers. Destroying it
        may wait on an unresponsive broker, so it happens on a thread of its own; the process
        waits for it before it exits (:func:`await_closed`).
        """
        producer = self._producer
        # Purged first, so that nothing more is sent; then its reports, and those already
        # queued, are served, and ignored, here on the session's thread.
        try:
            producer.purge(in_queue=True, in_flight=True, blocking=False)
            producer.flush(PURGED_REPORTS_WAIT)
        except Exception as exc:  # e.g. fenced: whoever closes it has its own cause to report
            self._closed_with(exc)
        with self._metadata_done:
            # No metadata call starts from here on (AttributeError).
            # The producer holds our error callback, we hold the producer: break the cycle.
            del self._producer, self.produce_raw, self.poll
        self._admin = None
        closing = threading.Thread(
            target=self._destroy, args=(producer,), name="cdc-relay-producer-close", daemon=True
        )
        # Those already destroyed go: a relay that rebuilds its producer for days keeps none.
        _closing[:] = [*(other for other in _closing if other.is_alive()), closing]
        closing.start()

    def _closed_with(self, raised: Exception) -> None:
        """What serving the last reports raised while closing: said, never raised."""
        try:
            failure = self._failure(raised, "closing the Kafka producer")
        except Exception:  # no librdkafka error: a callback of ours raised
            log.exception("a Kafka delivery callback failed while the producer closed")
            return
        log.warning(
            "the Kafka producer failed while it closed",
            extra={"fields": {"error": str(failure), "fatal": self.fatal_error is not None}},
        )

    def _destroy(self, producer: Producer) -> None:
        """Destroy ``producer`` once no metadata call of another thread is inside it (each
        returns within its timeout): librdkafka's client must not be destroyed under a call."""
        with self._metadata_done:
            if not self._metadata_done.wait_for(lambda: self._metadata_calls == 0, CLOSE_WAIT):
                log.warning("a Kafka metadata request outlived the producer's close")
                return
        producer.close()

    def _list_topics(self, topic: str | None = None, timeout: float = METADATA_TIMEOUT) -> Any:
        """The producer's metadata, asked off the session's thread: counted, so that close()
        waits for it. AttributeError once closed."""
        with self._metadata_done:
            producer = self._producer
            self._metadata_calls += 1
        try:
            return producer.list_topics(topic, timeout=timeout)
        finally:
            with self._metadata_done:
                self._metadata_calls -= 1
                self._metadata_done.notify_all()

    def ensure_topic(
        self,
        topic: str,
        create: bool,
        partitions: int,
        replication_factor: int,
        may_create: Callable[[], None] | None = None,
    ) -> bool:
        """Make sure ``topic`` exists, creating it when allowed; never a broker auto-create.
        True when it was created. Blocks (metadata, CreateTopics): the relay calls it off its
        streaming loop.

        ProduceRefused (permanent) when it is missing and may not be created (``may_create``
        raises it too), or cannot be (an invalid name); SinkUnavailable when the cluster does not
        answer.
        """
        if not legal_topic(topic):
            # Checked here rather than trusted to the broker: not every Kafka-protocol broker
            # rejects such names, and a topic that exists under an illegal name helps nobody.
            raise ProduceRefused(
                KafkaError.TOPIC_EXCEPTION,
                f"invalid topic name {cut(topic)!r}: Kafka allows 1-249 of [a-zA-Z0-9._-]",
            )
        try:
            metadata = self._list_topics()
        except KafkaException as exc:
            raise SinkUnavailable(f"cannot read Kafka metadata: {exc}") from None
        found = metadata.topics.get(topic)
        if found is not None and found.error is None:
            return False
        if not create:
            raise ProduceRefused(
                KafkaError.UNKNOWN_TOPIC_OR_PART,
                f"topic {topic!r} does not exist and CDC_RELAY_MISSING_TOPICS=fail: create it",
            )
        if may_create is not None:
            may_create()
        if self._admin is None:
            # Kept for the producer's lifetime: destroying a client waits for its requests.
            self._admin = AdminClient(dict(admin_config(self._config)))
        future = self._admin.create_topics(
            [NewTopic(topic, num_partitions=partitions, replication_factor=replication_factor)],
            operation_timeout=METADATA_TIMEOUT,
        )[topic]
        try:
            future.result(timeout=METADATA_TIMEOUT * 2)
        except KafkaException as exc:
            error = exc.args[0]
            if not isinstance(error, KafkaError):
                raise SinkUnavailable(f"cannot create topic {topic!r}: {exc}") from None
            if error.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                return False
            if error.code() in PERMANENT_ERRORS or error.code() == KafkaError.INVALID_PARTITIONS:
                raise ProduceRefused(
                    error.code(), f"cannot create topic {topic!r}: {error.str()}"
                ) from None
            raise SinkUnavailable(f"cannot create topic {topic!r}: {error.str()}") from None
        log.info(
            "created topic",
            extra={"fields": {"topic": topic, "partitions": partitions, "rf": replication_factor}},
        )
        return True

    def partition_ends(self, topic: str) -> dict[int, int]:
        """Each partition of ``topic`` and its end as ListOffsets "latest" tells it — a lower
        bound on some brokers, never above what exists. Blocks: call it off the loop."""
        try:
            metadata = self._list_topics(topic)
            found = metadata.topics.get(topic)
            if found is None or found.error is not None:
                raise SinkUnavailable(f"no metadata for topic {topic!r}")
            if self._admin is None:
                self._admin = AdminClient(dict(admin_config(self._config)))
            latest = OffsetSpec.latest()  # type: ignore[no-untyped-call]
            futures = self._admin.list_offsets(
                {TopicPartition(topic, p): latest for p in found.partitions},
                request_timeout=METADATA_TIMEOUT,
            )
            return {
                tp.partition: int(future.result(timeout=METADATA_TIMEOUT * 2).offset)
                for tp, future in futures.items()
            }
        except KafkaException as exc:
            raise SinkUnavailable(f"cannot list the offsets of {topic!r}: {exc}") from None

    def probe(self, timeout: float) -> None:
        """Ask a broker for metadata; raises SinkUnavailable when none answers in time."""
        try:
            self._list_topics(timeout=timeout)
        except (KafkaException, AttributeError) as exc:  # AttributeError: closed meanwhile
            raise SinkUnavailable(f"Kafka broker unreachable: {exc}") from None

    def _on_error(self, err: KafkaError) -> None:
        self._stats.producer_errors += 1
        if err.fatal():  # (confluent-kafka raises a fatal error instead: see _failure)
            self.fatal_error, self._fatal = err.str(), err
        now = time.monotonic()
        if err.fatal() or now - self._last_error_log >= _ERROR_LOG_INTERVAL:
            self._last_error_log = now
            log.warning(
                "kafka client error", extra={"fields": {"error": err.str(), "code": err.name()}}
            )
