"""Taking over from Debezium (issue 14): the slot and publication its PostgreSQL connector created
(slot ``debezium``, plugin pgoutput; publication ``dbz_publication`` FOR TABLE the outbox, or FOR
ALL TABLES in its default ``all_tables`` mode), part of the events confirmed by Debezium. The relay
starts at the slot's confirmed position: exactly the events after it reach Kafka, in order — no
gap, nothing before it again, no snapshot."""

from __future__ import annotations

import uuid

import orjson
import psycopg
import pytest

from tests.conftest import KafkaBroker
from tests.integration.relay_support import RelayProcess, relay_env, scalar
from tests.kafka_helpers import consume_with_grace

pytestmark = pytest.mark.integration

# Debezium's documented outbox table.
OUTBOXEVENT_DDL = """
CREATE TABLE outboxevent (
    id uuid PRIMARY KEY,
    aggregatetype varchar(255) NOT NULL,
    aggregateid varchar(255) NOT NULL,
    type varchar(255) NOT NULL,
    payload jsonb
);
CREATE TABLE orders (id text PRIMARY KEY, status text NOT NULL);
"""
PUBLICATIONS = {
    "filtered": "CREATE PUBLICATION dbz_publication FOR TABLE public.outboxevent",
    "all_tables": "CREATE PUBLICATION dbz_publication FOR ALL TABLES",
}
COLUMNS = {
    "aggregate_type": "aggregatetype",
    "aggregate_id": "aggregateid",
    "event_type": "type",
    "headers": None,
}


def _write(conn: psycopg.Connection[tuple[object, ...]], n: int) -> str:
    """One business transaction: an order change and its event, as Debezium's users write them."""
    event_id = str(uuid.uuid4())
    with conn.transaction():
        conn.execute(
            "INSERT INTO orders VALUES (%s, 'created') ON CONFLICT (id) DO UPDATE SET status = "
            "'changed'",
            (f"o-{n % 3}",),
        )
        conn.execute(
            "INSERT INTO outboxevent VALUES (%s, 'order', %s, 'OrderCreated', %s::jsonb)",
            (event_id, f"o-{n % 3}", orjson.dumps({"n": n}).decode()),
        )
    return event_id


@pytest.mark.parametrize("mode", sorted(PUBLICATIONS))
def test_the_relay_takes_over_debeziums_slot_at_its_confirmed_position(
    database: str, broker: KafkaBroker, unique: str, mode: str
) -> None:
    # Slot names are the server's, not the database's: Debezium's own may exist there already.
    slot = f"debezium_{unique}"
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(OUTBOXEVENT_DDL.encode())
        conn.execute(PUBLICATIONS[mode].encode())  # publish: every operation, Debezium's default
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
        conn.execute("SET synchronous_commit = on")
        confirmed_by_debezium = [_write(conn, n) for n in range(4)]
        # A slot advances only as far as the WAL is flushed; the test cluster commits
        # asynchronously, so these commits flush, as a production server's do.
        lsn = conn.execute("SELECT pg_current_wal_flush_lsn()").fetchone()
        assert lsn is not None
        # Debezium confirmed these four (it stops here); then the application writes on.
        conn.execute("SELECT pg_replication_slot_advance(%s, %s)", (slot, lsn[0]))
        assert conn.execute(
            "SELECT confirmed_flush_lsn = %s::pg_lsn FROM pg_replication_slots "
            "WHERE slot_name = %s",
            (lsn[0], slot),
        ).fetchone() == (True,)
        after = [_write(conn, n) for n in range(4, 10)]
        # What Debezium's users do to keep the table small: the delete must not travel.
        conn.execute("DELETE FROM outboxevent WHERE id = %s", (confirmed_by_debezium[0],))
        after.append(_write(conn, 10))

    env = relay_env(
        database,
        broker.bootstrap_servers,
        unique,
        slot_name=slot,
        publication_name="dbz_publication",
        outbox_table="public.outboxevent",
        outbox_columns=orjson.dumps(COLUMNS).decode(),
        topic_partitions="1",
        plugin="pgoutput",  # Debezium's slot: the plugin it was created with
    )
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        with psycopg.connect(database, autocommit=True) as conn:
            later = _write(conn, 11)  # written while the relay streams
        records = consume_with_grace(
            broker.bootstrap_servers, f"{unique}.order", len(after) + 1, timeout=30, grace=2.0
        )
        if mode == "all_tables":
            # The fix check names, run while the relay streams: one transaction, so the slot
            # never decodes a moment without the publication; then the outbox only. The relay
            # cannot tell a replacement from a gap, so it stops (exit 3) confirming nothing
            # decoded after it, and a restart resumes there: nothing is lost.
            with psycopg.connect(database) as conn:
                with conn.transaction():
                    conn.execute("DROP PUBLICATION dbz_publication")
                    conn.execute(
                        "CREATE PUBLICATION dbz_publication FOR TABLE public.outboxevent "
                        "WITH (publish = 'insert')"
                    )
                more = [_write(conn, n) for n in range(12, 15)]
            assert relay.wait(timeout=30) == 3, relay.logs()
            assert "the publication or an outbox table changed under the relay" in relay.logs()
            relay.close()
            relay = RelayProcess(env).start()
            relay.wait_streaming()
            records = consume_with_grace(
                broker.bootstrap_servers, f"{unique}.order", len(after) + 4, timeout=30, grace=2.0
            )
            after += more
    finally:
        relay.close()
    ids = [dict(r.headers)["id"].decode() for r in records]
    expected = [*after[:7], later, *after[7:]]
    assert ids == expected, "exactly the events after Debezium's position, in order"
    assert not set(ids) & set(confirmed_by_debezium), "nothing Debezium confirmed is sent again"
    recorded = scalar(
        database, "SELECT confirmed_lsn >= %s::pg_lsn FROM cdc_relay.slot_position", str(lsn[0])
    )
    assert recorded is True, "the relay recorded its own position for the slot it took over"
