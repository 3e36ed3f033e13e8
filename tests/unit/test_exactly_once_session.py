"""The session publishing exactly once, over fakes: records go out inside Kafka transactions, the
slot is confirmed only up to what committed, and a failed, aborted or fenced transaction confirms
nothing of it and is sent again (what a re-send skips and dead-letters: its notes)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from confluent_kafka import KafkaError

from cdc_relay.errors import LeadershipLost, SinkUnavailable, StopSession
from cdc_relay.kafka_transaction import Resend
from cdc_relay.reconcile import POSITION_HEADER, position_prefix
from cdc_relay.session import HOUSEKEEPING_SPACING
from tests.fakes import FakeSink, FakeSource, Record
from tests.unit.test_session import DEAD_LETTER, FRAMES, TOPIC_CITY, TOPIC_ORDER, Harness, _commits

LONG = 60.0  # a transaction interval no test reaches: commits only where the test says


def test_records_go_out_in_one_kafka_transaction_confirmed_once_it_committed() -> None:
    harness = Harness(FRAMES, exactly_once=True, transaction_interval=LONG)
    with pytest.raises(StopSession):
        harness.session.stream()
    harness.session.housekeeping()
    assert len(harness.sink.delivered) == 2  # acknowledged, but not committed
    assert harness.store.saved == []
    assert harness.sink.committed == []
    harness.session.shutdown()  # a clean stop commits between transactions
    assert harness.sink.transaction_calls == ["begin", "commit"]
    assert [r.topic for r in harness.sink.committed] == [TOPIC_ORDER, TOPIC_CITY]
    assert harness.store.saved[-1] == _commits(FRAMES)[-1]
    records = [e for e in harness.journal if e[0] == "record"]
    assert records, "the record is written before the slot is told"
    assert harness.journal.index(records[-1]) < len(harness.journal) - 1


def test_the_latency_of_an_event_is_observed_when_its_kafka_transaction_commits() -> None:
    harness = Harness(FRAMES, exactly_once=True, transaction_interval=LONG)
    with pytest.raises(StopSession):
        harness.session.stream()
    harness.session.housekeeping()
    assert len(harness.sink.delivered) == 2
    assert harness.stats.latency.count == 0  # acknowledged, not yet visible to read_committed
    harness.session.shutdown()
    assert harness.stats.latency.count == 2
    assert harness.stats.kafka_transactions_committed == 1
    assert harness.stats.snapshot()["kafka_transactions_aborted"] == 0


def test_with_the_setting_off_no_transaction_is_begun() -> None:
    harness = Harness(FRAMES)
    harness.run()
    assert harness.sink.transaction_calls == []
    assert harness.store.saved[-1] == _commits(FRAMES)[-1]


def test_a_due_transaction_commits_at_the_postgresql_commit() -> None:
    harness = Harness(
        FRAMES, exactly_once=True, transaction_interval=0.001, transaction_max_events=1
    )
    harness.run()
    assert harness.sink.transaction_calls == ["begin", "commit", "begin", "commit"]
    assert harness.store.saved[-1] == _commits(FRAMES)[-1]


def test_a_failed_commit_confirms_nothing_of_it_and_ends_the_session() -> None:
    harness = Harness(FRAMES, exactly_once=True, transaction_max_events=1)
    harness.sink.commit_fails_with = KafkaError._TIMED_OUT
    with pytest.raises(SinkUnavailable, match="committing"):
        harness.session.stream()
    assert harness.session.window is not None
    harness.session.window.abandon()
    assert harness.sink.transaction_calls == ["begin", "abort"]
    assert harness.sink.committed == []
    assert harness.store.saved == []
    assert harness.session.confirmer.acknowledged() == 0  # what the next session resumes at
    assert (
        harness.stats.kafka_transactions_committed,
        harness.stats.kafka_transactions_aborted,
    ) == (0, 1)


def test_a_fenced_commit_is_a_lost_leadership_that_confirms_nothing() -> None:
    harness = Harness(FRAMES, exactly_once=True, transaction_max_events=1)
    harness.sink.commit_fails_with = KafkaError.PRODUCER_FENCED
    with pytest.raises(LeadershipLost, match="fenced"):
        harness.session.stream()
    assert harness.store.saved == []


def test_a_record_refused_by_a_fencing_broker_is_a_lost_leadership() -> None:
    harness = Harness(FRAMES, exactly_once=True, transaction_interval=LONG)
    harness.sink.acknowledging = False
    with pytest.raises(StopSession):
        harness.session.stream()
    harness.sink.fail_in_flight(KafkaError.PRODUCER_FENCED, "Broker: producer fenced")
    with pytest.raises(LeadershipLost):
        harness.session.housekeeping()
    assert harness.store.saved == []


def test_a_record_refused_for_good_aborts_and_is_dead_lettered_when_sent_again() -> None:
    first = Harness(FRAMES, exactly_once=True, transaction_interval=LONG)
    first.sink.acknowledging = False
    with pytest.raises(StopSession):
        first.session.stream()
    first.sink.fail_in_flight(KafkaError.MSG_SIZE_TOO_LARGE, "Broker: message too large")
    with pytest.raises(SinkUnavailable, match="inside a Kafka transaction"):
        first.session.housekeeping()
    assert first.store.saved == []
    assert first.sink.on_topic(DEAD_LETTER) == []  # not in the aborted transaction

    again = Harness(
        FRAMES, exactly_once=True, transaction_interval=LONG, resend=first.session.resend
    )
    again.run()
    letters = again.sink.on_topic(DEAD_LETTER)
    assert [r.header("cdc_relay.topic") for r in letters] == [
        TOPIC_ORDER.encode(),
        TOPIC_CITY.encode(),
    ]
    assert {r.header("cdc_relay.error_code") for r in letters} == {b"MSG_SIZE_TOO_LARGE"}
    assert again.sink.on_topic(TOPIC_ORDER) == []
    assert set(map(id, letters)) <= set(map(id, again.sink.committed))
    assert again.store.saved[-1] == _commits(FRAMES)[-1]


def test_a_resend_skips_the_committed_part_of_a_split_transaction() -> None:
    first_lsn = 0
    harness = Harness(FRAMES, exactly_once=True, transaction_interval=LONG)
    with pytest.raises(StopSession):
        harness.session.stream()
    harness.session.housekeeping()
    positions = [r.header(POSITION_HEADER) for r in harness.sink.delivered]
    assert positions[0] is not None
    first_lsn = int(positions[0].split(b"/")[1], 16)
    resend = Resend()
    resend.note_committed(position_prefix("cdc_relay", first_lsn), 1, first_lsn)
    again = Harness(FRAMES, exactly_once=True, transaction_interval=LONG, resend=resend)
    again.run()
    assert [r.topic for r in again.sink.committed] == [TOPIC_CITY]
    assert again.stats.skipped_in_kafka == 1
    assert again.store.saved[-1] == _commits(FRAMES)[-1]


GAP = b""  # the source has nothing more for a moment: the loop's housekeeping runs


class GappySource(FakeSource):
    def read(self) -> memoryview | None:
        if self.frames and self.frames[0] == GAP:
            self.frames.pop(0)
            time.sleep(HOUSEKEEPING_SPACING * 2)  # so the loop's housekeeping runs now
            return None
        return super().read()


class FailingSecondCommit(FakeSink):
    def commit_transaction(self, serve: Callable[[], None]) -> None:
        if self.transaction_calls.count("commit") == 1:
            self.commit_fails_with = KafkaError._TIMED_OUT
        super().commit_transaction(serve)


def _large_transaction(before: int, after: int) -> list[bytes]:
    """One PostgreSQL transaction of ``before + after`` events, a pause of the stream between."""
    relation, begin, insert, commit = FRAMES[:4]
    return [relation, begin, *[insert] * before, GAP, *[insert] * after, commit]


def _ordinals(records: list[Record]) -> list[int]:
    return [int((r.header(POSITION_HEADER) or b"").rsplit(b"/", 1)[1]) for r in records]


def test_a_too_large_transaction_is_split_at_a_tick_and_confirmed_when_whole() -> None:
    harness = Harness(
        _large_transaction(25, 5),
        source_type=GappySource,
        exactly_once=True,
        transaction_interval=LONG,
        transaction_max_events=1,  # split past 10 events
    )
    harness.run()
    assert harness.sink.transaction_calls == ["begin", "commit", "begin", "commit"]
    assert _ordinals(harness.sink.committed) == list(range(1, 31))
    assert harness.store.saved[-1] == _commits(FRAMES[:4])[-1]


def test_a_split_transaction_sent_again_skips_its_committed_part() -> None:
    frames = _large_transaction(25, 5)
    settings: dict[str, Any] = {
        "exactly_once": True,
        "transaction_interval": LONG,
        "transaction_max_events": 1,
    }
    first = Harness(frames, source_type=GappySource, sink=FailingSecondCommit(), **settings)
    with pytest.raises(SinkUnavailable):
        first.session.stream()
    assert first.session.window is not None
    first.session.window.abandon()
    assert first.sink.transaction_calls == ["begin", "commit", "begin", "abort"]
    assert _ordinals(first.sink.committed) == list(range(1, 26))
    assert first.store.saved == []  # the transaction is not whole: nothing of it confirmed

    again = Harness(frames, source_type=GappySource, resend=first.session.resend, **settings)
    again.run()
    assert _ordinals(again.sink.committed) == list(range(26, 31))  # the rest, once
    assert again.stats.skipped_in_kafka == 25
    assert again.store.saved[-1] == _commits(FRAMES[:4])[-1]


class UnansweredSink(FakeSink):
    """The broker took the commit and does not answer: librdkafka's commit is resumed, serving
    the loop, until the transaction timeout (short here)."""

    TRANSACTION_TIMEOUT = 3.0

    def commit_transaction(self, serve: Callable[[], None]) -> None:
        deadline = time.monotonic() + self.TRANSACTION_TIMEOUT
        while time.monotonic() < deadline:
            serve()
            time.sleep(0.01)
        raise SinkUnavailable("committing a Kafka transaction failed: timed out")


def test_a_stop_gives_a_commit_without_an_answer_up_at_its_deadline() -> None:
    harness = Harness(
        FRAMES, exactly_once=True, transaction_interval=LONG, shutdown_timeout=0.2,
        sink=UnansweredSink(),
    )  # fmt: skip
    with pytest.raises(StopSession):
        harness.session.stream()
    started = time.monotonic()
    harness.session.shutdown()  # the clean stop's commit: no answer comes
    assert time.monotonic() - started < 1.0, "within CDC_RELAY_SHUTDOWN_TIMEOUT, not the commit's"
    assert harness.session.resend.unsettled, "its outcome is unknown: the next start settles it"
    assert harness.store.saved == []  # nothing of it confirmed
    assert harness.sink.transaction_calls == ["begin", "abort"]
