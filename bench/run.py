"""``python -m bench``: every scenario in one run, a table, JSON and a PNG (see bench/README.md)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from bench import compiled
from bench import peer as peer_module
from bench.catchup import EXACTLY_ONCE, VARIANTS, catchup_scenario
from bench.harness import (
    REPO,
    foreign_cpu,
    load_average,
    machine_facts,
    postmaster_pid,
    process_snapshot,
)
from bench.plot import plot
from bench.report import (
    budget_lines,
    cpu_lines,
    cpu_runs_table,
    evaluate,
    machine_line,
    programs_table,
    table,
    targets_json,
    title,
)
from bench.steady import steady_scenario
from bench.timeline import LOG_SETTINGS, worst_lines
from cdc_relay.local import LocalPostgres

RESULTS = REPO / "bench" / "results"
SCENARIOS = (
    "catchup_10_per_txn",
    "catchup_1000_per_txn",
    "catchup_single_txn",
    "steady_low",
    "steady_high",
    "steady_high_exactly_once",
)
# Server settings on top of LocalPostgres's (wal_level=logical, fsync=off, ...). Commits flush WAL
# at once, as on a production server (with fsync=off the flush is a write(), not a disk sync):
# under synchronous_commit=off the walsender sees a commit only after the WAL writer's next round
# (wal_writer_delay, 200 ms), which would dominate any latency measured here.
# The log says when autovacuum and checkpoints ran, for the steady state's timeline.
POSTGRES_SETTINGS = {"synchronous_commit": "on", "max_wal_size": "4GB", **LOG_SETTINGS}
# Percent of the machine used by other processes above which results are flagged as disturbed.
BUSY_PERCENT = 5.0


@dataclass(frozen=True)
class Sizes:
    rows_10: int
    rows_1000: int
    rows_single: int
    rates: tuple[int, int]
    steady_seconds: float
    idle_seconds: float


FULL = Sizes(200_000, 1_000_000, 1_000_000, (1_000, 5_000), 30.0, 3.0)
SMOKE = Sizes(2_000, 10_000, 20_000, (200, 500), 2.0, 0.5)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="cdc-relay benchmark: catch-up against pg_recvlogical, steady-state latency, "
        "relay CPU and memory. Prints a table, writes JSON and a PNG.",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="tiny sizes (< 60 s), targets not evaluated"
    )
    parser.add_argument("--json", type=Path, default=RESULTS / "latest.json", help="result JSON")
    parser.add_argument("--plot", type=Path, default=RESULTS / "latest.png", help="result PNG")
    parser.add_argument(
        "--steady-seconds", type=float, help="steady-state duration (default 30, smoke 2)"
    )
    parser.add_argument(
        "--rates",
        help="the two steady-state rates, events/s, LOW,HIGH (default 1000,5000; smoke 200,500)",
    )
    parser.add_argument(
        "--only", help=f"comma-separated subset of the scenarios: {', '.join(SCENARIOS)}"
    )
    parser.add_argument("--plugin", choices=("pgoutput", "wal2json"), default="pgoutput")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="catch-up: interleaved rounds of every program, medians reported (default 1)",
    )
    parser.add_argument(
        "--no-peer",
        action="store_true",
        help=f"leave {peer_module.NAME} out of catchup_10_per_txn (default: in it when it can run)",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        action="append",
        default=[],
        metavar="CHECKOUT",
        help="catch-up: also run the relay from another checkout (e.g. `git worktree add "
        "/tmp/base <commit>`), interleaved, so a change's before and after share one run",
    )
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="catch-up: also run the relay as docker/Dockerfile builds it (mypyc, its build "
        "pins; built once per tree into bench/.compiled/), interleaved, as one more row",
    )
    parser.add_argument(
        "--relay-setting",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a relay setting for every scenario, e.g. sweep_interval=0 "
        "(CDC_RELAY_SWEEP_INTERVAL); repeatable. Default: the relay's defaults",
    )
    args = parser.parse_args(argv)
    settings: dict[str, str] = {}
    for item in args.relay_setting:
        name, sep, value = item.partition("=")
        if not sep or not name:
            parser.error(f"--relay-setting takes NAME=VALUE, got {item!r}")
        settings[name.strip().lower().removeprefix("cdc_relay_")] = value
    args.relay_setting = settings
    if args.rounds < 1:
        parser.error("--rounds takes a positive integer")
    args.baseline = [tree.resolve() for tree in args.baseline]
    for tree in args.baseline:
        if not (tree / "cdc_relay" / "__main__.py").is_file():
            parser.error(f"--baseline {tree}: not a checkout of cdc-relay")
    if args.only:
        unknown = set(args.only.split(",")) - set(SCENARIOS)
        if unknown:
            parser.error(f"unknown scenario(s) {sorted(unknown)}; choose from {SCENARIOS}")
    if args.rates:
        try:
            low, high = (int(r) for r in args.rates.split(","))
        except ValueError:
            parser.error("--rates takes two integers, LOW,HIGH")
        args.rates = (low, high)
    return args


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    sizes = SMOKE if args.smoke else FULL
    rates: tuple[int, int] = args.rates or sizes.rates
    seconds: float = args.steady_seconds or sizes.steady_seconds
    selected = args.only.split(",") if args.only else list(SCENARIOS)
    plugin: str = args.plugin
    extra: dict[str, str] = args.relay_setting
    rounds: int = args.rounds
    baselines: list[Path] = args.baseline
    if args.compiled and any(key.startswith("catchup") for key in selected):
        baselines = [*baselines, compiled.prepare()]
    started = time.perf_counter()
    started_at = datetime.datetime.now(datetime.UTC)
    peer: peer_module.PeerRuntime | str | None = None
    if "catchup_10_per_txn" in selected:
        if args.no_peer:
            peer = "left out (--no-peer)"
        else:
            _progress(f"preparing {peer_module.NAME} (bench/.peer-venv) ...")
            peer = peer_module.prepare()

    plans: dict[str, Callable[[LocalPostgres], dict[str, Any]]] = {
        "catchup_10_per_txn": lambda s: catchup_scenario(
            s,
            "bench_catchup_10",
            sizes.rows_10,
            10,
            plugin,
            relay_settings=extra,
            rounds=rounds,
            peer=peer,
            baselines=baselines,
            floor=True,
            variants=[EXACTLY_ONCE],
        ),
        "catchup_1000_per_txn": lambda s: catchup_scenario(
            s,
            "bench_catchup_1000",
            sizes.rows_1000,
            1000,
            plugin,
            relay_settings=extra,
            rounds=rounds,
            baselines=baselines,
        ),
        "catchup_single_txn": lambda s: catchup_scenario(
            s,
            "bench_catchup_single",
            sizes.rows_single,
            sizes.rows_single,
            plugin,
            relay_settings=extra,
            rounds=rounds,
            baselines=baselines,
        ),
        "steady_low": lambda s: steady_scenario(
            s,
            "bench_steady_low",
            rates[0],
            seconds,
            plugin,
            idle_seconds=sizes.idle_seconds,
            relay_settings=extra,
        ),
        "steady_high": lambda s: steady_scenario(
            s,
            "bench_steady_high",
            rates[1],
            seconds,
            plugin,
            idle_seconds=sizes.idle_seconds,
            relay_settings=extra,
        ),
        "steady_high_exactly_once": lambda s: steady_scenario(
            s,
            "bench_steady_high_eos",
            rates[1],
            seconds,
            plugin,
            idle_seconds=sizes.idle_seconds,
            relay_settings={**extra, **VARIANTS[EXACTLY_ONCE]},
            read_after_window=False,  # its latency is when a read_committed consumer sees it
        ),
    }
    scenarios: dict[str, dict[str, Any]] = {}
    with LocalPostgres(settings=POSTGRES_SETTINGS) as server:
        machine = machine_facts(server.url())
        busy = machine["busy_percent_at_start"]
        if busy > BUSY_PERCENT:
            _progress(
                f"warning: the machine is {busy:.0f} % busy before the benchmark starts: "
                "results will be lower than on a quiet machine"
            )
        roots = {os.getpid(), postmaster_pid(server)}
        for number, key in enumerate(selected, 1):
            _progress(f"[{number}/{len(selected)}] {key} ...")
            begun = time.perf_counter()
            before = process_snapshot()
            scenarios[key] = plans[key](server)
            other_cpu, top = foreign_cpu(before, process_snapshot(), roots)
            capacity = (time.perf_counter() - begun) * (os.cpu_count() or 1)
            scenarios[key]["other_processes"] = {
                "cpu_s": round(other_cpu, 2),
                "percent_of_machine": round(100 * other_cpu / capacity, 1),
                "top": top,
            }
            with psycopg.connect(server.url(), autocommit=True) as conn:
                conn.execute("CHECKPOINT")  # the next scenario starts from clean buffers
            _progress(
                f"[{number}/{len(selected)}] {key} done in {time.perf_counter() - begun:.1f}s"
            )
    machine["load_average_1m_at_end"] = load_average()
    disturbed = {
        key: value["other_processes"]
        for key, value in scenarios.items()
        if value["other_processes"]["percent_of_machine"] > BUSY_PERCENT
    }

    enforce = not args.smoke
    targets = evaluate(scenarios, enforce)
    result: dict[str, Any] = {
        "mode": "smoke" if args.smoke else "full",
        "started_at": started_at.isoformat(timespec="seconds"),
        "duration_s": round(time.perf_counter() - started, 1),
        "machine": machine,
        "postgres_settings": POSTGRES_SETTINGS,
        "plugin": plugin,
        "relay_settings": extra,
        "rounds": rounds,
        "peer": _peer_json(peer),
        "scenarios": scenarios,
        "targets": targets_json(targets),
        "notes": {
            "ratio": "program rows/s ÷ pg_recvlogical rows/s, each on its own copy of one "
            "template slot, same round of the same run; median over rounds",
            "peer": f"{peer_module.NAME}: launch → every row arrived in its topic (counted on "
            "the broker); its whole-process CPU (utime+stime, children included)",
            "catchup_time": "relay launch → slot confirmed past an LSN inside the last "
            "transaction (every event acknowledged by Kafka); includes the relay's start-up",
            "latency_ms": "steady state with exactly once, insert (clock_timestamp() in the "
            "payload, one-row transactions committed at once) → read_committed consumer receive; "
            "null where the consumer reads after the window (it only counts the events there: "
            "a consumer fetching from the test broker during the window slows its "
            "acknowledgements as the window goes on)",
            "relay_histogram": "the relay's cdc_relay_event_latency_seconds (commit → "
            "acknowledgement) over the measured window; quantiles interpolated inside buckets",
            "cpu_us_per_event": "relay utime+stime ÷ events; catch-up: whole run incl. start-up; "
            "steady state: the measured window only",
        },
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")

    print(f"cdc-relay benchmark ({result['mode']}, {plugin}), {result['started_at']}")
    if extra:
        print("relay settings: " + ", ".join(f"{k}={v}" for k, v in extra.items()))
    print(f"machine: {machine_line(machine)}")
    print(
        f"machine {machine['busy_percent_at_start']:.0f} % busy before the run; load average "
        f"(1 min) {machine['load_average_1m_at_start']:.2f} at start, "
        f"{machine['load_average_1m_at_end']:.2f} at end; run took {result['duration_s']:.0f} s"
    )
    for key, other in disturbed.items():
        print(
            f"warning: during {key}, other processes used {other['percent_of_machine']:.0f} % "
            f"of the machine ({', '.join(f'{n} {c:g} s' for n, c in other['top'])}): rerun it "
            "on a quiet machine"
        )
    print()
    print(table(scenarios, targets))
    print()
    for text in programs_table(scenarios):
        print(text)
        print()
    for text in cpu_runs_table(scenarios, machine["cores"] or 1):
        print(text)
        print()
    for line in budget_lines(scenarios):
        print(line)
    for line in cpu_lines(scenarios, machine["cores"] or 1):
        print(line)
    worst = [line for key, r in scenarios.items() for line in worst_lines(title(key, r), r)]
    if worst:
        print("Worst seconds of the steady-state windows (the relay's share within 20 ms):")
        print("\n".join(worst))
    if enforce:
        failed = [t for t in targets if t.passed is False]
        print(f"targets: {len(targets) - len(failed)} of {len(targets)} met")
    else:
        print("targets: not evaluated (--smoke)")
    print(f"JSON: {args.json}")
    message = plot(result, args.plot)
    print(message or f"plot: {args.plot}")
    return 1 if enforce and any(t.passed is False for t in targets) else 0


def _peer_json(peer: peer_module.PeerRuntime | str | None) -> dict[str, str] | None:
    if peer is None:
        return None
    if isinstance(peer, str):
        return {"name": peer_module.NAME, "skipped": peer}
    return {
        "name": peer_module.NAME,
        "python": peer.base_version,
        "interpreter": peer.base_python,
        "venv": str(peer.python.parent.parent),
    }


def main(argv: list[str] | None = None) -> int:
    return run(_parse_args(argv))
