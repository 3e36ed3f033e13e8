"""Catch-up benchmark: the relay and its Rust peer against ``pg_recvlogical``, on identical WAL.

A backlog of outbox rows is committed before anything reads the template slot. Every program
then runs on its own copy of that slot (``pg_copy_logical_replication_slot``, made just before
it starts), so each decodes exactly the same WAL from the same position:

- ``pg_recvlogical``, PostgreSQL's own client, with the relay's own plugin options, to /dev/null:
  the ceiling for any consumer of that plugin on this machine;
- the relay, timed from its launch until its slot is confirmed past an LSN inside the last
  transaction, i.e. until Kafka acknowledged every event;
- mq-bridge (``bench.peer``), at its defaults and tuned, timed from its launch until every row
  arrived in its topic, counted on the broker;
- with ``floor``, the other half of the floor (``bench.floor_programs``): a bare idempotent
  producer sending as many records of the relay's shape, timed from its launch until every one
  was acknowledged; and, once per round, the import floor (a fresh interpreter importing psycopg
  and pydantic-settings), against which the relay's launch → ``START_REPLICATION`` is judged.

Each Kafka program gets a fresh broker, and the records that arrive are counted while it runs
(for the relay too, so that every Kafka program shares the machine with the same counter). CPU is
utime + stime of the whole process from /proc (all threads, waited-for children included), for
``pg_recvlogical`` from ``wait4()``. With ``rounds`` > 1 the programs are interleaved, each round
in a rotated order, and the medians are reported; ratios are taken within a round.

    python -m bench.catchup --rows 200000 --per-txn 10 [--rounds 5] [--json results.json]

``python -m bench`` runs this (three sizes) together with the steady-state scenarios.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg

from bench import compiled
from bench import peer as peer_module
from bench.floor_programs import import_floor_seconds, time_bare_producer
from bench.harness import (
    PAD,
    PUBLICATION,
    REPO,
    SLOT,
    TOPIC,
    TOPIC_PARTITIONS,
    BrokerCounter,
    RelayChild,
    RunCPU,
    confirmed_lsn,
    cpu_seconds_with_children,
    create_outbox,
    current_lsn,
    machine_facts,
    postmaster_pid,
    thread_cpu_seconds,
    thread_schedstat,
)
from bench.peer import PeerChild, PeerRuntime
from bench.report import RATIO_AFTER_STARTUP_MIN
from cdc_relay._hot_path import HOT_PATH, extension_of
from cdc_relay.config import Settings
from cdc_relay.decode import plugin_options_for
from cdc_relay.local import LocalBroker, LocalPostgres
from cdc_relay.local.postgres_binaries import find_bindir
from cdc_relay.lsn import format_lsn

SAMPLE_INTERVAL = 0.2  # seconds between throughput samples
POLL_INTERVAL = 0.02  # seconds between reads of the slot's confirmed position / the broker
RECVLOGICAL, RELAY, BARE = "pg_recvlogical", "relay", "bare producer"
# The relay with a setting that changes what it costs, run beside the default relay on the same
# WAL in every round: its row and its ratio to the default relay come from one run.
EXACTLY_ONCE = "cdc-relay, exactly once"
VARIANTS: dict[str, dict[str, str]] = {EXACTLY_ONCE: {"exactly_once": "true"}}
IMPORT_FLOOR_LAUNCHES = 3  # per round, the fastest counts
PEER_TOPIC = "bench.peer"
PEER_MIN_SECONDS = 60.0  # a peer run that has not delivered every row by then failed
PEER_MIN_ROWS_PER_S = 2_000.0  # ... or, for big backlogs, by rows / this


def write_backlog(url: str, rows: int, per_txn: int) -> tuple[int, int, float]:
    """Commit ``rows`` outbox rows, ``per_txn`` per transaction, while no slot is read.

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
    return inside_last, wal_bytes, elapsed


def copy_slot(url: str, name: str) -> str:
    """A fresh copy of the template slot: the program reading it starts where every other did."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_copy_logical_replication_slot(%s, %s)", (SLOT, name))
    return name


def drop_slot(url: str, name: str, timeout: float = 10.0) -> None:
    """Drop a copy once its reader is gone (a walsender may take a moment to release it)."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(url, autocommit=True) as conn:
        while True:
            try:
                conn.execute("SELECT pg_drop_replication_slot(%s)", (name,))
                return
            except psycopg.errors.ObjectInUse:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


def _settings(plugin: str, bootstrap: str = "unused:9092") -> Settings:
    # model_validate: exactly these values, no environment or .env file read.
    return Settings.model_validate(
        {
            "database_url": "postgresql://unused",
            "kafka_bootstrap_servers": bootstrap,
            "slot_name": SLOT,
            "publication_name": PUBLICATION,
            "plugin": plugin,
            "outbox_table": "public.outbox",
        }
    )


def recvlogical_options(plugin: str) -> dict[str, str]:
    """The options the relay itself passes to the plugin, so both read and decode the same."""
    return plugin_options_for(_settings(plugin))


def time_bare(bootstrap: str, rows: int, *, postmaster: int, broker: int) -> dict[str, Any]:
    """The bare producer with the relay's producer configuration, counted on the broker too."""
    config = _settings("pgoutput", bootstrap).producer_config()
    with BrokerCounter(bootstrap, TOPIC) as counter:
        counter.pause()  # counted once it finished: its own acknowledgements time it
        window = RunCPU(postmaster)
        during: dict[str, Any] = {}

        def exited(pid: int) -> None:
            during.update(window.end({"program": pid, "broker": broker}))

        measured = time_bare_producer(config, TOPIC, rows, exited=exited)
        measured["cpu_during_run"] = during
        counter.resume()
        deadline = time.monotonic() + 10.0
        while counter.count < rows and time.monotonic() < deadline:
            counter.wait(POLL_INTERVAL)
        measured["on_broker"] = counter.count
    return measured


def time_recvlogical(
    url: str, slot: str, end: int, plugin: str, *, postmaster: int
) -> dict[str, Any]:
    """``pg_recvlogical`` streams ``slot`` up to ``end`` to /dev/null: seconds and CPU, and where
    the machine's CPU went meanwhile (its walsender read every ``POLL_INTERVAL / 2``)."""
    options = recvlogical_options(plugin)
    command = [
        str(find_bindir() / "pg_recvlogical"),
        "-d", url, "-S", slot, "--start", "--no-loop", "-E", format_lsn(end), "-f", "/dev/null",
        *(item for key, value in options.items() for item in ("-o", f"{key}={value}")),
    ]  # fmt: skip
    window = RunCPU(postmaster)
    started = time.perf_counter()
    proc = subprocess.Popen(command)
    stop = threading.Event()

    def watch() -> None:  # its walsender exits with it: read while it lives
        while not stop.wait(POLL_INTERVAL / 2):
            window.poll()

    watcher = threading.Thread(target=watch, name="walsender-cpu", daemon=True)
    watcher.start()
    # Exited but not reaped (WNOWAIT): its /proc entry still holds its CPU for the breakdown.
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    elapsed = time.perf_counter() - started
    stop.set()
    watcher.join()
    window.wait_walsenders_gone()
    during = window.end({"program": proc.pid})
    _, status, usage = os.wait4(proc.pid, 0)  # its rusage: what /proc cannot give after exit
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, command[0])
    return {
        "seconds": elapsed,
        "cpu_seconds": usage.ru_utime + usage.ru_stime,
        "cpu_during_run": during,
    }


def time_relay(
    url: str,
    bootstrap: str,
    *,
    slot: str,
    rows: int,
    inside_last: int,
    plugin: str,
    relay_settings: dict[str, str] | None = None,
    tree: Path = REPO,
    postmaster: int,
    broker: int,
) -> dict[str, Any]:
    """Start the relay (from ``tree``) on ``slot``; time it until the slot is confirmed past
    ``inside_last``. Also its main thread's CPU (the loop: decode, map, produce, acknowledge) and
    where the machine's CPU went meanwhile."""
    relay = RelayChild(
        url,
        bootstrap,
        plugin,
        slot=slot,
        tree=tree,
        settings={
            "confirm_interval": "0.05",  # timing resolution, not a tuning
            **(relay_settings or {}),
        },
    )
    samples_t: list[float] = [0.0]  # relay launch: nothing published yet
    samples_published: list[int] = [0]
    startup_cpu: float | None = None
    startup_main_cpu: float | None = None
    startup_sched: tuple[float, float] | None = None
    startup_s: float | None = None
    start_replication_s: float | None = None
    broker_s: float | None = None
    first_s: float | None = None
    with (
        psycopg.connect(url, autocommit=True) as conn,
        BrokerCounter(bootstrap, TOPIC) as counter,
        contextlib.ExitStack() as stack,
    ):
        window = RunCPU(postmaster)  # the counter's start-up is not the relay's run
        stack.enter_context(relay)
        next_sample = relay.started
        while True:
            now = time.perf_counter()
            if first_s is None and counter.count:
                first_s = now - relay.started
                # The rest is counted once the slot is confirmed: reading every record as it
                # arrives would take the broker's and the bench's CPU from the relay's run.
                counter.pause()
            if confirmed_lsn(conn, slot) > inside_last:
                break
            relay.check_alive()
            if startup_cpu is None or now >= next_sample:
                status = relay.status()
                if status is not None:
                    if startup_cpu is None and status["streaming"]:
                        # Start-up cost: imports, connections, slot checks (read within ~20 ms
                        # of the session starting, so it includes a little streaming work).
                        startup_cpu = cpu_seconds_with_children(relay.pid)
                        startup_main_cpu = thread_cpu_seconds(relay.pid)
                        startup_sched = thread_schedstat(relay.pid)
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
            if first_s is None:
                counter.wait(POLL_INTERVAL)
            else:
                time.sleep(POLL_INTERVAL)
        elapsed = time.perf_counter() - relay.started
        cpu = cpu_seconds_with_children(relay.pid)
        main_cpu = thread_cpu_seconds(relay.pid)
        end_sched = thread_schedstat(relay.pid)
        during = window.end({"program": relay.pid, "broker": broker})
        rss = relay.peak_rss_mb()
        published = relay.published() or 0
        samples_t.append(round(elapsed, 3))
        samples_published.append(published)
        exit_code = relay.stop()
        counter.resume()
        deadline = time.monotonic() + 10.0
        while counter.count < rows and time.monotonic() < deadline:
            counter.wait(POLL_INTERVAL)  # every acknowledged record is there, or it is missing
        if counter.count >= rows:
            broker_s = elapsed  # counted after the confirmation, which follows every ack
        on_broker = counter.count
    return {
        "seconds": elapsed,
        "cpu_seconds": cpu,
        "startup_cpu_seconds": cpu if startup_cpu is None else startup_cpu,
        "main_thread_cpu_seconds": main_cpu,
        "startup_main_thread_cpu_seconds": (
            main_cpu if startup_main_cpu is None else startup_main_cpu
        ),
        "startup_seconds": elapsed if startup_s is None else startup_s,
        # The main thread after start-up: seconds on a CPU and runnable without one.
        "main_thread_sched_after_startup": (
            None
            if startup_sched is None
            else [end - start for start, end in zip(startup_sched, end_sched, strict=True)]
        ),
        "broker_seconds": broker_s,
        "cpu_during_run": during,
        "first_on_broker_seconds": first_s,
        "start_replication_seconds": start_replication_s,
        "peak_rss_mb": rss,
        "published": published,
        "on_broker": on_broker,
        "exit_code": exit_code,
        "settings": relay.settings,
        "throughput": {"t": samples_t, "published": samples_published},
    }


def time_peer(
    runtime: PeerRuntime,
    url: str,
    bootstrap: str,
    *,
    slot: str,
    rows: int,
    variant: str,
    postmaster: int,
    broker: int,
) -> dict[str, Any]:
    """Start mq-bridge on ``slot``; time it until ``rows`` records arrived in its topic."""
    config = peer_module.route_config(
        url, slot=slot, publication=PUBLICATION, bootstrap=bootstrap, topic=PEER_TOPIC,
        variant=variant,
    )  # fmt: skip
    timeout = max(PEER_MIN_SECONDS, rows / PEER_MIN_ROWS_PER_S)
    samples_t: list[float] = [0.0]
    samples_published: list[int] = [0]
    startup_cpu: float | None = None
    startup_s: float | None = None
    first_s: float | None = None
    with BrokerCounter(bootstrap, PEER_TOPIC) as counter, contextlib.ExitStack() as stack:
        window = RunCPU(postmaster)
        peer = stack.enter_context(PeerChild(runtime, config))
        next_sample = peer.started + SAMPLE_INTERVAL
        while True:
            counter.wait(POLL_INTERVAL)
            now = time.perf_counter()
            if first_s is None and counter.count:
                first_s = now - peer.started
            if counter.count >= rows:
                break
            peer.check_alive()
            if startup_cpu is None and peer.ready():
                startup_cpu = peer.cpu_seconds()  # the route is deployed: replication started
                startup_s = now - peer.started
            if now >= next_sample:
                samples_t.append(round(now - peer.started, 3))
                samples_published.append(counter.count)
                next_sample += SAMPLE_INTERVAL
            if now - peer.started > timeout:
                raise RuntimeError(
                    f"{peer_module.NAME} delivered {counter.count} of {rows} rows in "
                    f"{timeout:.0f}s:\n{peer.log()}"
                )
        elapsed = now - peer.started
        cpu = peer.cpu_seconds()
        during = window.end({"program": peer.pid, "broker": broker})
        rss = peer.peak_rss_mb()
        samples_t.append(round(elapsed, 3))
        samples_published.append(counter.count)
        published = counter.count
        exit_code = peer.stop()
        counter.wait(0.2)  # at-least-once: a duplicate would arrive by now, after its flush
    config["input"]["postgres_cdc"]["url"] = "(bench database)"
    return {
        "seconds": elapsed,
        "cpu_seconds": cpu,
        "startup_cpu_seconds": cpu if startup_cpu is None else startup_cpu,
        "startup_seconds": elapsed if startup_s is None else startup_s,
        "first_on_broker_seconds": first_s,
        "cpu_during_run": during,
        "peak_rss_mb": rss,
        "published": published,
        "on_broker": counter.count,
        "exit_code": exit_code,
        "settings": config,
        "throughput": {"t": samples_t, "published": samples_published},
    }


def baseline_label(tree: Path) -> str:
    """``cdc-relay <commit>`` for a checkout (its short commit, ``+`` when it has changes), or
    :data:`bench.compiled.LABEL` for the Docker image's build (``--compiled``)."""
    if (tree / compiled.MARKER).is_file():
        return compiled.LABEL

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(tree), *args], capture_output=True, text=True, check=False
        ).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or tree.name
    changed = "+" if git("status", "--porcelain", "--untracked-files=no") else ""
    # The hot path's mypyc modules, not the C tuple reader every install builds.
    built = any(extension_of(tree / "cdc_relay", name) for name in HOT_PATH)
    return f"cdc-relay {commit}{changed}{' compiled' if built else ''}"


def _summary(rows: int, measured: dict[str, Any]) -> dict[str, Any]:
    """One program's run as reported: rates, CPU per row, start-up."""
    seconds = float(measured["seconds"])
    out: dict[str, Any] = {
        "seconds": round(seconds, 3),
        "rows_per_s": round(rows / seconds),
        "cpu_s": round(measured["cpu_seconds"], 3),
        "cpu_us_per_event": round(measured["cpu_seconds"] / rows * 1e6, 2),
    }
    if "startup_seconds" in measured:
        streaming = seconds - float(measured["startup_seconds"])
        out |= {
            "startup_s": round(measured["startup_seconds"], 3),
            "rows_per_s_after_startup": round(rows / streaming),
            "startup_cpu_s": round(measured["startup_cpu_seconds"], 3),
            "cpu_us_per_event_after_startup": round(
                (measured["cpu_seconds"] - measured["startup_cpu_seconds"]) / rows * 1e6, 2
            ),
            "peak_rss_mb": round(measured["peak_rss_mb"], 1),
            "published": measured["published"],
            "exit_code": measured["exit_code"],
        }
    for key in ("start_replication_seconds", "broker_seconds", "first_on_broker_seconds"):
        if measured.get(key) is not None:
            out[key.replace("seconds", "s")] = round(measured[key], 3)
    if "on_broker" in measured:
        out["on_broker"] = measured["on_broker"]
    if "main_thread_cpu_seconds" in measured:
        main = measured["main_thread_cpu_seconds"]
        streaming = (main - measured["startup_main_thread_cpu_seconds"]) / rows * 1e6
        out |= {
            "main_thread_cpu_us_per_event": round(main / rows * 1e6, 2),
            "main_thread_cpu_us_per_event_after_startup": round(streaming, 2),
            # What the loop alone could sustain with a core of its own.
            "main_thread_rows_per_s_alone": round(1e6 / streaming) if streaming > 0 else None,
        }
    sched = measured.get("main_thread_sched_after_startup")
    if sched is not None and "startup_seconds" in measured:
        wall = seconds - float(measured["startup_seconds"])
        running, runnable = sched
        if wall > 0:
            # Where the loop's wall time after start-up went: working, preempted (runnable, no
            # CPU free), or neither (waiting on the server's socket, the position write, a sleep).
            out["main_thread_after_startup_percent"] = {
                "running": round(100 * running / wall, 1),
                "runnable": round(100 * runnable / wall, 1),
                "waiting": round(100 * max(wall - running - runnable, 0.0) / wall, 1),
            }
    if "cpu_during_run" in measured:
        out["cpu_during_run"] = cpu_during_run(rows, measured["cpu_during_run"])
    return out


def cpu_during_run(rows: int, during: dict[str, Any]) -> dict[str, Any]:
    """CPU seconds by label over one run as % of one core and as µs per row of the backlog."""
    window, cpu = float(during["window_s"]), during["cpu_s"]
    out = {
        "window_s": round(window, 3),
        "percent_of_a_core": {label: round(100 * s / window, 1) for label, s in cpu.items()},
        "us_per_row": {label: round(s / rows * 1e6, 2) for label, s in cpu.items()},
    }
    if "walsender_runnable_s" in during:  # the walsender runnable without a CPU, % of the run
        out["walsender_runnable_percent"] = round(100 * during["walsender_runnable_s"] / window, 1)
    return out


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Field by field: the median of numbers, the worst exit code, the fewest rows published and
    the most records on the broker (duplicates show)."""
    out: dict[str, Any] = {}
    for key, first in runs[0].items():
        if key == "round":
            continue
        values = [run[key] for run in runs if key in run and run[key] is not None]
        value = values[0] if values else first
        if not values:
            out[key] = value
            continue
        if key == "exit_code":
            out[key] = max(values, key=abs)
        elif key == "published":
            out[key] = min(values)
        elif key == "on_broker":
            out[key] = max(values)
        elif isinstance(value, dict):
            out[key] = _median(values)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            middle = statistics.median(values)
            whole = all(isinstance(v, int) for v in values)
            out[key] = round(middle) if whole else round(middle, 3)
        else:
            out[key] = value
    return out


def _median_index(runs: list[dict[str, Any]]) -> int:
    """The run whose time is the median (the lower one of an even count): its throughput curve."""
    return sorted(range(len(runs)), key=lambda i: runs[i]["seconds"])[(len(runs) - 1) // 2]


def _ratios(base: list[dict[str, Any]], runs: list[dict[str, Any]]) -> dict[str, float]:
    """Within each round, ``pg_recvlogical``'s time over the program's; medians over rounds."""
    ratio = [b["seconds"] / r["seconds"] for b, r in zip(base, runs, strict=True)]
    out = {"ratio": round(statistics.median(ratio), 3)}
    if all("startup_s" in r for r in runs):
        after = [
            b["seconds"] / (r["seconds"] - r["startup_s"]) for b, r in zip(base, runs, strict=True)
        ]
        out["ratio_after_startup"] = round(statistics.median(after), 3)
    return out


def catchup_scenario(
    server: LocalPostgres,
    name: str,
    rows: int,
    per_txn: int,
    plugin: str = "pgoutput",
    *,
    relay_settings: dict[str, str] | None = None,
    rounds: int = 1,
    peer: PeerRuntime | str | None = None,
    baselines: Sequence[Path] = (),
    floor: bool = False,
    variants: Sequence[str] = (),
) -> dict[str, Any]:
    """One catch-up scenario in a fresh database: ``rounds`` interleaved runs of every program.

    ``peer``: mq-bridge's runtime to run it too, the reason it is skipped, or None (not part of
    this scenario). ``baselines``: other checkouts of the relay (an older commit, a compiled build),
    each run as one more program, so a change's before and after come from the same run.
    ``floor``: the bare producer runs too, and each round times the import floor.
    ``variants``: names in :data:`VARIANTS`, the relay with those settings, one more program each.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    peer_names = [f"{peer_module.NAME} {variant}" for variant in peer_module.VARIANTS]
    trees = {baseline_label(tree): tree for tree in baselines}
    if len(trees) != len(baselines):
        raise ValueError("two baselines with the same commit and build")
    programs = [
        RECVLOGICAL,
        RELAY,
        *variants,
        *([BARE] if floor else []),
        *trees,
        *(peer_names if isinstance(peer, PeerRuntime) else []),
    ]
    measured: dict[str, list[dict[str, Any]]] = {program: [] for program in programs}
    throughputs: dict[str, list[dict[str, list[Any]]]] = {program: [] for program in programs}
    settings: dict[str, Any] = {}
    failed: dict[str, str] = {}
    orders: list[list[str]] = []
    import_floor: list[float] = []
    postmaster = postmaster_pid(server)
    url = server.create_database(name)
    try:
        create_outbox(url, plugin)  # the template slot: nothing ever reads it
        inside_last, wal_bytes, write_s = write_backlog(url, rows, per_txn)
        with psycopg.connect(url, autocommit=True) as conn:
            end = current_lsn(conn)

        def run_one(program: str, slot: str) -> dict[str, Any]:
            if program == RECVLOGICAL:
                return time_recvlogical(url, slot, end, plugin, postmaster=postmaster)
            with LocalBroker() as broker:
                pids = {"postmaster": postmaster, "broker": broker.pid or 0}
                if program == BARE:
                    broker.create_topic(TOPIC, partitions=TOPIC_PARTITIONS)
                    return time_bare(broker.bootstrap_servers, rows, **pids)
                if program == RELAY or program in trees or program in variants:
                    broker.create_topic(TOPIC, partitions=TOPIC_PARTITIONS)
                    tree = trees.get(program, REPO)
                    settings = {**(relay_settings or {}), **VARIANTS.get(program, {})}
                    return time_relay(
                        url, broker.bootstrap_servers, slot=slot, rows=rows,
                        inside_last=inside_last, plugin=plugin, relay_settings=settings,
                        tree=tree, **pids,
                    )  # fmt: skip
                assert isinstance(peer, PeerRuntime)
                broker.create_topic(PEER_TOPIC, partitions=TOPIC_PARTITIONS)
                variant = list(peer_module.VARIANTS)[peer_names.index(program)]
                return time_peer(
                    peer, url, broker.bootstrap_servers, slot=slot, rows=rows, variant=variant,
                    **pids,
                )  # fmt: skip

        for number in range(rounds):
            shift = number % len(programs)
            order = [p for p in programs[shift:] + programs[:shift] if p not in failed]
            orders.append(order)
            if floor:
                import_floor.append(import_floor_seconds(IMPORT_FLOOR_LAUNCHES))
            for program in order:
                if program == BARE:  # reads no slot
                    measurement = run_one(program, "")
                    throughputs[program].append({})
                    measured[program].append(_summary(rows, measurement) | {"round": number + 1})
                    continue
                slot = copy_slot(url, f"bench_{programs.index(program)}_r{number}")
                try:
                    measurement = run_one(program, slot)
                except Exception as exc:
                    if program in (RECVLOGICAL, RELAY) or program in trees or program in variants:
                        raise
                    failed[program] = f"{type(exc).__name__}: {exc}"[:2000]
                    continue
                finally:
                    drop_slot(url, slot)
                throughputs[program].append(measurement.pop("throughput", {}))
                settings[program] = measurement.pop("settings", None)
                measured[program].append(_summary(rows, measurement) | {"round": number + 1})
    finally:
        server.drop_database(name)

    base = measured[RECVLOGICAL]
    relay_runs = measured[RELAY]
    for run in (run for program in (RELAY, *variants) for run in measured[program]):
        if min(run["published"], run["on_broker"]) < rows:
            raise RuntimeError(
                f"slot confirmed but only {run['published']} of {rows} published and "
                f"{run['on_broker']} on the broker"
            )
    relay = _median(relay_runs)
    relay["settings"] = settings[RELAY]
    result: dict[str, Any] = {
        "kind": "catchup",
        "plugin": plugin,
        "rows": rows,
        "rows_per_txn": per_txn,
        "transactions": rows // per_txn,
        "backlog_write_s": round(write_s, 3),
        "wal_mb": round(wal_bytes / 1024 / 1024, 1),
        "rounds": rounds,
        "order": orders,
        "pg_recvlogical": _median(base),
        "relay": relay,
        **_ratios(base, relay_runs),
        "throughput": throughputs[RELAY][_median_index(relay_runs)],
        "per_round": {program: runs for program, runs in measured.items()},
    }
    if floor:
        bare = measured[BARE]
        for run in bare:
            if run["on_broker"] < rows:
                raise RuntimeError(f"the bare producer got {run['on_broker']} of {rows} records in")
        others = [
            run["cpu_during_run"]["percent_of_a_core"]["other"]
            for runs in measured.values()
            for run in runs
            if "cpu_during_run" in run
        ]
        result["floor"] = floor_summary(
            _median(base), _median(bare) | _ratios(base, bare), import_floor, relay
        )
        result["floor"]["budget"] = item2_budget(
            _median(base), result["floor"]["bare_producer"], relay,
            cores=os.cpu_count() or 1, other_percent=statistics.median(others),
        )  # fmt: skip
    if variants:
        result["variants"] = {
            name: _median(measured[name])
            | _ratios(base, measured[name])
            | {"vs_relay": _ratios(relay_runs, measured[name])["ratio"], "settings": settings[name]}
            for name in variants
        }
    if trees:
        result["baselines"] = {
            name: _median(measured[name]) | _ratios(base, measured[name]) | {"tree": str(tree)}
            for name, tree in trees.items()
        }
    if peer is not None:
        peers: dict[str, Any] = {}
        for program in peer_names:
            if isinstance(peer, str):
                peers[program] = {"skipped": peer}
            elif program in failed:
                peers[program] = {"failed": failed[program]}
            else:
                runs = measured[program]
                rounds_of = [run["round"] - 1 for run in runs]
                peers[program] = (
                    _median(runs)
                    | _ratios([base[i] for i in rounds_of], runs)
                    | {
                        "python": peer.base_version,
                        "settings": settings[program],
                        "throughput": throughputs[program][_median_index(runs)],
                    }
                )
        result["peers"] = peers
    return result


def floor_summary(
    recvlogical: dict[str, Any],
    bare: dict[str, Any],
    import_floor: list[float],
    relay: dict[str, Any],
) -> dict[str, Any]:
    """The floor of this scenario: the server's decoding as its client pays it plus the bare
    producer, per row; the import floor; and the relay against both."""
    cpu = recvlogical["cpu_us_per_event"] + bare["cpu_us_per_event"]
    after = recvlogical["cpu_us_per_event"] + bare["cpu_us_per_event_after_startup"]
    imports = statistics.median(import_floor)
    out: dict[str, Any] = {
        "bare_producer": bare,
        "cpu_us_per_event": round(cpu, 2),
        "cpu_us_per_event_after_startup": round(after, 2),
        "relay_cpu_over_floor": round(relay["cpu_us_per_event"] / cpu, 2),
        "import_floor_s": round(imports, 3),
        "import_floor_launches": [round(s, 3) for s in import_floor],
    }
    sent = relay.get("start_replication_s")
    if sent is not None:
        out["relay_start_replication_over_import_floor_s"] = round(sent - imports, 3)
    return out


def _cpu_per_row(
    server_run: dict[str, Any], producer_run: dict[str, Any], producer: str, bench: str
) -> dict[str, float]:
    """CPU µs per row by who spent it: the server in ``server_run``; the broker, the bench and,
    after its start-up, the producing process (called ``producer``) in ``producer_run``."""
    server = server_run["cpu_during_run"]["us_per_row"]
    kafka = producer_run["cpu_during_run"]["us_per_row"]
    return {
        "server": server["server"],
        "broker": kafka["broker"],
        producer: producer_run["cpu_us_per_event_after_startup"],
        bench: kafka["bench"],
    }


def item2_budget(
    recvlogical: dict[str, Any],
    bare: dict[str, Any],
    relay: dict[str, Any],
    *,
    cores: int,
    other_percent: float,
    ratio: float = RATIO_AFTER_STARTUP_MIN,
) -> dict[str, Any]:
    """Whether this machine's cores can run the floor at ``ratio`` times pg_recvlogical's rate.

    At that rate, every row costs the server's CPU (pg_recvlogical's run: the walsender's
    decoding, the cluster's background), the broker's and the bench's counter's (the bare
    producer's run: records in, counted) and the bare producer's own (after its start-up), all
    measured in this run; the cores they need are the rate times their sum, against the
    machine's cores, and against what the other processes on the machine left of them in this
    run (the median of ``other_percent`` over every run).
    """
    per_row = _cpu_per_row(recvlogical, bare, "bare producer", "bench (broker counter)")
    floor_us = max(sum(per_row.values()), 0.01)  # 10 ms ticks: a tiny run may count none
    target = ratio * recvlogical["rows_per_s"]
    available = max(cores - other_percent / 100, 0.0)
    # The relay's own run the same way.
    relay_parts = _cpu_per_row(relay, relay, "relay", "bench")
    relay_sum = sum(relay_parts.values())
    return {
        "ratio": ratio,
        "target_rows_per_s": round(target),
        "floor_us_per_row": {key: round(value, 2) for key, value in per_row.items()},
        "walsender_us_per_row": recvlogical["cpu_during_run"]["us_per_row"]["walsender"],
        "floor_us_per_row_sum": round(floor_us, 2),
        "cores_needed": round(target * floor_us / 1e6, 2),
        "cores": cores,
        "reachable": target * floor_us / 1e6 <= cores,
        # The floor's rate with every core its own, and per row at the target rate what the
        # relay may spend beyond the bare producer.
        "floor_max_rows_per_s": round(cores * 1e6 / floor_us),
        "floor_max_ratio": round(cores * 1e6 / floor_us / recvlogical["rows_per_s"], 3),
        "left_for_the_relay_us_per_row": round(cores * 1e6 / target - floor_us, 2),
        # The same on what the other processes left of the cores in this run.
        "other_processes_cores": round(other_percent / 100, 2),
        "reachable_on_what_others_left": target * floor_us / 1e6 <= available,
        "floor_max_ratio_on_what_others_left": round(
            available * 1e6 / floor_us / recvlogical["rows_per_s"], 3
        ),
        "relay_run_us_per_row": {key: round(value, 2) for key, value in relay_parts.items()},
        "relay_run_us_per_row_sum": round(relay_sum, 2),
        "relay_run_cores_needed": round(target * relay_sum / 1e6, 2),
        "relay_over_bare_producer_us_per_row": round(
            relay["cpu_us_per_event_after_startup"] - bare["cpu_us_per_event_after_startup"], 2
        ),
    }


def run(
    rows: int, per_txn: int, plugin: str = "pgoutput", rounds: int = 1, peer: bool = True
) -> dict[str, Any]:
    """A throw-away cluster and one catch-up measurement, as a flat dict (``bench.catchup`` CLI)."""
    runtime = peer_module.prepare() if peer else None
    with LocalPostgres() as server:
        machine = machine_facts(server.url())
        result = catchup_scenario(
            server, "bench_catchup", rows, per_txn, plugin, rounds=rounds, peer=runtime
        )
    flat: dict[str, Any] = {
        "plugin": plugin,
        "rows": rows,
        "rows_per_txn": per_txn,
        "rounds": rounds,
        "machine": f"{machine['cpu_model']}, {machine['cores']} cores, "
        f"Python {machine['python']}, PostgreSQL {machine['postgresql']}",
        "pg_recvlogical_s": result["pg_recvlogical"]["seconds"],
        "pg_recvlogical_rows_per_s": result["pg_recvlogical"]["rows_per_s"],
        "pg_recvlogical_cpu_us_per_event": result["pg_recvlogical"]["cpu_us_per_event"],
        "relay_s": result["relay"]["seconds"],
        "relay_rows_per_s": result["relay"]["rows_per_s"],
        "relay_startup_s": result["relay"]["startup_s"],
        "relay_start_replication_s": result["relay"].get("start_replication_s"),
        "relay_rows_per_s_after_startup": result["relay"]["rows_per_s_after_startup"],
        "relay_cpu_us_per_event": result["relay"]["cpu_us_per_event"],
        "relay_peak_rss_mb": result["relay"]["peak_rss_mb"],
        "ratio_relay_to_pg_recvlogical": result["ratio"],
        "ratio_after_relay_startup": result["ratio_after_startup"],
    }
    for name, measured in result.get("peers", {}).items():
        key = name.replace(" ", "_")
        if "seconds" not in measured:
            flat[key] = measured
            continue
        for field in ("rows_per_s", "ratio", "cpu_us_per_event", "startup_s"):
            flat[f"{key}_{field}"] = measured[field]
    return flat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--per-txn", type=int, default=10)
    parser.add_argument("--plugin", choices=("pgoutput", "wal2json"), default="pgoutput")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds, medians")
    parser.add_argument("--no-peer", action="store_true", help="leave mq-bridge out")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()
    result = run(args.rows, args.per_txn, args.plugin, args.rounds, not args.no_peer)
    width = max(len(k) for k in result)
    for key, value in result.items():
        print(f"{key:<{width}}  {value}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
