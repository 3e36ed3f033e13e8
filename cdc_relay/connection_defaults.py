"""How long any connection of the relay may stay silent before it is given up: libpq's defaults.

A network partition leaves a TCP connection open on both ends while every packet goes nowhere.
Without help the kernel gives up on unacknowledged data only after ``tcp_retries2`` (about 15
minutes on Linux), and never on a connection that waits for a reply with nothing of its own to
send. A leader's renewal, its position record or a standby's poll would block that long: the old
leader could not even compete again as a standby once the network came back.

So every connection the relay opens (leadership, replication, the position record, the sweeper,
the monitors, the operator commands) gets, unless ``CDC_RELAY_DATABASE_URL`` sets them itself:

- ``tcp_user_timeout``: sent data left unacknowledged this long ends the connection;
- TCP keepalives: an idle connection whose probes go unanswered ends too;
- ``connect_timeout``: a connection attempt into the void ends.

All derive from the leader lease: half of it, so that a leader notices a dead connection well
within its lease (it then steps down, and the lease fences what it could still try to write). The
replication connection gets the same: it belongs to the leader, and once the leader cannot reach
the server for half its lease the session ends anyway. The kernel acknowledges on the server's
behalf, so a busy server never trips these; only a dead network (or host) does.
"""

from __future__ import annotations

import math

from cdc_relay.database_url import with_defaults

CONNECT_TIMEOUT = 10  # seconds per host of the URL, as before these defaults
KEEPALIVES_COUNT = 3


def connection_defaults(lease_timeout: float) -> dict[str, str]:
    """libpq parameters for a lease of ``lease_timeout`` seconds: dead connections are noticed
    within about half of it (libpq's keepalive settings are whole seconds, at least one)."""
    budget = lease_timeout / 2
    idle = max(1, math.floor(budget / 2))
    interval = max(1, math.floor((budget - idle) / KEEPALIVES_COUNT))
    # An interval raised to libpq's one second leaves less of the budget to the idle time.
    idle = max(1, min(idle, math.floor(budget - KEEPALIVES_COUNT * interval)))
    return {
        "keepalives": "1",
        "keepalives_idle": str(idle),
        "keepalives_interval": str(interval),
        "keepalives_count": str(KEEPALIVES_COUNT),
        "tcp_user_timeout": str(max(1000, round(budget * 1000))),
        "connect_timeout": str(CONNECT_TIMEOUT),
    }


def source_url(database_url: str, lease_timeout: float) -> str:
    """``database_url`` with :func:`connection_defaults` for what it does not set. A secret, like
    the URL: never log it (:func:`cdc_relay.database_url.redact_url`)."""
    return with_defaults(database_url, connection_defaults(lease_timeout))
