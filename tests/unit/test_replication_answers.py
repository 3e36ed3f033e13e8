"""A server that takes the replication connection and then never answers holds the relay's
replication commands for at most their answer timeout, and a stop ends the wait at once.

The server is a few lines of PostgreSQL's protocol on a local socket: it accepts libpq's start-up
(no TLS, no password) and then reads whatever it is sent without a word, as a stopped walsender
or a cut network that the kernel still acknowledges for would. The client is the real libpq.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from cdc_relay.errors import SourceUnavailable
from cdc_relay.replication.stream import ReplicationStream, timeline

SSL_REQUEST, GSS_REQUEST = 80877103, 80877104


def _message(kind: bytes, body: bytes) -> bytes:
    return kind + struct.pack("!i", len(body) + 4) + body


def _serve_silently(conn: socket.socket) -> None:
    with conn:
        while True:  # the start-up packet, after any requests for encryption (refused)
            header = conn.recv(8, socket.MSG_WAITALL)
            if len(header) < 8:
                return
            length, code = struct.unpack("!ii", header)
            conn.recv(length - 8, socket.MSG_WAITALL)
            if code in (SSL_REQUEST, GSS_REQUEST):
                conn.sendall(b"N")
                continue
            break
        conn.sendall(
            _message(b"R", struct.pack("!i", 0))  # AuthenticationOk
            + _message(b"S", b"server_version\x0015.0\x00")
            + _message(b"S", b"client_encoding\x00UTF8\x00")
            + _message(b"K", struct.pack("!ii", 4242, 1))
            + _message(b"Z", b"I")
        )
        while conn.recv(65536):  # every command read, none answered
            pass


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A database URL whose server accepts the connection and then never answers."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=_serve_silently, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"postgresql://relay@127.0.0.1:{port}/app?sslmode=disable&gssencmode=disable"
    finally:
        listener.close()


def test_a_server_that_does_not_answer_start_up_is_given_up_on_at_the_answer_timeout(
    silent_server: str,
) -> None:
    stream = ReplicationStream(silent_server, "slot", 0, {}, answer_timeout=0.5)
    started = time.monotonic()
    with pytest.raises(SourceUnavailable, match=r"did not answer IDENTIFY_SYSTEM within 0\.5 s"):
        stream.open()
    assert time.monotonic() - started < 2.0


def test_a_stop_ends_the_wait_for_a_server_that_does_not_answer(silent_server: str) -> None:
    asked = threading.Event()
    threading.Timer(0.3, asked.set).start()
    stream = ReplicationStream(silent_server, "slot", 0, {}, stopping=asked.is_set)
    started = time.monotonic()
    with pytest.raises(SourceUnavailable, match="stopped while waiting"):
        stream.open()  # the answer timeout is 30 s: only the stop ends this
    assert time.monotonic() - started < 1.5


def test_a_one_off_replication_command_is_bounded_too(silent_server: str) -> None:
    started = time.monotonic()
    with pytest.raises(SourceUnavailable, match="did not answer IDENTIFY_SYSTEM"):
        timeline(silent_server, answer_timeout=0.5)
    assert time.monotonic() - started < 2.0


def test_the_relays_other_threads_run_while_a_command_waits(silent_server: str) -> None:
    """libpq's blocking calls hold the interpreter: leadership renewals and health answers
    would stop with the replication connection's wait."""
    ticks: list[float] = []
    done = threading.Event()

    def tick() -> None:
        while not done.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.01)

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        with pytest.raises(SourceUnavailable):
            ReplicationStream(silent_server, "slot", 0, {}, answer_timeout=1.0).open()
    finally:
        done.set()
        ticker.join()
    assert len(ticks) > 30, f"the other thread ran {len(ticks)} times in a 1 s wait"
