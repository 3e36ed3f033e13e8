"""The bench's Rust peer (mq-bridge): when it is skipped and why, what it is configured to do,
and how its rows are reported next to ``pg_recvlogical`` and the relay."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from bench import peer
from bench.catchup import _median, _ratios, baseline_label
from bench.report import programs_table
from bench.run import _parse_args


def _script(path: Path, body: str) -> Path:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


def test_an_explicit_interpreter_that_does_not_run_skips_the_peer_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "no-such-python"
    monkeypatch.setenv(peer.PYTHON_ENV, str(missing))
    venv = tmp_path / "venv"
    reason = peer.prepare(venv)
    assert isinstance(reason, str)
    assert peer.PYTHON_ENV in reason
    assert str(missing) in reason
    assert "does not run" in reason
    assert not venv.exists()  # nothing was installed for it


def test_an_explicit_interpreter_too_old_is_not_replaced_by_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = _script(tmp_path / "python3.8", "echo 3 8 10")
    monkeypatch.setenv(peer.PYTHON_ENV, str(old))
    reason = peer.find_interpreter()
    assert isinstance(reason, str)
    assert "is Python 3.8.10" in reason
    assert ">= 3.9" in reason


def test_without_a_choice_the_first_working_candidate_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = _script(tmp_path / "python3.13", "exit 1")  # e.g. a pyenv shim with no such version
    good = _script(tmp_path / "python3.14", "echo 3 14 0")
    monkeypatch.delenv(peer.PYTHON_ENV, raising=False)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path / "no-pyenv"))
    assert broken.exists()
    assert peer.find_interpreter() == (str(good), (3, 14, 0))


def test_the_route_reads_a_copied_slot_and_writes_the_bench_topic() -> None:
    config = peer.route_config(
        "postgresql://bench@127.0.0.1:5432/db",
        slot="bench_2_r0",
        publication="bench_pub",
        bootstrap="127.0.0.1:9092",
        topic="bench.peer",
        variant="defaults",
    )
    source = config["input"]["postgres_cdc"]
    assert source["url"] == "postgres://bench@127.0.0.1:5432/db"
    assert source["slot_name"] == "bench_2_r0"
    assert source["create_slot"] is False  # never a slot of its own: the copy, or nothing
    assert source["publication"] == "bench_pub"
    assert config["output"]["kafka"] == {
        "url": "127.0.0.1:9092",
        "topic": "bench.peer",
        "create_topic": False,
    }
    assert "batch_size" not in config  # its defaults: 512
    tuned = peer.route_config(
        "postgresql://x/db", slot="s", publication="p", bootstrap="b", topic="t",
        variant="batch_size 4096",
    )  # fmt: skip
    assert tuned["batch_size"] == 4096
    assert "concurrency" not in tuned  # > 1 would reorder batches: not the relay's guarantees


def _program(seconds: float, rows: int = 1000, **extra: Any) -> dict[str, Any]:
    return {
        "seconds": seconds,
        "rows_per_s": round(rows / seconds),
        "cpu_s": 0.01,
        "cpu_us_per_event": 10.0,
        **extra,
    }


def test_ratios_are_taken_within_a_round_then_the_median() -> None:
    base = [_program(1.0), _program(2.0), _program(1.0)]
    runs = [_program(2.0, startup_s=0.5), _program(2.0, startup_s=0.5), _program(4.0, startup_s=1)]
    ratios = _ratios(base, runs)
    assert ratios["ratio"] == 0.5  # 0.5, 1.0, 0.25: not median(base) / median(runs) = 1 / 2
    assert ratios["ratio_after_startup"] == pytest.approx(0.667, abs=1e-3)  # 0.67, 1.33, 0.33


def test_medians_keep_the_worst_exit_code_and_show_duplicates() -> None:
    runs = [
        _program(1.0, exit_code=0, published=1000, on_broker=1000, round=1),
        _program(3.0, exit_code=-9, published=1000, on_broker=1002, round=2),
        _program(2.0, exit_code=0, published=999, on_broker=1000, round=3),
    ]
    median = _median(runs)
    assert median["seconds"] == 2.0
    assert median["rows_per_s"] == 500
    assert median["exit_code"] == -9
    assert median["published"] == 999
    assert median["on_broker"] == 1002
    assert "round" not in median


def _scenario(peers: dict[str, Any]) -> dict[str, dict[str, Any]]:
    relay = _program(
        2.0, startup_s=0.4, rows_per_s_after_startup=625, on_broker=1000, published=1000
    )
    return {
        "catchup_10_per_txn": {
            "kind": "catchup",
            "rows": 1000,
            "rows_per_txn": 10,
            "transactions": 100,
            "rounds": 3,
            "pg_recvlogical": _program(1.0),
            "relay": relay,
            "ratio": 0.5,
            "ratio_after_startup": 0.625,
            "peers": peers,
        }
    }


def test_the_programs_table_has_a_row_per_peer_with_its_skip_reason() -> None:
    names = [f"{peer.NAME} {variant}" for variant in peer.VARIANTS]
    reason = "no Python >= 3.9 interpreter found for mq-bridge"
    (text,) = programs_table(_scenario({name: {"skipped": reason} for name in names}))
    assert "3 interleaved rounds, medians" in text
    for name in names:
        row = next(line for line in text.splitlines() if line.startswith(name))
        assert row.split()[-1] == "skipped"
        assert f"{name} skipped: {reason}" in text


def test_the_programs_table_reports_a_peer_that_ran_and_its_duplicates() -> None:
    name = f"{peer.NAME} defaults"
    ran = _program(
        1.25, startup_s=0.25, rows_per_s_after_startup=1000, ratio=0.8,
        ratio_after_startup=1.0, on_broker=1003, published=1000, first_on_broker_s=0.5,
    )  # fmt: skip
    (text,) = programs_table(_scenario({name: ran}))
    row = next(line for line in text.splitlines() if line.startswith(name))
    # rows/s, ratio, after start-up (ratio), CPU, (no floor), START_REPLICATION, start-up, 1st
    cells = ["800", "0.80", "1,000", "(1.00)", "10.0", "-", "0.25", "0.50"]
    assert row.split()[len(name.split()) :] == cells
    assert f"{name}: 3 duplicates" in text
    assert "pg_recvlogical (to /dev/null)" in text


def test_the_floor_is_rows_of_the_programs_table_and_each_program_is_divided_by_it() -> None:
    scenario = _scenario({})
    bare = _program(0.5, startup_s=0.1, rows_per_s_after_startup=2500, on_broker=1000,
                    published=1000, ratio=2.0, ratio_after_startup=2.5)  # fmt: skip
    bare["cpu_us_per_event"] = 2.5
    scenario["catchup_10_per_txn"]["pg_recvlogical"]["cpu_us_per_event"] = 5.0
    scenario["catchup_10_per_txn"]["relay"]["cpu_us_per_event"] = 15.0
    scenario["catchup_10_per_txn"]["relay"]["start_replication_s"] = 0.262
    scenario["catchup_10_per_txn"]["floor"] = {
        "bare_producer": bare, "cpu_us_per_event": 7.5, "import_floor_s": 0.213,
    }  # fmt: skip
    (text,) = programs_table(scenario)
    lines = text.splitlines()
    floor = next(line for line in lines if line.startswith("floor: pg_recvlogical + bare"))
    assert floor.split()[-4:] == ["7.5", "1", "0.213", "(imports)"]
    bare_row = next(line for line in lines if line.startswith("bare producer (bench.floor)"))
    assert bare_row.split()[3:9] == ["2,000", "2.00", "2,500", "(2.50)", "2.5", "0.33"]
    relay = next(line for line in lines if line.startswith("cdc-relay"))
    assert relay.split()[5:8] == ["15.0", "2.00", "0.262"]


def test_a_baseline_checkout_is_a_row_of_its_own_named_by_its_commit(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parents[2]
    label = baseline_label(repo)
    commit = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    assert label.removesuffix(" compiled").removesuffix("+") == f"cdc-relay {commit}"
    scenario = _scenario({})
    ran = _program(1.6, startup_s=0.5, rows_per_s_after_startup=909, on_broker=1000, published=1000)
    scenario["catchup_10_per_txn"]["baselines"] = {
        label: ran | {"ratio": 0.62, "ratio_after_startup": 0.9}
    }
    (text,) = programs_table(scenario)
    row = next(line for line in text.splitlines() if line.startswith(label))
    assert row.split()[len(label.split()) : len(label.split()) + 2] == ["625", "0.62"]
    with pytest.raises(SystemExit):
        _parse_args(["--baseline", str(tmp_path)])  # not a checkout of cdc-relay
    assert _parse_args(["--baseline", str(repo)]).baseline == [repo]
