"""Steady-state benchmark: writers at a fixed rate, end-to-end latency measured at a consumer.

Writers commit one outbox event per transaction on a fixed schedule (event ``i`` is due at
``t0 + i / rate``; a writer that falls behind sends at once, it never skips), spread over several
connections so that the writer keeps up; the achieved rate is measured and reported. The writers
are PL/pgSQL procedures inside PostgreSQL, so the load generator costs no client CPU. Each payload
carries ``clock_timestamp()`` taken by PostgreSQL while inserting the row; the transaction commits
immediately after. The relay's own ``cdc_relay_event_latency_seconds`` histogram (commit
timestamp to acknowledgement, bucketed) is scraped from /metrics before and after the measured
window: the latency measured. A consumer process (``bench.consumer``) reads all partitions and
counts that every event arrived exactly once. It reads after the window: the test broker's fetch
cost grows with everything a partition holds, and a consumer fetching during the window makes the
broker's acknowledgements slower as the window goes on (README, Performance). Where the consumer
is what is measured (exactly once: when a ``read_committed`` consumer sees an event) it reads
during the window and records ``receive time - ts``: insert to a consumer holding the record.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

import psycopg

from bench import timeline
from bench.harness import (
    PAD,
    RECEIVE_LATENCY_METRIC,
    TOPIC,
    TOPIC_PARTITIONS,
    Histogram,
    RelayChild,
    cpu_breakdown,
    create_outbox,
    percentile,
    postmaster_pid,
    process_snapshot,
    threads_cpu,
)
from bench.report import P99_MS_MAX
from cdc_relay.local import LocalBroker, LocalPostgres

WARMUP_EVENTS = 20
INSERT = (
    "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) "
    "VALUES (gen_random_uuid(), 'order', %s, 'order_created', jsonb_build_object("
    "'seq', %s::bigint, 'ts', extract(epoch FROM clock_timestamp()), 'pad', %s::text))"
)
# CDF points kept in the JSON (and plotted): every percent, then the tail.
CDF_QUANTILES = (*(i / 100 for i in range(100)), 0.995, 0.999, 0.9995, 0.9999, 1.0)


def default_writers(rate: int) -> int:
    """Connections for ``rate`` events/s: ~500 transactions/s each, 2 to 16."""
    return max(2, min(16, math.ceil(rate / 500)))


# The writer runs inside PostgreSQL: a Python client paced by time.sleep() cost ~90 µs of CPU per
# event (44 % of a core at 5,000 events/s), CPU the relay and the database then lacked.
PACED_WRITER = """
CREATE PROCEDURE bench_paced_writer(
    writer int, writers int, total int, rate float8, t0 float8, pad text,
    INOUT max_lag float8 DEFAULT 0, INOUT late int DEFAULT 0, INOUT finished float8 DEFAULT 0
) LANGUAGE plpgsql AS $$
DECLARE
    seq int := writer;
    due float8;
    now float8;
BEGIN
    WHILE seq < total LOOP
        due := t0 + seq / rate;
        now := extract(epoch FROM clock_timestamp());
        IF due > now THEN
            PERFORM pg_sleep(due - now);  -- rounded up to whole milliseconds by PostgreSQL
        ELSE
            max_lag := greatest(max_lag, now - due);
            late := late + (now - due > 0.002)::int;
        END IF;
        INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
        VALUES (gen_random_uuid(), 'order', 'order-' || seq % 1000, 'order_created',
                jsonb_build_object('seq', seq, 'ts', extract(epoch FROM clock_timestamp()),
                                   'pad', pad));
        COMMIT;
        seq := seq + writers;
    END LOOP;
    finished := extract(epoch FROM clock_timestamp());
END $$
"""


def write_events(
    connections: list[psycopg.Connection[Any]], rate: int, seconds: float
) -> dict[str, Any]:
    """Commit ``rate * seconds`` one-event transactions on schedule over ``connections``.

    Each connection runs the paced writer procedure for every ``len(connections)``-th event;
    the Python threads only wait for their CALL to return.
    """
    total = round(rate * seconds)
    writers = len(connections)
    connections[0].execute(PACED_WRITER.encode())
    results: list[tuple[float, int, float]] = [(0.0, 0, 0.0)] * writers
    errors: list[BaseException] = []
    t0 = time.time() + 0.3  # every writer has started its CALL by then

    def writer(index: int) -> None:
        try:
            row = (
                connections[index]
                .execute(
                    "CALL bench_paced_writer(%s, %s, %s, %s, %s, %s)",
                    (index, writers, total, float(rate), t0, PAD),
                )
                .fetchone()
            )
            assert row is not None
            results[index] = (float(row[0]), int(row[1]), float(row[2]))
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    threads = [
        threading.Thread(target=writer, args=(i,), name=f"bench-writer-{i}") for i in range(writers)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise RuntimeError(f"writer failed: {errors[0]!r}") from errors[0]
    elapsed = max(finished for _, _, finished in results) - t0
    return {
        "events": total,
        "writers": writers,
        "seconds": round(elapsed, 3),
        "achieved_rate": round(total / elapsed, 1),
        "max_lag_ms": round(max(lag for lag, _, _ in results) * 1000, 1),
        "late_events": sum(late for _, late, _ in results),
        "t0": t0,
    }


def consumer_timeout(seconds: float) -> float:
    """How long the consumer may take, once the relay published everything, to read the window's
    events: the test broker serves fetches more slowly the more it holds, so the consumer falls
    behind by a share of the window (seconds behind after a 60 s window), more on a busy machine."""
    return 120.0 + 2.0 * seconds


def write_warmup(url: str, count: int) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        for i in range(count):
            conn.execute(INSERT, ("order-warmup", -1 - i, PAD))


class ConsumerChild:
    """``python -m bench.consumer`` with line-based control over its stdin/stdout; with
    ``read_after`` it sends no fetch between ``warm`` and :meth:`result`."""

    def __init__(self, bootstrap: str, warmup: int, *, read_after: bool = False) -> None:
        self._out = Path(tempfile.mkstemp(prefix="cdc-relay-bench-", suffix=".json")[1])
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "bench.consumer", bootstrap, TOPIC, str(TOPIC_PARTITIONS),
                str(warmup), str(self._out), *(["--read-after"] if read_after else []),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=Path(__file__).resolve().parents[1],
        )  # fmt: skip
        self._pending = b""

    def wait_for(self, line: str, timeout: float) -> None:
        stdout: IO[bytes] | None = self.proc.stdout
        assert stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            while b"\n" in self._pending:
                got, self._pending = self._pending.split(b"\n", 1)
                if got.decode().strip() == line:
                    return
            ready, _, _ = select.select([stdout], [], [], 0.1)
            if ready:
                chunk = os.read(stdout.fileno(), 4096)
                if not chunk:
                    raise RuntimeError(f"consumer exited ({self.proc.wait()}) before {line!r}")
                self._pending += chunk
        raise RuntimeError(f"consumer did not say {line!r} within {timeout}s")

    def result(self, expected: int, timeout: float) -> dict[str, Any]:
        """What the consumer read once it has ``expected`` events; after ``timeout`` seconds, what
        it read until then (``timed_out``: the rest is reported missing, not the run lost)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{expected}\n".encode())
        self.proc.stdin.flush()
        timed_out = False
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            self.proc.terminate()  # it writes what it read, then exits
            self.proc.wait(30)
        if self.proc.returncode != 0:
            raise RuntimeError(f"consumer failed with exit code {self.proc.returncode}")
        result: dict[str, Any] = json.loads(self._out.read_text())
        result["timed_out"] = timed_out
        return result

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
        self._out.unlink(missing_ok=True)


def _latency_summary(latencies: list[float]) -> dict[str, Any]:
    ordered = sorted(latencies)
    return {
        "count": len(ordered),
        "mean": round(sum(ordered) / len(ordered), 3) if ordered else None,
        "p50": round(percentile(ordered, 0.50), 3),
        "p95": round(percentile(ordered, 0.95), 3),
        "p99": round(percentile(ordered, 0.99), 3),
        "max": round(ordered[-1], 3) if ordered else None,
        "cdf": [[q, round(percentile(ordered, q), 3)] for q in CDF_QUANTILES],
    }


def _histogram_summary(histogram: Histogram) -> dict[str, Any]:
    """The relay's commit -> acknowledgement histogram: interpolated quantiles, the bucket that
    holds the p99 (the true p99 lies inside it), and the exact share of events within the
    target when it is one of the relay's bounds."""

    def ms(value: float | None) -> float | None:
        return None if value is None or math.isinf(value) else round(value * 1000, 3)

    p99_bucket = histogram.bucket(0.99)
    within = histogram.share_within(P99_MS_MAX / 1000)
    count = histogram.count
    return {
        "count": int(count),
        "mean_ms": ms(histogram.sum / count) if count else None,
        "p50_ms": ms(histogram.quantile(0.50)),
        "p95_ms": ms(histogram.quantile(0.95)),
        "p99_ms": ms(histogram.quantile(0.99)),
        "p99_bucket_ms": None if p99_bucket is None else [ms(b) for b in p99_bucket],
        "target_ms": P99_MS_MAX,
        "share_within_target": None if within is None else round(within, 5),
        "bounds_ms": [b * 1000 for b in histogram.bounds if b != float("inf")],
        "cdf": [
            [ms(b), round(c / count, 5)]
            for b, c in zip(histogram.bounds, histogram.cumulative, strict=True)
            if b != float("inf") and count
        ],
    }


def _log_size(server: LocalPostgres) -> int:
    try:
        return server.log_path.stat().st_size
    except OSError:
        return 0


def _log_since(server: LocalPostgres, offset: int) -> str:
    """The server log written since ``offset`` (empty when there is none to read)."""
    try:
        with server.log_path.open("rb") as fh:
            fh.seek(offset)
            return fh.read().decode(errors="replace")
    except OSError:
        return ""


def _timeline(
    received: dict[str, Any],
    samples: list[timeline.Sample],
    server_log: str,
    *,
    t0: float,
    rate: int,
    errors: list[str],
    roots: dict[str, int],
    read_after_window: bool,
) -> dict[str, Any]:
    """The window over time (bench.timeline): per second of the schedule, per scrape of the
    relay, and what PostgreSQL logged; the worst seconds and intervals picked out."""
    seconds = timeline.per_second(
        received.get("seqs", []),
        received.get("inserted", []),
        None if read_after_window else received["latencies_ms"],
        t0=t0,
        rate=rate,
        target_ms=P99_MS_MAX,
    )
    relay_rows = timeline.relay_intervals(samples, t0, P99_MS_MAX / 1000, roots)
    events = timeline.parse_server_log(server_log, t0)
    busy = timeline.statement_ms(events, t0, seconds[-1]["t"] + 1 if seconds else 0)
    for row in seconds:
        row["statements_ms"] = busy[row["t"]]
    return {
        "t0_unix": round(t0, 3),
        "per_second": seconds,
        "relay_per_scrape": relay_rows,
        # Statements only when long: the per-second sums above hold the rest.
        "server_events": [
            e.relative(t0)
            for e in events
            if e.kind != "statement" or e.end - e.start >= timeline.LONG_STATEMENT_S
        ],
        "statements_total_ms": timeline.statement_totals(seconds),
        "quiet": timeline.quiet_share(relay_rows, timeline.QUIET_OTHER_PERCENT),
        "early_late": timeline.early_late(relay_rows),
        "worst_seconds": timeline.worst(seconds, "consumer_within_target"),
        "worst_relay_intervals": timeline.worst(relay_rows, "within_target"),
        "sampler_errors": errors[:5],
    }


def steady_scenario(
    server: LocalPostgres,
    name: str,
    rate: int,
    seconds: float,
    plugin: str = "pgoutput",
    *,
    writers: int | None = None,
    idle_seconds: float = 3.0,
    relay_settings: dict[str, str] | None = None,
    read_after_window: bool = True,
) -> dict[str, Any]:
    """One steady-state run in a fresh database and broker.

    Before the writers start, the relay's CPU is read across ``idle_seconds`` of nothing to do:
    what it costs at rest, reported beside (and subtracted in) the per-event figure. With
    ``read_after_window`` the consumer reads once the window is over (``latency_ms`` is then
    None); without, during it, and insert -> consumer is measured.
    """
    writers = writers or default_writers(rate)
    url = server.create_database(name)
    try:
        create_outbox(url, plugin)
        with LocalBroker() as broker:
            broker.create_topic(TOPIC, partitions=TOPIC_PARTITIONS)
            consumer = ConsumerChild(
                broker.bootstrap_servers, WARMUP_EVENTS, read_after=read_after_window
            )
            try:
                consumer.wait_for("ready", 30)
                with RelayChild(
                    url, broker.bootstrap_servers, plugin, settings=relay_settings
                ) as relay:
                    streaming_after = relay.wait_streaming()
                    startup_cpu = relay.cpu_seconds()
                    # Warm-up: topic metadata, producer connections, prepared statements.
                    write_warmup(url, WARMUP_EVENTS)
                    relay.wait_published(WARMUP_EVENTS, 60)
                    consumer.wait_for("warm", 60)
                    idle_from = relay.cpu_seconds()
                    time.sleep(idle_seconds)
                    idle_rate = (relay.cpu_seconds() - idle_from) / idle_seconds
                    before = relay.latency_histogram()
                    receive_before = relay.latency_histogram(RECEIVE_LATENCY_METRIC)
                    cpu_before = relay.cpu_seconds()
                    window_from = time.perf_counter()
                    processes = process_snapshot()
                    log_from = _log_size(server)
                    with contextlib.ExitStack() as stack:
                        connections = [
                            stack.enter_context(psycopg.connect(url, autocommit=True))
                            for _ in range(writers)
                        ]
                        watcher = stack.enter_context(psycopg.connect(url, autocommit=True))
                        roots = {
                            "relay": relay.pid,
                            "postgres": postmaster_pid(server),
                            "broker": broker.pid or 0,
                            "consumer": consumer.proc.pid,
                            "writer (bench)": os.getpid(),
                        }
                        sampler = timeline.Sampler(
                            relay.latency_histogram,
                            lambda: timeline.database_activity(watcher),
                            processes=process_snapshot,
                            threads=lambda: threads_cpu(relay.pid),
                        ).start()
                        try:
                            written = write_events(connections, rate, seconds)
                            events = int(written["events"])
                            relay.wait_published(WARMUP_EVENTS + events, 120)
                        finally:
                            samples = sampler.stop()
                        cpu_after = relay.cpu_seconds()
                        window = time.perf_counter() - window_from
                        # Before the writers' backends exit and take their CPU time along.
                        breakdown = cpu_breakdown(processes, process_snapshot(), window, roots)
                    rss = relay.peak_rss_mb()
                    # With exactly once an event is observed when its Kafka transaction commits,
                    # up to CDC_RELAY_TRANSACTION_INTERVAL after its acknowledgement.
                    histogram = relay.latency_histogram().minus(before)
                    settle = time.monotonic() + 10
                    while histogram.count < events and time.monotonic() < settle:
                        time.sleep(0.05)
                        histogram = relay.latency_histogram().minus(before)
                    receive = relay.latency_histogram(RECEIVE_LATENCY_METRIC).minus(receive_before)
                    received = consumer.result(events, consumer_timeout(seconds))
                    server_log = _log_since(server, log_from)
                    exit_code = relay.stop()
                    settings = relay.settings
            finally:
                consumer.close()
    finally:
        server.drop_database(name)

    def ms(value: float | None) -> float | None:
        return None if value is None else round(value * 1000, 3)

    cpu = cpu_after - cpu_before
    t0 = float(written.pop("t0"))
    return {
        "kind": "steady",
        "plugin": plugin,
        "target_rate": rate,
        "duration_s": seconds,
        "writer": written,
        "cpu_percent_of_a_core": breakdown,
        "consumer": {
            "received": received["received"],
            "missing": events - int(received["received"]),
            "timed_out": received["timed_out"],
            "duplicates": received["duplicates"],
            "reads": "after the window" if read_after_window else "during the window",
        },
        "latency_ms": None if read_after_window else _latency_summary(received["latencies_ms"]),
        "relay_histogram": _histogram_summary(histogram),
        # Commit -> the relay read the commit: how much of the latency is PostgreSQL's.
        "relay_receive_histogram": {
            "count": int(receive.count),
            "p50_ms": ms(receive.quantile(0.50)),
            "p99_ms": ms(receive.quantile(0.99)),
        },
        "timeline": _timeline(
            received,
            samples,
            server_log,
            t0=t0,
            rate=rate,
            errors=sampler.errors,
            roots=roots,
            read_after_window=read_after_window,
        ),
        "relay": {
            "streaming_after_s": round(streaming_after, 3),
            "startup_cpu_s": round(startup_cpu, 3),
            "cpu_s": round(cpu, 3),
            "cpu_us_per_event": round(cpu / events * 1e6, 2),
            "idle_cpu_percent": round(idle_rate * 100, 2),
            "cpu_us_per_event_net_of_idle": round(
                max(cpu - idle_rate * window, 0) / events * 1e6, 2
            ),
            "peak_rss_mb": round(rss, 1),
            "exit_code": exit_code,
            "settings": settings,
        },
    }
