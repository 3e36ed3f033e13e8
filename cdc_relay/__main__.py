"""``python -m cdc_relay``: the relay's entry point."""

import gc
import sys

# Start-up allocates much and frees next to nothing: no cycle collection while the modules load
# (~10 % of the imports' CPU). cli.main enables it again before any command runs.
gc.disable()

from cdc_relay.cli import main  # noqa: E402 - after the collector is paused

sys.exit(main(prog="python -m cdc_relay"))
