"""A TCP proxy in front of the test broker that can hold back what one process sends to it.

A zombie leader is a relay that paused (a GC or VM freeze, SIGSTOP, a stalled network) with
records in flight: its successor publishes them again, and then the paused process's bytes reach
the broker after all. Making that happen on purpose, every time, needs the old leader's requests
to be *sent* (they left the process, as a stalled network leaves them) yet *not arrive* until the
successor has taken over. :meth:`HoldingProxy.hold` does that for one process: from then on every
byte that process sends to the broker is read by the proxy and kept, in order; the broker's
answers to what already went through still reach it. :meth:`HoldingProxy.release` hands the kept
bytes to the broker, in order, and forwards again. Other processes (the standby, the test's
consumer) pass through untouched.

Why a broker of its own: a Kafka client connects to the address the broker *advertises* in its
metadata, not to the bootstrap address it was given. So :class:`ProxiedBroker` is a Tansu broker
that listens on one port and advertises the proxy's: every client, whatever it bootstraps from,
reaches the broker only through the proxy. Which process a connection belongs to is read from
the kernel: the client's socket (its local port is the peer port the proxy sees) has an inode in
``/proc/net/tcp``, and the holding process has that inode among its ``/proc/<pid>/fd`` links.
Linux only, and the test broker only: a broker somebody else runs advertises its own addresses.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

from cdc_relay.local.broker import LocalBroker
from cdc_relay.local.lifetime import Watchdog, free_port, stat_fields

_CHUNK = 65536
_LOOPBACK = "127.0.0.1"
# Tansu reads its configuration from these as well: never inherited from the test's environment.
_TANSU_ENV = frozenset(
    {
        "CLUSTER_ID",
        "LISTENER_URL",
        "ADVERTISED_LISTENER_URL",
        "STORAGE_ENGINE",
        "SCHEMA_REGISTRY",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
    }
)


def _client_inodes(proxy_port: int) -> dict[int, int]:
    """Client-side port -> socket inode, for every loopback connection to ``proxy_port``."""
    found: dict[int, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                local, remote, inode = fields[1], fields[2], int(fields[9])
                if int(remote.rsplit(":", 1)[1], 16) == proxy_port and inode:
                    found[int(local.rsplit(":", 1)[1], 16)] = inode
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


class _Link:
    """One forwarded connection; its client-to-broker direction can be held."""

    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.client = client
        self.server = server
        self.client_port = int(client.getpeername()[1])
        self.lock = threading.Lock()  # orders forwarding, holding and releasing
        self.held = False
        self.kept: list[bytes] = []  # b"" stands for the end of the client's stream
        self.kept_bytes = 0

    def hold(self) -> None:
        with self.lock:
            self.held = True

    def release(self) -> None:
        with self.lock:
            try:
                for chunk in self.kept:
                    if chunk:
                        self.server.sendall(chunk)
                    else:
                        self.server.shutdown(socket.SHUT_WR)
            except OSError:
                self.close()
            self.kept.clear()
            self.held = False

    def forward_from_client(self, data: bytes) -> None:
        """Pass ``data`` on, or keep it while held; ``b""`` is the end of the stream."""
        with self.lock:
            if self.held:
                self.kept.append(data)
                self.kept_bytes += len(data)
            elif data:
                self.server.sendall(data)
            else:
                self.server.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        for sock in (self.client, self.server):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


class HoldingProxy:
    """Forwards every connection on ``127.0.0.1:port`` to ``127.0.0.1:upstream_port``."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind((_LOOPBACK, 0))
        self._listener.listen(64)
        self.port = int(self._listener.getsockname()[1])
        self._links: set[_Link] = set()
        self._lock = threading.Lock()
        self._held_pid: int | None = None
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept, name="holding-proxy", daemon=True)
        self._acceptor.start()

    @property
    def address(self) -> str:
        return f"{_LOOPBACK}:{self.port}"

    def hold(self, pid: int) -> int:
        """Keep every byte process ``pid`` sends from now on, on the connections it has and the
        ones it opens until :meth:`release`. Returns how many of its connections are held now."""
        with self._lock:
            self._held_pid = pid
            links = list(self._links)
        owned = self._owned_by(pid, links)
        for link in owned:
            link.hold()
        return len(owned)

    def release(self) -> int:
        """Send what was kept, in order, and forward again. Returns the number of bytes kept."""
        with self._lock:
            self._held_pid = None
            links = list(self._links)
        kept = 0
        for link in links:
            with link.lock:
                kept += link.kept_bytes
                link.kept_bytes = 0
            link.release()
        return kept

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            links, self._links = self._links, set()
        for link in links:
            link.close()
        self._acceptor.join(5)

    def __enter__(self) -> HoldingProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- inside ------------------------------------------------------------------------------

    def _owned_by(self, pid: int, links: list[_Link]) -> list[_Link]:
        inodes = _socket_inodes(pid)
        by_port = _client_inodes(self.port)
        return [link for link in links if by_port.get(link.client_port) in inodes]

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection((_LOOPBACK, self.upstream_port), timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            link = _Link(client, server)
            with self._lock:
                self._links.add(link)
                held_pid = self._held_pid
            if held_pid is not None and self._owned_by(held_pid, [link]):
                link.hold()  # a connection the held process opened while held
            threading.Thread(target=self._from_client, args=(link,), daemon=True).start()
            threading.Thread(target=self._from_server, args=(link,), daemon=True).start()

    def _from_client(self, link: _Link) -> None:
        try:
            while True:
                data = link.client.recv(_CHUNK)
                link.forward_from_client(data)
                if not data:
                    return
        except OSError:
            self._drop(link)

    def _from_server(self, link: _Link) -> None:
        try:
            while data := link.server.recv(_CHUNK):
                link.client.sendall(data)
            link.client.shutdown(socket.SHUT_WR)
        except OSError:
            self._drop(link)

    def _drop(self, link: _Link) -> None:
        """A reset or a closed socket: end both sides, unless bytes are still kept for later
        (a client that died while held still has its requests delivered on release)."""
        with link.lock:
            if link.held:
                return
        with self._lock:
            self._links.discard(link)
        link.close()


class ProxiedBroker(LocalBroker):
    """A Tansu broker whose advertised address is ``proxy``'s: clients reach it only through it.

    Its :attr:`bootstrap_servers` is the proxy's address; pause, resume and kill are
    :class:`LocalBroker`'s.
    """

    _DIRECTORY_PREFIX = "cdc-relay-proxied-broker-"

    def __init__(self, proxy: HoldingProxy) -> None:
        super().__init__(proxy.upstream_port)
        self.proxy = proxy

    @property
    def bootstrap_servers(self) -> str:
        return self.proxy.address

    def start(self, timeout: float = 30.0) -> None:
        if self.running:
            return
        if self._watchdog is None:
            self._watchdog = Watchdog(self.directory, self._pid_file)
        binary = self._install_binary()
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                [
                    str(binary),
                    "broker",
                    "--listener-url",
                    f"tcp://{_LOOPBACK}:{self.port}",
                    "--advertised-listener-url",
                    f"tcp://{self.proxy.address}",
                    "--storage-engine",
                    "memory://tansu/",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.directory,
                env={k: v for k, v in os.environ.items() if k not in _TANSU_ENV},
                start_new_session=True,
            )
        self._pid_file.write_text(f"{self._process.pid}\n")
        self._paused = False
        try:
            self._wait_ready(time.monotonic() + timeout)
        except BaseException:
            self._terminate(force=True)
            raise


def proxied_broker() -> ProxiedBroker:
    """A started :class:`ProxiedBroker` behind a new :class:`HoldingProxy` (close both with
    :meth:`ProxiedBroker.cleanup` and :meth:`HoldingProxy.close`)."""
    broker = ProxiedBroker(HoldingProxy(free_port()))
    try:
        broker.start()
    except BaseException:
        broker.proxy.close()
        raise
    return broker


def wait_stopped(pid: int, timeout: float = 5.0) -> None:
    """Return once every thread of ``pid`` is stopped (SIGSTOP takes effect asynchronously)."""
    tasks = Path(f"/proc/{pid}/task")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = [fields[0] for task in tasks.iterdir() if (fields := stat_fields(task / "stat"))]
        if states and all(state in ("T", "t") for state in states):
            return
        time.sleep(0.005)
    raise RuntimeError(f"pid {pid} did not stop within {timeout}s of SIGSTOP")
