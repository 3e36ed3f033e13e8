"""A TCP proxy in front of a Kafka cluster that can hold back what one process sends to it.

A zombie leader is a relay that paused (a GC or VM freeze, SIGSTOP, a stalled network) with
records in flight: its successor publishes them again, and then the paused process's bytes reach
the broker after all. Making that happen on purpose, every time, needs the old leader's requests
to be *sent* (they left the process, as a stalled network leaves them) yet *not arrive* until the
successor has taken over. :meth:`HoldingProxy.hold` does that for one process: from then on every
byte that process sends to any broker is read by the proxy and kept, in order; the brokers'
answers to what already went through still reach it. :meth:`HoldingProxy.release` hands the kept
bytes on, in order, and forwards again. Other processes (the standby, the test's consumer) pass
through untouched.

A request whose outcome its sender cannot learn — a Kafka transaction's commit that reached the
broker, whose answer never came back — needs the opposite cut: :meth:`HoldingProxy.cut_after`
lets one process's next request of a kind (``END_TXN``) through (or, ``arrives=False``, not even
that one) and from then on cuts that process off both ways (nothing more it sends arrives, no
answer reaches it), as a network that fails right after (or before) a request left does.
:meth:`HoldingProxy.release` then resets its cut connections (it reconnects, as after a real
outage) and forwards again.

Why it speaks a little Kafka: a client connects to the addresses the brokers *advertise* in their
metadata, not to the bootstrap address it was given, so a plain forwarder would see only the first
request of each client. The proxy rewrites the broker addresses in the responses that tell
producers and consumers where brokers are — Metadata and FindCoordinator, every version — to
addresses of its own, one listener per broker, made when a broker is first named; everything else
passes byte for byte (DescribeCluster, which only an admin client's ``describe_cluster`` sends,
is not rewritten).
So it works in front of any broker: the local test broker, or a real Apache Kafka in external
mode (plaintext or SASL_PLAINTEXT listeners; not TLS, whose bytes it cannot read).

Which process a connection belongs to is read from the kernel: the client's socket (its local
port is the peer port the proxy sees) has an inode in ``/proc/net/tcp``, and the holding process
has that inode among its ``/proc/<pid>/fd`` links. Linux only.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_CHUNK = 65536
_LOOPBACK = "127.0.0.1"
PRODUCE = 0
METADATA = 3
FIND_COORDINATOR = 10
ADD_PARTITIONS_TO_TXN = 24
END_TXN = 26

Route = Callable[[str, int], tuple[str, int]]  # a broker's address -> the proxy's for it


# -- the Kafka protocol, as far as addresses go ------------------------------------------------


class _Reader:
    """Reads the primitive types of the Kafka protocol from ``data``, from ``pos`` on."""

    def __init__(self, data: bytes, pos: int = 0) -> None:
        self.data = data
        self.pos = pos

    def take(self, size: int) -> bytes:
        if size < 0 or self.pos + size > len(self.data):
            raise ValueError("truncated Kafka message")
        chunk = self.data[self.pos : self.pos + size]
        self.pos += size
        return chunk

    def int16(self) -> int:
        return int(struct.unpack(">h", self.take(2))[0])

    def int32(self) -> int:
        return int(struct.unpack(">i", self.take(4))[0])

    def uvarint(self) -> int:
        value = shift = 0
        while True:
            byte = self.take(1)[0]
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
            shift += 7
            if shift > 28:
                raise ValueError("varint too long")

    def string(self, compact: bool) -> str | None:
        size = self.uvarint() - 1 if compact else self.int16()
        return None if size < 0 else self.take(size).decode()

    def array_length(self, compact: bool) -> int:
        return self.uvarint() - 1 if compact else self.int32()

    def skip_tags(self) -> None:
        for _ in range(self.uvarint()):
            self.uvarint()
            self.take(self.uvarint())


def _uvarint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _string(value: str, compact: bool) -> bytes:
    raw = value.encode()
    return (_uvarint(len(raw) + 1) if compact else struct.pack(">h", len(raw))) + raw


def _flexible(api_key: int, version: int) -> bool:
    return version >= (9 if api_key == METADATA else 3)


def _address(reader: _Reader, out: bytearray, compact: bool, route: Route) -> None:
    """Copy ``host string, port int32`` from ``reader`` to ``out``, routed; an absent address
    (an error's empty host, port -1) stays as it is."""
    start = reader.pos
    host = reader.string(compact)
    port = reader.int32()
    if not host or port < 0:
        out += reader.data[start : reader.pos]
        return
    new_host, new_port = route(host, port)
    out += _string(new_host, compact) + struct.pack(">i", new_port)


def rewrite_response(api_key: int, version: int, body: bytes, route: Route) -> bytes:
    """A response body (after the correlation id) with every broker address routed; bodies of
    other requests unchanged."""
    if api_key not in (METADATA, FIND_COORDINATOR):
        return body
    compact = _flexible(api_key, version)
    reader = _Reader(body)
    out = bytearray()

    def copy_to_here(start: int) -> None:
        out.extend(body[start : reader.pos])

    start = 0
    if compact:
        reader.skip_tags()  # the response header's tagged fields
    if api_key == METADATA:
        if version >= 3:
            reader.int32()  # throttle_time_ms
        brokers = reader.array_length(compact)
        copy_to_here(start)
        for _ in range(max(brokers, 0)):
            start = reader.pos
            reader.int32()  # node_id
            copy_to_here(start)
            _address(reader, out, compact, route)
            start = reader.pos
            if version >= 1:
                reader.string(compact)  # rack
            if compact:
                reader.skip_tags()
            copy_to_here(start)
    elif version < 4:
        if version >= 1:
            reader.int32()  # throttle_time_ms
        reader.int16()  # error_code
        if version >= 1:
            reader.string(compact)  # error_message
        reader.int32()  # node_id
        copy_to_here(start)
        _address(reader, out, compact, route)
    else:
        reader.int32()  # throttle_time_ms
        coordinators = reader.array_length(compact=True)
        copy_to_here(start)
        for _ in range(max(coordinators, 0)):
            start = reader.pos
            reader.string(compact=True)  # key
            reader.int32()  # node_id
            copy_to_here(start)
            _address(reader, out, compact, route)
            start = reader.pos
            reader.int16()  # error_code
            reader.string(compact=True)  # error_message
            reader.skip_tags()
            copy_to_here(start)
    out += body[reader.pos :]
    return bytes(out)


def _frames(buffer: bytearray) -> list[bytes]:
    """Whole size-prefixed frames taken off the front of ``buffer`` (the rest stays)."""
    frames = []
    while len(buffer) >= 4:
        size = int(struct.unpack(">i", buffer[:4])[0])
        if len(buffer) < 4 + size:
            break
        frames.append(bytes(buffer[: 4 + size]))
        del buffer[: 4 + size]
    return frames


# -- who owns a connection ---------------------------------------------------------------------


def _client_inodes(proxy_ports: set[int]) -> dict[tuple[int, int], int]:
    """(client port, proxy port) -> the client socket's inode, for connections to the proxy."""
    found: dict[tuple[int, int], int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                local = int(fields[1].rsplit(":", 1)[1], 16)
                remote = int(fields[2].rsplit(":", 1)[1], 16)
                inode = int(fields[9])
                if remote in proxy_ports and inode:
                    found[(local, remote)] = inode
    return found


def _socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets process ``pid`` has open (its threads share them)."""
    inodes: set[int] = set()
    with contextlib.suppress(OSError):
        for fd in os.scandir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(fd.path)
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
    return inodes


# -- the proxy ---------------------------------------------------------------------------------


@dataclass
class Held:
    """What a hold kept, handed on by :meth:`HoldingProxy.release`."""

    bytes: int = 0
    produce_requests: int = 0

    def __add__(self, other: Held) -> Held:
        return Held(self.bytes + other.bytes, self.produce_requests + other.produce_requests)


class _Link:
    """One forwarded connection; its client-to-broker direction can be held, at once or from
    its next Produce request on (armed)."""

    def __init__(
        self, client: socket.socket, server: socket.socket, on_produce: Callable[[], None]
    ) -> None:
        self.client = client
        self.server = server
        self.key = (int(client.getpeername()[1]), int(client.getsockname()[1]))
        self.lock = threading.Lock()  # orders forwarding, holding and releasing
        self.armed = False
        self.arm_key = PRODUCE
        self.held = False
        self.kept: list[bytes] = []  # b"" stands for the end of the client's stream
        self.kept_count = Held()
        self.requests: dict[int, tuple[int, int]] = {}  # correlation id -> (api key, version)
        self._on_produce = on_produce
        self.cut_after: int | None = None  # the api key whose request cuts (passing, or not)
        self.cut_arrives = True
        self.cut = False  # nothing more passes either way; closed on release
        self.on_cut: Callable[[], None] = lambda: None

    def hold(self) -> None:
        with self.lock:
            self.held = True
            self.armed = False

    def arm(self, api_key: int = PRODUCE) -> None:
        with self.lock:
            self.armed, self.arm_key = not self.held, api_key

    def cut_off(self) -> None:
        with self.lock:
            self.cut, self.cut_after = True, None

    def release(self) -> Held:
        with self.lock:
            if self.cut:  # what it kept is dropped; a reset: the client reconnects
                self.kept.clear()
                self.kept_count = Held()
                self.cut = self.held = self.armed = False
                self.close()
                return Held()
            kept = self.kept_count
            try:
                for chunk in self.kept:
                    if chunk:
                        self.server.sendall(chunk)
                    else:
                        self.server.shutdown(socket.SHUT_WR)
            except OSError:
                self.close()
            self.kept.clear()
            self.kept_count = Held()
            self.held = self.armed = False
            return kept

    def to_server(self, frame: bytes) -> None:
        """Pass a request on, or keep it while held; ``b""`` is the end of the stream."""
        api_key = -1
        with self.lock:
            if len(frame) >= 12:
                api_key, version, correlation = struct.unpack(">hhi", frame[4:12])
                if api_key in (METADATA, FIND_COORDINATOR):
                    self.requests[correlation] = (api_key, version)
            triggered = self.armed and api_key == self.arm_key
            if triggered:
                self.held, self.armed = True, False
            cutting = self.cut_after is not None and api_key == self.cut_after
            passes = cutting and self.cut_arrives
            if cutting:  # from this request on, nothing passes either way
                self.cut, self.cut_after = True, None
            if passes:
                self.server.sendall(frame)  # it arrives; its answer does not
            elif self.held or self.cut:
                self.kept.append(frame)
                self.kept_count += Held(len(frame), int(api_key == PRODUCE))
            elif frame:
                self.server.sendall(frame)
            else:
                self.server.shutdown(socket.SHUT_WR)
        if triggered:
            self._on_produce()  # outside this link's lock: it takes the others'
        if cutting:
            self.on_cut()

    def close(self) -> None:
        for sock in (self.client, self.server):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


class HoldingProxy:
    """A listener on 127.0.0.1 for each broker of the cluster at ``bootstrap_servers``."""

    def __init__(self, bootstrap_servers: str) -> None:
        self._lock = threading.Lock()
        self._links: set[_Link] = set()
        self._listeners: dict[tuple[str, int], socket.socket] = {}  # by upstream address
        self._held_pid: int | None = None
        self._armed_pid: int | None = None
        self._armed_key = PRODUCE  # the request that makes an armed hold take effect
        self.holding = threading.Event()  # set while a hold is in effect
        self._cut_armed: tuple[int, int, bool] | None = None  # cut_after's (pid, api key, arrives)
        self._cut_pid: int | None = None
        self.cut = threading.Event()  # set once a cut_after took effect
        self._closed = False
        self.errors: list[str] = []  # responses it could not read (passed on unchanged)
        self._bootstrap = [self._route(*_split(a)) for a in bootstrap_servers.split(",")]

    @property
    def bootstrap_servers(self) -> str:
        return ",".join(f"{host}:{port}" for host, port in self._bootstrap)

    def hold(self, pid: int, *, from_produce: bool = False, from_request: int | None = None) -> int:
        """Keep every byte process ``pid`` sends, on the connections it has and the ones it
        opens, until :meth:`release`: from now on, or (``from_produce``) from the moment it
        sends its next Produce request, that request included — a hold that certainly has
        records in flight — or (``from_request``) its next request with that api key.
        :attr:`holding` is set when the hold takes effect. Returns how many connections of
        ``pid`` were found."""
        trigger = PRODUCE if from_produce else from_request
        with self._lock:
            self.holding.clear()
            if trigger is not None:
                self._armed_pid, self._armed_key = pid, trigger
            else:
                self._held_pid = pid
            links = list(self._links)
        owned = self._owned_by(pid, links)
        for link in owned:
            if trigger is not None:
                link.arm(trigger)
            else:
                link.hold()
        if trigger is None:
            self.holding.set()
        return len(owned)

    def cut_after(self, pid: int, api_key: int, *, arrives: bool = True) -> int:
        """Let process ``pid``'s next request with ``api_key`` through (``arrives``; else keep
        that one too), then cut that process off both ways until :meth:`release` (which resets
        its connections): it never learns what came of it. :attr:`cut` is set when that request
        was sent. Returns how many connections of ``pid`` were found."""
        with self._lock:
            self.cut.clear()
            self._cut_armed = (pid, api_key, arrives)
            links = list(self._links)
        owned = self._owned_by(pid, links)
        for link in owned:
            self._arm_cut(link, api_key, arrives)
        return len(owned)

    def release(self) -> Held:
        """Send what was kept, in order, and forward again; cut connections are reset."""
        with self._lock:
            self._held_pid = self._armed_pid = None
            self._cut_armed = self._cut_pid = None
            links = list(self._links)
            self.holding.clear()
        for link in links:
            if link.cut:
                with self._lock:
                    self._links.discard(link)
        return sum((link.release() for link in links), Held())

    def close(self) -> None:
        with self._lock:
            self._closed = True
            listeners, self._listeners = list(self._listeners.values()), {}
            links, self._links = self._links, set()
        for listener in listeners:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        for link in links:
            link.close()

    def __enter__(self) -> HoldingProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- inside ------------------------------------------------------------------------------

    def _route(self, host: str, port: int) -> tuple[str, int]:
        """The proxy's address for the broker at ``host:port`` (a listener made on first use)."""
        with self._lock:
            listener = self._listeners.get((host, port))
            if listener is None:
                listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                listener.bind((_LOOPBACK, 0))
                listener.listen(64)
                self._listeners[(host, port)] = listener
                threading.Thread(
                    target=self._accept, args=(listener, host, port), daemon=True
                ).start()
            return _LOOPBACK, int(listener.getsockname()[1])

    def _produce_seen(self) -> None:
        """An armed connection sent its request: hold all of the armed process's."""
        with self._lock:
            pid, self._armed_pid = self._armed_pid, None
            if pid is None:
                return  # another connection of it was first
            self._held_pid = pid
            links = list(self._links)
        for link in self._owned_by(pid, links):
            link.hold()
        self.holding.set()

    def _arm_cut(self, link: _Link, api_key: int, arrives: bool) -> None:
        with link.lock:
            link.cut_after, link.cut_arrives = api_key, arrives
            link.on_cut = self._cut_seen

    def _cut_seen(self) -> None:
        """An armed connection passed its request: cut all of the armed process's."""
        with self._lock:
            armed, self._cut_armed = self._cut_armed, None
            if armed is None:
                return  # another connection of it was first
            self._cut_pid = armed[0]
            links = list(self._links)
        for link in self._owned_by(armed[0], links):
            link.cut_off()
        self.cut.set()

    def _owned_by(self, pid: int, links: list[_Link]) -> list[_Link]:
        inodes = _socket_inodes(pid)
        with self._lock:
            ports = {int(s.getsockname()[1]) for s in self._listeners.values()}
        by_key = _client_inodes(ports)
        return [link for link in links if by_key.get(link.key) in inodes]

    def _accept(self, listener: socket.socket, host: str, port: int) -> None:
        while not self._closed:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection((host, port), timeout=10)
            except OSError:
                client.close()
                continue
            try:
                server.settimeout(None)
                for sock in (client, server):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                link = _Link(client, server, self._produce_seen)
            except OSError:  # the client is already gone
                client.close()
                server.close()
                continue
            with self._lock:
                self._links.add(link)
                held_pid, armed_pid = self._held_pid, self._armed_pid
                cut_pid, cut_armed = self._cut_pid, self._cut_armed
            # A connection the process opened while held (or armed) is held (or armed) too.
            if held_pid is not None and self._owned_by(held_pid, [link]):
                link.hold()
            elif armed_pid is not None and self._owned_by(armed_pid, [link]):
                link.arm(self._armed_key)
            # And one it opened while cut (or armed to be) is cut (or armed) too.
            if cut_pid is not None and self._owned_by(cut_pid, [link]):
                link.cut_off()
            elif cut_armed is not None and self._owned_by(cut_armed[0], [link]):
                self._arm_cut(link, cut_armed[1], cut_armed[2])
            threading.Thread(target=self._from_client, args=(link,), daemon=True).start()
            threading.Thread(target=self._from_server, args=(link,), daemon=True).start()

    def _from_client(self, link: _Link) -> None:
        buffer = bytearray()
        try:
            while data := link.client.recv(_CHUNK):
                buffer += data
                for frame in _frames(buffer):
                    link.to_server(frame)
            link.to_server(b"")
        except OSError:
            self._drop(link)

    def _from_server(self, link: _Link) -> None:
        buffer = bytearray()
        try:
            while data := link.server.recv(_CHUNK):
                buffer += data
                for frame in _frames(buffer):
                    if not link.cut:  # a cut connection's answers are lost
                        link.client.sendall(self._rewritten(link, frame))
            link.client.shutdown(socket.SHUT_WR)
        except OSError:
            self._drop(link)

    def _rewritten(self, link: _Link, frame: bytes) -> bytes:
        if len(frame) < 8:
            return frame
        correlation = int(struct.unpack(">i", frame[4:8])[0])
        with link.lock:
            request = link.requests.pop(correlation, None)
        if request is None:
            return frame
        try:
            body = rewrite_response(*request, frame[8:], self._route)
        except ValueError as exc:  # a truncated or undecodable message
            self.errors.append(f"api {request[0]} v{request[1]}: {exc}")
            return frame
        return struct.pack(">ii", 4 + len(body), correlation) + body

    def _drop(self, link: _Link) -> None:
        """A reset or a closed socket: end both sides, unless bytes are still kept for later
        (a client that died while held still has its requests delivered on release)."""
        with link.lock:
            if link.held or link.cut:
                return
        with self._lock:
            self._links.discard(link)
        link.close()


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.strip().rpartition(":")
    return host.strip("[]"), int(port)
