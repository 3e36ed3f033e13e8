"""The steady-state benchmark's Kafka consumer, in its own process (its own GIL and clock reads).

    python -m bench.consumer BOOTSTRAP TOPIC PARTITIONS WARMUP OUT [--read-after]

Reads every partition of TOPIC from the beginning (``assign()``, no group protocol, short fetch
waits) and, for each event, computes ``receive time - payload["ts"]``: the writer put
``clock_timestamp()`` into the payload at insert time. Events with a negative ``seq`` are warm-up
events, not measured. Protocol on stdout: ``ready`` once assigned, ``warm`` once WARMUP warm-up
events arrived. On stdin: a line with the number of measured events to expect; the consumer stops
when it has them all (or after ``--idle-timeout`` seconds without a new one, or on SIGTERM: the
parent's deadline) and writes OUT as JSON: ``latencies_ms`` (in arrival order), with each
event's ``seqs`` and ``inserted`` (its ``ts``, for the bench's timeline), ``received``,
``duplicates``, ``messages``, ``first_read_at`` (when the first measured event arrived, Unix
time).

With ``--read-after`` the consumer pauses its partitions once warm and sends no fetch until the
expected count arrives on stdin, then reads everything: the test broker (Tansu's memory engine)
lists every batch a partition holds on each fetch that finds new records, so a consumer fetching
beside the producer makes the broker's cost, and its acknowledgements' round trip, grow with the
window. Read after the window, an event's receive time says nothing about its latency:
``latencies_ms`` stays empty; every event is still counted once. Its fetches then wait up to
:data:`READ_AFTER_FETCH_WAIT_MS`: the test broker fills a fetch for about as long as the fetch may
wait, so 60 s of events at 5,000 a second (~27,000 batches) take ~2-3 s in ~6 fetches of ~5 MB;
with 5 ms a fetch returns ~2 batches, each fetch listing everything held (35-50k of the 300k
events in 40-60 s).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import sys
import time
from pathlib import Path
from typing import Any

import orjson
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

LIVE_FETCH_WAIT_MS = 5
READ_AFTER_FETCH_WAIT_MS = 500


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _expected_from_stdin() -> int | None:
    """The expected count, once the parent wrote it; -1 when stdin closed without one."""
    ready, _, _ = select.select([sys.stdin], [], [], 0)
    if not ready:
        return None
    line = sys.stdin.readline()
    return int(line) if line.strip() else -1


def consume(
    bootstrap: str,
    topic: str,
    partitions: int,
    warmup: int,
    idle_timeout: float,
    *,
    read_after: bool = False,
) -> dict[str, Any]:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"bench-consumer-{os.getpid()}",  # required, unused with assign()
            "enable.auto.commit": False,
            "fetch.wait.max.ms": READ_AFTER_FETCH_WAIT_MS if read_after else LIVE_FETCH_WAIT_MS,
            "fetch.min.bytes": 1,
            "fetch.error.backoff.ms": 5,
            "log_level": 3,
        }
    )
    stop = False

    def on_term(_signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True  # what was read so far is written out, not lost

    signal.signal(signal.SIGTERM, on_term)
    assigned = [TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)]
    consumer.assign(assigned)
    consumer.consume(num_messages=1, timeout=0.2)  # first fetch under way
    _say("ready")
    latencies: list[float] = []
    seqs: list[int] = []
    inserted: list[float] = []
    seen: set[int] = set()
    warm: set[int] = set()
    duplicates = messages = 0
    expected: int | None = None
    first_read_at: float | None = None
    paused = False
    last_new = time.monotonic()
    try:
        while not stop:
            # poll() returns as soon as one record is there; consume(timeout=0) then takes what
            # else is queued. (consume() with a timeout waits to fill its batch: added latency.)
            first = consumer.poll(0.05)
            received_at = time.time()
            batch = [] if first is None else [first, *consumer.consume(1000, timeout=0)]
            for message in batch:
                value = message.value()
                if message.error() is not None or value is None:
                    continue
                messages += 1
                event = orjson.loads(value)
                seq = int(event["seq"])
                if seq < 0:
                    if seq not in warm:
                        warm.add(seq)
                        if len(warm) == warmup:
                            if read_after:
                                consumer.pause(assigned)
                                paused = True
                            _say("warm")
                    continue
                if seq in seen:
                    duplicates += 1
                    continue
                seen.add(seq)
                ts = float(event["ts"])
                if first_read_at is None:
                    first_read_at = received_at
                if not read_after:
                    latencies.append((received_at - ts) * 1000.0)
                seqs.append(seq)
                inserted.append(ts)
                last_new = time.monotonic()
            if expected is None:
                expected = _expected_from_stdin()
                if expected is not None:
                    last_new = max(last_new, time.monotonic())
                    if paused:
                        # Fetching resumes at the position consumed so far: nothing skipped.
                        consumer.resume(assigned)
                        paused = False
            if expected is not None:
                if expected < 0 or len(seen) >= expected:
                    break
                if time.monotonic() - last_new > idle_timeout:
                    break
    finally:
        consumer.close()
    return {
        "latencies_ms": latencies,
        "seqs": seqs,
        "inserted": inserted,
        "received": len(seen),
        "duplicates": duplicates,
        "messages": messages,
        "first_read_at": first_read_at,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("bootstrap")
    parser.add_argument("topic")
    parser.add_argument("partitions", type=int)
    parser.add_argument("warmup", type=int)
    parser.add_argument("out", type=Path)
    parser.add_argument("--idle-timeout", type=float, default=30.0)
    parser.add_argument("--read-after", action="store_true")
    args = parser.parse_args()
    result = consume(
        args.bootstrap,
        args.topic,
        args.partitions,
        args.warmup,
        args.idle_timeout,
        read_after=args.read_after,
    )
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
