"""When a Kafka transaction commits, publishing exactly once (``CDC_RELAY_EXACTLY_ONCE``).

Many PostgreSQL transactions share one Kafka transaction. The session tells
:class:`KafkaTransaction` about PostgreSQL transaction boundaries only — a Begin
(:meth:`~KafkaTransaction.join`), a Commit (:meth:`~KafkaTransaction.sealed`) and its housekeeping
ticks — never about single records, so publishing costs what it costs without it:

- a Kafka transaction is begun (local and cheap) with the first PostgreSQL transaction after a
  commit; each PostgreSQL transaction that joins it is *held* (:meth:`PendingTransaction.hold
  <cdc_relay.watermark.PendingTransaction.hold>`), so the watermark, and with it the slot, never
  passes it until its Kafka transaction committed (:meth:`~cdc_relay.watermark.PendingTransaction.
  committed`);
- it commits at a PostgreSQL transaction boundary (a Commit, or a tick while none is open) once
  it is older than ``CDC_RELAY_TRANSACTION_INTERVAL`` or holds ``CDC_RELAY_TRANSACTION_MAX_EVENTS``
  events, so one PostgreSQL transaction's records never span two Kafka transactions, except:
- a PostgreSQL transaction too large for one (more than ten times the event bound, or open for
  half of ``transaction.timeout.ms``) is *split*: what it produced so far is committed at a tick,
  and the rest goes into the next Kafka transaction. The committed part is noted
  (:class:`Resend`), so that a re-send skips it: still each event once,
  but a ``read_committed`` consumer may see the first part before the rest.

A commit that fails, or a delivery that fails inside the transaction, ends the session
(:mod:`cdc_relay.transaction_errors` says how; fenced: the relay stands by): nothing held by it is
released, so nothing of it is confirmed, and the next session sends it again, with the notes of
:class:`Resend`. Only a commit librdkafka calls aborted (:class:`~cdc_relay.transaction_errors.
TransactionAborted`) is known not to have committed. Any other end of a commit — timed out for
good while the broker was unreachable, or given up at a stop's deadline — may have come after the
broker took it: its outcome is *unknown* (:attr:`Resend.unsettled`), and the next session must
settle it before it sends anything: a new producer's ``init_transactions`` (the fence: the broker
finishes or aborts what the old one left) and a ``read_committed`` read-back, which finds what
committed. Sending it again without looking would send a committed transaction twice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn, Protocol

from cdc_relay.config import Settings
from cdc_relay.errors import LeadershipLost, SinkUnavailable, StopSession
from cdc_relay.lsn import format_lsn
from cdc_relay.reconcile import POSITION_HEADER
from cdc_relay.transaction_errors import Outcome, TransactionAborted, outcome
from cdc_relay.watermark import PendingTransaction

if TYPE_CHECKING:
    from cdc_relay.publisher import DeliveryFailure, DeliveryTracker

log = logging.getLogger(__name__)

SPLIT_FACTOR = 10  # a PostgreSQL transaction of more than this x the event bound is split


class TransactionalSink(Protocol):
    """The transactional producer (:class:`~cdc_relay.publisher.Publisher`)."""

    def begin_transaction(self) -> None: ...

    def commit_transaction(self, serve: Callable[[], None]) -> None: ...

    def abort_transaction(self) -> bool: ...


def transactional(
    settings: Settings,
    sink: TransactionalSink,
    resend: Resend,
    serve: Callable[[], None],
    tracker: DeliveryTracker,
) -> KafkaTransaction | None:
    """The session's Kafka transaction, with ``CDC_RELAY_EXACTLY_ONCE``; else None."""
    if not settings.exactly_once:
        return None
    timeout_ms = int(settings.producer_config()["transaction.timeout.ms"])
    return KafkaTransaction(
        sink,
        resend,
        interval=settings.transaction_interval,
        max_events=settings.transaction_max_events,
        split_after=timeout_ms / 2000,  # half the broker's patience with an open transaction
        serve=serve,
        tracker=tracker,
    )


class KafkaTransaction:
    """The open Kafka transaction and the PostgreSQL transactions it holds."""

    def __init__(
        self,
        sink: TransactionalSink,
        resend: Resend,
        *,
        interval: float,
        max_events: int,
        split_after: float,
        serve: Callable[[], None] = lambda: None,
        tracker: DeliveryTracker | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._sink = sink
        self._serve = serve  # the loop's duties while a commit waits
        self._tracker = tracker  # the deliveries' failures
        self.resend = resend
        self._interval = interval
        self._max_events = max_events
        self._split_events = max_events * SPLIT_FACTOR
        self._split_after = split_after
        self._clock = clock
        self.held: list[PendingTransaction] = []
        self.open: PendingTransaction | None = None  # the PostgreSQL transaction being read
        self.events = 0  # events of the held transactions (of a split one: since the split)
        self.begun = False
        self.opened_at = 0.0
        self.commits = 0
        self._base = 0  # the open transaction's events committed by a split
        self._warned: PendingTransaction | None = None

    def join(self, txn: PendingTransaction) -> None:
        """A Begin: ``txn`` joins the Kafka transaction (begun now if none is) and is held."""
        if not self.begun:
            self._sink.begin_transaction()
            self.begun = True
        if not self.held:
            self.opened_at = self._clock()
        txn.hold()
        self.held.append(txn)
        self.open = txn

    def sealed(self, txn: PendingTransaction) -> bool:
        """A Commit of ``txn``: True when the Kafka transaction is due to commit now."""
        self.events += txn.events - self._base
        self._base = 0
        self.open = None
        return self.due()

    def due(self) -> bool:
        """Old enough or large enough to commit (only meaningful between transactions)."""
        return bool(self.held) and (
            self.events >= self._max_events or self._clock() - self.opened_at >= self._interval
        )

    def too_large(self) -> bool:
        """The open PostgreSQL transaction must be split (asked at a tick while one is open)."""
        txn = self.open
        if txn is None:
            return False
        return (
            txn.events - self._base >= self._split_events
            or self._clock() - self.opened_at >= self._split_after
        )

    def tick(self) -> None:
        """Housekeeping between records: commit a due Kafka transaction between PostgreSQL
        transactions, split a too large one."""
        if self.open is None:
            if self.due():
                self.commit()
        elif self.too_large():
            self.split()

    def commit(self) -> None:
        """Commit (between PostgreSQL transactions), then release what it held. Raises what the
        commit raised (naming the delivery that failed, if one did), releasing nothing."""
        if self.open is not None:
            raise AssertionError("a Kafka transaction commits between PostgreSQL transactions")
        self._commit()

    def split(self) -> None:
        """Commit with the open PostgreSQL transaction's part so far; the rest goes on in the
        next Kafka transaction (a tick while it is open found it :meth:`too_large`)."""
        txn = self.open
        assert txn is not None
        if self._warned is not txn:
            self._warned = txn
            log.warning(
                "a PostgreSQL transaction too large for one Kafka transaction is split: a "
                "read_committed consumer may see its first part before the rest",
                extra={"fields": {"commit_lsn": format_lsn(txn.commit_lsn), "events": txn.events}},
            )
        self.events += txn.events - self._base
        self._commit()
        self.resend.note_committed(txn.position, txn.events, txn.commit_lsn)
        self._base = txn.events
        self.join(txn)

    def _commit(self) -> None:
        if self.events:
            try:
                self._sink.commit_transaction(self._serve)
            except BaseException as exc:
                if not isinstance(exc, TransactionAborted):
                    self._unsettled(exc)
                if (
                    isinstance(exc, SinkUnavailable)
                    and self._tracker is not None
                    and self._tracker.failures
                ):
                    self.failed()  # says which delivery failed, and remembers it
                raise
            self.begun = False
            self.commits += 1
            if self._tracker is not None:
                self._tracker.stats.kafka_transactions_committed += 1
        # else: nothing was produced in it; the (local) transaction stays begun for the next
        observe = self._tracker.stats.latency.observe if self._tracker is not None else None
        now = time.time()
        for txn in self.held:
            txn.committed()
            if txn.unobserved and observe is not None:
                # Its events became visible to read_committed consumers now: commit -> commit.
                observe(now - txn.commit_time, txn.unobserved)
                txn.unobserved = 0
        self.held.clear()
        self.events = 0

    def _unsettled(self, exc: BaseException) -> None:
        """The commit ended without an answer: it may have committed. Nothing of it is released
        (confirmed); the next session settles it before it sends anything (see the module)."""
        self.resend.unsettled = True
        reason = (
            "stopping: CDC_RELAY_SHUTDOWN_TIMEOUT passed while the commit waited"
            if isinstance(exc, StopSession)
            else str(exc) or type(exc).__name__
        )
        log.error(
            "a Kafka transaction's commit ended without an answer: its outcome is unknown; "
            "nothing of it is confirmed, and the next session (or start) fences and reads back "
            "what committed before it sends anything again",
            extra={"fields": {"error": reason, "postgresql_transactions": len(self.held)}},
        )

    def failed(self) -> NoReturn:
        """A delivery failed inside the Kafka transaction: it cannot commit. Fenced: stand by;
        else the session ends and the transaction is sent again, the records the broker refused
        for good remembered (dead-lettered, or stopping, when they come again)."""
        assert self._tracker is not None
        failures = self._tracker.take_failures()
        if any(outcome(f.code) is Outcome.FENCED for f in failures):
            raise LeadershipLost("fenced: another producer of the slot took over")
        for failure in failures:
            if failure.permanent and not failure.dead_letter:
                self._remember_refusal(failure)
        first = failures[0]
        raise SinkUnavailable(
            f"delivery to {first.topic!r} failed inside a Kafka transaction ({first.reason}): "
            "it is sent again from the last committed position"
        )

    def _remember_refusal(self, failure: DeliveryFailure) -> None:
        for name, value in reversed(failure.headers):
            if name == POSITION_HEADER:
                lsn = failure.txn.commit_lsn
                self.resend.note_refused(value, failure.code, failure.reason, lsn)
                return

    def end(self) -> None:
        """A clean stop: commit what is held (between PostgreSQL transactions), else abort. A
        commit of unknown outcome is not tried again: the next start settles it."""
        if self.open is None and self.held and not self.resend.unsettled:
            try:
                self.commit()
                return
            except (SinkUnavailable, LeadershipLost, StopSession) as exc:
                if not self.resend.unsettled:  # else said already
                    log.error(
                        "the last Kafka transaction did not commit: it is sent again",
                        extra={"fields": {"error": str(exc)}},
                    )
        self.abandon()

    def abandon(self) -> None:
        """The session ends without committing: abort (a best effort; the next producer's fence
        aborts it anyway). What it held stays held: nothing of it is confirmed."""
        if self.begun and self.held:
            self._sink.abort_transaction()
            if self._tracker is not None:
                self._tracker.stats.kafka_transactions_aborted += 1
        self.begun = False


class Resend:
    """What a session sending an uncommitted Kafka transaction again must know (the next session
    of the same leadership, which resumes at the committed position without a read-back unless
    a commit is :attr:`unsettled`): the committed part of a split PostgreSQL transaction
    (skipped), and the records the broker refused for good (dead-lettered at once, or stopping,
    per the poison policy: a row is published, dead-lettered or stops the relay)."""

    def __init__(self) -> None:
        self.committed: dict[bytes, tuple[int, int]] = {}  # prefix -> (last ordinal, commit lsn)
        self.refusals: dict[bytes, tuple[int, str, int]] = {}  # position -> (code, reason, lsn)
        self.highest_lsn = 0  # past this commit LSN, nothing is looked up
        # A commit of unknown outcome: the next session fences and reads back first. Never
        # handed on (from_position): the session it is handed to has settled it.
        self.unsettled = False

    @property
    def found(self) -> bool:
        return bool(self.committed or self.refusals)

    def note_committed(self, prefix: bytes, ordinal: int, commit_lsn: int) -> None:
        self.committed[prefix] = (ordinal, commit_lsn)
        self.highest_lsn = max(self.highest_lsn, commit_lsn)

    def note_refused(self, position: bytes, code: int, reason: str, commit_lsn: int) -> None:
        self.refusals[position] = (code, reason, commit_lsn)
        self.highest_lsn = max(self.highest_lsn, commit_lsn)

    def from_position(self, start: int) -> Resend:
        """What still matters to a session starting at ``start`` (a transaction that committed
        below it is confirmed whole)."""
        kept = Resend()
        for prefix, (ordinal, lsn) in self.committed.items():
            if lsn >= start:
                kept.note_committed(prefix, ordinal, lsn)
        for position, (code, reason, lsn) in self.refusals.items():
            if lsn >= start:
                kept.note_refused(position, code, reason, lsn)
        return kept

    def in_kafka(self, position: bytes, event_id: str | None) -> bool:
        """The event at ``position`` is in a committed part: not sent again."""
        cut = position.rfind(b"/") + 1
        part = self.committed.get(position[:cut])
        return part is not None and int(position[cut:]) <= part[0]

    def refused(self, position: bytes) -> tuple[int, str] | None:
        """The broker's permanent refusal of the event at ``position`` (code, reason), if any."""
        found = self.refusals.get(position)
        return None if found is None else (found[0], found[1])
