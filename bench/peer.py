"""mq-bridge, the Rust peer of issue 17: its interpreter, its cached venv, its route, its process.

mq-bridge (PyPI ``mq-bridge``: Python bindings over a Rust core with librdkafka) has a Postgres
CDC source (pgoutput) and a Kafka sink, so it does the relay's job with a compiled hot path. The
catch-up scenario runs it on its own copy of the template slot, on the same WAL, in the same run
as ``pg_recvlogical`` and the relay (``bench.catchup``). It never runs in the bench's own
interpreter: a venv with only ``mq-bridge`` pinned is made once under ``bench/.peer-venv``
(gitignored) and reused, and ``bench/peer_route.py`` runs the route there.

    python -m bench.peer        # prepare the venv now (the smoke test does, before its timer)

The interpreter: ``$CDC_RELAY_BENCH_PEER_PYTHON`` when set (and nothing else: a wrong one skips
the peer rows, it is not silently replaced), else the first of ``python3.13``/``python3.14`` on
PATH, pyenv's newest ``3.13+`` and the bench's own interpreter that runs. The wheel is abi3
(cp38) and declares Python >= 3.9: mq-bridge 1.2.0 installs and runs on 3.11 too (measured).
When no interpreter works or the package cannot be installed, the peer rows are skipped and the
reason is in the table and the JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import REPO, cpu_seconds_with_children
from cdc_relay.local.relay_process import peak_rss_mb

PACKAGE, VERSION = "mq-bridge", "1.2.0"
NAME = f"{PACKAGE} {VERSION}"
VENV = REPO / "bench" / ".peer-venv"
RUNNER = REPO / "bench" / "peer_route.py"
PYTHON_ENV = "CDC_RELAY_BENCH_PEER_PYTHON"
MIN_PYTHON = (3, 9)  # the wheel's Requires-Python
INSTALL_TIMEOUT = 600.0
STOP_TIMEOUT = 15.0

# The route's settings on top of the configuration below, per measured variant. `batch_size` is
# what mq-bridge's documentation names for throughput ("Increasing this improves throughput");
# `concurrency` > 1 would let batches reach Kafka out of source order and `delayed_ack` would
# stop waiting for Kafka's acknowledgement: both give up guarantees the relay keeps, so neither
# is part of "tuned".
VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "batch_size 4096": {"batch_size": 4096},
}


def route_config(
    url: str, *, slot: str, publication: str, bootstrap: str, topic: str, variant: str
) -> dict[str, Any]:
    """The route the bench writes for mq-bridge (see bench/README.md, "The Rust peer")."""
    return {
        "input": {
            "postgres_cdc": {
                "url": url.replace("postgresql://", "postgres://", 1),
                "publication": publication,  # exists: the bench made it for the relay
                "slot_name": slot,  # a copy of the template slot, made just before the run
                "create_slot": False,
                "consume": "capture_new",  # from the slot's position on: the backlog
            }
        },
        "output": {
            "kafka": {
                "url": bootstrap,
                "topic": topic,
                "create_topic": False,  # the bench creates it, as many partitions as the relay's
            }
        },
        **VARIANTS[variant],
    }


# --------------------------------------------------------------------------------------------
# the interpreter and the venv


@dataclass(frozen=True)
class PeerRuntime:
    """A ready venv: its interpreter, and the interpreter it was made from."""

    python: Path
    base_python: str
    base_version: str


def _version(python: str) -> tuple[int, ...] | None:
    try:
        out = subprocess.run(
            [python, "-c", "import sys; print(*sys.version_info[:3])"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    try:
        return tuple(int(part) for part in out.split())
    except ValueError:
        return None


def _candidates() -> list[str]:
    found = [p for name in ("python3.13", "python3.14") if (p := shutil.which(name))]
    pyenv = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"
    newest_first = sorted(
        pyenv.glob("3.1[3-9]*"),
        key=lambda path: [int(part) for part in path.name.split(".") if part.isdigit()],
        reverse=True,
    )
    found += [str(path / "bin" / "python") for path in newest_first]
    return [*found, sys.executable]


def find_interpreter() -> tuple[str, tuple[int, ...]] | str:
    """(interpreter, version) to build the peer's venv from, or why there is none."""
    chosen = os.environ.get(PYTHON_ENV)
    for python in [chosen] if chosen else _candidates():
        version = _version(python)
        if version is not None and version[:2] >= MIN_PYTHON:
            return python, version
        if chosen:
            why = "does not run" if version is None else f"is Python {'.'.join(map(str, version))}"
            return f"${PYTHON_ENV}={chosen} {why} (mq-bridge needs Python >= 3.9)"
    return "no Python >= 3.9 interpreter found for mq-bridge"


def _marker(base_python: str, version: tuple[int, ...]) -> dict[str, str]:
    return {
        "base_python": base_python,
        "base_version": ".".join(map(str, version)),
        "package": f"{PACKAGE}=={VERSION}",
    }


def prepare(venv: Path = VENV) -> PeerRuntime | str:
    """The peer's venv, made (or reused when made from the same interpreter), or why not."""
    found = find_interpreter()
    if isinstance(found, str):
        return found
    base_python, version = found
    marker = _marker(base_python, version)
    python, marker_file = venv / "bin" / "python", venv / "bench-peer.json"
    try:
        if json.loads(marker_file.read_text()) == marker and python.exists():
            return PeerRuntime(python, base_python, marker["base_version"])
    except (OSError, ValueError):
        pass
    shutil.rmtree(venv, ignore_errors=True)
    steps = (
        [base_python, "-m", "venv", str(venv)],
        [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
         marker["package"]],
    )  # fmt: skip
    for step in steps:
        try:
            done = subprocess.run(
                step, capture_output=True, text=True, timeout=INSTALL_TIMEOUT, check=False
            )
        except (OSError, subprocess.SubprocessError) as exc:
            return f"{' '.join(step[1:3])} failed: {exc}"
        if done.returncode != 0:
            lines = [ln for ln in (done.stderr + done.stdout).splitlines() if ln.strip()]
            errors = [ln for ln in lines if "ERROR" in ln] or lines[-1:]
            return f"`{' '.join(step[1:])}` failed: {' '.join(errors)[:300]}"
    marker_file.write_text(json.dumps(marker) + "\n")
    return PeerRuntime(python, base_python, marker["base_version"])


# --------------------------------------------------------------------------------------------
# the running peer


class PeerChild:
    """``bench/peer_route.py`` on one route, in the peer's venv: its /proc probes and its stop."""

    def __init__(self, runtime: PeerRuntime, config: dict[str, Any]) -> None:
        self.runtime = runtime
        self._dir = Path(tempfile.mkdtemp(prefix="bench-peer-"))
        self.config_path = self._dir / "route.json"
        self.config_path.write_text(json.dumps(config, indent=2) + "\n")
        self.ready_path = self._dir / "ready"
        self.log_path = self._dir / "peer.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0

    def start(self) -> PeerChild:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
        with self.log_path.open("wb") as log:
            self.started = time.perf_counter()
            self.proc = subprocess.Popen(
                [str(self.runtime.python), str(RUNNER), str(self.config_path),
                 str(self.ready_path)],
                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                cwd=self._dir,
            )  # fmt: skip
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def ready(self) -> bool:
        return self.ready_path.exists()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def check_alive(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"{NAME} exited with code {self.proc.returncode}:\n{self.log()}")

    def cpu_seconds(self) -> float:
        return cpu_seconds_with_children(self.pid)

    def peak_rss_mb(self) -> float:
        return peak_rss_mb(self.pid)

    def stop(self) -> int:
        """SIGTERM (the route stops and joins), SIGKILL if it does not exit in time."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __enter__(self) -> PeerChild:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            shutil.rmtree(self._dir, ignore_errors=True)


def main() -> None:
    prepared = prepare()
    if isinstance(prepared, str):
        print(f"{NAME}: skipped: {prepared}")
        return
    print(f"{NAME}: {prepared.python} (from {prepared.base_python}, {prepared.base_version})")


if __name__ == "__main__":
    main()
