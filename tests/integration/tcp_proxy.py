"""A TCP forwarder that can be cut off from its clients the way a network partition cuts them off.

Tests put it in front of PostgreSQL: a relay connects to the proxy, the proxy to the server.
:meth:`TcpProxy.cut` makes every packet between the clients and the proxy go nowhere while every
socket stays open; :meth:`TcpProxy.heal` lets them through again.

Why not just stop forwarding in user space: the proxy's kernel would still acknowledge what a
client sends and answer its TCP keepalive probes, so the client would see a *hung server*, never a
*dead network* — TCP keepalives and ``tcp_user_timeout``, the defences against a partition, could
never fire. So the proxy's listening side lives in a network namespace of its own, reached over a
veth pair, and a cut removes the proxy's address inside the namespace: the client's packets still
leave its host as if all were well, and arrive nowhere (the namespace neither owns the address
nor can answer, not even with an ICMP error), exactly what a partition does; nothing in the
client's kernel knows. (Taking a link down instead is not the same: the client's kernel then sees
its own transmissions fail and retries every half second, not with TCP's backoff, so it comes back
at once after the heal — which no real partition does.) The proxy's connections to the server
stay in the host's namespace and are never cut: the server sees clients that went quiet.

What was sent during a cut is delivered after :meth:`heal` as long as the TCP connection lived:
the proxy holds nothing back, TCP retransmits what was lost, as it does when a real partition
ends. A connection whose end gave up meanwhile (``tcp_user_timeout``, keepalives) is gone, and the
other end learns it from a reset after the heal — also as in a real partition.

Needs root (``ip netns``, ``setns``); :func:`unavailable` says why not, for a skip.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import shutil
import socket
import subprocess
import threading

from psycopg.conninfo import make_conninfo

_CLONE_NEWNET = 0x40000000
_CHUNK = 65536


def unavailable() -> str | None:
    """Why a proxy cannot be made on this machine, or None."""
    if os.geteuid() != 0:
        return "the partition proxy needs root (ip netns, setns)"
    if shutil.which("ip") is None:
        return "the partition proxy needs iproute2's ip"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def _listen_in(netns: str, address: str) -> socket.socket:
    """A listening socket created inside ``netns`` (a socket keeps the namespace it was made in;
    setns changes only the calling thread's, so a short-lived thread makes it)."""
    made: list[socket.socket | BaseException] = []

    def make() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
            try:
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns failed")
            finally:
                os.close(fd)
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.bind((address, 0))
            listener.listen(64)
            made.append(listener)
        except BaseException as exc:  # handed to the caller's thread
            made.append(exc)

    thread = threading.Thread(target=make)
    thread.start()
    thread.join()
    if isinstance(made[0], BaseException):
        raise made[0]
    return made[0]


class TcpProxy:
    """Forwards each connection to ``upstream``; :meth:`cut` / :meth:`heal` the clients' side."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self._upstream = (upstream_host, upstream_port)
        tag = secrets.token_hex(3)
        self._netns = f"cdcr-part-{tag}"
        self._host_end = f"cdcrh{tag}"
        self._ns_end = f"cdcrn{tag}"
        self._inside = ("netns", "exec", self._netns, "ip")  # ip run inside the namespace
        # A /30 of 10.128.0.0/9 picked at random: tests running at the same time do not meet.
        net = secrets.randbelow(1 << 21) << 2
        self._host_ip = socket.inet_ntoa((0x0A800000 | net | 1).to_bytes(4, "big"))
        self.host = socket.inet_ntoa((0x0A800000 | net | 2).to_bytes(4, "big"))
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._made = False
        try:
            self._make_namespace()
            self._listener = _listen_in(self._netns, self.host)
        except BaseException:
            self._remove_namespace()
            raise
        self.port = int(self._listener.getsockname()[1])
        self._acceptor = threading.Thread(target=self._accept, name="tcp-proxy", daemon=True)
        self._acceptor.start()

    def url(self, database_url: str) -> str:
        """``database_url`` pointed at the proxy (a ``key=value`` string; all else unchanged)."""
        return make_conninfo(database_url, host=self.host, port=str(self.port))

    def cut(self) -> None:
        """From now on every packet between the clients and the proxy is dropped."""
        _ip(*self._inside, "addr", "del", f"{self.host}/30", "dev", self._ns_end)

    def heal(self) -> None:
        """Packets pass again; TCP retransmits what the cut dropped."""
        _ip(*self._inside, "addr", "add", f"{self.host}/30", "dev", self._ns_end)

    def drop_connections(self) -> None:
        """End every forwarded connection (both sockets of each); new ones are still accepted."""
        with self._lock:
            sockets, self._sockets = self._sockets, set()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    @property
    def connections(self) -> int:
        """Forwarded connections now open (two sockets each)."""
        with self._lock:
            return len(self._sockets) // 2

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self.drop_connections()
        self._acceptor.join(5)
        self._remove_namespace()

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- inside ------------------------------------------------------------------------------

    def _make_namespace(self) -> None:
        _ip("netns", "add", self._netns)
        self._made = True
        _ip("link", "add", self._host_end, "type", "veth", "peer", "name", self._ns_end)
        _ip("link", "set", self._ns_end, "netns", self._netns)
        _ip("addr", "add", f"{self._host_ip}/30", "dev", self._host_end)
        _ip("link", "set", self._host_end, "up")
        _ip(*self._inside, "addr", "add", f"{self.host}/30", "dev", self._ns_end)
        _ip(*self._inside, "link", "set", self._ns_end, "up")

    def _remove_namespace(self) -> None:
        if self._made:
            with contextlib.suppress(subprocess.SubprocessError):
                _ip("netns", "del", self._netns)  # takes the veth pair with it
            self._made = False

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self._upstream, timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._sockets |= {client, server}
            ended: list[int] = []  # one entry per direction that has ended
            for source, target in ((client, server), (server, client)):
                threading.Thread(
                    target=self._pump, args=(source, target, ended), daemon=True
                ).start()

    def _pump(self, source: socket.socket, target: socket.socket, ended: list[int]) -> None:
        """One direction of one connection; the second direction to end closes both sockets."""
        try:
            while data := source.recv(_CHUNK):
                target.sendall(data)
            target.shutdown(socket.SHUT_WR)  # pass the end of the stream on
        except OSError:
            for sock in (source, target):  # a reset, a timeout, drop_connections: both go
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        with self._lock:
            ended.append(1)
            if len(ended) < 2:
                return
            self._sockets -= {source, target}
        source.close()
        target.close()
