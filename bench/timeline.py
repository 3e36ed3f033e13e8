"""The steady-state window over time: latency and writer lag per second beside what PostgreSQL did.

A share within the target over 30 s says that a stall happened, not when nor why. This module puts
three clocks on one axis (seconds since the writers' schedule began, ``t0``):

- per second of the schedule (event ``i`` is due at ``t0 + i / rate``), from the consumer's
  records: the events due in that second, the writers' worst lag behind schedule (the payload's
  ``ts``, read by PostgreSQL at insert, minus the due time) and, when the consumer read during
  the window, insert -> consumer percentiles;
- per scrape interval, the relay's own commit -> acknowledgement histogram (``/metrics`` read by
  a sampler thread every :data:`SCRAPE_INTERVAL`): events acknowledged and the share within the
  target;
- what PostgreSQL did meanwhile: the sampler's look at ``pg_stat_activity`` (autovacuum workers
  and what they vacuum) and the server log's autovacuum and checkpoint lines (the bench's cluster
  logs them with an epoch timestamp, ``log_line_prefix = '%n [%p] '``), each with its start and
  end.

All of it is cheap enough to stay on in every run: one scrape and one catalog query per second.
"""

from __future__ import annotations

import itertools
import math
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg

from bench.harness import Histogram, ProcessCPU, cpu_breakdown, percentile

LONG_STATEMENT_S = 0.05  # a statement listed on its own in the JSON (the rest summed per second)
SCRAPE_INTERVAL = 1.0  # seconds between the sampler's looks at the relay and the database
QUIET_OTHER_PERCENT = 25.0  # an interval counts as quiet below this much foreign CPU (one core)
# Server settings that make the log say what this module reads (on top of the bench's).
LOG_SETTINGS = {
    "log_autovacuum_min_duration": "0",
    "log_checkpoints": "on",
    "track_io_timing": "on",
    "log_line_prefix": "%n [%p] [%a] ",
    # Every statement of a client (the relay's sweeper, its position record) that took this long,
    # with its duration; the writers' inserts run inside one CALL each and are not logged.
    "log_min_duration_statement": "0",
}

# "1700000000.123 [4242] LOG:  automatic vacuum of table "db.public.outbox": index scans: 1"
_LOG_LINE = re.compile(r"^(\d{9,11}\.\d{3}) \[(\d+)\] \[([^\]]*)\] (\w+):\s+(.*)$")
_DURATION = re.compile(r"^duration: ([0-9.]+) ms\s+(?:statement|execute [^:]*): (.*)$", re.S)
_AUTOVACUUM = re.compile(r'^automatic (vacuum|analyze) of table "([^"]+)"')
_ELAPSED = re.compile(r"elapsed: ([0-9.]+) s")
_CHECKPOINT = re.compile(r"^(checkpoint|restartpoint) (starting|complete)(?::\s*(.*))?$")
_CHECKPOINT_TOTAL = re.compile(r"total=([0-9.]+) s")

ACTIVITY_QUERY = """
SELECT a.pid, coalesce(a.query, ''), coalesce(v.phase, ''),
       coalesce(v.heap_blks_scanned, 0), coalesce(v.heap_blks_total, 0)
FROM pg_stat_activity a LEFT JOIN pg_stat_progress_vacuum v ON v.pid = a.pid
WHERE a.backend_type = 'autovacuum worker' AND a.state <> 'idle'
"""


@dataclass(frozen=True)
class ServerEvent:
    """Something the server logged: ``start`` and ``end`` in Unix time (equal when instant)."""

    kind: str  # "autovacuum", "autoanalyze", "checkpoint"
    what: str  # the table, or the checkpoint's cause
    start: float
    end: float
    detail: str = ""

    def relative(self, t0: float) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "what": self.what,
            "from_s": round(self.start - t0, 3),
            "to_s": round(self.end - t0, 3),
            "detail": self.detail,
        }


def parse_server_log(text: str, since: float = 0.0) -> list[ServerEvent]:
    """Autovacuum, autoanalyze and checkpoint events of a log written with ``%n [%p] `` lines,
    ending at or after ``since``. A vacuum's or analyze's start is its end minus its
    ``elapsed``; a checkpoint runs from its ``starting`` line to its ``complete`` line."""
    events: list[ServerEvent] = []
    checkpoint_started: tuple[float, str] | None = None
    current: tuple[float, str, str] | None = None  # (end, kind, table) awaiting its "elapsed"
    details: list[str] = []

    def close_current() -> None:
        nonlocal current
        if current is None:
            return
        end, kind, table = current
        elapsed = next((float(m.group(1)) for line in details if (m := _ELAPSED.search(line))), 0.0)
        if end >= since:
            events.append(
                ServerEvent(kind, table, end - elapsed, end, "; ".join(d.strip() for d in details))
            )
        current = None
        details.clear()

    for line in text.splitlines():
        match = _LOG_LINE.match(line)
        if match is None:
            if current is not None:
                details.append(line)
            continue
        close_current()
        at, application, message = float(match.group(1)), match.group(3), match.group(5)
        if (found := _DURATION.match(message)) is not None:
            took = float(found.group(1)) / 1000
            if at >= since:
                events.append(
                    ServerEvent(
                        "statement",
                        application or "?",
                        at - took,
                        at,
                        " ".join(found.group(2).split())[:120],
                    )
                )
        elif (found := _AUTOVACUUM.match(message)) is not None:
            kind = "autovacuum" if found.group(1) == "vacuum" else "autoanalyze"
            current = (at, kind, found.group(2))
            details.append(message[found.end() :].lstrip(": "))
        elif (found := _CHECKPOINT.match(message)) is not None:
            if found.group(2) == "starting":
                checkpoint_started = (at, found.group(3) or "")
            else:
                total = _CHECKPOINT_TOTAL.search(found.group(3) or "")
                if checkpoint_started is not None:
                    start, cause = checkpoint_started
                else:  # its start was before the part of the log read
                    start, cause = at - (float(total.group(1)) if total else 0.0), ""
                checkpoint_started = None
                if at >= since:
                    events.append(ServerEvent("checkpoint", cause, start, at, found.group(3) or ""))
    close_current()
    return events


@dataclass
class Sample:
    """One look of the sampler: Unix time, the relay's histogram, the autovacuum workers' work."""

    at: float
    histogram: Histogram
    database: dict[str, Any] = field(default_factory=dict)
    processes: dict[int, ProcessCPU] | None = None  # every process's CPU so far
    threads: dict[str, float] | None = None  # the relay's CPU so far by thread group


class Sampler:
    """A thread that scrapes ``scrape()`` (the relay's histogram) and ``activity()`` (the
    database's autovacuum workers) every ``interval`` seconds until :meth:`stop`."""

    def __init__(
        self,
        scrape: Callable[[], Histogram],
        activity: Callable[[], dict[str, Any]],
        interval: float = SCRAPE_INTERVAL,
        processes: Callable[[], dict[int, ProcessCPU]] | None = None,
        threads: Callable[[], dict[str, float]] | None = None,
    ) -> None:
        self._scrape = scrape
        self._activity = activity
        self._processes = processes
        self._threads = threads
        self._interval = interval
        self._stop = threading.Event()
        self.samples: list[Sample] = []
        self.errors: list[str] = []
        self._thread = threading.Thread(target=self._run, name="bench-timeline", daemon=True)

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def stop(self) -> list[Sample]:
        self._stop.set()
        self._thread.join()
        return self.samples

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            try:
                at = time.time()
                histogram = self._scrape()
                processes = self._processes() if self._processes is not None else None
                threads = self._threads() if self._threads is not None else None
                self.samples.append(Sample(at, histogram, self._activity(), processes, threads))
            except Exception as exc:  # a missed sample must not end the run
                self.errors.append(repr(exc))
            next_at += self._interval
            self._stop.wait(max(next_at - time.monotonic(), 0.0))


def database_activity(conn: psycopg.Connection[Any], table: str = "outbox") -> dict[str, Any]:
    """What each busy autovacuum worker is doing (its query and vacuum phase) and the outbox
    table's live and dead rows by the statistics."""
    rows = conn.execute(ACTIVITY_QUERY).fetchall()
    tuples = conn.execute(
        "SELECT n_live_tup, n_dead_tup, pg_relation_size(relid) / 8192 "
        "FROM pg_stat_user_tables WHERE relname = %s",
        (table,),
    ).fetchone()
    live, dead, pages = tuples if tuples is not None else (None, None, None)
    return {
        "autovacuum": [
            f"{query}" + (f" [{phase} {scanned}/{total}]" if phase else "")
            for _pid, query, phase, scanned, total in rows
        ],
        "outbox_live": live,
        "outbox_dead": dead,
        "outbox_pages": pages,
    }


def per_second(
    seqs: Sequence[int],
    inserted: Sequence[float],
    latencies_ms: Sequence[float] | None,
    *,
    t0: float,
    rate: float,
    target_ms: float,
) -> list[dict[str, Any]]:
    """Per second of the writers' schedule: events due, the writers' worst lag behind schedule,
    and, unless ``latencies_ms`` is None (the consumer read after the window), insert ->
    consumer p50 / p99 / max and share within ``target_ms``."""
    if latencies_ms is not None and len(latencies_ms) != len(seqs):
        raise ValueError("one latency per event, or none at all")
    bins: dict[int, tuple[list[float], list[float]]] = {}
    for index, (seq, ts) in enumerate(zip(seqs, inserted, strict=True)):
        due = seq / rate
        lags, lats = bins.setdefault(int(due), ([], []))
        lags.append(max(ts - (t0 + due), 0.0) * 1000)
        if latencies_ms is not None:
            lats.append(latencies_ms[index])
    rows = []
    for second in sorted(bins):
        lags, lats = bins[second]
        row: dict[str, Any] = {
            "t": second,
            "events": len(lags),
            "writer_lag_max_ms": round(max(lags), 1),
        }
        if lats:
            lats.sort()
            row["consumer_p50_ms"] = round(percentile(lats, 0.5), 1)
            row["consumer_p99_ms"] = round(percentile(lats, 0.99), 1)
            row["consumer_max_ms"] = round(lats[-1], 1)
            row["consumer_within_target"] = round(
                sum(1 for x in lats if x <= target_ms) / len(lats), 4
            )
        rows.append(row)
    return rows


def relay_intervals(
    samples: Sequence[Sample],
    t0: float,
    target_s: float,
    roots: dict[str, int] | None = None,
) -> list[dict[str, Any]]:
    """Per pair of consecutive samples: the events the relay acknowledged in between, their share
    within ``target_s`` and the p99's bucket; the autovacuum work seen at the interval's end;
    with ``roots`` (label -> root pid) and process snapshots, the CPU each tree used in between,
    ``other`` included (in % of one core: was the machine someone else's just then?)."""
    rows = []
    for earlier, later in itertools.pairwise(samples):
        cpu = (
            cpu_breakdown(earlier.processes, later.processes, later.at - earlier.at, roots)
            if roots and earlier.processes is not None and later.processes is not None
            else None
        )
        seconds = later.at - earlier.at
        threads = (
            {
                group: round((cpu - earlier.threads.get(group, 0.0)) / seconds * 100, 1)
                for group, cpu in sorted(later.threads.items())
            }
            if earlier.threads is not None and later.threads is not None and seconds > 0
            else None
        )
        delta = later.histogram.minus(earlier.histogram)
        within = delta.share_within(target_s)
        bucket = delta.bucket(0.99)
        rows.append(
            {
                "from_s": round(earlier.at - t0, 2),
                "to_s": round(later.at - t0, 2),
                "events": int(delta.count),
                "within_target": None if within is None else round(within, 4),
                "p99_bucket_ms": None
                if bucket is None
                else [round(b * 1000, 1) if math.isfinite(b) else None for b in bucket],
                **later.database,
                **({"cpu_percent_of_a_core": cpu} if cpu is not None else {}),
                **({"relay_threads_percent_of_a_core": threads} if threads is not None else {}),
            }
        )
    return rows


def early_late(rows: Sequence[dict[str, Any]], span: float = 10.0) -> dict[str, Any] | None:
    """The relay's CPU by thread group and the broker's, mean % of a core over the first and the
    last ``span`` seconds of the scrape intervals: at a constant event rate, what grows."""
    timed = [r for r in rows if "relay_threads_percent_of_a_core" in r and r.get("events")]
    if len(timed) < 2:
        return None
    end = timed[-1]["to_s"]
    first = [r for r in timed if r["from_s"] < timed[0]["from_s"] + span]
    last = [r for r in timed if r["to_s"] > end - span]

    def mean(chosen: Sequence[dict[str, Any]]) -> dict[str, float]:
        sums: dict[str, float] = {}
        for row in chosen:
            for group, value in row["relay_threads_percent_of_a_core"].items():
                sums[group] = sums.get(group, 0.0) + value
            broker = row.get("cpu_percent_of_a_core", {}).get("broker")
            if broker is not None:
                sums["broker (process)"] = sums.get("broker (process)", 0.0) + broker
            sums["within target"] = sums.get("within target", 0.0) + row["within_target"] * 100
        return {group: round(total / len(chosen), 1) for group, total in sums.items()}

    return {"span_s": span, "first": mean(first), "last": mean(last)}


def statement_ms(events: Sequence[ServerEvent], t0: float, seconds: int) -> list[dict[str, float]]:
    """Per second of the window (``seconds`` of them), the milliseconds the server spent in
    logged statements, by client (application name) and statement kind (``SELECT``,
    ``DELETE`` ...): a second in which the sweeper kept a backend busy for 900 ms shows."""
    busy: list[dict[str, float]] = [{} for _ in range(seconds)]
    for event in events:
        if event.kind != "statement":
            continue
        what = f"{event.what} {event.detail.split(' ', 1)[0]}".strip()
        start, end = event.start - t0, event.end - t0
        second = max(math.floor(start), 0)
        while second < seconds and second < end:
            overlap = min(end, second + 1) - max(start, second)
            if overlap > 0:
                busy[second][what] = busy[second].get(what, 0.0) + overlap * 1000
            second += 1
    return [{k: round(v, 1) for k, v in row.items() if v >= 0.5} for row in busy]


def quiet_share(rows: Sequence[dict[str, Any]], other_max: float) -> dict[str, Any]:
    """The share within the target over the scrape intervals in which other processes used less
    than ``other_max`` % of a core: on a shared machine, the relay's tail with its neighbours'
    worst minutes left out (how many intervals that kept is part of the answer)."""
    kept = [
        r
        for r in rows
        if r.get("within_target") is not None
        and r.get("cpu_percent_of_a_core", {}).get("other", math.inf) < other_max
    ]
    events = sum(r["events"] for r in kept)
    within = sum(r["within_target"] * r["events"] for r in kept)
    return {
        "other_below_percent_of_a_core": other_max,
        "intervals": len(kept),
        "of_intervals": len(rows),
        "events": events,
        "within_target": round(within / events, 4) if events else None,
    }


def statement_totals(seconds: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The window's statement time per client and kind (from ``per_second``), in ms."""
    totals: dict[str, float] = {}
    for row in seconds:
        for what, ms in row.get("statements_ms", {}).items():
            totals[what] = totals.get(what, 0.0) + ms
    return {k: round(v) for k, v in sorted(totals.items(), key=lambda item: -item[1])}


def worst(rows: Sequence[dict[str, Any]], key: str, count: int = 3) -> list[dict[str, Any]]:
    """The ``count`` rows with the lowest ``key`` (rows without it left out), in time order."""
    scored = [r for r in rows if r.get(key) is not None and r.get("events")]
    chosen = sorted(scored, key=lambda r: r[key])[:count]
    return sorted(chosen, key=lambda r: r.get("t", r.get("from_s", 0)))


def worst_lines(name: str, result: dict[str, Any]) -> list[str]:
    """The text report's lines for one steady-state run: its worst scrape intervals, each with
    the writers' lag, the busiest client statements in the seconds it spans, and the autovacuum
    and checkpoint runs of the window."""
    found = result.get("timeline")
    if not found:
        return []
    seconds = {row["t"]: row for row in found["per_second"]}
    parts = []
    for row in found["worst_relay_intervals"]:
        spanned = [
            seconds[t]
            for t in range(math.floor(row["from_s"]), math.ceil(row["to_s"]))
            if t in seconds
        ]
        lag = max((s["writer_lag_max_ms"] for s in spanned), default=0.0)
        busy: dict[str, float] = {}
        for second in spanned:
            for what, ms in second.get("statements_ms", {}).items():
                busy[what] = busy.get(what, 0.0) + ms
        top = sorted(busy.items(), key=lambda item: -item[1])[:2]
        statements = ", ".join(f"{what} {ms:.0f} ms" for what, ms in top if ms >= 20)
        other = row.get("cpu_percent_of_a_core", {}).get("other")
        parts.append(
            f"{row['from_s']:.1f}-{row['to_s']:.1f} s {row['within_target'] * 100:.0f} %, "
            f"writers {lag:.0f} ms behind"
            + (f", other processes {other:.0f} % of a core" if other is not None else "")
            + (f" ({statements})" if statements else "")
        )
    background = [
        f"{e['kind']} {e['what']} {e['from_s']:.1f}-{e['to_s']:.1f} s"
        for e in found["server_events"]
        if e["kind"] != "statement"
    ]
    growth = found.get("early_late")
    quiet = found.get("quiet", {})
    totals = list(found.get("statements_total_ms", {}).items())[:4]
    spent = ", ".join(f"{what} {ms / 1000:.1f} s" for what, ms in totals if ms >= 50)
    lines = [
        f"  {name}: " + "; ".join(parts),
        "    autovacuum and checkpoints in the window: " + ("; ".join(background) or "none"),
        "    statement time in the window: " + (spent or "none"),
    ]
    if growth:
        first, last = growth["first"], growth["last"]
        lines.append(
            f"    first vs last {growth['span_s']:g} s, % of a core: "
            + ", ".join(
                f"{group} {first.get(group, 0.0):.0f} → {last.get(group, 0.0):.0f}"
                for group in sorted(set(first) | set(last))
                if group != "within target"
            )
            + f"; within 20 ms {first.get('within target', 0.0):.1f} → "
            f"{last.get('within target', 0.0):.1f} %"
        )
    if quiet.get("within_target") is not None:
        lines.append(
            f"    within 20 ms in the {quiet['intervals']} of {quiet['of_intervals']} intervals "
            f"with other processes below {quiet['other_below_percent_of_a_core']:g} % of a core: "
            f"{quiet['within_target'] * 100:.2f} %"
        )
    return lines
