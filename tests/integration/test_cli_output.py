"""What the commands print: text from the database someone else wrote, escaped on one line; and
their own words (and libpq's) with no escape sequence at all.

The lease row names its holder; any role that may UPDATE it (or restore the ``cdc_relay`` schema)
chooses that text. Printed raw, a newline forges another line of the report (``ok   …``), and a
terminal obeys escape sequences (clear the screen, set the title, hide text). Real PostgreSQL,
the commands run as an operator runs them: a child process, its printed lines.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import psycopg
import pytest

from cdc_relay.commands.catalog import COMMANDS
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


# -- every command's own output: no escape sequences where nothing hostile was read --------------

# What printable() writes for a character it will not print: in a report made only of the
# relay's and libpq's own words, it means a message kept line breaks or tabs meant for a terminal.
ESCAPED = re.compile(r"\\(?:[nrt]|x[0-9a-f]{2}|u[0-9a-f]{4}|U[0-9a-f]{8})")
UNREACHABLE = "postgresql://relay@127.0.0.1:9/app?connect_timeout=2"


def _without_outer_settings(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m cdc_relay`` with ``env`` as its only ``CDC_RELAY_*`` variables."""
    base = {k: v for k, v in os.environ.items() if not k.upper().startswith("CDC_RELAY_")}
    return subprocess.run(
        [sys.executable, "-m", "cdc_relay", *args],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tempfile.gettempdir(),  # no stray .env file is read
        check=False,
    )


def _no_escapes(result: subprocess.CompletedProcess[str], what: object) -> None:
    output = result.stdout + result.stderr
    assert not ESCAPED.search(output), (what, output[-3000:])
    assert not UNSAFE.search(output.replace("\n", "")), (what, output[-3000:])


@pytest.mark.parametrize(
    "args", [("check",), ("status",), ("setup",), ("sweep", "--once", "--wait", "0")]
)
def test_a_database_that_cannot_be_reached_is_reported_on_one_clean_line(
    args: tuple[str, ...],
) -> None:
    """libpq's message has a line break and a tab before its hint; printed through printable()
    they were a literal ``\\n\\t`` in the middle of the line."""
    env = {
        "CDC_RELAY_DATABASE_URL": UNREACHABLE,
        "CDC_RELAY_KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:9",
    }
    result = _without_outer_settings(env, *args)
    assert result.returncode != 0
    assert "Connection refused" in result.stdout + result.stderr
    assert "Is the server running on that host" in result.stdout + result.stderr
    _no_escapes(result, args)


def test_run_logs_an_unreachable_database_without_escapes() -> None:
    env = {
        **{k: v for k, v in os.environ.items() if not k.upper().startswith("CDC_RELAY_")},
        "CDC_RELAY_DATABASE_URL": UNREACHABLE,
        "CDC_RELAY_KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:9",
        "CDC_RELAY_HTTP_PORT": "0",
    }
    with subprocess.Popen(
        [sys.executable, "-m", "cdc_relay", "run"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tempfile.gettempdir(),
    ) as process:
        assert process.stdout is not None
        lines: list[str] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "Connection refused" in line:
                break
        process.send_signal(signal.SIGTERM)
        rest, _ = process.communicate(timeout=60)
    output = "".join(lines) + rest
    assert "Connection refused" in output, output[-3000:]
    assert not ESCAPED.search(output), output[-3000:]


def test_every_command_prints_its_own_words_without_escapes(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    env = relay_env(database, broker.bootstrap_servers, unique)
    create_outbox(database)
    for args in (
        ("--help",),
        *((entry.name, "--help") for entry in COMMANDS),
        ("settings",),
        ("settings", "--markdown"),
        ("setup",),
        ("check",),
        ("status",),
        ("sweep", "--once", "--wait", "0"),
        ("--slot-name", "Bad-Slot", "status"),
    ):
        result = cdc_relay(env, *args)
        assert result.stdout + result.stderr, args
        _no_escapes(result, args)


def test_status_needs_no_kafka_setting(database: str, broker: KafkaBroker, unique: str) -> None:
    """``status`` reads PostgreSQL and the relay's HTTP port, never Kafka: it runs without
    ``CDC_RELAY_KAFKA_BOOTSTRAP_SERVERS``, and so do ``setup`` and ``sweep``."""
    env = relay_env(database, broker.bootstrap_servers, unique)
    create_outbox(database)
    del env["CDC_RELAY_KAFKA_BOOTSTRAP_SERVERS"]
    setup = _without_outer_settings(env, "setup")
    assert setup.returncode == 0, setup.stdout + setup.stderr
    status = _without_outer_settings(env, "status")
    assert status.returncode == 0, status.stdout + status.stderr
    assert f"slot: slot_{unique}" in status.stdout.splitlines()
    assert "slot_exists: True" in status.stdout.splitlines()
    sweep = _without_outer_settings(env, "sweep", "--once", "--wait", "0")
    assert sweep.returncode == 0, sweep.stdout + sweep.stderr
    # The commands that publish or probe the broker still need it, and say so.
    for command in ("run", "check"):
        refused = _without_outer_settings(env, command)
        assert refused.returncode == 2, (command, refused.stdout + refused.stderr)
        assert refused.stderr == (
            "cdc-relay: invalid configuration: CDC_RELAY_KAFKA_BOOTSTRAP_SERVERS: is required "
            f"by {command}\n"
        )
