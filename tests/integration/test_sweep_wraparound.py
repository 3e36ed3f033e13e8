"""The sweeper two and four billion transactions after its boundary, on a cluster of its own
whose transaction ids are moved forward with ``pg_resetwal``
(:meth:`LocalPostgres.advance_transaction_ids`, which first freezes every database as autovacuum
would have: frozen rows keep their raw 32-bit ``xmin``).

A row's ``xmin`` is 32 bits; the boundary (``slot_position.sweep_from_xid``) is 64. Rows younger
than the boundary are swept whatever the distance, rows older than it never are, and where their
32-bit ids are about to look younger (2^32 transactions after the oldest of them) the sweeper stops
deleting from that table, saying why, until they are gone."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

from cdc_relay.checkpoint import PostgresCheckpointStore
from cdc_relay.config import Settings
from cdc_relay.local import LocalPostgres
from cdc_relay.lsn import parse_lsn
from cdc_relay.prerequisites import verified_stamp
from cdc_relay.relayed_filters import recorded_form
from cdc_relay.sweeper import Sweeper, SweepResult
from tests.conftest import LOCAL_POSTGRES_SETTINGS, skip_if_external
from tests.integration.relay_support import (
    Event,
    create_outbox,
    event_ids,
    new_event,
    relay_env,
    relay_settings,
    scalar,
    write_transactions,
)

pytestmark = pytest.mark.integration

SPAN = 1 << 32


@pytest.fixture
def cluster() -> Iterator[LocalPostgres]:
    skip_if_external("moves a cluster's transaction ids forward with pg_resetwal")
    server = LocalPostgres(settings=LOCAL_POSTGRES_SETTINGS)
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


class _Outbox:
    """One database of the cluster with an outbox, its publication and the relay's record (no
    slot: pg_resetwal starts a new WAL, and the sweeper reads only the record)."""

    def __init__(self, cluster: LocalPostgres, unique: str) -> None:
        self.cluster = cluster
        self.url = cluster.create_database("outbox")
        create_outbox(self.url)
        self.env = relay_env(self.url, "127.0.0.1:9", unique)
        with psycopg.connect(self.url, autocommit=True) as conn:
            publication = f"CREATE PUBLICATION pub_{unique} FOR TABLE outbox"
            conn.execute(f"{publication} WITH (publish = 'insert')".encode())

    def settings(self) -> Settings:
        return relay_settings(self.env)

    def store(self, conn: psycopg.Connection[tuple[object, ...]]) -> PostgresCheckpointStore:
        return PostgresCheckpointStore(conn, "cdc_relay", self.env["CDC_RELAY_SLOT_NAME"])

    def take_boundary(self) -> int:
        """As the relay does when it creates its slot: a record with a fresh sweep boundary."""
        with psycopg.connect(self.url, autocommit=True) as conn:
            store = self.store(conn)
            store.ensure_table()
            store.save(self._insert_lsn(conn), new_slot=True)
            store.verify(verified_stamp(conn, self.settings()))  # the publication it verified
            store.record_row_filters(recorded_form(self.settings().tables()), changed=False)
            boundary = store.load_sweep_boundary()
        assert boundary is not None
        return boundary

    def confirm_all(self) -> None:
        """A record covering everything committed so far, as a relay that published it all."""
        with psycopg.connect(self.url, autocommit=True) as conn:
            self.store(conn).save(self._insert_lsn(conn))

    def sweep(self) -> SweepResult:
        """A fresh sweeper (a new process: only the database remembers): one selection, a record
        covering it, the deletes it allows."""
        sweeper = Sweeper(self.settings())
        try:
            sweeper.sweep_once()
            self.confirm_all()
            return sweeper.sweep_until_done(timeout=1)
        finally:
            sweeper.close()

    def remaining(self) -> set[str]:
        with psycopg.connect(self.url, autocommit=True) as conn:
            return {str(r[0]) for r in conn.execute("SELECT id FROM outbox").fetchall()}

    def write(self, count: int, prefix: str) -> list[Event]:
        events = [new_event("order", f"{prefix}-{n}", "created", {"n": n}) for n in range(count)]
        write_transactions(self.url, [events])
        return events

    @staticmethod
    def _insert_lsn(conn: psycopg.Connection[tuple[object, ...]]) -> int:
        row = conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
        assert row is not None
        return parse_lsn(str(row[0]))


def _deleted(result: SweepResult) -> set[str]:
    return {str(i) for b in result.batches for i in b.ids}


def test_rows_after_a_boundary_two_billion_transactions_back_are_swept_and_older_ones_kept(
    cluster: LocalPostgres, unique: str
) -> None:
    """2^31 transactions after the boundary every row's 32-bit age compared below the
    boundary's: the sweeper deleted nothing and said nothing waits, with the rows still there."""
    outbox = _Outbox(cluster, unique)
    older = outbox.write(5, "older")  # before the boundary: never published, never swept
    boundary = outbox.take_boundary()
    first = outbox.write(5, "first")
    assert _deleted(outbox.sweep()) == event_ids(first)
    second = outbox.write(5, "second")  # frozen by the jump, as autovacuum would have

    cluster.advance_transaction_ids(boundary + (1 << 30))
    cluster.advance_transaction_ids(boundary + (1 << 31) + 1_000_000)
    third = outbox.write(5, "third")
    assert int(str(scalar(outbox.url, "SELECT min(age(xmin)) FROM outbox"))) < 0  # 32 bits wrapped

    result = outbox.sweep()
    assert _deleted(result) == event_ids(second) | event_ids(third)
    assert outbox.remaining() == event_ids(older)
    # The older rows' ids look younger 2^32 transactions after the oldest of them: said ahead.
    assert "predate the sweep boundary" in result.warnings["public.outbox"]


def test_the_sweeper_stops_deleting_before_older_rows_could_look_younger_and_resumes_once_gone(
    cluster: LocalPostgres, unique: str
) -> None:
    outbox = _Outbox(cluster, unique)
    older = outbox.write(3, "older")
    boundary = outbox.take_boundary()
    assert _deleted(outbox.sweep()) == set()  # looks at the table: the older rows are counted
    waiting = outbox.write(4, "waiting")
    oldest = boundary - 1
    # Within the last 2^27 transactions before the oldest older row's id comes round again.
    for step in (1_500_000_000, 3_000_000_000):
        cluster.advance_transaction_ids(boundary + step)
    cluster.advance_transaction_ids(oldest + SPAN - (1 << 27))

    refused = outbox.sweep()
    assert _deleted(refused) == set()
    reason = refused.refused["public.outbox"]
    assert "3 row(s)" in reason, reason
    assert "predate the sweep boundary" in reason, reason
    assert outbox.remaining() == event_ids(older) | event_ids(waiting)

    with psycopg.connect(outbox.url, autocommit=True) as conn:  # the operator's fix
        conn.execute("DELETE FROM outbox WHERE id = ANY(%s::uuid[])", ([e.id for e in older],))
    assert _deleted(outbox.sweep()) == event_ids(waiting)

    # Settled: no row older than the boundary is left, none can come: 2^32 and more later too.
    cluster.advance_transaction_ids(cluster.next_transaction_id() + 2_000_000_000)
    assert cluster.next_transaction_id() > oldest + SPAN
    later = outbox.write(4, "later")
    result = outbox.sweep()
    assert _deleted(result) == event_ids(later)
    assert not result.refused
    assert not result.warnings
    assert outbox.remaining() == set()


def test_a_first_look_two_billion_transactions_after_the_boundary_refuses_rows_it_cannot_tell(
    cluster: LocalPostgres, unique: str
) -> None:
    """Never looked at since the boundary was taken: a row older than 2^32 transactions may
    carry the 32-bit id of one after the boundary. Refused, with the fix; an empty table is
    no risk."""
    outbox = _Outbox(cluster, unique)
    boundary = outbox.take_boundary()
    rows = outbox.write(3, "rows")
    cluster.advance_transaction_ids(boundary + (1 << 30))
    cluster.advance_transaction_ids(boundary + (1 << 31) + 1_000_000)

    result = outbox.sweep()
    assert _deleted(result) == set()
    reason = result.refused["public.outbox"]
    assert "first looked" in reason, reason
    assert "sweep_from_xid" in reason, reason
    assert outbox.remaining() == event_ids(rows)

    with psycopg.connect(outbox.url, autocommit=True) as conn:  # the fix the refusal names
        conn.execute(
            "UPDATE cdc_relay.slot_position SET sweep_from_xid = "
            "pg_snapshot_xmax(pg_current_snapshot()) WHERE slot_name = %s",
            (outbox.env["CDC_RELAY_SLOT_NAME"],),
        )
    later = outbox.write(3, "later")
    result = outbox.sweep()
    assert _deleted(result) == event_ids(later)
    assert outbox.remaining() == event_ids(rows)  # older than the new boundary: kept
