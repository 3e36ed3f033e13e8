"""How a session stops: the one answer to "what does SIGTERM do to a transaction half-read?".

A stop requested between PostgreSQL transactions stops at once. Inside one, the session reads on
to its Commit, so that the transaction is relayed whole, for at most ``CDC_RELAY_SHUTDOWN_TIMEOUT``
(a failed relay stops at once). Then the deliveries in flight are waited for, within the same
deadline, and what Kafka acknowledged is confirmed (:meth:`cdc_relay.session.Session.shutdown`).
A Kafka transaction's commit (publishing exactly once) is waited for within the same deadline
too, and then given up (:meth:`StopRule.expired`): its outcome unknown, the next start settles it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from cdc_relay.errors import SinkUnavailable, StopSession

log = logging.getLogger(__name__)


class StopOwner(Protocol):
    @property
    def failed(self) -> bool: ...


class DrainedSink(Protocol):
    def poll(self, timeout: float) -> int: ...

    def in_flight(self) -> int: ...


class StopRule:
    """When a requested stop takes effect."""

    def __init__(self, owner: StopOwner, timeout: float) -> None:
        self._owner = owner
        self._timeout = timeout
        self.deadline: float | None = None  # set when a stop finds a transaction open

    def now(self) -> bool:
        """A stop was requested inside a transaction: stop at once, or read on to its Commit?"""
        if self._owner.failed:
            return True
        if self.deadline is None:
            log.info("stop requested: reading on to the end of the transaction")
        return self.expired()

    def expired(self) -> bool:
        """The requested stop's deadline passed (set at the first ask; a recorded failure does
        not cut a wait short here)."""
        now = time.monotonic()
        if self.deadline is None:
            self.deadline = now + self._timeout
        return now >= self.deadline

    def drain(
        self, sink: DrainedSink, failures: Callable[[], bool], handle: Callable[[], None]
    ) -> None:
        """Wait (bounded by the deadline) until ``sink`` has nothing in flight, handing delivery
        failures to ``handle`` as they come."""
        if self.deadline is None:  # the stop's one deadline: what waits after this shares it
            self.deadline = time.monotonic() + self._timeout
        deadline = self.deadline
        try:
            while sink.in_flight() > 0 and time.monotonic() < deadline:
                sink.poll(0.1)
                if failures():
                    handle()
        except (SinkUnavailable, StopSession) as exc:
            log.error("deliveries failed while draining", extra={"fields": {"error": str(exc)}})
