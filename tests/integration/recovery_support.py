"""What the slot-recovery tests share: losing the slot as a DBA or the server would, running
``cdc-relay recover``, and judging what reached Kafka (every committed event once, each
aggregate's first occurrences in commit order)."""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import orjson
import psycopg

from cdc_relay.local.relay_process import peak_rss_mb
from cdc_relay.reconcile import POSITION_HEADER
from tests.integration.relay_support import (
    RelayProcess,
    insert_events,
    new_event,
    scalar,
    wait_until,
    write_transactions,
)
from tests.integration.test_relay_faults import _BackgroundWriter
from tests.kafka_helpers import Record, consume_all


def drop_slot(database: str, slot: str, timeout: float = 30.0) -> None:
    """Drop ``slot`` as a DBA would, its walsender ended first (it may be reconnecting)."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(database, autocommit=True) as conn:
        while True:
            row = conn.execute(
                "SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", (slot,)
            ).fetchone()
            if row is None:
                return
            if row[0] is not None:
                conn.execute("SELECT pg_terminate_backend(%s)", (row[0],))
            try:
                conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
                return
            except psycopg.errors.ObjectInUse:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


def recovery_state(database: str, slot: str) -> dict[str, object]:
    value = scalar(
        database, "SELECT recovery::text FROM cdc_relay.slot_position WHERE slot_name = %s", slot
    )
    return {} if value is None else dict(orjson.loads(str(value)))


def proven_below(database: str, slot: str) -> int:
    """The transaction id below which the record proves rows published (its horizon's snapshot's
    xmin; its boundary's when it proves nothing yet)."""
    value = scalar(
        database,
        "SELECT recovery_horizon->>'snapshot' FROM cdc_relay.slot_position WHERE slot_name = %s",
        slot,
    )
    return int(str(value).split(":")[0]) if value else 0


def wait_for_horizon(database: str, slot: str, beyond: int, timeout: float = 30.0) -> int:
    """Until the record proves rows of transactions up to ``beyond`` published."""
    deadline = time.monotonic() + timeout
    while (found := proven_below(database, slot)) <= beyond:
        assert time.monotonic() < deadline, f"the horizon stayed at {found}"
        time.sleep(0.1)
    return found


def current_xid(database: str) -> int:
    return int(str(scalar(database, "SELECT pg_snapshot_xmax(pg_current_snapshot())::text")))


@dataclass
class Run:
    """A finished ``cdc-relay recover``: its exit code, log, seconds and peak memory."""

    code: int
    logs: str
    seconds: float
    peak_rss_mb: float


def run_recover(env: dict[str, str], timeout: float = 300.0) -> Run:
    """``cdc-relay recover`` as an operator runs it, to its end; its peak RSS sampled."""
    process = RelayProcess(env, ["recover"]).start()
    peak = [0.0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            try:
                peak[0] = max(peak[0], peak_rss_mb(process.pid))
            except (FileNotFoundError, ProcessLookupError):
                return
            done.wait(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    started = time.monotonic()
    try:
        code = process.wait(timeout)
        return Run(code, process.logs(), time.monotonic() - started, peak[0])
    finally:
        done.set()
        sampler.join()
        process.close()


def event_ids(records: Iterable[Record]) -> list[str]:
    return [(r.header("id") or r.header("cdc_relay.event_id") or b"").decode() for r in records]


def consume_covering(
    bootstrap: str, topics: Sequence[str], ids: set[str], timeout: float, **options: object
) -> list[Record]:
    """Everything in ``topics`` once every one of ``ids`` arrived (or at the timeout), with a
    grace period so that late duplicates show too."""
    deadline = time.monotonic() + timeout
    while True:
        records = consume_all(bootstrap, list(topics), len(ids), 30, grace=2.0, **options)  # type: ignore[arg-type]
        if ids <= set(event_ids(records)) or time.monotonic() > deadline:
            return records
        time.sleep(1.0)


@dataclass
class Verdict:
    """What reached Kafka against what was committed."""

    committed: int
    missing: set[str]
    duplicates: int
    position_duplicates: int
    out_of_order: int  # aggregates whose first occurrences are not in commit order

    def check(self, what: str, logs: str = "") -> None:
        """Print the figures; every event once, each aggregate's first occurrences in order."""
        print(
            f"\n{what}: {self.committed} events, {len(self.missing)} lost, {self.duplicates} "
            f"duplicates, {self.out_of_order} aggregates out of order"
        )
        assert not self.missing, logs
        assert self.duplicates == 0, logs
        assert self.position_duplicates == 0, logs
        assert self.out_of_order == 0, logs


def judge(records: Sequence[Record], committed: Sequence[str]) -> Verdict:
    """``committed``: event ids in commit order. First occurrences of each aggregate's events
    (by the record's key) must come in that order (Kafka keeps order per partition, and a key's
    records share one)."""
    ids = event_ids(records)
    counts = Counter(ids)
    order = {event_id: index for index, event_id in enumerate(committed)}
    seen: set[str] = set()
    by_aggregate: dict[bytes, list[int]] = {}
    for record in records:
        event_id = (record.header("id") or b"").decode()
        if event_id in seen or event_id not in order:
            continue
        seen.add(event_id)
        by_aggregate.setdefault(record.key or b"", []).append(order[event_id])
    positions = [r.header(POSITION_HEADER) for r in records]
    return Verdict(
        committed=len(committed),
        missing=set(order) - set(ids),
        duplicates=sum(n - 1 for event_id, n in counts.items() if event_id in order and n > 1),
        position_duplicates=len(positions) - len(set(positions)),
        out_of_order=sum(1 for firsts in by_aggregate.values() if firsts != sorted(firsts)),
    )


def wrote(writer: _BackgroundWriter, more: int) -> None:
    """Until ``writer`` committed ``more`` events after those so far."""
    count = len(writer.committed) + more
    wait_until(lambda: len(writer.committed) >= count, 60, f"the writer's {count} events")


def stream_and_read(
    env: dict[str, str], broker: str, topic: str, committed: Sequence[str]
) -> tuple[list[Record], list[str], str]:
    """A relay started with ``env`` streams; five more events are written; everything read back
    once all arrived. The records, the event ids in commit order, and the relay's log."""
    database = env["CDC_RELAY_DATABASE_URL"]
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming(120)
        after = [new_event(aggregate_id=f"a-{i}", payload={"n": -i}) for i in range(5)]
        write_transactions(database, [after])
        everything = [*committed, *(e.id for e in after)]
        records = consume_covering(broker, [topic], set(everything), 120)
        assert relay.stop() == 0
        return records, everything, relay.logs()
    finally:
        relay.close()


def write_bulk(database: str, events: int, per_txn: int, aggregates: int = 97) -> None:
    """``events`` events in transactions of ``per_txn``, one after another (fast: generated by
    the server)."""
    with psycopg.connect(database, autocommit=True) as conn:
        for first in range(0, events, per_txn):
            conn.execute(
                "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) "
                "SELECT gen_random_uuid(), 'order', 'a-' || (i %% %s::int), 'created', "
                "jsonb_build_object('n', i) FROM generate_series(%s::int, %s::int) i",
                (aggregates, first, min(first + per_txn, events) - 1),
            )


def committed_rows(database: str, where: str = "true") -> list[str]:
    """The outbox rows' event ids (of ``where``, a trusted literal condition), in commit order —
    for a table written by one session, one transaction after another: transaction id, then
    place."""
    with psycopg.connect(database, autocommit=True) as conn:
        rows = conn.execute(
            f"SELECT id::text FROM outbox WHERE {where} ORDER BY xmin::text::int8, ctid".encode()
        ).fetchall()
    return [str(event_id) for (event_id,) in rows]


def write_contended(database: str, writers: int, transactions: int, aggregates: int = 5) -> None:
    """``writers`` sessions commit ``transactions`` transactions each, as an application with an
    aggregate table does: a transaction takes its id first (another write), waits a little,
    locks its aggregate's row, bumps its version and inserts the event (payload ``{"v": version}``)
    — so each aggregate's events commit in version order, while their transaction ids need not
    be in that order."""
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS aggregates (id text PRIMARY KEY, version int)")
        conn.execute("CREATE TABLE IF NOT EXISTS scratch (x int)")
        for i in range(aggregates):
            conn.execute(
                "INSERT INTO aggregates VALUES (%s, 0) ON CONFLICT DO NOTHING", (f"g-{i}",)
            )
    errors: list[str] = []

    def write(seed: int) -> None:
        rng = random.Random(seed)
        try:
            with psycopg.connect(database, autocommit=True) as conn:
                for _ in range(transactions):
                    aggregate = f"g-{rng.randrange(aggregates)}"
                    with conn.transaction():
                        conn.execute("INSERT INTO scratch VALUES (1)")  # the id, taken now
                        time.sleep(rng.random() * 0.004)
                        row = conn.execute(
                            "UPDATE aggregates SET version = version + 1 WHERE id = %s "
                            "RETURNING version",
                            (aggregate,),
                        ).fetchone()
                        assert row is not None
                        insert_events(
                            conn, [new_event(aggregate_id=aggregate, payload={"v": row[0]})]
                        )
        except Exception as exc:
            errors.append(repr(exc))

    threads = [threading.Thread(target=write, args=(seed,)) for seed in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors


def order_inversions(records: Sequence[Record]) -> tuple[int, int]:
    """Over each aggregate's first occurrences in Kafka: (adjacent pairs out of version order,
    adjacent pairs in all)."""
    seen: set[bytes] = set()
    versions: dict[bytes, list[int]] = {}
    for record in records:
        event_id = record.header("id") or b""
        if event_id in seen:
            continue
        seen.add(event_id)
        versions.setdefault(record.key or b"", []).append(
            int(orjson.loads(record.value or b"{}")["v"])
        )
    pairs = inverted = 0
    for found in versions.values():
        for before, after in itertools.pairwise(found):
            pairs += 1
            inverted += before > after
    return inverted, pairs
