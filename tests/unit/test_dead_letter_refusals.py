"""A dead-letter record Kafka refuses *asynchronously* (the broker's limit is lower than the
producer's) is sent again smaller, down to its metadata; when even that is refused, the relay stops
without confirming past the row. The test broker enforces no per-topic size limit, so this part of
the poison policy is driven here with a stand-in producer and hand-made delivery reports; the
synchronous refusals run against the real broker in tests/integration/test_hostile_rows.py."""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import KafkaError

from cdc_relay.config import load_settings
from cdc_relay.errors import ConfigError, RelayError, StopSession
from cdc_relay.observability.stats import RelayStats
from cdc_relay.poison import PoisonPolicyHandler, RefusedRecord
from cdc_relay.publisher import DeliveryTracker
from cdc_relay.reconcile import POSITION_HEADER, ReadBack, reconcile
from cdc_relay.watermark import PendingTransaction, Watermark

DEAD_LETTER = "dead"
POSITION = b"slot_a/64/1"


class _Producer:
    """Records what is produced; each record's delivery report is sent by the test."""

    def __init__(self) -> None:
        self.produced: list[dict[str, Any]] = []

    def produce(
        self,
        topic: str,
        value: bytes | None,
        key: bytes | None,
        headers: list[tuple[str, bytes]],
        on_delivery: Any,
    ) -> None:
        self.produced.append(
            {"topic": topic, "value": value, "key": key, "headers": headers, "report": on_delivery}
        )

    def poll(self, timeout: float) -> int:
        return 0


class _Relay:
    def __init__(self) -> None:
        self.failed: RelayError | None = None

    def fail(self, error: RelayError) -> None:
        self.failed = error


class _Error:
    def __init__(self, code: int) -> None:
        self._code = code

    def code(self) -> int:
        return self._code

    def str(self) -> str:
        return "Broker: Message size too large"


class _Message:
    def __init__(self, record: dict[str, Any]) -> None:
        self._record = record

    def key(self) -> bytes | None:
        return self._record["key"]  # type: ignore[no-any-return]

    def value(self) -> bytes | None:
        return self._record["value"]  # type: ignore[no-any-return]

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return 7


class _Policy:
    """The poison policy over the stand-in producer, as a session wires it."""

    def __init__(self) -> None:
        self.producer, self.relay = _Producer(), _Relay()
        self.stats = RelayStats()
        self.tracker = DeliveryTracker(self.stats)
        settings = load_settings(
            database_url="postgresql://relay@db/app",
            kafka_bootstrap_servers="k:9092",
            dead_letter_topic=DEAD_LETTER,
        )
        self.handler = PoisonPolicyHandler(
            settings,
            self.producer,
            self.tracker,
            ensure_topic=lambda topic: None,
            fail=self.relay.fail,
            wait_for_room=lambda: None,
        )

    def refuse_row(self, txn: PendingTransaction, position: bytes = POSITION) -> None:
        self.handler.refuse(
            RefusedRecord(
                txn=txn,
                table="public.outbox",
                reason="too large",
                code="MSG_SIZE_TOO_LARGE",
                event_id="e-1",
                topic="orders",
                key=b"key",
                value=b"value" * 100,
                headers=[("id", b"e-1"), ("h", b"x" * 50), (POSITION_HEADER, position)],
            )
        )

    def broker_refuses(self, record: dict[str, Any]) -> None:
        """The broker's report for ``record``, handled as the session handles a permanent one."""
        record["report"](_Error(KafkaError.MSG_SIZE_TOO_LARGE), _Message(record))
        for failure in self.tracker.take_failures():
            assert failure.permanent
            self.handler.refused_delivery(failure)


def test_a_refused_dead_letter_is_sent_again_smaller_until_it_is_acknowledged() -> None:
    policy = _Policy()
    producer = policy.producer
    watermark = Watermark(0)
    txn = watermark.open(100)
    policy.refuse_row(txn)
    watermark.seal(txn, 200)
    assert txn.pending == 1
    assert producer.produced[-1]["topic"] == DEAD_LETTER
    assert producer.produced[-1]["value"] == b"value" * 100

    policy.broker_refuses(producer.produced[-1])
    second = producer.produced[-1]
    assert second["value"] is None
    assert second["key"] == b"key"
    assert ("h", b"x" * 50) in second["headers"]
    assert ("cdc_relay.value_size", b"500") in second["headers"]
    assert txn.pending == 1

    policy.broker_refuses(second)
    third = producer.produced[-1]
    assert [name for name, _ in third["headers"] if not name.startswith("cdc_relay.")] == []
    assert ("cdc_relay.dropped", b"value,headers") in third["headers"]
    assert watermark.advance() == 0, "not confirmed while no copy is acknowledged"

    third["report"](None, _Message(third))
    assert txn.pending == 0
    assert policy.stats.dead_lettered == 1
    assert watermark.advance() == 200
    assert len(producer.produced) == 3


def test_when_not_even_the_metadata_is_accepted_the_relay_stops_short_of_the_row() -> None:
    policy = _Policy()
    producer, relay = policy.producer, policy.relay
    watermark = Watermark(0)
    txn = watermark.open(100)
    policy.refuse_row(txn)
    watermark.seal(txn, 200)
    for _ in range(3):  # whole, without value, without headers
        policy.broker_refuses(producer.produced[-1])
    metadata_only = producer.produced[-1]
    assert metadata_only["key"] is None
    assert ("cdc_relay.dropped", b"metadata") in metadata_only["headers"]
    with pytest.raises(StopSession):
        policy.broker_refuses(metadata_only)
    assert isinstance(relay.failed, ConfigError)
    assert DEAD_LETTER in str(relay.failed)
    assert txn.pending == 1, "the transaction never completes"
    assert watermark.advance() == 0
    assert policy.stats.dead_lettered == 0


def test_every_form_of_a_dead_letter_keeps_the_relays_position() -> None:
    policy = _Policy()
    producer = policy.producer
    txn = Watermark(0).open(100)
    policy.refuse_row(txn)
    for _ in range(3):  # whole, without value, without headers, metadata only
        policy.broker_refuses(producer.produced[-1])
    assert ("cdc_relay.dropped", b"metadata") in producer.produced[-1]["headers"]
    for form in producer.produced:
        assert [v for n, v in form["headers"] if n == POSITION_HEADER] == [POSITION], form
        # ...so that the read-back at a start knows it for the relay's, whatever was cut.
        acked = ReadBack("dead", 0, 0, (("id", b"a"), (POSITION_HEADER, b"slot_a/32/1")))
        letter = ReadBack("dead", 0, 1, tuple(form["headers"]))
        result = reconcile("slot_a", 0x40 - 1, {("dead", 0): 0}, {("dead", 0): [acked, letter]},
                           [("dead", 0)])  # fmt: skip
        assert result.doubt is None
        assert result.in_kafka(POSITION, "e-1")
