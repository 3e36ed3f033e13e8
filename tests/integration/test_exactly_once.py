"""Exactly once (``CDC_RELAY_EXACTLY_ONCE``): the relay publishes inside Kafka transactions fenced
by the slot's transactional.id, and confirms only what committed (issue 27).

What a ``read_committed`` consumer sees is counted, by event id and by position header: each event
once, in commit order per aggregate, nothing lost — after a clean run, a kill -9, an aborted
transaction (the broker paused past the records' timeout), a fencing producer, and a PostgreSQL
transaction split over Kafka transactions. The test broker does not hide the records of aborted
transactions from ``read_committed`` readers (``../shared/test-broker.md``): the aborted
transaction's test pauses the local broker (so it runs on the test broker only) and asserts the
re-send and that nothing is lost; the others assert each event once on either broker
(``CDC_RELAY_TEST_KAFKA_BOOTSTRAP_SERVERS`` for a real Kafka).
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from confluent_kafka import Producer

from cdc_relay.local import LocalBroker
from cdc_relay.reconcile import POSITION_HEADER
from cdc_relay.transactional_id import transactional_id
from tests.conftest import KafkaBroker
from tests.integration.holding_proxy import END_TXN, HoldingProxy
from tests.integration.relay_support import (
    Event,
    RelayProcess,
    create_outbox,
    new_event,
    relay_env,
    scalar,
    slot_confirmed_lsn,
    wait_until,
    write_transactions,
)
from tests.integration.test_relay_faults import _BackgroundWriter, kill_while_writing
from tests.kafka_helpers import Record, consume_all

pytestmark = pytest.mark.integration


def _ids(records: list[Record]) -> list[str]:
    return [(r.header("id") or r.header("cdc_relay.event_id") or b"").decode() for r in records]


def _read_committed(
    bootstrap: str, topics: list[str], ids: set[str], timeout: float = 60, grace: float = 2.0
) -> list[Record]:
    """What a read_committed consumer sees once every one of ``ids`` arrived (or at the
    timeout), with a grace period so that duplicates show too."""
    deadline = time.monotonic() + timeout
    while True:
        records = consume_all(
            bootstrap, topics, len(ids), 30, grace=grace, isolation="read_committed"
        )
        if ids <= set(_ids(records)) or time.monotonic() > deadline:
            return records
        time.sleep(1.0)


def _exactly_once_env(
    database: str, broker: KafkaBroker, unique: str, **extra: str
) -> dict[str, str]:
    return relay_env(database, broker.bootstrap_servers, unique, exactly_once="true", **extra)


def _recorded(database: str, slot: str) -> int:
    from cdc_relay.lsn import parse_lsn  # noqa: PLC0415

    text = scalar(
        database,
        "SELECT confirmed_lsn::text FROM cdc_relay.slot_position WHERE slot_name = %s",
        slot,
    )
    return parse_lsn(str(text)) if text is not None else 0


def _write(
    database: str, batches: list[list[Event]], between: Callable[[], None] | None = None
) -> int:
    """Commit each batch as its own transaction; the WAL insert position after the last."""
    from cdc_relay.lsn import parse_lsn  # noqa: PLC0415

    write_transactions(database, batches, between=between)
    return parse_lsn(str(scalar(database, "SELECT pg_current_wal_insert_lsn()::text")))


def _read_committed_and_confirmed(
    database: str,
    slot: str,
    broker: KafkaBroker,
    topics: list[str],
    events: list[Event],
    written: int,
) -> list[Record]:
    """What a read_committed consumer sees once every one of ``events`` arrived, after the slot
    confirmed past ``written`` (all the test wrote)."""
    records = _read_committed(broker.bootstrap_servers, topics, {e.id for e in events})
    wait_until(lambda: slot_confirmed_lsn(database, slot) >= written, 30, "the slot confirmed")
    return records


def _transaction_markers(records: list[Record]) -> int:
    """Offsets skipped inside the partitions read: each Kafka transaction's commit marker takes
    one in every partition it wrote (a plain producer's records are contiguous)."""
    offsets: dict[tuple[str, int], list[int]] = defaultdict(list)
    for record in records:
        offsets[record.topic, record.partition].append(record.offset)
    return sum(max(o) - min(o) + 1 - len(o) for o in offsets.values())


def _in_commit_order(records: list[Record], events: list[Event]) -> None:
    """Per aggregate (one partition each), the events arrived in the order they committed."""
    order = {e.id: n for n, e in enumerate(events)}
    seen: dict[tuple[str, bytes], list[int]] = defaultdict(list)
    for record, event_id in zip(records, _ids(records), strict=True):
        if event_id in order:
            seen[record.topic, record.key or b""].append(order[event_id])
    for key, positions in seen.items():
        assert positions == sorted(positions), f"aggregate {key!r} out of commit order"


@pytest.mark.usefixtures("plugin")
def test_a_read_committed_consumer_sees_each_event_once_in_commit_order(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    create_outbox(database)
    topics = [f"{unique}.order", f"{unique}.city"]
    for topic in topics:
        broker.create_topic(topic, partitions=3)
    env = _exactly_once_env(database, broker, unique, confirm_interval="0.2")
    slot = f"slot_{unique}"
    batches = [
        [
            new_event(
                aggregate_type="order" if (t + i) % 3 else "city",
                aggregate_id=f"a-{(t * 7 + i) % 11}",
                payload={"t": t, "i": i},
            )
            for i in range(1 + t % 6)
        ]
        for t in range(150)
    ]
    events = [e for batch in batches for e in batch]
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        # Two halves, the second written once the first is confirmed (its Kafka transaction
        # committed): at least two Kafka transactions, whose commit markers the offsets show
        # below, however fast the relay reads (all at once, it could make them one).
        first = _write(database, batches[:75])
        wait_until(lambda: slot_confirmed_lsn(database, slot) >= first, 60, "the first half")
        written = _write(database, batches[75:])
        records = _read_committed_and_confirmed(database, slot, broker, topics, events, written)
        assert _recorded(database, slot) >= written, "the position record is confirmed too"
        assert relay.stop() == 0
        logs = relay.logs()
    finally:
        relay.close()
    ids = _ids(records)
    assert Counter(ids) == Counter(e.id for e in events), logs
    positions = [r.header(POSITION_HEADER) for r in records]
    assert all(positions)
    assert len(set(positions)) == len(positions)
    _in_commit_order(records, events)
    assert _transaction_markers(records) > 0, "published inside Kafka transactions"


def test_kill_9_mid_stream_then_a_restart_sends_each_event_once(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    create_outbox(database)
    topic = f"{unique}.order"
    broker.create_topic(topic, partitions=3)
    env = _exactly_once_env(database, broker, unique)
    relay = RelayProcess(env).start()
    relay.wait_streaming()
    with _BackgroundWriter(database) as writer:
        kill_while_writing(relay, env, writer, 2, 600)
    committed = [event_id for event_id, _ in writer.committed]
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        records = _read_committed(broker.bootstrap_servers, [topic], set(committed), 120)
        assert relay.stop() == 0
        logs = relay.logs()
    finally:
        relay.close()
    counts = Counter(_ids(records))
    missing = set(committed) - set(counts)
    assert not missing, f"{len(missing)} of {len(committed)} events lost:\n{logs}"
    twice = [event_id for event_id, n in counts.items() if n > 1]
    assert not twice, f"{len(twice)} events twice"
    assert _transaction_markers(records) > 0


def test_an_aborted_kafka_transaction_is_sent_again(
    database: str, local_broker: LocalBroker, unique: str
) -> None:
    create_outbox(database)
    topic = f"{unique}.order"
    local_broker.create_topic(topic, partitions=2)
    # A record not delivered within 2 s fails inside its Kafka transaction, which must then abort.
    env = _exactly_once_env(
        database,
        local_broker,
        unique,
        kafka_producer_config='{"message.timeout.ms": "2000", "transaction.timeout.ms": "3000"}',
        delivery_stall_timeout="60",
    )
    slot = f"slot_{unique}"
    before = [new_event(aggregate_id=f"a-{i}", payload={"n": i}) for i in range(10)]
    during = [new_event(aggregate_id=f"a-{i}", payload={"n": 10 + i}) for i in range(10)]
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        write_transactions(database, [before])
        _read_committed(local_broker.bootstrap_servers, [topic], {e.id for e in before}, 30, 0)
        local_broker.pause()
        try:
            written = _write(database, [during])
            relay.wait_for_log("inside a Kafka transaction", 30)  # the delivery failed
            assert slot_confirmed_lsn(database, slot) < written, "nothing of it confirmed"
        finally:
            local_broker.resume()
        records = _read_committed_and_confirmed(
            database, slot, local_broker, [topic], during, written
        )
        assert relay.stop() == 0
        logs = relay.logs()
    finally:
        relay.close()
    counts = Counter(_ids(records))
    print(f"\naborted and sent again: {sum(counts[e.id] for e in during)} copies of 10 events")
    assert all(counts[e.id] >= 1 for e in before + during), f"nothing lost:\n{logs}"
    assert all(counts[e.id] == 1 for e in before), "what committed before is not sent again"
    # The re-send resumed at the committed position: no read-back (it would skip the aborted
    # copies the test broker keeps visible).
    assert logs.count("reconciled with Kafka") + logs.count("nothing to reconcile") == 1, logs
    assert logs.count("streaming") >= 2, logs


def _system_identifier(database: str) -> str:
    return str(scalar(database, "SELECT system_identifier::text FROM pg_control_system()"))


def test_a_producer_that_fences_the_relay_makes_it_stand_by_and_lose_nothing(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    create_outbox(database)
    topic = f"{unique}.order"
    broker.create_topic(topic, partitions=2)
    env = _exactly_once_env(database, broker, unique)
    slot = f"slot_{unique}"
    first = [new_event(aggregate_id=f"a-{i}", payload={"n": i}) for i in range(10)]
    after = [[new_event(aggregate_id=f"a-{i}", payload={"n": 10 + 5 * t + i}) for i in range(5)]
             for t in range(20)]  # fmt: skip
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        write_transactions(database, [first])
        _read_committed(broker.bootstrap_servers, [topic], {e.id for e in first}, 30, 0)
        fencer = Producer(
            {
                "bootstrap.servers": broker.bootstrap_servers,
                "transactional.id": transactional_id(_system_identifier(database), slot),
            }
        )
        fencer.init_transactions(30)
        written = _write(database, after, between=lambda: time.sleep(0.05))
        relay.wait_for_log("lost the leadership", 30)
        events = first + [e for batch in after for e in batch]
        records = _read_committed_and_confirmed(database, slot, broker, [topic], events, written)
        assert relay.stop() == 0
        logs = relay.logs()
    finally:
        relay.close()
    counts = Counter(_ids(records))
    assert all(counts[e.id] >= 1 for e in events), f"nothing lost:\n{logs}"
    assert all(n == 1 for n in counts.values()), "each event once"
    assert "fenced" in logs
    assert logs.count("streaming") >= 2, "it led again, fencing the other producer"


def test_a_postgresql_transaction_larger_than_the_split_bound_arrives_complete_once(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    create_outbox(database)
    topic = f"{unique}.order"
    broker.create_topic(topic, partitions=3)
    # Split past 10 x 20 = 200 events: a 1,000-event transaction goes out in several parts.
    env = _exactly_once_env(database, broker, unique, transaction_max_events="20")
    slot = f"slot_{unique}"
    large = [new_event(aggregate_id=f"a-{i % 7}", payload={"n": i}) for i in range(1000)]
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        written = _write(database, [large])
        records = _read_committed_and_confirmed(database, slot, broker, [topic], large, written)
        assert relay.stop() == 0
        logs = relay.logs()
    finally:
        relay.close()
    assert Counter(_ids(records)) == Counter(e.id for e in large), logs
    assert "too large for one Kafka transaction" in logs
    _in_commit_order(records, large)
    assert _transaction_markers(records) > 0  # commit markers inside the one transaction's run


def _reads_back(logs: str) -> int:
    return logs.count("reconciled with Kafka") + logs.count("nothing to reconcile")


@dataclass
class _Batches:
    """Events committed before the commit that gets no answer, in it, and after it."""

    before: list[Event]
    during: list[Event]
    after: list[Event]

    @classmethod
    def made(cls) -> _Batches:
        def batch(first: int) -> list[Event]:
            return [new_event(aggregate_id=f"a-{i}", payload={"n": first + i}) for i in range(10)]

        return cls(batch(0), batch(10), batch(20))

    @property
    def events(self) -> list[Event]:
        return self.before + self.during + self.after

    def copies(self, records: list[Record]) -> dict[str, list[int]]:
        """How many times each event of each batch arrived."""
        counts = Counter(_ids(records))
        named = (("before", self.before), ("during", self.during), ("after", self.after))
        return {name: [counts[e.id] for e in batch] for name, batch in named}


def _prepared(database: str, broker: KafkaBroker, unique: str) -> _Batches:
    """The outbox, the test's topic (``<unique>.order``), and the events to write."""
    create_outbox(database)
    broker.create_topic(f"{unique}.order", partitions=2)
    return _Batches.made()


def _commit_without_an_answer(
    database: str, broker: KafkaBroker, proxy: HoldingProxy, relay: RelayProcess,
    batches: _Batches, unique: str, *, arrives: bool = True,
) -> int:  # fmt: skip
    """The relay publishes ``before``; then its commit of ``during`` gets no answer (its EndTxn
    reached the broker, or not). Returns the WAL position after ``during``."""
    topic = f"{unique}.order"
    relay.wait_streaming()
    write_transactions(database, [batches.before])
    _read_committed(broker.bootstrap_servers, [topic], {e.id for e in batches.before}, 30, 0)
    assert proxy.cut_after(relay.pid, END_TXN, arrives=arrives) > 0
    written = _write(database, [batches.during])
    assert proxy.cut.wait(30), "the relay sent no EndTxn"
    return written


def _sent_once_after(
    database: str, broker: KafkaBroker, relay: RelayProcess, batches: _Batches, unique: str
) -> str:
    """``after`` committed and published: every event of the batches arrived once (a
    read_committed consumer counts), and the relay stopped cleanly. Returns its logs."""
    written = _write(database, [batches.after])
    records = _read_committed_and_confirmed(
        database, f"slot_{unique}", broker, [f"{unique}.order"], batches.events, written
    )
    assert relay.stop() == 0
    logs = relay.logs()
    copies = batches.copies(records)
    assert all(n == 1 for batch in copies.values() for n in batch), f"{copies}\n{logs}"
    return logs


@pytest.mark.parametrize("arrives", [True, False], ids=["commit arrived", "commit lost"])
def test_a_commit_of_unknown_outcome_is_settled_before_anything_is_sent_again(
    database: str, broker: KafkaBroker, unique: str, arrives: bool
) -> None:
    """The commit (EndTxn) reaches the broker, which commits; its answer never comes back, past
    transaction.timeout.ms: the relay gives up on it, not knowing. The next session fences and
    reads back (read_committed) before it sends anything: it finds the transaction committed and
    sends none of it again — on either broker.

    The commit lost on the way (it never arrived): on Apache Kafka the fence aborts the open
    transaction, read_committed hides it, and the read-back does not find it: it is sent again,
    once. The test broker neither aborts nor hides it, so there the read-back finds its records
    and the consumer counts them once: that branch is verified only against an Apache Kafka
    (CDC_RELAY_TEST_KAFKA_BOOTSTRAP_SERVERS)."""
    batches = _prepared(database, broker, unique)
    with HoldingProxy(broker.bootstrap_servers) as proxy:
        env = _exactly_once_env(
            database,
            broker,
            unique,
            kafka_bootstrap_servers=proxy.bootstrap_servers,
            kafka_producer_config='{"transaction.timeout.ms": "3000"}',
        )
        relay = RelayProcess(env).start()
        try:
            written = _commit_without_an_answer(
                database, broker, proxy, relay, batches, unique, arrives=arrives
            )
            relay.wait_for_log("session ended, retrying", 30)  # it gave up on the commit
            assert slot_confirmed_lsn(database, f"slot_{unique}") < written, "none confirmed"
            proxy.release()
            logs = _sent_once_after(database, broker, relay, batches, unique)
        finally:
            relay.close()
    assert "outcome is unknown" in logs, logs
    assert _reads_back(logs) == 2, "read back at the start, and to settle the commit"


SHUTDOWN_TIMEOUT = 5.0
# What a stop may take past CDC_RELAY_SHUTDOWN_TIMEOUT: the abort (at most 1 s), the producer's
# close (its purged reports: at most 1 s), the position's last write and the process's exit.
EXIT_SLACK = 4.0


def test_a_stop_during_a_commit_that_cannot_finish_ends_within_the_shutdown_timeout(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    """SIGTERM while a commit waits for an answer that does not come (transaction.timeout.ms at
    its default, 60 s): the relay ends within CDC_RELAY_SHUTDOWN_TIMEOUT and a few seconds,
    confirming nothing of it; the next start settles it (fence, read-back): nothing twice, nothing
    lost."""
    batches = _prepared(database, broker, unique)
    with HoldingProxy(broker.bootstrap_servers) as proxy:
        env = _exactly_once_env(
            database,
            broker,
            unique,
            kafka_bootstrap_servers=proxy.bootstrap_servers,
            shutdown_timeout=f"{SHUTDOWN_TIMEOUT:g}",
        )
        relay = RelayProcess(env).start()
        try:
            written = _commit_without_an_answer(database, broker, proxy, relay, batches, unique)
            time.sleep(1.0)  # the commit waits for its answer
            stopped = time.monotonic()
            code = relay.stop(timeout=120)
            took = time.monotonic() - stopped
            logs = relay.logs()
        finally:
            relay.close()
        print(f"\nstopped during a stuck commit: exited {code} after {took:.1f}s")
        assert code == 0, logs
        assert took < SHUTDOWN_TIMEOUT + EXIT_SLACK, f"{took:.1f}s\n{logs}"
        assert slot_confirmed_lsn(database, f"slot_{unique}") < written, "none confirmed"
        assert "outcome is unknown" in logs, logs
        proxy.release()
    relay = RelayProcess(_exactly_once_env(database, broker, unique)).start()
    try:
        relay.wait_streaming()
        logs = _sent_once_after(database, broker, relay, batches, unique)
    finally:
        relay.close()
    assert "reconciled with Kafka" in logs, logs
