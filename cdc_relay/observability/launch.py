"""How long after its launch the relay sent ``START_REPLICATION``: the start-up figure.

Measured from the process's real start, as the kernel recorded it (``/proc/self/stat`` field 22,
the fork, before the interpreter even loaded), not from any moment inside Python: interpreter
start-up and imports count. That field has the kernel's clock-tick resolution (10 ms), so the
instant itself is also kept on ``CLOCK_MONOTONIC``, which every process on the machine shares: a
parent that noted ``time.monotonic()`` (or ``perf_counter()``, the same clock on Linux) before it
launched the relay gets the exact figure by subtracting.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Instant:
    """One moment of this process's life: on the shared monotonic clock, and since its launch."""

    monotonic: float
    since_launch: float | None  # None where /proc does not say (not Linux)


def process_age(stat: str, boottime: float, ticks_per_second: int) -> float | None:
    """Seconds since the process described by ``stat`` (a ``/proc/<pid>/stat`` line) started,
    given the current ``CLOCK_BOOTTIME``; None for a line that does not parse."""
    # The command name (field 2) is in parentheses and may hold spaces or parentheses itself.
    fields = stat.rsplit(")", 1)[-1].split()
    try:
        started_ticks = int(fields[19])  # field 22 of the whole line: starttime
    except (IndexError, ValueError):
        return None
    return max(boottime - started_ticks / ticks_per_second, 0.0)


def now() -> Instant:
    """This moment, with the time since this process was launched."""
    monotonic = time.monotonic()
    try:
        stat = Path("/proc/self/stat").read_text()
        boottime = time.clock_gettime(time.CLOCK_BOOTTIME)
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return Instant(monotonic, None)
    return Instant(monotonic, process_age(stat, boottime, ticks))
