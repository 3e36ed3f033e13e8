"""The relay's own sweeper while a DBA changes the outbox under it: a key column's type (a table
rewrite, which gives every row the rewriting transaction's id) and the primary key. Sweeping
follows without a restart, and a row older than the sweep boundary is never deleted."""

from __future__ import annotations

import psycopg
import pytest

from tests.conftest import KafkaBroker
from tests.integration.relay_support import (
    Event,
    create_outbox,
    event_ids,
    new_event,
    relay_env,
    streaming_relay,
    wait_until,
    write_transactions,
)
from tests.kafka_helpers import consume_all

pytestmark = pytest.mark.integration

SWEEPING = {
    "sweep_interval": "0.3",
    "confirm_interval": "0.2",
    "idle_confirm_interval": "0.3",
}


def _remaining(url: str) -> set[str]:
    with psycopg.connect(url, autocommit=True) as conn:
        return {str(r[0]) for r in conn.execute("SELECT id::text FROM outbox").fetchall()}


def _events(count: int, prefix: str) -> list[Event]:
    return [new_event("order", f"{prefix}-{n % 5}", "created", {"n": n}) for n in range(count)]


def test_a_key_column_changing_type_and_a_new_primary_key_are_followed_without_a_restart(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    create_outbox(database)
    older = _events(3, "older")  # before the relay's slot: never published, never swept
    write_transactions(database, [older])
    env = relay_env(database, broker.bootstrap_servers, unique, **SWEEPING)
    first, second, third = _events(20, "first"), _events(20, "second"), _events(20, "third")
    with streaming_relay(env) as relay:
        write_transactions(database, [first[:10], first[10:]])
        wait_until(lambda: _remaining(database) == event_ids(older), 30, "the first rows swept")

        with psycopg.connect(database, autocommit=True) as conn:
            # A rewrite: every row now carries this transaction's id, the older ones too.
            conn.execute("ALTER TABLE outbox ALTER COLUMN id TYPE text")
        write_transactions(database, [second[:10], second[10:]])
        wait_until(
            lambda: _remaining(database) == event_ids(older),
            30,
            "the rows written after the type change swept, the older ones kept",
        )

        with psycopg.connect(database, autocommit=True) as conn:
            conn.execute(
                "ALTER TABLE outbox DROP CONSTRAINT outbox_pkey, ADD PRIMARY KEY (id, aggregate_id)"
            )
        write_transactions(database, [third])
        wait_until(
            lambda: _remaining(database) == event_ids(older),
            30,
            "rows swept by the new primary key",
        )
        records = consume_all(broker.bootstrap_servers, f"{unique}.order", 60, 30)
        assert relay.stop() == 0
    logs = relay.logs()
    assert sorted(r.header("id") or b"" for r in records) == sorted(
        e.id.encode() for e in first + second + third
    )
    assert _remaining(database) == event_ids(older)
    assert "sweep failed" not in logs, logs[-3000:]


def test_rows_older_than_the_boundary_are_kept_through_a_rewrite_and_a_restart(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    """A rewrite gives the older rows a transaction id after the boundary: a sweeper that only
    compared ids (a relay started after the change) deleted them, never published."""
    create_outbox(database)
    older = _events(3, "older")
    write_transactions(database, [older])
    env = relay_env(database, broker.bootstrap_servers, unique, **SWEEPING)
    first, second = _events(10, "first"), _events(10, "second")
    with streaming_relay(env) as relay:
        write_transactions(database, [first])
        wait_until(lambda: _remaining(database) == event_ids(older), 30, "the first rows swept")
        assert relay.stop() == 0
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("ALTER TABLE outbox ALTER COLUMN aggregate_type TYPE varchar(100)")
        conn.execute("VACUUM FULL outbox")
        conn.execute("ALTER TABLE outbox ALTER COLUMN id TYPE text")
    with streaming_relay(env) as relay:
        write_transactions(database, [second])
        wait_until(lambda: _remaining(database) <= event_ids(older), 30, "the second rows swept")
        records = consume_all(broker.bootstrap_servers, f"{unique}.order", 20, 30)
        assert relay.stop() == 0
    assert len(records) == 20
    assert _remaining(database) == event_ids(older)
