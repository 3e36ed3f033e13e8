"""The sweeper against a real PostgreSQL, a real broker and the real relay: it deletes published
outbox rows and never one whose event Kafka has not acknowledged."""

from __future__ import annotations

import gc
import itertools
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from typing import Any

import orjson
import psycopg
import pytest
from psycopg import sql

from cdc_relay.checkpoint import PostgresCheckpointStore
from cdc_relay.config import Settings
from cdc_relay.local.lifetime import free_port
from cdc_relay.lsn import parse_lsn
from cdc_relay.publication_stamp import StampQuery, read_stamp
from cdc_relay.relayed_filters import recorded_form
from cdc_relay.row_key import key_types
from cdc_relay.sweep_queries import Eligible, page_statement, select_page
from cdc_relay.sweeper import Candidates, Sweeper
from tests.conftest import KafkaBroker
from tests.fakes import SweptTableStub, eligible_since
from tests.integration.relay_support import (
    INSERT_SQL,
    OUTBOX_DDL,
    Event,
    RelayProcess,
    create_outbox,
    http_get,
    insert_events,
    new_event,
    relay_env,
    relay_settings,
    scalar,
    streaming_relay,
    wait_until,
    write_transactions,
)
from tests.kafka_helpers import Record, consume_all, consume_with_grace

# Every test here runs for each output plugin (pgoutput, wal2json).
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("plugin")]

# The relay must not sweep itself here; it confirms promptly, also when only the WAL moved (the
# sweeper's fence is the WAL insert end, which the relay's own position writes keep moving).
RELAY = {"sweep_interval": "0", "confirm_interval": "0.2", "idle_confirm_interval": "0.3"}


def _recorded(conn: psycopg.Connection[tuple[object, ...]], slot: str) -> int:
    """The relay's record, read by the test itself (not through the sweeper's code)."""
    row = conn.execute(
        "SELECT confirmed_lsn::text FROM cdc_relay.slot_position WHERE slot_name = %s", (slot,)
    ).fetchone()
    return parse_lsn(str(row[0])) if row else 0


def _insert_lsn(url: str) -> int:
    return parse_lsn(str(scalar(url, "SELECT pg_current_wal_insert_lsn()::text")))


def _ids(records: list[Record]) -> Counter[str]:
    return Counter((r.header("id") or b"").decode() for r in records)


def _remaining(url: str) -> set[str]:
    with psycopg.connect(url, autocommit=True) as conn:
        return {str(r[0]) for r in conn.execute("SELECT id FROM outbox").fetchall()}


def _record_relayed(conn: psycopg.Connection[tuple[object, ...]], settings: Settings) -> None:
    """What a relay's start records beside its position: its row filters, and the publication
    as it verified it (cdc_relay.publication_stamp)."""
    store = PostgresCheckpointStore(conn, settings.state_schema, settings.slot_name)
    tables = settings.tables()
    query = StampQuery.of(
        settings.plugin, settings.publication_name, tables, conn.info.server_version
    )
    store.verify(read_stamp(conn, query))
    store.record_row_filters(recorded_form(tables), changed=False)


def _events(count: int, prefix: str) -> list[Event]:
    return [new_event("order", f"{prefix}-{n % 17}", "created", {"n": n}) for n in range(count)]


def _row(event: Event) -> tuple[object, ...]:
    return (
        event.id,
        event.aggregate_type,
        event.aggregate_id,
        event.event_type,
        orjson.dumps(event.payload).decode(),
        None,
    )


def _batches(events: list[Event], size: int) -> list[list[Event]]:
    return [events[i : i + size] for i in range(0, len(events), size)]


class _AuditedSweeper(Sweeper):
    """Checks, right before every delete and with its own connection, that the relay's record
    covers the batch's fence, and keeps what was deleted when."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.audit_conn = psycopg.connect(settings.database_url.get_secret_value(), autocommit=True)
        self.deletions: list[tuple[tuple[object, ...], int, int, float]] = []
        self.passes: list[int] = []  # rows deleted per pass

    def _delete(
        self, conn: Any, table: Any, batch: Candidates, eligible: Eligible
    ) -> tuple[object, ...]:
        recorded = _recorded(self.audit_conn, self.settings.slot_name)
        ids = super()._delete(conn, table, batch, eligible)
        self.deletions.append((ids, batch.fence, recorded, time.time()))
        return ids

    def sweep_once(self) -> Any:
        result = super().sweep_once()
        self.passes.append(result.deleted)
        return result


def test_concurrent_writers_rows_are_deleted_only_after_kafka_has_them(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    create_outbox(database)
    topic = f"{unique}.order"
    broker.create_topic(topic, partitions=3)
    env = relay_env(database, broker.bootstrap_servers, unique, **RELAY)
    relay = RelayProcess(env).start()
    sweeper = _AuditedSweeper(relay_settings(env, sweep_interval=0.1, sweep_batch_size=250))
    stop = threading.Event()
    sweeping = threading.Thread(target=sweeper.run, args=(stop,), daemon=True)
    writers_count, rows_per_writer = 4, 1000
    written: list[list[str]] = [[] for _ in range(writers_count)]
    errors: list[str] = []

    def writer(index: int) -> None:
        rng = random.Random(index)
        events = _events(rows_per_writer, f"w{index}")
        try:
            with psycopg.connect(database) as conn:
                pos = 0
                while pos < len(events):
                    batch = events[pos : pos + rng.randint(1, 8)]
                    with conn.transaction():
                        insert_events(conn, batch)
                    written[index].extend(e.id for e in batch)
                    pos += len(batch)
                    time.sleep(0.003)
        except Exception as exc:
            errors.append(repr(exc))

    try:
        relay.wait_streaming()
        sweeping.start()
        started = time.monotonic()
        threads = [threading.Thread(target=writer, args=(i,)) for i in range(writers_count)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        writers_done = time.time()
        write_seconds = time.monotonic() - started
        assert not errors, errors
        all_ids = {i for ids in written for i in ids}
        assert len(all_ids) == writers_count * rows_per_writer
        records = consume_all(broker.bootstrap_servers, topic, len(all_ids), timeout=60)
        wait_until(lambda: not _remaining(database), 30, "the sweeper to empty the outbox")
        drained = time.monotonic() - started
    finally:
        stop.set()
        sweeping.join(30)
        sweeper.audit_conn.close()
        relay.close()
    assert not sweeping.is_alive()

    in_kafka = _ids(records)
    assert set(in_kafka) == all_ids, "every event reached Kafka"
    deleted = [i for ids, _, _, _ in sweeper.deletions for i in ids]
    assert len(deleted) == len(set(deleted)), "no row deleted twice"
    assert {str(i) for i in deleted} == all_ids, "the sweeper deleted every row"
    for ids, fence, recorded, _ in sweeper.deletions:
        # Independently read: Kafka had acknowledged everything below `recorded` when the batch
        # was deleted, and every row of the batch was committed below `fence`.
        assert recorded >= fence, (len(ids), fence, recorded)
        assert len(ids) <= 250
    # The sweeper worked while the writers did, not only afterwards.
    assert any(at < writers_done for _, _, _, at in sweeper.deletions)
    print(
        f"\n{len(all_ids)} rows written in {write_seconds:.2f}s, all swept after "
        f"{drained:.2f}s in {len(sweeper.deletions)} delete transactions "
        f"({sum(1 for n in sweeper.passes if n)} passes deleted something)"
    )


def test_rows_published_before_a_relay_crash_are_swept_and_not_sent_again(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    create_outbox(database)
    topic = f"{unique}.order"
    broker.create_topic(topic, partitions=3)
    env = relay_env(database, broker.bootstrap_servers, unique, **RELAY)
    slot = env["CDC_RELAY_SLOT_NAME"]
    first, second = _events(300, "a"), _events(200, "b")
    first_ids, second_ids = {e.id for e in first}, {e.id for e in second}
    sweeper = Sweeper(relay_settings(env))  # outlives the relay, as a separate sweep process would
    with streaming_relay(env) as relay:
        write_transactions(database, _batches(first, 10))
        selected = sweeper.sweep_once()  # selects the first rows, with their fence
        assert selected.deleted == 0
        assert selected.fence is not None
        with psycopg.connect(database, autocommit=True) as conn:
            wait_until(
                lambda: _recorded(conn, slot) >= (selected.fence or 0),
                15,
                "the relay to record a position past the fence of the first rows",
            )
        write_transactions(database, _batches(second, 10))
        relay.kill()  # what of `second` was not yet confirmed is the unconfirmed tail

    # The relay is dead; its record still proves the first rows published.
    after_crash = sweeper.sweep_once()
    sweeper.close()
    deleted = {str(i) for b in after_crash.batches for i in b.ids}
    assert deleted == first_ids, "rows the record covers are swept while the relay is down"
    assert _remaining(database) == second_ids

    # A sweeper started now (its candidates lost, as in a crash) proves nothing more without the
    # relay: the rows stay and it says what they wait for.
    swept = subprocess.run(
        [sys.executable, "-m", "cdc_relay", "sweep", "--once", "--wait", "1"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tempfile.gettempdir(),
        check=False,
    )
    assert swept.returncode == 0, swept.stderr
    assert swept.stdout.splitlines()[0] == "deleted nothing"
    assert f"{len(second)} row(s) wait for the relay to confirm past " in swept.stdout
    assert _remaining(database) == second_ids

    with streaming_relay(env):
        records = consume_with_grace(
            broker.bootstrap_servers, topic, len(first) + len(second), timeout=30, grace=1.5
        )
        after_restart = Sweeper(relay_settings(env)).sweep_until_done(timeout=15)
    assert after_restart.deleted == len(second)
    assert not _remaining(database), "nothing leaks: the rest is swept once the relay confirms"
    counts = _ids(records)
    assert set(counts) == first_ids | second_ids
    resent = {i for i, n in counts.items() if n > 1}
    assert not resent & first_ids, "a row swept after the crash was published again"
    print(f"\nswept with the relay down: {len(deleted)}; unconfirmed tail re-sent: {len(resent)}")


def test_each_delete_transaction_removes_at_most_a_batch(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    create_outbox(database)
    # Observed on the server side: rows removed per deleting transaction.
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE sweep_audit (xid bigint, removed int, started float8, ended float8)"
        )
        conn.execute(
            "CREATE FUNCTION audit_sweep() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "INSERT INTO sweep_audit SELECT txid_current(), count(*), "
            "extract(epoch FROM statement_timestamp()), extract(epoch FROM clock_timestamp()) "
            "FROM gone; RETURN NULL; END $$"
        )
        conn.execute(
            "CREATE TRIGGER audit_sweep AFTER DELETE ON outbox REFERENCING OLD TABLE AS gone "
            "FOR EACH STATEMENT EXECUTE FUNCTION audit_sweep()"
        )
    env = relay_env(database, broker.bootstrap_servers, unique, **RELAY)
    events = _events(1000, "c")
    with streaming_relay(env):
        write_transactions(database, _batches(events, 100))
        sweeper = Sweeper(relay_settings(env, sweep_batch_size=100))
        started = time.monotonic()
        result = sweeper.sweep_until_done(timeout=20)
        elapsed = time.monotonic() - started
        sweeper.close()
    assert result.deleted == 1000
    assert result.waiting == 0
    assert [len(b.ids) for b in result.batches] == [100] * 10
    with psycopg.connect(database, autocommit=True) as conn:
        per_transaction = conn.execute(
            "SELECT xid, sum(removed) FROM sweep_audit GROUP BY xid"
        ).fetchall()
    assert len(per_transaction) == 10
    assert all(int(str(n)) <= 100 for _, n in per_transaction)
    assert sum(int(str(n)) for _, n in per_transaction) == 1000
    assert sweeper.deleted_total == 1000
    # Paced: between two deletes the sweeper rests at least as long as the first one took.
    with psycopg.connect(database, autocommit=True) as conn:
        spans = conn.execute("SELECT started, ended FROM sweep_audit ORDER BY started").fetchall()
    gaps = [
        (float(later[0]) - float(earlier[1]), float(earlier[1]) - float(earlier[0]))
        for earlier, later in itertools.pairwise(spans)
    ]
    assert all(gap >= took for gap, took in gaps), gaps
    print(f"\n1000 rows swept in batches of 100 in {elapsed:.2f}s (incl. waiting for the relay)")


def test_a_pass_spreads_its_statements_over_the_interval_and_the_outbox_stays_small(
    database: str, broker: KafkaBroker, unique: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writers at a steady rate, the sweeper's own loop: each pass's deletes (timed by the
    server) and its pages of candidates are spread over the interval, never a burst of back to
    back statements that the writers and the walsender feel; the outbox stays about an
    interval's worth of rows, pass after pass, and is empty once the writers stop."""
    create_outbox(database)
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("CREATE TABLE sweep_audit (started float8, ended float8)")
        conn.execute(
            "CREATE FUNCTION audit_sweep() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "INSERT INTO sweep_audit VALUES (extract(epoch FROM statement_timestamp()), "
            "extract(epoch FROM clock_timestamp())); RETURN NULL; END $$"
        )
        conn.execute(
            "CREATE TRIGGER audit_sweep AFTER DELETE ON outbox "
            "FOR EACH STATEMENT EXECUTE FUNCTION audit_sweep()"
        )
    pages: list[tuple[float, float]] = []

    def timed_page(*args: Any, **kwargs: Any) -> tuple[int, list[object]]:
        started = time.time()
        page = select_page(*args, **kwargs)
        pages.append((started, time.time()))
        return page

    monkeypatch.setattr("cdc_relay.sweeper.select_page", timed_page)
    interval, batch, rate = 2.0, 50, 200  # ~8 deletes and ~8 pages a pass
    env = relay_env(database, broker.bootstrap_servers, unique, **RELAY)
    sweeper = Sweeper(relay_settings(env, sweep_interval=interval, sweep_batch_size=batch))
    stop = threading.Event()
    sweeping = threading.Thread(target=sweeper.run, args=(stop,), daemon=True)
    events = _events(rate * 9, "p")
    sizes: list[int] = []
    with streaming_relay(env):
        sweeping.start()
        started = time.monotonic()
        for n, chunk in enumerate(_batches(events, 10)):
            write_transactions(database, [chunk])
            time.sleep(max(started + (n + 1) * 10 / rate - time.monotonic(), 0))
            if n % (rate // 10) == 0:
                sizes.append(int(str(scalar(database, "SELECT count(*) FROM outbox"))))
        wait_until(lambda: not _remaining(database), 20, "the sweeper to empty the outbox")
        stop.set()
        sweeping.join(30)
        sweeper.close()
    assert not sweeping.is_alive()
    with psycopg.connect(database, autocommit=True) as conn:
        spans = [
            (float(str(a)), float(str(b)))
            for a, b in conn.execute("SELECT * FROM sweep_audit ORDER BY started").fetchall()
        ]
    # A pass's deletes: those less than a third of the interval after the one before.
    passes: list[list[tuple[float, float]]] = []
    for span in spans:
        if passes and span[0] - passes[-1][-1][1] < interval / 3:
            passes[-1].append(span)
        else:
            passes.append([span])
    full = [p for p in passes if len(p) >= 6]
    assert len(full) >= 2, [len(p) for p in passes]
    for deletes in full:
        busy = sum(end - start for start, end in deletes)
        # Spread: the pass's deletes over at least a fifth of the interval (back to back at a
        # half duty cycle they took twice their own time, some 0.05 s here).
        assert deletes[-1][1] - deletes[0][0] >= max(interval / 5, 4 * busy), deletes
    # Pages of one selection: each rests at least as long as the one before took.
    gaps = [
        (later[0] - earlier[1], earlier[1] - earlier[0])
        for earlier, later in itertools.pairwise(pages)
        if later[0] - earlier[1] < interval / 3
    ]
    assert gaps
    assert all(gap >= took for gap, took in gaps), gaps
    # Bounded: never much more than two intervals' rows (one waiting to be selected, one
    # waiting for the relay), and not growing from pass to pass.
    assert max(sizes[3:]) <= 2.5 * interval * rate, sizes
    assert max(sizes[-3:]) <= max(sizes[3:6]) + interval * rate, sizes


def test_waiting_candidates_are_plain_text_the_cycle_collector_never_walks(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    """Candidates wait in memory between passes (tens of thousands at a few thousand events/s):
    as ``uuid.UUID`` objects they filled the collector's young generation, whose collection then
    stopped the relay's loop for tens of milliseconds. Text keys are untracked; the pages after
    the first compare, and the deletes name rows, by casting them back to the key's type."""
    create_outbox(database)
    env = relay_env(database, broker.bootstrap_servers, unique, **RELAY)
    events = _events(250, "t")
    with streaming_relay(env):
        write_transactions(database, _batches(events, 50))
        sweeper = Sweeper(relay_settings(env, sweep_batch_size=100))
        sweeper.sweep_once()  # selects three pages: the relay has not confirmed past their fence
        waiting = [i for state in sweeper._tables for b in state.queue._batches for i in b.ids]
        result = sweeper.sweep_until_done(timeout=20)
        sweeper.close()
    assert all(type(i) is str and not gc.is_tracked(i) for i in waiting), waiting[:3]
    assert sorted(map(str, waiting)) == sorted(e.id for e in events)
    assert sorted(str(i) for b in result.batches for i in b.ids) == sorted(e.id for e in events)
    assert not _remaining(database)


def test_a_pass_selects_every_published_row_of_an_integer_key_in_the_keys_order(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    """Pages continue after the last key of the page before, compared in the key's type: the
    pages must be in that order too. Ordered by the keys' text, the first page of 1..250 in tens
    ends at "18", and the next one (keys > 18) never selects 2..9."""
    create_outbox(database)
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("ALTER TABLE outbox ADD COLUMN n bigint GENERATED ALWAYS AS IDENTITY UNIQUE")
    env = relay_env(database, broker.bootstrap_servers, unique, **RELAY)
    events = _events(250, "i")
    with streaming_relay(env):
        write_transactions(database, _batches(events, 50))
        settings = relay_settings(env, sweep_batch_size=10, outbox_columns={"row_key": ["n"]})
        sweeper = Sweeper(settings)
        sweeper.sweep_once()  # one selection: the relay has not confirmed past its fences yet
        selected = [i for state in sweeper._tables for b in state.queue._batches for i in b.ids]
        result = sweeper.sweep_until_done(timeout=20)
        sweeper.close()
    assert [int(str(i)) for i in selected] == list(range(1, 251))
    assert result.deleted == 250
    assert not _remaining(database)


def test_a_page_of_candidates_reads_the_keys_index_not_the_whole_table(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    """A page reads about its limit of rows along the key's index: ordered by the keys' text
    (the output column of the key's name), every page read the whole table and sorted it, so a
    pass over a table of N rows read N rows per page (at 5,000 events/s: seconds of a core in
    PostgreSQL per pass, the writers and the walsender stalled behind it)."""
    create_outbox(database)
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) "
            "SELECT gen_random_uuid(), 'order', 'o-' || g, 'created', '{}' "
            "FROM generate_series(1, 20000) g"
        )
        conn.execute("ANALYZE outbox")
        table = relay_settings(relay_env(database, broker.bootstrap_servers, unique)).tables()[0]
        swept = SweptTableStub(table, ("id",), key_types(conn, table, ("id",)))
        after = str(uuid.UUID(int=1 << 126))  # a quarter into the keys
        boundary = int(str(scalar(database, "SELECT txid_current()"))) - 100
        eligible = eligible_since(conn, "outbox", boundary)
        for page_after in (None, after):
            statement, params = page_statement(
                swept, page_after, eligible, created_at=None, limit=100
            )
            explain = sql.SQL("EXPLAIN (ANALYZE, FORMAT JSON) {}").format(statement)
            plan = conn.execute(explain, params).fetchone()[0][0]["Plan"]  # type: ignore[index]
            nodes = [plan]
            for node in nodes:
                nodes.extend(node.get("Plans", []))
            read = sum(n["Actual Rows"] for n in nodes if "Relation Name" in n)
            assert not [n for n in nodes if n["Node Type"] == "Sort"], plan
            assert read <= 100, plan
            rows = conn.execute(statement, params).fetchall()
            keys = [str(r[1]) for r in rows]
            expected = conn.execute(
                "SELECT id::text FROM outbox WHERE %s::uuid IS NULL OR id > %s::uuid "
                "ORDER BY id LIMIT 100",
                (page_after, page_after),
            ).fetchall()
            assert keys == [str(r[0]) for r in expected]


def test_retention_keeps_young_rows(database: str, broker: KafkaBroker, unique: str) -> None:
    create_outbox(database)
    env = relay_env(database, broker.bootstrap_servers, unique, **RELAY)
    old, young = _events(50, "old"), _events(50, "young")
    with streaming_relay(env):
        write_transactions(database, [old])
        time.sleep(2.2)
        write_transactions(database, [young])
        young_written = time.monotonic()
        sweeper = Sweeper(relay_settings(env, sweep_retention_seconds=2))
        # The selection runs first thing, while the young rows are well under 2 s old.
        assert time.monotonic() - young_written < 1.5
        result = sweeper.sweep_until_done(timeout=15)
        assert {str(i) for b in result.batches for i in b.ids} == {e.id for e in old}
        assert _remaining(database) == {e.id for e in young}
        assert result.waiting == 0  # the young rows are kept, not waiting
        time.sleep(max(2.2 - (time.monotonic() - young_written), 0))
        later = sweeper.sweep_until_done(timeout=15)
        sweeper.close()
    assert {str(i) for b in later.batches for i in b.ids} == {e.id for e in young}
    assert not _remaining(database)


def test_rows_deleted_in_their_own_transaction_are_published_and_nothing_is_swept(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    create_outbox(database)
    topic = f"{unique}.order"
    broker.create_topic(topic, partitions=3)
    env = relay_env(database, broker.bootstrap_servers, unique, **RELAY)
    events = _events(60, "e")
    with streaming_relay(env):
        with psycopg.connect(database) as conn:
            for batch in _batches(events, 6):
                with conn.transaction():
                    insert_events(conn, batch)
                    conn.execute(
                        "DELETE FROM outbox WHERE id = ANY(%s)",
                        ([uuid.UUID(e.id) for e in batch],),
                    )
        records = consume_all(broker.bootstrap_servers, topic, len(events), timeout=30)
        sweeper = Sweeper(relay_settings(env))
        result = sweeper.sweep_once()
        done = sweeper.sweep_until_done(timeout=1)
        sweeper.close()
    assert set(_ids(records)) == {e.id for e in events}
    assert (result.deleted, result.waiting) == (0, 0)
    assert (done.deleted, done.waiting) == (0, 0)
    assert done.describe() == ["deleted nothing", "nothing waits"]
    assert sweeper.deleted_total == 0


def test_tables_the_relay_does_not_stream_or_ids_that_are_not_unique_are_never_swept(
    database: str, unique: str
) -> None:
    create_outbox(database)
    env = relay_env(database, "127.0.0.1:9", unique)
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            OUTBOX_DDL.replace("public.outbox", "public.outbox2")
            .replace("PRIMARY KEY", "")
            .encode()
        )
        store = PostgresCheckpointStore(conn, "cdc_relay", env["CDC_RELAY_SLOT_NAME"])
        store.ensure_table()
        store.save(_insert_lsn(database))
    first, second = _events(10, "p"), _events(10, "q")
    write_transactions(database, [first])
    with psycopg.connect(database) as conn, conn.transaction():
        conn.execute(INSERT_SQL.replace("outbox", "outbox2").encode(), _row(second[0]))
    tables = ({"table": "public.outbox"}, {"table": "public.outbox2"})
    settings = relay_settings(env, outbox_tables=tables)
    sweeper = Sweeper(settings)
    with psycopg.connect(database, autocommit=True) as conn:  # as the relay records them
        _record_relayed(conn, settings)

    result = sweeper.sweep_until_done(timeout=1)
    assert result.deleted == 0, "no publication: nothing is relayed, so nothing is swept"
    assert set(result.errors) == {"public.outbox", "public.outbox2"}
    assert "not in publication" in result.errors["public.outbox"]

    publication = env["CDC_RELAY_PUBLICATION_NAME"]
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            f"CREATE PUBLICATION {publication} FOR TABLE outbox, outbox2 "
            "WITH (publish = 'insert')".encode()
        )
        _record_relayed(conn, settings)  # a relay's start under the new publication
        sweeper.sweep_once()  # selects the candidates, below the WAL end as of now
        # A record covering them all (as far as a record can: the WAL's end), so that only the
        # guards keep rows now.
        PostgresCheckpointStore(conn, "cdc_relay", env["CDC_RELAY_SLOT_NAME"]).save(
            _insert_lsn(database)
        )
    result = sweeper.sweep_until_done(timeout=1)
    sweeper.close()
    assert {str(i) for b in result.batches for i in b.ids} == {e.id for e in first}
    assert set(result.errors) == {"public.outbox2"}
    assert result.errors["public.outbox2"] == (
        "public.outbox2 has no primary key and column id no unique index, and the sweeper "
        'deletes by a key that names one row: add a primary key, set "row_key" to unique columns '
        "in CDC_RELAY_OUTBOX_COLUMNS, or run CREATE UNIQUE INDEX ON public.outbox2 (id) (or "
        "CDC_RELAY_SWEEP_INTERVAL=0)"
    )
    assert scalar(database, "SELECT count(*) FROM outbox2") == 1


def test_rows_older_than_the_slot_are_never_swept(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    """Rows committed before the slot existed were never streamed: never delete them."""
    create_outbox(database)
    before = _events(20, "before")
    write_transactions(database, [before])  # no slot yet: these are in no WAL stream
    env = relay_env(database, broker.bootstrap_servers, unique, **RELAY)
    after = _events(20, "after")
    with streaming_relay(env) as relay:
        write_transactions(database, [after])
        consume_all(broker.bootstrap_servers, [f"{unique}.order"], 20, 30)
        sweeper = Sweeper(relay_settings(env))
        result = sweeper.sweep_until_done(timeout=15)
        sweeper.close()
        assert relay.stop() == 0
    assert {str(i) for b in result.batches for i in b.ids} == {e.id for e in after}
    assert _remaining(database) == {e.id for e in before}


def test_the_relay_sweeps_what_it_published(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    """The sweeper inside the relay process (on by default): the table empties, Kafka has all."""
    create_outbox(database)
    port = free_port()
    env = relay_env(
        database,
        broker.bootstrap_servers,
        unique,
        sweep_interval="0.5",
        idle_confirm_interval="0.3",
        http_port=str(port),
    )
    events = _events(300, "swept")
    with streaming_relay(env) as relay:
        write_transactions(database, _batches(events, 10))
        records = consume_all(broker.bootstrap_servers, [f"{unique}.order"], 300, 30)
        wait_until(lambda: not _remaining(database), 30, "the relay's sweeper to empty the table")
        status = orjson.loads(http_get(port, "/status")[1])
        metrics = http_get(port, "/metrics")[1].decode()
        assert relay.stop() == 0
    assert set(_ids(records)) == {e.id for e in events}
    assert status["swept_rows"] == 300
    assert "cdc_relay_sweeper_rows_deleted_total" in metrics
