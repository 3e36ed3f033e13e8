"""Hot-path benchmark: a recorded replication stream replayed through the relay's session loop.

The catch-up scenario measures the relay together with PostgreSQL and the broker on the same
cores, and on a shared virtual machine its timings move by ±25 % from one minute to the next. To
judge a change to the hot path (decoding, mapping, producing, acknowledging) this takes the
database's side out: the stream of a backlog is recorded once, then fed from memory to the very
session loop the relay runs (``cdc_relay.session.Session``), with a real producer and a real
broker, and a real database connection for the position record. Reported per event: the CPU
of the main thread (the relay's bottleneck in a catch-up) and of the whole process, the minimum
and median over several replays. ``--callgrind`` also counts instructions per event under
valgrind's callgrind, which does not depend on the machine's speed at all: the way to compare
two versions on a noisy machine (same recording, same count of events, run both).

    python -m bench.replay [--rows 20000] [--per-txn 10] [--repeat 7] [--callgrind]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg

from bench.catchup import write_backlog
from bench.harness import (
    PUBLICATION,
    SLOT,
    TOPIC,
    TOPIC_PARTITIONS,
    create_outbox,
)
from cdc_relay import collector
from cdc_relay.checkpoint import PostgresCheckpointStore
from cdc_relay.config import Settings
from cdc_relay.decode import plugin_options_for
from cdc_relay.errors import RelayError, StopSession
from cdc_relay.local import LocalBroker, LocalPostgres
from cdc_relay.observability.stats import RelayStats
from cdc_relay.observability.tracing import Tracing
from cdc_relay.publisher import Publisher
from cdc_relay.replication.protocol import XLOG_DATA, XLOG_DATA_PAYLOAD_OFFSET
from cdc_relay.replication.stream import ReplicationStream
from cdc_relay.session import Session
from cdc_relay.topics import TopicRules
from cdc_relay.transactional_id import transactional_id

DRAIN_BYTES = 16 * 1024  # libpq reads about this much at a time: the loop sees it run out
_LENGTH = struct.Struct(">I")
_COMMIT, _INSERT = ord("C"), ord("I")


def settings_for(
    url: str, bootstrap: str, plugin: str = "pgoutput", extra: dict[str, Any] | None = None
) -> Settings:
    return Settings.model_validate(
        {
            "database_url": url,
            "kafka_bootstrap_servers": bootstrap,
            "slot_name": SLOT,
            "publication_name": PUBLICATION,
            "plugin": plugin,
            "sweep_interval": 0,
            "http_port": 0,
            **(extra or {}),
        }
    )


def record(url: str, settings: Settings, rows: int) -> list[bytes]:
    """Every CopyData message the slot sends until the Commit after its ``rows``-th insert."""
    stream = ReplicationStream(url, SLOT, 0, plugin_options_for(settings))
    stream.open()
    frames: list[bytes] = []
    inserts = 0
    payload = XLOG_DATA_PAYLOAD_OFFSET  # the pgoutput message type byte
    try:
        while True:
            data = stream.read()
            if data is None:
                if not stream.wait(10.0):
                    raise RuntimeError(f"the slot went quiet after {inserts} of {rows} inserts")
                continue
            frame = bytes(data)
            frames.append(frame)
            if frame[0] == XLOG_DATA:
                if frame[payload] == _INSERT:
                    inserts += 1
                elif frame[payload] == _COMMIT and inserts >= rows:
                    return frames
    finally:
        stream.close()


def save_frames(frames: list[bytes], path: Path) -> None:
    with path.open("wb") as out:
        for frame in frames:
            out.write(_LENGTH.pack(len(frame)))
            out.write(frame)


def load_frames(path: Path) -> list[bytes]:
    data = path.read_bytes()
    frames, pos = [], 0
    while pos < len(data):
        (size,) = _LENGTH.unpack_from(data, pos)
        frames.append(data[pos + 4 : pos + 4 + size])
        pos += 4 + size
    return frames


class ReplayOwner:
    """The relay as the replayed session sees it: one process, so always the leader."""

    def __init__(self) -> None:
        self.stopping = False
        self.failure: RelayError | None = None

    @property
    def failed(self) -> bool:
        return self.failure is not None

    def require_leading(self) -> None:
        return None

    def fail(self, error: RelayError) -> None:
        self.failure = error
        self.stopping = True


class FrameFeed:
    """Stands in for ReplicationStream: the recorded messages, running out every ~16 KB."""

    def __init__(self, frames: list[bytes], owner: ReplayOwner) -> None:
        self._frames = frames
        self._owner = owner
        self._next = 0
        self._since_drain = 0
        self.status_updates = 0

    def read(self) -> memoryview | None:
        if self._next >= len(self._frames):
            self._owner.stopping = True  # all replayed: the session unwinds
            return None
        if self._since_drain >= DRAIN_BYTES:
            self._since_drain = 0
            return None
        frame = self._frames[self._next]
        self._next += 1
        self._since_drain += len(frame)
        return memoryview(frame)

    def wait(self, timeout: float) -> bool:
        return self._next < len(self._frames)

    def send_status(self, written: int, flushed: int, reply: bool = False) -> None:
        self.status_updates += 1


def events_in(frames: list[bytes]) -> int:
    payload = XLOG_DATA_PAYLOAD_OFFSET
    return sum(1 for f in frames if f[0] == XLOG_DATA and f[payload] == _INSERT)


def replay_once(
    frames: list[bytes], settings: Settings, toggle: list[str] | None = None
) -> dict[str, float]:
    """One replay through a fresh session; CPU of the main thread and the process, per event."""
    owner, stats = ReplayOwner(), RelayStats()
    publisher = Publisher(settings.producer_config(), stats, _transactional_id(settings))
    if publisher.transactional:  # CDC_RELAY_EXACTLY_ONCE: the fence, as a leader's start does
        publisher.init_transactions(lambda: None)
    url = settings.database_url.get_secret_value()
    with psycopg.connect(url, autocommit=True) as conn:
        store = PostgresCheckpointStore(conn, settings.state_schema, settings.slot_name)
        store.ensure_table()
        feed = FrameFeed(frames, owner)
        session = Session(
            owner,
            settings,
            stats,
            Tracing(),
            TopicRules(settings),
            source=feed,  # the recording stands in for the server
            sink=publisher,
            store=store,
            start=0,
            heartbeat=lambda: None,
            retained_wal=lambda: None,
        )
        session.ensure_topic(TOPIC)  # metadata round trip outside the measurement
        if toggle:
            subprocess.run([*toggle, "on", str(os.getpid())], check=True, capture_output=True)
        wall, main, process = time.perf_counter(), time.thread_time(), _process_cpu()
        with contextlib.suppress(StopSession):  # raised once the recording is all read
            session.stream()
        session.drain()
        if session.window is not None:
            session.window.end()  # the last Kafka transaction commits, as on a clean stop
        main = time.thread_time() - main
        process = _process_cpu() - process
        wall = time.perf_counter() - wall
        if toggle:
            subprocess.run([*toggle, "off", str(os.getpid())], check=True, capture_output=True)
    published = stats.published
    publisher.close()
    if published != events_in(frames):
        raise RuntimeError(f"replayed {events_in(frames)} events but {published} were acknowledged")
    return {
        "events": published,
        "wall_s": wall,
        "main_us_per_event": main / published * 1e6,
        "process_us_per_event": process / published * 1e6,
    }


def _transactional_id(settings: Settings) -> str | None:
    """With CDC_RELAY_EXACTLY_ONCE, the replay's producer is transactional, as the relay's."""
    return transactional_id("bench", settings.slot_name) if settings.exactly_once else None


def _process_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def callgrind_instructions(
    frames_path: Path, url: str, bootstrap: str, extra: dict[str, Any], keep: Path | None = None
) -> tuple[float, float]:
    """Instructions per event of one replay under callgrind, the loop only: all threads, and the
    main thread alone. The main thread's count is the judge of a change to the relay's own code:
    librdkafka's threads vary by several per cent from run to run (batching, timing)."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise RuntimeError("--callgrind needs valgrind (apt-get install valgrind)")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        subprocess.run(
            [
                valgrind,
                "--tool=callgrind",
                "--instr-atstart=no",
                "--separate-threads=yes",  # one file per thread: out-01 is the main thread
                f"--callgrind-out-file={out}",
                # sys.executable as it is: inside a virtual environment, resolving its symlink
                # would start the base interpreter, which lacks the environment's packages
                sys.executable,
                "-m",
                "bench.replay",
                "--child",
                str(frames_path),
                url,
                bootstrap,
                "--child-settings",
                json.dumps(extra),
            ],
            check=True,
            capture_output=True,
            cwd=Path(__file__).resolve().parents[1],
        )
        by_thread = {path.name: _totals(path) for path in Path(tmp).glob(f"{out.name}-*")}
        main = by_thread[f"{out.name}-01"]
        events = events_in(load_frames(frames_path))
        if keep is not None:  # for callgrind_annotate: out-01 is the main thread
            keep.mkdir(parents=True, exist_ok=True)
            for path in Path(tmp).glob(f"{out.name}-*"):
                shutil.copy(path, keep / path.name)
    return sum(by_thread.values()) / events, main / events


def _totals(path: Path) -> int:
    """The instruction count a callgrind output file reports (its last ``totals:`` line)."""
    totals = [line for line in path.read_text().splitlines() if line.startswith("totals:")]
    return int(totals[-1].split()[1]) if totals else 0


def child(frames_path: Path, url: str, bootstrap: str, extra: dict[str, Any]) -> None:
    """The measured process under callgrind: one replay, instrumentation on around the loop."""
    frames = load_frames(frames_path)
    collector.tune()
    settings = settings_for(url, bootstrap, extra=extra)
    replay_once(frames, settings, toggle=["callgrind_control", "-i"])


def run(
    rows: int,
    per_txn: int,
    repeat: int,
    callgrind: bool,
    extra: dict[str, Any] | None = None,
    *,
    keep: Path | None = None,
) -> dict[str, Any]:
    with LocalPostgres() as server, LocalBroker() as broker, tempfile.TemporaryDirectory() as tmp:
        url = server.create_database("bench_replay")
        broker.create_topic(TOPIC, partitions=TOPIC_PARTITIONS)
        create_outbox(url, "pgoutput")
        write_backlog(url, rows, per_txn)
        settings = settings_for(url, broker.bootstrap_servers, extra=extra)
        frames = record(url, settings, rows)
        collector.tune()  # as `python -m cdc_relay` does
        runs = [replay_once(frames, settings) for _ in range(repeat)]
        result: dict[str, Any] = {
            "rows": rows,
            "rows_per_txn": per_txn,
            "messages": len(frames),
            "events": runs[0]["events"],
            "repeat": repeat,
        }
        for key in ("main_us_per_event", "process_us_per_event"):
            values = [r[key] for r in runs]
            result[f"{key}_min"] = round(min(values), 2)
            result[f"{key}_median"] = round(statistics.median(values), 2)
        result["events_per_s_best"] = round(max(r["events"] / r["wall_s"] for r in runs))
        if callgrind:
            path = Path(tmp) / "frames.bin"
            save_frames(frames, path)
            every_thread, main_thread = callgrind_instructions(
                path, url, broker.bootstrap_servers, extra or {}, keep
            )
            result["callgrind_instructions_per_event"] = round(every_thread)
            result["callgrind_main_instructions_per_event"] = round(main_thread)
    return result


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--per-txn", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--callgrind", action="store_true", help="also count instructions/event")
    parser.add_argument(
        "--callgrind-keep",
        type=Path,
        metavar="DIR",
        help="with --callgrind: keep the callgrind output files there (one per thread)",
    )
    parser.add_argument(
        "--relay-setting",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a relay setting (VALUE as JSON when it parses), e.g. outbox_columns='{...}'",
    )
    parser.add_argument(
        "--child", nargs=3, metavar=("FRAMES", "URL", "BOOTSTRAP"), help=argparse.SUPPRESS
    )
    parser.add_argument("--child-settings", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    extra: dict[str, Any] = {}
    for item in args.relay_setting:
        name, equals, value = item.partition("=")
        if not equals:
            parser.error(f"--relay-setting takes NAME=VALUE, got {item!r}")
        try:
            extra[name] = json.loads(value)
        except ValueError:
            extra[name] = value
    args.relay_setting = extra
    return args


def _lines(result: dict[str, Any]) -> Iterator[str]:
    width = max(len(k) for k in result)
    for key, value in result.items():
        yield f"{key:<{width}}  {value}"


def main() -> None:
    args = _parse()
    if args.child:
        frames_path, url, bootstrap = args.child
        child(Path(frames_path), url, bootstrap, json.loads(args.child_settings))
        return
    result = run(
        args.rows, args.per_txn, args.repeat, args.callgrind, args.relay_setting,
        keep=args.callgrind_keep,
    )  # fmt: skip
    for line in _lines(result):
        print(line)


if __name__ == "__main__":
    main()
