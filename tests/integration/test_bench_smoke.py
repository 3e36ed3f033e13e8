"""``python -m bench --smoke`` runs end to end and reports every scenario with sane numbers.

Not a performance test: the smoke sizes are tiny and no target is evaluated. It proves that the
benchmark command still works (it starts its own PostgreSQL cluster and Tansu broker, hence the
integration marker) and finishes in well under a minute.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from bench import peer
from bench.catchup import copy_slot, time_recvlogical, write_backlog
from bench.harness import create_outbox, current_lsn, postmaster_pid
from cdc_relay.local import LocalPostgres
from tests.conftest import own_services_only

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = {
    "catchup_10_per_txn",
    "catchup_1000_per_txn",
    "catchup_single_txn",
    "steady_low",
    "steady_high",
    "steady_high_exactly_once",
}

pytestmark = [
    pytest.mark.integration,
    own_services_only("the benchmark starts a PostgreSQL cluster and a broker of its own"),
]


def _positive(result: dict[str, Any], *path: str) -> float:
    value: Any = result
    for key in path:
        value = value[key]
    assert isinstance(value, int | float), (path, value)
    assert value > 0, (path, value)
    return float(value)


def _prepare_peer() -> peer.PeerRuntime | str:
    """The peer's venv, made before the timer: its first install downloads the wheel."""
    completed = subprocess.run(
        [sys.executable, "-m", "bench.peer"], cwd=REPO, capture_output=True, text=True,
        timeout=900, check=True,
    )  # fmt: skip
    print(completed.stdout)
    return peer.prepare()  # cached now: the same answer the bench will get


def _assert_peers(result: dict[str, Any], stdout: str, expected: peer.PeerRuntime | str) -> None:
    scenario = result["scenarios"]["catchup_10_per_txn"]
    rows = scenario["rows"]
    names = [f"{peer.NAME} {variant}" for variant in peer.VARIANTS]
    assert set(scenario["peers"]) == set(names)
    lines = stdout.splitlines()
    for name in names:
        measured = scenario["peers"][name]
        row = next(line for line in lines if line.startswith(name))
        if isinstance(expected, str):
            assert measured == {"skipped": expected}
            assert result["peer"]["skipped"] == expected
            assert row.split()[-1] == "skipped"
            assert f"{name} skipped: {expected}" in stdout
            continue
        assert "failed" not in measured, measured.get("failed")
        assert measured["published"] >= rows
        assert measured["on_broker"] >= rows
        for metric in ("seconds", "rows_per_s", "ratio", "startup_s", "cpu_s"):
            _positive(measured, metric)
        assert measured["startup_s"] < measured["seconds"]
        assert 0 < measured["first_on_broker_s"] <= measured["seconds"]
        assert measured["exit_code"] == 0  # stopped cleanly by SIGTERM
        assert measured["settings"]["input"]["postgres_cdc"]["url"] == "(bench database)"
        assert row.split()[len(name.split())] == f"{measured['rows_per_s']:,}"
        assert result["peer"]["python"] == expected.base_version
    assert scenario["pg_recvlogical"]["cpu_us_per_event"] >= 0  # 10 ms ticks: 0 on tiny runs


def _assert_floor(result: dict[str, Any], stdout: str) -> None:
    """The floor's rows: the bare producer ran with every record acknowledged and counted on its
    broker, the floor's CPU is pg_recvlogical's plus the bare producer's, the import floor was
    timed, and each is a row of the programs table."""
    scenario = result["scenarios"]["catchup_10_per_txn"]
    rows, floor = scenario["rows"], scenario["floor"]
    bare = floor["bare_producer"]
    assert bare["published"] == rows
    assert bare["on_broker"] >= rows
    for metric in ("seconds", "rows_per_s", "ratio", "cpu_us_per_event", "startup_s"):
        _positive(bare, metric)
    assert bare["startup_s"] < bare["seconds"]
    recvlogical = scenario["pg_recvlogical"]["cpu_us_per_event"]
    assert floor["cpu_us_per_event"] == pytest.approx(recvlogical + bare["cpu_us_per_event"])
    assert 0 < _positive(floor, "import_floor_s") < scenario["relay"]["start_replication_s"] + 1
    target = next(
        t for t in result["targets"]
        if t["scenario"] == "catchup_10_per_txn" and t["metric"] == "start_replication_s"
    )  # fmt: skip
    assert target["limit"] == pytest.approx(floor["import_floor_s"] + 0.05)
    lines = stdout.splitlines()
    bare_row = next(line for line in lines if line.startswith("bare producer (bench.floor)"))
    assert f"{bare['rows_per_s']:,}" in bare_row.split()
    floor_row = next(line for line in lines if line.startswith("floor: pg_recvlogical + bare"))
    assert f"{floor['import_floor_s']:.3f}" in floor_row
    _assert_cpu_during_runs(scenario, stdout)


def _assert_cpu_during_runs(scenario: dict[str, Any], stdout: str) -> None:
    """Where the machine's CPU went during each program's run, the relay's main thread, and
    issue 25 item 2's budget from them, in the JSON and printed."""
    runs = {
        "pg_recvlogical": scenario["pg_recvlogical"],
        "bare producer (bench.floor)": scenario["floor"]["bare_producer"],
        "cdc-relay": scenario["relay"],
        **scenario["variants"],
    }
    for name, run in runs.items():
        during = run["cpu_during_run"]
        percent = during["percent_of_a_core"]
        assert 0 < during["window_s"] <= run["seconds"] + 1, name
        # 10 ms ticks: pg_recvlogical's tiny run may take none, the others' start-up some
        assert percent["program"] >= (0 if name == "pg_recvlogical" else 0.1), name
        assert percent["machine"] > 0, name
        assert percent["walsender"] <= percent["server"], name
        assert ("broker" in percent) == (name != "pg_recvlogical"), name
    for name in ("cdc-relay", *scenario["variants"]):
        relay = runs[name]
        assert 0 < relay["main_thread_cpu_us_per_event"] <= relay["cpu_us_per_event"], name
        alone = relay["main_thread_rows_per_s_alone"]  # None: no 10 ms tick after start-up
        assert alone is None or alone > 0, name
    budget = scenario["floor"]["budget"]
    assert budget["target_rows_per_s"] == round(0.95 * scenario["pg_recvlogical"]["rows_per_s"])
    assert budget["floor_us_per_row_sum"] == pytest.approx(
        sum(budget["floor_us_per_row"].values()), abs=0.02
    )
    assert "CPU during each program's run, % of one core" in stdout
    assert "Budget for ≥ 0.95x pg_recvlogical after start-up" in stdout


def test_bench_smoke(tmp_path: Path) -> None:
    json_path, png_path = tmp_path / "smoke.json", tmp_path / "smoke.png"
    expected_peer = _prepare_peer()
    started = time.monotonic()
    completed = subprocess.run(
        [sys.executable, "-m", "bench", "--smoke", "--json", str(json_path),
         "--plot", str(png_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )  # fmt: skip
    elapsed = time.monotonic() - started
    assert completed.returncode == 0, completed.stdout + completed.stderr
    print(f"\nbench --smoke took {elapsed:.1f}s\n{completed.stdout}")

    result = json.loads(json_path.read_text())
    assert result["mode"] == "smoke"
    assert set(result["scenarios"]) == SCENARIOS
    for key, scenario in result["scenarios"].items():
        for metric in ("cpu_us_per_event", "peak_rss_mb"):
            _positive(scenario, "relay", metric)
        if scenario["kind"] == "catchup":
            rows = _positive(scenario, "rows")
            assert scenario["relay"]["published"] >= rows, key
            for measured in ("relay", "pg_recvlogical"):
                _positive(scenario, measured, "seconds")
                _positive(scenario, measured, "rows_per_s")
            _positive(scenario, "ratio")
            _positive(scenario, "ratio_after_startup")
            assert 0 < _positive(scenario, "relay", "startup_s") < scenario["relay"]["seconds"]
            # START_REPLICATION goes out before /status first says streaming.
            sent = _positive(scenario, "relay", "start_replication_s")
            assert sent <= scenario["relay"]["startup_s"], key
            _positive(scenario, "relay", "rows_per_s_after_startup")
            assert len(scenario["throughput"]["t"]) >= 1, key
            for name, variant in scenario.get("variants", {}).items():
                assert variant["published"] >= rows, name
                assert variant["settings"], name
                _positive(variant, "vs_relay")
        else:
            assert scenario["kind"] == "steady", key
            _positive(scenario, "writer", "achieved_rate")
            assert scenario["consumer"]["missing"] == 0, key
            assert scenario["consumer"]["duplicates"] == 0, key
            # With exactly once, what a read_committed consumer sees is the measure.
            if key == "steady_high_exactly_once":
                assert scenario["consumer"]["reads"] == "during the window", key
                for quantile in ("p50", "p95", "p99", "max"):
                    _positive(scenario, "latency_ms", quantile)
            else:  # the consumer only counts, after the window: no latency from it
                assert scenario["consumer"]["reads"] == "after the window", key
                assert scenario["latency_ms"] is None, key
                assert "consumer_p99_ms" not in scenario["timeline"]["per_second"][0], key
            assert scenario["relay_histogram"]["count"] == scenario["writer"]["events"], key
            # One event per transaction: one commit→read observation per event.
            assert scenario["relay_receive_histogram"]["count"] == scenario["writer"]["events"]
            _positive(scenario, "relay_histogram", "p99_ms")
    _assert_peers(result, completed.stdout, expected_peer)
    _assert_floor(result, completed.stdout)
    assert result["machine"]["cores"] >= 1
    assert all(target["passed"] is None for target in result["targets"])  # not evaluated
    assert set(result["scenarios"]["catchup_10_per_txn"]["variants"]) == {"cdc-relay, exactly once"}
    for title in ("1a catch-up", "1b catch-up", "1c catch-up", "2 steady", "exactly once"):
        assert title in completed.stdout
    if importlib.util.find_spec("matplotlib") is not None:
        assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "matplotlib is not installed" in completed.stdout
    assert elapsed < 60, f"--smoke must finish in < 60 s, took {elapsed:.1f}s"


def test_bench_peer_skipped_with_its_reason(tmp_path: Path) -> None:
    """An interpreter that does not run: the peer rows stay, with the reason, and nothing fails."""
    json_path = tmp_path / "skip.json"
    missing = tmp_path / "no-such-python"
    completed = subprocess.run(
        [sys.executable, "-m", "bench", "--smoke", "--only", "catchup_10_per_txn",
         "--json", str(json_path), "--plot", str(tmp_path / "skip.png")],
        cwd=REPO, capture_output=True, text=True, timeout=180, check=False,
        env={**os.environ, peer.PYTHON_ENV: str(missing)},
    )  # fmt: skip
    assert completed.returncode == 0, completed.stdout + completed.stderr
    print(completed.stdout)
    result = json.loads(json_path.read_text())
    reason = result["peer"]["skipped"]
    assert str(missing) in reason
    assert "does not run" in reason
    _assert_peers(result, completed.stdout, reason)


def test_bench_catchup_rounds(tmp_path: Path) -> None:
    """``--rounds 2``: every program twice, interleaved in a rotated order, medians reported."""
    json_path = tmp_path / "rounds.json"
    completed = subprocess.run(
        [sys.executable, "-m", "bench", "--smoke", "--only", "catchup_1000_per_txn",
         "--rounds", "2", "--json", str(json_path), "--plot", str(tmp_path / "rounds.png")],
        cwd=REPO, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stdout + completed.stderr
    scenario = json.loads(json_path.read_text())["scenarios"]["catchup_1000_per_txn"]
    assert scenario["rounds"] == 2
    assert scenario["order"] == [["pg_recvlogical", "relay"], ["relay", "pg_recvlogical"]]
    per_round = scenario["per_round"]
    assert [run["round"] for run in per_round["relay"]] == [1, 2]
    assert [run["round"] for run in per_round["pg_recvlogical"]] == [1, 2]
    ratios = sorted(
        b["seconds"] / r["seconds"]
        for b, r in zip(per_round["pg_recvlogical"], per_round["relay"], strict=True)
    )
    assert scenario["ratio"] == pytest.approx(sum(ratios) / 2, rel=0.02)  # median of two
    for run in per_round["relay"]:
        assert run["on_broker"] >= scenario["rows"]  # counted on the broker, each round
    assert "2 interleaved rounds, medians" in completed.stdout
    assert "peers" not in scenario  # the peer runs in catchup_10_per_txn only


def _replay(*extra: str) -> dict[str, str]:
    command = [sys.executable, "-m", "bench.replay", "--rows", "2000", "--repeat", "2", *extra]
    completed = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=180, check=False
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    print(completed.stdout)
    return dict(line.split(None, 1) for line in completed.stdout.splitlines())


def test_replay_smoke() -> None:
    """``python -m bench.replay``: a recorded stream through the session loop, every event acked."""
    result = _replay()
    assert int(result["events"]) == 2000
    assert int(result["messages"]) >= 2000 + 2 * 200  # inserts, and a Begin and Commit per txn
    for key in ("main_us_per_event_min", "process_us_per_event_median", "events_per_s_best"):
        assert float(result[key]) > 0, key
    assert float(result["main_us_per_event_min"]) <= float(result["process_us_per_event_median"])


@pytest.mark.skipif(
    shutil.which("valgrind") is None,
    reason="valgrind is not installed (Debian/Ubuntu: apt-get install valgrind); CI installs it",
)
def test_replay_callgrind_smoke() -> None:
    """``--callgrind``: the replay child runs under valgrind in this interpreter's environment."""
    result = _replay("--callgrind")
    assert int(result["events"]) == 2000
    every_thread = int(result["callgrind_instructions_per_event"])
    main_thread = int(result["callgrind_main_instructions_per_event"])
    assert 1000 < main_thread < every_thread


def test_floor_smoke() -> None:
    """``python -m bench.floor``: the imports timed, the bare producer and the relay both acked."""
    command = [sys.executable, "-m", "bench.floor", "--events", "2000", "--repeat", "1"]
    completed = subprocess.run(
        [*command, "--launches", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stdout + completed.stderr
    print(completed.stdout)
    result = {k: float(v) for k, v in (line.split() for line in completed.stdout.splitlines())}
    assert 0 < result["launch_s_python"] < result["launch_s_psycopg_and_pydantic_settings"]
    for part in ("main", "process"):
        bare = result[f"{part}_us_per_event_bare_producer"]
        assert 0 < bare < result[f"{part}_us_per_event_relay"]


def test_pg_recvlogicals_walsender_is_counted_though_it_exits_with_its_client() -> None:
    """The server's CPU during pg_recvlogical's run holds its walsender's decoding, read while it
    lived and, once it exited, through the postmaster's reaped children: never lost between the
    walsender's own /proc entry (gone) and the postmaster's (read before it reaped it)."""
    rows = 50_000
    with LocalPostgres() as server:
        url = server.create_database("bench_walsender")
        create_outbox(url, "pgoutput")
        write_backlog(url, rows, 10)
        with psycopg.connect(url, autocommit=True) as conn:
            end = current_lsn(conn)
        postmaster = postmaster_pid(server)
        for number in range(5):  # the race it guards against hit 1 window in 6
            slot = copy_slot(url, f"copy_{number}")
            measured = time_recvlogical(url, slot, end, "pgoutput", postmaster=postmaster)
            cpu = measured["cpu_during_run"]["cpu_s"]
            print(cpu)
            # The walsender decodes every row: ~1-5 µs each, 10 ms ticks.
            assert cpu["walsender"] >= 0.02, cpu
            assert cpu["server"] >= cpu["walsender"], cpu
            assert cpu["program"] > 0 or measured["cpu_seconds"] < 0.02, (cpu, measured)
            assert cpu["machine"] >= cpu["server"] * 0.5, cpu
