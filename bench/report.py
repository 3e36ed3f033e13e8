"""Targets, and the table ``python -m bench`` prints."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

# The project's targets; each is checked against every scenario it names.
# Catch-up at 10 rows/txn, after the relay's start-up: relay rows/s ÷ pg_recvlogical rows/s.
RATIO_AFTER_STARTUP_MIN = 0.95
CPU_US_MAX = 15.0  # relay CPU time per event, every scenario ...
CPU_US_MAX_CATCHUP_10 = 8.0  # ... and at most this in the catch-up at 10 rows/txn
# Commit -> Kafka acknowledgement p99 on the high-rate steady-state run (5k events/s), from the
# relay's histogram: 20 ms is one of its bucket bounds, so pass or fail is exact (bench/README.md).
P99_MS_MAX = 20.0
RSS_MB_MAX = 150.0  # relay peak RSS, every scenario
# Exactly once (CDC_RELAY_EXACTLY_ONCE=true): its catch-up rows/s ÷ the default relay's, same WAL,
# same rounds; and its p99 at the high steady rate.
EXACTLY_ONCE_VS_RELAY_MIN = 0.8
EXACTLY_ONCE_P99_MS_MAX = 150.0
# Catch-up: relay launch -> it sends START_REPLICATION, at most this much after the import floor
# of the same run (a fresh interpreter importing psycopg and pydantic-settings) ...
START_OVER_IMPORT_FLOOR_S = 0.05
START_REPLICATION_S_MAX = 0.15  # ... or this, in a scenario that did not time the import floor


@dataclass
class Target:
    scenario: str
    metric: str
    value: float
    op: str  # ">=" or "<="
    limit: float
    passed: bool | None  # None: not evaluated (--smoke)

    @property
    def label(self) -> str:
        symbol = "≥" if self.op == ">=" else "≤"
        return f"{symbol} {self.limit:g}"


def _check(value: float, op: str, limit: float) -> bool:
    return value >= limit if op == ">=" else value <= limit


def evaluate(scenarios: dict[str, dict[str, Any]], enforce: bool) -> list[Target]:
    targets: list[Target] = []

    def add(scenario: str, metric: str, value: float, op: str, limit: float) -> None:
        passed = _check(value, op, limit) if enforce else None
        targets.append(Target(scenario, metric, value, op, limit, passed))

    for key, result in scenarios.items():
        if key == "catchup_10_per_txn":
            add(key, "ratio_after_startup", result["ratio_after_startup"], ">=",
                RATIO_AFTER_STARTUP_MIN)  # fmt: skip
        sent = result["relay"].get("start_replication_s") if result["kind"] == "catchup" else None
        if sent is not None:
            limit = START_REPLICATION_S_MAX
            if "floor" in result:
                limit = round(result["floor"]["import_floor_s"] + START_OVER_IMPORT_FLOOR_S, 3)
            add(key, "start_replication_s", sent, "<=", limit)
        for name, variant in result.get("variants", {}).items():
            add(key, f"{name}: rows/s ÷ cdc-relay", variant["vs_relay"], ">=",
                EXACTLY_ONCE_VS_RELAY_MIN)  # fmt: skip
        if key == "steady_high":
            add(key, "commit_to_ack_p99_ms", result["relay_histogram"]["p99_ms"], "<=",
                P99_MS_MAX)  # fmt: skip
        if key == "steady_high_exactly_once":
            add(key, "latency_p99_ms", result["latency_ms"]["p99"], "<=", EXACTLY_ONCE_P99_MS_MAX)
        cpu_max = CPU_US_MAX_CATCHUP_10 if key == "catchup_10_per_txn" else CPU_US_MAX
        add(key, "cpu_us_per_event", result["relay"]["cpu_us_per_event"], "<=", cpu_max)
        add(key, "peak_rss_mb", result["relay"]["peak_rss_mb"], "<=", RSS_MB_MAX)
    return targets


def targets_json(targets: list[Target]) -> list[dict[str, Any]]:
    return [asdict(t) for t in targets]


def title(key: str, result: dict[str, Any]) -> str:
    if result["kind"] == "catchup":
        if result["transactions"] == 1:
            return f"1c catch-up, one {result['rows']:,}-row txn"
        part = "1a" if key == "catchup_10_per_txn" else "1b"
        return f"{part} catch-up, {result['rows']:,} rows, {result['rows_per_txn']:,}/txn"
    mode = ", exactly once" if key.endswith("_exactly_once") else ""
    return f"2 steady {result['target_rate']:,} ev/s for {result['duration_s']:g} s{mode}"


def _p99_note(hist: dict[str, Any]) -> str:
    """Where the relay's bucketed p99 truly lies, and the exact share within the target."""
    bucket = hist.get("p99_bucket_ms")
    if not bucket:
        return "bucketed"
    upper = "∞" if bucket[1] is None else f"{bucket[1]:g}"
    note = f"in ({bucket[0]:g}, {upper}]"
    share = hist.get("share_within_target")
    if share is not None:
        note += f"; {share * 100:.2f} % ≤ {hist['target_ms']:g} ms"
    return note


def _num(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def table(scenarios: dict[str, dict[str, Any]], targets: list[Target]) -> str:
    """One row per measure: relay value, baseline, ratio, target, result."""
    by_metric = {(t.scenario, t.metric): t for t in targets}
    header = ("scenario", "measure", "relay", "pg_recvlogical", "ratio", "target", "result")
    rows: list[tuple[str, ...]] = []

    def verdict(key: str, metric: str, note: str = "", otherwise: str = "") -> tuple[str, str]:
        """(target, result) of ``metric``, ``note`` beside the result; ``otherwise`` without one."""
        target = by_metric.get((key, metric))
        if target is None:
            return "", otherwise
        result = "-" if target.passed is None else ("PASS" if target.passed else "FAIL")
        return target.label, f"{result} {note}" if note else result

    for key, result in scenarios.items():
        name = title(key, result)
        relay = result["relay"]
        if result["kind"] == "catchup":
            base = result["pg_recvlogical"]
            rows.append(
                (
                    name,
                    "throughput, rows/s",
                    f"{relay['rows_per_s']:,}",
                    f"{base['rows_per_s']:,}",
                    f"{result['ratio']:.3f}",
                    "",
                    "",
                )
            )
            rows.append(
                ("", "time to all acknowledged, s", _num(relay["seconds"], 2),
                 _num(base["seconds"], 2), "", "", "")
            )  # fmt: skip
            if relay.get("start_replication_s") is not None:
                floor = result.get("floor")
                label = "launch → START_REPLICATION, s"
                if floor:
                    label += f" (import floor {floor['import_floor_s']:.3f})"
                rows.append(
                    ("", label, _num(relay["start_replication_s"], 3),
                     "", "", *verdict(key, "start_replication_s"))
                )  # fmt: skip
            if "startup_s" in relay:
                after = verdict(key, "ratio_after_startup")
                rows.append(
                    ("", f"  after the relay's start-up ({relay['startup_s']:.2f} s), rows/s",
                     f"{relay['rows_per_s_after_startup']:,}", "",
                     f"{result['ratio_after_startup']:.3f}", *(after if after[0] else ("", "info")))
                )  # fmt: skip
            for variant_name, variant in result.get("variants", {}).items():
                rows.append(
                    ("", f"{variant_name}: rows/s (÷ cdc-relay)", f"{variant['rows_per_s']:,}",
                     "", f"{variant['vs_relay']:.3f}",
                     *verdict(key, f"{variant_name}: rows/s ÷ cdc-relay"))
                )  # fmt: skip
        else:
            writer, latency, hist = (
                result["writer"],
                result["latency_ms"],
                result["relay_histogram"],
            )
            consumer = result["consumer"]
            rows.append(
                (name, "writer rate achieved, ev/s", _num(writer["achieved_rate"]),
                 "", "", "", f"max lag {writer['max_lag_ms']:g} ms")
            )  # fmt: skip
            if latency is None:
                rows.append(("", "insert→consumer", "-", "", "", "",
                             "consumer read after the window"))  # fmt: skip
            else:
                rows.append(
                    ("", "insert→consumer p50 / p95, ms", f"{_num(latency['p50'])} / "
                     f"{_num(latency['p95'])}", "", "", "", "")
                )  # fmt: skip
                rows.append(("", "insert→consumer p99, ms", _num(latency["p99"]), "", "",
                             *verdict(key, "latency_p99_ms", otherwise="info")))  # fmt: skip
                rows.append(("", "insert→consumer max, ms", _num(latency["max"]), "", "", "", ""))
            rows.append(
                ("", f"relay commit→Kafka ack p50 / p95, ms (n={hist['count']:,})",
                 f"{_num(hist['p50_ms'])} / {_num(hist.get('p95_ms'))}", "", "", "", "bucketed")
            )  # fmt: skip
            rows.append(
                ("", "relay commit→Kafka ack p99, ms", _num(hist["p99_ms"]), "", "",
                 *verdict(key, "commit_to_ack_p99_ms", _p99_note(hist), _p99_note(hist)))
            )  # fmt: skip
            receive = result.get("relay_receive_histogram")
            if receive:
                rows.append(
                    ("", "  of it commit→relay read (PostgreSQL), p50 / p99",
                     f"{_num(receive['p50_ms'])} / {_num(receive['p99_ms'])}", "", "", "",
                     "bucketed")
                )  # fmt: skip
            if consumer["missing"] or consumer["duplicates"]:
                rows.append(
                    ("", "missing / duplicate events", f"{consumer['missing']} / "
                     f"{consumer['duplicates']}", "", "", "",
                     "consumer stopped at its deadline" if consumer.get("timed_out") else "")
                )  # fmt: skip
        rows.append(
            ("", "relay CPU, µs/event", _num(relay["cpu_us_per_event"]), "", "",
             *verdict(key, "cpu_us_per_event"))
        )  # fmt: skip
        if "cpu_us_per_event_after_startup" in relay:
            rows.append(
                ("", f"  without start-up ({relay['startup_cpu_s']:.2f} s CPU)",
                 _num(relay["cpu_us_per_event_after_startup"]), "", "", "", "info")
            )  # fmt: skip
        if "cpu_us_per_event_net_of_idle" in relay:
            rows.append(
                ("", f"  net of idle ({relay['idle_cpu_percent']:.1f} % of a core at rest)",
                 _num(relay["cpu_us_per_event_net_of_idle"]), "", "", "", "info")
            )  # fmt: skip
        rows.append(
            ("", "relay peak RSS, MB", _num(relay["peak_rss_mb"]), "", "",
             *verdict(key, "peak_rss_mb"))
        )  # fmt: skip
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    right = {2, 3, 4}

    def line(row: tuple[str, ...]) -> str:
        cells = [
            cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
            for i, cell in enumerate(row)
        ]
        return "  ".join(cells).rstrip()

    rule = "  ".join("-" * w for w in widths)
    out = [line(header), rule]
    for row in rows:
        if row[0] and len(out) > 2:
            out.append("")
        out.append(line(row))
    return "\n".join(out)


def _grid(header: tuple[str, ...], rows: Sequence[tuple[str, ...]], right: set[int]) -> list[str]:
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]

    def line(row: tuple[str, ...]) -> str:
        cells = [
            cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
            for i, cell in enumerate(row)
        ]
        return "  ".join(cells).rstrip()

    return [line(header), "  ".join("-" * w for w in widths), *(line(row) for row in rows)]


BARE_PRODUCER = "bare producer (bench.floor)"
FLOOR = "floor: pg_recvlogical + bare producer"


def programs_table(scenarios: dict[str, dict[str, Any]]) -> list[str]:
    """Per catch-up scenario, every program on the same WAL: the comparison of issues 17 and 25,
    with the floor (the server's decoding plus a bare producer; the import floor) as rows."""
    header = ("program", "rows/s", "ratio", "after start-up: rows/s (ratio)", "CPU µs/row",
              "÷ floor", "START_REPLICATION s", "start-up s", "1st record s")  # fmt: skip
    tables: list[str] = []
    for key, result in scenarios.items():
        if result["kind"] != "catchup":
            continue
        base, relay = result["pg_recvlogical"], result["relay"]
        floor = result.get("floor")

        floor_cpu = floor["cpu_us_per_event"] if floor else None

        def program(
            name: str, run: dict[str, Any], floor_cpu: float | None = floor_cpu
        ) -> tuple[str, ...]:
            cpu = run["cpu_us_per_event"]
            return (name, f"{run['rows_per_s']:,}", f"{run['ratio']:.2f}",
                    f"{run['rows_per_s_after_startup']:,} ({run['ratio_after_startup']:.2f})",
                    _num(cpu), f"{cpu / floor_cpu:.2f}" if floor_cpu else "",
                    _num(run.get("start_replication_s"), 3), _num(run["startup_s"], 2),
                    _num(run.get("first_on_broker_s"), 2))  # fmt: skip

        rows: list[tuple[str, ...]] = [
            ("pg_recvlogical (to /dev/null)", f"{base['rows_per_s']:,}", "1", "",
             _num(base["cpu_us_per_event"]), "", "", "", ""),
        ]  # fmt: skip
        if floor:
            rows.append(program(BARE_PRODUCER, floor["bare_producer"]))
            rows.append(
                (FLOOR, "", "", "", _num(floor["cpu_us_per_event"]), "1",
                 f"{_num(floor['import_floor_s'], 3)} (imports)", "", "")
            )  # fmt: skip
        rows.append(program("cdc-relay", relay | _ratio_fields(result)))
        notes: list[str] = []
        if relay.get("on_broker", result["rows"]) > result["rows"]:
            notes.append(f"  cdc-relay: {relay['on_broker'] - result['rows']:,} duplicates")
        for name, variant in result.get("variants", {}).items():
            rows.append(program(name, variant))
            notes.append(f"  {name}: {variant['vs_relay']:.2f} of cdc-relay's rows/s, same rounds")
        others = {**result.get("baselines", {}), **result.get("peers", {})}
        for name, peer in others.items():
            if "seconds" in peer:
                if peer["on_broker"] > result["rows"]:
                    notes.append(f"  {name}: {peer['on_broker'] - result['rows']:,} duplicates")
                rows.append(program(name, peer))
            else:
                why = "skipped" if "skipped" in peer else "failed"
                rows.append((name, why, "", "", "", "", "", "", ""))
                notes.append(f"  {name} {why}: {peer[why].splitlines()[0]}")
        rounds = result.get("rounds", 1)
        done = f"{rounds} interleaved rounds, medians" if rounds > 1 else "one round"
        heading = f"{title(key, result)}: each program on its own copy of one slot, {done}"
        if floor:
            notes.append(
                "  floor: CPU of pg_recvlogical + the bare producer per row (both whole "
                "processes); START_REPLICATION of the floor: launch → exit of `python -c "
                "'import psycopg, pydantic_settings'`"
            )
        tables.append("\n".join([heading, *_grid(header, rows, set(range(1, 9))), *notes]))
    return tables


def _ratio_fields(result: dict[str, Any]) -> dict[str, Any]:
    return {"ratio": result["ratio"], "ratio_after_startup": result["ratio_after_startup"]}


def machine_line(machine: dict[str, Any]) -> str:
    return (
        f"{machine['cpu_model']}, {machine['cores']} cores, {machine['memory_gib']} GiB, "
        f"{machine['kernel']}; Python {machine['python']}; PostgreSQL {machine['postgresql']}; "
        f"librdkafka {machine['librdkafka']}; {machine['broker']}"
    )


def cpu_lines(scenarios: dict[str, dict[str, Any]], cores: int) -> list[str]:
    """Who used the CPU during each steady-state window, in % of one core."""
    lines: list[str] = []
    for key, result in scenarios.items():
        breakdown = result.get("cpu_percent_of_a_core")
        if breakdown:
            parts = ", ".join(f"{label} {value:g}" for label, value in breakdown.items())
            lines.append(f"  {title(key, result)}: {parts} (of {cores * 100} %)")
    if lines:
        lines.insert(0, "CPU during the steady-state windows, % of one core:")
    return lines


CPU_LABELS = ("server", "walsender", "broker", "program", "bench", "other", "machine")


def _catchup_programs(result: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Every program of a catch-up that ran, in the programs table's order."""
    floor = result.get("floor")
    programs = [("pg_recvlogical (to /dev/null)", result["pg_recvlogical"])]
    if floor:
        programs.append((BARE_PRODUCER, floor["bare_producer"]))
    programs.append(("cdc-relay", result["relay"]))
    others = {
        **result.get("variants", {}),
        **result.get("baselines", {}),
        **result.get("peers", {}),
    }
    programs += [(name, run) for name, run in others.items() if "seconds" in run]
    return programs


def cpu_runs_table(scenarios: dict[str, dict[str, Any]], cores: int) -> list[str]:
    """Per catch-up scenario: where the machine's CPU went during each program's run, and what
    the relay's main thread alone could sustain."""
    header = ("program", "run s", *CPU_LABELS, "µs/row: server (walsender)", "broker",
              "program", "main thread µs/row → rows/s alone",
              "main thread % run / runnable / waiting")  # fmt: skip
    tables: list[str] = []
    for key, result in scenarios.items():
        if result["kind"] != "catchup":
            continue
        rows: list[tuple[str, ...]] = []
        for name, run in _catchup_programs(result):
            during = run.get("cpu_during_run")
            if not during:
                continue
            percent, per_row = during["percent_of_a_core"], during["us_per_row"]
            shares = [_num(percent[label], 0) if label in percent else "-" for label in CPU_LABELS]
            main = run.get("main_thread_cpu_us_per_event_after_startup")
            alone = run.get("main_thread_rows_per_s_alone")
            split = run.get("main_thread_after_startup_percent")
            rows.append(
                (name, _num(during["window_s"], 2),
                 *shares,
                 f"{_num(per_row['server'], 2)} ({_num(per_row['walsender'], 2)})",
                 _num(per_row.get("broker"), 2) if "broker" in per_row else "-",
                 _num(per_row["program"], 2),
                 f"{_num(main, 2)} → {alone:,}" if main is not None and alone else "",
                 " / ".join(_num(split[k], 0) for k in ("running", "runnable", "waiting"))
                 if split else "")
            )  # fmt: skip
        if not rows:
            continue
        rounds = result.get("rounds", 1)
        done = f"medians of {rounds} rounds" if rounds > 1 else "one round"
        heading = (
            f"{title(key, result)}: CPU during each program's run, % of one core "
            f"(of {cores * 100}), {done}"
        )
        notes = [
            "  server: every process of the PostgreSQL cluster (exited ones included); "
            "walsender: of it, the replication connection's; program: the program's own "
            "process (every thread); bench: its broker counter and probes; machine: /proc/stat",
            "  main thread: its CPU per row after start-up, and 1 / that: the rows/s the loop "
            "could sustain with a core of its own; its wall time after start-up in % on a CPU, "
            "runnable without one (preempted: /proc schedstat), and neither (waiting on the "
            "server, the position write, a sleep)",
        ]
        tables.append("\n".join([heading, *_grid(header, rows, set(range(1, 14))), *notes]))
    return tables


def budget_lines(scenarios: dict[str, dict[str, Any]]) -> list[str]:
    """Issue 25 item 2 against this machine's cores, from the numbers of the same run."""
    lines: list[str] = []
    for key, result in scenarios.items():
        budget = result.get("floor", {}).get("budget")
        if not budget:
            continue
        base = result["pg_recvlogical"]["rows_per_s"]
        floor = budget["floor_us_per_row"]
        parts = " + ".join(f"{name} {value:.2f}" for name, value in floor.items())
        relay = budget["relay_run_us_per_row"]
        relay_parts = " + ".join(f"{name} {value:.2f}" for name, value in relay.items())
        verdict = (
            "reachable by the floor" if budget["reachable"] else "NOT reachable, even by the floor"
        )
        others = "reachable" if budget["reachable_on_what_others_left"] else "not reachable"
        lines += [
            f"Budget for ≥ {budget['ratio']:g}x pg_recvlogical after start-up (issue 25 item 2), "
            f"{title(key, result)}, this run's numbers:",
            f"  {budget['ratio']:g} x {base:,} = {budget['target_rows_per_s']:,} rows/s; the "
            f"floor per row, µs: {parts} = {budget['floor_us_per_row_sum']:.2f} (server: "
            f"pg_recvlogical's run, of it walsender {budget['walsender_us_per_row']:.2f}; broker "
            "and counter: the bare producer's run; bare producer after its start-up)",
            f"  → {budget['cores_needed']:.2f} cores needed of this machine's {budget['cores']}: "
            f"{verdict}; the floor alone could run {budget['floor_max_rows_per_s']:,} rows/s "
            f"({budget['floor_max_ratio']:.2f}x) with every core its own; the relay may spend "
            f"{budget['left_for_the_relay_us_per_row']:.2f} µs/row beyond the bare producer, it "
            f"spends {budget['relay_over_bare_producer_us_per_row']:.2f} more (after start-up)",
            f"  → the relay's own run per row, µs: {relay_parts} = "
            f"{budget['relay_run_us_per_row_sum']:.2f} (relay after its start-up): "
            f"{budget['relay_run_cores_needed']:.2f} cores at the target",
            f"  → other processes used {budget['other_processes_cores']:.2f} cores during the "
            f"runs (median): on what they left, {others} (the floor at most "
            f"{budget['floor_max_ratio_on_what_others_left']:.2f}x)",
        ]
    return lines
