"""DeliveryTracker's accounting per record, with the latency histogram fed per transaction."""

from __future__ import annotations

from types import MethodType

from cdc_relay.observability.stats import RelayStats
from cdc_relay.publisher import DeliveryTracker
from cdc_relay.watermark import PendingTransaction
from tests.fakes import DeliveredMessage, Record

TOPIC = "outbox.event.order"


def _produce(tracker: DeliveryTracker, txn: PendingTransaction, count: int) -> list[Record]:
    records = []
    for i in range(count):
        headers = [("id", b"%d" % i)]
        bound = (txn, "public.outbox", TOPIC, headers)
        records.append(Record(TOPIC, b"{}", b"k", headers, MethodType(tracker.on_delivery, bound)))
        txn.produced()
    return records


def _acknowledge(records: list[Record]) -> None:
    for offset, record in enumerate(records):
        record.offset = offset
        record.on_delivery(None, DeliveredMessage(record))


def test_every_acknowledged_event_is_counted_and_observed_once() -> None:
    stats = RelayStats()
    tracker = DeliveryTracker(stats)
    txn = PendingTransaction(100, commit_time=0.0)
    first = _produce(tracker, txn, 3)
    _acknowledge(first[:2])  # acknowledged while the transaction still has records in flight
    assert (stats.latency.count, tracker.acked, txn.pending) == (0, 2, 1)
    _acknowledge(first[2:])  # the last one in flight: the three are observed at once
    assert (stats.latency.count, tracker.acked, txn.pending) == (3, 3, 0)
    later = _produce(tracker, txn, 2)  # the transaction goes on after all was acknowledged
    _acknowledge(later)
    assert stats.latency.count == 5
    assert stats.published_by_topic[TOPIC] == 5
    assert sum(stats.latency.counts) == 5
    # Two observations (commit time 0: each is "now"), standing for 3 and 2 events.
    assert 5 * stats.latency.min <= stats.latency.sum <= 5 * stats.latency.max
    assert txn.offsets == {(TOPIC, 0): 1}  # the highest offset the partition acknowledged


def test_a_session_counts_its_own_acknowledgements_dead_letters_included() -> None:
    """A new session's tracker starts at zero whatever the relay counted before it, and counts
    published and dead-lettered records alike (the confirmer and the stall monitor compare it)."""
    stats = RelayStats()
    stats.published_by_topic[TOPIC] = 7
    stats.dead_lettered = 2
    tracker = DeliveryTracker(stats)
    assert tracker.acked == 0
    txn = PendingTransaction(100, commit_time=0.0)
    records = _produce(tracker, txn, 3)
    headers = [("id", b"x")]
    bound = (txn, "public.outbox", "dead.letters", headers)
    records.append(
        Record(
            "dead.letters", b"{}", b"k", headers,
            MethodType(tracker.on_dead_letter_delivery, bound),
        )
    )  # fmt: skip
    txn.produced()
    _acknowledge(records)
    assert tracker.acked == 4
    assert (stats.published, stats.dead_lettered, txn.pending) == (10, 3, 0)
