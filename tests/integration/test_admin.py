"""``python -m cdc_relay setup`` and ``check`` against a real PostgreSQL and broker, run the way an
operator runs them: a child process, environment variables, printed lines, the exit code."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator

import orjson
import psycopg
import pytest

from cdc_relay.local import LocalPostgres
from cdc_relay.local.lifetime import free_port
from cdc_relay.prerequisites.server import OUTPUT_PLUGIN_SETTING
from cdc_relay.publisher import admin_config
from cdc_relay.replication.stream import ReplicationStream
from tests.conftest import KafkaBroker, skip_if_external
from tests.integration.relay_support import (
    OUTBOX_DDL,
    RelayProcess,
    create_outbox,
    new_event,
    relay_env,
    scalar,
    wait_until,
    write_transactions,
)
from tests.kafka_helpers import consume_all

pytestmark = pytest.mark.integration

SETUP_ITEMS = ("table", "state table", "publication", "replication slot")
# With table-less messages on, setup also makes outbox_emit the one way to emit them.
SETUP_ITEMS_WITH_MESSAGES = (
    "table",
    "state table",
    "function",
    "privileges",
    "publication",
    "replication slot",
)


def cdc_relay(
    env: dict[str, str], *args: str, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cdc_relay", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tempfile.gettempdir(),  # no stray .env file is read
        check=False,
    )


def lines_of(result: subprocess.CompletedProcess[str]) -> dict[str, str]:
    """``check`` output as {check name: whole line}."""
    found: dict[str, str] = {}
    for line in result.stdout.splitlines():
        assert line.startswith(("ok   ", "FAIL ")), line
        found[line[5:].split(":", 1)[0]] = line
    return found


def failed(result: subprocess.CompletedProcess[str]) -> dict[str, str]:
    return {name: line for name, line in lines_of(result).items() if line.startswith("FAIL")}


@pytest.fixture
def env(database: str, broker: KafkaBroker, unique: str) -> dict[str, str]:
    return relay_env(database, broker.bootstrap_servers, unique)


# -- setup ------------------------------------------------------------------------------------


def test_setup_on_an_empty_database_then_the_relay_works(
    database: str, broker: KafkaBroker, unique: str, env: dict[str, str]
) -> None:
    result = cdc_relay(env, "setup", "--create-outbox")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["created"] * len(SETUP_ITEMS)
    for line, item in zip(lines, SETUP_ITEMS, strict=True):
        assert line.startswith(f"created {item} "), line
    assert f"replication slot slot_{unique} (pgoutput) at " in lines[-1]

    topic = f"{unique}.order"
    broker.create_topic(topic, partitions=3)
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        event = new_event("order", "o-1", "created", {"total": 3})
        write_transactions(database, [[event]])
        records = consume_all(broker.bootstrap_servers, topic, 1, timeout=30)
    finally:
        relay.stop()
        relay.close()
    assert [r.header("id") for r in records] == [event.id.encode()]
    assert "created replication slot" not in relay.logs(), "setup's slot and record were used"


@pytest.mark.parametrize("messages", [False, True])
def test_setup_twice_is_idempotent(env: dict[str, str], messages: bool) -> None:
    env = {**env, "CDC_RELAY_MESSAGES": str(messages).lower()}
    items = SETUP_ITEMS_WITH_MESSAGES if messages else SETUP_ITEMS
    first = cdc_relay(env, "setup", "--create-outbox")
    assert first.returncode == 0, first.stdout + first.stderr
    for line, item in zip(first.stdout.splitlines(), items, strict=True):
        assert line.startswith(f"created {item} "), line
    second = cdc_relay(env, "setup", "--create-outbox")
    assert second.returncode == 0, second.stdout + second.stderr
    lines = second.stdout.splitlines()
    assert len(lines) == len(items)
    for line, item in zip(lines, items, strict=True):
        assert line.startswith(f"exists  {item} "), line
    # The slot is the same one: same position printed.
    assert first.stdout.splitlines()[-1].split()[-1] == lines[-1].split()[-1]


def test_setup_gives_the_publication_the_configured_row_filter(
    database: str, env: dict[str, str], row_filters_missing: str | None
) -> None:
    if row_filters_missing:
        pytest.skip(row_filters_missing)
    filtered = {**env, "CDC_RELAY_OUTBOX_ROW_FILTER": "aggregate_type IN ('order', 'invoice')"}
    assert cdc_relay(filtered, "setup", "--create-outbox").returncode == 0
    publication = env["CDC_RELAY_PUBLICATION_NAME"]
    query = "SELECT rowfilter FROM pg_publication_tables WHERE pubname = %s"
    created = scalar(database, query, publication)
    assert created == "(aggregate_type = ANY (ARRAY['order'::text, 'invoice'::text]))"
    assert not failed(cdc_relay(filtered, "check"))

    # Another setting: check names the difference, setup changes it, check is content again.
    other = {**env, "CDC_RELAY_OUTBOX_ROW_FILTER": "aggregate_type = 'order'"}
    problem = failed(cdc_relay(other, "check"))["publication"]
    assert "public.outbox is published with row filter" in problem, problem
    assert "the relay sets them when it starts" in problem, problem
    result = cdc_relay(other, "setup")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"changed publication {publication}: public.outbox is published" in result.stdout
    assert scalar(database, query, publication) == "(aggregate_type = 'order'::text)"
    assert not failed(cdc_relay(other, "check"))
    # No filter in the settings: the publication's goes too.
    assert cdc_relay(env, "setup").returncode == 0
    assert scalar(database, query, publication) is None


def test_setup_will_not_recreate_a_lost_slot(database: str, env: dict[str, str]) -> None:
    assert cdc_relay(env, "setup", "--create-outbox").returncode == 0
    slot = env["CDC_RELAY_SLOT_NAME"]
    scalar(database, "SELECT pg_drop_replication_slot(%s)", slot)
    result = cdc_relay(env, "setup")
    assert result.returncode == 4, result.stdout
    last = result.stdout.splitlines()[-1]
    assert last.startswith(
        f"FAIL replication slot {slot}: replication slot '{slot}' is missing, but the relay had "
        "confirmed up to"
    )
    assert "No new slot is created over that gap" in last
    assert "CDC_RELAY_ALLOW_SLOT_RESET=true" in last
    assert (
        scalar(database, "SELECT count(*) FROM pg_replication_slots WHERE slot_name = %s", slot)
        == 0
    )


def test_setup_create_outbox_is_only_for_the_default_table(env: dict[str, str]) -> None:
    result = cdc_relay({**env, "CDC_RELAY_OUTBOX_TABLE": "app.events"}, "setup", "--create-outbox")
    assert result.returncode == 2
    assert result.stdout.startswith("FAIL table: --create-outbox creates public.outbox")


def test_outbox_emit_writes_a_transactional_message(database: str, env: dict[str, str]) -> None:
    env = {**env, "CDC_RELAY_MESSAGES": "true"}
    assert cdc_relay(env, "setup", "--create-outbox").returncode == 0
    peek_slot = f"peek_{uuid.uuid4().hex[:8]}"
    publication = env["CDC_RELAY_PUBLICATION_NAME"]
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (peek_slot,))
        conn.execute("SET synchronous_commit = on")  # peeking reads flushed WAL only
        row = conn.execute("SELECT outbox_emit('order', 'o-1', 'created', '{\"a\": 1}')").fetchone()
        assert row is not None
        event_id = row[0]
        assert isinstance(event_id, uuid.UUID)
        with pytest.raises(psycopg.errors.NullValueNotAllowed):
            conn.execute("SELECT outbox_emit('order', '', 'created', '{}')")
        changes = conn.execute(
            "SELECT data FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, "
            "'proto_version', '1', 'publication_names', %s, 'messages', 'true')",
            (peek_slot, publication),
        ).fetchall()
        stored = conn.execute("SELECT count(*) FROM outbox").fetchone()
    kinds = [bytes(c[0])[:1] for c in changes]
    assert kinds == [b"B", b"M", b"C"], "one transaction carrying one message"
    message = bytes(changes[1][0])
    assert message[1] & 1, "transactional"
    prefix_end = message.index(b"\0", 10)
    assert message[10:prefix_end] == b"outbox"
    length = int.from_bytes(message[prefix_end + 1 : prefix_end + 5], "big")
    content = orjson.loads(message[prefix_end + 5 : prefix_end + 5 + length])
    assert content == {
        "id": str(event_id),
        "aggregate_type": "order",
        "aggregate_id": "o-1",
        "event_type": "created",
        "payload": {"a": 1},
        "headers": None,
    }
    assert stored == (0,), "nothing is stored in a table"


# -- check ------------------------------------------------------------------------------------


def test_check_passes_on_a_set_up_database(env: dict[str, str], plugin: str) -> None:
    assert cdc_relay(env, "setup", "--create-outbox").returncode == 0
    result = cdc_relay(env, "check")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = lines_of(result)
    assert all(line.startswith("ok   ") for line in lines.values()), result.stdout
    expected = {
        "settings",
        "connection",
        "server version",
        "wal_level",
        "replication slots",
        "wal senders",
        "privileges",
        "table public.outbox",
        "state table",
        "publication",
        "slot",
        "messages",
        "leadership",
        "waits",
        "failover",
        "broker",
        "topics",
        "transactions",
    }
    if plugin == "wal2json":
        expected.add("wal2json")
        assert lines["wal2json"] == "ok   wal2json: installed"
    restricted = scalar(
        env["CDC_RELAY_DATABASE_URL"], "SELECT current_setting(%s, true)", OUTPUT_PLUGIN_SETTING
    )
    if restricted is not None:  # a server that restricts output plugins (newest minors)
        expected.add("output plugin")
        assert (
            lines["output plugin"]
            == f"ok   output plugin: {plugin}, which {OUTPUT_PLUGIN_SETTING} lists"
        )
    assert set(lines) == expected
    assert f"{env['CDC_RELAY_SLOT_NAME']} ({plugin}) idle" in lines["slot"]
    assert lines["leadership"].startswith("ok   leadership: no relay has led this slot yet")
    assert lines["messages"].startswith("ok   messages: off (CDC_RELAY_MESSAGES)")
    # Failover slots came with PostgreSQL 17: before, check says what a failover does.
    assert "failover slot" in lines["failover"] or "has no failover slots" in lines["failover"]


def test_a_misspelt_setting_is_named_by_every_command_and_fails_check(
    env: dict[str, str],
) -> None:
    typo = {"CDC_RELAY_SWEEP_CONDITON": "status = 'published'"}
    setup = cdc_relay({**env, **typo}, "setup", "--create-outbox")
    assert setup.returncode == 0, setup.stdout + setup.stderr
    warning = (
        "CDC_RELAY_SWEEP_CONDITON is not a setting and is ignored; "
        "did you mean CDC_RELAY_SWEEP_CONDITION?"
    )
    assert warning in setup.stderr
    result = cdc_relay({**env, **typo}, "check")
    assert result.returncode == 1, result.stdout
    assert failed(result) == {"settings": f"FAIL settings: {warning}"}
    assert "settings" not in failed(cdc_relay(env, "check"))


@pytest.fixture
def replica_server() -> Iterator[LocalPostgres]:
    skip_if_external("starts a cluster of its own with wal_level=replica")
    server = LocalPostgres(settings={"wal_level": "replica"})
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


def test_check_fails_when_wal_level_is_not_logical(
    replica_server: LocalPostgres, broker: KafkaBroker, unique: str
) -> None:
    url = replica_server.url()
    create_outbox(url)
    result = cdc_relay(relay_env(url, broker.bootstrap_servers, unique), "check")
    assert result.returncode == 1
    line = failed(result)["wal_level"]
    assert line == (
        "FAIL wal_level: wal_level is 'replica', logical decoding needs 'logical': run ALTER "
        "SYSTEM SET wal_level = logical; then restart PostgreSQL"
    )


def test_check_fails_without_a_publication(database: str, env: dict[str, str]) -> None:
    create_outbox(database)
    result = cdc_relay(env, "check")
    assert result.returncode == 1
    publication = env["CDC_RELAY_PUBLICATION_NAME"]
    assert set(failed(result)) == {"publication"}, result.stdout
    assert failed(result)["publication"] == (
        f"FAIL publication: {publication} does not exist: run python -m cdc_relay setup (the "
        "relay also creates it when it starts), or as the tables' owner: CREATE PUBLICATION "
        f'"{publication}" FOR TABLE "public"."outbox" WITH '
        "(publish = 'insert', publish_via_partition_root = true);"
    )


def test_check_fails_for_a_publication_that_publishes_too_much(
    database: str, env: dict[str, str]
) -> None:
    create_outbox(database)
    publication = env["CDC_RELAY_PUBLICATION_NAME"]
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("CREATE TABLE other (id int PRIMARY KEY)")
        conn.execute(f"CREATE PUBLICATION {publication} FOR TABLE outbox, other".encode())
    result = cdc_relay(env, "check")
    assert result.returncode == 1
    line = failed(result)["publication"]
    assert f"run ALTER PUBLICATION {publication} DROP TABLE public.other" in line
    assert "publishes update, delete, truncate" in line
    assert f"run ALTER PUBLICATION {publication} SET (publish = 'insert')" in line


def test_relay_and_check_refuse_a_publication_lacking_the_outbox(
    database: str, env: dict[str, str]
) -> None:
    create_outbox(database)
    publication = env["CDC_RELAY_PUBLICATION_NAME"]
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("CREATE TABLE other (id int PRIMARY KEY)")
        conn.execute(
            f"CREATE PUBLICATION {publication} FOR TABLE other WITH (publish = 'insert')".encode()
        )
    fix = f"it lacks public.outbox: run ALTER PUBLICATION {publication} ADD TABLE public.outbox"
    result = cdc_relay(env, "check")
    assert result.returncode == 1
    assert fix in failed(result)["publication"]
    # The relay's start runs the same check (the coverage part of it) and stops at it.
    relay = RelayProcess(env).start()
    try:
        assert relay.wait(30) == 3
        assert f"publication: {publication}: {fix}" in relay.logs()
    finally:
        relay.close()


def test_check_fails_for_a_missing_column(database: str, env: dict[str, str]) -> None:
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(OUTBOX_DDL.replace("    event_type     text        NOT NULL,\n", "").encode())
        columns = conn.execute(
            "SELECT count(*) FROM information_schema.columns WHERE table_name = 'outbox' "
            "AND column_name = 'event_type'"
        ).fetchone()
    assert columns == (0,)
    result = cdc_relay(env, "check")
    assert result.returncode == 1
    assert failed(result)["table public.outbox"] == (
        "FAIL table public.outbox: lacks column(s) event_type: add them, or map the names with "
        "CDC_RELAY_OUTBOX_COLUMNS"
    )


def test_check_fails_when_ids_are_not_unique_and_the_sweeper_is_on(
    database: str, env: dict[str, str]
) -> None:
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(OUTBOX_DDL.replace("PRIMARY KEY", "").encode())
    env = {**env, "CDC_RELAY_SWEEP_INTERVAL": "5"}  # relay_env turns the sweeper off
    assert cdc_relay(env, "setup").returncode == 0
    result = cdc_relay(env, "check")
    assert result.returncode == 1
    assert set(failed(result)) == {"table public.outbox"}, result.stdout
    assert failed(result)["table public.outbox"] == (
        "FAIL table public.outbox: public.outbox has no primary key and column id no unique "
        "index, and the sweeper deletes by a key that names one row: add a primary key, set "
        '"row_key" to unique columns in CDC_RELAY_OUTBOX_COLUMNS, or run CREATE UNIQUE INDEX ON '
        "public.outbox (id) (or CDC_RELAY_SWEEP_INTERVAL=0)"
    )
    assert cdc_relay({**env, "CDC_RELAY_SWEEP_INTERVAL": "0"}, "check").returncode == 0


@contextlib.contextmanager
def holding_slot(database: str, env: dict[str, str]) -> Iterator[int]:
    """Another process streaming from the relay's slot, for the test's duration; yields its pid."""
    slot = env["CDC_RELAY_SLOT_NAME"]
    holder = ReplicationStream(
        database,
        slot,
        0,
        {"proto_version": "1", "publication_names": f'"{env["CDC_RELAY_PUBLICATION_NAME"]}"'},
    )
    holder.open()
    query = "SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s"
    try:
        wait_until(lambda: scalar(database, query, slot) is not None, 10, "the slot to be held")
        yield int(str(scalar(database, query, slot)))
    finally:
        holder.close()


def test_check_fails_when_the_slot_is_held_by_another_process(
    database: str, env: dict[str, str]
) -> None:
    assert cdc_relay(env, "setup", "--create-outbox").returncode == 0
    slot = env["CDC_RELAY_SLOT_NAME"]
    with holding_slot(database, env) as pid:
        result = cdc_relay(env, "check")
    assert result.returncode == 1
    assert set(failed(result)) == {"slot"}, result.stdout
    assert failed(result)["slot"].startswith(
        f"FAIL slot: {slot} is in use by process {pid} (application_name 'cdc-relay', "
    )
    assert "Stop it before starting this relay" in failed(result)["slot"]


def test_check_fails_when_the_broker_is_unreachable(database: str, unique: str) -> None:
    env = relay_env(database, f"127.0.0.1:{free_port()}", unique)
    assert cdc_relay(env, "setup", "--create-outbox").returncode == 0
    started = time.monotonic()
    result = cdc_relay(env, "check")
    assert result.returncode == 1
    assert set(failed(result)) == {"broker"}, result.stdout
    line = failed(result)["broker"]
    assert line.startswith(
        f"FAIL broker: cannot reach Kafka at {env['CDC_RELAY_KAFKA_BOOTSTRAP_SERVERS']}"
    )
    assert "Connection refused" in line
    assert "topics" not in lines_of(result)
    assert time.monotonic() - started < 20


def test_check_fails_for_a_missing_dead_letter_topic_when_topics_are_not_created(
    env: dict[str, str],
) -> None:
    assert cdc_relay(env, "setup", "--create-outbox").returncode == 0
    result = cdc_relay({**env, "CDC_RELAY_MISSING_TOPICS": "fail"}, "check")
    assert result.returncode == 1
    assert failed(result)["topics"].startswith(
        f"FAIL topics: dead-letter topic {env['CDC_RELAY_DEAD_LETTER_TOPIC']} does not exist and "
        "CDC_RELAY_MISSING_TOPICS=fail"
    )


def test_admin_client_configuration_keeps_connection_properties_only() -> None:
    producer = {
        "bootstrap.servers": "k:9093",
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "relay",
        "sasl.password": "secret",
        "ssl.ca.location": "/ca.pem",
        "client.id": "cdc-relay",
        "acks": "all",
        "enable.idempotence": "true",
        "linger.ms": "5",
        "compression.type": "lz4",
        "queue.buffering.max.messages": "20000",
        "message.timeout.ms": "0",
    }
    assert admin_config(producer) == {
        "bootstrap.servers": "k:9093",
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "relay",
        "sasl.password": "secret",
        "ssl.ca.location": "/ca.pem",
        "client.id": "cdc-relay",
    }


# The relay itself refuses to start on the same broken prerequisites, with exit code 3 and the
# statement that fixes it (it runs the same preflight at every session start).


def test_relay_refuses_wal_level_replica(
    replica_server: LocalPostgres, broker: KafkaBroker, unique: str
) -> None:
    url = replica_server.url()
    create_outbox(url)
    relay = RelayProcess(relay_env(url, broker.bootstrap_servers, unique)).start()
    try:
        assert relay.wait(30) == 3
        assert "ALTER SYSTEM SET wal_level = logical" in relay.logs()
    finally:
        relay.close()


def test_relay_refuses_a_missing_table(database: str, env: dict[str, str]) -> None:
    relay = RelayProcess(env).start()
    try:
        assert relay.wait(30) == 3
        assert "table public.outbox: does not exist" in relay.logs()
    finally:
        relay.close()


def test_relay_refuses_a_slot_held_by_another_process(database: str, env: dict[str, str]) -> None:
    assert cdc_relay(env, "setup", "--create-outbox").returncode == 0
    slot = env["CDC_RELAY_SLOT_NAME"]
    with holding_slot(database, env):
        # The relay gives a holder the lease timeout to let go (default 15 s) before it refuses:
        # the same wait and refusal, with the shorter lease of the high-availability tests (the
        # connection timeouts derive from it: half of it, the renewal's a quarter).
        relay = RelayProcess(
            {
                **env,
                "CDC_RELAY_LEADER_LEASE_TIMEOUT": "4",
                "CDC_RELAY_LEADER_RENEW_INTERVAL": "1",
            }
        ).start()
        try:
            assert relay.wait(30) == 3
            assert f"slot: {slot} is in use by process" in relay.logs()
        finally:
            relay.close()
