"""``python -m cdc_relay demo``: runs end to end, stops on its own or on Ctrl-C, leaves nothing.

The demo runs as a child process with ``TMPDIR`` pointing at a directory of the test's own, so
everything it starts (the PostgreSQL cluster, the Tansu broker, their watchdogs) lives under that
directory: afterwards no process may refer to it and it must be empty.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cdc_relay.commands import demo
from tests.conftest import own_services_only

pytestmark = [
    pytest.mark.integration,
    own_services_only("the demo starts a PostgreSQL cluster and a broker of its own"),
]

EVENT_LINE = re.compile(
    r"^\s*(?P<n>\d+)\s+(?P<topic>\S+)\s+(?P<partition>\d+)\s+(?P<key>order-\S+)\s+"
    r"(?P<event>order_(?:created|paid|shipped))$"
)


@pytest.fixture
def scratch() -> Iterator[Path]:
    """The demo's TMPDIR; world-traversable, as root runs PostgreSQL as the postgres user."""
    path = Path(tempfile.mkdtemp(prefix="cdc-relay-demo-test-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def demo_env(scratch: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CDC_RELAY_")}
    env["TMPDIR"] = str(scratch)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def processes_referring_to(path: Path) -> list[str]:
    """Processes whose command line, working directory or executable is under ``path``."""
    needle = str(path)
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone meanwhile
        places = [cmdline]
        for link in ("cwd", "exe"):
            with contextlib.suppress(OSError):  # not ours to read, or gone meanwhile
                places.append(os.readlink(entry / link))
        if any(needle in place for place in places):
            found.append(f"{entry.name}: {cmdline.strip()[:200]}")
    return found


def assert_nothing_left(scratch: Path) -> None:
    deadline = time.monotonic() + 5
    while True:
        leftovers = processes_referring_to(scratch)
        if not leftovers or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert leftovers == [], f"processes of the demo still running: {leftovers}"
    assert sorted(p.name for p in scratch.iterdir()) == [], "the demo left files behind"


def event_lines(output: str) -> list[re.Match[str]]:
    return [m for line in output.splitlines() if (m := EVENT_LINE.match(line))]


def test_demo_delivers_n_events_and_cleans_up(scratch: Path) -> None:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "cdc_relay", "demo", "--events", "50"],
        env=demo_env(scratch),
        cwd=scratch,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    took = time.monotonic() - started
    output = f"--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"
    assert result.returncode == 0, output
    events = event_lines(result.stdout)
    assert [int(m["n"]) for m in events] == list(range(1, 51)), output
    assert {m["topic"] for m in events} == {"outbox.event.order"}
    assert len({m["key"] for m in events}) > 1, "several aggregates"
    assert {m["event"] for m in events} >= {"order_created", "order_paid"}
    # One aggregate's events share a key, hence a partition, and arrive in lifecycle order.
    by_key: dict[str, list[re.Match[str]]] = {}
    for m in events:
        by_key.setdefault(m["key"], []).append(m)
    lifecycle = ["order_created", "order_paid", "order_shipped"]
    for key, matches in by_key.items():
        assert len({m["partition"] for m in matches}) == 1, key
        assert [m["event"] for m in matches] == lifecycle[: len(matches)], key
    assert "50 events delivered" in result.stdout
    assert re.search(r"version \d+\.\d+, binaries in /", result.stdout), output
    assert_nothing_left(scratch)
    print(f"demo --events 50 took {took:.1f}s")


def test_demo_stops_cleanly_on_ctrl_c(scratch: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "cdc_relay", "demo", "--rate", "50"],
        env=demo_env(scratch),
        cwd=scratch,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        seen = []
        deadline = time.monotonic() + 120
        for line in proc.stdout:  # blocks per line; the demo prints one per event
            seen.append(line)
            if len(event_lines("".join(seen))) >= 5 or time.monotonic() > deadline:
                break
        assert len(event_lines("".join(seen))) >= 5, "".join(seen)
        proc.send_signal(signal.SIGINT)
        rest, errors = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = "".join(seen) + rest
    assert proc.returncode == 0, f"{output}\n--- stderr ---\n{errors}"
    assert "stopped and cleaned up" in output
    assert_nothing_left(scratch)


@pytest.mark.parametrize(
    ("missing", "hint"),
    [
        ("broker", "pip install 'cdc-relay[local]'"),
        ("postgres", "apt-get install postgresql"),
        ("postgres", "brew install postgresql"),
    ],
)
def test_demo_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], missing: str, hint: str
) -> None:
    if missing == "broker":
        monkeypatch.setattr(demo, "broker_installed", lambda: False)
    else:

        def find_bindir() -> Path:
            raise RuntimeError("PostgreSQL server binaries not found")

        monkeypatch.setattr(demo, "find_bindir", find_bindir)
    code = demo.main(argparse.Namespace(events=1, rate=None))
    assert code == 1
    assert hint in capsys.readouterr().err
