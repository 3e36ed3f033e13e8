"""Catch-up benchmark: the relay against ``pg_recvlogical`` reading the identical WAL.

A backlog of outbox rows is committed before anything reads the slot. The slot is copied
(``pg_copy_logical_replication_slot``) so that PostgreSQL's own client, ``pg_recvlogical``, decodes
exactly the same WAL with the relay's own plugin options to /dev/null: the ceiling for any
consumer of that plugin on this machine. Then the relay starts on the original slot, and is timed
from its launch until the slot is confirmed past an LSN inside the last transaction, i.e. until
Kafka acknowledged every event. Reported as a ratio measured in the same run.

    python -m bench.catchup --rows 200000 --per-txn 10 [--json results.json]

``python -m bench`` runs this (three sizes) together with the steady-state scenarios.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path
from typing import Any

import psycopg

from bench.harness import (
    COPY,
    PAD,
    PUBLICATION,
    SLOT,
    TOPIC,
    TOPIC_PARTITIONS,
    RelayChild,
    confirmed_lsn,
    create_outbox,
    current_lsn,
    machine_facts,
)
from cdc_relay.config import Settings
from cdc_relay.decode import plugin_options_for
from cdc_relay.local import LocalBroker, LocalPostgres
from cdc_relay.local.postgres_binaries import find_bindir
from cdc_relay.lsn import format_lsn

SAMPLE_INTERVAL = 0.2  # seconds between throughput samples (/status `published`)
POLL_INTERVAL = 0.02  # seconds between reads of the slot's confirmed position


def write_backlog(url: str, rows: int, per_txn: int) -> tuple[int, int, float]:
    """Commit ``rows`` outbox rows, ``per_txn`` per transaction, then copy the slot.

    Returns an LSN inside the last transaction, the WAL bytes written and the seconds it took.
    """
    if rows % per_txn:
        raise ValueError(f"rows ({rows}) must be a multiple of rows per transaction ({per_txn})")
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            b"CREATE PROCEDURE fill(txns int, per_txn int, pad text) LANGUAGE plpgsql AS $$ "
            b"BEGIN FOR t IN 1..txns LOOP "
            b"INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) "
            b"SELECT gen_random_uuid(), 'order', 'order-' || ((t * per_txn + i) % 1000), "
            b"'order_created', jsonb_build_object('n', t * per_txn + i, 'pad', pad) "
            b"FROM generate_series(1, per_txn) i; COMMIT; END LOOP; END $$"
        )
        started = time.perf_counter()
        start_lsn = current_lsn(conn)
        conn.execute("CALL fill(%s, %s, %s)", (rows // per_txn - 1, per_txn, PAD))
        inside_last = current_lsn(conn, "pg_current_wal_insert_lsn")
        conn.execute("CALL fill(1, %s, %s)", (per_txn, PAD))
        elapsed = time.perf_counter() - started
        wal_bytes = current_lsn(conn) - start_lsn
        conn.execute("SELECT pg_copy_logical_replication_slot(%s, %s)", (SLOT, COPY))
    return inside_last, wal_bytes, elapsed


def recvlogical_options(plugin: str) -> dict[str, str]:
    """The options the relay itself passes to the plugin, so both read and decode the same."""
    # model_validate: exactly these values, no environment or .env file read.
    settings = Settings.model_validate(
        {
            "database_url": "postgresql://unused",
            "kafka_bootstrap_servers": "unused:9092",
            "slot_name": SLOT,
            "publication_name": PUBLICATION,
            "plugin": plugin,
            "outbox_table": "public.outbox",
        }
    )
    return plugin_options_for(settings)


def time_recvlogical(url: str, end: int, plugin: str) -> float:
    """Seconds ``pg_recvlogical`` takes to stream the copied slot up to ``end`` to /dev/null."""
    options = recvlogical_options(plugin)
    command = [
        str(find_bindir() / "pg_recvlogical"),
        "-d", url, "-S", COPY, "--start", "--no-loop", "-E", format_lsn(end), "-f", "/dev/null",
        *(item for key, value in options.items() for item in ("-o", f"{key}={value}")),
    ]  # fmt: skip
    started = time.perf_counter()
    subprocess.run(command, check=True)
    elapsed = time.perf_counter() - started
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_drop_replication_slot(%s)", (COPY,))  # release its WAL
    return elapsed


def time_relay(
    url: str,
    bootstrap: str,
    inside_last: int,
    plugin: str,
    relay_settings: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Start the relay on the slot; time it until the slot is confirmed past ``inside_last``."""
    relay = RelayChild(
        url,
        bootstrap,
        plugin,
        **{
            "confirm_interval": "0.05",  # timing resolution, not a tuning
            **(relay_settings or {}),
        },
    )
    samples_t: list[float] = [0.0]  # relay launch: nothing published yet
    samples_published: list[int] = [0]
    startup_cpu: float | None = None
    startup_s: float | None = None
    start_replication_s: float | None = None
    with psycopg.connect(url, autocommit=True) as conn, relay:
        next_sample = relay.started
        while True:
            now = time.perf_counter()
            if confirmed_lsn(conn) > inside_last:
                break
            relay.check_alive()
            if startup_cpu is None or now >= next_sample:
                status = relay.status()
                if status is not None:
                    if startup_cpu is None and status["streaming"]:
                        # Start-up cost: imports, connections, slot checks (read within ~20 ms
                        # of the session starting, so it includes a little streaming work).
                        startup_cpu = relay.cpu_seconds()
                        startup_s = now - relay.started
                        # The instant the relay sent START_REPLICATION, on the monotonic clock
                        # both processes share (perf_counter is that clock on Linux): exact,
                        # whenever /status was read.
                        sent = status.get("start_replication_monotonic")
                        if sent is not None:
                            start_replication_s = float(sent) - relay.started
                    if now >= next_sample:
                        samples_t.append(round(now - relay.started, 3))
                        samples_published.append(int(status["published"]))
                if now >= next_sample:
                    next_sample += SAMPLE_INTERVAL
            time.sleep(POLL_INTERVAL)
        elapsed = time.perf_counter() - relay.started
        cpu = relay.cpu_seconds()
        rss = relay.peak_rss_mb()
        published = relay.published() or 0
        samples_t.append(round(elapsed, 3))
        samples_published.append(published)
        exit_code = relay.stop()
    return {
        "seconds": elapsed,
        "cpu_seconds": cpu,
        "startup_cpu_seconds": cpu if startup_cpu is None else startup_cpu,
        "startup_seconds": elapsed if startup_s is None else startup_s,
        "start_replication_seconds": start_replication_s,
        "peak_rss_mb": rss,
        "published": published,
        "exit_code": exit_code,
        "settings": relay.settings,
        "throughput": {"t": samples_t, "published": samples_published},
    }


def catchup_scenario(
    server: LocalPostgres,
    name: str,
    rows: int,
    per_txn: int,
    plugin: str = "pgoutput",
    *,
    relay_settings: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One catch-up measurement in a fresh database and a fresh broker."""
    url = server.create_database(name)
    try:
        with LocalBroker() as broker:
            broker.create_topic(TOPIC, partitions=TOPIC_PARTITIONS)
            create_outbox(url, plugin)
            inside_last, wal_bytes, write_s = write_backlog(url, rows, per_txn)
            with psycopg.connect(url, autocommit=True) as conn:
                end = current_lsn(conn)
            recvlogical = time_recvlogical(url, end, plugin)
            relay = time_relay(url, broker.bootstrap_servers, inside_last, plugin, relay_settings)
    finally:
        server.drop_database(name)
    if relay["published"] < rows:
        raise RuntimeError(f"slot confirmed but only {relay['published']} of {rows} published")
    relay_seconds = float(relay["seconds"])
    streaming_seconds = relay_seconds - float(relay["startup_seconds"])
    return {
        "kind": "catchup",
        "plugin": plugin,
        "rows": rows,
        "rows_per_txn": per_txn,
        "transactions": rows // per_txn,
        "backlog_write_s": round(write_s, 3),
        "wal_mb": round(wal_bytes / 1024 / 1024, 1),
        "pg_recvlogical": {
            "seconds": round(recvlogical, 3),
            "rows_per_s": round(rows / recvlogical),
        },
        "relay": {
            "seconds": round(relay_seconds, 3),
            "rows_per_s": round(rows / relay_seconds),
            "cpu_s": round(relay["cpu_seconds"], 3),
            "cpu_us_per_event": round(relay["cpu_seconds"] / rows * 1e6, 2),
            "startup_s": round(relay["startup_seconds"], 3),
            "start_replication_s": (
                None
                if relay["start_replication_seconds"] is None
                else round(relay["start_replication_seconds"], 3)
            ),
            "rows_per_s_after_startup": round(rows / streaming_seconds),
            "startup_cpu_s": round(relay["startup_cpu_seconds"], 3),
            "cpu_us_per_event_after_startup": round(
                (relay["cpu_seconds"] - relay["startup_cpu_seconds"]) / rows * 1e6, 2
            ),
            "peak_rss_mb": round(relay["peak_rss_mb"], 1),
            "published": relay["published"],
            "exit_code": relay["exit_code"],
            "settings": relay["settings"],
        },
        "ratio": round(recvlogical / relay_seconds, 3),
        "ratio_after_startup": round(recvlogical / streaming_seconds, 3),
        "throughput": relay["throughput"],
    }


def run(rows: int, per_txn: int, plugin: str = "pgoutput") -> dict[str, Any]:
    """A throw-away cluster and one catch-up measurement, as a flat dict (``bench.catchup`` CLI)."""
    with LocalPostgres() as server:
        machine = machine_facts(server.url())
        result = catchup_scenario(server, "bench_catchup", rows, per_txn, plugin)
    return {
        "plugin": plugin,
        "rows": rows,
        "rows_per_txn": per_txn,
        "machine": f"{machine['cpu_model']}, {machine['cores']} cores, "
        f"Python {machine['python']}, PostgreSQL {machine['postgresql']}",
        "pg_recvlogical_s": result["pg_recvlogical"]["seconds"],
        "pg_recvlogical_rows_per_s": result["pg_recvlogical"]["rows_per_s"],
        "relay_s": result["relay"]["seconds"],
        "relay_rows_per_s": result["relay"]["rows_per_s"],
        "relay_startup_s": result["relay"]["startup_s"],
        "relay_start_replication_s": result["relay"]["start_replication_s"],
        "relay_rows_per_s_after_startup": result["relay"]["rows_per_s_after_startup"],
        "relay_cpu_us_per_event": result["relay"]["cpu_us_per_event"],
        "relay_peak_rss_mb": result["relay"]["peak_rss_mb"],
        "ratio_relay_to_pg_recvlogical": result["ratio"],
        "ratio_after_relay_startup": result["ratio_after_startup"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--per-txn", type=int, default=10)
    parser.add_argument("--plugin", choices=("pgoutput", "wal2json"), default="pgoutput")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()
    result = run(args.rows, args.per_txn, args.plugin)
    width = max(len(k) for k in result)
    for key, value in result.items():
        print(f"{key:<{width}}  {value}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
