"""The health/metrics HTTP server: ``/healthz``, ``/readyz``, ``/metrics``, ``/status``.

HTTP clients are strangers: the server must never let them take the file descriptors, threads or
CPU the relay needs. One thread owns every connection through a selector: it accepts, reads the
request head (at most :data:`MAX_REQUEST_BYTES`, within :data:`REQUEST_TIMEOUT`), and keeps at
most ``max_connections`` sockets waiting for their request; when full, a new connection evicts the
one that has been waiting longest, so idle connections cannot lock out a probe. ``/readyz``,
``/metrics`` and ``/status`` go to a small pool of workers (answering ``/readyz`` may wait for
Kafka), at most ``max_connections`` of them at once (more are answered 503 at once); everything
else (``/healthz``, a 404, a refusal) is answered by the server thread itself, a few hundred bytes
into a fresh socket's buffer, so a flood of slow requests cannot lock out a liveness probe
either. One request per connection. Handlers only read :class:`RelayStats` and ask the relay
whether it is ready, so a slow scrape never blocks the relay's loop.

Nothing a client does may end the server thread or close the listening socket. A connection
closed in the middle of a ``select()`` batch (evicted by an accept, say) still has its events in
that batch: they are skipped, since only connections still waiting are read. Whatever raises while
serving one connection closes that connection only; whatever raises in the loop itself is logged
(at most once per :data:`_COMPLAINT_INTERVAL`) and the loop carries on with a fresh selector
(and a fresh listener on the same address, should the old one ever be closed).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import orjson

from cdc_relay.errors import ConfigError
from cdc_relay.observability.stats import RelayStats

log = logging.getLogger(__name__)

LIVENESS_TIMEOUT = 30.0  # seconds without a main-loop iteration before /healthz fails
MAX_CONNECTIONS = 64  # HTTP sockets waiting for a request at most, and as many being answered
REQUEST_TIMEOUT = 5.0  # seconds a client has to send its request line and headers
WRITE_TIMEOUT = 5.0  # seconds a client has to take the answer
MAX_REQUEST_BYTES = 8192
# The kernel's queue of connections not yet accepted. During a flood of connections a full queue
# drops a new client's SYN, and that client (a liveness probe) retries only after a second; a deep
# queue keeps it waiting its turn instead, which the accept loop reaches within milliseconds.
LISTEN_BACKLOG = 1024
WORKERS = 4
_TICK = 0.25  # how often deadlines are checked
_ACCEPT_PAUSE = 0.5  # after the process ran out of file descriptors
_COMPLAINT_INTERVAL = 10.0  # seconds between two log lines about failures in the server
_FAILURE_PAUSE = 0.05  # after the loop failed: a fault that repeats does not spin the CPU
# accept() errors about one client (it left before it was accepted), not about the process.
_CLIENT_GONE = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EPERM})
_PATHS = ["/healthz", "/readyz", "/metrics", "/status"]
_ANSWERED_BY_WORKERS = frozenset({"/readyz", "/metrics", "/status"})

ReadinessCheck = Callable[[], tuple[bool, str]]


@dataclass
class _Waiting:
    """A connection whose request head has not arrived yet."""

    since: float
    head: bytearray = field(default_factory=bytearray)


class HealthServer:
    def __init__(
        self,
        port: int,
        stats: RelayStats,
        metrics_text: Callable[[], bytes],
        readiness: ReadinessCheck,
        host: str = "0.0.0.0",  # noqa: S104 - a sidecar is probed from outside its container
        *,
        max_connections: int = MAX_CONNECTIONS,
        request_timeout: float = REQUEST_TIMEOUT,
    ) -> None:
        self.stats = stats
        self._metrics_text = metrics_text
        self._readiness = readiness
        self._max_connections = max_connections
        self._request_timeout = request_timeout
        try:
            family, _, _, _, address = socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0]
            self._listener = _listen(address, family)
        except OSError as exc:
            raise ConfigError(
                f"cannot serve health and metrics on {host} port {port}: "
                f"{exc.strerror or exc}. Choose another CDC_RELAY_HTTP_PORT (0 disables it) "
                "or CDC_RELAY_HTTP_HOST"
            ) from None
        self._family = family
        self._address = self._listener.getsockname()  # the port chosen, when 0 was asked for
        self._host = host
        self._selector = selectors.DefaultSelector()
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._wake_reader.setblocking(False)
        self._waiting: dict[socket.socket, _Waiting] = {}  # owned by the server thread
        self._answering = 0  # handed to workers; guarded by _lock
        self._lock = threading.Lock()
        self._workers = ThreadPoolExecutor(WORKERS, thread_name_prefix="cdc-relay-http-worker")
        self._stopping = False
        self._accept_paused_until = 0.0
        self._complaints = threading.Lock()  # the loop and the workers complain
        self._last_complaint = float("-inf")
        self._unreported = 0  # failures since the last complaint
        self._thread = threading.Thread(target=self._serve, name="cdc-relay-http", daemon=True)

    @property
    def port(self) -> int:
        return int(self._listener.getsockname()[1])

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._waiting) + self._answering

    def start(self) -> None:
        self._thread.start()
        log.info("http server listening", extra={"fields": {"host": self._host, "port": self.port}})

    def stop(self) -> None:
        self._stopping = True
        if self._thread.is_alive():
            self._wake_writer.send(b"x")
            self._thread.join(REQUEST_TIMEOUT)
        self._workers.shutdown(wait=False, cancel_futures=True)
        for conn in list(self._waiting):
            conn.close()
        self._waiting.clear()
        self._selector.close()
        self._listener.close()
        self._wake_reader.close()
        self._wake_writer.close()

    def respond(self, path: str) -> tuple[int, str, bytes]:
        if path == "/healthz":
            silent = time.monotonic() - self.stats.last_loop
            if silent > LIVENESS_TIMEOUT:
                return _json(503, {"status": "stuck", "loop_silent_s": round(silent, 1)})
            return _json(200, {"status": "ok"})
        if path == "/readyz":
            ready, reason = self._readiness()
            return _json(200 if ready else 503, {"ready": ready, "reason": reason})
        if path == "/metrics":
            return 200, "text/plain; version=0.0.4; charset=utf-8", self._metrics_text()
        if path == "/status":
            return _json(200, self.stats.snapshot())
        return _json(404, {"error": "not found", "paths": _PATHS})

    # -- the server thread --------------------------------------------------------------------

    def _serve(self) -> None:
        try:
            self._selector.register(self._listener, selectors.EVENT_READ, "accept")
            self._selector.register(self._wake_reader, selectors.EVENT_READ, "wake")
        except Exception:
            self._complain("http server cannot watch its sockets; starting afresh")
            self._recover()
        while not self._stopping:
            try:
                self._serve_once()
            except Exception:
                self._complain("http server loop failed; serving on")
                time.sleep(_FAILURE_PAUSE)
                self._recover()

    def _serve_once(self) -> None:
        for key, _ in self._selector.select(_TICK):
            if key.data == "accept":
                self._accept()
            elif key.data == "wake":
                with contextlib.suppress(OSError):
                    self._wake_reader.recv(64)
            else:
                self._serve_connection(key.fileobj)  # type: ignore[arg-type]
        self._expire()

    def _serve_connection(self, conn: socket.socket) -> None:
        if conn not in self._waiting:
            return  # closed earlier in this batch (evicted): what it sent no longer matters
        try:
            self._read(conn)
        except Exception:
            self._complain("http connection failed; closed")
            self._close(conn)

    def _accept(self) -> None:
        for _ in range(self._max_connections):
            try:
                conn, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in _CLIENT_GONE:
                    continue
                # Out of file descriptors (EMFILE/ENFILE): stop accepting for a moment rather
                # than spin on a listener that stays readable.
                self._complain("http server cannot accept; pausing")
                with contextlib.suppress(KeyError, ValueError):
                    self._selector.unregister(self._listener)
                self._accept_paused_until = time.monotonic() + _ACCEPT_PAUSE
                return
            if len(self._waiting) >= self._max_connections:
                self._evict_oldest()
            try:
                conn.setblocking(False)
                self._selector.register(conn, selectors.EVENT_READ, "read")
            except Exception:
                self._complain("http connection cannot be watched; closed")
                conn.close()
                continue
            with self._lock:
                self._waiting[conn] = _Waiting(time.monotonic())

    def _evict_oldest(self) -> None:
        if self._waiting:
            self._close(min(self._waiting, key=lambda conn: self._waiting[conn].since))

    def _read(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(MAX_REQUEST_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        head = self._waiting[conn].head
        head += data
        if b"\r\n\r\n" not in head and b"\n\n" not in head:
            if len(head) > MAX_REQUEST_BYTES:
                self._close(conn)
            return
        self._selector.unregister(conn)
        method, path = _request_line(bytes(head))
        with self._lock:
            del self._waiting[conn]
            to_workers = method in ("GET", "HEAD") and path in _ANSWERED_BY_WORKERS
            busy = to_workers and self._answering >= self._max_connections
            if to_workers and not busy:
                self._answering += 1
        if not to_workers or busy:
            # A few hundred bytes: a fresh socket's send buffer takes them whole, at once.
            with contextlib.suppress(OSError):
                conn.send(_busy() if busy else self._response(method, path))
            conn.close()
            return
        try:
            self._workers.submit(self._answer, conn, method, path)
        except Exception:  # the pool is shut down: the server is stopping
            conn.close()
            with self._lock:
                self._answering -= 1

    def _expire(self) -> None:
        now = time.monotonic()
        if self._listener.fileno() == -1 and not self._stopping:
            self._recover()
        if self._accept_paused_until and now >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            with contextlib.suppress(KeyError):  # watched already
                self._selector.register(self._listener, selectors.EVENT_READ, "accept")
        for conn, waiting in list(self._waiting.items()):
            if now - waiting.since > self._request_timeout:
                self._close(conn)

    def _close(self, conn: socket.socket) -> None:
        """Forget ``conn`` and close it, once: unwatched before closed, so no stale descriptor
        is left in the selector (a closed socket's number is reused by the next accept)."""
        with self._lock:
            self._waiting.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):  # not watched (any more)
            self._selector.unregister(conn)
        conn.close()

    def _recover(self) -> None:
        """After a failure of the loop: a fresh selector watching what is sound, a listener."""
        try:
            if self._listener.fileno() == -1 and not self._stopping:
                self._listener = _listen(self._address, self._family)
                log.warning("http server listening again", extra={"fields": {"port": self.port}})
            selector = selectors.DefaultSelector()
            selector.register(self._wake_reader, selectors.EVENT_READ, "wake")
            selector.register(self._listener, selectors.EVENT_READ, "accept")
            self._accept_paused_until = 0.0
            for conn in list(self._waiting):
                try:
                    selector.register(conn, selectors.EVENT_READ, "read")
                except Exception:  # closed or broken: gone
                    with self._lock:
                        self._waiting.pop(conn, None)
                    conn.close()
            old, self._selector = self._selector, selector
            with contextlib.suppress(Exception):
                old.close()
        except Exception:
            self._complain("http server cannot recover yet; trying again")

    def _complain(self, message: str) -> None:
        """Log the failure being handled, at most once per _COMPLAINT_INTERVAL."""
        with self._complaints:
            self._unreported += 1
            now = time.monotonic()
            if now - self._last_complaint < _COMPLAINT_INTERVAL:
                return
            failures, self._unreported = self._unreported, 0
            self._last_complaint = now
        log.warning(message, exc_info=True, extra={"fields": {"failures": failures}})

    # -- the workers ----------------------------------------------------------------------------

    def _answer(self, conn: socket.socket, method: str, path: str) -> None:
        try:
            conn.setblocking(True)
            conn.settimeout(WRITE_TIMEOUT)
            conn.sendall(self._response(method, path))
        except OSError:
            pass  # the client left or was too slow to take the answer
        except Exception:  # a bug must not take the worker, nor leave the connection open
            self._complain("http answer failed")
        finally:
            conn.close()
            with self._lock:
                self._answering -= 1

    def _response(self, method: str, path: str) -> bytes:
        if not method:
            status, content_type, body = _json(400, {"error": "not an HTTP request"})
        elif method not in ("GET", "HEAD"):
            status, content_type, body = _json(405, {"error": "GET only"})
        else:
            try:
                status, content_type, body = self.respond(path)
            except Exception:  # a bug in a handler must not kill the worker
                log.exception("http handler failed", extra={"fields": {"path": path}})
                status, content_type, body = _json(500, {"error": "internal error"})
        return _http(status, content_type, b"" if method == "HEAD" else body, len(body))


def _busy() -> bytes:
    status, content_type, body = _json(503, {"error": "busy, try again"})
    return _http(status, content_type, body, len(body))


def _http(status: int, content_type: str, body: bytes, length: int) -> bytes:
    return (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {length}\r\nConnection: close\r\n\r\n"
    ).encode() + body


def _listen(address: tuple[Any, ...], family: socket.AddressFamily) -> socket.socket:
    listener = socket.create_server(address, family=family, backlog=LISTEN_BACKLOG)
    listener.setblocking(False)
    return listener


def _request_line(head: bytes) -> tuple[str, str]:
    """Method and path of ``GET /path?query HTTP/1.1``; empty strings for anything else."""
    parts = head.split(b"\n", 1)[0].decode("latin-1").strip().split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        return "", ""
    return parts[0], parts[1].split("?", 1)[0]


def _json(status: int, body: object) -> tuple[int, str, bytes]:
    return status, "application/json", orjson.dumps(body)
