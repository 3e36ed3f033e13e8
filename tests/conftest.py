"""Shared fixtures: a PostgreSQL server, a Kafka-protocol broker, fresh databases, unique names.

By default the session starts a throw-away :class:`~cdc_relay.local.LocalPostgres` cluster and a
:class:`~cdc_relay.local.LocalBroker` (Tansu). Point the tests at services you run yourself with

- ``CDC_RELAY_TEST_DATABASE_URL``: admin URL of a PostgreSQL server with ``wal_level=logical``
  (a superuser, or a role with CREATEDB and REPLICATION);
- ``CDC_RELAY_TEST_KAFKA_BOOTSTRAP_SERVERS``: e.g. Apache Kafka from docker-compose.

Tests that stop, kill or restart a service request ``local_postgres`` / ``local_broker``: those
skip when the corresponding service is external, and so does a test that starts a server of its
own (:func:`skip_if_external`). Against external services every test cleans up after itself: its
database (with its slots and publications) is dropped, the roles it created are dropped, and the
topics whose names carry its :func:`unique` string are deleted. Tests marked ``readonly`` read
from the services and change nothing: run them first against a cluster you care about.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from cdc_relay.local import ExternalBroker, ExternalPostgres, LocalBroker, LocalPostgres
from cdc_relay.local.relay_process import RelayProcess

DATABASE_URL_ENV = "CDC_RELAY_TEST_DATABASE_URL"
BOOTSTRAP_SERVERS_ENV = "CDC_RELAY_TEST_KAFKA_BOOTSTRAP_SERVERS"

PostgresServer = LocalPostgres | ExternalPostgres
KafkaBroker = LocalBroker | ExternalBroker

# Commits are asynchronous on the throw-away cluster (LocalPostgres: synchronous_commit=off), and
# a logical walsender sends only flushed WAL: each committed row would wait for the WAL writer's
# next round (every 200 ms by default) before the relay could see it. 10 ms keeps that wait out
# of every write-then-read-back step of the tests; the relay reads the same WAL.
LOCAL_POSTGRES_SETTINGS = {"wal_writer_delay": "10ms"}

# Hypothesis's default deadline (200 ms per example) fails examples that a loaded machine (the
# suite's two workers, or anything beside them) merely slowed down; 2 s still catches an example
# that runs away (a pattern or a parser gone super-linear).
settings.register_profile("cdc-relay", deadline=2000)
settings.load_profile("cdc-relay")


def _short_id() -> str:
    return uuid.uuid4().hex[:10]


@pytest.fixture(scope="session", autouse=True)
def _relay_logs_in_pytest_temp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Relay child logs under pytest's base temp dir (pytest keeps the last three runs' dirs)."""
    RelayProcess.log_dir = tmp_path_factory.mktemp("relay-logs")
    yield
    RelayProcess.log_dir = None


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """A running PostgreSQL server with ``wal_level=logical``: local unless the env var says."""
    external = os.environ.get(DATABASE_URL_ENV)
    if external:
        yield ExternalPostgres(external)
        return
    server = LocalPostgres(settings=LOCAL_POSTGRES_SETTINGS)
    started = time.monotonic()
    server.start()
    print(f"\nLocalPostgres on port {server.port} ready in {time.monotonic() - started:.2f}s")
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture(scope="session")
def broker() -> Iterator[KafkaBroker]:
    """A running Kafka-protocol broker: a local Tansu unless the env var says otherwise."""
    external = os.environ.get(BOOTSTRAP_SERVERS_ENV)
    if external:
        yield ExternalBroker(external)
        return
    local = LocalBroker()
    started = time.monotonic()
    local.start()
    print(f"\nLocalBroker on {local.bootstrap_servers} ready in {time.monotonic() - started:.3f}s")
    try:
        yield local
    finally:
        local.cleanup()


@pytest.fixture
def local_postgres(postgres: PostgresServer) -> Iterator[LocalPostgres]:
    """The session's local cluster, for tests that stop/kill/restart it; skips if external.

    The cluster is running again after the test, whatever the test did to it.
    """
    if not isinstance(postgres, LocalPostgres):
        pytest.skip(
            f"needs a local PostgreSQL cluster it can stop/kill/restart; {DATABASE_URL_ENV} "
            "points at an external server"
        )
    try:
        yield postgres
    finally:
        if not postgres.running:
            postgres.start()


@pytest.fixture
def local_broker(broker: KafkaBroker) -> Iterator[LocalBroker]:
    """The session's local broker, for tests that pause/kill/restart it; skips if external.

    The broker is running (and not paused) after the test; after a kill or restart it is empty.
    """
    if not isinstance(broker, LocalBroker):
        pytest.skip(
            f"needs a local broker it can pause/kill/restart; {BOOTSTRAP_SERVERS_ENV} points at "
            "an external broker"
        )
    try:
        yield broker
    finally:
        if broker.paused:
            broker.resume()
        if not broker.running:
            broker.start()


@pytest.fixture
def database(postgres: PostgresServer) -> Iterator[str]:
    """URL of a fresh database ``test_<id>``, dropped (with its replication slots) afterwards."""
    name = f"test_{_short_id()}"
    url = postgres.create_database(name)
    try:
        yield url
    finally:
        if isinstance(postgres, LocalPostgres) and not postgres.running:
            postgres.start()  # a test left the server stopped or killed
        postgres.drop_database(name)


def external_services() -> list[str]:
    """The variables that point the tier at external services, of those set."""
    return [name for name in (DATABASE_URL_ENV, BOOTSTRAP_SERVERS_ENV) if os.environ.get(name)]


def own_services_only(what: str) -> pytest.MarkDecorator:
    """The mark of a module whose tests start services of their own (``what`` says which): they
    are skipped when the tier runs against external services."""
    return pytest.mark.skipif(
        bool(external_services()),
        reason=f"{what}; {' and '.join(external_services())} select external services",
    )


def skip_if_external(what: str) -> None:
    """Skip a test that starts a PostgreSQL cluster of its own (from local server binaries) when
    the tier runs against external services: that mode uses no local server."""
    if os.environ.get(DATABASE_URL_ENV):
        pytest.skip(f"{what}; {DATABASE_URL_ENV} selects an external server")


@pytest.fixture
def unique(request: pytest.FixtureRequest) -> Iterator[str]:
    """A short unique lowercase string for slot, publication and topic names.

    On an external broker, the topics whose names contain it are deleted after the test.
    """
    value = _short_id()
    external: ExternalBroker | None = None
    if {"broker", "local_broker"} & set(request.fixturenames):
        found = request.getfixturevalue("broker")
        external = found if isinstance(found, ExternalBroker) else None
    yield value
    if external is not None:
        external.delete_topics([t for t in external.topics() if value in t])


_SERVER_FIXTURES = frozenset({"postgres", "broker", "database", "local_postgres", "local_broker"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Everything under ``tests/integration`` is marked integration; nothing else starts a server.

    This keeps ``pytest -m "not integration"`` the fast tier: a test outside ``tests/integration``
    that asks for a server fixture is a collection error, not a slow unit test.
    """
    integration_dir = Path(__file__).resolve().parent / "integration"
    misplaced = []
    for item in items:
        if integration_dir in item.path.resolve().parents:
            item.add_marker(pytest.mark.integration)
        elif _SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            misplaced.append(item.nodeid)
    if misplaced:
        raise pytest.UsageError(
            "tests that start a server belong under tests/integration: " + ", ".join(misplaced)
        )
