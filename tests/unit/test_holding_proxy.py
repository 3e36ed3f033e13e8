"""The holding proxy's Kafka rewriting: every broker address in Metadata and FindCoordinator
responses, every version, is routed; every other byte is kept. And its cut after a request: that
request arrives, its answer and everything after it do not, until the release resets the
connection."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.integration.holding_proxy import (
    END_TXN,
    FIND_COORDINATOR,
    METADATA,
    HoldingProxy,
    _frames,
    _Reader,
    _string,
    _uvarint,
    rewrite_response,
)

hosts = st.text(st.characters(codec="utf-8"), min_size=1, max_size=40)
ports = st.integers(0, 65535)
# (host, port), or an error's absent address
addresses = st.one_of(st.tuples(hosts, ports), st.just(("", -1)))
tags = st.lists(st.tuples(st.integers(0, 1000), st.binary(max_size=8)), max_size=2)
trailing = st.binary(max_size=64)


def _route(host: str, port: int) -> tuple[str, int]:
    return f"proxy-for-{host}", (port * 7 + 3) % 65536


def _routed(address: tuple[str, int]) -> tuple[str, int]:
    return address if not address[0] or address[1] < 0 else _route(*address)


def _nullable(value: str | None, compact: bool) -> bytes:
    if value is not None:
        return _string(value, compact)
    return _uvarint(0) if compact else struct.pack(">h", -1)


def _tags(fields: list[tuple[int, bytes]]) -> bytes:
    out = _uvarint(len(fields))
    for tag, data in sorted(fields):
        out += _uvarint(tag) + _uvarint(len(data)) + data
    return out


def _address(address: tuple[str, int], compact: bool) -> bytes:
    return _string(address[0], compact) + struct.pack(">i", address[1])


def _read_address(reader: _Reader, compact: bool) -> tuple[str, int]:
    host = reader.string(compact)
    assert host is not None
    return host, reader.int32()


Broker = tuple[int, tuple[str, int], str | None, list[tuple[int, bytes]]]


def _metadata(
    version: int, brokers: list[Broker], header: list[tuple[int, bytes]], rest: bytes
) -> bytes:
    compact = version >= 9
    out = _tags(header) if compact else b""
    if version >= 3:
        out += struct.pack(">i", 25)
    out += _uvarint(len(brokers) + 1) if compact else struct.pack(">i", len(brokers))
    for node, address, rack, fields in brokers:
        out += struct.pack(">i", node) + _address(address, compact)
        if version >= 1:
            out += _nullable(rack, compact)
        if compact:
            out += _tags(fields)
    return out + rest


@given(
    st.integers(0, 12),
    st.lists(st.tuples(st.integers(0, 9), addresses, st.none() | hosts, tags), max_size=4),
    tags,
    trailing,
)
def test_metadata_brokers_are_routed_and_nothing_else_changes(
    version: int, brokers: list[Broker], header: list[tuple[int, bytes]], rest: bytes
) -> None:
    # What a version cannot say is left out: a rack before v1, tagged fields before v9.
    brokers = [
        (node, address, rack if version >= 1 else None, fields if version >= 9 else [])
        for node, address, rack, fields in brokers
    ]
    body = _metadata(version, brokers, header, rest)
    expected = [(node, _routed(address), rack, fields) for node, address, rack, fields in brokers]
    assert rewrite_response(METADATA, version, body, _route) == _metadata(
        version, expected, header, rest
    )


Coordinator = tuple[str, int, tuple[str, int], int, str | None, list[tuple[int, bytes]]]


def _find_coordinator(version: int, coordinators: list[Coordinator], rest: bytes) -> bytes:
    compact = version >= 3
    out = _tags([]) if compact else b""
    if version >= 4:
        out += struct.pack(">i", 0) + _uvarint(len(coordinators) + 1)
        for key, node, address, error, message, fields in coordinators:
            out += _string(key, True) + struct.pack(">i", node) + _address(address, True)
            out += struct.pack(">h", error) + _nullable(message, True) + _tags(fields)
        return out + _tags([]) + rest
    _key, node, address, error, message, _fields = coordinators[0]
    if version >= 1:
        out += struct.pack(">i", 0)
    out += struct.pack(">h", error)
    if version >= 1:
        out += _nullable(message, compact)
    out += struct.pack(">i", node) + _address(address, compact)
    return out + (_tags([]) if compact else b"") + rest


coordinators = st.tuples(
    st.text(max_size=10), st.integers(-1, 9), addresses, st.integers(0, 30), st.none() | hosts, tags
)


@given(st.integers(0, 6), st.lists(coordinators, min_size=1, max_size=3), trailing)
def test_find_coordinator_addresses_are_routed_and_nothing_else_changes(
    version: int, found: list[Coordinator], rest: bytes
) -> None:
    if version < 4:
        found = found[:1]  # one coordinator, no tagged fields of its own
    body = _find_coordinator(version, found, rest)
    expected = [(k, n, _routed(a), e, m, f) for k, n, a, e, m, f in found]
    assert rewrite_response(FIND_COORDINATOR, version, body, _route) == _find_coordinator(
        version, expected, rest
    )


@given(st.integers(0, 70).filter(lambda k: k not in (METADATA, FIND_COORDINATOR)), trailing)
def test_other_responses_pass_unchanged(api_key: int, body: bytes) -> None:
    assert rewrite_response(api_key, 5, body, _route) == body


@given(st.lists(st.binary(max_size=50), max_size=6), st.integers(1, 40))
def test_frames_come_out_whole_however_the_stream_is_cut(payloads: list[bytes], cut: int) -> None:
    stream = b"".join(struct.pack(">i", len(p)) + p for p in payloads)
    buffer = bytearray()
    frames: list[bytes] = []
    for start in range(0, len(stream), cut):
        buffer += stream[start : start + cut]
        frames += _frames(buffer)
    assert frames == [struct.pack(">i", len(p)) + p for p in payloads]
    assert not buffer


def test_a_reader_refuses_a_truncated_message() -> None:
    body = _metadata(12, [(1, ("broker", 9092), None, [])], [], b"")
    for end in range(len(body)):
        try:
            rewrite_response(METADATA, 12, body[:end], _route)
        except ValueError:
            continue
        raise AssertionError(f"a body cut at {end} was accepted")


API_VERSIONS = 18


def _request(api_key: int, correlation: int) -> bytes:
    body = struct.pack(">hhi", api_key, 0, correlation) + _string("client", compact=False)
    return struct.pack(">i", len(body)) + body


class AnsweringServer:
    """A server that answers every request frame with its correlation id, noting what came."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.received: list[tuple[int, int]] = []  # (api key, correlation id)
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept: close alone does not
        self.listener.close()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.listener.getsockname()[1]}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buffer = bytearray()
        with conn:
            while data := conn.recv(4096):
                buffer += data
                for frame in _frames(buffer):
                    api_key, _, correlation = struct.unpack(">hhi", frame[4:12])
                    self.received.append((api_key, correlation))
                    conn.sendall(struct.pack(">ii", 4, correlation))


@pytest.fixture
def proxied() -> Iterator[tuple[AnsweringServer, HoldingProxy]]:
    server = AnsweringServer()
    with HoldingProxy(server.address) as proxy:
        yield server, proxy
    server.close()


def _connect(proxy: HoldingProxy) -> socket.socket:
    host, port = proxy.bootstrap_servers.split(":")
    client = socket.create_connection((host, int(port)), timeout=5)
    client.settimeout(0.5)
    return client


def _connected(proxy: HoldingProxy) -> socket.socket:
    """A client the proxy has answered once (it knows the connection)."""
    client = _connect(proxy)
    client.sendall(_request(API_VERSIONS, 1))
    assert _answer(client) == 1
    return client


def _answer(client: socket.socket) -> int | None:
    """The correlation id of the next answer; None when none comes (or the connection ended)."""
    try:
        data = client.recv(8)
    except (TimeoutError, ConnectionResetError):
        return None
    return int(struct.unpack(">ii", data)[1]) if len(data) == 8 else None


def test_a_cut_lets_the_request_through_and_nothing_after_it_either_way(
    proxied: tuple[AnsweringServer, HoldingProxy],
) -> None:
    server, proxy = proxied
    client = _connected(proxy)
    assert proxy.cut_after(os.getpid(), END_TXN) == 1
    client.sendall(_request(API_VERSIONS, 2))  # not the request the cut waits for: passes
    assert _answer(client) == 2
    client.sendall(_request(END_TXN, 3))
    assert proxy.cut.wait(5)
    assert _answer(client) is None  # it arrived, its answer does not
    client.sendall(_request(API_VERSIONS, 4))
    assert _answer(client) is None
    assert server.received == [(API_VERSIONS, 1), (API_VERSIONS, 2), (END_TXN, 3)]
    proxy.release()
    assert _answer(client) is None  # reset
    client.close()
    again = _connect(proxy)  # after the release, a new connection works
    again.sendall(_request(API_VERSIONS, 5))
    assert _answer(again) == 5
    again.close()
    assert (API_VERSIONS, 4) not in server.received


def test_a_cut_before_the_request_keeps_it_too(
    proxied: tuple[AnsweringServer, HoldingProxy],
) -> None:
    server, proxy = proxied
    client = _connected(proxy)
    assert proxy.cut_after(os.getpid(), END_TXN, arrives=False) == 1
    client.sendall(_request(END_TXN, 2))
    assert proxy.cut.wait(5)
    assert _answer(client) is None
    proxy.release()
    assert server.received == [(API_VERSIONS, 1)]
    client.close()
