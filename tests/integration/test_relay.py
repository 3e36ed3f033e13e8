"""The relay against a real PostgreSQL and a real Kafka-protocol broker: the core contract."""

from __future__ import annotations

import random
import threading
from collections import defaultdict

import orjson
import psycopg
import pytest

from cdc_relay.lsn import format_lsn
from tests.conftest import KafkaBroker
from tests.integration.relay_support import (
    RelayProcess,
    create_outbox,
    insert_events,
    new_event,
    relay_env,
    scalar,
    slot_confirmed_lsn,
    wait_until,
    write_transactions,
)
from tests.kafka_helpers import Record, consume_all

# Every test here runs for each output plugin (pgoutput, wal2json).
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("plugin")]

AGGREGATE_TYPES = ("order", "payment")
AGGREGATES_PER_TYPE = 10
WRITERS = 4
TRANSACTIONS_PER_WRITER = 60


def _prepare_business_tables(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE aggregates (type text, id text, version int NOT NULL, "
            "PRIMARY KEY (type, id))"
        )
        conn.execute("CREATE TABLE other (id uuid PRIMARY KEY, note text)")
        for kind in AGGREGATE_TYPES:
            for n in range(AGGREGATES_PER_TYPE):
                conn.execute("INSERT INTO aggregates VALUES (%s, %s, 0)", (kind, f"{kind}-{n}"))


def _writer(
    url: str, seed: int, rolled_back: set[str], foreign: set[str], errors: list[str]
) -> None:
    """Business transactions: bump each aggregate's version and write its event, in one commit.

    The row lock on the aggregate serialises writers per aggregate, so per aggregate the version
    order *is* the commit order — the ground truth the Kafka order is checked against.
    """
    rng = random.Random(seed)
    try:
        with psycopg.connect(url) as conn:
            for n in range(TRANSACTIONS_PER_WRITER):
                kind = rng.choice(AGGREGATE_TYPES)
                targets = sorted(
                    rng.choice(range(AGGREGATES_PER_TYPE)) for _ in range(rng.randint(1, 4))
                )
                events = []
                conn.execute("BEGIN")
                for target in targets:
                    aggregate_id = f"{kind}-{target}"
                    row = conn.execute(
                        "UPDATE aggregates SET version = version + 1 WHERE type = %s AND id = %s "
                        "RETURNING version",
                        (kind, aggregate_id),
                    ).fetchone()
                    assert row is not None
                    event = new_event(
                        kind,
                        aggregate_id,
                        f"{kind}_changed",
                        {"version": row[0], "writer": seed, "n": n, "note": "Zürich 東京 🚀"},
                        {"trace": f"t-{seed}-{n}", "attempt": 1, "tags": ["a", "b"]},
                    )
                    insert_events(conn, [event])
                    events.append(event)
                if rng.random() < 0.2:
                    foreign_id = conn.execute(
                        "INSERT INTO other VALUES (gen_random_uuid(), 'not an event') RETURNING id"
                    ).fetchone()
                    assert foreign_id is not None
                    foreign.add(str(foreign_id[0]))
                if rng.random() < 0.15:
                    conn.execute("ROLLBACK")
                    rolled_back.update(e.id for e in events)
                else:
                    conn.execute("COMMIT")
    except Exception as exc:  # surfaced by the test, not swallowed
        errors.append(repr(exc))


def _by_aggregate(records: list[Record]) -> dict[tuple[str, str], list[int]]:
    versions: dict[tuple[str, str], list[int]] = defaultdict(list)
    for record in records:
        kind = (record.header("aggregate_type") or b"").decode()
        assert record.key is not None
        assert record.value is not None
        versions[(kind, record.key.decode())].append(orjson.loads(record.value)["version"])
    return versions


def test_concurrent_writers_arrive_complete_in_commit_order(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    create_outbox(database)
    _prepare_business_tables(database)
    topics = [f"{unique}.{kind}" for kind in AGGREGATE_TYPES]
    for topic in topics:
        broker.create_topic(topic, partitions=3)

    relay = RelayProcess(relay_env(database, broker.bootstrap_servers, unique)).start()
    try:
        relay.wait_streaming()
        rolled_back: set[str] = set()
        foreign: set[str] = set()
        errors: list[str] = []
        threads = [
            threading.Thread(target=_writer, args=(database, seed, rolled_back, foreign, errors))
            for seed in range(WRITERS)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors

        with psycopg.connect(database) as conn:
            rows = conn.execute(
                "SELECT id::text, aggregate_type, aggregate_id, event_type, payload, headers "
                "FROM outbox"
            ).fetchall()
        committed = {str(r[0]): r for r in rows}
        assert rolled_back, "the workload is meant to include rolled-back transactions"

        records = consume_all(broker.bootstrap_servers, topics, len(committed), 60, grace=1.0)
    finally:
        relay.close()

    received_ids = [(r.header("id") or b"").decode() for r in records]
    assert len(received_ids) == len(set(received_ids)), "no duplicates in a run without faults"
    assert set(received_ids) == set(committed)
    assert not set(received_ids) & rolled_back
    assert not set(received_ids) & foreign

    for record in records:
        _, aggregate_type, aggregate_id, event_type, payload, headers = committed[
            (record.header("id") or b"").decode()
        ]
        assert record.topic == f"{unique}.{aggregate_type}"
        assert record.key == str(aggregate_id).encode()
        assert record.value is not None
        assert orjson.loads(record.value) == payload
        assert record.headers[:3] == [
            ("id", (record.header("id") or b"")),
            ("event_type", str(event_type).encode()),
            ("aggregate_type", str(aggregate_type).encode()),
        ]
        assert isinstance(headers, dict)
        # jsonb orders keys its own way; each entry arrives once, after the three fixed headers
        # and before the relay's position header, the last one.
        assert record.headers[-1][0] == "cdc_relay.position"
        assert sorted(record.headers[3:-1]) == [
            ("attempt", b"1"),  # non-string JSON values travel as their JSON text
            ("tags", b'["a", "b"]'),  # PostgreSQL's jsonb text, unchanged
            ("trace", headers["trace"].encode()),  # strings travel as they are
        ]

    # Per aggregate, Kafka order == commit order: versions 1, 2, 3, ... with no gap.
    versions = _by_aggregate(records)
    final = dict(
        ((str(t), str(i)), int(str(v)))
        for t, i, v in psycopg.connect(database).execute("SELECT type, id, version FROM aggregates")
    )
    for aggregate, seen in versions.items():
        assert seen == list(range(1, final[aggregate] + 1)), aggregate


def test_clean_stop_and_restart_sends_no_duplicates(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    create_outbox(database)
    topic = f"{unique}.order"
    broker.create_topic(topic, partitions=2)
    env = relay_env(database, broker.bootstrap_servers, unique)
    first = [[new_event(aggregate_id=f"a-{i % 7}", payload={"n": i})] for i in range(200)]
    second = [[new_event(aggregate_id=f"a-{i % 7}", payload={"n": 200 + i})] for i in range(150)]

    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        write_transactions(database, first)
        consume_all(broker.bootstrap_servers, [topic], 200, 30)
        assert relay.stop() == 0
        assert "stopped" in relay.logs()
    finally:
        relay.close()

    # The position is confirmed on the way out: the slot and the relay's record agree.
    confirmed = slot_confirmed_lsn(database, f"slot_{unique}")
    recorded = scalar(
        database,
        "SELECT confirmed_lsn::text FROM cdc_relay.slot_position WHERE slot_name = %s",
        f"slot_{unique}",
    )
    assert recorded == format_lsn(confirmed)

    write_transactions(database, second)  # committed while the relay is down
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        records = consume_all(broker.bootstrap_servers, [topic], 350, 30, grace=2.0)
        assert relay.stop() == 0
    finally:
        relay.close()
    ids = [(r.header("id") or b"").decode() for r in records]
    assert len(ids) == 350
    assert set(ids) == {batch[0].id for batch in first + second}


def test_backlog_written_while_stopped_is_relayed_in_order(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    """Events written while the relay is stopped (slot exists) are relayed on start, in order."""
    create_outbox(database)
    topic = f"{unique}.order"
    broker.create_topic(topic, partitions=1)
    env = relay_env(database, broker.bootstrap_servers, unique)
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        assert relay.stop() == 0
    finally:
        relay.close()
    backlog = [[new_event(payload={"n": i}) for i in range(j * 10, j * 10 + 10)] for j in range(50)]
    write_transactions(database, backlog[:-1])
    before_last = int(str(scalar(database, "SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")))
    write_transactions(database, backlog[-1:])
    relay = RelayProcess(env).start()
    try:
        records = consume_all(broker.bootstrap_servers, [topic], 500, 60)
        # Once Kafka has it all, the slot is confirmed past the last transaction.
        wait_until(
            lambda: slot_confirmed_lsn(database, f"slot_{unique}") > before_last,
            15,
            "slot confirmation to pass the acknowledged backlog",
        )
        assert relay.stop() == 0
    finally:
        relay.close()
    assert [orjson.loads(r.value or b"")["n"] for r in records] == list(range(500))
