"""The bench's steady-state target: commit -> Kafka acknowledgement p99 from the relay's own
histogram, as /metrics exposes it, exact at the target because the target is a bucket bound."""

from __future__ import annotations

import itertools
import math

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from bench.harness import Histogram, parse_histogram
from bench.report import P99_MS_MAX, evaluate, table
from bench.steady import _histogram_summary
from cdc_relay.observability.metrics import RelayMetrics
from cdc_relay.observability.stats import LATENCY_BOUNDARIES, RelayStats

TARGET_S = P99_MS_MAX / 1000
# Latencies in seconds, dense around the target and its neighbouring bounds.
latencies = st.lists(
    st.one_of(
        st.floats(0.0, 0.06, allow_nan=False),
        st.sampled_from(LATENCY_BOUNDARIES[:14]),
        st.floats(0.06, 400.0, allow_nan=False),
    ),
    min_size=1,
    max_size=300,
)


def _scraped(values: list[float]) -> Histogram:
    """``values`` observed by the relay, read back from its Prometheus text as the bench does."""
    stats = RelayStats()
    metrics = RelayMetrics(stats, CollectorRegistry())
    try:
        for value in values:
            stats.latency.observe(value)
        return parse_histogram(metrics.prometheus_text().decode())
    finally:
        metrics.shutdown()


def _nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(math.ceil(q * len(ordered)), 1) - 1]


def test_the_target_is_a_bound_of_the_relay_histogram_with_steps_of_at_most_2_5_ms_below_it() -> (
    None
):
    assert TARGET_S in LATENCY_BOUNDARIES
    below = [b for b in LATENCY_BOUNDARIES if 0.005 <= b <= TARGET_S]
    assert max(b - a for a, b in itertools.pairwise(below)) <= 0.0025 + 1e-12


@settings(max_examples=60, deadline=None)
@given(latencies)
def test_pass_or_fail_at_the_target_is_exact_and_the_p99_lies_in_the_bucket_reported(
    values: list[float],
) -> None:
    histogram = _scraped(values)
    assert histogram.count == len(values)
    true_p99 = _nearest_rank(values, 0.99)
    share = histogram.share_within(TARGET_S)
    assert share == sum(v <= TARGET_S for v in values) / len(values)
    # The bench's verdict (interpolated p99 <= 20 ms) is the exact answer to "p99 <= 20 ms".
    p99 = histogram.quantile(0.99)
    assert p99 is not None
    assert (p99 <= TARGET_S) == (true_p99 <= TARGET_S) == (share >= 0.99)
    bucket = histogram.bucket(0.99)
    assert bucket is not None
    lower, upper = bucket
    assert lower < true_p99 <= upper or (lower == 0.0 and true_p99 <= upper)


def test_the_steady_target_row_gates_on_the_relay_histogram_not_on_the_consumer() -> None:
    # 99.5 % of events acknowledged within 20 ms; the consumer saw a slow broker hand-over.
    values = [0.008] * 980 + [0.019] * 15 + [0.03] * 5
    summary = _histogram_summary(_scraped(values))
    assert summary["share_within_target"] == 0.995
    assert summary["p99_bucket_ms"] == [17.5, 20.0]
    result = {
        "kind": "steady",
        "target_rate": 5000,
        "duration_s": 20,
        "writer": {"achieved_rate": 5000.0, "max_lag_ms": 1.0},
        "consumer": {"missing": 0, "duplicates": 0},
        "latency_ms": {"p50": 15.0, "p95": 80.0, "p99": 150.0, "max": 200.0},
        "relay_histogram": summary,
        "relay": {"cpu_us_per_event": 10.0, "peak_rss_mb": 80.0},
    }
    targets = evaluate({"steady_high": result}, enforce=True)
    latency = [t for t in targets if "p99" in t.metric]
    assert [(t.metric, t.passed) for t in latency] == [("commit_to_ack_p99_ms", True)]
    lines = table({"steady_high": result}, targets).splitlines()
    (consumer,) = [line for line in lines if "insert→consumer p99" in line]
    assert consumer.endswith("info")
    (relay,) = [line for line in lines if "commit→Kafka ack p99" in line]
    assert relay.endswith("≤ 20    PASS in (17.5, 20]; 99.50 % ≤ 20 ms")
    # One more slow event per hundred: the p99 is past 20 ms, and the row says FAIL.
    summary = _histogram_summary(_scraped([0.008] * 985 + [0.03] * 15))
    result["relay_histogram"] = summary
    assert summary["p99_bucket_ms"] == [25.0, 30.0]
    assert [t.passed for t in evaluate({"steady_high": result}, True) if "p99" in t.metric] == [
        False
    ]


def test_a_consumer_that_read_after_the_window_reports_no_latency_and_the_relay_gates() -> None:
    result = {
        "kind": "steady",
        "target_rate": 5000,
        "duration_s": 20,
        "writer": {"achieved_rate": 5000.0, "max_lag_ms": 1.0},
        "consumer": {"missing": 0, "duplicates": 0, "reads": "after the window"},
        "latency_ms": None,
        "relay_histogram": _histogram_summary(_scraped([0.008] * 1000)),
        "relay": {"cpu_us_per_event": 10.0, "peak_rss_mb": 80.0},
    }
    targets = evaluate({"steady_high": result}, enforce=True)
    assert [(t.metric, t.passed) for t in targets if "p99" in t.metric] == [
        ("commit_to_ack_p99_ms", True)
    ]
    lines = table({"steady_high": result}, targets).splitlines()
    (consumer,) = [line for line in lines if "insert→consumer" in line]
    assert consumer.rstrip().endswith("consumer read after the window")
    (relay,) = [line for line in lines if "commit→Kafka ack p99" in line]
    assert "PASS" in relay
