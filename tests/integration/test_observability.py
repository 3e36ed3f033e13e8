"""Observability against real services: metrics counts, health and readiness, trace propagation."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import threading
import time
from contextlib import closing

import orjson
import psycopg
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from cdc_relay.config import load_settings
from cdc_relay.local import LocalBroker
from cdc_relay.local.lifetime import free_port
from cdc_relay.observability.http import LIVENESS_TIMEOUT
from cdc_relay.observability.tracing import Tracing
from cdc_relay.relay import Relay
from tests.conftest import KafkaBroker
from tests.integration.relay_support import (
    RelayProcess,
    create_outbox,
    http_get,
    new_event,
    relay_env,
    wait_until,
    write_transactions,
)
from tests.kafka_helpers import consume_all

pytestmark = pytest.mark.integration


def _metric(text: str, name: str, **labels: str) -> float:
    """The value of one Prometheus sample whose labels include ``labels``."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{key}="{value}"' in line for key, value in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {name} {labels} in:\n{text}")


def test_metrics_report_exactly_what_was_relayed(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    create_outbox(database)
    order, payment = f"{unique}.order", f"{unique}.payment"
    broker.create_topic(order, partitions=2)
    broker.create_topic(payment, partitions=1)
    port = free_port()
    env = relay_env(database, broker.bootstrap_servers, unique, http_port=str(port))
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        assert http_get(port, "/healthz")[0] == 200
        batches = [[new_event("order", f"o-{i}") for i in range(4)] for _ in range(5)]
        batches += [[new_event("payment", f"p-{i}")] for i in range(10)]
        batches += [[new_event("bad topic!", "x")]]  # dead-lettered
        write_transactions(database, batches)
        consume_all(broker.bootstrap_servers, [order, payment], 30, 30)

        def scraped() -> str:
            return http_get(port, "/metrics")[1].decode()

        wait_until(
            lambda: (
                "cdc_relay_events_dead_lettered_total" in scraped()
                and _metric(scraped(), "cdc_relay_events_dead_lettered_total") == 1
            ),
            15,
            "the dead-lettered event to be counted",
        )
        text = scraped()
        status, body = http_get(port, "/status")
        ready = http_get(port, "/readyz")
        command = subprocess.run(
            [sys.executable, "-m", "cdc_relay", "status"],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert relay.stop() == 0
    finally:
        relay.close()

    published = "cdc_relay_events_published_total"
    assert _metric(text, published, messaging_destination_name=order) == 20
    assert _metric(text, published, messaging_destination_name=payment) == 10
    assert _metric(text, "cdc_relay_event_latency_seconds_count") == 30
    assert _metric(text, "cdc_relay_event_latency_seconds_bucket", le="+Inf") == 30
    assert _metric(text, "cdc_relay_transactions_relayed_total") == 16
    # One observation per transaction with events, the dead-lettered one included.
    assert _metric(text, "cdc_relay_transaction_receive_latency_seconds_count") == len(batches)
    receive_sum = _metric(text, "cdc_relay_transaction_receive_latency_seconds_sum")
    assert 0 < receive_sum <= _metric(text, "cdc_relay_event_latency_seconds_sum")
    assert _metric(text, "cdc_relay_events_in_flight") == 0
    assert _metric(text, "cdc_relay_reconnects_total") == 0
    assert "cdc_relay_slot_retained_wal_bytes" in text
    assert "cdc_relay_replication_lag_bytes" in text
    assert "process_cpu_seconds_total" in text
    assert status == 200
    snapshot = orjson.loads(body)
    assert snapshot["published"] == 30
    # When it sent START_REPLICATION: after this test launched it (one monotonic clock for the
    # machine), and since its own launch as the kernel recorded it.
    assert snapshot["start_replication_monotonic"] > relay.started
    assert 0 < snapshot["start_replication_after_launch_s"] < 60
    assert snapshot["dead_lettered"] == 1
    assert ready[0] == 200, ready
    assert command.returncode == 0, command.stderr
    assert "slot_exists: True" in command.stdout
    assert "relay.published: 30" in command.stdout
    assert "retained_wal_bytes: " in command.stdout
    leader = next(line for line in command.stdout.splitlines() if line.startswith("leader: "))
    assert leader.removeprefix("leader: ") not in ("", "None"), command.stdout
    assert "leader_lease_current: True" in command.stdout, command.stdout


def test_readiness_follows_the_broker(
    database: str, local_broker: LocalBroker, unique: str
) -> None:
    create_outbox(database)
    topic = f"{unique}.order"
    local_broker.create_topic(topic, partitions=1)
    port = free_port()
    env = relay_env(database, local_broker.bootstrap_servers, unique, http_port=str(port))
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        wait_until(lambda: http_get(port, "/readyz")[0] == 200, 15, "ready while streaming")
        local_broker.pause()
        try:
            write_transactions(database, [[new_event()]])
            wait_until(lambda: http_get(port, "/readyz")[0] == 503, 20, "not ready while paused")
            status, body = http_get(port, "/readyz")
            assert orjson.loads(body)["ready"] is False
            assert http_get(port, "/healthz")[0] == 200, "alive, just not ready"
        finally:
            local_broker.resume()
        wait_until(lambda: http_get(port, "/readyz")[0] == 200, 30, "ready again after resume")
        assert len(consume_all(local_broker.bootstrap_servers, [topic], 1, 30)) == 1
        assert relay.stop() == 0
    finally:
        relay.close()
    assert status == 503


IDLE_CONNECTIONS = 1000


def _allow_open_files(count: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < count:
        wanted = count if hard == resource.RLIM_INFINITY else min(count, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= count, "hard limit of open files"


def test_idle_http_connections_cannot_starve_the_relay(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    create_outbox(database)
    topic = f"{unique}.order"
    broker.create_topic(topic, partitions=1)
    _allow_open_files(IDLE_CONNECTIONS + 200)
    port = free_port()
    env = relay_env(database, broker.bootstrap_servers, unique, http_port=str(port))
    env["CDC_RELAY_HTTP_HOST"] = "127.0.0.1"
    relay = RelayProcess(env).start()
    idle: list[socket.socket] = []
    try:
        relay.wait_streaming()
        fds_before = len(os.listdir(f"/proc/{relay.pid}/fd"))
        for _ in range(IDLE_CONNECTIONS):  # opened, never a byte sent
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", port), timeout=1) as probe:
            probe.sendall(b"GET /healthz HTTP/1.1\r\nHost: relay\r\n\r\n")
            answer = probe.recv(1024)
        elapsed = time.monotonic() - started
        fds_during = len(os.listdir(f"/proc/{relay.pid}/fd"))
        write_transactions(database, [[new_event("order")]])
        assert len(consume_all(broker.bootstrap_servers, [topic], 1, 30)) == 1
        assert http_get(port, "/healthz")[0] == 200
        assert relay.stop() == 0
    finally:
        for conn in idle:
            conn.close()
        relay.close()
    assert answer.startswith(b"HTTP/1.1 200"), answer
    assert elapsed < 1.0
    # The relay holds at most 64 HTTP connections, however many clients open.
    assert fds_during - fds_before <= 64 + 2, (fds_before, fds_during)


TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"


def _outbox_with_traceparent(database: str) -> None:
    create_outbox(database)
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("ALTER TABLE outbox ADD COLUMN traceparent text")


def _insert_traced(database: str, event_id: str) -> None:
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, "
            "traceparent) VALUES (%s, 'order', 'o-1', 'created', '{}', %s)",
            (event_id, f"00-{TRACE_ID}-{PARENT_SPAN}-01"),
        )


def test_traceparent_is_propagated_with_a_child_publish_span(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    _outbox_with_traceparent(database)
    topic = f"{unique}.order"
    broker.create_topic(topic, partitions=1)
    exporter = InMemorySpanExporter()
    env = relay_env(database, broker.bootstrap_servers, unique)
    settings = load_settings(
        **{key.removeprefix("CDC_RELAY_").lower(): value for key, value in env.items()}
    )
    relay = Relay(settings, tracing=Tracing(SimpleSpanProcessor(exporter)))
    thread = threading.Thread(target=relay.run)
    thread.start()
    try:
        wait_until(lambda: relay.stats.streaming, 30, "the in-process relay to stream")
        event = new_event()
        _insert_traced(database, event.id)
        (record,) = consume_all(broker.bootstrap_servers, [topic], 1, 30)
        wait_until(lambda: len(exporter.get_finished_spans()) == 1, 10, "the publish span")
    finally:
        relay.request_stop()
        thread.join(30)
    (span,) = exporter.get_finished_spans()
    header = (record.header("traceparent") or b"").decode()
    _version, trace_id, span_id, _flags = header.split("-")
    assert trace_id == TRACE_ID, "the same trace continues into Kafka"
    assert span.context is not None
    assert span.parent is not None
    assert f"{span.context.trace_id:032x}" == TRACE_ID
    assert f"{span.parent.span_id:016x}" == PARENT_SPAN, "the publish span is the row's child"
    assert span_id == f"{span.context.span_id:016x}", "consumers continue from the publish span"
    assert span.attributes is not None
    assert span.attributes["messaging.message.id"] == event.id
    assert span.attributes["messaging.destination.name"] == topic
    assert span.attributes["messaging.kafka.destination.partition"] == record.partition
    assert span.attributes["messaging.kafka.message.offset"] == record.offset


def test_traceparent_passes_through_when_tracing_is_off(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    _outbox_with_traceparent(database)
    topic = f"{unique}.order"
    broker.create_topic(topic, partitions=1)
    relay = RelayProcess(relay_env(database, broker.bootstrap_servers, unique)).start()
    try:
        relay.wait_streaming()
        _insert_traced(database, new_event().id)
        (record,) = consume_all(broker.bootstrap_servers, [topic], 1, 30)
        assert relay.stop() == 0
    finally:
        relay.close()
    assert record.header("traceparent") == f"00-{TRACE_ID}-{PARENT_SPAN}-01".encode()


def test_a_relay_waiting_for_postgresql_stays_alive(unique: str) -> None:
    """A relay that cannot reach PostgreSQL retries with a backoff of up to 30 s: it is waiting,
    not stuck, so /healthz stays 200 (a liveness probe restarting it would only restart the
    wait); /readyz says it is not ready."""
    port = free_port()
    env = relay_env(f"postgresql://relay@127.0.0.1:{free_port()}/app", "127.0.0.1:9", unique)
    env["CDC_RELAY_HTTP_PORT"] = str(port)
    env["CDC_RELAY_HTTP_HOST"] = "127.0.0.1"
    with closing(RelayProcess(env)) as relay:
        relay.start()
        relay.wait_for_log("cannot reach PostgreSQL, retrying")
        started = time.monotonic()
        while time.monotonic() - started < LIVENESS_TIMEOUT + 5:
            status, body = http_get(port, "/healthz")
            assert status == 200, (round(time.monotonic() - started, 1), body)
            time.sleep(1)
        assert http_get(port, "/readyz")[0] == 503
        assert relay.stop() == 0
