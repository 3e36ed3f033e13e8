"""Catch-up benchmark: the relay against ``pg_recvlogical`` reading the identical WAL.

A backlog of outbox rows is committed before anything reads the slot. The slot is copied
(``pg_copy_logical_replication_slot``) so that PostgreSQL's own client, ``pg_recvlogical``, decodes
exactly the same WAL to /dev/null: the ceiling for any pgoutput consumer on this machine. Then the
relay starts on the original slot, and is timed until the slot is confirmed past the backlog,
i.e. until Kafka acknowledged every event. Reported as a ratio measured in the same run.

    python -m bench.catchup --rows 200000 --per-txn 10 [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg

from cdc_relay.local import LocalBroker, LocalPostgres
from cdc_relay.local.postgres import find_bindir
from cdc_relay.lsn import format_lsn, parse_lsn
from cdc_relay.wal2json import plugin_options

REPO = Path(__file__).resolve().parents[1]
SLOT, COPY, PUBLICATION, TOPIC = "bench", "bench_copy", "bench_pub", "outbox.event.order"


def _lsn(conn: psycopg.Connection[Any], query: str) -> int:
    row = conn.execute(query.encode()).fetchone()
    assert row is not None
    return parse_lsn(str(row[0]))


def write_backlog(url: str, rows: int, per_txn: int, plugin: str = "pgoutput") -> int:
    """Commit ``rows`` outbox rows, ``per_txn`` per transaction; returns an LSN inside the last."""
    payload = "x" * 200  # ~250-byte payloads, as in the peer measurements
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute((REPO / "sql" / "001_outbox.sql").read_bytes())
        conn.execute(
            f"CREATE PUBLICATION {PUBLICATION} FOR TABLE outbox WITH (publish = 'insert')".encode()
        )
        conn.execute("SELECT pg_create_logical_replication_slot('bench', %s)", (plugin,))
        txns = rows // per_txn
        conn.execute(
            b"CREATE PROCEDURE fill(txns int, per_txn int, pad text) LANGUAGE plpgsql AS $$ "
            b"BEGIN FOR t IN 1..txns LOOP "
            b"INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) "
            b"SELECT gen_random_uuid(), 'order', 'order-' || ((t * per_txn + i) % 1000), "
            b"'order_created', jsonb_build_object('n', t * per_txn + i, 'pad', pad) "
            b"FROM generate_series(1, per_txn) i; COMMIT; END LOOP; END $$"
        )
        conn.execute("CALL fill(%s, %s, %s)", (txns - 1, per_txn, payload))
        inside_last = _lsn(conn, "SELECT pg_current_wal_insert_lsn()::text")
        conn.execute("CALL fill(1, %s, %s)", (per_txn, payload))
        conn.execute(b"SELECT pg_copy_logical_replication_slot('bench', 'bench_copy')")
        return inside_last


def time_recvlogical(url: str, end: int, plugin: str = "pgoutput") -> float:
    if plugin == "wal2json":
        options = [f"{key}={value}" for key, value in plugin_options(["public.outbox"]).items()]
    else:
        options = ["proto_version=1", f"publication_names={PUBLICATION}"]
    command = [
        str(find_bindir() / "pg_recvlogical"),
        "-d", url, "-S", COPY, "--start", "--no-loop", "-E", format_lsn(end), "-f", "/dev/null",
        *(item for option in options for item in ("-o", option)),
    ]  # fmt: skip
    started = time.perf_counter()
    subprocess.run(command, check=True)
    return time.perf_counter() - started


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def time_relay(
    url: str, bootstrap: str, inside_last: int, plugin: str = "pgoutput"
) -> dict[str, float]:
    env = {
        **os.environ,
        "CDC_RELAY_DATABASE_URL": url,
        "CDC_RELAY_KAFKA_BOOTSTRAP_SERVERS": bootstrap,
        "CDC_RELAY_SLOT_NAME": SLOT,
        "CDC_RELAY_PUBLICATION_NAME": PUBLICATION,
        "CDC_RELAY_CONFIRM_INTERVAL": "0.05",  # timing resolution, not a tuning
        "CDC_RELAY_LOG_LEVEL": "WARNING",
        "CDC_RELAY_PLUGIN": plugin,
        "CDC_RELAY_HTTP_PORT": "0",
    }
    with tempfile.TemporaryFile() as log:
        started = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "cdc_relay"], env=env, stdout=log, stderr=log,
            cwd=tempfile.gettempdir(),
        )  # fmt: skip
        try:
            with psycopg.connect(url, autocommit=True) as conn:
                query = (
                    "SELECT confirmed_flush_lsn::text FROM pg_replication_slots "
                    f"WHERE slot_name = '{SLOT}'"
                )
                while _lsn(conn, query) <= inside_last:
                    if proc.poll() is not None:
                        log.seek(0)
                        raise RuntimeError(f"relay exited: {log.read().decode()}")
                    time.sleep(0.01)
            elapsed = time.perf_counter() - started
            cpu = _cpu_seconds(proc.pid)
            rss = _peak_rss_mb(proc.pid)
        finally:
            proc.terminate()
            proc.wait(30)
    return {"seconds": elapsed, "cpu_seconds": cpu, "peak_rss_mb": rss}


def run(rows: int, per_txn: int, plugin: str = "pgoutput") -> dict[str, Any]:
    with LocalPostgres() as server, LocalBroker() as broker:
        url = server.create_database("bench")
        broker.create_topic(TOPIC, partitions=3)
        inside_last = write_backlog(url, rows, per_txn, plugin)
        with psycopg.connect(url, autocommit=True) as conn:
            end = _lsn(conn, "SELECT pg_current_wal_lsn()::text")
        recvlogical = time_recvlogical(url, end, plugin)
        relay = time_relay(url, broker.bootstrap_servers, inside_last, plugin)
    return {
        "plugin": plugin,
        "rows": rows,
        "rows_per_txn": per_txn,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}",
        "pg_recvlogical_s": round(recvlogical, 3),
        "pg_recvlogical_rows_per_s": round(rows / recvlogical),
        "relay_s": round(relay["seconds"], 3),
        "relay_rows_per_s": round(rows / relay["seconds"]),
        "relay_cpu_us_per_event": round(relay["cpu_seconds"] / rows * 1e6, 1),
        "relay_peak_rss_mb": round(relay["peak_rss_mb"], 1),
        "ratio_relay_to_pg_recvlogical": round(recvlogical / relay["seconds"], 3),
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
