"""The contiguous acknowledgement watermark: how far the slot may be confirmed.

Transactions are tracked in commit order. Each counts the Kafka deliveries it still waits for;
that count changes only through :class:`PendingTransaction`'s methods (:meth:`~PendingTransaction.
produced`, :meth:`~PendingTransaction.acknowledged`, :meth:`~PendingTransaction.refused`,
:meth:`~PendingTransaction.hold`, :meth:`~PendingTransaction.committed`), called by the session,
the delivery callbacks, the poison policy and, publishing exactly once, the Kafka transaction
(:mod:`cdc_relay.kafka_transaction`): a transaction held until its Kafka transaction committed.
(The C extension's delivery callback does what :meth:`~PendingTransaction.acknowledged` does on
the slot itself, a Python call from C costing more than the rest of the acknowledgement; it is
checked against the Python callback, which calls the method: test_delivery_callback.py.)
The watermark is the end LSN of the newest transaction such that it *and every transaction before
it* are sealed (their Commit was seen) and fully acknowledged — never simply the highest LSN
acknowledged, because acknowledgements arrive out of order across partitions.

Beside the watermark it keeps, per topic-partition, the highest offset Kafka acknowledged for a
transaction at or below it (:attr:`Watermark.offsets`): recorded with the position, it tells the
next start where in each partition the records of the unconfirmed window begin
(:mod:`cdc_relay.reconcile`).
"""

from __future__ import annotations

from collections import deque


class PendingTransaction:
    """One source transaction on its way to Kafka."""

    __slots__ = (
        "_pending",
        "commit_lsn",
        "commit_time",
        "end_lsn",
        "events",
        "offsets",
        "position",
        "sealed",
        "unobserved",
    )

    def __init__(self, commit_lsn: int, commit_time: float = 0.0, position: bytes = b"") -> None:
        self.commit_lsn = commit_lsn
        self.commit_time = commit_time  # Unix seconds, for latency and lag
        self.end_lsn = 0
        self._pending = 0  # deliveries still awaited (+1 for good when held)
        self.unobserved = 0  # acknowledged events whose latency is not yet observed
        self.sealed = False
        self.position = position  # b"<slot>/<commit LSN hex>/": the events' position prefix
        self.events = 0  # events seen so far: the ordinal of the last one
        # (topic, partition) -> offset of this transaction's last acknowledged record there
        self.offsets: dict[tuple[str, int], int] = {}

    @property
    def pending(self) -> int:
        """The Kafka deliveries this transaction still waits for."""
        return self._pending

    @property
    def done(self) -> bool:
        return self.sealed and self._pending == 0

    def produced(self) -> None:
        """librdkafka took one of its records: one more delivery to wait for."""
        self._pending += 1

    def acknowledged(self) -> int:
        """Kafka acknowledged one of its records; the deliveries still awaited."""
        self._pending -= 1
        return self._pending

    def refused(self) -> None:
        """Kafka refused one of its records after taking it: that delivery is no longer awaited
        (what replaces the record, a dead letter, is produced, and counted, anew)."""
        self._pending -= 1

    def hold(self) -> None:
        """It can never complete (a record that can be neither published nor dead-lettered):
        the watermark never passes it, so nothing at or after it is confirmed. Publishing
        exactly once, each transaction is held from its Begin until its Kafka transaction
        committed (:meth:`committed`)."""
        self._pending += 1

    def committed(self) -> None:
        """The Kafka transaction that holds it committed: that hold is released."""
        self._pending -= 1


class Watermark:
    """Pure bookkeeping; the caller reports produces, acknowledgements and commits."""

    def __init__(self, start: int, offsets: dict[tuple[str, int], int] | None = None) -> None:
        self.confirmed = start
        self.confirmed_commit_time = 0.0  # commit time of the newest fully acknowledged txn
        # Per partition, the highest offset acknowledged at or below ``confirmed`` (as recorded
        # at the start, then folded from each finished transaction).
        self.offsets: dict[tuple[str, int], int] = dict(offsets or {})
        self._queue: deque[PendingTransaction] = deque()

    def open(
        self, commit_lsn: int, commit_time: float = 0.0, position: bytes = b""
    ) -> PendingTransaction:
        """A Begin: the transaction joins the queue at once, so nothing after it can pass it."""
        txn = PendingTransaction(commit_lsn, commit_time, position)
        self._queue.append(txn)
        return txn

    def seal(self, txn: PendingTransaction, end_lsn: int) -> None:
        """A Commit: no more records will be added to ``txn``."""
        txn.end_lsn = end_lsn
        txn.sealed = True
        self.advance()

    def advance(self) -> int:
        """Drop finished transactions from the head; returns the (possibly new) watermark."""
        queue = self._queue
        while queue and queue[0].done:
            txn = queue.popleft()
            if txn.offsets:
                # One producer writes each partition in order, so a later transaction's offset
                # is the higher one (a lower one only makes the next start read a little more).
                self.offsets.update(txn.offsets)
            self.confirmed = max(self.confirmed, txn.end_lsn)
            self.confirmed_commit_time = txn.commit_time
        return self.confirmed

    def idle(self, wal_end: int) -> bool:
        """A keepalive: with nothing open or pending, everything up to ``wal_end`` is relayed.

        True when the watermark moved.
        """
        if not self._queue and wal_end > self.confirmed:
            self.confirmed = wal_end
            return True
        return False

    @property
    def pending_transactions(self) -> int:
        return len(self._queue)
