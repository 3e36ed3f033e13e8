"""A Kafka commit's outcome, and what the next session does with it (exactly once).

A commit librdkafka calls aborted did not commit: the next session of the leadership resumes at
the committed position and sends it again, reading nothing back. Any other end of a commit — timed
out for good while the broker did not answer, or given up at a stop's deadline — may have come
after the broker took it: its outcome is unknown, and the next session must settle it before it
sends anything (a new producer's fence, then the read-back) instead of resuming carried, which
would send a committed transaction twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import pytest
from confluent_kafka import KafkaError

from cdc_relay.config import Settings
from cdc_relay.errors import SinkUnavailable, SourceUnavailable, StopSession
from cdc_relay.kafka_transaction import KafkaTransaction, Resend
from cdc_relay.observability.stats import RelayStats
from cdc_relay.reconcile import Offsets, Reconciliation
from cdc_relay.relay import Relay
from cdc_relay.start import Started
from cdc_relay.transaction_errors import TransactionAborted, transaction_failure
from tests.fakes import FakeLeadership, FakeStart, FakeStartDatabase, FakeStream
from tests.unit.test_kafka_transaction import Sink, _transaction, _window


def _commit_failing_with(window: KafkaTransaction, sink: Sink, error: BaseException) -> None:
    def failing(serve: Callable[[], None]) -> None:
        serve()
        raise error

    sink.commit_transaction = failing  # type: ignore[method-assign]
    with pytest.raises(type(error)):
        window.commit()


@pytest.mark.parametrize(
    "error",
    [
        transaction_failure(KafkaError(KafkaError._TIMED_OUT, retriable=True), "committing"),
        SourceUnavailable("the slot's status could not be sent while the commit waited"),
        StopSession(),  # a stop's deadline passed while the commit waited
    ],
    ids=["timed out for good", "the loop's duties failed", "a stop's deadline"],
)
def test_a_commit_ended_without_an_answer_is_left_unsettled(error: BaseException) -> None:
    window, sink, clock, watermark = _window()
    _transaction(window, watermark, 100, 3)
    clock.now += 1
    _commit_failing_with(window, sink, error)
    assert window.resend.unsettled
    assert watermark.advance() == 0  # nothing of it confirmed


def test_a_commit_librdkafka_calls_aborted_is_settled() -> None:
    aborted = transaction_failure(
        KafkaError(KafkaError._INCONSISTENT, txn_requires_abort=True), "committing"
    )
    assert isinstance(aborted, TransactionAborted)
    window, sink, clock, watermark = _window()
    _transaction(window, watermark, 100, 3)
    clock.now += 1
    _commit_failing_with(window, sink, aborted)
    assert not window.resend.unsettled  # the next session resumes carried and sends it again
    assert watermark.advance() == 0


def test_a_clean_stop_does_not_commit_again_what_it_left_unsettled() -> None:
    window, sink, clock, watermark = _window()
    _transaction(window, watermark, 100, 3)
    clock.now += 1
    _commit_failing_with(window, sink, StopSession())
    window.end()  # the clean stop's end: abandons, the next start settles it
    assert sink.calls == ["begin", "abort"]
    assert watermark.advance() == 0


def test_the_session_a_settling_read_back_starts_inherits_no_unsettled_commit() -> None:
    resend = Resend()
    resend.note_committed(b"s/100/", 2, 0x100)
    resend.unsettled = True
    kept = resend.from_position(0x100)
    assert kept.committed == resend.committed
    assert not kept.unsettled


# -- the relay: the next session fences and reads back ----------------------------------------


class FencingPublisher:
    """The transactional producer, as the relay builds it: its fences (init_transactions)."""

    made: ClassVar[list[FencingPublisher]] = []

    def __init__(self, config: dict[str, str], stats: RelayStats, transactional_id: str) -> None:
        self.fenced = 0
        self.closed = False
        FencingPublisher.made.append(self)

    def init_transactions(self, serve: Callable[[], None]) -> None:
        self.fenced += 1

    def close(self) -> None:
        self.closed = True


class CarryingStart(FakeStart):
    """A start whose session resumes at the position the previous one carried."""

    def __init__(self) -> None:
        super().__init__([])
        self.resumes_carried = True
        self.read_backs = 0

    @contextmanager
    def session(self) -> Iterator[Started]:
        raise AssertionError("driven through _fence_then_read_back only")
        yield

    def read_back(
        self, started: Started, meanwhile: Callable[[], None]
    ) -> tuple[Reconciliation | None, Offsets | None]:
        self.read_backs += 1
        return Reconciliation(), started.noted


def _settings() -> Settings:
    return Settings.model_validate(
        {
            "database_url": "postgresql://relay@127.0.0.1:1/app",
            "kafka_bootstrap_servers": "127.0.0.1:1",
            "exactly_once": True,
            "http_port": 0,
            "sweep_interval": 0,
        }
    )


def _next_session(monkeypatch: pytest.MonkeyPatch, previous: Resend) -> tuple[Relay, Any]:
    monkeypatch.setattr("cdc_relay.publisher.Publisher", FencingPublisher)
    FencingPublisher.made = []
    leadership = FakeLeadership()
    start = CarryingStart()
    relay = Relay(_settings(), leadership=leadership, start=start)
    old = FencingPublisher({}, relay.stats, "cdc-relay.1.slot")  # the last session's producer
    relay._publisher = old  # type: ignore[assignment]
    relay._resend = previous
    database = FakeStartDatabase(leadership)
    stream = FakeStream(0x100, database.timeline())
    started = Started(database, database.store(), stream, 0x100, {("t", 0): 4}, None)
    relay._fence_then_read_back(started)
    return relay, start


def test_after_a_commit_of_unknown_outcome_the_next_session_fences_and_reads_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    previous = Resend()
    previous.unsettled = True
    relay, start = _next_session(monkeypatch, previous)
    old, new = FencingPublisher.made
    assert old.closed, "the producer of the unknown commit is dropped"
    assert new.fenced == 1, "a new producer's init_transactions fences before the read-back"
    assert relay._publisher is new  # type: ignore[comparison-overlap]
    assert start.read_backs == 1, "settled by a read-back, not resumed carried"


def test_after_an_aborted_commit_the_next_session_resumes_carried(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, start = _next_session(monkeypatch, Resend())
    assert start.read_backs == 0


def test_a_stop_while_the_fence_waits_ends_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    class Waiting(FencingPublisher):
        def init_transactions(self, serve: Callable[[], None]) -> None:
            while True:  # the broker does not answer: librdkafka's call resumed, serving
                serve()

    previous = Resend()
    previous.unsettled = True
    monkeypatch.setattr("cdc_relay.publisher.Publisher", Waiting)
    relay = Relay(_settings(), leadership=FakeLeadership(), start=CarryingStart())
    relay._resend = previous
    relay.request_stop()
    database = FakeStartDatabase(FakeLeadership())
    stream = FakeStream(0x100, database.timeline())
    with pytest.raises(StopSession):
        relay._fence_then_read_back(Started(database, database.store(), stream, 0x100, {}, None))
    assert relay._publisher is None


def test_a_sink_unavailable_commit_is_no_abort_unless_librdkafka_says_so() -> None:
    assert not isinstance(SinkUnavailable("x"), TransactionAborted)
    timed_out = transaction_failure(KafkaError(KafkaError._TIMED_OUT), "committing")
    assert type(timed_out) is SinkUnavailable
