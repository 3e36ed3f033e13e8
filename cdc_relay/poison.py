"""What happens to a poison row: the one answer.

A record that can never be delivered as it is — a row that breaks the outbox contract, a record
librdkafka or the broker refuses permanently (too large, invalid topic, a topic the relay's rules
refuse) — ends in exactly one of two ways, chosen by ``CDC_RELAY_POISON_POLICY``:

- ``dead_letter``: a copy goes to ``CDC_RELAY_DEAD_LETTER_TOPIC`` with the ``cdc_relay.*``
  metadata headers (``cdc_relay.position`` among them, kept in every form), as much of the record
  as fits (:mod:`cdc_relay.dead_letter` shrinks it); its
  acknowledgement takes over the pending delivery of the original, so the position moves past the
  row only once the copy is in Kafka. It is logged when refused, and again once acknowledged.
- ``stop``: the row's transaction is held open for good (the watermark never passes it), the
  relay is told to fail with exit 5, and the session unwinds to its clean shutdown: nothing past
  the row is confirmed.

A dead-letter topic that cannot take even the metadata-only copy stops the relay the same way
(exit 2, naming the setting). Transient failures are not poison: they end the session instead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, NoReturn, Protocol

from cdc_relay.config import PoisonPolicy, Settings
from cdc_relay.dead_letter import ERROR_HEADER, DeadLetter, text_bytes
from cdc_relay.errors import (
    ConfigError,
    PoisonRecordError,
    RelayError,
    SinkUnavailable,
    StopSession,
)
from cdc_relay.logs import cut
from cdc_relay.lsn import format_lsn
from cdc_relay.outbox import RecordFields
from cdc_relay.publisher import (
    BoundRecord,
    DeliveryCallback,
    DeliveryFailure,
    DeliveryTracker,
    ProduceRefused,
    TransactionCallback,
    error_name,
)
from cdc_relay.reconcile import POSITION_HEADER
from cdc_relay.watermark import PendingTransaction

log = logging.getLogger(__name__)

MALFORMED = "MALFORMED_OUTBOX_ROW"  # error code of a row that breaks the outbox contract


@dataclass(frozen=True, kw_only=True)
class RefusedRecord:
    """A record Kafka will never accept as it is, with its source coordinates."""

    txn: PendingTransaction
    table: str
    reason: str
    code: str
    event_id: str | None = None
    topic: str | None = None
    key: bytes | None = None
    value: bytes | None = None
    headers: list[tuple[str, bytes]]
    too_large: bool = False

    @classmethod
    def of_failure(cls, failure: DeliveryFailure) -> RefusedRecord:
        """An event record the broker refused permanently after it was produced."""
        event_id = next(
            (v.decode("utf-8", "replace") for k, v in failure.headers if k == "id"), None
        )
        return cls(
            txn=failure.txn,
            table=failure.table,
            reason=failure.reason,
            code=error_name(failure.code),
            event_id=event_id,
            topic=failure.topic,
            key=failure.key,
            value=failure.value,
            headers=failure.headers,
            too_large=failure.too_large,
        )

    @classmethod
    def malformed(
        cls,
        txn: PendingTransaction,
        mapping: DescribedMapping,
        data: Any,
        reason: str,
        *,
        event_id: str | None,
        position: bytes,
    ) -> RefusedRecord:
        """A row (or message) that breaks the outbox contract: its dead-letter value is the row
        itself, as far as it can be described."""
        try:
            row: bytes | None = mapping.describe_row(data)
        except Exception as exc:  # the row is hostile to describing too: say so instead
            row = None
            reason = f"{reason} (the row cannot be described: {type(exc).__name__})"
        return cls(
            txn=txn,
            table=mapping.table,
            reason=reason,
            code=MALFORMED,
            event_id=event_id,
            value=row,
            headers=[(POSITION_HEADER, position)],
        )

    @classmethod
    def of_record(
        cls, txn: PendingTransaction, table: str, record: RecordFields, refused: ProduceRefused
    ) -> RefusedRecord:
        """A mapped record known to be refused (a re-send remembers the broker's refusal)."""
        topic, key, value, headers, event_id, _traceparent = record
        return cls(
            txn=txn,
            table=table,
            reason=refused.reason,
            code=refused.name,
            event_id=event_id,
            topic=topic,
            key=key,
            value=value,
            headers=headers,
            too_large=refused.too_large,
        )


class DescribedMapping(Protocol):
    """What a malformed row's dead letter needs of its mapping."""

    @property
    def table(self) -> str: ...

    def describe_row(self, data: Any) -> bytes: ...


# Publisher.produce's signature again, deliberately: the policy depends on this, not on the adapter.
class DeadLetterSink(Protocol):
    """What the policy needs of the Kafka adapter."""

    def produce(
        self,
        topic: str,
        value: bytes | None,
        key: bytes | None,
        headers: list[tuple[str, bytes]],
        on_delivery: DeliveryCallback,
    ) -> None: ...

    def poll(self, timeout: float) -> int: ...


class PoisonPolicyHandler:
    """Applies the poison policy to refused records and to refused dead-letter copies."""

    def __init__(
        self,
        settings: Settings,
        sink: DeadLetterSink,
        tracker: DeliveryTracker,
        *,
        ensure_topic: Callable[[str], None],
        fail: Callable[[RelayError], None],
        wait_for_room: Callable[[], None],
    ) -> None:
        self._stop = settings.poison_policy is PoisonPolicy.STOP
        self._topic = settings.dead_letter_topic
        self._sink = sink
        self._tracker = tracker
        self._ensure_topic = ensure_topic  # the session's: the topic must exist before producing
        self._fail = fail
        # The session's wait while the producer's queue is full: it serves the producer and
        # raises StopSession once a requested stop takes effect (a broker that never drains the
        # queue must not hold a SIGTERM here).
        self._wait_for_room = wait_for_room
        self._topic_ready = False

    def refuse(self, refused: RefusedRecord) -> None:
        """Dead-letter ``refused``, or (policy ``stop``) fail and raise StopSession."""
        txn = refused.txn
        commit_lsn = format_lsn(txn.commit_lsn)
        fields = {
            "event_id": cut(refused.event_id),
            "table": refused.table,
            "commit_lsn": commit_lsn,
            "topic": cut(refused.topic),
            "error": cut(refused.reason),
        }
        trace_id = _trace_id(refused.headers)
        if trace_id:
            fields["trace_id"] = trace_id
        if self._stop:
            txn.hold()
            log.error("poison record, stopping (poison policy: stop)", extra={"fields": fields})
            self._fail(
                PoisonRecordError(
                    f"Kafka refused event {cut(refused.event_id)} of {refused.table} at commit "
                    f"{commit_lsn} for topic {cut(refused.topic)!r}: {cut(refused.reason)}. "
                    "The relay stopped without confirming past it (CDC_RELAY_POISON_POLICY=stop)"
                )
            )
            raise StopSession
        # The position is the relay's, not the record's: metadata, which no shrinking drops, so
        # that the read-back at a start still knows the copy for this relay's (and its event).
        own = [(n, v) for n, v in refused.headers if n != POSITION_HEADER]
        position = [(n, v) for n, v in refused.headers if n == POSITION_HEADER][-1:]
        letter = DeadLetter.of(
            refused.key,
            refused.value,
            own,
            [
                (ERROR_HEADER, text_bytes(refused.reason)),
                ("cdc_relay.error_code", text_bytes(refused.code)),
                ("cdc_relay.commit_lsn", commit_lsn.encode()),
                ("cdc_relay.table", text_bytes(refused.table)),
                ("cdc_relay.event_id", text_bytes(refused.event_id or "")),
                ("cdc_relay.topic", text_bytes(refused.topic or "")),
                *position,
            ],
        )
        if refused.too_large:
            letter = letter.smaller() or letter  # the value cannot travel; its size is recorded
        log.error("poison record, sending it to the dead-letter topic", extra={"fields": fields})
        if not self._topic_ready:
            try:
                self._ensure_topic(self._topic)
            except ProduceRefused as exc:
                self._unusable(txn, exc.reason)
            self._topic_ready = True
        self._send(txn, refused.table, letter)

    def delivery_failed(self, failure: DeliveryFailure) -> None:
        """A delivery the broker refused: the session ends on a transient refusal (SinkUnavailable,
        the relay retries), a permanent one is the record's poison policy."""
        if not failure.permanent:
            if failure.dead_letter:
                raise SinkUnavailable(
                    f"the dead-letter topic {failure.topic!r} refused a record: {failure.reason}"
                )
            raise SinkUnavailable(f"delivery to {failure.topic!r} failed: {failure.reason}")
        self.refused_delivery(failure)

    def refused_delivery(self, failure: DeliveryFailure) -> None:
        """The broker refused a record permanently after it was produced."""
        failure.txn.refused()
        if not failure.dead_letter:
            self.refuse(RefusedRecord.of_failure(failure))
            return
        smaller = DeadLetter.split(failure.key, failure.value, failure.headers).smaller()
        if smaller is None:
            self._unusable(failure.txn, failure.reason)
        log.warning(
            "dead-letter record refused, sending a smaller one",
            extra={"fields": {"error": failure.reason, "dropped": smaller.stage}},
        )
        self._send(failure.txn, failure.table, smaller)

    def _send(self, txn: PendingTransaction, table: str, letter: DeadLetter) -> None:
        """Produce ``letter``, smaller each time librdkafka refuses it, down to its metadata."""
        topic = self._topic
        callback = self._tracker.on_dead_letter_delivery
        while True:
            headers = letter.all_headers
            on_delivery = partial(_delivered, callback, (txn, table, topic, headers))
            try:
                self._sink.produce(topic, letter.value, letter.key, headers, on_delivery)
                txn.produced()
                return
            except BufferError:
                self._wait_for_room()
                continue
            except ProduceRefused as exc:
                if not exc.permanent:
                    raise SinkUnavailable(
                        f"cannot write to the dead-letter topic {topic!r}: {exc.reason}"
                    ) from None
                reason = exc.reason
            smaller = letter.smaller()
            if smaller is None:
                self._unusable(txn, reason)
            log.warning(
                "dead-letter record refused, sending a smaller one",
                extra={"fields": {"error": reason, "dropped": smaller.stage}},
            )
            letter = smaller

    def _unusable(self, txn: PendingTransaction, reason: str) -> NoReturn:
        """Not even the metadata can be dead-lettered: stop without confirming past ``txn``."""
        txn.hold()
        self._fail(
            ConfigError(
                f"the dead-letter topic {self._topic!r} is unusable: {reason} "
                "(CDC_RELAY_DEAD_LETTER_TOPIC)"
            )
        )
        raise StopSession from None


def _delivered(callback: TransactionCallback, record: BoundRecord, err: Any, msg: Any) -> None:
    callback(record, err, msg)
    if err is None:
        topic, headers = record[2], record[3]
        event_id = next((v for n, v in reversed(headers) if n == "cdc_relay.event_id"), b"")
        log.info(
            "poison record sent to the dead-letter topic",
            extra={
                "fields": {
                    "event_id": cut(event_id.decode("utf-8", "replace")),
                    "topic": topic,
                    "partition": msg.partition(),
                    "offset": msg.offset(),
                }
            },
        )


def _trace_id(headers: list[tuple[str, bytes]]) -> str | None:
    """The W3C trace id of a record's ``traceparent`` header, for log lines."""
    for name, value in headers:
        if name == "traceparent":
            parts = value.decode("ascii", "replace").split("-")
            return parts[1] if len(parts) == 4 else None
    return None
