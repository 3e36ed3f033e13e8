"""Lifetime of the throw-away services: cleanup on exit, even when the owner dies abruptly.

:class:`ThrowAway` makes a service a context manager and registers it for an ``atexit`` cleanup;
:class:`Watchdog` covers what ``atexit`` cannot (SIGKILL, SIGTERM, ``os._exit``).
"""

from __future__ import annotations

import atexit
import contextlib
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Self

# Runs in its own Python process: blocks until the pipe from the owning process reaches EOF,
# then kills the process group named by the pid file and deletes the directory.
_WATCHDOG_SCRIPT = """
import os, shutil, signal, sys
sys.stdin.buffer.read()
root, pid_file = sys.argv[1], sys.argv[2]
try:
    with open(pid_file) as fh:
        pid = int(fh.readline())
    if pid > 1 and os.getpgid(pid) == pid:
        os.killpg(pid, signal.SIGKILL)
except (OSError, ValueError):
    pass
shutil.rmtree(root, ignore_errors=True)
"""


class Watchdog:
    """Cleans up after a service when its owner dies without running ``atexit``.

    ``atexit`` handlers do not run on SIGTERM (CI job cancelled), SIGKILL or ``os._exit``
    (pytest-timeout's thread method). This starts a small Python process that waits for EOF on a
    pipe whose write end only the owner holds; the kernel closes it however the owner dies. The
    watchdog then SIGKILLs the process group whose leader's pid is on the first line of
    ``pid_file`` (the service must run in its own session) and deletes ``directory``.
    :meth:`close` ends it after a normal cleanup.
    """

    def __init__(self, directory: Path, pid_file: Path) -> None:
        self._process: subprocess.Popen[bytes] | None = subprocess.Popen(
            [sys.executable, "-c", _WATCHDOG_SCRIPT, str(directory), str(pid_file)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C meant for the test run must not kill it first
        )

    def close(self) -> None:
        """Let the watchdog run now (call it once the service is stopped) and wait for it."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.stdin is not None:
            with contextlib.suppress(OSError):
                process.stdin.close()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


LOG_TAIL_LINES = 40


def stat_fields(stat: Path) -> list[str] | None:
    """The fields of a ``/proc/<pid>[/task/<tid>]/stat`` file after the command name (state,
    ppid, pgrp, ...); None when it cannot be read. The name is parenthesised and may itself
    contain spaces, so the fields start after the last ``)``."""
    try:
        return stat.read_text().rpartition(")")[2].split()
    except OSError:
        return None


def wait_stopped(pid: int, timeout: float = 5.0) -> None:
    """Return once every thread of ``pid`` is stopped: SIGSTOP takes effect asynchronously, and
    a thread that was running when it was sent could still answer one more request."""
    tasks = Path(f"/proc/{pid}/task")
    if not tasks.is_dir():
        return  # no procfs: trust the signal
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = [fields[0] for task in tasks.iterdir() if (fields := stat_fields(task / "stat"))]
        if states and all(state in ("T", "t") for state in states):
            return
        time.sleep(0.005)
    raise RuntimeError(f"pid {pid} did not stop within {timeout}s of SIGSTOP")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class ThrowAway:
    """Base of LocalPostgres and LocalBroker: a port, a temporary directory, a log, ``with``
    support, cleanup at exit."""

    _DIRECTORY_PREFIX = "cdc-relay-"  # a subclass names its kind: "cdc-relay-pg-"

    def __init__(self, port: int | None, base_dir: Path | None) -> None:
        self._requested_port = port
        self._port: int | None = port
        self._base_dir = base_dir
        self._root: Path | None = None
        self._watchdog: Watchdog | None = None

    @property
    def port(self) -> int:
        """The TCP port on 127.0.0.1 (a free one is chosen on first use)."""
        if self._port is None:
            self._port = free_port()
        return self._port

    @property
    def directory(self) -> Path:
        """The temporary directory the service keeps everything in (created on first use)."""
        if self._root is None:
            base = self._base_dir
            if base is not None:
                base.mkdir(parents=True, exist_ok=True)
            self._root = Path(tempfile.mkdtemp(prefix=self._DIRECTORY_PREFIX, dir=base))
            self._track()
        return self._root

    @property
    def log_path(self) -> Path:
        raise NotImplementedError

    def start(self) -> None:
        raise NotImplementedError

    def cleanup(self) -> None:
        raise NotImplementedError

    def _log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The end of the service's log, to quote when it failed."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(no log at {self.log_path}: {exc})"
        return f"--- tail of {self.log_path} ---\n" + "\n".join(text.splitlines()[-lines:])

    def _release(self) -> None:
        """The end of :meth:`cleanup`: the directory deleted, the port and watchdog forgotten."""
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
        self._root = None
        self._port = self._requested_port
        if self._watchdog is not None:
            self._watchdog.close()
            self._watchdog = None
        self._untrack()

    def _track(self) -> None:
        with _live_lock:
            _live.add(self)

    def _untrack(self) -> None:
        with _live_lock:
            _live.discard(self)

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.cleanup()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()


_live: set[ThrowAway] = set()
_live_lock = threading.Lock()


@atexit.register
def _cleanup_all() -> None:
    with _live_lock:
        instances = list(_live)
    for instance in instances:
        with contextlib.suppress(Exception):
            instance.cleanup()
