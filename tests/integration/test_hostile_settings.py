"""Settings as an attacker or a careless operator gives them: secrets hidden, bad values refused.

A role whose password holds every character a URL parser can trip over (``? # / @ % :`` and
non-ASCII) runs the relay, ``check`` and ``status``; its password must appear in no log line
(plain or JSON), no command output, no ``/status`` answer, no crash output. Invalid connection
strings and options stop the relay with one line and exit 2; a server refusing the role or
database stops it with exit 3; a server that is merely unreachable is retried, and said so.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from cdc_relay.local.lifetime import free_port
from tests.conftest import KafkaBroker
from tests.integration.relay_support import (
    RelayProcess,
    create_outbox,
    http_get,
    new_event,
    relay_env,
    write_transactions,
)
from tests.kafka_helpers import consume_all

pytestmark = pytest.mark.integration

MARKER = "s3cr3tZq"  # in the password only: it must never be printed
PASSWORD = f"Pw?#/@%:é-{MARKER}"


def _url(database: str, user: str, password_in_uri: str, **query: str) -> str:
    params = conninfo_to_dict(database)
    url = (
        f"postgresql://{user}:{password_in_uri}@{params.get('host', '127.0.0.1')}:"
        f"{params.get('port', '5432')}/{params['dbname']}"
    )
    if query:
        url += "?" + "&".join(f"{key}={value}" for key, value in query.items())
    return url


@pytest.fixture
def secret_role(database: str, unique: str) -> Iterator[str]:
    """A superuser role whose password is :data:`PASSWORD`; its URI leaves ``? # :`` unencoded."""
    role = f"relay_{unique}"
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE ROLE {} LOGIN SUPERUSER PASSWORD {}").format(
                sql.Identifier(role), sql.Literal(PASSWORD)
            )
        )
    # libpq reads ?, # and : inside the user info as the password's; / @ % must be encoded.
    in_uri = PASSWORD.replace("%", "%25").replace("/", "%2F").replace("@", "%40")
    try:
        yield _url(database, role, in_uri)
    finally:
        with contextlib.suppress(psycopg.Error), psycopg.connect(database, autocommit=True) as c:
            c.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            c.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def _command(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cdc_relay", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tempfile.gettempdir(),  # no stray .env file, and the installed package
    )


def _assert_secret_free(text: str) -> None:
    assert MARKER not in text
    assert quote(MARKER) not in text
    assert "é-" not in text


def test_a_password_with_url_characters_is_never_shown(
    database: str, broker: KafkaBroker, unique: str, secret_role: str
) -> None:
    create_outbox(database)
    topic = f"{unique}.order"
    broker.create_topic(topic, partitions=1)
    outputs: list[str] = []
    port = free_port()
    for written, log_format in enumerate(("plain", "json"), start=1):
        env = relay_env(
            secret_role,
            broker.bootstrap_servers,
            unique,
            http_port=str(port),
            http_host="127.0.0.1",
            log_format=log_format,
        )
        relay = RelayProcess(env).start()
        try:
            relay.wait_streaming()
            write_transactions(database, [[new_event("order")]])
            # Relayed before the stop below (a stop does not wait for what was not read yet).
            assert len(consume_all(broker.bootstrap_servers, [topic], written, 30)) == written
            status, body = http_get(port, "/status")
            assert status == 200
            outputs.append(body.decode())
            status_command = _command(env, "status")
            assert status_command.returncode == 0, status_command.stdout + status_command.stderr
            outputs += [status_command.stdout, status_command.stderr]
            assert relay.stop() == 0
        finally:
            relay.close()
        logs = relay.logs()
        assert "starting" in logs
        assert "password=***" in logs, "the start-up line shows the URL as libpq reads it"
        outputs.append(logs)
    check = _command(relay_env(secret_role, broker.bootstrap_servers, unique), "check")
    outputs += [check.stdout, check.stderr]
    assert "password=***" in check.stdout
    assert len(consume_all(broker.bootstrap_servers, [topic], 2, 30)) == 2
    for text in outputs:
        _assert_secret_free(text)


@pytest.mark.parametrize(
    ("password_in_uri", "query"),
    [
        (f"Pw%zz-{MARKER}", {}),  # libpq refuses the URI and its message quotes it
        (f"Pw@{MARKER}", {}),  # an unencoded @: libpq would read the rest as the host
        (f"Pw/{MARKER}", {}),  # an unencoded /: libpq would read the rest as the database
        (f"Pw {MARKER}", {}),
        (f"Pw-{MARKER}", {"sslmode": "bogus"}),
        (f"Pw-{MARKER}", {"port": "x"}),
    ],
)
@pytest.mark.parametrize("command", ["run", "check", "status", "sweep"])
def test_an_invalid_connection_string_exits_2_with_one_line_and_no_echo(
    database: str,
    broker: KafkaBroker,
    unique: str,
    password_in_uri: str,
    query: dict[str, str],
    command: str,
) -> None:
    url = _url(database, "relay", password_in_uri, **query)
    env = relay_env(url, broker.bootstrap_servers, unique, sweep_interval="5")
    result = _command(env, command)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert len(lines) == 1, lines
    assert "CDC_RELAY_DATABASE_URL" in lines[0]
    assert "Traceback" not in lines[0]
    _assert_secret_free(lines[0])


def test_the_database_url_from_a_file(
    database: str, broker: KafkaBroker, unique: str, secret_role: str, tmp_path: Path
) -> None:
    create_outbox(database)
    topic = f"{unique}.order"
    broker.create_topic(topic, partitions=1)
    url_file = tmp_path / "database_url"
    url_file.write_text(secret_role + "\n", encoding="utf-8")
    props_file = tmp_path / "kafka.properties"
    props_file.write_text(f"# from a secret\nlinger.ms=1\nsasl.password={MARKER}\n", "utf-8")
    env = relay_env("", broker.bootstrap_servers, unique)
    del env["CDC_RELAY_DATABASE_URL"]
    env |= {
        "CDC_RELAY_DATABASE_URL_FILE": str(url_file),
        "CDC_RELAY_KAFKA_PRODUCER_CONFIG_FILE": str(props_file),
    }
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        write_transactions(database, [[new_event("order")]])
        assert len(consume_all(broker.bootstrap_servers, [topic], 1, 30)) == 1
        assert relay.stop() == 0
    finally:
        relay.close()
    _assert_secret_free(relay.logs())


def test_a_missing_database_is_permanent_exit_3(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    params = conninfo_to_dict(database)
    url = (
        f"postgresql://{params.get('user', 'postgres')}:{MARKER}@{params['host']}:"
        f"{params['port']}/no_such_db_{unique}"
    )
    relay = RelayProcess(relay_env(url, broker.bootstrap_servers, unique)).start()
    try:
        assert relay.wait(60) == 3
    finally:
        relay.close()
    logs = relay.logs()
    assert "does not exist" in logs
    assert "permanent" in logs
    assert "Traceback" not in logs
    _assert_secret_free(logs)


def test_an_unreachable_server_is_retried_and_said_so(broker: KafkaBroker, unique: str) -> None:
    url = f"postgresql://relay:{MARKER}@127.0.0.1:{free_port()}/app"
    env = relay_env(url, broker.bootstrap_servers, unique, reconnect_max_backoff="0.5")
    relay = RelayProcess(env).start()
    try:
        relay.wait_for_log("retrying", timeout=30)
        time.sleep(1.5)
        assert relay.proc is not None
        assert relay.proc.poll() is None, "a refused connection is transient"
        assert relay.logs().count("retrying") >= 2
        assert relay.stop() == 0
    finally:
        relay.close()
    logs = relay.logs()
    assert "Connection refused" in logs
    _assert_secret_free(logs)


def test_an_invalid_kafka_property_exits_2_with_one_line(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    env = relay_env(
        database,
        broker.bootstrap_servers,
        unique,
        kafka_producer_config='{"linger.ms": "soon", "sasl.password": "' + MARKER + '"}',
    )
    result = _command(env, "run")
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert "CDC_RELAY_KAFKA_PRODUCER_CONFIG" in lines[0]
    _assert_secret_free(result.stdout + result.stderr)


def test_sigusr1_prints_stacks_and_run_carries_on(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    create_outbox(database)
    topic = f"{unique}.order"
    broker.create_topic(topic, partitions=1)
    relay = RelayProcess(relay_env(database, broker.bootstrap_servers, unique)).start()
    try:
        relay.wait_streaming()
        assert relay.proc is not None
        relay.proc.send_signal(signal.SIGUSR1)
        relay.wait_for_log("Current thread", timeout=10)
        time.sleep(0.5)
        assert relay.proc.poll() is None, "SIGUSR1 must not end the relay"
        write_transactions(database, [[new_event("order")]])
        assert len(consume_all(broker.bootstrap_servers, [topic], 1, 30)) == 1
        assert relay.stop() == 0
    finally:
        relay.close()
    logs = relay.logs()
    assert 'File "' in logs
    assert "cdc_relay" in logs.split("Current thread", 1)[1]
