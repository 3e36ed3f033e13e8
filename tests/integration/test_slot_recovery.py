"""A lost replication slot recovered from the outbox table itself (``cdc-relay recover``,
``CDC_RELAY_ON_SLOT_LOSS=recover``): every committed event reaches Kafka once, each aggregate's
first occurrences in commit order."""

from __future__ import annotations

import time
from collections.abc import Iterator

import orjson
import psycopg
import pytest

from cdc_relay.local import LocalBroker, LocalPostgres
from cdc_relay.local.lifetime import free_port
from cdc_relay.observability.http import LIVENESS_TIMEOUT
from cdc_relay.reconcile import POSITION_HEADER
from tests.conftest import LOCAL_POSTGRES_SETTINGS, KafkaBroker, skip_if_external
from tests.integration.recovery_support import (
    committed_rows,
    consume_covering,
    current_xid,
    drop_slot,
    judge,
    order_inversions,
    recovery_state,
    run_recover,
    stream_and_read,
    wait_for_horizon,
    write_bulk,
    write_contended,
    wrote,
)
from tests.integration.relay_support import (
    RelayProcess,
    create_outbox,
    http_get,
    log_field,
    new_event,
    relay_env,
    scalar,
    streaming_relay,
    wait_until,
    write_transactions,
)
from tests.integration.test_admin import cdc_relay
from tests.integration.test_relay_faults import _BackgroundWriter
from tests.kafka_helpers import consume_all

pytestmark = [pytest.mark.integration]


def test_a_slot_dropped_while_writers_run_is_recovered_exactly(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    create_outbox(database)
    topic = f"{unique}.order"
    broker.create_topic(topic, partitions=3)
    env = relay_env(database, broker.bootstrap_servers, unique)
    slot = f"slot_{unique}"
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        with _BackgroundWriter(database) as writer:
            wrote(writer, 1500)
            # The record proves most of them published: only the rest are read back.
            wait_for_horizon(database, slot, current_xid(database))
            wrote(writer, 500)
            # A DBA drops the slot under the running relay; it stops, refusing to go on.
            drop_slot(database, slot)
            assert relay.wait(60) == 4
            wrote(writer, 1500)
        logs = relay.logs()
    finally:
        relay.close()
    assert "cdc-relay recover" in logs, logs
    assert "CDC_RELAY_ON_SLOT_LOSS=recover" in logs, logs

    run = run_recover(env)
    assert run.code == 0, run.logs
    assert recovery_state(database, slot)["state"] == "done"
    committed = [event_id for event_id, _ in writer.committed]
    records, committed, _ = stream_and_read(env, broker.bootstrap_servers, topic, committed)
    judge(records, committed).check(
        f"recovered in {run.seconds:.1f}s (peak RSS {run.peak_rss_mb:.0f} MiB)", run.logs
    )


@pytest.fixture
def small_wal_server() -> Iterator[LocalPostgres]:
    """A cluster of its own that invalidates a slot retaining more than 1 MB of WAL (the
    server binaries CDC_RELAY_POSTGRES_BINDIR selects, as the session's)."""
    skip_if_external("starts a PostgreSQL cluster with max_slot_wal_keep_size of its own")
    server = LocalPostgres(settings={**LOCAL_POSTGRES_SETTINGS, "max_slot_wal_keep_size": "1MB"})
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


def invalidate_slot(database: str, slot: str) -> None:
    """Write WAL past max_slot_wal_keep_size and checkpoint: the server gives up the idle slot."""
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS filler (x text)")
        for _ in range(4):
            conn.execute(
                "INSERT INTO filler SELECT repeat('x', 100) FROM generate_series(1, 20000)"
            )
            conn.execute("SELECT pg_switch_wal()")
        conn.execute("CHECKPOINT")
        row = conn.execute(
            "SELECT wal_status FROM pg_replication_slots WHERE slot_name = %s", (slot,)
        ).fetchone()
    assert row is not None
    assert row[0] == "lost", row


def test_a_slot_invalidated_by_max_slot_wal_keep_size_is_recovered_at_the_start(
    small_wal_server: LocalPostgres, broker: KafkaBroker, unique: str
) -> None:
    database = small_wal_server.create_database(f"test_{unique}")
    create_outbox(database)
    topic = f"{unique}.order"
    broker.create_topic(topic, partitions=3)
    env = relay_env(database, broker.bootstrap_servers, unique)
    slot = f"slot_{unique}"
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        with _BackgroundWriter(database) as writer:
            wrote(writer, 1000)
            relay.kill()  # the slot stops moving: the WAL piles up behind it
            wrote(writer, 1500)
    finally:
        relay.close()
    invalidate_slot(database, slot)

    refused = RelayProcess(env).start()
    try:
        assert refused.wait(60) == 4
        logs = refused.logs()
    finally:
        refused.close()
    assert "was invalidated by the server" in logs, logs
    assert "cdc-relay recover" in logs, logs

    committed = [event_id for event_id, _ in writer.committed]
    recovering = {**env, "CDC_RELAY_ON_SLOT_LOSS": "recover"}
    records, committed, logs = stream_and_read(
        recovering, broker.bootstrap_servers, topic, committed
    )
    assert "recovered the slot" in logs
    major = scalar(database, "SHOW server_version")
    judge(records, committed).check(f"invalidated slot (PostgreSQL {major})", logs)


def _lost_with_unpublished_rows(
    database: str, broker: KafkaBroker, unique: str, rows: int, **settings: str
) -> dict[str, str]:
    """A relay that streamed a little and stopped; then ``rows`` more events, and the slot
    dropped. The relay's settings."""
    create_outbox(database)
    broker.create_topic(f"{unique}.order", partitions=3)
    env = relay_env(
        database, broker.bootstrap_servers, unique, idle_confirm_interval="0.2", **settings
    )
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        write_transactions(database, [[new_event(aggregate_id=f"a-{i}")] for i in range(10)])
        wait_for_horizon(database, f"slot_{unique}", current_xid(database))
        assert relay.stop() == 0
    finally:
        relay.close()
    if rows:
        write_bulk(database, rows, 1000)
    drop_slot(database, f"slot_{unique}")
    return env


@pytest.mark.parametrize("when", ["sending", "progressed"])
def test_a_recovery_killed_half_way_finishes_without_a_duplicate(
    database: str, broker: KafkaBroker, unique: str, when: str
) -> None:
    """Killed while its first records are on their way (it finds them again by reading back its
    own position headers), or after it recorded progress (it skips what is acknowledged and
    reads back the rest)."""
    rows = 150_000
    env = _lost_with_unpublished_rows(database, broker, unique, rows)
    slot = f"slot_{unique}"
    first = RelayProcess(env, ["recover"]).start()
    try:
        if when == "sending":
            # Its first records are on their way once it noted where their partitions end.
            wait_until(lambda: bool(recovery_state(database, slot).get("noted")), 120, "a record")
            time.sleep(0.5)
        else:
            wait_until(
                lambda: 0 < int(str(recovery_state(database, slot).get("done", 0))) < rows,
                120,
                "progress recorded",
            )
        first.kill()
    finally:
        first.close()
    state = recovery_state(database, slot)
    assert state["state"] == "publishing"
    shown = cdc_relay(env, "status").stdout
    assert "recovery_state: publishing" in shown, shown
    assert f"recovery_rows: {rows}" in shown, shown
    checked = cdc_relay(env, "check")
    assert "has not ended" in checked.stdout, checked.stdout
    assert checked.returncode == 1
    swept = cdc_relay(env, "sweep", "--once", "--wait", "1")
    assert swept.returncode == 3, swept.stdout  # nothing is swept until it has ended
    assert "a recovery of the slot has not ended" in swept.stdout
    # The relay will not stream before the recovery has ended.
    refused = cdc_relay(env, "run", timeout=120)
    assert refused.returncode == 4, refused.stdout
    assert "a recovery of replication slot" in refused.stderr
    run = run_recover(env)
    assert run.code == 0, run.logs
    shown = cdc_relay(env, "status").stdout
    assert "recovery_state: done" in shown, shown
    assert f"recovery_done: {rows}" in shown, shown
    committed = committed_rows(database)
    records = consume_covering(broker.bootstrap_servers, [f"{unique}.order"], set(committed), 120)
    judge(records, committed).check(
        f"killed at {state['done']} of {state['rows']} rows, run again", run.logs
    )


@pytest.fixture
def commit_timestamp_server() -> Iterator[LocalPostgres]:
    """A cluster of its own with track_commit_timestamp on."""
    skip_if_external("starts a PostgreSQL cluster with track_commit_timestamp of its own")
    server = LocalPostgres(settings={**LOCAL_POSTGRES_SETTINGS, "track_commit_timestamp": "on"})
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.mark.parametrize("commit_timestamps", [False, True])
def test_the_order_recovered_per_aggregate(
    request: pytest.FixtureRequest,
    database: str,
    broker: KafkaBroker,
    unique: str,
    commit_timestamps: bool,
) -> None:
    """Exact with commit timestamps; by transaction id otherwise (measured, not asserted)."""
    if commit_timestamps:
        server = request.getfixturevalue("commit_timestamp_server")
        database = server.create_database(f"test_{unique}")
    env = _lost_with_unpublished_rows(database, broker, unique, 0)
    # Written while the slot is gone: every one of them is recovered.
    write_contended(database, writers=4, transactions=150)
    run = run_recover(env)
    assert run.code == 0, run.logs
    committed = committed_rows(database)
    records = consume_covering(broker.bootstrap_servers, [f"{unique}.order"], set(committed), 120)
    verdict = judge(records, committed)
    assert not verdict.missing
    assert verdict.duplicates == 0
    inverted, pairs = order_inversions([r for r in records if b'"v"' in (r.value or b"")])
    print(
        f"\ncommit_timestamps={commit_timestamps}: {inverted} of {pairs} consecutive events of "
        "an aggregate out of commit order"
    )
    if commit_timestamps:
        assert "commit_order=commit_timestamp" in run.logs
        assert inverted == 0


def test_the_recovery_of_200k_rows_runs_in_bounded_memory(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    """Rows are read through a server-side cursor and sent as Kafka takes them: the recovery's
    memory does not grow with the rows owed (8 bytes a row for its own read-back)."""
    rows = 200_000
    env = _lost_with_unpublished_rows(database, broker, unique, rows)
    run = run_recover(env, timeout=600)
    assert run.code == 0, run.logs
    records = consume_all(broker.bootstrap_servers, [f"{unique}.order"], rows + 10, 120)
    assert len(records) == rows + 10
    rate = log_field(run.logs, "recovered the slot", "seconds")
    print(
        f"\n{rows} rows recovered in {rate} s of publishing ({run.seconds:.1f} s in all, with "
        f"the process's start): {rows / float(str(rate)):,.0f} rows/s; peak RSS "
        f"{run.peak_rss_mb:.0f} MiB"
    )
    assert run.peak_rss_mb < 200


def test_the_leader_recovers_at_its_start_and_the_standby_waits(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    create_outbox(database)
    topic = f"{unique}.order"
    broker.create_topic(topic, partitions=3)
    ports = [free_port(), free_port()]
    env = relay_env(database, broker.bootstrap_servers, unique, on_slot_loss="recover")
    slot = f"slot_{unique}"
    leader = RelayProcess({**env, "CDC_RELAY_HTTP_PORT": str(ports[0])}).start()
    standby = RelayProcess({**env, "CDC_RELAY_HTTP_PORT": str(ports[1])})
    try:
        leader.wait_streaming()
        standby.start()
        standby.wait_for_log("standby: another relay leads")
        with _BackgroundWriter(database) as writer:
            wrote(writer, 1000)
            drop_slot(database, slot)  # the leader's session ends; its next start recovers
            leader.wait_for_log("recovered the slot", 60)
            wrote(writer, 1000)
        committed = [event_id for event_id, _ in writer.committed]
        records = consume_covering(broker.bootstrap_servers, [topic], set(committed), 120)
        shown = orjson.loads(http_get(ports[0], "/status")[1])["recovery"]
        assert orjson.loads(http_get(ports[1], "/status")[1])["role"] == "standby"
        assert leader.stop() == 0
        assert standby.stop() == 0
        standby_logs = standby.logs()
    finally:
        leader.close()
        standby.close()
    judge(records, committed).check("recovered by the leader beside a standby")
    assert "recover" not in standby_logs.replace("recovery_", "")
    assert shown["state"] == "done"
    assert shown["done"] == shown["rows"]
    assert shown["seconds"] >= 0


def test_exactly_once_a_recovery_sends_each_event_once_to_read_committed_consumers(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    create_outbox(database)
    topic = f"{unique}.order"
    broker.create_topic(topic, partitions=3)
    env = relay_env(database, broker.bootstrap_servers, unique, exactly_once="true")
    slot = f"slot_{unique}"
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        with _BackgroundWriter(database) as writer:
            wrote(writer, 1000)
            relay.kill()  # its last Kafka transaction may be open: aborted by the next fence
            drop_slot(database, slot)
            wrote(writer, 1500)
    finally:
        relay.close()
    committed = [event_id for event_id, _ in writer.committed]
    relay = RelayProcess({**env, "CDC_RELAY_ON_SLOT_LOSS": "recover"}).start()
    try:
        relay.wait_streaming(120)
        records = consume_covering(
            broker.bootstrap_servers, [topic], set(committed), 120, isolation="read_committed"
        )
        assert relay.stop() == 0
        logs = relay.logs()
    finally:
        relay.close()
    judge(records, committed).check("exactly once", logs)
    assert "recovered the slot" in logs


def test_a_first_start_adopts_the_rows_a_polling_publisher_left_unpublished(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    create_outbox(database)
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("ALTER TABLE outbox ADD COLUMN published_at timestamptz")
    topic = f"{unique}.order"
    broker.create_topic(topic, partitions=3)
    write_bulk(database, 1000, 100)
    # The polling publisher sent the first 400 (and marked them) before it was stopped.
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("UPDATE outbox SET published_at = now() WHERE (payload->>'n')::int < 400")
    unpublished = committed_rows(database, "published_at IS NULL")
    env = relay_env(
        database, broker.bootstrap_servers, unique, adopt_condition="published_at IS NULL"
    )
    records, committed, logs = stream_and_read(env, broker.bootstrap_servers, topic, unpublished)
    assert len(committed) == 605
    assert len(records) == 605, "the 400 rows the polling publisher sent are not sent again"
    judge(records, committed).check("adopted", logs)
    assert "cause=adopted" in logs
    assert recovery_state(database, f"slot_{unique}")["state"] == "done"


def test_republish_replays_retained_rows_by_aggregate_and_time_marked_as_a_replay(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    create_outbox(database)
    topic, replay = f"{unique}.order", f"{unique}.replay"
    broker.create_topic(topic, partitions=3)
    broker.create_topic(replay, partitions=1)
    env = relay_env(database, broker.bootstrap_servers, unique)
    orders = [new_event(aggregate_id=f"a-{i % 3}", payload={"n": i}) for i in range(30)]
    cities = [new_event(aggregate_type="city", aggregate_id="c-1") for _ in range(5)]
    with streaming_relay(env):
        write_transactions(database, [[e] for e in orders[:20]] + [cities])
        consume_all(broker.bootstrap_servers, [topic], 20, 30)
        middle = scalar(database, "SELECT now()::text")
        write_transactions(database, [[e] for e in orders[20:]])
        consume_all(broker.bootstrap_servers, [topic], 30, 30)

    counted = cdc_relay(env, "republish", "--aggregate-type", "order", "--dry-run")
    assert counted.returncode == 0, counted.stderr
    assert "30 retained row(s) selected; nothing sent" in counted.stdout
    sent = cdc_relay(env, "republish", "--aggregate-type", "order", "--to-topic", replay)
    assert sent.returncode == 0, sent.stderr
    assert "republished 30 of 30 retained row(s)" in sent.stdout
    records = consume_all(broker.bootstrap_servers, [replay], 30, 30, grace=1.0)
    assert [r.header("id") for r in records] == [e.id.encode() for e in orders]  # commit order
    marks = {r.header("cdc_relay.replay") for r in records}
    assert len(marks) == 1
    assert (next(iter(marks)) or b"").startswith(f"slot_{unique}/".encode())
    assert not any(r.header(POSITION_HEADER) for r in records)  # never taken for the relay's own

    later = cdc_relay(env, "republish", "--aggregate-type", "order", "--from", str(middle))
    assert later.returncode == 0, later.stderr
    again = consume_all(broker.bootstrap_servers, [topic], 40, 30, grace=1.0)
    replayed = [r for r in again if r.header("cdc_relay.replay")]
    # To their own topic (three partitions): the ten created since, each aggregate's in order.
    assert sorted(r.header("id") or b"" for r in replayed) == sorted(
        e.id.encode() for e in orders[20:]
    )
    assert judge(replayed, [e.id for e in orders[20:]]).out_of_order == 0


def test_a_relay_recovering_at_its_start_stays_alive_for_its_liveness_probe(
    database: str, local_broker: LocalBroker, unique: str
) -> None:
    """A recovery can take longer than the liveness timeout (30 s): /healthz answers 200 all
    along, or an orchestrator would kill the relay in the middle of it, again and again."""
    env = _lost_with_unpublished_rows(database, local_broker, unique, 20_000)
    port = free_port()
    relay = RelayProcess(
        {**env, "CDC_RELAY_ON_SLOT_LOSS": "recover", "CDC_RELAY_HTTP_PORT": str(port)}
    ).start()
    try:
        slot = f"slot_{unique}"
        wait_until(lambda: bool(recovery_state(database, slot).get("noted")), 60, "a record")
        local_broker.pause()  # Kafka acknowledges nothing: the recovery waits
        try:
            deadline = time.monotonic() + LIVENESS_TIMEOUT + 5
            while time.monotonic() < deadline:
                status, body = http_get(port, "/healthz")
                assert status == 200, body
                time.sleep(1.0)
        finally:
            local_broker.resume()
        relay.wait_for_log("recovered the slot", 120)
        relay.wait_streaming(60)
        assert relay.stop() == 0
    finally:
        relay.close()


@pytest.mark.parametrize("how", ["deleted", "rewritten"])
def test_rows_deleted_or_moved_between_two_runs_of_a_recovery_cost_no_other_row(
    database: str, broker: KafkaBroker, unique: str, how: str
) -> None:
    """A recovery's ordinals name its rows as they were: rows it had sent, deleted before it
    runs again (by hand, or by a sweeper of an older version), or the table rewritten (its rows'
    places break ties in the order), must not make it skip others."""
    rows = 150_000
    env = _lost_with_unpublished_rows(database, broker, unique, rows)
    slot = f"slot_{unique}"
    first = RelayProcess(env, ["recover"]).start()
    try:
        wait_until(
            lambda: 0 < int(str(recovery_state(database, slot).get("done", 0))) < rows,
            120,
            "progress recorded",
        )
        first.kill()
    finally:
        first.close()
    # The first 100,000 rows in its order (commit order) are deleted meanwhile: most it had sent.
    deleted = committed_rows(database)[:100_000] if how == "deleted" else []
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("DELETE FROM outbox WHERE id = ANY(%s::uuid[])", (deleted,))
        if how == "rewritten":
            conn.execute("CLUSTER outbox USING outbox_pkey")  # every row moves
    run = run_recover(env)
    assert run.code == 0, run.logs
    committed = committed_rows(database)
    records = consume_covering(broker.bootstrap_servers, [f"{unique}.order"], set(committed), 120)
    verdict = judge(records, committed)
    print(
        f"\n{how} between two runs ({len(deleted)} deleted): {len(verdict.missing)} lost, "
        f"{verdict.duplicates} duplicates"
    )
    assert not verdict.missing, run.logs
    assert verdict.duplicates == 0, run.logs
    assert "their table rewritten, since it began" in run.logs
