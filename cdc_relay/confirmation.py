"""When the slot is confirmed: the one answer.

The relay confirms a position P only when Kafka has acknowledged every event committed below P:
P is the contiguous watermark of :mod:`cdc_relay.watermark` (the end LSN of the newest
transaction that, with every transaction before it, is sealed and fully acknowledged), or, with
nothing in flight, the server's WAL end that a keepalive reported (an idle outbox pins no WAL).
Publishing exactly once (``CDC_RELAY_EXACTLY_ONCE``), "fully acknowledged" includes its Kafka
transaction's commit: each transaction is held from its Begin until the Kafka transaction it
joined committed (:mod:`cdc_relay.kafka_transaction`), so P never passes an event a
``read_committed`` consumer cannot see yet; an aborted or fenced Kafka transaction releases
nothing, and nothing of it is confirmed.

Confirming is two writes, in this order, and nothing else confirms:

1. the position record (:class:`PositionStore`: the ``slot_position`` row, with the offsets Kafka
   acknowledged per partition at or below P — see :mod:`cdc_relay.reconcile`), then
2. the standby status update (:class:`SlotFeedback`) with flush = P.

A write of the record also requires the publication the relay verified at its start to be
unchanged (:mod:`cdc_relay.publication_stamp`): when it is not, nothing is written, nothing is
confirmed from then on, and the relay is told to stop (``on_changed``).

So the slot is never ahead of the record; :mod:`cdc_relay.checkpoint` says what a start does when
they differ. When: at most every ``CDC_RELAY_CONFIRM_INTERVAL`` while events are acknowledged; at
most every ``CDC_RELAY_IDLE_CONFIRM_INTERVAL`` when only the WAL moved (other tables, heartbeats,
our own record — recording the position writes WAL, which must not confirm itself in a loop);
and once more on a clean stop. In between, a status update (written = what was received, flush =
what was confirmed) goes out at least every ``STATUS_INTERVAL`` and whenever the server asks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Protocol

from cdc_relay.errors import (
    LeadershipLost,
    PublicationChanged,
    RelayError,
    SourceSetupError,
    SourceUnavailable,
)
from cdc_relay.lsn import format_lsn
from cdc_relay.observability.stats import RelayStats
from cdc_relay.watermark import Watermark

log = logging.getLogger(__name__)

STATUS_INTERVAL = 10.0  # a standby status update at least this often (wal_sender_timeout)


class PositionStore(Protocol):
    """The relay's record of its confirmed position (written before the slot is told)."""

    def save(self, lsn: int, offsets: Mapping[tuple[str, int], int] | None = None) -> None:
        """Record ``lsn``; with ``offsets`` also the acknowledged offset of each partition."""

    def note_written_from(self, offsets: Mapping[tuple[str, int], int]) -> None:
        """Before a first write to partitions with no acknowledged offset: where they end now."""


class SlotFeedback(Protocol):
    """The replication connection's standby status update."""

    def send_status(self, written: int, flushed: int, reply: bool = False) -> None: ...


class Confirmer:
    """Decides when to confirm, and confirms: the record first, then the slot."""

    def __init__(
        self,
        start: int,
        store: PositionStore,
        slot: SlotFeedback,
        stats: RelayStats,
        *,
        confirm_interval: float,
        idle_confirm_interval: float,
        offsets: dict[tuple[str, int], int] | None = None,
        on_changed: Callable[[RelayError], None] | None = None,
    ) -> None:
        self.watermark = Watermark(start, offsets)
        # The publication changed under the relay: it confirms nothing more (None: it did not).
        self.changed: PublicationChanged | None = None
        self._on_changed = on_changed
        self.received = start  # highest WAL position seen, reported as "written"
        self.confirmed = start  # what was recorded and told to the slot
        # Partitions whose acknowledged offset is in the position record (not merely acknowledged
        # in memory): a start after a crash reads them back from there.
        self.recorded_partitions: set[tuple[str, int]] = set(offsets or {})
        self._store = store
        self._slot = slot
        self._stats = stats
        self._confirm_interval = confirm_interval
        self._idle_confirm_interval = idle_confirm_interval
        now = time.monotonic()
        self._last_confirm = now
        self._last_status = now
        self._acked_at_confirm = 0

    def tick(self, now: float, acked: int, reply: bool = False) -> None:
        """Periodic: confirm when due (``acked``: acknowledgements so far), else keep in touch."""
        watermark = self.watermark
        position = watermark.advance()
        stats = self._stats
        stats.last_acked_commit_time = watermark.confirmed_commit_time
        stats.caught_up = (
            watermark.pending_transactions == 0 and self.received >= stats.server_wal_end
        )
        if position > self.confirmed and self.changed is None:
            if acked != self._acked_at_confirm:
                due = now - self._last_confirm >= self._confirm_interval
            else:
                due = now - self._last_confirm >= self._idle_confirm_interval
            if due:
                self._acked_at_confirm = acked
                self._confirm_unless_changed(position)
                return
        if reply or now - self._last_status >= STATUS_INTERVAL:
            self.send_status()

    def confirm(self, lsn: int) -> None:
        """Record the position, then tell the slot: the record must never be behind the slot."""
        # ``lsn`` is the watermark, so its offsets are those of the transactions below it.
        self._store.save(lsn, self.watermark.offsets)
        self.recorded_partitions = set(self.watermark.offsets)
        self.confirmed = lsn
        self._stats.confirmed_lsn = lsn
        self._last_confirm = time.monotonic()
        self.send_status()
        log.debug("confirmed", extra={"fields": {"lsn": format_lsn(lsn)}})

    def _confirm_unless_changed(self, lsn: int) -> None:
        """:meth:`confirm`, or, when the publication changed under the relay, nothing from now
        on, and the relay told (without ``on_changed``: raised)."""
        try:
            self.confirm(lsn)
        except PublicationChanged as exc:
            if self._on_changed is None:
                raise
            self.changed = exc
            self._on_changed(exc)

    def send_status(self) -> None:
        self._slot.send_status(max(self.received, self.confirmed), self.confirmed)
        self._last_status = time.monotonic()

    def final(self) -> None:
        """A clean stop: confirm everything acknowledged, if the database still listens."""
        position = self.watermark.advance()
        if position > self.confirmed and self.changed is None:
            try:
                self._confirm_unless_changed(position)
            except PublicationChanged as exc:  # no one to tell: said here
                self.changed = exc
                log.error(str(exc), extra={"fields": {"error": type(exc).__name__}})
            except (SourceUnavailable, SourceSetupError, LeadershipLost) as exc:
                log.warning("could not confirm on shutdown", extra={"fields": {"error": str(exc)}})

    def acknowledged(self) -> int:
        """Everything below this is in Kafka: where the next session resumes."""
        return self.watermark.advance()
