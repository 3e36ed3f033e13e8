"""Running the real relay (``python -m cdc_relay``) as a child process, and writing outbox rows.

Tests drive the relay the way an operator does: environment variables, signals, exit codes, log
lines. The database side is plain psycopg.
"""

from __future__ import annotations

import os
import re
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import psycopg

from cdc_relay.config import Settings, load_settings
from cdc_relay.local.relay_process import RelayProcess as BaseRelayProcess
from cdc_relay.lsn import parse_lsn

REPO = Path(__file__).resolve().parents[2]
OUTBOX_DDL = (REPO / "sql" / "001_outbox.sql").read_text()


class RelayProcess(BaseRelayProcess):
    """A relay child for a test: the test's environment plus the settings it passes."""

    def __init__(self, env: dict[str, str], args: Sequence[str] = ()) -> None:
        super().__init__({**os.environ, **env}, args)

    def wait_for_log(self, text: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.logs():
                return
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"relay exited ({self.proc.returncode}):\n{self.logs()}")
            time.sleep(0.05)
        raise AssertionError(f"{text!r} not logged within {timeout}s:\n{self.logs()}")

    def wait_streaming(self, timeout: float = 30.0) -> RelayProcess:
        self.wait_for_log("streaming", timeout)
        return self


def relay_env(database_url: str, bootstrap: str, unique: str, **extra: str) -> dict[str, str]:
    """Settings isolating one test: its own slot, publication and topic prefix."""
    env = {
        "CDC_RELAY_DATABASE_URL": database_url,
        "CDC_RELAY_KAFKA_BOOTSTRAP_SERVERS": bootstrap,
        "CDC_RELAY_SLOT_NAME": f"slot_{unique}",
        "CDC_RELAY_PUBLICATION_NAME": f"pub_{unique}",
        "CDC_RELAY_TOPIC_TEMPLATE": f"{unique}.{{aggregate_type}}",
        "CDC_RELAY_DEAD_LETTER_TOPIC": f"{unique}.dead_letter",
        "CDC_RELAY_LOG_LEVEL": "DEBUG",
        "CDC_RELAY_HTTP_PORT": "0",  # tests that need the HTTP server pass a free port
        # Tests read the outbox table as ground truth; the sweeper's own tests turn it on.
        "CDC_RELAY_SWEEP_INTERVAL": "0",
    }
    env.update({f"CDC_RELAY_{k.upper()}": v for k, v in extra.items()})
    return env


def relay_settings(env: dict[str, str], **overrides: object) -> Settings:
    """The settings of a relay run with ``env`` (its slot, publication, state schema), with
    ``overrides``: for the parts of it a test runs in its own process (a sweeper)."""
    values: dict[str, Any] = {
        key.removeprefix("CDC_RELAY_").lower(): value
        for key, value in env.items()
        if key.startswith("CDC_RELAY_")
    }
    return load_settings(**{**values, **overrides})


@contextmanager
def streaming_relay(env: dict[str, str]) -> Iterator[RelayProcess]:
    """A relay run with ``env``, streaming for the ``with`` block, ended after it."""
    relay = RelayProcess(env).start()
    try:
        yield relay.wait_streaming()
    finally:
        relay.close()


def trust_messages(database_url: str) -> dict[str, str]:
    """Table-less messages on, as an operator makes them a trusted path: PUBLIC may no longer
    execute pg_logical_emit_message (tests emit as the superuser). Returns the relay's setting."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        for (emit,) in conn.execute(
            "SELECT oid::regprocedure::text FROM pg_proc WHERE proname = 'pg_logical_emit_message'"
        ).fetchall():
            conn.execute(f"REVOKE EXECUTE ON FUNCTION {emit} FROM PUBLIC".encode())
    return {"CDC_RELAY_MESSAGES": "true"}


def create_outbox(database_url: str) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(OUTBOX_DDL.encode())  # a trusted file of our own


@dataclass(frozen=True)
class Event:
    id: str
    aggregate_type: str
    aggregate_id: str
    event_type: str
    payload: dict[str, object]
    headers: dict[str, object] | None = None


def new_event(
    aggregate_type: str = "order",
    aggregate_id: str = "a-1",
    event_type: str = "created",
    payload: dict[str, object] | None = None,
    headers: dict[str, object] | None = None,
) -> Event:
    return Event(
        str(uuid.uuid4()), aggregate_type, aggregate_id, event_type, payload or {}, headers
    )


INSERT_SQL = (
    "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, headers) "
    "VALUES (%s, %s, %s, %s, %s::jsonb, %s::jsonb)"
)


def insert_events(conn: psycopg.Connection[tuple[object, ...]], events: Sequence[Event]) -> None:
    """Insert in the caller's transaction, in order."""
    with conn.cursor() as cur:
        cur.executemany(
            INSERT_SQL,
            [
                (
                    e.id,
                    e.aggregate_type,
                    e.aggregate_id,
                    e.event_type,
                    orjson.dumps(e.payload).decode(),
                    orjson.dumps(e.headers).decode() if e.headers is not None else None,
                )
                for e in events
            ],
        )


def event_ids(*groups: Sequence[Event]) -> set[str]:
    """The ids of the events of every group."""
    return {e.id for group in groups for e in group}


def write_transactions(
    database_url: str, batches: Sequence[Sequence[Event]], between: Callable[[], None] | None = None
) -> None:
    """Commit each batch as its own transaction."""
    with psycopg.connect(database_url) as conn:
        for batch in batches:
            with conn.transaction():
                insert_events(conn, batch)
            if between is not None:
                between()


def scalar(database_url: str, query: str, *params: object) -> object:
    with psycopg.connect(database_url, autocommit=True) as conn:
        row = conn.execute(query.encode(), params or None).fetchone()
        return row[0] if row else None


def slot_confirmed_lsn(database_url: str, slot: str) -> int:
    text = scalar(
        database_url,
        "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
        slot,
    )
    assert text is not None, f"slot {slot} missing"
    return parse_lsn(str(text))


def log_field(logs: str, message: str, name: str) -> str | None:
    """A field of the last log line holding ``message`` (plain or JSON log format)."""
    lines = [line for line in logs.splitlines() if message in line]
    if not lines:
        return None
    match = re.search(rf'"?{name}"?[=:]\s*"?([^\s",}}]+)', lines[-1])
    return match.group(1) if match else None


def wait_until(predicate: Callable[[], bool], timeout: float, message: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s: {message}")


def http_get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return int(response.status), bytes(response.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), bytes(exc.read())


class PositionSampler:
    """(the position record, the slot's confirmed_flush), sampled every 50 ms until closed.

    Two statements, the slot first: a single SELECT reads the record in the snapshot taken at its
    start but ``pg_replication_slots`` live, later, so a record committed and confirmed in between
    would show the slot ahead of a record that was not. Read in this order, a slot position was
    confirmed only after a record at least as far committed, which the second statement sees.
    """

    def __init__(self, url: str, slot: str) -> None:
        self.samples: list[tuple[int, int]] = []
        self._url = url
        self._slot = slot
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def _run(self) -> None:
        with psycopg.connect(self._url, autocommit=True) as conn:
            while not self._stop.is_set():
                flushed = conn.execute(
                    "SELECT confirmed_flush_lsn::text FROM pg_replication_slots "
                    "WHERE slot_name = %s",
                    (self._slot,),
                ).fetchone()
                recorded = conn.execute(
                    "SELECT confirmed_lsn::text FROM cdc_relay.slot_position WHERE slot_name = %s",
                    (self._slot,),
                ).fetchone()
                if flushed and recorded and flushed[0] is not None:
                    self.samples.append((parse_lsn(str(recorded[0])), parse_lsn(str(flushed[0]))))
                time.sleep(0.05)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def check(self) -> None:
        records = [r for r, _ in self.samples]
        flushes = [f for _, f in self.samples]
        assert records, "no position was ever sampled"
        assert records == sorted(records), "the recorded position went backwards"
        assert flushes == sorted(flushes), "the slot's confirmed position went backwards"
        assert all(f <= r for r, f in self.samples), "the slot got ahead of the record"
