"""The contiguous acknowledgement watermark: how far the slot may be confirmed.

Transactions are tracked in commit order. Each counts the Kafka deliveries it still waits for.
The watermark is the end LSN of the newest transaction such that it *and every transaction before
it* are sealed (their Commit was seen) and fully acknowledged — never simply the highest LSN
acknowledged, because acknowledgements arrive out of order across partitions.
"""

from __future__ import annotations

from collections import deque


class PendingTransaction:
    """One source transaction on its way to Kafka."""

    __slots__ = ("commit_lsn", "commit_time", "end_lsn", "pending", "sealed")

    def __init__(self, commit_lsn: int, commit_time: float = 0.0) -> None:
        self.commit_lsn = commit_lsn
        self.commit_time = commit_time  # Unix seconds, for latency and lag
        self.end_lsn = 0
        self.pending = 0
        self.sealed = False

    @property
    def done(self) -> bool:
        return self.sealed and self.pending == 0


class Watermark:
    """Pure bookkeeping; the caller reports produces, acknowledgements and commits."""

    def __init__(self, start: int) -> None:
        self.confirmed = start
        self.confirmed_commit_time = 0.0  # commit time of the newest fully acknowledged txn
        self._queue: deque[PendingTransaction] = deque()

    def open(self, commit_lsn: int, commit_time: float = 0.0) -> PendingTransaction:
        """A Begin: the transaction joins the queue at once, so nothing after it can pass it."""
        txn = PendingTransaction(commit_lsn, commit_time)
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
