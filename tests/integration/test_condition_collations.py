"""Row filters and sweep conditions on columns with a collation of their own.

The relay compares a condition's text byte for byte on every decoded row, the publication (on
PostgreSQL 15+) and the sweeper's DELETE compare it with the column's collation. Under a
deterministic collation equal means byte-equal, so all three agree; under a nondeterministic one
(``'KAFKA' = 'kafka'`` when case-insensitive) the sweeper would delete rows the relay never
published. And PostgreSQL refuses a publication row filter on a column whose collation is
user-defined (``FeatureNotSupported``): ``check`` passed, then the relay exited 70 at its first
start. Both are now refused by ``check``, ``setup`` and the relay's start, naming the column, its
collation and the fix (exit 2); built-in collations (``"C"``, ICU's predefined ones) work.
"""

from __future__ import annotations

import uuid

import psycopg
import pytest
from psycopg import sql

from tests.conftest import KafkaBroker
from tests.integration.relay_support import RelayProcess, create_outbox, relay_env
from tests.integration.test_admin import cdc_relay, failed, lines_of
from tests.kafka_helpers import consume_with_grace

pytestmark = pytest.mark.integration

COLLATIONS = {
    # a case-insensitive ICU collation: 'KAFKA' = 'kafka'
    "case_insensitive": "provider = icu, locale = 'und-u-ks-level2', deterministic = false",
    # byte order, like "C", but created by a user: no publication row filter may use it
    "my_c": "provider = libc, locale = 'C'",
}
NEEDS_ICU = frozenset({"case_insensitive", "und-x-icu"})
# A deterministic user-defined collation is refused only in a publication's row filter.
PUBLICATION_ONLY = frozenset({"my_c"})


def _skip_without_icu(collation: str, icu_missing: str | None) -> None:
    if collation in NEEDS_ICU and icu_missing:
        pytest.skip(icu_missing)


def _collate(database: str, collation: str, column: str = "aggregate_type") -> None:
    with psycopg.connect(database, autocommit=True) as conn:
        if collation in COLLATIONS:
            conn.execute(
                sql.SQL("CREATE COLLATION {} ({})").format(
                    sql.Identifier(collation),
                    sql.SQL(COLLATIONS[collation]),  # a constant of this test
                )
            )
        conn.execute(
            sql.SQL("ALTER TABLE outbox ALTER COLUMN {} TYPE text COLLATE {}").format(
                sql.Identifier(column), sql.Identifier(collation)
            )
        )


@pytest.mark.parametrize("collation", sorted(COLLATIONS))
def test_a_row_filter_on_a_collation_postgresql_cannot_publish_is_refused_everywhere(
    database: str,
    broker: KafkaBroker,
    unique: str,
    collation: str,
    icu_missing: str | None,
    row_filters_missing: str | None,
) -> None:
    _skip_without_icu(collation, icu_missing)
    if collation in PUBLICATION_ONLY and row_filters_missing:
        pytest.skip(row_filters_missing)
    create_outbox(database)
    _collate(database, collation)
    env = relay_env(
        database, broker.bootstrap_servers, unique, outbox_row_filter="aggregate_type = 'order'"
    )

    check = cdc_relay(env, "check")
    assert check.returncode == 1, check.stdout + check.stderr
    line = failed(check)["table public.outbox"]
    assert "column aggregate_type" in line, line
    assert f"collation public.{collation}" in line, line
    assert 'ALTER TABLE public.outbox ALTER COLUMN aggregate_type TYPE text COLLATE "C"' in line

    setup = cdc_relay(env, "setup")
    assert setup.returncode == 2, setup.stdout + setup.stderr
    assert f"collation public.{collation}" in setup.stdout
    assert "Traceback" not in setup.stdout + setup.stderr

    relay = RelayProcess(env).start()
    try:
        assert relay.wait(30) == 2
        logs = relay.logs()
        assert f"collation public.{collation}" in logs
        assert "FeatureNotSupported" not in logs
    finally:
        relay.close()


def test_a_sweep_condition_refuses_a_nondeterministic_collation_only(
    database: str, broker: KafkaBroker, unique: str, icu_missing: str | None
) -> None:
    """The sweep condition is PostgreSQL's alone (never in the publication): a user-defined
    deterministic collation compares as bytes there too; a nondeterministic one does not."""
    _skip_without_icu("case_insensitive", icu_missing)
    create_outbox(database)
    _collate(database, "my_c", "event_type")
    _collate(database, "case_insensitive")
    env = relay_env(
        database,
        broker.bootstrap_servers,
        unique,
        sweep_interval="5",
        sweep_condition="event_type <> 'keep'",
    )
    assert "table public.outbox" not in failed(cdc_relay(env, "check"))
    env["CDC_RELAY_SWEEP_CONDITION"] = "aggregate_type <> 'keep'"
    line = failed(cdc_relay(env, "check"))["table public.outbox"]
    assert "the sweep condition compares column aggregate_type" in line, line
    assert "collation public.case_insensitive is nondeterministic" in line, line


@pytest.mark.parametrize("collation", ["C", "und-x-icu"])
def test_a_row_filter_on_a_built_in_collation_filters_as_written(
    database: str, broker: KafkaBroker, unique: str, collation: str, icu_missing: str | None
) -> None:
    _skip_without_icu(collation, icu_missing)
    create_outbox(database)
    _collate(database, collation)
    env = relay_env(
        database,
        broker.bootstrap_servers,
        unique,
        outbox_row_filter="aggregate_type = 'order'",
        topic_template=f"{unique}.events",
        confirm_interval="0.2",
    )
    check = cdc_relay(env, "check")
    assert lines_of(check)["table public.outbox"].startswith("ok   ")
    relay = RelayProcess(env).start().wait_streaming()
    try:
        ids = {kind: str(uuid.uuid4()) for kind in ("order", "ORDER", "Order ")}
        with psycopg.connect(database, autocommit=True) as conn:
            for kind, event_id in ids.items():
                conn.execute(
                    "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) "
                    "VALUES (%s, %s, 'a-1', 'created', '{}')",
                    (event_id, kind),
                )
        records = consume_with_grace(broker.bootstrap_servers, f"{unique}.events", 1, grace=2.0)
        got = [record.header("id") for record in records]
        assert got == [ids["order"].encode()]
    finally:
        relay.close()
