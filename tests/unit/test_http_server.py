"""The health server under hostile clients: nothing a client does ends its thread or its socket.

The server's loop is gated in these tests (:class:`Gate`): while it is held, events pile up in the
kernel, so one ``select()`` batch carries them together (a connection evicted by an accept and its
own read event, say), which a free-running loop only meets by chance under load.
"""

from __future__ import annotations

import contextlib
import errno
import selectors
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cdc_relay.observability.http import HealthServer
from cdc_relay.observability.stats import RelayStats

MAX_CONNECTIONS = 8
REQUEST_TIMEOUT = 0.5


class Gate:
    """Holds the server's loop before its next ``select()`` while closed."""

    def __init__(self, selector: selectors.BaseSelector, wake: socket.socket) -> None:
        self._wake = wake
        self._open = threading.Event()
        self._open.set()
        self._waiting = threading.Event()
        real = selector.select

        def select(timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
            if not self._open.is_set():
                self._waiting.set()
                self._open.wait(5)
            return real(timeout)

        selector.select = select  # type: ignore[method-assign]

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """The loop stops before its next select() until the block ends; then one batch."""
        self._waiting.clear()
        self._open.clear()
        self._wake.send(b"x")  # out of the select() it may be in
        try:
            assert self._waiting.wait(5), "the server loop did not come round"
            yield
            time.sleep(0.02)  # the kernel has delivered what the block sent
        finally:
            self._open.set()


def _start(**overrides: float) -> tuple[HealthServer, Gate]:
    server = HealthServer(
        0,
        RelayStats(),
        lambda: b"# metrics\n",
        lambda: (True, "streaming"),
        host="127.0.0.1",
        max_connections=int(overrides.get("max_connections", MAX_CONNECTIONS)),
        request_timeout=overrides.get("request_timeout", REQUEST_TIMEOUT),
    )
    gate = Gate(server._selector, server._wake_writer)
    server.start()
    return server, gate


@pytest.fixture
def gated() -> Iterator[tuple[HealthServer, Gate]]:
    server, gate = _start()
    try:
        yield server, gate
    finally:
        server.stop()


def _healthz(port: int, timeout: float = 2.0) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
        conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        response = b""
        while chunk := conn.recv(4096):
            response += chunk
    return int(response.split(b" ", 2)[1])


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=2)


def _connect_nonblocking(port: int) -> socket.socket:
    conn = socket.socket()
    conn.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        conn.connect(("127.0.0.1", port))
    return conn


def _reset(conn: socket.socket) -> None:
    """Close with an RST instead of a FIN."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()


def _received(conn: socket.socket) -> bytes:
    """What the server sent before it closed ``conn`` (nothing, when it reset it)."""
    try:
        return conn.recv(100)
    except ConnectionResetError:
        return b""


def _wait_for(condition: object, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_connection_evicted_in_the_batch_of_its_own_read_event_is_skipped(
    gated: tuple[HealthServer, Gate],
) -> None:
    server, gate = gated
    idle = [_connect(server.port) for _ in range(MAX_CONNECTIONS)]
    _wait_for(lambda: server.open_connections == MAX_CONNECTIONS)
    with gate.held():
        # The accepts come first in the batch and evict the oldest idle connections, whose
        # requests (and closes) are in the same batch.
        newcomers = [_connect_nonblocking(server.port) for _ in range(4)]
        time.sleep(0.02)
        for conn in idle[:4]:
            conn.sendall(b"GET /healthz HTTP/1.1\r\n\r\n")
        for conn in idle[4:]:
            conn.close()
    try:
        time.sleep(0.1)
        assert server._thread.is_alive()
        assert _healthz(server.port) == 200
    finally:
        for conn in idle + newcomers:
            conn.close()


def test_a_failure_serving_one_connection_closes_only_that_one(
    gated: tuple[HealthServer, Gate], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, _ = gated
    real_read = server._read
    poisoned = _connect(server.port)
    _wait_for(lambda: server.open_connections == 1)
    bystander = _connect(server.port)
    _wait_for(lambda: server.open_connections == 2)
    victim = {poisoned.getsockname()}

    def read(conn: socket.socket) -> None:
        if conn.getpeername() in victim:
            raise RuntimeError("a bug met by one connection")
        real_read(conn)

    monkeypatch.setattr(server, "_read", read)
    poisoned.sendall(b"GET /healthz HTTP/1.1\r\n\r\n")
    assert _received(poisoned) == b""  # closed, no answer
    bystander.sendall(b"GET /healthz HTTP/1.1\r\n\r\n")
    assert bystander.recv(100).startswith(b"HTTP/1.1 200")
    assert server._thread.is_alive()
    assert _healthz(server.port) == 200
    poisoned.close()
    bystander.close()


def test_a_failure_of_the_loop_itself_is_survived(
    gated: tuple[HealthServer, Gate], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, _ = gated
    failures = iter([OSError(errno.EBADF, "Bad file descriptor"), ValueError("-1")])
    real_expire = server._expire

    def expire() -> None:
        failure = next(failures, None)
        if failure is not None:
            raise failure
        real_expire()

    monkeypatch.setattr(server, "_expire", expire)
    time.sleep(0.6)  # two failing rounds at least
    assert next(failures, None) is None
    assert server._thread.is_alive()
    assert _healthz(server.port) == 200


def test_a_closed_listener_is_opened_again_on_the_same_port(
    gated: tuple[HealthServer, Gate],
) -> None:
    server, gate = gated
    port = server.port
    with gate.held():
        server._listener.close()  # what no code path does: the loop must still recover
    _wait_for(lambda: server._listener.fileno() != -1)
    assert _healthz(port) == 200


# -- the soak -------------------------------------------------------------------------------------

SOAK_REQUEST_TIMEOUT = 0.1

REQUESTS = [
    b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /readyz HTTP/1.1\r\n\r\n",
    b"HEAD /metrics HTTP/1.0\n\n",
    b"POST /status HTTP/1.1\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",
]


class HostileClients(RuleBasedStateMachine):
    """Connect, send part of a request or garbage or too much, close, half-close, reset, pile
    up idle connections, in any order and in batches; the server answers a probe throughout."""

    def __init__(self) -> None:
        super().__init__()
        self.server, self.gate = _start(request_timeout=SOAK_REQUEST_TIMEOUT)
        self.port = self.server.port
        self.clients: list[socket.socket] = []
        self.holding: contextlib.ExitStack | None = None

    def _client(self, index: int) -> socket.socket:
        return self.clients[index % len(self.clients)]

    @rule(count=st.integers(1, 3 * MAX_CONNECTIONS), blocking=st.booleans())
    def connect(self, count: int, blocking: bool) -> None:
        for _ in range(count):
            opened = _connect(self.port) if blocking else _connect_nonblocking(self.port)
            self.clients.append(opened)

    @precondition(lambda self: self.clients)
    @rule(index=st.integers(0, 1000), data=st.sampled_from(REQUESTS), cut=st.integers(0, 40))
    def send(self, index: int, data: bytes, cut: int) -> None:
        with contextlib.suppress(OSError):
            self._client(index).send(data[: cut or None])

    @precondition(lambda self: self.clients)
    @rule(index=st.integers(0, 1000), garbage=st.binary(min_size=1, max_size=20_000))
    def send_garbage(self, index: int, garbage: bytes) -> None:
        with contextlib.suppress(OSError):
            self._client(index).send(garbage)

    @precondition(lambda self: self.clients)
    @rule(index=st.integers(0, 1000), how=st.sampled_from(["close", "half", "reset"]))
    def leave(self, index: int, how: str) -> None:
        conn = self.clients.pop(index % len(self.clients))
        with contextlib.suppress(OSError):
            if how == "half":
                conn.shutdown(socket.SHUT_WR)
                self.clients.append(conn)
                return
            if how == "reset":
                _reset(conn)
            conn.close()

    @precondition(lambda self: self.clients)
    @rule(how=st.sampled_from(["close", "reset"]))
    def leave_all(self, how: str) -> None:
        for conn in self.clients:
            with contextlib.suppress(OSError):
                if how == "reset":
                    _reset(conn)
                conn.close()
        self.clients.clear()

    @precondition(lambda self: self.holding is None)
    @rule()
    def hold(self) -> None:
        """What follows, up to ``release``, reaches the server in one batch."""
        self.holding = contextlib.ExitStack()
        self.holding.enter_context(self.gate.held())

    @precondition(lambda self: self.holding is not None)
    @rule()
    def release(self) -> None:
        assert self.holding is not None
        self.holding.close()
        self.holding = None

    @rule()
    def wait(self) -> None:
        """Waiting connections expire after a few of these."""
        time.sleep(SOAK_REQUEST_TIMEOUT / 3)

    @invariant()
    def bounded(self) -> None:
        assert self.server.open_connections <= 2 * MAX_CONNECTIONS

    @invariant()
    def alive(self) -> None:
        assert self.server._thread.is_alive()

    def teardown(self) -> None:
        try:
            if self.holding is not None:
                self.release()
            assert _healthz(self.port) == 200
            assert self.server._thread.is_alive()
        finally:
            for conn in self.clients:
                conn.close()
            self.server.stop()


HostileClients.TestCase.settings = settings(
    max_examples=20,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_hostile_clients_leave_the_server_answering = HostileClients.TestCase


def test_a_readiness_flood_cannot_lock_out_a_liveness_probe() -> None:
    """/readyz may wait for Kafka: a flood of them holds every worker, yet /healthz answers."""
    release = threading.Event()

    def slow_readiness() -> tuple[bool, str]:
        release.wait(10)
        return True, "streaming"

    server = HealthServer(
        0,
        RelayStats(),
        lambda: b"",
        slow_readiness,
        host="127.0.0.1",
        max_connections=MAX_CONNECTIONS,
        request_timeout=5.0,
    )
    server.start()
    flood = [_connect(server.port) for _ in range(4 * MAX_CONNECTIONS)]
    try:
        for conn in flood:
            with contextlib.suppress(OSError):
                conn.sendall(b"GET /readyz HTTP/1.1\r\n\r\n")
        time.sleep(0.2)
        started = time.monotonic()
        assert _healthz(server.port, timeout=1.0) == 200
        assert time.monotonic() - started < 0.5
        assert server.open_connections <= 2 * MAX_CONNECTIONS
        assert server._thread.is_alive()
    finally:
        release.set()
        for conn in flood:
            conn.close()
        server.stop()
