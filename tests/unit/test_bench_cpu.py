"""The bench's CPU accounting during a catch-up's runs, issue 25 item 2's budget from it, and the
Docker image's build as a row (``--compiled``): the pure parts, on made-up /proc contents."""

from __future__ import annotations

import importlib.machinery
import subprocess
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench import compiled
from bench.catchup import _median, _summary, baseline_label, cpu_during_run, item2_budget
from bench.harness import (
    KTHREADD,
    ProcessCPU,
    cpu_breakdown,
    cpu_seconds_by_tree,
    parse_cpu_line,
    parse_schedstat,
    parse_stat,
)
from bench.report import budget_lines, cpu_runs_table

REPO = Path(__file__).resolve().parents[2]


def _stat(pid: int, name: str, ppid: int, utime: int, stime: int, cutime: int, cstime: int) -> str:
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime ...
    return f"{pid} ({name}) S {ppid} 1 1 0 -1 4194560 10 0 0 0 {utime} {stime} {cutime} {cstime} 20"


def test_a_stat_line_gives_own_and_reaped_cpu_whatever_the_command_name() -> None:
    text = _stat(42, "postgres: a) (b", 7, 150, 50, 300, 100)
    assert parse_stat(text, 100) == ProcessCPU("postgres: a) (b", 7, 2.0, 4.0)


@given(st.text(alphabet=st.characters(exclude_characters="\0\n"), max_size=30))
def test_any_command_name_parses(name: str) -> None:
    parsed = parse_stat(_stat(9, name, 1, 1, 2, 3, 4), 100)
    assert (parsed.parent, parsed.cpu, parsed.reaped) == (1, 0.03, 0.07)


def test_the_machine_is_busy_in_user_nice_system_irq_softirq_not_idle_iowait_or_steal() -> None:
    # user nice system idle iowait irq softirq steal guest guest_nice
    line = "cpu  100 10 50 1000 20 5 15 300 40 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n"
    assert parse_cpu_line(line, 100) == pytest.approx((100 + 10 + 50 + 5 + 15) / 100)


def _p(name: str, parent: int, cpu: float, reaped: float = 0.0) -> ProcessCPU:
    return ProcessCPU(name, parent, cpu, reaped)


def test_each_tree_counts_its_own_and_its_exited_children_once() -> None:
    bench, postmaster, relay, broker, other = 100, 200, 101, 102, 300
    before = {
        1: _p("init", 0, 5.0),
        bench: _p("python", 1, 10.0, 1.0),
        relay: _p("python", bench, 0.0),
        broker: _p("tansu", bench, 3.0),
        postmaster: _p("postgres", 1, 1.0, 2.0),
        201: _p("postgres", postmaster, 4.0),  # checkpointer
        202: _p("postgres", postmaster, 0.5),  # a backend that exits in between
        other: _p("bash", 1, 7.0),
        KTHREADD: _p("kthreadd", 0, 1.0),
        3: _p("kworker/0:1", KTHREADD, 9.0),
    }
    after = {
        1: _p("init", 0, 5.0),
        bench: _p("python", 1, 10.5, 1.0),
        relay: _p("python", bench, 2.0),
        103: _p("python", relay, 0.25),  # a child of the relay: the relay's tree
        broker: _p("tansu", bench, 4.0),
        # the backend exited (0.75 s in all) and the walsender (1.5 s) too: both reaped
        postmaster: _p("postgres", 1, 1.0, 2.0 + 0.75 + 1.5),
        201: _p("postgres", postmaster, 4.25),
        other: _p("bash", 1, 8.0),
        KTHREADD: _p("kthreadd", 0, 1.0),
        3: _p("kworker/0:1", KTHREADD, 19.0),  # kernel threads: left out
    }
    roots = {"server": postmaster, "program": relay, "broker": broker, "bench": bench}
    used = cpu_seconds_by_tree(before, after, roots)
    assert used == pytest.approx(
        {"server": 0.25 + 0.25 + 1.5, "program": 2.25, "broker": 1.0, "bench": 0.5, "other": 1.0}
    )
    percent = cpu_breakdown(before, after, 2.0, roots)
    assert percent["server"] == 100.0
    assert percent["machine"] == pytest.approx(sum(100 * s / 2.0 for s in used.values()), abs=0.5)


def test_a_program_that_exited_but_is_not_reaped_counts_for_itself_not_its_parent() -> None:
    """The catch-up ends a run's window on a zombie (waitid WNOWAIT): its CPU is its own."""
    bench, program = 100, 101
    before = {bench: _p("python", 1, 1.0)}
    zombie = {bench: _p("python", 1, 1.0), program: _p("pg_recvlogical", bench, 0.75)}
    reaped = {bench: _p("python", 1, 1.0, 0.75)}
    roots = {"program": program, "bench": bench}
    assert cpu_seconds_by_tree(before, zombie, roots) == {
        "program": 0.75,
        "bench": 0.0,
        "other": 0.0,
    }
    assert cpu_seconds_by_tree(before, reaped, roots)["bench"] == 0.75  # why it must not be


def test_a_run_in_percent_of_a_core_and_per_row() -> None:
    during = {"window_s": 2.0, "cpu_s": {"server": 1.0, "walsender": 0.8, "machine": 3.0}}
    assert cpu_during_run(100_000, during) == {
        "window_s": 2.0,
        "percent_of_a_core": {"server": 50.0, "walsender": 40.0, "machine": 150.0},
        "us_per_row": {"server": 10.0, "walsender": 8.0, "machine": 30.0},
    }


def test_medians_go_into_nested_figures_and_skip_missing_ones() -> None:
    runs: list[dict[str, Any]] = [
        {"round": 1, "seconds": 1.0, "alone": None, "cpu": {"server": 10.0, "other": 1.0}},
        {"round": 2, "seconds": 3.0, "alone": 5, "cpu": {"server": 30.0, "other": 5.0}},
        {"round": 3, "seconds": 2.0, "alone": 7, "cpu": {"server": 20.0, "other": 3.0}},
    ]
    assert _median(runs) == {"seconds": 2.0, "alone": 6, "cpu": {"server": 20.0, "other": 3.0}}


def _during(**us_per_row: float) -> dict[str, Any]:
    return {"us_per_row": us_per_row, "percent_of_a_core": {}, "window_s": 1.0}


def _budget_inputs(
    server: float, broker: float, bare: float
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    recvlogical = {
        "rows_per_s": 150_000,
        "cpu_during_run": _during(server=server, walsender=server - 0.5),
    }
    bare_producer = {
        "cpu_us_per_event_after_startup": bare,
        "cpu_during_run": _during(server=0.1, broker=broker, program=bare, bench=1.0),
    }
    relay = {
        "cpu_us_per_event_after_startup": bare + 4.0,
        "cpu_during_run": _during(server=6.0, broker=broker, program=bare + 4.5, bench=1.0),
    }
    return recvlogical, bare_producer, relay


def test_the_budget_says_when_even_the_floor_needs_more_cores_than_the_machine_has() -> None:
    budget = item2_budget(*_budget_inputs(5.0, 4.0, 6.0), cores=2, other_percent=10.0)
    # 0.95 x 150,000 = 142,500 rows/s x (5 + 4 + 6 + 1) µs = 2.28 cores, of 2
    assert budget["target_rows_per_s"] == 142_500
    assert budget["floor_us_per_row"] == {
        "server": 5.0,
        "broker": 4.0,
        "bare producer": 6.0,
        "bench (broker counter)": 1.0,
    }
    assert budget["walsender_us_per_row"] == 4.5
    assert budget["floor_us_per_row_sum"] == 16.0
    assert budget["cores_needed"] == 2.28
    assert budget["reachable"] is False
    assert budget["floor_max_rows_per_s"] == 125_000  # 2 cores / 16 µs
    assert budget["floor_max_ratio"] == 0.833
    assert budget["left_for_the_relay_us_per_row"] == round(2e6 / 142_500 - 16.0, 2)
    assert budget["other_processes_cores"] == 0.1
    assert budget["reachable_on_what_others_left"] is False
    assert budget["floor_max_ratio_on_what_others_left"] == round(1.9e6 / 16.0 / 150_000, 3)
    assert budget["relay_over_bare_producer_us_per_row"] == 4.0
    # the relay's own run: its process after start-up (10), the rest over the run
    assert budget["relay_run_us_per_row"] == {
        "server": 6.0,
        "broker": 4.0,
        "relay": 10.0,
        "bench": 1.0,
    }
    assert budget["relay_run_us_per_row_sum"] == 21.0
    assert budget["relay_run_cores_needed"] == round(142_500 * 21.0 / 1e6, 2)
    scenario = {
        "kind": "catchup",
        "rows": 200_000,
        "rows_per_txn": 10,
        "transactions": 20_000,
        "pg_recvlogical": {"rows_per_s": 150_000},
        "floor": {"budget": budget},
    }
    (*_, reach, relay, others) = budget_lines({"catchup_10_per_txn": scenario})
    assert "2.28 cores needed of this machine's 2: NOT reachable, even by the floor" in reach
    assert "125,000 rows/s (0.83x) with every core its own" in reach
    assert "may spend -1.96 µs/row beyond the bare producer, it spends 4.00 more" in reach
    assert "server 6.00 + broker 4.00 + relay 10.00 + bench 1.00 = 21.00" in relay
    assert "2.99 cores at the target" in relay
    assert "other processes used 0.10 cores" in others
    assert "not reachable (the floor at most 0.79x)" in others


def test_the_budget_says_so_when_the_target_is_within_reach() -> None:
    budget = item2_budget(*_budget_inputs(2.0, 1.0, 2.0), cores=2, other_percent=100.0)
    assert budget["cores_needed"] == round(142_500 * 6.0 / 1e6, 2)
    assert budget["reachable"] is True
    assert budget["reachable_on_what_others_left"] is True  # 0.86 cores of the 1 left
    assert budget["left_for_the_relay_us_per_row"] == round(2e6 / 142_500 - 6.0, 2)
    budget = item2_budget(*_budget_inputs(2.0, 1.0, 2.0), cores=2, other_percent=120.0)
    assert budget["reachable"] is True
    assert budget["reachable_on_what_others_left"] is False


def test_a_walsender_runnable_without_a_cpu_is_a_share_of_the_run() -> None:
    during = {"window_s": 2.0, "cpu_s": {"walsender": 0.6}, "walsender_runnable_s": 0.9}
    assert cpu_during_run(100_000, during)["walsender_runnable_percent"] == 45.0


def test_schedstat_is_seconds_on_a_cpu_then_runnable_without_one() -> None:
    assert parse_schedstat("1177000000 527000000 1992\n") == (1.177, 0.527)


def test_the_main_threads_wall_time_after_start_up_splits_into_running_runnable_waiting() -> None:
    measured = {
        "seconds": 2.5,
        "cpu_seconds": 2.0,
        "startup_seconds": 0.5,
        "startup_cpu_seconds": 0.4,
        "peak_rss_mb": 70.0,
        "published": 200_000,
        "exit_code": 0,
        "main_thread_cpu_seconds": 1.6,
        "startup_main_thread_cpu_seconds": 0.3,
        # after start-up: 1.3 s on a CPU, 0.5 s runnable, of the 2.0 s
        "main_thread_sched_after_startup": [1.3, 0.5],
    }
    assert _summary(200_000, measured)["main_thread_after_startup_percent"] == {
        "running": 65.0,
        "runnable": 25.0,
        "waiting": 10.0,
    }
    measured["main_thread_sched_after_startup"] = None  # never saw it stream: no split
    assert "main_thread_after_startup_percent" not in _summary(200_000, measured)


def test_the_cpu_table_has_a_row_per_program_and_the_loop_alone() -> None:
    during = {
        "window_s": 1.25,
        "percent_of_a_core": {"server": 80.0, "walsender": 70.0, "program": 20.0, "machine": 110.0},
        "us_per_row": {"server": 5.0, "walsender": 4.4, "program": 1.25, "machine": 6.9},
    }
    relay_during = {
        "window_s": 2.0,
        "percent_of_a_core": dict.fromkeys(("server", "walsender", "broker", "program"), 50.0),
        "us_per_row": {"server": 5.5, "walsender": 4.5, "broker": 4.0, "program": 9.0},
    }
    relay = {
        "seconds": 2.0,
        "cpu_during_run": relay_during,
        "main_thread_cpu_us_per_event_after_startup": 6.25,
        "main_thread_rows_per_s_alone": 160_000,
    }
    split = {"running": 63.4, "runnable": 28.2, "waiting": 8.4}
    scenario = {
        "kind": "catchup",
        "rows": 200_000,
        "rows_per_txn": 10,
        "transactions": 20_000,
        "rounds": 2,
        "pg_recvlogical": {"cpu_during_run": during},
        "relay": {**relay, "main_thread_after_startup_percent": split},
        "baselines": {compiled.LABEL: relay},
    }
    (text,) = cpu_runs_table({"catchup_10_per_txn": scenario}, 2)
    lines = text.splitlines()
    assert "% of one core (of 200), medians of 2 rounds" in lines[0]
    recv = next(line for line in lines if line.startswith("pg_recvlogical"))
    assert recv.split()[3:12] == ["1.25", "80", "70", "-", "20", "-", "-", "110", "5.00"]
    compiled_row = next(line for line in lines if line.startswith(compiled.LABEL))
    assert compiled_row.endswith("6.25 → 160,000")  # no split measured: the column left empty
    relay_row = next(line for line in lines if line.startswith("cdc-relay "))
    assert relay_row.split("160,000")[1].split() == ["63", "/", "28", "/", "8"]


def test_the_build_pins_and_inputs_are_the_dockerfiles() -> None:
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    pins = compiled.build_pins(dockerfile).splitlines()
    assert [pin.split("==")[0] for pin in pins] == ["mypy", "setuptools"]
    assert sorted(compiled.build_inputs(dockerfile)) == sorted(compiled.INPUTS)
    with pytest.raises(ValueError, match="build-pins"):
        compiled.build_pins("FROM python:3.11\nRUN pip wheel .\n")


def test_a_build_is_keyed_by_its_commit_and_by_how_its_inputs_differ_from_it() -> None:
    assert compiled.cache_key("0f4fdf0abcde", b"") == "0f4fdf0abcde"
    dirty = compiled.cache_key("0f4fdf0abcde", b"diff --git a/x b/x")
    assert dirty.startswith("0f4fdf0abcde+")
    assert len(dirty) == len("0f4fdf0abcde+") + 12
    assert dirty != compiled.cache_key("0f4fdf0abcde", b"diff --git a/y b/y")


def test_the_dockers_build_is_a_row_named_as_such_and_a_checkout_by_its_hot_path(
    tmp_path: Path,
) -> None:
    (tmp_path / compiled.MARKER).write_text("{}")
    assert baseline_label(tmp_path) == compiled.LABEL
    # A checkout with only the C tuple reader built (every install builds it) is not "compiled".
    checkout = tmp_path / "checkout"
    (checkout / "cdc_relay" / "decode").mkdir(parents=True)
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    (checkout / "cdc_relay" / "decode" / f"_tuple_reader{suffix}").touch()
    subprocess.run(["git", "init", "-q", str(checkout)], check=True)
    assert not baseline_label(checkout).endswith("compiled")
    (checkout / "cdc_relay" / f"session{suffix}").touch()
    assert baseline_label(checkout).endswith(" compiled")
