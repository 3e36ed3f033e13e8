"""How long to wait before trying again: doubling from a first delay up to a limit.

Shared by the relay's reconnect loop and the sweeper. Pure (it only computes delays; the caller
waits), so its rules are tested without a clock.
"""

from __future__ import annotations


class Backoff:
    """``first``, then twice the previous delay, never more than ``limit`` — except that the first
    delay is always ``first``, even above ``limit``; :meth:`reset` starts over."""

    def __init__(self, first: float, limit: float) -> None:
        self._first = first
        self._limit = limit
        self._next = first

    def delay(self) -> float:
        """The delay before this retry; the next one is doubled."""
        delay = self._next
        self._next = min(delay * 2, self._limit)
        return delay

    def reset(self) -> None:
        """What was retried worked: the next failure waits ``first`` again."""
        self._next = self._first
