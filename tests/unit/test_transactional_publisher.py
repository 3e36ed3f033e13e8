"""The publisher's transactional calls: a timed-out call is resumed while the loop's duties are
served, and every other error ends in the relay's own (transaction_errors' one table)."""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from cdc_relay.errors import ConfigError, LeadershipLost, SinkUnavailable
from cdc_relay.observability.stats import RelayStats
from cdc_relay.publisher import Publisher
from cdc_relay.transaction_errors import ACL_FIX


class Producer:
    """librdkafka's transactional calls, failing with ``errors`` one call at a time."""

    def __init__(self, errors: list[KafkaError]) -> None:
        self.errors = list(errors)
        self.calls = 0

    def call(self, timeout: float = 0) -> int:
        self.calls += 1
        if self.errors:
            raise KafkaException(self.errors.pop(0))
        return 0

    init_transactions = commit_transaction = abort_transaction = poll = call

    def flush(self, timeout: float = 0) -> int:
        return 0

    def purge(self, **_: Any) -> None:
        return None

    def close(self) -> bool:
        return True


def _publisher(errors: list[KafkaError]) -> tuple[Publisher, Producer]:
    publisher = Publisher(
        {"bootstrap.servers": "127.0.0.1:1", "transaction.timeout.ms": "60000"},
        RelayStats(),
        "cdc-relay.7300000000000000001.slot",
    )
    fake = Producer(errors)
    # The fake stands in for librdkafka's producer; the real one, unreferenced, goes.
    publisher._producer = fake  # type: ignore[assignment]
    publisher.produce_raw = lambda *args: None
    return publisher, fake


def test_a_timed_out_commit_is_resumed_while_the_loop_is_served() -> None:
    timed_out = KafkaError(KafkaError._TIMED_OUT, retriable=True)
    publisher, producer = _publisher([timed_out, timed_out])
    served: list[int] = []
    publisher.commit_transaction(lambda: served.append(1))
    assert producer.calls == 3
    assert served == [1, 1]


def test_a_commit_that_must_be_aborted_ends_the_session() -> None:
    publisher, _ = _publisher([KafkaError(KafkaError._TIMED_OUT, txn_requires_abort=True)])
    with pytest.raises(SinkUnavailable, match="committing"):
        publisher.commit_transaction(lambda: None)


def test_a_fenced_commit_is_a_lost_leadership() -> None:
    publisher, _ = _publisher([KafkaError(KafkaError.PRODUCER_FENCED)])
    with pytest.raises(LeadershipLost):
        publisher.commit_transaction(lambda: None)


def test_a_missing_acl_refuses_to_start_naming_the_fix() -> None:
    publisher, _ = _publisher([KafkaError(KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED)])
    with pytest.raises(ConfigError) as refused:
        publisher.init_transactions(lambda: None)
    assert ACL_FIX in str(refused.value)


def test_a_poll_that_raises_the_fence_is_a_lost_leadership() -> None:
    publisher, _ = _publisher([KafkaError(KafkaError._FENCED, fatal=True)])
    with pytest.raises(LeadershipLost):
        publisher.poll(0)


def test_an_abort_is_a_best_effort() -> None:
    publisher, _ = _publisher([KafkaError(KafkaError._TIMED_OUT, retriable=True)])
    assert publisher.abort_transaction() is False
    assert publisher.abort_transaction() is True


def _served_with_a_fence() -> SystemError:
    """What confluent-kafka raises from a call that served librdkafka's fatal error and then
    another callback: it raises the fatal error inside its error callback and leaves it set, so
    the next callback it calls (a delivery report) returns with an exception set: SystemError,
    raised from the fatal KafkaException."""
    try:
        raise KafkaException(
            KafkaError(KafkaError._FENCED, "fenced by a newer instance", fatal=True)
        )
    except KafkaException as fatal:
        try:
            raise SystemError(
                "<built-in method on_delivery> returned a result with an exception set"
            ) from fatal
        except SystemError as served:
            return served


class ServingProducer(Producer):
    """A producer whose calls that serve callbacks raise what a served fence raises."""

    def serve(self, timeout: float = 0) -> int:
        self.calls += 1
        raise _served_with_a_fence()

    init_transactions = commit_transaction = abort_transaction = poll = flush = serve


def _serving_publisher() -> Publisher:
    publisher, _ = _publisher([])
    publisher._producer = ServingProducer([])  # type: ignore[assignment]
    return publisher


def test_a_fence_served_with_delivery_reports_while_closing_is_not_raised() -> None:
    publisher = _serving_publisher()
    publisher.close()  # a fenced producer being closed: nothing to stand by for but the close
    assert publisher.fatal_error is not None
    assert "fenced" in publisher.fatal_error


def test_a_fence_served_with_delivery_reports_by_a_poll_is_a_lost_leadership() -> None:
    publisher = _serving_publisher()
    with pytest.raises(LeadershipLost, match="fenced"):
        publisher.poll(0)


def test_a_fence_served_with_delivery_reports_by_a_commit_is_a_lost_leadership() -> None:
    publisher = _serving_publisher()
    with pytest.raises(LeadershipLost, match="fenced"):
        publisher.commit_transaction(lambda: None)


def test_a_fence_served_with_delivery_reports_by_an_abort_is_a_failed_abort() -> None:
    publisher = _serving_publisher()
    assert publisher.abort_transaction() is False


def test_a_non_kafka_error_a_callback_raised_is_not_taken_for_a_fence() -> None:
    """A bug in a callback of ours is not disguised as an operating condition."""
    publisher, producer = _publisher([])

    def broken(timeout: float = 0) -> int:
        raise SystemError("returned a result with an exception set") from ValueError("a bug")

    producer.poll = broken  # type: ignore[method-assign]
    with pytest.raises(SystemError):
        publisher.poll(0)
