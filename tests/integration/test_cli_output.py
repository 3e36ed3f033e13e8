"""What ``status`` and ``check`` print from the database, when someone else wrote it.

The lease row names its holder; any role that may UPDATE it (or restore the ``cdc_relay`` schema)
chooses that text. Printed raw, a newline forges another line of the report (``ok   …``), and a
terminal obeys escape sequences (clear the screen, set the title, hide text). Real PostgreSQL,
the commands run as an operator runs them: a child process, its printed lines.
"""

from __future__ import annotations

import re

import psycopg
import pytest

from tests.conftest import KafkaBroker
from tests.integration.relay_support import create_outbox, relay_env
from tests.integration.test_admin import cdc_relay, lines_of

pytestmark = pytest.mark.integration

FORGED = "ok   fake check: all good"
HOLDER = (
    "relay-7\n"
    + FORGED
    + "\r\x1b[2J\x1b]0;owned\x07\x1b[8m hidden \x1b[0m\u202etxt.exe\u2028\x7f\x9b"
    + "x" * 100_000
)
ESCAPED_START = r"relay-7\n" + FORGED + r"\r\x1b[2J\x1b]0;owned\x07\x1b[8m hidden \x1b[0m\u202etxt"
# Anything a terminal may act on or that breaks a line: C0/C1 controls, DEL, line/paragraph
# separators, bidirectional overrides.
UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _tamper_lease(database: str, slot: str) -> None:
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO cdc_relay.leader_lease (slot_name, holder, lock_pid, expires_at) "
            "VALUES (%s, %s, 0, now() + interval '1 hour')",
            (slot, HOLDER),
        )


def test_status_and_check_print_a_tampered_lease_holder_escaped_on_one_line(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    env = relay_env(database, broker.bootstrap_servers, unique)
    create_outbox(database)
    setup = cdc_relay(env, "setup")
    assert setup.returncode == 0, setup.stdout + setup.stderr
    _tamper_lease(database, env["CDC_RELAY_SLOT_NAME"])

    status = cdc_relay(env, "status")
    assert status.returncode == 0, status.stdout + status.stderr
    lines = status.stdout.splitlines()
    assert all(re.match(r"[a-z_.]+: ", line) for line in lines), lines
    assert not UNSAFE.search(status.stdout.replace("\n", ""))
    leader = [line for line in lines if line.startswith("leader: ")]
    assert len(leader) == 1
    assert leader[0].startswith("leader: " + ESCAPED_START)
    assert len(leader[0]) < 2000  # cut, with a marker saying how much
    assert "more characters" in leader[0]
    assert FORGED not in [line.strip() for line in lines]

    check = cdc_relay(env, "check")
    assert not UNSAFE.search(check.stdout.replace("\n", ""))
    found = lines_of(check)  # every line is one check's: ok/FAIL, a name, a colon
    assert "fake check" not in found
    assert found["leadership"].startswith("ok   leadership: relay " + ESCAPED_START)
    assert all(len(line) < 20_000 for line in check.stdout.splitlines())
