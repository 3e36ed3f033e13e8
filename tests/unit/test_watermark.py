"""Unit tests for cdc_relay.watermark: the contiguous acknowledgement watermark.

The relay's usage is mirrored here: ``open`` on Begin, ``produced()`` per produced record,
``acknowledged()`` on a delivery acknowledgement followed by ``advance()``, ``seal`` on Commit and
``idle`` on a keepalive received outside a transaction.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from cdc_relay.watermark import PendingTransaction, Watermark

START = 0x1000


def produce(txn: PendingTransaction, records: int = 1) -> None:
    for _ in range(records):
        txn.produced()


def ack(watermark: Watermark, txn: PendingTransaction) -> int:
    txn.acknowledged()
    return watermark.advance()


def test_starts_at_the_given_position() -> None:
    watermark = Watermark(START)
    assert watermark.confirmed == START
    assert watermark.pending_transactions == 0
    assert watermark.advance() == START


def test_pending_transaction_state() -> None:
    txn = PendingTransaction(0x2000)
    assert (txn.commit_lsn, txn.end_lsn, txn.pending, txn.sealed) == (0x2000, 0, 0, False)
    assert not txn.done
    txn.sealed = True
    assert txn.done
    txn.hold()
    assert not txn.done


def test_one_transaction_advances_when_sealed_and_fully_acknowledged() -> None:
    watermark = Watermark(START)
    txn = watermark.open(0x2000)
    produce(txn, 2)
    watermark.seal(txn, 0x2008)
    assert watermark.confirmed == START
    assert ack(watermark, txn) == START
    assert ack(watermark, txn) == 0x2008
    assert watermark.confirmed == 0x2008
    assert watermark.pending_transactions == 0


def test_acks_out_of_order_do_not_pass_an_unfinished_earlier_transaction() -> None:
    watermark = Watermark(START)
    first = watermark.open(0x2000)
    produce(first, 2)
    watermark.seal(first, 0x2008)
    second = watermark.open(0x3000)
    produce(second, 1)
    watermark.seal(second, 0x3008)
    third = watermark.open(0x4000)
    produce(third, 1)
    watermark.seal(third, 0x4008)

    assert ack(watermark, third) == START  # the latest is acknowledged first
    assert ack(watermark, second) == START
    assert ack(watermark, first) == START  # one of two records of the first
    assert watermark.pending_transactions == 3
    assert ack(watermark, first) == 0x4008  # now all three are contiguous
    assert watermark.pending_transactions == 0


def test_watermark_stops_at_the_first_unfinished_transaction() -> None:
    watermark = Watermark(START)
    txns = []
    for i in range(1, 5):
        txn = watermark.open(i * 0x1000 + 0x1000)
        produce(txn)
        watermark.seal(txn, i * 0x1000 + 0x1008)
        txns.append(txn)
    ack(watermark, txns[0])
    ack(watermark, txns[1])
    ack(watermark, txns[3])
    assert watermark.confirmed == txns[1].end_lsn
    assert watermark.pending_transactions == 2
    ack(watermark, txns[2])
    assert watermark.confirmed == txns[3].end_lsn


def test_an_open_transaction_blocks_even_with_nothing_pending() -> None:
    watermark = Watermark(START)
    txn = watermark.open(0x2000)
    produce(txn)
    ack(watermark, txn)
    assert txn.pending == 0
    assert watermark.confirmed == START  # no Commit yet: more records may follow
    watermark.seal(txn, 0x2008)
    assert watermark.confirmed == 0x2008


def test_an_open_transaction_blocks_later_finished_ones() -> None:
    watermark = Watermark(START)
    first = watermark.open(0x2000)
    produce(first)
    ack(watermark, first)
    # A later transaction cannot really finish before the earlier one's Commit on a single
    # stream, but the bookkeeping must not depend on that.
    second = watermark.open(0x3000)
    watermark.seal(second, 0x3008)
    assert second.done
    assert watermark.confirmed == START
    assert watermark.pending_transactions == 2
    watermark.seal(first, 0x2008)
    assert watermark.confirmed == 0x3008
    assert watermark.pending_transactions == 0


def test_later_open_transaction_does_not_hold_back_finished_earlier_ones() -> None:
    watermark = Watermark(START)
    first = watermark.open(0x2000)
    produce(first)
    watermark.seal(first, 0x2008)
    second = watermark.open(0x3000)
    produce(second)
    ack(watermark, first)
    assert watermark.confirmed == 0x2008
    assert watermark.pending_transactions == 1
    ack(watermark, second)
    assert watermark.confirmed == 0x2008  # still open
    watermark.seal(second, 0x3008)
    assert watermark.confirmed == 0x3008


def test_sealing_advances_at_once_when_acks_came_first() -> None:
    watermark = Watermark(START)
    txn = watermark.open(0x2000)
    produce(txn, 3)
    for _ in range(3):
        ack(watermark, txn)
    assert watermark.confirmed == START
    watermark.seal(txn, 0x2010)
    assert watermark.confirmed == 0x2010
    assert txn.sealed
    assert txn.end_lsn == 0x2010


def test_zero_record_transaction_advances_at_once() -> None:
    watermark = Watermark(START)
    txn = watermark.open(0x2000)
    assert watermark.pending_transactions == 1
    watermark.seal(txn, 0x2008)
    assert watermark.confirmed == 0x2008
    assert watermark.pending_transactions == 0


def test_zero_record_transaction_waits_behind_a_pending_one() -> None:
    watermark = Watermark(START)
    busy = watermark.open(0x2000)
    produce(busy)
    watermark.seal(busy, 0x2008)
    empty = watermark.open(0x3000)
    watermark.seal(empty, 0x3008)
    assert watermark.confirmed == START
    ack(watermark, busy)
    assert watermark.confirmed == 0x3008


def test_idle_advances_only_when_nothing_is_open_or_pending() -> None:
    watermark = Watermark(START)
    assert watermark.idle(0x1800) is True
    assert watermark.confirmed == 0x1800

    txn = watermark.open(0x2000)
    assert watermark.idle(0x2100) is False  # open
    assert watermark.confirmed == 0x1800
    produce(txn)
    watermark.seal(txn, 0x2008)
    assert watermark.idle(0x2100) is False  # sealed but not acknowledged
    assert watermark.confirmed == 0x1800
    ack(watermark, txn)
    assert watermark.confirmed == 0x2008
    assert watermark.idle(0x2100) is True
    assert watermark.confirmed == 0x2100


def test_idle_never_moves_backwards() -> None:
    watermark = Watermark(START)
    assert watermark.idle(START) is False
    assert watermark.idle(START - 1) is False
    assert watermark.idle(0) is False
    assert watermark.confirmed == START
    assert watermark.idle(START + 1) is True
    assert watermark.idle(START) is False
    assert watermark.confirmed == START + 1


def test_seal_below_the_watermark_never_moves_it_backwards() -> None:
    watermark = Watermark(0x5000)
    txn = watermark.open(0x2000)  # e.g. a transaction replayed from before the start point
    produce(txn)
    watermark.seal(txn, 0x2008)
    ack(watermark, txn)
    assert watermark.confirmed == 0x5000
    assert watermark.pending_transactions == 0


def test_open_returns_distinct_transactions_in_commit_order() -> None:
    watermark = Watermark(START)
    first = watermark.open(0x2000)
    second = watermark.open(0x3000)
    assert first is not second
    assert (first.commit_lsn, second.commit_lsn) == (0x2000, 0x3000)
    assert watermark.pending_transactions == 2


# -- property -------------------------------------------------------------------------------------

try:
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:  # the property test needs hypothesis; everything else runs without it
    HAVE_HYPOTHESIS = False
else:
    HAVE_HYPOTHESIS = True


@dataclass
class _Model:
    """The stream as the relay sees it: transactions in commit order, with their records."""

    records: list[int]  # records per transaction
    txns: list[PendingTransaction] = field(default_factory=list)
    outstanding: list[int] = field(default_factory=list)  # txn index of each unacked record
    stream_txn: int = 0  # next transaction to Begin
    produced: int = 0  # records produced of the open transaction
    inside: bool = False  # between Begin and Commit
    last_end: int = START

    @staticmethod
    def commit_lsn(i: int) -> int:
        return START + (i + 1) * 0x100

    @staticmethod
    def end_lsn(i: int) -> int:
        return START + (i + 1) * 0x100 + 0x10


if HAVE_HYPOTHESIS:

    @settings(max_examples=200, deadline=None, database=None)
    @given(
        records=st.lists(st.integers(min_value=0, max_value=4), min_size=1, max_size=8),
        schedule=st.lists(st.integers(min_value=0, max_value=1 << 16), max_size=60),
    )
    def test_random_interleavings_keep_the_watermark_contiguous_and_monotonic(
        records: list[int], schedule: list[int]
    ) -> None:
        """Random interleavings of stream events, acknowledgements and keepalives.

        Each number of ``schedule`` picks the next action (and which record is acknowledged, or the
        keepalive's WAL end); once it is used up, the stream is played out and then every record is
        acknowledged in order.
        """
        model = _Model(records)
        watermark = Watermark(START)
        history = [watermark.confirmed]
        picks = iter(schedule)

        def step_stream() -> None:
            i = model.stream_txn
            if not model.inside:
                model.txns.append(watermark.open(model.commit_lsn(i)))
                model.inside, model.produced = True, 0
            elif model.produced < model.records[i]:
                produce(model.txns[i])
                model.outstanding.append(i)
                model.produced += 1
            else:
                watermark.seal(model.txns[i], model.end_lsn(i))
                model.inside = False
                model.last_end = model.end_lsn(i)
                model.stream_txn += 1

        while model.stream_txn < len(records) or model.outstanding:
            choices = []
            if model.stream_txn < len(records):
                choices.append("stream")
            if model.outstanding:
                choices.append("ack")
            if not model.inside:
                choices.append("idle")
            pick = next(picks, None)
            action = choices[0] if pick is None else choices[pick % len(choices)]
            if action == "stream":
                step_stream()
            elif action == "ack":
                position = 0 if pick is None else (pick >> 2) % len(model.outstanding)
                ack(watermark, model.txns[model.outstanding.pop(position)])
            else:
                # A keepalive between transactions: its WAL end lies before the next Begin.
                assert pick is not None
                wal_end = START + (pick >> 2) % (model.last_end + 0x9 - START)
                moved = watermark.idle(wal_end)
                assert moved == (watermark.pending_transactions == 0 and wal_end > history[-1])

            confirmed = watermark.confirmed
            assert confirmed >= history[-1], "the watermark moved backwards"
            history.append(confirmed)
            unfinished = [i for i, txn in enumerate(model.txns) if not txn.done]
            if unfinished:
                first = unfinished[0]
                # Never past the first unfinished transaction (not even to its commit record) ...
                assert confirmed < model.commit_lsn(first)
                # ... and up to the end of the last one before it.
                if first > 0:
                    assert confirmed >= model.end_lsn(first - 1)
            elif model.txns:
                assert confirmed >= model.end_lsn(len(model.txns) - 1)
            assert watermark.pending_transactions == (
                len(model.txns) - unfinished[0] if unfinished else 0
            )

        assert watermark.pending_transactions == 0
        assert watermark.confirmed >= model.end_lsn(len(records) - 1)
        assert watermark.confirmed <= model.end_lsn(len(records) - 1) + 0x8

else:

    def test_random_interleavings_need_hypothesis() -> None:
        pytest.skip("hypothesis is not installed: pip install hypothesis")
