"""ReplicationStream.wait: read coalescing, against a socket pair standing in for libpq's socket."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from cdc_relay.replication.stream import ReplicationStream


class _FakeConn:
    """The three PGconn members wait() and read() use, over one end of a socket pair."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.received = b""
        self.consumed = 0

    @property
    def socket(self) -> int:
        return self._sock.fileno()

    def consume_input(self) -> None:
        self.consumed += 1
        self.received += self._sock.recv(65536)

    def get_copy_data(self, _async: int) -> tuple[int, memoryview]:
        if not self.received:
            return 0, memoryview(b"")
        data, self.received = self.received, b""
        return len(data), memoryview(data)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    left, right = socket.socketpair()
    yield left, right
    left.close()
    right.close()


def stream_over(sock: socket.socket, coalesce: float) -> tuple[ReplicationStream, _FakeConn]:
    stream = ReplicationStream("postgresql:///unused", "slot", 0, {}, coalesce=coalesce)
    conn = _FakeConn(sock)
    stream._conn = conn  # type: ignore[assignment]
    return stream, conn


def read_bytes(stream: ReplicationStream) -> bytes | None:
    data = stream.read()
    return None if data is None else bytes(data)


def timed_wait(stream: ReplicationStream, timeout: float) -> tuple[bool, float]:
    started = time.monotonic()
    got = stream.wait(timeout)
    return got, time.monotonic() - started


def test_an_idle_stream_waits_for_the_timeout_then_wakes_at_once(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    server, client = pair
    stream, _ = stream_over(client, coalesce=1.0)
    got, took = timed_wait(stream, 0.05)
    assert not got
    assert 0.04 <= took < 0.5  # no coalescing pause: the last wait brought nothing
    server.send(b"begin")
    got, took = timed_wait(stream, 5.0)
    assert got
    assert took < 0.5
    assert read_bytes(stream) == b"begin"


def test_after_data_the_next_wait_lets_more_arrive_first(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    server, client = pair
    stream, conn = stream_over(client, coalesce=1.0)
    server.send(b"B")
    assert stream.wait(5.0)
    assert read_bytes(stream) == b"B"
    assert stream.read() is None
    server.send(b"I")
    server.send(b"C")
    # Data already waiting is read at once, without the pause.
    got, took = timed_wait(stream, 5.0)
    assert got
    assert took < 0.5
    assert read_bytes(stream) == b"IC"
    # Nothing waiting after a wake-up that brought data: pause, then take what came meanwhile.
    started = time.monotonic()
    got, took = timed_wait(stream, 5.0)
    assert not got
    assert 0.9 <= took < 3.0
    assert conn.consumed == 2
    server.send(b"late")
    got, took = timed_wait(stream, 5.0)  # the pause is over: block until data, wake at once
    assert got
    assert took < 0.5
    assert read_bytes(stream) == b"late"
    assert time.monotonic() - started < 4.0


def test_no_coalescing_reads_as_soon_as_data_arrives(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    server, client = pair
    stream, _ = stream_over(client, coalesce=0.0)
    server.send(b"B")
    assert stream.wait(5.0)
    assert read_bytes(stream) == b"B"
    got, took = timed_wait(stream, 0.05)
    assert not got
    assert took < 0.5
