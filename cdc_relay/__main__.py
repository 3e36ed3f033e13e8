"""``python -m cdc_relay``: the relay's entry point."""

import sys

from cdc_relay.cli import main

sys.exit(main())
