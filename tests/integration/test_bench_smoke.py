"""``python -m bench --smoke`` runs end to end and reports every scenario with sane numbers.

Not a performance test: the smoke sizes are tiny and no target is evaluated. It proves that the
benchmark command still works (it starts its own PostgreSQL cluster and Tansu broker, hence the
integration marker) and finishes in well under a minute.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = {
    "catchup_10_per_txn",
    "catchup_1000_per_txn",
    "catchup_single_txn",
    "steady_low",
    "steady_high",
}

pytestmark = pytest.mark.integration


def _positive(result: dict[str, Any], *path: str) -> float:
    value: Any = result
    for key in path:
        value = value[key]
    assert isinstance(value, int | float), (path, value)
    assert value > 0, (path, value)
    return float(value)


def test_bench_smoke(tmp_path: Path) -> None:
    json_path, png_path = tmp_path / "smoke.json", tmp_path / "smoke.png"
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
        else:
            assert scenario["kind"] == "steady", key
            _positive(scenario, "writer", "achieved_rate")
            assert scenario["consumer"]["missing"] == 0, key
            for quantile in ("p50", "p95", "p99", "max"):
                _positive(scenario, "latency_ms", quantile)
            assert scenario["relay_histogram"]["count"] == scenario["writer"]["events"], key
            # One event per transaction: one commit→read observation per event.
            assert scenario["relay_receive_histogram"]["count"] == scenario["writer"]["events"]
            _positive(scenario, "relay_histogram", "p99_ms")
    assert result["machine"]["cores"] >= 1
    assert all(target["passed"] is None for target in result["targets"])  # not evaluated
    for title in ("1a catch-up", "1b catch-up", "1c catch-up", "2 steady"):
        assert title in completed.stdout
    if importlib.util.find_spec("matplotlib") is not None:
        assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "matplotlib is not installed" in completed.stdout
    assert elapsed < 60, f"--smoke must finish in < 60 s, took {elapsed:.1f}s"


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
