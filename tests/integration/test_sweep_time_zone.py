"""Sweep retention on a ``timestamp without time zone`` creation column (issue 14): the column is
read in CDC_RELAY_SWEEP_TIME_ZONE (UTC), never in the server's TimeZone — which, east of UTC,
made fresh rows look hours old (swept too early) and, west of it, kept old rows for hours."""

from __future__ import annotations

import uuid

import psycopg
import pytest

from cdc_relay.sweeper import Sweeper
from tests.conftest import KafkaBroker
from tests.integration.relay_support import (
    create_outbox,
    relay_env,
    relay_settings,
    streaming_relay,
)
from tests.kafka_helpers import consume_all

pytestmark = pytest.mark.integration

RELAY = {"confirm_interval": "0.2", "idle_confirm_interval": "0.3"}


@pytest.mark.parametrize("zone", ["Asia/Tokyo", "America/New_York"])
def test_retention_reads_a_naive_creation_time_as_utc_whatever_the_servers_zone(
    database: str, broker: KafkaBroker, unique: str, zone: str
) -> None:
    create_outbox(database)
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            "ALTER TABLE outbox ALTER created_at TYPE timestamp without time zone "
            "USING created_at AT TIME ZONE 'UTC', "
            "ALTER created_at SET DEFAULT (now() AT TIME ZONE 'UTC')"
        )
        name = conn.info.dbname
        conn.execute(f"ALTER DATABASE {name} SET timezone = '{zone}'".encode())  # test's own
    old, young = str(uuid.uuid4()), str(uuid.uuid4())
    env = relay_env(database, broker.bootstrap_servers, unique, **RELAY)
    with streaming_relay(env):
        with psycopg.connect(database, autocommit=True) as conn:
            assert conn.execute("SHOW timezone").fetchone() == (zone,)
            for event_id, age in ((old, "2 hours"), (young, "10 minutes")):
                conn.execute(
                    "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, "
                    "created_at) VALUES (%s, 'order', 'a-1', 'created', '{}', "
                    "(now() AT TIME ZONE 'UTC') - %s::interval)",
                    (event_id, age),
                )
        consume_all(broker.bootstrap_servers, f"{unique}.order", 2, timeout=30)
        sweeper = Sweeper(relay_settings(env, sweep_retention_seconds=3600))
        result = sweeper.sweep_until_done(timeout=15)
        sweeper.close()
    with psycopg.connect(database) as conn:
        remaining = {str(r[0]) for r in conn.execute("SELECT id FROM outbox").fetchall()}
    assert {str(i) for b in result.batches for i in b.ids} == {old}, "the 2-hour-old row goes"
    assert remaining == {young}, "the 10-minute-old row stays for the hour of retention"
