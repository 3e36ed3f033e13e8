"""A partitioned outbox (``PARTITION BY RANGE (created_at)``): rows inserted into its partitions are
relayed under the root's mapping (``publish_via_partition_root``) and swept from the partitions;
a table attached with rows of its own keeps them (never published); partitions created, detached
and dropped as a retention tool would lose nothing unpublished."""

from __future__ import annotations

import subprocess
import time

import orjson
import psycopg
import pytest

from tests.conftest import KafkaBroker
from tests.integration.relay_support import (
    Event,
    RelayProcess,
    event_ids,
    new_event,
    relay_env,
    scalar,
    streaming_relay,
    wait_until,
)
from tests.integration.test_admin import cdc_relay, failed, lines_of
from tests.kafka_helpers import consume_all

pytestmark = pytest.mark.integration

PARTITIONED_DDL = """
CREATE TABLE public.outbox (
    id             uuid        NOT NULL,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    event_type     text        NOT NULL,
    payload        jsonb       NOT NULL,
    headers        jsonb       NULL,
    created_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (id, created_at)
) PARTITION BY RANGE (created_at);
CREATE TABLE public.outbox_2024_01 PARTITION OF public.outbox
    FOR VALUES FROM ('2024-01-01') TO ('2024-02-01');
CREATE TABLE public.outbox_2024_02 PARTITION OF public.outbox
    FOR VALUES FROM ('2024-02-01') TO ('2024-03-01');
CREATE TABLE public.outbox_default PARTITION OF public.outbox DEFAULT;
"""

INSERT = (
    "INSERT INTO {table} (id, aggregate_type, aggregate_id, event_type, payload, created_at) "
    "VALUES (%s, %s, %s, %s, %s::jsonb, %s::timestamptz)"
)

SWEEPING = {"sweep_interval": "0.3", "confirm_interval": "0.2", "idle_confirm_interval": "0.3"}


def _create(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(PARTITIONED_DDL.encode())


def write_partitioned(
    url: str, month: str, count: int, prefix: str, table: str = "outbox", batches: int = 2
) -> list[Event]:
    """``count`` rows created in 2024-``month`` (their partition), in ``batches`` transactions."""
    events = [new_event("order", f"{prefix}-{n % 3}", "created", {"n": n}) for n in range(count)]
    statement = INSERT.format(table=table).encode()
    with psycopg.connect(url) as conn:
        for start in range(0, count, max(count // batches, 1)):
            with conn.transaction():
                conn.cursor().executemany(
                    statement,
                    [
                        (
                            e.id,
                            e.aggregate_type,
                            e.aggregate_id,
                            e.event_type,
                            orjson.dumps(e.payload).decode(),
                            f"2024-{month}-15",
                        )
                        for e in events[start : start + max(count // batches, 1)]
                    ],
                )
    return events


def partitioned_rows(url: str, table: str = "outbox") -> set[str]:
    with psycopg.connect(url, autocommit=True) as conn:
        return {str(r[0]) for r in conn.execute(f"SELECT id FROM {table}".encode()).fetchall()}


def test_a_partitioned_outbox_is_relayed_through_its_root_and_swept_from_its_partitions(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    _create(database)
    env = relay_env(database, broker.bootstrap_servers, unique, **SWEEPING)
    setup = cdc_relay(env, "setup")
    assert setup.returncode == 0, setup.stdout + setup.stderr
    via_root = scalar(
        database,
        "SELECT pubviaroot FROM pg_publication WHERE pubname = %s",
        env["CDC_RELAY_PUBLICATION_NAME"],
    )
    assert via_root is True
    check = cdc_relay(env, "check")
    assert not failed(check), check.stdout

    # A table filled before it joins: its rows were never published (they are not the outbox's).
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("CREATE TABLE public.outbox_2024_03 (LIKE public.outbox INCLUDING ALL)")
    prefilled = write_partitioned(database, "03", 4, "prefilled", table="outbox_2024_03", batches=1)
    topic = f"{unique}.order"
    with streaming_relay(env) as relay:
        january = write_partitioned(database, "01", 6, "jan")
        february = write_partitioned(database, "02", 6, "feb")
        later = write_partitioned(database, "07", 6, "jul")  # the default partition
        wait_until(lambda: not partitioned_rows(database), 30, "the rows swept from partitions")

        with psycopg.connect(database, autocommit=True) as conn:
            conn.execute(
                "ALTER TABLE public.outbox DETACH PARTITION public.outbox_default; "
                "ALTER TABLE public.outbox ATTACH PARTITION public.outbox_2024_03 "
                "FOR VALUES FROM ('2024-03-01') TO ('2024-04-01'); "
                # As pg_partman premakes partitions: CREATE TABLE ... PARTITION OF.
                "CREATE TABLE public.outbox_2024_04 PARTITION OF public.outbox "
                "FOR VALUES FROM ('2024-04-01') TO ('2024-05-01')"
            )
        march = write_partitioned(database, "03", 4, "mar")
        april = write_partitioned(database, "04", 4, "apr")
        wait_until(
            lambda: partitioned_rows(database) == event_ids(prefilled),
            30,
            "the rows written after the attach swept, the attached table's own kept",
        )
        time.sleep(1.5)  # a few more passes: still kept
        assert partitioned_rows(database) == event_ids(prefilled)
        assert relay.stop() == 0

    # Rows the relay has not read yet, then their partition detached and dropped (retention).
    unread = write_partitioned(database, "02", 5, "unread")
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("ALTER TABLE public.outbox DETACH PARTITION public.outbox_2024_02")
        conn.execute("DROP TABLE public.outbox_2024_02")
    with streaming_relay(env) as relay:
        records = consume_all(broker.bootstrap_servers, topic, 35, 30)
        assert relay.stop() == 0
    logs = relay.logs()
    published = [(r.header("id") or b"").decode() for r in records]
    assert sorted(published) == sorted(event_ids(january, february, later, march, april, unread))
    assert {r.topic for r in records} == {topic}
    assert partitioned_rows(database) == event_ids(prefilled)
    assert "ignoring inserts of a relation" not in logs


def test_check_and_setup_on_a_partitioned_outbox_with_a_publication_of_its_partitions(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    """A publication created without publish_via_partition_root publishes each partition under
    its own name: the relay would relay none of them. check names the fix that works; the relay
    refuses to start until it is applied."""
    _create(database)
    env = relay_env(database, broker.bootstrap_servers, unique, **SWEEPING)
    publication = env["CDC_RELAY_PUBLICATION_NAME"]
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            f"CREATE PUBLICATION {publication} FOR TABLE public.outbox "
            "WITH (publish = 'insert')".encode()
        )
    check = cdc_relay(env, "check")
    line = lines_of(check)["publication"]
    fix = f"ALTER PUBLICATION {publication} SET (publish_via_partition_root = true)"
    assert line.startswith("FAIL"), line
    assert fix in line, line
    assert "ADD TABLE" not in line, line
    assert "DROP TABLE" not in line, line
    setup = cdc_relay(env, "setup")
    assert setup.returncode == 3, setup.stdout
    assert fix in setup.stdout, setup.stdout
    relay = RelayProcess(env).start()
    try:
        assert relay.wait(30) == 3
    finally:
        relay.close()
    assert fix in relay.logs()

    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(fix.encode())
    assert not failed(cdc_relay(env, "check"))
    with streaming_relay(env) as relay:
        events = write_partitioned(database, "01", 4, "jan")
        records = consume_all(broker.bootstrap_servers, f"{unique}.order", 4, 30)
        assert relay.stop() == 0
    assert sorted((r.header("id") or b"").decode() for r in records) == sorted(event_ids(events))


def test_wal2json_and_a_partitioned_outbox_are_refused_naming_pgoutput(
    database: str, broker: KafkaBroker, unique: str, wal2json_missing: str | None
) -> None:
    """wal2json names a row by its partition, and is asked for the root's rows only: it would
    send none of them. Refused at start and by check."""
    if wal2json_missing:
        pytest.skip(wal2json_missing)
    _create(database)
    env = relay_env(database, broker.bootstrap_servers, unique, plugin="wal2json")
    check = cdc_relay(env, "check")
    line = lines_of(check)["table public.outbox"]
    assert line.startswith("FAIL"), line
    assert "CDC_RELAY_PLUGIN=pgoutput" in line, line
    relay = RelayProcess(env).start()
    try:
        code = relay.wait(30)
    except (TimeoutError, subprocess.TimeoutExpired):
        code = None
    finally:
        relay.close()
    assert code == 3, relay.logs()[-2000:]
    assert "CDC_RELAY_PLUGIN=pgoutput" in relay.logs()
