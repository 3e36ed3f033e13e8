"""Pure pieces of observability: the latency histogram, lag, the HTTP answers, trace contexts."""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Iterator

import orjson
import pytest
from prometheus_client import CollectorRegistry

from cdc_relay.errors import ConfigError
from cdc_relay.observability.http import LIVENESS_TIMEOUT, HealthServer
from cdc_relay.observability.metrics import RelayMetrics
from cdc_relay.observability.stats import LatencyHistogram, RelayStats
from cdc_relay.outbox import traceparent_from_span_context


def test_histogram_buckets_are_upper_bounds_inclusive() -> None:
    histogram = LatencyHistogram((0.01, 0.1, 1.0))
    for value in (0.005, 0.01, 0.011, 0.1, 0.5, 2.0):
        histogram.observe(value)
    assert histogram.counts == [2, 2, 1, 1]
    assert histogram.count == 6
    assert histogram.sum == pytest.approx(2.626)
    assert (histogram.min, histogram.max) == (0.005, 2.0)


def test_prometheus_histogram_is_cumulative_and_counts_every_observation() -> None:
    stats = RelayStats()
    metrics = RelayMetrics(stats, CollectorRegistry())
    for value in (0.002, 0.002, 0.3):
        stats.latency.observe(value)
    stats.receive_latency.observe(0.0015)
    stats.published_by_topic["a"] += 2
    stats.published_by_topic["b"] += 1
    text = metrics.prometheus_text().decode()
    metrics.shutdown()
    assert 'cdc_relay_event_latency_seconds_bucket{le="0.0025"' in text
    samples = [line for line in text.splitlines() if line.startswith("cdc_relay_event_latency")]
    by_le = {
        line.split('le="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in samples
        if "_bucket" in line
    }
    assert by_le["0.001"] == 0
    assert by_le["0.0025"] == 2
    assert by_le["0.25"] == 2
    assert by_le["0.5"] == 3
    assert by_le["+Inf"] == 3
    assert 'cdc_relay_events_published_total{messaging_destination_name="a"' in text
    # A sample with or without labels (exporter versions differ: otel_scope_* labels or none).
    sample = re.compile(
        r"cdc_relay_transaction_receive_latency_seconds_(\w+)"
        r"(?:\{[^}]*?(?:le=\"([^\"]*)\")?[^}]*\})? (\S+)"
    )
    receive = {
        kind + le: float(value)
        for kind, le, value in (m.groups("") for m in map(sample.fullmatch, text.splitlines()) if m)
    }
    assert receive["count"] == 1
    assert (receive["bucket0.001"], receive["bucket0.0025"]) == (0, 1)


def test_lag_is_zero_when_caught_up_and_age_of_last_ack_otherwise() -> None:
    stats = RelayStats(server_wal_end=5000, confirmed_lsn=3000, last_acked_commit_time=100.0)
    assert stats.lag_bytes == 2000
    assert stats.lag_seconds(now=130.0) == 30.0
    stats.caught_up = True
    assert stats.lag_seconds(now=130.0) == 0.0
    assert RelayStats().lag_bytes == 0


def _server(stats: RelayStats, ready: tuple[bool, str] = (True, "streaming")) -> HealthServer:
    return HealthServer(0, stats, lambda: b"# metrics\n", lambda: ready, host="127.0.0.1")


def test_health_answers() -> None:
    stats = RelayStats()
    server = _server(stats, (False, "not streaming from the replication slot"))
    try:
        assert server.respond("/healthz")[0] == 200
        status, content_type, body = server.respond("/readyz")
        assert (status, content_type) == (503, "application/json")
        assert orjson.loads(body) == {
            "ready": False,
            "reason": "not streaming from the replication slot",
        }
        assert server.respond("/metrics")[2] == b"# metrics\n"
        assert orjson.loads(server.respond("/status")[2])["published"] == 0
        assert server.respond("/nope")[0] == 404
        stats.last_loop = time.monotonic() - LIVENESS_TIMEOUT - 1
        assert server.respond("/healthz")[0] == 503
    finally:
        server.stop()


def _get(port: int, path: str, timeout: float = 2.0, method: str = "GET") -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
        conn.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        return _status_and_body(_read_all(conn))


def _read_all(conn: socket.socket) -> bytes:
    chunks = []
    while chunk := conn.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _status_and_body(response: bytes) -> tuple[int, bytes]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


@pytest.fixture
def running() -> Iterator[HealthServer]:
    server = HealthServer(
        0,
        RelayStats(),
        lambda: b"# metrics\n",
        lambda: (True, "streaming"),
        host="127.0.0.1",
        max_connections=8,
        request_timeout=0.5,
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_served_over_http(running: HealthServer) -> None:
    assert _get(running.port, "/healthz") == (200, b'{"status":"ok"}')
    assert _get(running.port, "/readyz?verbose=1")[0] == 200
    assert _get(running.port, "/metrics") == (200, b"# metrics\n")
    assert _get(running.port, "/nope")[0] == 404
    assert _get(running.port, "/healthz", method="POST")[0] == 405
    assert _get(running.port, "/healthz", method="HEAD") == (200, b"")
    with socket.create_connection(("127.0.0.1", running.port), timeout=2) as conn:
        conn.sendall(b"\x16\x03\x01 not http\r\n\r\n")
        assert _status_and_body(_read_all(conn))[0] == 400


def test_listens_only_on_the_given_host(running: HealthServer) -> None:
    assert running._listener.getsockname()[0] == "127.0.0.1"


def test_an_idle_connection_is_closed_after_the_request_timeout(running: HealthServer) -> None:
    with socket.create_connection(("127.0.0.1", running.port), timeout=5) as conn:
        conn.sendall(b"GET /healthz HTTP/1.1\r\n")  # never finishes its headers
        started = time.monotonic()
        assert conn.recv(100) == b""
        assert 0.4 < time.monotonic() - started < 2.0


def test_an_oversized_request_is_dropped(running: HealthServer) -> None:
    with socket.create_connection(("127.0.0.1", running.port), timeout=5) as conn:
        try:
            conn.sendall(b"GET /" + b"a" * 20_000)
            received = conn.recv(100)
        except ConnectionResetError:
            received = b""
        assert received == b""


def test_idle_connections_cannot_lock_out_a_probe(running: HealthServer) -> None:
    idle = [socket.create_connection(("127.0.0.1", running.port), timeout=2) for _ in range(50)]
    try:
        time.sleep(0.1)
        assert running.open_connections <= 8
        started = time.monotonic()
        assert _get(running.port, "/healthz", timeout=1.0)[0] == 200
        assert time.monotonic() - started < 1.0
        assert running.open_connections <= 8
    finally:
        for conn in idle:
            conn.close()


def test_a_slow_readiness_check_does_not_hold_up_liveness() -> None:
    release = threading.Event()

    def slow_readiness() -> tuple[bool, str]:
        release.wait(5)
        return True, "streaming"

    server = HealthServer(0, RelayStats(), lambda: b"", slow_readiness, host="127.0.0.1")
    server.start()
    slow = [threading.Thread(target=_get, args=(server.port, "/readyz", 10.0)) for _ in range(2)]
    try:
        for thread in slow:
            thread.start()
        time.sleep(0.1)
        started = time.monotonic()
        assert _get(server.port, "/healthz", timeout=1.0)[0] == 200
        assert time.monotonic() - started < 0.5
    finally:
        release.set()
        for thread in slow:
            thread.join()
        server.stop()


def test_port_in_use_is_a_clear_configuration_error() -> None:
    first = _server(RelayStats())
    try:
        with pytest.raises(ConfigError, match="CDC_RELAY_HTTP_PORT"):
            HealthServer(first.port, RelayStats(), lambda: b"", lambda: (True, ""), "127.0.0.1")
    finally:
        first.stop()


TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (TRACEPARENT, TRACEPARENT),
        ("traceparent=00-abc-def-01\ntracestate=x=1", "00-abc-def-01"),
        ("tracestate=x\n", None),
        ("", None),
    ],
)
def test_debezium_span_context_and_bare_traceparent(text: str, expected: str | None) -> None:
    assert traceparent_from_span_context(text) == expected
