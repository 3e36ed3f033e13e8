"""When a Kafka transaction commits, and what the watermark may confirm meanwhile (exactly once)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cdc_relay.errors import SinkUnavailable
from cdc_relay.kafka_transaction import SPLIT_FACTOR, KafkaTransaction, Resend
from cdc_relay.reconcile import position_prefix
from cdc_relay.watermark import Watermark


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Sink:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.fail_commit = False

    def begin_transaction(self) -> None:
        self.calls.append("begin")

    def commit_transaction(self, serve: Callable[[], None]) -> None:
        serve()
        if self.fail_commit:
            raise SinkUnavailable("committing a Kafka transaction failed")
        self.calls.append("commit")

    def abort_transaction(self) -> bool:
        self.calls.append("abort")
        return True


def _window(
    max_events: int = 100, interval: float = 0.1, split_after: float = 30.0
) -> tuple[KafkaTransaction, Sink, Clock, Watermark]:
    sink, clock = Sink(), Clock()
    window = KafkaTransaction(
        sink,
        Resend(),
        interval=interval,
        max_events=max_events,
        split_after=split_after,
        clock=clock,
    )
    return window, sink, clock, Watermark(0)


def _transaction(window: KafkaTransaction, watermark: Watermark, lsn: int, events: int) -> bool:
    """One PostgreSQL transaction of ``events`` acknowledged events: True when the window is due."""
    txn = watermark.open(lsn, position=position_prefix("s", lsn))
    window.join(txn)
    for _ in range(events):
        txn.events += 1
        txn.produced()
        txn.acknowledged()
    watermark.seal(txn, lsn + 8)
    return window.sealed(txn)


def _noop() -> None:
    return None


def test_acknowledged_transactions_are_confirmed_only_once_their_kafka_transaction_committed() -> (
    None
):
    window, sink, clock, watermark = _window()
    assert not _transaction(window, watermark, 100, 3)
    assert not _transaction(window, watermark, 200, 2)
    assert watermark.advance() == 0  # every record acknowledged, nothing committed
    assert sink.calls == ["begin"]  # one Kafka transaction for both
    clock.now += 0.125
    assert window.due()
    window.commit()
    assert sink.calls == ["begin", "commit"]
    assert watermark.advance() == 208


def test_the_event_bound_makes_it_due_at_the_next_commit() -> None:
    window, _, _, watermark = _window(max_events=5)
    assert not _transaction(window, watermark, 100, 4)
    assert _transaction(window, watermark, 200, 1)


def test_it_never_commits_inside_a_postgresql_transaction() -> None:
    window, sink, clock, watermark = _window()
    txn = watermark.open(100)
    window.join(txn)
    clock.now += 10
    with pytest.raises(AssertionError):
        window.commit()
    assert sink.calls == ["begin"]


def test_a_failed_commit_releases_nothing() -> None:
    window, sink, clock, watermark = _window()
    _transaction(window, watermark, 100, 3)
    sink.fail_commit = True
    clock.now += 1
    with pytest.raises(SinkUnavailable):
        window.commit()
    assert watermark.advance() == 0
    window.abandon()
    assert sink.calls == ["begin", "abort"]
    assert watermark.advance() == 0  # still held: the next session sends it again


def test_transactions_without_events_are_released_without_a_kafka_commit() -> None:
    window, sink, clock, watermark = _window()
    _transaction(window, watermark, 100, 0)
    clock.now += 1
    window.commit()
    assert sink.calls == ["begin"]  # begun, empty: kept for the next
    assert watermark.advance() == 108
    _transaction(window, watermark, 200, 1)
    clock.now += 1
    window.commit()
    assert sink.calls == ["begin", "commit"]


def test_a_too_large_transaction_is_split_and_its_committed_part_noted() -> None:
    window, sink, clock, watermark = _window(max_events=2)
    txn = watermark.open(100, position=position_prefix("s", 100))
    window.join(txn)
    for _ in range(2 * SPLIT_FACTOR):
        txn.events += 1
        txn.produced()
        txn.acknowledged()
    assert window.too_large()
    window.split()
    assert sink.calls == ["begin", "commit", "begin"]
    assert watermark.advance() == 0  # the transaction is not whole yet
    assert window.resend.in_kafka(position_prefix("s", 100) + b"20", None)
    assert not window.resend.in_kafka(position_prefix("s", 100) + b"21", None)
    assert not window.too_large()  # counted from the split
    txn.events += 1
    txn.produced()
    txn.acknowledged()
    watermark.seal(txn, 108)
    assert not window.sealed(txn)  # one event since the split: under the bound
    clock.now += 1
    assert window.due()
    window.commit()
    assert watermark.advance() == 108


def test_a_transaction_open_for_half_the_transaction_timeout_is_split() -> None:
    window, _, clock, watermark = _window(split_after=30.0)
    txn = watermark.open(100)
    window.join(txn)
    assert not window.too_large()
    clock.now += 30
    assert window.too_large()


def test_a_resend_keeps_only_what_a_start_has_not_passed() -> None:
    resend = Resend()
    resend.note_committed(position_prefix("s", 100), 5, 100)
    resend.note_refused(position_prefix("s", 300) + b"2", 10, "too large", 300)
    assert resend.found
    assert resend.highest_lsn == 300
    later = resend.from_position(200)
    assert not later.in_kafka(position_prefix("s", 100) + b"1", None)
    assert later.refused(position_prefix("s", 300) + b"2") == (10, "too large")
    assert later.refused(position_prefix("s", 300) + b"3") is None
    assert not resend.from_position(301).found


@given(st.integers(min_value=1, max_value=10**6), st.integers(min_value=0, max_value=10**6))
def test_a_committed_part_covers_exactly_its_ordinals(committed: int, ordinal: int) -> None:
    resend = Resend()
    prefix = position_prefix("slot_a", 0x16B3748)
    resend.note_committed(prefix, committed, 0x16B3748)
    position = prefix + str(ordinal).encode()
    assert resend.in_kafka(position, "id") == (ordinal <= committed)
    assert not resend.in_kafka(position_prefix("slot_a", 0x16B3749) + b"1", "id")
