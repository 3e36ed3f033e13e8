"""The relay as a child process (``python -m cdc_relay``), for tests and benchmarks.

Driven the way an operator drives it: environment variables, signals, exit codes, a log file;
its CPU time and peak memory read from /proc.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import ClassVar, Self


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_mb(pid: int) -> float:
    """VmHWM of ``pid`` in MiB (0.0 when the kernel does not say)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


class RelayProcess:
    """One relay child with its own log file; ``env`` is its whole environment.

    Logs go to :attr:`log_dir` (the system temp dir unless set): the test suite points it into
    pytest's base temp dir, which pytest itself rotates, so kept logs do not pile up in /tmp.
    """

    log_dir: ClassVar[Path | None] = None

    def __init__(
        self, env: Mapping[str, str], args: Sequence[str] = (), keep_log: bool = True
    ) -> None:
        self.env = dict(env)
        self.args = list(args)
        self._keep_log = keep_log  # kept logs help a post-mortem of a failed test
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed by close()
            prefix="cdc-relay-", suffix=".log", dir=self.log_dir, delete=False
        )
        self.log_path = Path(self._log.name)
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0

    def start(self) -> Self:
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cdc_relay", *self.args],
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=tempfile.gettempdir(),  # no stray .env file is read
        )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout: float = 60.0) -> int:
        """The exit code; a relay still running after ``timeout`` dumps its stacks and is killed."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGUSR1)  # the relay prints its threads' stacks
            time.sleep(1)
            self.proc.kill()
            self.proc.wait()
            raise TimeoutError(f"relay did not exit within {timeout}s:\n{self.logs()}") from None

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait: the clean shutdown path."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.wait(timeout)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.pid)

    def peak_rss_mb(self) -> float:
        return peak_rss_mb(self.pid)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
        if not self._keep_log:
            self.log_path.unlink(missing_ok=True)
