"""What the session watches from the side, on its housekeeping ticks.

None of these decide what is published or confirmed; they keep the operator informed and the
session honest:

- :class:`DeliveryStall`: records in flight but no acknowledgement — warn, report not ready, and
  past ``CDC_RELAY_DELIVERY_STALL_TIMEOUT`` end the session so that the producer is rebuilt;
- :class:`Heartbeat`: a small non-relayed logical message every ``CDC_RELAY_HEARTBEAT_INTERVAL``,
  so that keepalives move the slot on databases whose other writes it never sees;
- :class:`RetainedWal`: how much WAL the slot holds on the server, sampled;
- :class:`Progress`: ``catching up`` lines while a backlog is read.

:class:`Monitors` holds one of each and ticks them together.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from cdc_relay.config import Settings
from cdc_relay.errors import SinkUnavailable
from cdc_relay.observability.stats import RelayStats

log = logging.getLogger(__name__)

STALL_WARNING_AFTER = 10.0
READY_STALL_AFTER = 5.0  # seconds without an acknowledgement (records waiting) -> not ready
RETAINED_WAL_CHECK_INTERVAL = 10.0


class DeliveryStall:
    """No delivery progress while records wait: a broker that is gone, paused or lost state."""

    def __init__(self, stall_timeout: float, stats: RelayStats, now: float) -> None:
        self._timeout = stall_timeout
        self._warn_after = min(STALL_WARNING_AFTER, stall_timeout / 2)
        self._stats = stats
        self._last_progress = now
        self._last_warning = now
        self._acked_at_last_check = 0

    def check(self, now: float, in_flight: int, acked: int) -> None:
        """Raises SinkUnavailable once nothing was acknowledged for the stall timeout."""
        stats = self._stats
        stats.in_flight = in_flight
        if in_flight == 0 or acked != self._acked_at_last_check:
            self._acked_at_last_check = acked
            self._last_progress = now
            stats.delivery_stalled = False
            return
        stalled = now - self._last_progress
        stats.delivery_stalled = stalled >= READY_STALL_AFTER
        if stalled >= self._timeout:
            raise SinkUnavailable(
                f"no Kafka delivery progress for {stalled:.0f}s with {in_flight} records in "
                "flight; rebuilding the producer"
            )
        if stalled >= self._warn_after and now - self._last_warning >= self._warn_after:
            self._last_warning = now
            log.warning(
                "Kafka is not acknowledging records; broker unreachable?",
                extra={"fields": {"in_flight": in_flight, "stalled_s": round(stalled, 1)}},
            )


class Heartbeat:
    """``emit`` every ``interval`` seconds (0: never)."""

    def __init__(self, emit: Callable[[], None], interval: float, now: float) -> None:
        self._emit = emit
        self._interval = interval
        self._last = now

    def tick(self, now: float) -> None:
        if self._interval and now - self._last >= self._interval:
            self._last = now
            self._emit()


class RetainedWal:
    """Samples the slot's retained WAL into the stats (a query: not on every tick)."""

    def __init__(self, measure: Callable[[], int | None], stats: RelayStats) -> None:
        self._measure = measure
        self._stats = stats
        self._last = float("-inf")

    def tick(self, now: float) -> None:
        if now - self._last >= RETAINED_WAL_CHECK_INTERVAL:
            self._last = now
            self._stats.retained_wal_bytes = self._measure()


class Progress:
    """A progress line every few seconds while a backlog is read, so catch-up never looks hung."""

    BACKLOG_BYTES = 1024 * 1024  # below this the relay counts as keeping up

    def __init__(self, received: int, stats: RelayStats, interval: float, now: float) -> None:
        self._stats = stats
        self._interval = interval
        self._at = now
        self._received = received
        self._published = stats.published

    def tick(self, now: float, received: int) -> None:
        if now - self._at < self._interval:
            return
        stats = self._stats
        remaining = max(stats.server_wal_end - received, 0)
        elapsed = now - self._at
        published = stats.published
        if remaining >= self.BACKLOG_BYTES:
            byte_rate = (received - self._received) / elapsed
            eta = remaining / byte_rate if byte_rate > 0 else None
            log.info(
                "catching up",
                extra={
                    "fields": {
                        "events_per_s": round((published - self._published) / elapsed),
                        "remaining_bytes": remaining,
                        "eta_s": round(eta, 1) if eta is not None else "unknown",
                    }
                },
            )
        self._at, self._received, self._published = now, received, published


class Monitors:
    """One session's watchers, ticked together on its housekeeping."""

    def __init__(
        self,
        settings: Settings,
        stats: RelayStats,
        *,
        start: int,
        heartbeat: Callable[[], None],
        retained_wal: Callable[[], int | None],
        now: float,
    ) -> None:
        self.stall = DeliveryStall(settings.delivery_stall_timeout, stats, now)
        self.heartbeat = Heartbeat(heartbeat, settings.heartbeat_interval, now)
        self.retained_wal = RetainedWal(retained_wal, stats)
        self.progress = Progress(start, stats, settings.progress_interval, now)

    def tick(self, now: float, in_flight: int, acked: int, received: int) -> None:
        self.stall.check(now, in_flight, acked)
        self.progress.tick(now, received)
        self.heartbeat.tick(now)
        self.retained_wal.tick(now)
