"""The C delivery callback (``_tuple_reader.Deliveries``) accounts every delivery report exactly as
its Python reference, ``DeliveryTracker``'s on_delivery, does: the transaction's pending count,
offsets and unobserved events, the per-topic counts, the latency histogram and the failures."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import MethodType
from typing import Any

import pytest
from confluent_kafka import Message
from hypothesis import given, settings
from hypothesis import strategies as st

from cdc_relay import publisher, watermark
from cdc_relay.observability.stats import RelayStats
from cdc_relay.publisher import DeliveryTracker
from cdc_relay.watermark import PendingTransaction
from tests.built_extension import load_tuple_reader
from tests.fakes import DeliveryError

TOPICS = ("outbox.event.order", "outbox.event.payment")
# The mypyc build's PendingTransaction is a compiled class without __slots__: the C callback
# refuses it and is never used there (test_it_needs_the_transactions_slots,
# test_the_tracker_uses_it_unless_pure_python_is_asked_for); its equivalence with the reference
# runs in the source tiers, where it is used.
COMPILED = not str(watermark.__file__).endswith(".py")
needs_slots = pytest.mark.skipif(
    COMPILED, reason="compiled PendingTransaction: the C callback is not used in this build"
)


READER = load_tuple_reader()


class OtherTransaction(PendingTransaction):
    """A subclass: its attributes could be anything, so the C callback leaves it to Python."""

    __slots__ = ()


class PythonReport:
    """A report type of Python's (the tests' fakes): its methods are looked up every time."""

    def __init__(self, partition: int, offset: int) -> None:
        self._partition, self._offset = partition, offset

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def key(self) -> bytes:
        return b"k"

    def value(self) -> bytes:
        return b"v"


@contextmanager
def _python_only() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(publisher, "_deliveries", None)
        yield


def _trackers() -> tuple[DeliveryTracker, DeliveryTracker]:
    """A tracker whose event callback is the C one (its reference the Python one of the same
    tracker), and a tracker with the Python callbacks only."""
    with _python_only():
        fast = DeliveryTracker(RelayStats())
        reference = DeliveryTracker(RelayStats())
    python_callback = fast.on_delivery
    stats = fast.stats
    fast.on_delivery = READER.Deliveries(
        PendingTransaction,
        stats.published_by_topic,
        stats.latency.observe,
        time.time,
        python_callback,
    )
    return fast, reference


def _state(tracker: DeliveryTracker, txns: list[PendingTransaction]) -> tuple[Any, ...]:
    stats = tracker.stats
    return (
        [(t.pending, t.unobserved, dict(t.offsets), t.done) for t in txns],
        dict(stats.published_by_topic),
        stats.latency.count,
        list(stats.latency.counts),
        stats.producer_errors,
        [(f.code, f.reason, f.topic, txns.index(f.txn), f.key, f.value) for f in tracker.failures],
    )


_REPORTS = st.tuples(
    st.integers(0, 2),  # partition
    st.integers(0, 2**40),  # offset
    st.sampled_from([None, None, None, 2, -152]),  # the error's code: none, a failure, a purge
    st.sampled_from(["message", "message", "python"]),  # what kind of report object
)
_TRANSACTIONS = st.lists(
    st.tuples(
        st.lists(st.sampled_from(TOPICS), min_size=1, max_size=6),  # one topic per record
        st.booleans(),  # a PendingTransaction, or a subclass of it
        st.sampled_from([0.0, 1.0e18]),  # commit time: long ago, or in the future
    ),
    min_size=1,
    max_size=3,
)


@needs_slots
@settings(max_examples=300, deadline=None)
@given(_TRANSACTIONS, st.data())
def test_every_report_is_accounted_as_the_reference_accounts_it(
    transactions: list[tuple[list[str], bool, float]], data: st.DataObject
) -> None:
    fast, reference = _trackers()
    worlds: list[tuple[DeliveryTracker, list[PendingTransaction], list[Any]]] = []
    for tracker in (fast, reference):
        txns: list[PendingTransaction] = []
        callbacks = []
        for position, (topics, plain, commit_time) in enumerate(transactions):
            made = PendingTransaction if plain else OtherTransaction
            txn = made(100 + position, commit_time, b"slot/0/64/")
            txns.append(txn)
            for index, topic in enumerate(topics):
                record = (txn, "public.outbox", topic, [("id", b"%d" % index)])
                callbacks.append((topic, MethodType(tracker.on_delivery, record)))
                txn.produced()
            txn.sealed = True
        worlds.append((tracker, txns, callbacks))
    records = len(worlds[0][2])
    order = data.draw(st.permutations(range(records)))
    reports = data.draw(st.lists(_REPORTS, min_size=records, max_size=records))
    for index, (partition, offset, code, kind) in zip(order, reports, strict=True):
        for _tracker, _txns, callbacks in worlds:
            topic, callback = callbacks[index]
            msg: Any = (
                PythonReport(partition, offset)
                if kind == "python"
                else Message(topic=topic, partition=partition, offset=offset, key=b"k", value=b"v")
            )
            err = None if code is None else DeliveryError(code, f"refused ({code})")
            callback(err, msg)
        assert _state(fast, worlds[0][1]) == _state(reference, worlds[1][1])


@needs_slots
def test_what_it_cannot_read_goes_to_the_reference() -> None:
    """A report with the wrong arguments, a record of another shape: the reference is called, and
    its answer (or error) is the callback's."""
    calls: list[tuple[Any, ...]] = []

    def reference(*args: Any, **kwargs: Any) -> str:
        calls.append((args, kwargs))
        return "reference"

    stats = RelayStats()
    callback = READER.Deliveries(
        PendingTransaction, stats.published_by_topic, stats.latency.observe, float, reference
    )
    txn = PendingTransaction(1)
    txn.produced()
    odd = [
        ((txn, "t", "topic"), None, PythonReport(0, 1)),  # three fields
        ((txn, "t", b"topic", []), None, PythonReport(0, 1)),  # the topic not text
        (("txn", "t", "topic", []), None, PythonReport(0, 1)),  # no transaction
        ([txn, "t", "topic", []], None, PythonReport(0, 1)),  # a list
    ]
    for args in odd:
        assert callback(*args) == "reference"
    assert callback(1, 2) == "reference"
    assert callback(1, 2, 3, x=4) == "reference"
    assert len(calls) == len(odd) + 2
    assert txn.pending == 1
    assert dict(stats.published_by_topic) == {}


def test_it_needs_the_transactions_slots() -> None:
    """It reads PendingTransaction's slots where the type keeps them: a type without them (the
    mypyc build's compiled class, a plain class) is refused, and the tracker then uses Python."""

    class Plain:
        def __init__(self) -> None:
            self._pending = self.unobserved = 0
            self.offsets: dict[Any, int] = {}
            self.commit_time = 0.0

    stats = RelayStats()
    with pytest.raises(TypeError):
        READER.Deliveries(Plain, stats.published_by_topic, stats.latency.observe, float, print)
    with pytest.raises(TypeError):  # by_topic must be a dict
        READER.Deliveries(PendingTransaction, [], stats.latency.observe, float, print)
    if COMPILED:
        with pytest.raises(TypeError, match="has no slot"):
            READER.Deliveries(
                PendingTransaction, stats.published_by_topic, stats.latency.observe, float, print
            )


def test_the_tracker_uses_it_unless_pure_python_is_asked_for() -> None:
    """Except in the mypyc build, where PendingTransaction is compiled (no slots to read) and its
    compiled callback runs."""
    pure = os.environ.get("CDC_RELAY_PURE_PYTHON") == "1"
    compiled = not str(watermark.__file__).endswith(".py")
    tracker = DeliveryTracker(RelayStats())
    assert (type(tracker.on_delivery).__name__ == "Deliveries") != (pure or compiled)


def _spoiled(tracker: DeliveryTracker) -> tuple[Any, ...]:
    txn = PendingTransaction(1, 0.0, b"slot/0/1/")
    txn.produced()
    txn.produced()
    first_offsets = txn.offsets

    class Spoiler(int):
        def __hash__(self) -> int:
            txn.offsets = {("replaced", 0): 1}
            txn.unobserved = None  # type: ignore[assignment]
            return int.__hash__(self)

    callback = MethodType(tracker.on_delivery, (txn, "public.outbox", TOPICS[0], []))
    with pytest.raises(TypeError) as raised:
        callback(None, PythonReport(Spoiler(1), 7))
    return (
        dict(first_offsets), txn.offsets, txn.pending, dict(tracker.stats.published_by_topic),
        type(raised.value),
    )  # fmt: skip


@needs_slots
def test_a_report_whose_values_run_code_is_accounted_as_the_reference_does() -> None:
    """A partition whose hash replaces the transaction's offsets and spoils its unobserved count
    (only a fake report can): the same outcome, the same error, and nothing freed in use."""
    fast, reference = _trackers()
    outcome = _spoiled(fast)
    assert outcome == _spoiled(reference)
    assert outcome[0] == {(TOPICS[0], 1): 7}
