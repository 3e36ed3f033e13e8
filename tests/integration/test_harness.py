"""The test harness itself: local PostgreSQL cluster, local broker, fixtures and helpers."""

from __future__ import annotations

import time

import psycopg
import pytest
from confluent_kafka import Producer

from cdc_relay.local import ExternalBroker, ExternalPostgres, LocalBroker, LocalPostgres
from tests.conftest import skip_if_external
from tests.kafka_helpers import consume_all, consume_with_grace

pytestmark = pytest.mark.integration

PostgresServer = LocalPostgres | ExternalPostgres
KafkaBroker = LocalBroker | ExternalBroker


def _row(url: str, query: str) -> tuple[object, ...]:
    with psycopg.connect(url) as conn:
        row = conn.execute(query.encode()).fetchone()
    assert row is not None
    return row


def _scalar(url: str, query: str) -> object:
    with psycopg.connect(url) as conn:
        row = conn.execute(query).fetchone()
    assert row is not None
    return row[0]


# ------------------------------------------------------------------------------- PostgreSQL


@pytest.mark.readonly
def test_cluster_is_up_with_logical_wal(postgres: PostgresServer) -> None:
    url = postgres.url()
    assert _scalar(url, "SHOW wal_level") == "logical"
    assert int(str(_scalar(url, "SHOW max_replication_slots"))) >= 2
    if isinstance(postgres, LocalPostgres):
        assert url == f"postgresql://postgres@127.0.0.1:{postgres.port}/postgres"
        assert _scalar(url, "SHOW fsync") == "off"
        assert postgres.log_path.is_file()


@pytest.mark.readonly
def test_the_admin_role_may_run_the_tier(postgres: PostgresServer) -> None:
    """What the tier needs of the server's admin role: create (and drop) databases, roles,
    replication slots; and room for a few relays' slots and walsenders at once."""
    row = _row(
        postgres.url(),
        "SELECT rolsuper, rolcreatedb OR rolsuper, rolcreaterole OR rolsuper, "
        "rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user",
    )
    assert row[1:] == (True, True, True), "CREATEDB, CREATEROLE and REPLICATION (or SUPERUSER)"
    senders, slots = _row(
        postgres.url(),
        "SELECT current_setting('max_wal_senders')::int - (SELECT count(*) FROM "
        "pg_stat_replication), current_setting('max_replication_slots')::int - (SELECT count(*) "
        "FROM pg_replication_slots)",
    )
    assert int(str(senders)) >= 4, "free max_wal_senders: a test runs up to three relays"
    assert int(str(slots)) >= 4, "free max_replication_slots"


@pytest.mark.readonly
def test_broker_answers_metadata(broker: KafkaBroker) -> None:
    from confluent_kafka.admin import AdminClient  # noqa: PLC0415

    metadata = AdminClient({"bootstrap.servers": broker.bootstrap_servers}).list_topics(timeout=10)
    assert metadata.brokers


@pytest.mark.readonly
def test_url_params(postgres: PostgresServer) -> None:
    url = postgres.url("postgres", application_name="harness check")
    assert _scalar(url, "SHOW application_name") == "harness check"


def test_database_fixture_gives_a_fresh_database(database: str, unique: str) -> None:
    with psycopg.connect(database, autocommit=True) as conn:
        row = conn.execute("SELECT current_database()").fetchone()
        assert row is not None
        assert row[0].startswith("test_")
        assert conn.execute(
            "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'"
        ).fetchone() == (0,)
        # A slot in this database must not stop the fixture from dropping it afterwards.
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (f"s_{unique}",))


def test_stop_kill_restart_keep_data(local_postgres: LocalPostgres, unique: str) -> None:
    name = f"harness_{unique}"
    url = local_postgres.create_database(name)
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE TABLE t (id int PRIMARY KEY)")
            conn.execute("INSERT INTO t VALUES (1)")

        local_postgres.stop()
        assert not local_postgres.running
        local_postgres.start()
        assert _scalar(url, "SELECT count(*) FROM t") == 1

        with psycopg.connect(url, autocommit=True) as conn:
            # The cluster runs with synchronous_commit=off: a commit just before a crash is only
            # guaranteed to survive when this session asks for a synchronous commit.
            conn.execute("SET synchronous_commit = on")
            conn.execute("INSERT INTO t VALUES (2)")
        pid_before = _scalar(local_postgres.url(), "SELECT pg_backend_pid()")
        local_postgres.kill()
        assert not local_postgres.running
        local_postgres.start()
        assert _scalar(url, "SELECT count(*) FROM t") == 2
        assert "database system was interrupted" in local_postgres.log_path.read_text()

        port = local_postgres.port
        local_postgres.restart()
        assert local_postgres.port == port
        assert _scalar(url, "SELECT count(*) FROM t") == 2
        assert _scalar(url, "SHOW wal_level") == "logical"
        assert _scalar(local_postgres.url(), "SELECT pg_backend_pid()") != pid_before
    finally:
        local_postgres.drop_database(name)


def test_settings_override_and_context_manager() -> None:
    skip_if_external("starts a cluster of its own")
    with LocalPostgres(settings={"wal_level": "replica", "max_wal_senders": "5"}) as pg:
        directory = pg.directory
        assert _scalar(pg.url(), "SHOW wal_level") == "replica"
        pg.restart()
        assert _scalar(pg.url(), "SHOW wal_level") == "replica"
        assert _scalar(pg.url(), "SHOW max_wal_senders") == "5"
        with (
            psycopg.connect(pg.url(), autocommit=True) as conn,
            pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState, match="wal_level"),
        ):
            conn.execute("SELECT pg_create_logical_replication_slot('s', 'pgoutput')")
    assert not directory.exists()


# ------------------------------------------------------------------------------- broker


def test_standby_streams_and_promotes() -> None:
    """standby_of: a hot standby made by pg_basebackup, streaming through a physical slot on the
    primary, read-only until promote(), then a primary of its own; cleanup removes both."""
    skip_if_external("starts a primary and a standby of its own")
    with LocalPostgres() as primary:
        with psycopg.connect(primary.url(), autocommit=True) as conn:
            conn.execute("CREATE TABLE t (x int)")
            conn.execute("INSERT INTO t VALUES (1)")
        standby = LocalPostgres.standby_of(primary, "harness_standby")
        try:
            standby.start()
            assert standby.port != primary.port
            assert standby.bindir == primary.bindir
            assert standby.in_recovery
            assert not primary.in_recovery
            with psycopg.connect(primary.url(), autocommit=True) as conn:
                conn.execute("INSERT INTO t VALUES (2)")
                slot = conn.execute(
                    "SELECT slot_type, active FROM pg_replication_slots "
                    "WHERE slot_name = 'harness_standby'"
                ).fetchone()
            assert slot == ("physical", True)
            deadline = time.monotonic() + 30
            while _scalar(standby.url(), "SELECT count(*) FROM t") != 2:
                assert time.monotonic() < deadline, "the standby did not replay the insert"
                time.sleep(0.05)
            with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
                _scalar(standby.url(), "INSERT INTO t VALUES (3) RETURNING x")
            primary.kill()
            standby.promote()
            assert not standby.in_recovery
            assert _scalar(standby.url(), "INSERT INTO t VALUES (3) RETURNING x") == 3
            directory = standby.directory
        finally:
            standby.cleanup()
        assert not directory.exists()


def test_broker_round_trip_with_headers(broker: KafkaBroker, unique: str) -> None:
    topic = f"harness-{unique}"
    broker.create_topic(topic, partitions=3)
    producer = Producer(
        {
            "bootstrap.servers": broker.bootstrap_servers,
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 5,
        }
    )
    sent: list[tuple[bytes, bytes, list[tuple[str, bytes]]]] = []
    for i in range(30):
        headers: list[tuple[str, bytes]] = [
            ("event-id", f"id-{i}".encode()),
            ("bin", bytes([0, 255, i])),
        ]
        producer.produce(
            topic, key=f"k{i % 5}".encode(), value=f"v{i}".encode(), headers=list(headers)
        )
        sent.append((f"k{i % 5}".encode(), f"v{i}".encode(), headers))
    assert producer.flush(10) == 0

    records = consume_with_grace(broker.bootstrap_servers, topic, 30, timeout=20, grace=0.5)
    assert len(records) == 30
    by_value = {r.value: r for r in records}
    for key, value, headers in sent:
        record = by_value[value]
        assert record.key == key
        assert record.headers == headers
        assert record.topic == topic
    # One key, one partition, produce order kept.
    for key in {k for k, _, _ in sent}:
        same_key = [r for r in records if r.key == key]
        assert len({r.partition for r in same_key}) == 1
        assert [r.value for r in same_key] == [v for k, v, _ in sent if k == key]
    assert records[0].header("event-id") is not None


def test_topics_are_listed_and_deleted(broker: KafkaBroker, unique: str) -> None:
    """What the ``unique`` fixture uses to remove a test's topics from an external broker."""
    names = [f"harness-del-{unique}-{i}" for i in range(2)]
    for name in names:
        broker.create_topic(name)
    assert set(names) <= set(broker.topics())
    broker.delete_topics([*names, f"harness-never-{unique}"])
    deadline = time.monotonic() + 30
    while set(names) & set(broker.topics()):
        assert time.monotonic() < deadline, "topics still listed 30 s after their deletion"
        time.sleep(0.1)


def test_consume_all_returns_what_it_has_at_timeout(broker: KafkaBroker, unique: str) -> None:
    topic = f"harness-short-{unique}"
    broker.create_topic(topic)
    producer = Producer({"bootstrap.servers": broker.bootstrap_servers})
    producer.produce(topic, value=b"only")
    assert producer.flush(10) == 0
    started = time.monotonic()
    records = consume_all(broker.bootstrap_servers, [topic], 2, timeout=1.5)
    assert [r.value for r in records] == [b"only"]
    assert time.monotonic() - started < 10


def test_broker_pause_resume_and_restart(local_broker: LocalBroker, unique: str) -> None:
    topic = f"harness-fault-{unique}"
    local_broker.create_topic(topic)
    producer = Producer({"bootstrap.servers": local_broker.bootstrap_servers, "acks": "all"})
    producer.produce(topic, value=b"before")
    assert producer.flush(10) == 0

    local_broker.pause()
    producer.produce(topic, value=b"during")
    assert producer.flush(0.5) == 1  # the broker does not answer
    local_broker.resume()
    assert producer.flush(10) == 0
    values = [r.value for r in consume_all(local_broker.bootstrap_servers, topic, 2, timeout=10)]
    assert values == [b"before", b"during"]

    bootstrap = local_broker.bootstrap_servers
    local_broker.restart()
    assert local_broker.bootstrap_servers == bootstrap
    local_broker.create_topic(topic)  # in-memory storage: the restarted broker is empty
    fresh = Producer({"bootstrap.servers": bootstrap})
    fresh.produce(topic, value=b"after")
    assert fresh.flush(10) == 0
    assert [r.value for r in consume_all(bootstrap, topic, 1, timeout=10)] == [b"after"]
