"""The floor as programs of the catch-up: a bare producer, and the import of the relay's libraries.

A relay of this design costs at least what the server's decoding costs its client
(``pg_recvlogical``, a program of the catch-up already) plus what the Kafka client costs to send
the same records with per-record delivery accounting. This module makes the second one a program
of the same catch-up, run in the same rounds on its own fresh broker: a child process with one
idempotent producer, configured as the relay configures it (``Settings.producer_config()``),
sending as many records as the backlog has rows, of the relay's shape (key, ~250-byte JSON value,
the relay's four headers), with one Python delivery callback each that counts the
acknowledgement, timed from its launch until it exits with every record acknowledged. Its child
imports nothing but confluent-kafka, so its start-up is the client library's.

And the start-up floor: launch → exit of a fresh interpreter that only imports psycopg and
pydantic-settings, which the relay needs before it can send ``START_REPLICATION``.

    python -m bench.floor_programs ROWS TOPIC < producer-config.json   # the child
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

IMPORT_FLOOR_CODE = "import psycopg, pydantic_settings"
POOL = 1000  # distinct records, sent in turn (librdkafka copies each at produce())
POLL_EVERY = 1000  # records between two polls (the relay polls per read batch)
REPO = Path(__file__).resolve().parents[1]
PAD = "x" * 200  # bench.harness.PAD: not imported, the child imports nothing of the bench


def import_floor_seconds(launches: int) -> float:
    """Launch → exit of ``python -c 'import psycopg, pydantic_settings'``, the fastest launch."""
    best = float("inf")
    for _ in range(launches):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", IMPORT_FLOOR_CODE], check=True)
        best = min(best, time.perf_counter() - started)
    return best


def time_bare_producer(
    config: dict[str, str], topic: str, rows: int, exited: Callable[[int], None] | None = None
) -> dict[str, Any]:
    """Run the child: seconds from launch to exit, its CPU (wait4), start-up, acknowledgements.

    ``exited``: called with the child's pid once it exited, before it is reaped (its /proc entry
    still holds its CPU)."""
    command = [sys.executable, "-m", "bench.floor_programs", str(rows), topic]
    started = time.perf_counter()
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO)
    assert proc.stdin is not None
    assert proc.stdout is not None
    proc.stdin.write(json.dumps(config).encode())
    proc.stdin.close()
    out = proc.stdout.read()
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    elapsed = time.perf_counter() - started
    if exited is not None:
        exited(proc.pid)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, command)
    report = json.loads(out)
    if report["acked"] != rows:
        raise RuntimeError(f"the bare producer sent {rows} records, {report['acked']} acknowledged")
    return {
        "seconds": elapsed,
        "cpu_seconds": usage.ru_utime + usage.ru_stime,
        # perf_counter is CLOCK_MONOTONIC on Linux, shared by both processes
        "startup_seconds": report["ready"] - started,
        "startup_cpu_seconds": report["ready_cpu"],
        "main_thread_cpu_seconds": report["main_cpu"],
        "startup_main_thread_cpu_seconds": report["ready_main_cpu"],
        "published": report["acked"],
        "exit_code": proc.returncode,
        "peak_rss_mb": report["peak_rss_mb"],
    }


Headers = list[tuple[str, str | bytes | None]]


def _records() -> list[tuple[bytes, bytes, Headers]]:
    records = []
    for n in range(POOL):
        value = b'{"n": %d, "pad": "%b"}' % (n, PAD.encode())
        headers: Headers = [
            ("id", b"%08x-0000-4000-8000-%012x" % (n, n)),
            ("event_type", b"order_created"),
            ("aggregate_type", b"order"),
            ("cdc_relay.position", b"bench/16B3F28/%d" % (n % 10 + 1)),
        ]
        records.append((b"order-%d" % n, value, headers))
    return records


def child(rows: int, topic: str) -> None:
    """One producer through ``rows`` records; prints when it was ready and what was acked."""
    import resource  # noqa: PLC0415 (the child's own imports: its start-up is measured)

    from confluent_kafka import Producer  # noqa: PLC0415

    config = json.loads(sys.stdin.read())
    producer = Producer(config)
    producer.list_topics(topic, timeout=10)  # metadata, as the relay fetches before its first
    records = _records()
    acked = [0]

    def on_delivery(err: Any, msg: Any) -> None:
        if err is None:
            acked[0] += 1

    def cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    ready, ready_cpu, ready_main_cpu = time.perf_counter(), cpu(), time.thread_time()
    produce, poll = producer.produce, producer.poll
    for i in range(rows):
        key, value, headers = records[i % POOL]
        while True:
            try:
                produce(topic, value, key, on_delivery=on_delivery, headers=headers)
                break
            except BufferError:
                poll(0.01)
        if i % POLL_EVERY == 0:
            poll(0)
    while acked[0] < rows and producer.flush(10.0):
        pass
    main_cpu = time.thread_time()
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    report = {
        "ready": ready,
        "ready_cpu": ready_cpu,
        "ready_main_cpu": ready_main_cpu,
        "main_cpu": main_cpu,
        "acked": acked[0],
        "peak_rss_mb": peak_mb,
    }
    print(json.dumps(report))


if __name__ == "__main__":
    child(int(sys.argv[1]), sys.argv[2])
