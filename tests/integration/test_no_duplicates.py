"""No duplicates after a crash: a start reads back what an earlier run delivered (issue 13).

Each test kills the relay (``kill -9``) at a point where Kafka holds events the relay had not yet
recorded as confirmed, restarts it, and counts what arrived: every event at least once (never a
loss), and — with reconciliation on — exactly once, by the event id and by the position header.
"""

from __future__ import annotations

import time
from collections import Counter
from functools import partial

import psycopg
import pytest
from confluent_kafka import Producer

from cdc_relay.local import LocalBroker
from cdc_relay.reconcile import POSITION_HEADER
from tests.conftest import KafkaBroker
from tests.integration.recovery_support import drop_slot
from tests.integration.relay_support import (
    Event,
    RelayProcess,
    create_outbox,
    insert_events,
    log_field,
    new_event,
    relay_env,
    scalar,
    slot_confirmed_lsn,
    wait_until,
    write_transactions,
)
from tests.integration.test_relay_faults import _BackgroundWriter, _wrote, kill_while_writing
from tests.kafka_helpers import Record, consume_all

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("plugin")]


def _ids(records: list[Record]) -> list[str]:
    return [(r.header("id") or r.header("cdc_relay.event_id") or b"").decode() for r in records]


def _duplicates(values: list[bytes | str | None]) -> int:
    present = [v for v in values if v]
    return len(present) - len(set(present))


def _consume_covering(bootstrap: str, topic: str, ids: set[str], timeout: float) -> list[Record]:
    """Everything in ``topic`` once every one of ``ids`` arrived (or at the timeout), with a
    grace period so that late duplicates show too."""
    deadline = time.monotonic() + timeout
    while True:
        records = consume_all(bootstrap, [topic], len(ids), 30, grace=2.0)
        if ids <= set(_ids(records)) or time.monotonic() > deadline:
            return records
        time.sleep(1.0)


def _restart_and_count(
    env: dict[str, str], broker: KafkaBroker, topic: str, committed: list[str]
) -> tuple[list[Record], int, int]:
    """A relay started again reads on until every committed event arrived: what arrived, and
    how many duplicates by id and by position (none may be missing)."""
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        records = _consume_covering(broker.bootstrap_servers, topic, set(committed), 120)
        assert relay.stop() == 0
        logs = relay.logs()
    finally:
        relay.close()
    missing = set(committed) - set(_ids(records))
    assert not missing, f"{len(missing)} of {len(committed)} events lost:\n{logs}"
    by_position = _duplicates([r.header(POSITION_HEADER) for r in records])
    return records, _duplicates(list(_ids(records))), by_position


@pytest.mark.parametrize("reconcile", ["false", "true"])
def test_kill_9_repeatedly_with_writers_running(
    database: str, broker: KafkaBroker, unique: str, reconcile: str
) -> None:
    create_outbox(database)
    topic = f"{unique}.order"
    broker.create_topic(topic, partitions=3)
    env = relay_env(database, broker.bootstrap_servers, unique, reconcile=reconcile)
    kills = 3
    relay = RelayProcess(env).start()
    relay.wait_streaming()  # the slot exists before the first event is written
    with _BackgroundWriter(database) as writer:
        kill_while_writing(relay, env, writer, kills, 800)
    committed = [event_id for event_id, _ in writer.committed]

    records, by_id, by_position = _restart_and_count(env, broker, topic, committed)
    ids = _ids(records)
    assert all(r.header(POSITION_HEADER) for r in records)
    print(
        f"\nreconcile={reconcile}: {len(committed)} events, {kills} x kill -9: "
        f"{by_id} duplicates by id, {by_position} by position"
    )
    if reconcile == "true":
        assert by_id == 0
        assert by_position == 0
    counts = Counter(ids)
    assert all(counts[event_id] >= 1 for event_id in committed)


def test_kill_9_and_a_slot_dropped_with_writers_running_lose_and_repeat_nothing(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    """Slot loss as one more fault: kills before and after, the slot dropped while the relay is
    down and the writer runs; the relay recovers at its start (CDC_RELAY_ON_SLOT_LOSS=recover)."""
    create_outbox(database)
    topic = f"{unique}.order"
    broker.create_topic(topic, partitions=3)
    env = relay_env(database, broker.bootstrap_servers, unique, on_slot_loss="recover")
    relay = RelayProcess(env).start()
    relay.wait_streaming()
    with _BackgroundWriter(database) as writer:
        kill_while_writing(relay, env, writer, 2, 600)
        drop_slot(database, f"slot_{unique}")
        relay = RelayProcess(env).start()
        try:
            relay.wait_for_log("recovered the slot", 120)
            wait_until(partial(_wrote, writer, len(writer.committed) + 600), 60, "the writer")
            relay.kill()
            recovered = relay.logs()
        finally:
            relay.close()
    committed = [event_id for event_id, _ in writer.committed]

    _, by_id, by_position = _restart_and_count(env, broker, topic, committed)
    print(
        f"\n{len(committed)} events, 3 x kill -9 and a dropped slot: {by_id} duplicates by id, "
        f"{by_position} by position"
    )
    assert by_id == 0, recovered
    assert by_position == 0


def test_an_event_not_in_kafka_at_the_crash_is_published_after_the_restart(
    database: str, local_broker: LocalBroker, unique: str
) -> None:
    create_outbox(database)
    topic = f"{unique}.order"
    local_broker.create_topic(topic, partitions=2)
    # Records wait 3 s in the producer before they are sent: killed within that time, the
    # relay never sent them (and the paused broker would not have acknowledged them anyway).
    # Nothing is confirmed after the start: the first ten are delivered but unconfirmed.
    env = relay_env(
        database,
        local_broker.bootstrap_servers,
        unique,
        kafka_producer_config='{"linger.ms": "3000"}',
        confirm_interval="3600",
        idle_confirm_interval="3600",
    )
    delivered = [new_event(aggregate_id=f"a-{i}", payload={"n": i}) for i in range(10)]
    unsent = [new_event(aggregate_id=f"a-{i}", payload={"n": 10 + i}) for i in range(10)]
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        wait_until(
            lambda: "nothing to reconcile" in relay.logs() or "reconciled" in relay.logs(),
            10,
            "the start to reconcile",
        )
        write_transactions(database, [delivered])
        assert len(consume_all(local_broker.bootstrap_servers, [topic], 10, 30)) == 10
        local_broker.pause()
        try:
            write_transactions(database, [unsent])
            time.sleep(1.0)  # read by the relay, queued, never sent
            relay.kill()
        finally:
            local_broker.resume()
    finally:
        relay.close()

    # The restart sends at once (the default linger): the 3 s linger above was only there to keep
    # the first run from sending before the kill, so a second past the 20th record is grace
    # enough for a duplicate to show.
    del env["CDC_RELAY_KAFKA_PRODUCER_CONFIG"]
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        records = consume_all(local_broker.bootstrap_servers, [topic], 20, 30, grace=1.0)
        assert relay.stop() == 0
        logs = relay.logs()
    finally:
        relay.close()
    ids = _ids(records)
    assert sorted(ids) == sorted(e.id for e in delivered + unsent), "each exactly once"
    # The first ten were delivered before the crash and found; the others were published now.
    assert log_field(logs, "reconciled with Kafka", "in_kafka") == "10", logs


def test_new_topics_partitions_other_producers_and_dead_letters_in_the_window(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    create_outbox(database)
    order, dead_letter = f"{unique}.order", f"{unique}.dead_letter"
    broker.create_topic(order, partitions=4)
    broker.create_topic(dead_letter, partitions=1)
    env = relay_env(database, broker.bootstrap_servers, unique)
    slot = f"slot_{unique}"

    # A first run writes one partition of one topic, confirms and stops cleanly.
    first = [new_event(aggregate_id="a-0", payload={"n": i}) for i in range(5)]
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        write_transactions(database, [first])
        consume_all(broker.bootstrap_servers, [order], 5, 30)
        assert relay.stop() == 0
    finally:
        relay.close()
    confirmed = slot_confirmed_lsn(database, slot)

    # A second run confirms nothing more: every partition, a topic it creates (city), the
    # dead-letter topic, and another producer writing the same topic, then kill -9.
    env_window = {
        **env,
        "CDC_RELAY_CONFIRM_INTERVAL": "3600",
        "CDC_RELAY_IDLE_CONFIRM_INTERVAL": "3600",
    }
    window = [new_event(aggregate_id=f"a-{i}", payload={"n": i}) for i in range(40)]
    city = [new_event(aggregate_type="city", aggregate_id=f"c-{i}") for i in range(5)]
    poison = new_event(aggregate_type="bad topic!", payload={"n": -1})
    # Idempotent: a retry of its own must not look like a duplicate of ours.
    other = Producer({"bootstrap.servers": broker.bootstrap_servers, "enable.idempotence": True})
    relay = RelayProcess(env_window).start()
    try:
        relay.wait_streaming()
        write_transactions(database, [window[:20], [*city, poison]])
        for i in range(30):  # another producer; some records even claim a position of ours
            other.produce(
                order,
                b"{}",
                f"x-{i}".encode(),
                headers=[("id", f"other-{i}".encode()), (POSITION_HEADER, b"elsewhere/1/1")],
            )
        other.flush(10)
        write_transactions(database, [window[20:]])
        consume_all(broker.bootstrap_servers, [order], 5 + 40 + 30, 30)
        consume_all(broker.bootstrap_servers, [dead_letter], 1, 30)
        consume_all(broker.bootstrap_servers, [f"{unique}.city"], 5, 30)
        assert slot_confirmed_lsn(database, slot) == confirmed, "nothing confirmed in the window"
        relay.kill()
    finally:
        relay.close()

    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        topics = [order, dead_letter, f"{unique}.city"]
        records = consume_all(broker.bootstrap_servers, topics, 5 + 40 + 30 + 1 + 5, 30, grace=3.0)
        assert relay.stop() == 0
        logs = relay.logs()
    finally:
        relay.close()
    ids = _ids(records)
    expected = [e.id for e in [*first, *window, *city, poison]] + [f"other-{i}" for i in range(30)]
    twice = sorted(i for i, n in Counter(ids).items() if n > 1)
    assert sorted(ids) == sorted(expected), f"each exactly once; twice: {twice}\n{logs}"
    assert log_field(logs, "reconciled with Kafka", "in_kafka") == str(40 + 5 + 1), logs


def test_a_broker_that_lost_data_gets_everything_again_and_a_warning(
    database: str, local_broker: LocalBroker, unique: str
) -> None:
    create_outbox(database)
    topic = f"{unique}.order"
    local_broker.create_topic(topic, partitions=2)
    env = relay_env(database, local_broker.bootstrap_servers, unique, reconcile_timeout="3")
    slot = f"slot_{unique}"
    before = [new_event(aggregate_id=f"a-{i}", payload={"n": i}) for i in range(10)]
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        write_transactions(database, [before])
        consume_all(local_broker.bootstrap_servers, [topic], 10, 30)
        wait_until(
            lambda: bool(
                scalar(
                    database,
                    "SELECT acked_offsets IS NOT NULL FROM cdc_relay.slot_position "
                    "WHERE slot_name = %s",
                    slot,
                )
            ),
            20,
            "a confirmation recording the acknowledged offsets",
        )
        relay.kill()
    finally:
        relay.close()
    local_broker.restart()  # the memory engine: every record is gone
    local_broker.create_topic(topic, partitions=2)
    after = [new_event(aggregate_id=f"a-{i}", payload={"n": 10 + i}) for i in range(10)]
    with psycopg.connect(database, autocommit=True) as conn:
        insert_events(conn, after)

    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        records = consume_all(local_broker.bootstrap_servers, [topic], 10, 30, grace=1.0)
        assert relay.stop() == 0
        logs = relay.logs()
    finally:
        relay.close()
    assert "skips nothing" in logs, logs
    assert sorted(_ids(records)) == sorted(e.id for e in after)


MILLION = 1_000_000


@pytest.mark.parametrize("plugin", ["pgoutput"], indirect=True)
def test_start_up_reads_the_unconfirmed_window_not_the_topic(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    create_outbox(database)
    topic = f"{unique}.order"
    broker.create_topic(topic, partitions=3)
    started = time.monotonic()
    filler = Producer(
        {"bootstrap.servers": broker.bootstrap_servers, "linger.ms": 50, "batch.size": 1_000_000}
    )
    value = b"x" * 100
    for i in range(MILLION):
        while True:
            try:
                filler.produce(topic, value, b"k%d" % (i % 1000))
                break
            except BufferError:
                filler.poll(0.05)
        if i % 10_000 == 0:
            filler.poll(0)
    assert filler.flush(120) == 0
    print(f"\n{MILLION} records written by another producer in {time.monotonic() - started:.1f}s")

    env = relay_env(database, broker.bootstrap_servers, unique)
    slot = f"slot_{unique}"
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        write_transactions(database, [[new_event(aggregate_id=f"a-{i}")] for i in range(200)])
        wait_until(
            lambda: bool(
                scalar(
                    database,
                    "SELECT acked_offsets IS NOT NULL FROM cdc_relay.slot_position "
                    "WHERE slot_name = %s",
                    slot,
                )
            ),
            30,
            "a confirmation recording the acknowledged offsets",
        )
        write_transactions(database, [[new_event(aggregate_id=f"a-{i}")] for i in range(300)])
        time.sleep(0.3)
        relay.kill()
    finally:
        relay.close()

    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming(60)
        logs = relay.logs()
        assert relay.stop() == 0
    finally:
        relay.close()
    seconds = log_field(logs, "reconciled with Kafka", "seconds")
    read = log_field(logs, "reconciled with Kafka", "records_read")
    assert seconds is not None, logs
    assert read is not None
    print(f"start-up reconciliation with {MILLION} records in the topic: {seconds}s, {read} read")
    assert int(read) < 20_000, "bounded by the unconfirmed window, not by the topic"


def test_other_producers_large_records_in_the_window_cost_the_start_no_memory(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    create_outbox(database)
    topic = f"{unique}.order"
    broker.create_topic(topic, partitions=1)
    env = relay_env(database, broker.bootstrap_servers, unique)
    slot = f"slot_{unique}"
    first = [new_event(aggregate_id=f"a-{i}") for i in range(5)]
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        write_transactions(database, [first])
        consume_all(broker.bootstrap_servers, [topic], 5, 30)
        assert relay.stop() == 0
    finally:
        relay.close()
    assert scalar(
        database,
        "SELECT acked_offsets IS NOT NULL FROM cdc_relay.slot_position WHERE slot_name = %s",
        slot,
    )

    # Another producer writes after the relay's acknowledged offset: 300 records, ~900 KB of
    # headers each (270 MB in all), which the next start reads back.
    other = Producer(
        {"bootstrap.servers": broker.bootstrap_servers, "message.max.bytes": 2_000_000}
    )
    big = b"h" * 100_000
    for i in range(300):
        other.produce(topic, b"{}", b"x-%d" % i, headers=[(f"h{j}", big) for j in range(9)])
        other.poll(0)
    assert other.flush(60) == 0

    relay = RelayProcess(env).start()
    try:
        relay.wait_for_log("reconciled with Kafka", 60)
        peak = relay.peak_rss_mb()
        later = new_event(aggregate_id="a-later")
        write_transactions(database, [[later]])
        records = consume_all(broker.bootstrap_servers, [topic], 5 + 300 + 1, 60, grace=1.0)
        assert relay.stop() == 0
        logs = relay.logs()
    finally:
        relay.close()
    print(f"\nstart reading back 300 records of 900 KB headers: relay peak RSS {peak:.0f} MiB")
    assert log_field(logs, "reconciled with Kafka", "records_read") == "301", logs
    assert sorted(_ids(records)).count(later.id) == 1
    assert peak < 100, f"the read-back kept other producers' records: peak RSS {peak:.0f} MiB"


def _crash_in_a_window_then_restart(
    env: dict[str, str], database: str, broker: KafkaBroker, topic: str
) -> tuple[list[Event], list[Record], str]:
    """A run delivers ten events to ``topic`` (which holds one already), confirms none and is
    killed; the next run reads back and is stopped. The window, what ``topic`` holds, its logs."""
    window = [new_event(aggregate_id=f"a-{i}", payload={"n": i}) for i in range(10)]
    relay = RelayProcess(
        {**env, "CDC_RELAY_CONFIRM_INTERVAL": "3600", "CDC_RELAY_IDLE_CONFIRM_INTERVAL": "3600"}
    ).start()
    try:
        relay.wait_streaming()
        write_transactions(database, [window])
        consume_all(broker.bootstrap_servers, [topic], 1 + 10, 30)
        relay.kill()
    finally:
        relay.close()
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        records = consume_all(broker.bootstrap_servers, [topic], 1 + 10, 30, grace=3.0)
        assert relay.stop() == 0
        return window, records, relay.logs()
    finally:
        relay.close()


def test_a_dead_letter_cut_to_its_metadata_still_suppresses_duplicates(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    create_outbox(database)
    order, dead_letter = f"{unique}.order", f"{unique}.dead_letter"
    broker.create_topic(order, partitions=2)
    broker.create_topic(dead_letter, partitions=1)
    env = relay_env(database, broker.bootstrap_servers, unique)

    # A first run dead-letters a row whose 5 MB aggregate type is no topic name: the copy is too
    # large with its headers, so it is cut to its metadata. It is the last record of the
    # dead-letter topic at the recorded position.
    first = [new_event(aggregate_id="a-0")]
    poison = new_event(aggregate_type="a" * 5_000_000)
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        write_transactions(database, [first, [poison]])
        letters = consume_all(broker.bootstrap_servers, [dead_letter], 1, 30)
        assert letters[0].header("cdc_relay.dropped") is not None
        assert relay.stop() == 0
    finally:
        relay.close()

    # A second run delivers events, confirms none of them, and is killed; a third reads back.
    window, records, logs = _crash_in_a_window_then_restart(env, database, broker, order)
    ids = _ids(records)
    assert sorted(ids) == sorted(e.id for e in [*first, *window]), f"each exactly once\n{logs}"
    assert "skips nothing" not in logs, logs
    assert log_field(logs, "reconciled with Kafka", "in_kafka") == "10", logs
    assert letters[0].header(POSITION_HEADER), letters


def test_a_partition_whose_recorded_record_is_not_the_relays_leaves_the_others_suppressed(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    create_outbox(database)
    order, dead_letter = f"{unique}.order", f"{unique}.dead_letter"
    broker.create_topic(order, partitions=2)
    broker.create_topic(dead_letter, partitions=1)
    env = relay_env(database, broker.bootstrap_servers, unique)
    slot = f"slot_{unique}"

    first = [new_event(aggregate_id="a-0")]
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        write_transactions(database, [first, [new_event(aggregate_type="bad topic!")]])
        consume_all(broker.bootstrap_servers, [dead_letter], 1, 30)
        assert relay.stop() == 0
    finally:
        relay.close()
    # The record at the dead-letter partition's recorded offset is not the relay's (as after a
    # topic was recreated and written by someone else): that partition is in doubt for good.
    other = Producer({"bootstrap.servers": broker.bootstrap_servers})
    other.produce(dead_letter, b"{}", b"x", headers=[("id", b"other")])
    assert other.flush(10) == 0
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            "UPDATE cdc_relay.slot_position SET acked_offsets = jsonb_set(acked_offsets, "
            "ARRAY[%s, '0'], '1') WHERE slot_name = %s",
            (dead_letter, slot),
        )

    window, records, logs = _crash_in_a_window_then_restart(env, database, broker, order)
    ids = _ids(records)
    assert sorted(ids) == sorted(e.id for e in [*first, *window]), f"each exactly once\n{logs}"
    assert f"{dead_letter}[0]'s record at the acknowledged offset 1 is not this relay's" in logs
    assert log_field(logs, "reconciled with Kafka", "in_kafka") == "10", logs
