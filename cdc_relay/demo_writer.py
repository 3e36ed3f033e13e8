"""Demo writer: orders and their outbox events, one transaction per event, at a steady rate.

``python -m cdc_relay.demo_writer`` is the ``demo-writer`` service of ``docker-compose.yml``;
``python -m cdc_relay demo`` runs the same code in a thread. Each order goes through
``order_created`` -> ``order_paid`` -> ``order_shipped``; a few orders are open at a time, so
events of several aggregates interleave. Every event is one transaction that changes the business
row (table ``demo_orders``) and inserts the outbox row, which is the pattern the relay is for.

Options (each also an environment variable, for containers):

- ``--database-url`` [``DEMO_WRITER_DATABASE_URL``, else ``CDC_RELAY_DATABASE_URL``]
- ``--rate`` events per second [``DEMO_WRITER_RATE``, default 2]
- ``--events`` stop after this many events, 0 = never [``DEMO_WRITER_EVENTS``, default 0]
- ``--wait-for-slot`` replication slot to wait for before writing [``DEMO_WRITER_WAIT_FOR_SLOT``]:
  rows committed before the relay created its slot are never relayed.
"""

from __future__ import annotations

import argparse
import os
import random
import secrets
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import FrameType

import orjson
import psycopg

AGGREGATE_TYPE = "order"
LIFECYCLE = ("order_created", "order_paid", "order_shipped")
CUSTOMERS = ("ada", "grace", "linus", "barbara", "ken", "margaret", "edsger", "frances")
OPEN_ORDERS = 4  # orders in flight at once: their events interleave

ORDERS_DDL = """
CREATE TABLE IF NOT EXISTS public.demo_orders (
    id         text          PRIMARY KEY,
    customer   text          NOT NULL,
    amount     numeric(10,2) NOT NULL,
    status     text          NOT NULL,
    updated_at timestamptz   NOT NULL DEFAULT now()
)
"""
_UPSERT_ORDER = (
    "INSERT INTO public.demo_orders (id, customer, amount, status) VALUES (%s, %s, %s, %s) "
    "ON CONFLICT (id) DO UPDATE SET status = EXCLUDED.status, updated_at = now()"
)
_UPDATE_ORDER = "UPDATE public.demo_orders SET status = %s, updated_at = now() WHERE id = %s"
_INSERT_OUTBOX = (
    "INSERT INTO public.outbox (id, aggregate_type, aggregate_id, event_type, payload, headers) "
    "VALUES (%s, %s, %s, %s, %s::jsonb, %s::jsonb)"
)
_SLOT_EXISTS = "SELECT 1 FROM pg_replication_slots WHERE slot_name = %s"


@dataclass(frozen=True)
class OrderEvent:
    """One step of one order's lifecycle."""

    order_id: str
    event_type: str
    customer: str
    amount: str  # decimal text, e.g. "42.50"

    @property
    def status(self) -> str:
        return self.event_type.removeprefix("order_")

    def payload(self) -> dict[str, object]:
        data: dict[str, object] = {"order_id": self.order_id, "status": self.status}
        if self.event_type == "order_created":
            data.update(customer=self.customer, amount=self.amount, currency="EUR")
        return data


def order_events(seed: int | None = None) -> Iterator[OrderEvent]:
    """An endless stream of order events; :data:`OPEN_ORDERS` orders progress side by side.

    Order ids carry a random run prefix, so a restarted writer starts new orders (should a
    prefix repeat, the business row is upserted). ``seed`` makes the stream reproducible.
    """
    rng = random.Random(seed)  # noqa: S311 - sample data, not secrets
    run = f"{rng.getrandbits(16):04x}" if seed is not None else secrets.token_hex(2)
    numbers = iter(range(1, sys.maxsize))

    def new_order() -> list[OrderEvent]:
        order_id = f"order-{run}-{next(numbers):04d}"
        customer = rng.choice(CUSTOMERS)
        amount = f"{rng.randint(500, 25_000) / 100:.2f}"
        return [OrderEvent(order_id, step, customer, amount) for step in LIFECYCLE]

    open_orders = [new_order() for _ in range(OPEN_ORDERS)]
    while True:
        index = rng.randrange(len(open_orders))
        yield open_orders[index].pop(0)
        if not open_orders[index]:
            open_orders[index] = new_order()


def prepare(conn: psycopg.Connection[tuple[object, ...]]) -> None:
    """Create the demo's business table (the outbox table is ``sql/001_outbox.sql``'s job)."""
    with conn.transaction():
        conn.execute(ORDERS_DDL)


def write_event(conn: psycopg.Connection[tuple[object, ...]], event: OrderEvent) -> None:
    """The business change and its outbox row, in one transaction."""
    with conn.transaction():
        if event.event_type == "order_created":
            conn.execute(_UPSERT_ORDER, (event.order_id, event.customer, event.amount, "created"))
        else:
            conn.execute(_UPDATE_ORDER, (event.status, event.order_id))
        conn.execute(
            _INSERT_OUTBOX,
            (
                uuid.uuid4(),
                AGGREGATE_TYPE,
                event.order_id,
                event.event_type,
                orjson.dumps(event.payload()).decode(),
                orjson.dumps({"source": "cdc-relay-demo"}).decode(),
            ),
        )


def wait_for_slot(
    database_url: str,
    slot: str,
    stop: threading.Event,
    *,
    timeout: float,
    on_wait: Callable[[], None] | None = None,
) -> bool:
    """Wait until replication slot ``slot`` exists (an unreachable database counts as "not yet").

    ``on_wait`` is called once if the slot is not there at the first look. Returns False when
    ``stop`` was set first; raises TimeoutError after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    waited = False
    while not stop.is_set():
        try:
            with psycopg.connect(database_url, autocommit=True, connect_timeout=5) as conn:
                if conn.execute(_SLOT_EXISTS, (slot,)).fetchone() is not None:
                    return True
        except psycopg.OperationalError:
            pass  # not up yet; the deadline bounds the wait
        if not waited and on_wait is not None:
            on_wait()
        waited = True
        if time.monotonic() > deadline:
            raise TimeoutError(f"replication slot {slot!r} did not appear within {timeout:.0f}s")
        stop.wait(0.2)
    return False


def run_writer(
    database_url: str,
    rate: float,
    events: int | None,
    stop: threading.Event,
    *,
    on_event: Callable[[OrderEvent], None] | None = None,
    seed: int | None = None,
) -> int:
    """Write ``events`` events (None: until ``stop``) at ``rate`` per second; return the count."""
    interval = 1.0 / rate
    written = 0
    with psycopg.connect(database_url) as conn:
        prepare(conn)
        next_at = time.monotonic()
        for event in order_events(seed):
            if stop.is_set() or (events is not None and written >= events):
                break
            write_event(conn, event)
            written += 1
            if on_event is not None:
                on_event(event)
            next_at += interval
            delay = next_at - time.monotonic()
            if delay > 0:
                stop.wait(delay)
            else:
                next_at = time.monotonic()  # fell behind: do not burst to catch up
    return written


# ------------------------------------------------------------------------------------------------
# command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m cdc_relay.demo_writer",
        description="Write demo orders and their outbox events, one transaction per event.",
    )
    parser.add_argument(
        "--database-url",
        default=os.environ.get("DEMO_WRITER_DATABASE_URL")
        or os.environ.get("CDC_RELAY_DATABASE_URL"),
        help="libpq URI [DEMO_WRITER_DATABASE_URL, else CDC_RELAY_DATABASE_URL]",
    )
    parser.add_argument(
        "--rate",
        type=float,
        default=os.environ.get("DEMO_WRITER_RATE") or "2",
        help="events (transactions) per second [DEMO_WRITER_RATE, default 2]",
    )
    parser.add_argument(
        "--events",
        type=int,
        default=os.environ.get("DEMO_WRITER_EVENTS") or "0",
        help="stop after this many events; 0 = run until stopped [DEMO_WRITER_EVENTS]",
    )
    parser.add_argument(
        "--wait-for-slot",
        default=os.environ.get("DEMO_WRITER_WAIT_FOR_SLOT") or None,
        metavar="SLOT",
        help="wait until this replication slot exists before writing [DEMO_WRITER_WAIT_FOR_SLOT]",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.database_url:
        parser.error("--database-url (or DEMO_WRITER_DATABASE_URL) is required")
    if args.rate <= 0:
        parser.error("--rate must be positive")
    if args.events < 0:
        parser.error("--events must be 0 (no limit) or more")
    stop = threading.Event()

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    def report(event: OrderEvent) -> None:
        print(f"wrote {event.event_type:<14} {event.order_id}", flush=True)

    def waiting() -> None:
        print(
            f"demo-writer: waiting for replication slot {args.wait_for_slot!r} "
            "(the relay creates it when it first starts)",
            flush=True,
        )

    try:
        if args.wait_for_slot and not wait_for_slot(
            args.database_url, args.wait_for_slot, stop, timeout=600, on_wait=waiting
        ):
            return 0
        written = run_writer(
            args.database_url, args.rate, args.events or None, stop, on_event=report
        )
    except (psycopg.Error, TimeoutError) as exc:
        print(f"demo-writer: {exc}", file=sys.stderr)
        return 1
    print(f"demo-writer: {written} events written", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
