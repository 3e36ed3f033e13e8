"""What the relay counts, kept as plain numbers so the hot path pays nanoseconds, not microseconds.

An OpenTelemetry histogram costs ~4 µs per ``record()`` in Python; the relay publishes tens of
thousands of events per second, so end-to-end latency is bucketed here (a bisect and two adds) and
handed to OpenTelemetry as an already aggregated histogram at collection time.
"""

from __future__ import annotations

import bisect
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from cdc_relay.lsn import format_lsn

# Seconds; explicit bucket boundaries in OpenTelemetry's sense (upper bounds, +Inf implied).
# Steps of 2.5 ms from 5 to 20 ms, 5-10 ms to 50 ms: where a streaming relay's latency lies, so
# that a quantile interpolated inside a bucket is off by 2.5 ms at most there, and an objective
# of 10, 15, 20, 25, 30 or 50 ms is a bucket bound (the share of events within it is exact).
LATENCY_BOUNDARIES: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.0175, 0.02, 0.025, 0.03, 0.04, 0.05,
    0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
)  # fmt: skip


class LatencyHistogram:
    """Cumulative fixed-bucket histogram; ``observe`` is the hot path."""

    __slots__ = ("boundaries", "count", "counts", "max", "min", "sum")

    def __init__(self, boundaries: tuple[float, ...] = LATENCY_BOUNDARIES) -> None:
        self.boundaries = boundaries
        self.counts = [0] * (len(boundaries) + 1)
        self.count = 0
        self.sum = 0.0
        self.min = float("inf")
        self.max = float("-inf")

    def observe(self, value: float, count: int = 1) -> None:
        """``count`` observations of ``value`` (the events a transaction's acknowledgement ends)."""
        # bisect_left: a value equal to a boundary falls in that boundary's bucket (le semantics).
        self.counts[bisect.bisect_left(self.boundaries, value)] += count
        self.count += count
        self.sum += value * count
        # Comparisons rather than min()/max(): this runs for every acknowledged transaction.
        if value < self.min:  # noqa: PLR1730
            self.min = value
        if value > self.max:  # noqa: PLR1730
            self.max = value


class SweeperCounters(Protocol):
    deleted_total: int
    rows_waiting: int
    last_sweep_at: float


@dataclass
class RelayStats:
    """Shared between the relay loop (writer) and the HTTP/metrics threads (readers)."""

    started_at: float = field(default_factory=time.time)
    published_by_topic: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    dead_lettered: int = 0
    skipped_in_kafka: int = 0  # replayed events not re-sent: read back from Kafka at the start
    transactions: int = 0
    # Publishing exactly once: Kafka transactions committed, and aborted (sent again).
    kafka_transactions_committed: int = 0
    kafka_transactions_aborted: int = 0
    reconnects: int = 0
    producer_errors: int = 0
    sessions: int = 0
    latency: LatencyHistogram = field(default_factory=LatencyHistogram)  # commit -> Kafka ack
    receive_latency: LatencyHistogram = field(default_factory=LatencyHistogram)  # commit -> read
    # Positions (LSNs as integers) and times (Unix seconds); 0 until known.
    confirmed_lsn: int = 0
    received_lsn: int = 0
    server_wal_end: int = 0
    last_acked_commit_time: float = 0.0
    caught_up: bool = False
    retained_wal_bytes: int | None = None
    in_flight: int = 0
    streaming: bool = False
    leader: bool = False  # relays as the leader (cdc_relay.leadership); False: a standby
    # The leadership's own view (its lease by the local clock): a leader whose loop is blocked,
    # e.g. on a connection into a partition, still stops saying it leads once its lease ran out.
    lease_valid: Callable[[], bool] = lambda: True
    # A session that is no relay holding the leader lock (pid, role), as the leadership saw it.
    foreign_lock_holder: Callable[[], dict[str, object] | None] = lambda: None
    last_loop: float = field(default_factory=time.monotonic)
    delivery_stalled: bool = False
    sweeper: SweeperCounters | None = None  # set when the relay runs its sweeper
    # The first START_REPLICATION: on the monotonic clock all processes share, and seconds since
    # the process was launched (cdc_relay.observability.launch). None until it is sent.
    start_replication_monotonic: float | None = None
    start_replication_after_launch_s: float | None = None
    # What the last start named as possibly never streamed (cdc_relay.publication_stamp): the
    # change, the transactions and the query that finds their rows. None: nothing named.
    rows_in_doubt: dict[str, object] | None = None
    # A recovery of a lost slot, as it goes (cdc_relay.recovery.plan.Plan.summary); None: none
    recovery: dict[str, object] | None = None
    slot_lost: bool = False  # the last start found the slot dropped or invalidated, unrecovered

    def recovery_rows_remaining(self) -> int:
        """Rows a running recovery still owes Kafka (0: none runs)."""
        shown = self.recovery
        if not shown or shown.get("state") == "done":
            return 0
        return max(int(str(shown.get("rows", 0))) - int(str(shown.get("done", 0))), 0)

    @property
    def leading(self) -> bool:
        """What /status, /readyz and the role metric say."""
        return self.leader and self.lease_valid()

    @property
    def published(self) -> int:
        return sum(self.published_by_topic.values())

    @property
    def lag_bytes(self) -> int:
        return max(self.server_wal_end - self.confirmed_lsn, 0) if self.server_wal_end else 0

    def lag_seconds(self, now: float | None = None) -> float:
        """Age of the newest acknowledged commit while work is pending; 0 when caught up."""
        if self.caught_up or not self.last_acked_commit_time:
            return 0.0
        return max((now or time.time()) - self.last_acked_commit_time, 0.0)

    def snapshot(self) -> dict[str, object]:
        """The numbers ``status`` and ``/status`` show."""
        return {
            "role": "leader" if self.leading else "standby",
            "leader_lock_held_by": self.foreign_lock_holder(),
            "streaming": self.streaming,
            "uptime_s": round(time.time() - self.started_at, 1),
            "start_replication_monotonic": self.start_replication_monotonic,
            "start_replication_after_launch_s": self.start_replication_after_launch_s,
            "published": self.published,
            "published_by_topic": dict(self.published_by_topic),
            "dead_lettered": self.dead_lettered,
            "transactions": self.transactions,
            "kafka_transactions_committed": self.kafka_transactions_committed,
            "kafka_transactions_aborted": self.kafka_transactions_aborted,
            "reconnects": self.reconnects,
            "producer_errors": self.producer_errors,
            "in_flight": self.in_flight,
            "confirmed_lsn": format_lsn(self.confirmed_lsn),
            "server_wal_end": format_lsn(self.server_wal_end),
            "lag_bytes": self.lag_bytes,
            "lag_seconds": round(self.lag_seconds(), 3),
            "retained_wal_bytes": self.retained_wal_bytes,
            "latency_count": self.latency.count,
            "swept_rows": self.sweeper.deleted_total if self.sweeper else None,
            "rows_waiting_to_be_swept": self.sweeper.rows_waiting if self.sweeper else None,
            "last_sweep_at": self.sweeper.last_sweep_at if self.sweeper else None,
            "rows_in_doubt": self.rows_in_doubt,
            "slot_lost": self.slot_lost,
            "recovery": self.recovery,
        }
