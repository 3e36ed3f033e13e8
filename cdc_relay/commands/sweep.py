"""``python -m cdc_relay sweep [--once [--wait SECONDS]]``: the sweeper as a command of its own.

The relay sweeps by itself (``CDC_RELAY_SWEEP_INTERVAL``); this command is for a sweeper run next
to it, or for a one-off pass. It deletes only what the relay published: with a row filter other
than the relay's it refuses those tables (exit 3), and a position record the server cannot have
stops it before any delete (exit 4). The sweeping is :class:`cdc_relay.sweeper.Sweeper`'s; this
module only wires it to the command line and to SIGTERM / Ctrl-C.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType

from cdc_relay.commands.output import LINE_LIMIT, print_line, printable
from cdc_relay.config import Settings
from cdc_relay.errors import ConfigError, RelayError, SourceSetupError
from cdc_relay.exit_codes import ExitCode
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
                print_line(line)  # names filters read from the database
            # A row filter that is not the relay's: nothing of those tables was deleted.
            return SourceSetupError.exit_code if result.refused else ExitCode.OK
        if settings.sweep_interval <= 0:
            raise ConfigError("CDC_RELAY_SWEEP_INTERVAL is 0 (sweeping disabled); use --once")
    except RelayError as exc:
        print(printable(f"cdc-relay: {exc}", LINE_LIMIT), file=sys.stderr)
        return exc.exit_code
    stop = threading.Event()

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    sweeper.run(stop)
    return ExitCode.OK
