"""The health/metrics HTTP server: ``/healthz``, ``/readyz``, ``/metrics``, ``/status``.

A stdlib ``ThreadingHTTPServer`` on its own daemon thread: handlers only read
:class:`RelayStats` and ask the relay whether it is ready, so a slow scrape never blocks the loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import orjson

from cdc_relay.errors import ConfigError
from cdc_relay.observability.stats import RelayStats

log = logging.getLogger(__name__)

LIVENESS_TIMEOUT = 30.0  # seconds without a main-loop iteration before /healthz fails

ReadinessCheck = Callable[[], tuple[bool, str]]


class HealthServer:
    def __init__(
        self,
        port: int,
        stats: RelayStats,
        metrics_text: Callable[[], bytes],
        readiness: ReadinessCheck,
        host: str = "0.0.0.0",  # noqa: S104 - a sidecar is probed from outside its container
    ) -> None:
        self.stats = stats
        self._metrics_text = metrics_text
        self._readiness = readiness
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                status, content_type, body = server.respond(self.path.split("?", 1)[0])
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass  # probes every few seconds are not events of note

        try:
            self._httpd = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:
            raise ConfigError(
                f"cannot serve health and metrics on port {port}: {exc.strerror}. "
                "Choose another CDC_RELAY_HTTP_PORT, or 0 to disable"
            ) from None
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="cdc-relay-http", daemon=True
        )

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    def start(self) -> None:
        self._thread.start()
        log.info("http server listening", extra={"fields": {"port": self.port}})

    def stop(self) -> None:
        if self._thread.is_alive():
            self._httpd.shutdown()  # waits for serve_forever, so only when it runs
        self._httpd.server_close()

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
        return _json(404, {"error": "not found", "paths": ["/healthz", "/readyz", "/metrics"]})


def _json(status: int, body: object) -> tuple[int, str, bytes]:
    return status, "application/json", orjson.dumps(body)
