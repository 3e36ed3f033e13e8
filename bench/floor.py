"""The floor under the relay's numbers: what the chosen libraries cost before any relay code runs.

Issue 17's targets bound two things that are mostly not the relay's own code, so this measures
them without it, beside the relay's own figures from the same run:

- **start-up**: the relay needs psycopg and pydantic-settings (its settings) before it can send
  START_REPLICATION. Each import is timed in a fresh interpreter (``python -c``), launch to exit,
  the minimum of several interleaved launches, next to the relay's own start path up to the
  point where it connects (settings read, the relay built).
- **per event**: a bare idempotent producer, configured as the relay configures it
  (``Settings.producer_config()``), producing records of the relay's shape (key, ~250-byte JSON
  value, the relay's four headers) with one Python delivery callback each that counts the
  acknowledgement: the least a relay with per-event delivery accounting can do through
  confluent-kafka. Beside it, the relay's session loop on the same number of events
  (``bench.replay``: decode, map, produce, acknowledge, confirm). CPU per event of the main thread
  and of the whole process (librdkafka's threads included), minimum of ``--repeat`` runs.

    python -m bench.floor [--events 20000] [--repeat 5] [--launches 7]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

from confluent_kafka import Producer

from bench.catchup import write_backlog
from bench.harness import PAD, TOPIC, TOPIC_PARTITIONS, create_outbox
from bench.replay import _process_cpu, record, replay_once, settings_for
from cdc_relay.local import LocalBroker, LocalPostgres
from cdc_relay.reconcile import POSITION_HEADER

# What each launch runs. The relay's start path ends where it would connect to PostgreSQL.
IMPORTS = {
    "python": "pass",
    "psycopg": "import psycopg",
    "pydantic_settings": "import pydantic_settings",
    "psycopg_and_pydantic_settings": "import psycopg, pydantic_settings",
    "relay_start_path": (
        "from cdc_relay.cli import build_parser, settings_from_args\n"
        "from cdc_relay.relay import Relay\n"
        "Relay(settings_from_args(build_parser().parse_args(['run'])))"
    ),
}
START_PATH_ENV = {
    "CDC_RELAY_DATABASE_URL": "postgresql://relay@127.0.0.1:1/app",
    "CDC_RELAY_KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1",
}
POLL_EVERY = 1000  # records between two polls of the producer (the relay polls per read batch)


def launch_seconds(launches: int) -> dict[str, float]:
    """Launch-to-exit seconds of each of :data:`IMPORTS`, the minimum over interleaved launches."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("CDC_RELAY_", "OTEL_"))}
    env = {**clean, **START_PATH_ENV}
    best = dict.fromkeys(IMPORTS, float("inf"))
    for _ in range(launches):
        for name, code in IMPORTS.items():
            started = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], env=env, check=True)
            best[name] = min(best[name], time.perf_counter() - started)
    return best


def relay_shaped_records(events: int) -> list[tuple[bytes, bytes, list[tuple[str, bytes]]]]:
    """Key, value and headers as the relay sends the bench's backlog rows."""
    records = []
    for n in range(events):
        value = b'{"n": %d, "pad": "%b"}' % (n, PAD.encode())
        headers = [
            ("id", str(uuid.uuid4()).encode()),
            ("event_type", b"order_created"),
            ("aggregate_type", b"order"),
            (POSITION_HEADER, b"00000000016B3F28%d" % (n % 10 + 1)),
        ]
        records.append((b"order-%d" % (n % 1000), value, headers))
    return records


def produce_once(config: dict[str, str], records: list[Any]) -> dict[str, float]:
    """One bare producer through every record; CPU per event of its main thread and process."""
    producer = Producer(config)
    producer.list_topics(TOPIC, timeout=10)  # metadata round trip outside the measurement
    acked = [0]

    def on_delivery(err: Any, msg: Any) -> None:
        if err is None:
            acked[0] += 1

    produce, poll = producer.produce, producer.poll
    main, process = time.thread_time(), _process_cpu()
    for i, (key, value, headers) in enumerate(records):
        while True:
            try:
                produce(TOPIC, value, key, on_delivery=on_delivery, headers=headers)
                break
            except BufferError:
                poll(0.01)
        if i % POLL_EVERY == 0:
            poll(0)
    while acked[0] < len(records) and producer.flush(10.0):
        pass
    main = time.thread_time() - main
    process = _process_cpu() - process
    if acked[0] != len(records):
        raise RuntimeError(f"produced {len(records)} records but {acked[0]} were acknowledged")
    return {"main": main / len(records) * 1e6, "process": process / len(records) * 1e6}


def run(events: int, repeat: int, launches: int) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for name, seconds in launch_seconds(launches).items():
        result[f"launch_s_{name}"] = round(seconds, 3)
    with LocalPostgres() as server, LocalBroker() as broker:
        url = server.create_database("bench_floor")
        broker.create_topic(TOPIC, partitions=TOPIC_PARTITIONS)
        create_outbox(url, "pgoutput")
        write_backlog(url, events, 10)
        settings = settings_for(url, broker.bootstrap_servers)
        frames = record(url, settings, events)
        records = relay_shaped_records(events)
        bare, relay = [], []
        for _ in range(repeat):  # interleaved: both see the same machine
            bare.append(produce_once(settings.producer_config(), records))
            replayed = replay_once(frames, settings)
            relay.append(
                {"main": replayed["main_us_per_event"], "process": replayed["process_us_per_event"]}
            )
    for part in ("main", "process"):
        floor = min(r[part] for r in bare)
        own = min(r[part] for r in relay)
        result[f"{part}_us_per_event_bare_producer"] = round(floor, 2)
        result[f"{part}_us_per_event_relay"] = round(own, 2)
        result[f"{part}_relay_over_bare_producer"] = round(own / floor, 2)
    return result


def _lines(result: dict[str, Any]) -> Iterator[str]:
    width = max(len(k) for k in result)
    for key, value in result.items():
        yield f"{key:<{width}}  {value}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--launches", type=int, default=7)
    args = parser.parse_args()
    for line in _lines(run(args.events, args.repeat, args.launches)):
        print(line)


if __name__ == "__main__":
    main()
