"""Sweep retention on a ``timestamp without time zone`` creation column (issue 14): the column is
read in CDC_RELAY_SWEEP_TIME_ZONE (UTC), never in the server's TimeZone — which, east of UTC,
made fresh rows look hours old (swept too early) and, west of it, kept old rows for hours."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest

from cdc_relay.config import Settings, load_settings
from cdc_relay.sweeper import Sweeper
from tests.conftest import KafkaBroker
from tests.integration.relay_support import RelayProcess, create_outbox, relay_env
from tests.kafka_helpers import consume_all

pytestmark = pytest.mark.integration

RELAY = {"confirm_interval": "0.2", "idle_confirm_interval": "0.3"}


def _settings(env: dict[str, str], **overrides: object) -> Settings:
    values: dict[str, Any] = {
        key.removeprefix("CDC_RELAY_").lower(): value
        for key, value in env.items()
        if key.startswith("CDC_RELAY_")
    }
    values.update(overrides)
    return load_settings(**values)


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
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
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
        sweeper = Sweeper(_settings(env, sweep_retention_seconds=3600))
        result = sweeper.sweep_until_done(timeout=15)
        sweeper.close()
    finally:
        relay.close()
    with psycopg.connect(database) as conn:
        remaining = {str(r[0]) for r in conn.execute("SELECT id FROM outbox").fetchall()}
    assert {str(i) for b in result.batches for i in b.ids} == {old}, "the 2-hour-old row goes"
    assert remaining == {young}, "the 10-minute-old row stays for the hour of retention"
