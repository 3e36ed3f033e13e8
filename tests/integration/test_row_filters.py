"""A framework-shaped outbox (issue 14): row id apart from the event id, one row per destination,
a status column kept by the framework's own poller; relayed with a topic per category and the bare
aggregate id as key (both from stream_name), and swept by its primary key. Real PostgreSQL, the
real broker, the real relay, both output plugins: what reaches Kafka and what rows remain."""

from __future__ import annotations

import uuid

import orjson
import psycopg
import pytest

from cdc_relay.config import Settings
from cdc_relay.row_filter import parse, parse_deparsed
from cdc_relay.sweeper import Sweeper
from tests.conftest import KafkaBroker
from tests.integration.framework_support import framework_columns
from tests.integration.relay_support import RelayProcess, relay_env, relay_settings, scalar
from tests.integration.test_admin import cdc_relay
from tests.kafka_helpers import consume_all, consume_with_grace

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("plugin")]

FRAMEWORK_DDL = """
CREATE TABLE fw_outbox (
    id varchar PRIMARY KEY,
    message_id varchar NOT NULL,
    target_broker varchar NOT NULL,
    stream_name varchar NOT NULL,
    type varchar NOT NULL,
    data json NOT NULL,
    metadata_ bytea,
    correlation_id varchar,
    causation_id varchar,
    status varchar NOT NULL DEFAULT 'pending',
    created_at timestamp without time zone NOT NULL DEFAULT (now() AT TIME ZONE 'UTC'),
    retry_count integer NOT NULL DEFAULT 0,
    UNIQUE (message_id, target_broker)
)
"""
COLUMNS = {
    "id": "message_id",  # the event id, for the id header: not unique on its own
    "aggregate_type": "type",
    "aggregate_id": "stream_name",
    "event_type": "type",
    "payload": "data",
    "headers": None,
}
DESTINATIONS = ("kafka", "rabbit")
CATEGORIES = ("order", "payment")
RELAY = {"confirm_interval": "0.2", "idle_confirm_interval": "0.3", "topic_partitions": "1"}


def _env(database: str, broker: KafkaBroker, unique: str, **extra: str) -> dict[str, str]:
    return relay_env(
        database,
        broker.bootstrap_servers,
        unique,
        outbox_table="public.fw_outbox",
        outbox_columns=orjson.dumps(COLUMNS).decode(),
        topic_template=f"{unique}.shop",
        outbox_row_filter="target_broker = 'kafka'",
        **RELAY,
        **extra,
    )


def _settings(env: dict[str, str], **overrides: object) -> Settings:
    """The relay's settings: its outbox columns as the value they are (the env has them as JSON)."""
    return relay_settings(env, **{"outbox_columns": COLUMNS, **overrides})


def _write(database: str, count: int, categories: tuple[str, ...] = ("order",)) -> list[str]:
    """``count`` events, each one row per destination in one transaction, as the framework's
    unit of work writes them; their event ids in commit order."""
    ids = []
    with psycopg.connect(database) as conn:
        for n in range(count):
            message_id = str(uuid.uuid4())
            ids.append(message_id)
            with conn.transaction():
                for broker in DESTINATIONS:
                    conn.execute(
                        "INSERT INTO fw_outbox (id, message_id, target_broker, stream_name, type, "
                        "data, metadata_) VALUES (%s, %s, %s, %s, 'Shop.OrderPlaced.v1', %s, "
                        "'\\x00ff')",
                        (
                            str(uuid.uuid4()),
                            message_id,
                            broker,
                            f"shop::{categories[n % len(categories)]}-{n}",
                            orjson.dumps({"n": n}).decode(),
                        ),
                    )
    return ids


def _rows(database: str) -> set[tuple[str, str]]:
    with psycopg.connect(database) as conn:
        rows = conn.execute("SELECT message_id, target_broker FROM fw_outbox").fetchall()
    return {(str(m), str(b)) for m, b in rows}


def test_one_row_per_event_is_relayed_and_only_relayed_rows_are_swept(
    database: str, broker: KafkaBroker, unique: str, plugin: str, row_filters_missing: str | None
) -> None:
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(FRAMEWORK_DDL.encode())
    env = _env(database, broker, unique)
    columns = framework_columns(unique, ["correlation_id:header", "stream_name:envelope:stream"])
    env["CDC_RELAY_OUTBOX_COLUMNS"] = orjson.dumps(columns).decode()
    topics = [f"{unique}.{category}" for category in CATEGORIES]
    for topic in topics:
        broker.create_topic(topic, partitions=1)
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        ids = _write(database, 40, CATEGORIES)
        records = consume_all(broker.bootstrap_servers, topics, len(ids), 30, grace=1.5)
        # Sweeping waits for the status the framework's poller sets, and never takes the other
        # destination's rows, whatever their status.
        waiting = Sweeper(_settings(env, sweep_condition="status = 'published'"))
        nothing = waiting.sweep_until_done(timeout=5)
        with psycopg.connect(database, autocommit=True) as conn:
            conn.execute(
                "UPDATE fw_outbox SET status = 'published' WHERE message_id = ANY(%s)",
                (ids[:10],),
            )
        marked = waiting.sweep_until_done(timeout=15)
        waiting.close()
        # Without a sweep condition every relayed row goes; deleted by a two-column key now.
        by_pair = Sweeper(
            _settings(env, outbox_columns={**COLUMNS, "row_key": ["message_id", "target_broker"]})
        )
        rest = by_pair.sweep_until_done(timeout=15)
        by_pair.close()
    finally:
        relay.close()

    for i, topic in enumerate(topics):  # one topic per category, in commit order within it
        arrived = [r for r in records if r.topic == topic]
        assert [r.header("id") for r in arrived] == [m.encode() for m in ids[i::2]], topic
        assert [r.key for r in arrived] == [str(n).encode() for n in range(i, 40, 2)], topic
        envelope = orjson.loads(arrived[0].value or b"")
        assert envelope == {"payload": {"n": i}, "stream": f"shop::{CATEGORIES[i]}-{i}"}
    assert len(records) == len(ids), "one record per event although each has two rows"
    assert nothing.deleted == 0, "no row has the status the sweep condition asks for"
    assert marked.deleted == 10
    row_ids = {str(i) for b in marked.batches for i in b.ids}
    assert len(row_ids) == 10
    assert row_ids.isdisjoint(ids), "rows are named by the primary key, not by the event id"
    assert rest.deleted == 30
    pairs = {k for b in rest.batches for k in b.ids}  # (message_id, target_broker) tuples
    assert pairs == {(i, "kafka") for i in ids[10:]}
    assert _rows(database) == {(i, "rabbit") for i in ids}, "the other destination's rows stay"
    if plugin == "pgoutput" and not row_filters_missing:  # the relay filtered alone otherwise
        text = scalar(
            database,
            "SELECT rowfilter FROM pg_publication_tables WHERE pubname = %s",
            env["CDC_RELAY_PUBLICATION_NAME"],
        )
        found = parse_deparsed(str(text))
        assert found is not None, text
        assert found.same_as(parse("target_broker = 'kafka'")), text


def test_a_publication_filtering_otherwise_is_set_as_configured(
    database: str, broker: KafkaBroker, unique: str, row_filters_missing: str | None
) -> None:
    if row_filters_missing:
        pytest.skip(row_filters_missing)
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(FRAMEWORK_DDL.encode())
        # Made earlier with the other destination's filter: its rows would be relayed and ours
        # never, so the relay would never publish the rows the sweeper then deletes.
        conn.execute(
            f"CREATE PUBLICATION pub_{unique} FOR TABLE fw_outbox "
            "WHERE (target_broker = 'rabbit') WITH (publish = 'insert')".encode()
        )
    env = _env(database, broker, unique)
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        ids = _write(database, 5)
        records = consume_with_grace(
            broker.bootstrap_servers, f"{unique}.shop", len(ids), timeout=30, grace=1.5
        )
    finally:
        relay.close()
    assert [dict(r.headers)["id"].decode() for r in records] == ids
    text = scalar(
        database,
        "SELECT rowfilter FROM pg_publication_tables WHERE pubname = %s",
        f"pub_{unique}",
    )
    found = parse_deparsed(str(text))
    assert found is not None, text
    assert found.same_as(parse("target_broker = 'kafka'")), text
    assert "set the publication's row filters as configured" in relay.logs()


def test_a_row_key_that_is_not_unique_stops_the_relay_at_start(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(FRAMEWORK_DDL.encode())
    columns = {**COLUMNS, "row_key": ["message_id"]}  # one row per destination: not unique
    env = _env(database, broker, unique, sweep_interval="1")
    env["CDC_RELAY_OUTBOX_COLUMNS"] = orjson.dumps(columns).decode()
    relay = RelayProcess(env).start()
    try:
        exit_code = relay.wait(60)
    finally:
        relay.close()
    assert exit_code == 3, relay.logs()
    assert "row_key (message_id) is not unique" in relay.logs()
    assert "CREATE UNIQUE INDEX ON public.fw_outbox (message_id)" in relay.logs()


def test_a_filter_on_a_column_that_is_not_text_stops_the_relay_at_start(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(FRAMEWORK_DDL.encode())
    # '0' and '00' are one integer to PostgreSQL but two texts to the relay: refused.
    env = _env(database, broker, unique)
    env["CDC_RELAY_OUTBOX_ROW_FILTER"] = "retry_count = '0' AND nope IS NULL"
    relay = RelayProcess(env).start()
    try:
        exit_code = relay.wait(60)
    finally:
        relay.close()
    assert exit_code == 3, relay.logs()
    assert "the row filter compares column retry_count as text, but it is integer" in relay.logs()
    assert "the row filter names column nope, which it lacks" in relay.logs()


def test_rows_from_before_a_filter_change_are_never_swept(
    database: str, broker: KafkaBroker, unique: str, row_filters_missing: str | None
) -> None:
    """The relay changes the publication's filter at start (where publications have filters);
    rows committed before may have been decoded under the old filter (and not published), so the
    sweeper leaves them alone."""
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(FRAMEWORK_DDL.encode())
    env = _env(database, broker, unique)
    old = {**env, "CDC_RELAY_OUTBOX_ROW_FILTER": "target_broker = 'rabbit'"}
    relay = RelayProcess(old).start()
    try:
        relay.wait_streaming()
        before = _write(database, 5)
        consume_with_grace(broker.bootstrap_servers, f"{unique}.shop", 5, timeout=30, grace=0.5)
        assert relay.stop() == 0
    finally:
        relay.close()
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        after = _write(database, 5)
        consume_with_grace(broker.bootstrap_servers, f"{unique}.shop", 10, timeout=30, grace=1.0)
        sweeper = Sweeper(_settings(env))
        result = sweeper.sweep_until_done(timeout=15)
        sweeper.close()
    finally:
        relay.close()
    assert "the row filters differ from those the relay last relayed with" in relay.logs()
    if not row_filters_missing:
        assert "set the publication's row filters as configured" in relay.logs()
    assert result.deleted == 5
    remaining = _rows(database)
    assert remaining == {(i, b) for i in before for b in DESTINATIONS} | {
        (i, "rabbit") for i in after
    }


@pytest.mark.parametrize(
    ("sweep_filter", "refused"),
    [
        (None, True),  # the setting left out, as an operator running sweep by hand may
        ("target_broker IN ('kafka', 'rabbit')", True),
        ("target_broker IN ('kafka')", False),  # the relay's filter, written otherwise
    ],
)
def test_a_sweep_deletes_only_rows_of_the_relays_row_filter(
    database: str, broker: KafkaBroker, unique: str, sweep_filter: str | None, refused: bool
) -> None:
    """The relay relays the kafka rows only; ``sweep`` run with another filter deletes nothing
    and exits 3 naming both, with the relay's own (however written) it deletes what was
    published — never the rabbit row, which was not."""
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(FRAMEWORK_DDL.encode())
    env = _env(database, broker, unique)
    broker.create_topic(f"{unique}.shop", partitions=1)
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        ids = _write(database, 1)
        records = consume_with_grace(
            broker.bootstrap_servers, f"{unique}.shop", 1, timeout=30, grace=1.0
        )
        other = {k: v for k, v in env.items() if k != "CDC_RELAY_OUTBOX_ROW_FILTER"}
        if sweep_filter is not None:
            other["CDC_RELAY_OUTBOX_ROW_FILTER"] = sweep_filter
        swept = cdc_relay(other, "sweep", "--once", "--wait", "5")
        remaining = _rows(database)
        relay_sweep = cdc_relay(env, "sweep", "--once", "--wait", "5")
    finally:
        relay.close()
    assert [r.header("id") for r in records] == [ids[0].encode()]
    if refused:
        assert swept.returncode == 3, swept.stdout + swept.stderr
        assert remaining == {(ids[0], "kafka"), (ids[0], "rabbit")}, swept.stdout
        assert "the relay relays public.fw_outbox with row filter target_broker = 'kafka'" in (
            swept.stdout
        )
        assert f"this sweeper's is {sweep_filter or 'none'}" in swept.stdout
        assert "CDC_RELAY_OUTBOX_ROW_FILTER=target_broker = 'kafka'" in swept.stdout
    else:
        assert swept.returncode == 0, swept.stdout + swept.stderr
        assert remaining == {(ids[0], "rabbit")}, swept.stdout
    assert relay_sweep.returncode == 0, relay_sweep.stdout + relay_sweep.stderr
    assert _rows(database) == {(ids[0], "rabbit")}, "the unpublished row stays"


def test_two_relays_of_one_table_each_sweep_only_their_own_rows(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    """One relay (slot, publication) per destination: each slot's record carries its relay's
    filter, so a sweep of one slot deletes that destination's published rows only, and a sweep
    naming one slot with the other's filter is refused."""
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(FRAMEWORK_DDL.encode())
    kafka = _env(database, broker, f"{unique}k")
    rabbit = _env(database, broker, f"{unique}r")
    rabbit["CDC_RELAY_OUTBOX_ROW_FILTER"] = "target_broker = 'rabbit'"
    for env in (kafka, rabbit):
        broker.create_topic(env["CDC_RELAY_TOPIC_TEMPLATE"], partitions=1)
    relays = [RelayProcess(kafka).start(), RelayProcess(rabbit).start()]
    try:
        for relay in relays:
            relay.wait_streaming()
        ids = _write(database, 3)
        for env in (kafka, rabbit):
            consume_with_grace(
                broker.bootstrap_servers, env["CDC_RELAY_TOPIC_TEMPLATE"], 3, timeout=30, grace=0.5
            )
        crossed = cdc_relay(
            {**kafka, "CDC_RELAY_OUTBOX_ROW_FILTER": rabbit["CDC_RELAY_OUTBOX_ROW_FILTER"]},
            "sweep",
            "--once",
            "--wait",
            "3",
        )
        after_crossed = _rows(database)
        own = cdc_relay(kafka, "sweep", "--once", "--wait", "5")
        after_own = _rows(database)
    finally:
        for relay in relays:
            relay.close()
    assert crossed.returncode == 3, crossed.stdout + crossed.stderr
    assert after_crossed == {(i, b) for i in ids for b in DESTINATIONS}
    assert own.returncode == 0, own.stdout + own.stderr
    assert after_own == {(i, "rabbit") for i in ids}


def test_a_publication_refiltered_behind_the_relays_back_is_not_swept(
    database: str, broker: KafkaBroker, unique: str, row_filters_missing: str | None
) -> None:
    """pgoutput applies the publication's filter too: once it says otherwise than the relay,
    rows the relay's filter takes may not have been published, and nothing is swept."""
    if row_filters_missing:
        pytest.skip(row_filters_missing)
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(FRAMEWORK_DDL.encode())
    env = _env(database, broker, unique)
    publication = env["CDC_RELAY_PUBLICATION_NAME"]
    broker.create_topic(f"{unique}.shop", partitions=1)
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        ids = _write(database, 2)
        consume_with_grace(broker.bootstrap_servers, f"{unique}.shop", 2, timeout=30, grace=0.5)
        with psycopg.connect(database, autocommit=True) as conn:
            conn.execute(
                f"ALTER PUBLICATION {publication} SET TABLE fw_outbox "
                "WHERE (target_broker = 'rabbit')".encode()
            )
        swept = cdc_relay(env, "sweep", "--once", "--wait", "3")
    finally:
        relay.close()
    assert swept.returncode == 3, swept.stdout + swept.stderr
    (line,) = [s for s in swept.stdout.splitlines() if s.startswith("refused to sweep")]
    assert f"publication {publication} filters public.fw_outbox with row filter" in line
    assert "'rabbit'" in line
    assert "this sweeper's row filter is target_broker = 'kafka'" in line
    assert _rows(database) == {(i, b) for i in ids for b in DESTINATIONS}
