"""``python -m cdc_relay sweep [--once [--wait SECONDS]]``: the sweeper as a command of its own.

The relay sweeps by itself (``CDC_RELAY_SWEEP_INTERVAL``); this command is for a sweeper run next
to it, or for a one-off pass. The sweeping is :class:`cdc_relay.sweeper.Sweeper`'s; this module only
wires it to the command line and to SIGTERM / Ctrl-C.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType

from cdc_relay.config import Settings
from cdc_relay.errors import ConfigError, RelayError
from cdc_relay.sweeper import Sweeper


def sweep(settings: Settings, once: bool, wait: float) -> int:
    """``sweep --once``: one selection, deletes as the relay confirms; else sweep until stopped."""
    try:
        sweeper = Sweeper(settings)
        if once:
            try:
                result = sweeper.sweep_until_done(timeout=max(wait, 0.0))
            finally:
                sweeper.close()
            for line in result.describe():
                print(line)
            return 0
        if settings.sweep_interval <= 0:
            raise ConfigError("CDC_RELAY_SWEEP_INTERVAL is 0 (sweeping disabled); use --once")
    except RelayError as exc:
        print(f"cdc-relay: {exc}", file=sys.stderr)
        return exc.exit_code
    stop = threading.Event()

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    sweeper.run(stop)
    return 0
