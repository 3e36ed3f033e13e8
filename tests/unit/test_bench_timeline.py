"""The steady state's timeline (bench.timeline): the server log read into events with their start
and end, latency and writer lag per second, the relay's histogram per scrape."""

from __future__ import annotations

from typing import Any

import pytest

from bench.harness import Histogram, ProcessCPU, thread_group
from bench.timeline import (
    LOG_SETTINGS,
    Sample,
    ServerEvent,
    early_late,
    parse_server_log,
    per_second,
    quiet_share,
    relay_intervals,
    statement_ms,
    statement_totals,
    worst,
    worst_lines,
)

T0 = 1_700_000_000.0

LOG = f"""\
{T0 - 5:.3f} [11] [] LOG:  checkpoint starting: time
{T0 - 4.5:.3f} [11] [] LOG:  checkpoint complete: wrote 3 buffers (0.0%); write=0.001 s, \
sync=0.001 s, total=0.500 s; sync files=2
{T0 + 3.250:.3f} [42] [cdc-relay sweeper] LOG:  duration: 850.000 ms  execute <unnamed>: SELECT \
pg_current_wal_insert_lsn()::text, t."id"::text
  FROM "public"."outbox" AS t
{T0 + 3.250:.3f} [42] [cdc-relay sweeper] DETAIL:  parameters: $1 = '1', $2 = '1000'
{T0 + 4.010:.3f} [43] [cdc-relay] LOG:  duration: 12.000 ms  statement: BEGIN
{T0 + 21.400:.3f} [77] [] LOG:  automatic vacuum of table "bench.public.outbox": index scans: 1
\tpages: 0 removed, 6773 remain, 6773 scanned (100.00% of total)
\ttuples: 45000 removed, 50000 remain, 0 are dead but not yet removable
\tsystem usage: CPU: user: 0.30 s, system: 0.02 s, elapsed: 1.40 s
{T0 + 21.500:.3f} [77] [] LOG:  automatic analyze of table "bench.public.outbox"
\tsystem usage: CPU: user: 0.05 s, system: 0.00 s, elapsed: 0.10 s
{T0 + 25.000:.3f} [11] [] LOG:  checkpoint starting: wal
{T0 + 26.500:.3f} [11] [] LOG:  checkpoint complete: wrote 900 buffers (5.5%); write=1.2 s, \
sync=0.0 s, total=1.500 s
"""


def test_the_log_prefix_the_parser_reads_is_the_one_the_bench_sets() -> None:
    assert LOG_SETTINGS["log_line_prefix"] == "%n [%p] [%a] "
    assert LOG_SETTINGS["log_autovacuum_min_duration"] == "0"
    assert LOG_SETTINGS["log_checkpoints"] == "on"


def test_server_log_events_have_their_start_end_and_cause() -> None:
    events = parse_server_log(LOG, since=T0)
    by_kind = {(e.kind, e.what): e for e in events}
    assert [e.kind for e in events] == [
        "statement",
        "statement",
        "autovacuum",
        "autoanalyze",
        "checkpoint",
    ]  # the checkpoint that ended before the window is left out
    select = by_kind["statement", "cdc-relay sweeper"]
    assert select.end == pytest.approx(T0 + 3.25)
    assert select.start == pytest.approx(T0 + 2.4)
    assert select.detail.startswith("SELECT pg_current_wal_insert_lsn()")
    vacuum = by_kind["autovacuum", "bench.public.outbox"]
    assert (vacuum.start, vacuum.end) == pytest.approx((T0 + 20.0, T0 + 21.4))
    assert "45000 removed" in vacuum.detail
    analyze = by_kind["autoanalyze", "bench.public.outbox"]
    assert analyze.start == pytest.approx(T0 + 21.4)
    checkpoint = by_kind["checkpoint", "wal"]
    assert (checkpoint.start, checkpoint.end) == pytest.approx((T0 + 25, T0 + 26.5))
    assert vacuum.relative(T0) == {
        "kind": "autovacuum",
        "what": "bench.public.outbox",
        "from_s": 20.0,
        "to_s": 21.4,
        "detail": vacuum.detail,
    }


def test_a_checkpoint_whose_start_was_not_read_starts_at_its_end_minus_its_total() -> None:
    text = f"{T0 + 2:.3f} [11] [] LOG:  checkpoint complete: wrote 1 buffers; total=0.750 s\n"
    (event,) = parse_server_log(text, since=T0)
    assert (event.start, event.end) == pytest.approx((T0 + 1.25, T0 + 2))


def test_statement_time_is_split_over_the_seconds_it_spans() -> None:
    events = [
        ServerEvent("statement", "cdc-relay sweeper", T0 + 2.4, T0 + 3.25, "SELECT x"),
        ServerEvent("statement", "cdc-relay sweeper", T0 + 3.5, T0 + 3.6, "SELECT y"),
        ServerEvent("statement", "cdc-relay", T0 + 0.5, T0 + 0.502, "BEGIN"),
        ServerEvent("autovacuum", "bench.public.outbox", T0 + 1, T0 + 2),  # not a statement
        ServerEvent("statement", "late", T0 + 9, T0 + 9.5, "SELECT z"),  # beyond the window
    ]
    busy = statement_ms(events, T0, 4)
    assert busy[0] == {"cdc-relay BEGIN": 2.0}
    assert busy[1] == {}
    assert busy[2] == {"cdc-relay sweeper SELECT": pytest.approx(600.0)}
    assert busy[3] == {"cdc-relay sweeper SELECT": pytest.approx(350.0)}


def test_per_second_bins_events_by_their_due_time_with_the_writers_lag() -> None:
    rate = 4.0  # events 0..3 due in second 0, 4..7 in second 1
    seqs = [0, 1, 2, 3, 4, 5, 6, 7]
    inserted = [T0 + s / rate for s in seqs]
    inserted[5] += 0.120  # written 120 ms late
    latencies = [5.0, 6.0, 7.0, 30.0, 8.0, 9.0, 10.0, 11.0]
    rows = per_second(seqs, inserted, latencies, t0=T0, rate=rate, target_ms=20.0)
    assert [r["t"] for r in rows] == [0, 1]
    assert [r["events"] for r in rows] == [4, 4]
    assert rows[0]["consumer_within_target"] == 0.75
    assert rows[1]["consumer_within_target"] == 1.0
    assert rows[0]["writer_lag_max_ms"] == 0.0
    assert rows[1]["writer_lag_max_ms"] == pytest.approx(120.0)
    assert rows[0]["consumer_max_ms"] == 30.0
    assert rows[1]["consumer_p50_ms"] == 9.5
    assert worst(rows, "consumer_within_target", 1) == [rows[0]]


def test_per_second_without_consumer_latencies_keeps_the_events_and_the_writers_lag() -> None:
    # The consumer read after the window: its receive times are no latency.
    inserted = [T0, T0 + 0.25, T0 + 0.5 + 0.080, T0 + 1.0]
    rows = per_second([0, 1, 2, 4], inserted, None, t0=T0, rate=4.0, target_ms=20.0)
    assert rows == [
        {"t": 0, "events": 3, "writer_lag_max_ms": 80.0},
        {"t": 1, "events": 1, "writer_lag_max_ms": 0.0},
    ]
    assert worst(rows, "consumer_within_target") == []


def _histogram(within_5ms: float, within_20ms: float, total: float) -> Histogram:
    bounds = [0.005, 0.02, float("inf")]
    return Histogram(bounds, [within_5ms, within_20ms, total], total, 0.0)


def test_relay_intervals_are_the_histogram_between_two_scrapes() -> None:
    samples = [
        Sample(T0 - 0.3, _histogram(10, 20, 20)),
        Sample(T0 + 0.7, _histogram(100, 1000, 1020), {"autovacuum": []}),
        Sample(
            T0 + 1.7,
            _histogram(150, 1500, 2020),
            {"autovacuum": ["autovacuum: VACUUM public.outbox [scanning heap 10/20]"]},
        ),
    ]
    rows = relay_intervals(samples, T0, 0.02)
    assert [(r["from_s"], r["to_s"], r["events"]) for r in rows] == [
        (-0.3, 0.7, 1000),
        (0.7, 1.7, 1000),
    ]
    assert rows[0]["within_target"] == 0.98
    assert rows[1]["within_target"] == 0.5
    assert rows[1]["p99_bucket_ms"] == [20.0, None]
    assert rows[1]["autovacuum"] == ["autovacuum: VACUUM public.outbox [scanning heap 10/20]"]
    assert worst(rows, "within_target", 1) == [rows[1]]


def test_the_report_names_the_worst_intervals_with_what_the_server_did_then() -> None:
    result: dict[str, Any] = {
        "timeline": {
            "per_second": [
                {"t": 19, "writer_lag_max_ms": 50.2, "statements_ms": {"sweeper SELECT": 885}},
                {"t": 20, "writer_lag_max_ms": 119.2, "statements_ms": {"sweeper SELECT": 891}},
            ],
            "worst_relay_intervals": [
                {"from_s": 19.69, "to_s": 20.69, "within_target": 0.2696, "events": 5051}
            ],
            "server_events": [
                {"kind": "statement", "what": "sweeper", "from_s": 19.0, "to_s": 19.1},
                {"kind": "autovacuum", "what": "b.public.outbox", "from_s": 25.0, "to_s": 26.4},
            ],
        }
    }
    assert worst_lines("steady", result) == [
        "  steady: 19.7-20.7 s 27 %, writers 119 ms behind (sweeper SELECT 1776 ms)",
        "    autovacuum and checkpoints in the window: autovacuum b.public.outbox 25.0-26.4 s",
        "    statement time in the window: none",
    ]
    result["timeline"]["statements_total_ms"] = statement_totals(result["timeline"]["per_second"])
    result["timeline"]["quiet"] = {
        "other_below_percent_of_a_core": 25.0,
        "intervals": 12,
        "of_intervals": 30,
        "events": 60000,
        "within_target": 0.99125,
    }
    assert worst_lines("steady", result)[2:] == [
        "    statement time in the window: sweeper SELECT 1.8 s",
        "    within 20 ms in the 12 of 30 intervals with other processes below 25 % of a core: "
        "99.12 %",
    ]
    assert worst_lines("steady", {}) == []


def test_relay_intervals_say_how_much_of_the_machine_other_processes_used() -> None:
    def snapshot(relay: float, other: float) -> dict[int, ProcessCPU]:
        return {
            100: ProcessCPU("python", 1, relay, 0.0),
            200: ProcessCPU("valgrind", 1, other, 0.0),
        }

    samples = [
        Sample(T0, _histogram(0, 0, 0), {}, snapshot(1.0, 5.0)),
        Sample(T0 + 2.0, _histogram(10, 10, 10), {}, snapshot(1.4, 6.6)),
    ]
    (row,) = relay_intervals(samples, T0, 0.02, {"relay": 100})
    assert row["cpu_percent_of_a_core"] == {"relay": 20.0, "other": 80.0, "machine": 100.0}
    (bare,) = relay_intervals(samples, T0, 0.02)
    assert "cpu_percent_of_a_core" not in bare


def test_the_quiet_share_keeps_only_intervals_with_little_foreign_cpu() -> None:
    rows: list[dict[str, Any]] = [
        {"events": 1000, "within_target": 1.0, "cpu_percent_of_a_core": {"other": 5.0}},
        {"events": 3000, "within_target": 0.9, "cpu_percent_of_a_core": {"other": 24.9}},
        {"events": 5000, "within_target": 0.1, "cpu_percent_of_a_core": {"other": 80.0}},
        {"events": 5000, "within_target": 0.1},  # no CPU read: not known to be quiet
        {"events": 0, "within_target": None, "cpu_percent_of_a_core": {"other": 0.0}},
    ]
    assert quiet_share(rows, 25.0) == {
        "other_below_percent_of_a_core": 25.0,
        "intervals": 2,
        "of_intervals": 5,
        "events": 4000,
        "within_target": 0.925,
    }
    assert quiet_share(rows[2:4], 25.0)["within_target"] is None


def test_the_relay_threads_cpu_per_interval_and_first_against_last_seconds() -> None:
    def threads(main: float, broker: float) -> dict[str, float]:
        return {"main": main, "librdkafka broker": broker, "other threads": 0.5}

    samples = [
        Sample(T0 + t, _histogram(10 * t, 10 * t, 10 * t), {}, None, threads(0.1 * t, b))
        for t, b in enumerate([0.0, 0.05, 0.1, 0.3, 0.5, 0.7])
    ]
    rows = relay_intervals(samples, T0, 0.02)
    assert rows[0]["relay_threads_percent_of_a_core"] == {
        "librdkafka broker": 5.0,
        "main": 10.0,
        "other threads": 0.0,
    }
    growth = early_late(rows, span=2.0)
    assert growth == {
        "span_s": 2.0,
        "first": {"librdkafka broker": 5.0, "main": 10.0, "other threads": 0.0,
                  "within target": 100.0},
        "last": {"librdkafka broker": 20.0, "main": 10.0, "other threads": 0.0,
                 "within target": 100.0},
    }  # fmt: skip
    result: dict[str, Any] = {
        "timeline": {"per_second": [], "worst_relay_intervals": [], "server_events": []}
    }
    result["timeline"]["early_late"] = growth
    assert worst_lines("steady", result)[-1] == (
        "    first vs last 2 s, % of a core: librdkafka broker 5 → 20, main 10 → 10, "
        "other threads 0 → 0; within 20 ms 100.0 → 100.0 %"
    )
    assert early_late(rows[:1]) is None


def test_thread_groups_name_the_loop_librdkafka_and_the_rest() -> None:
    assert thread_group(10, 10, "python") == "main"
    assert thread_group(10, 11, "rdk:broker111") == "librdkafka broker"
    assert thread_group(10, 12, "rdk:broker-1") == "librdkafka other"  # the bootstrap connection
    assert thread_group(10, 13, "rdk:main") == "librdkafka other"
    assert thread_group(10, 14, "python") == "other threads"
