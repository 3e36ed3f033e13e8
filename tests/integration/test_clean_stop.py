"""A clean stop (SIGTERM) re-sends nothing: the relay reads on to the end of the transaction it is
in, drains, confirms, and the next start begins after everything Kafka has — tried 25 times while
writers commit multi-row transactions."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import psycopg
import pytest

from tests.conftest import KafkaBroker
from tests.integration.relay_support import (
    RelayProcess,
    create_outbox,
    insert_events,
    log_field,
    new_event,
    relay_env,
)
from tests.kafka_helpers import Reader

pytestmark = pytest.mark.integration

STOPS = 25
# Beyond STOPS only until one stop found a transaction open (a faster start catches up sooner).
MAX_STOPS = 75
ROWS_PER_TRANSACTION = 25
PARTITIONS = 3


class _Writers:
    """Two writers committing multi-row transactions until stopped; remembers what committed."""

    def __init__(self, database: str) -> None:
        self.database = database
        self.committed: list[str] = []
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._write, args=(n,), daemon=True) for n in range(2)
        ]

    def _write(self, writer: int) -> None:
        try:
            with psycopg.connect(self.database) as conn:
                while not self._stop.is_set():
                    events = [
                        new_event("order", f"w{writer}-{i % 5}", "created", {"i": i})
                        for i in range(ROWS_PER_TRANSACTION)
                    ]
                    with conn.transaction():
                        insert_events(conn, events)
                    with self._lock:
                        self.committed.extend(e.id for e in events)
                    time.sleep(0.04)
        except BaseException as exc:  # reported by the test
            self.errors.append(exc)

    def __enter__(self) -> _Writers:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)


class _Reader:
    """Everything the topic holds, read incrementally, counted by event id."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.ids: Counter[str] = Counter()
        self._reader = Reader(bootstrap, topic)

    def read(self, quiet: float = 0.5, timeout: float = 30.0) -> None:
        """Read until nothing arrived for ``quiet`` seconds."""
        deadline = time.monotonic() + timeout
        last = time.monotonic()
        while time.monotonic() - last < quiet and time.monotonic() < deadline:
            if self._poll():
                last = time.monotonic()

    def read_count(self, total: int, timeout: float = 30.0) -> None:
        """Read until ``total`` records arrived in all: no quiet period to wait out."""
        deadline = time.monotonic() + timeout
        while self.ids.total() < total and time.monotonic() < deadline:
            self._poll()
        assert self.ids.total() >= total, (
            f"Kafka holds {self.ids.total()} records, the relay runs acknowledged {total}"
        )

    def _poll(self) -> int:
        """One batch (up to 0.1 s); how many records it brought."""
        records = self._reader.poll(0.1)
        for record in records:
            event_id = record.header("id")
            assert event_id is not None
            self.ids[event_id.decode()] += 1
        return len(records)

    def duplicates(self) -> list[str]:
        return [event_id for event_id, n in self.ids.items() if n > 1]

    def close(self) -> None:
        self._reader.close()


def test_sigterm_under_load_resends_nothing_and_loses_nothing(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    create_outbox(database)
    topic = f"{unique}.order"
    broker.create_topic(topic, partitions=PARTITIONS)
    env = relay_env(
        database,
        broker.bootstrap_servers,
        unique,
        confirm_interval="0.05",
        shutdown_timeout="10",
        read_coalesce_ms="0",
    )
    reader = _Reader(broker.bootstrap_servers, topic)
    rng = random.Random(11)
    mid_transaction_stops = 0
    acknowledged = 0  # records the relay runs logged as published, in all
    # The slot first: what is committed before it exists is not in its stream.
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        assert relay.stop() == 0, relay.logs()
    finally:
        relay.close()
    try:
        with _Writers(database) as writers:
            stop = 0
            while stop < STOPS or (mid_transaction_stops == 0 and stop < MAX_STOPS):
                relay = RelayProcess(env).start()
                try:
                    relay.wait_streaming()
                    # Soon after the start the relay is catching up on what was written while
                    # it was down: a stop then most likely finds a transaction half read.
                    time.sleep(rng.uniform(0.0, 0.3))
                    code = relay.stop(timeout=30)
                finally:
                    relay.close()
                logs = relay.logs()
                assert code == 0, logs
                mid_transaction_stops += "reading on to the end of the transaction" in logs
                # Stopped cleanly, the run has drained: what it logs as published (acknowledged
                # by Kafka, re-sends included) is all it wrote, so read exactly that much.
                acknowledged += int(log_field(logs, "session: stopped", "published") or "-1")
                reader.read_count(acknowledged)
                assert not reader.duplicates(), (
                    f"stop {stop + 1}: {len(reader.duplicates())} event(s) sent twice\n{logs}"
                )
                stop += 1
            assert not writers.errors, writers.errors
        # Writers stopped: one more run relays the rest, then everything must be there once.
        committed = list(writers.committed)
        relay = RelayProcess(env).start()
        try:
            relay.wait_streaming()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and len(reader.ids) < len(committed):
                reader.read(quiet=0.3)
            code = relay.stop(timeout=30)
        finally:
            relay.close()
        assert code == 0, relay.logs()
        reader.read(quiet=1.0)
    finally:
        reader.close()
    assert not reader.duplicates(), f"{len(reader.duplicates())} event(s) sent twice"
    missing = set(committed) - set(reader.ids)
    assert not missing, f"{len(missing)} of {len(committed)} committed events lost"
    assert len(committed) > STOPS * ROWS_PER_TRANSACTION
    assert mid_transaction_stops > 0, "no stop found a transaction open: the test proved nothing"
    print(
        f"\n{stop} stops, {len(committed)} events, {mid_transaction_stops} stops inside a "
        "transaction"
    )
