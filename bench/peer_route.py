"""Runs one mq-bridge route from a configuration file until SIGTERM: the bench's Rust peer.

    PEER_PYTHON bench/peer_route.py CONFIG.json READY_FILE

Executed by the peer's own interpreter (the venv ``bench.peer`` prepares, with only
``mq-bridge`` installed), never imported by the bench: it is the smallest Python program that
runs a route, as mq-bridge's documentation shows. ``Route.start()`` returns once the route is
deployed (connections made, replication started); then READY_FILE is written, so the bench can
read the start-up time and CPU. SIGTERM stops the route (``stop()``, ``join()``) and exits 0.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from types import FrameType

import mq_bridge  # type: ignore[import-not-found]  # the peer's venv only


def main() -> int:
    config, ready = Path(sys.argv[1]), Path(sys.argv[2])
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    route = mq_bridge.Route.from_file(str(config))
    route.start()
    ready.write_text("started\n")
    stop.wait()
    route.stop()
    route.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
