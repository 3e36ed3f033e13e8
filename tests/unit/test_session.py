"""The session loop's rules, driven with captured pgoutput messages and in-memory collaborators.

The integration tests prove the same rules against PostgreSQL and a broker; these pin each rule
down on its own, fast: confirm only after Kafka acknowledged, the record before the slot,
dead-lettering, the ``stop`` policy, the idle advance and the clean shutdown.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from confluent_kafka import KafkaError

from cdc_relay.config import Settings, load_settings
from cdc_relay.decode import decoder_for
from cdc_relay.decode.messages import Commit, Insert
from cdc_relay.errors import (
    LeadershipLost,
    PoisonRecordError,
    ProtocolError,
    PublicationChanged,
    SinkUnavailable,
    StopSession,
)
from cdc_relay.kafka_transaction import Resend
from cdc_relay.observability.stats import RelayStats
from cdc_relay.observability.tracing import Tracing
from cdc_relay.reconcile import ORDINALS, POSITION_HEADER, Reconciliation, parse_position
from cdc_relay.session import Session
from cdc_relay.topics import TopicRules
from tests.fakes import (
    DeliveredMessage,
    FakeOwner,
    FakeSink,
    FakeSource,
    FakeStore,
    captured_frames,
    keepalive_frame,
)

TOPIC_ORDER = "outbox.event.order"
TOPIC_CITY = "outbox.event.city"
DEAD_LETTER = "dead.letters"


def _settings(**overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "database_url": "postgresql://relay@db/app",
        "kafka_bootstrap_servers": "k:9092",
        "dead_letter_topic": DEAD_LETTER,
        "confirm_interval": 1e-9,  # confirm at every chance
        "idle_confirm_interval": 1e-9,
        "shutdown_timeout": 1.0,
        **overrides,
    }
    return load_settings(**values)


class Harness:
    """One session over fakes; ``journal`` holds record and slot writes in order."""

    def __init__(
        self,
        frames: list[bytes],
        stop_after: int | None = None,
        reconciliation: Reconciliation | None = None,
        resend: Resend | None = None,
        source_type: type[FakeSource] = FakeSource,
        sink: FakeSink | None = None,
        **settings: Any,
    ) -> None:
        self.settings = _settings(**settings)
        self.journal: list[Any] = []
        self.owner = FakeOwner()
        self.source = source_type(frames, self.owner, self.journal, stop_after)
        self.sink = sink or FakeSink()
        self.store = FakeStore(self.journal)
        self.stats = RelayStats()
        self.session = Session(
            self.owner,
            self.settings,
            self.stats,
            Tracing(),
            TopicRules(self.settings),
            source=self.source,
            sink=self.sink,
            store=self.store,
            start=0,
            heartbeat=lambda: None,
            retained_wal=lambda: None,
            reconciliation=reconciliation,
            resend=resend,
        )

    def run(self) -> None:
        """Stream until the frames run out (the source then asks for a stop), then shut down."""
        with pytest.raises(StopSession):
            self.session.stream()
        self.session.shutdown()

    def records(self) -> list[tuple[int, int]]:
        return [entry for entry in self.journal if entry[0] == "record"]


def _commits(frames: list[bytes]) -> list[int]:
    decode = decoder_for(_settings())
    return [m.end_lsn for f in frames for m in decode(memoryview(f)) if isinstance(m, Commit)]


def _events(frames: list[bytes]) -> int:
    decode = decoder_for(_settings())
    return sum(1 for f in frames for m in decode(memoryview(f)) if isinstance(m, Insert))


FRAMES = captured_frames("basic_insert")


def test_the_fixture_has_two_transactions_of_one_event_each() -> None:
    assert _events(FRAMES) == 2
    assert len(_commits(FRAMES)) == 2


def test_events_are_published_in_commit_order_keyed_by_aggregate() -> None:
    harness = Harness(FRAMES)
    harness.run()
    delivered = harness.sink.delivered
    assert [(r.topic, r.key) for r in delivered] == [
        (TOPIC_ORDER, b"order-1"),
        (TOPIC_CITY, "Zürich 東京 🚀".encode()),
    ]
    assert delivered[0].header("id") == b"00000000-0000-4000-8000-000000000001"
    assert delivered[0].value == b'{"total": 42, "currency": "EUR"}'


def test_nothing_is_confirmed_before_kafka_acknowledges() -> None:
    harness = Harness(FRAMES)
    harness.sink.acknowledging = False
    with pytest.raises(StopSession):
        harness.session.stream()
    harness.session.housekeeping()
    assert harness.sink.in_flight() == 2
    assert harness.store.saved == []
    assert all(flushed == 0 for _, flushed in harness.source.statuses)

    harness.sink.acknowledging = True
    harness.session.housekeeping()
    last_commit = _commits(FRAMES)[-1]
    assert harness.store.saved == [last_commit]


def test_the_record_is_written_before_the_slot_is_told() -> None:
    harness = Harness(FRAMES)
    harness.run()
    writes = [e for e in harness.journal if e[1] > 0]
    assert writes, "something was confirmed"
    for position in {lsn for _, lsn in writes}:
        kinds = [kind for kind, lsn in writes if lsn == position]
        assert kinds[0] == "record", (position, kinds)
    assert harness.store.saved[-1] == _commits(FRAMES)[-1]


def test_a_partly_acknowledged_backlog_confirms_only_the_contiguous_prefix() -> None:
    harness = Harness(FRAMES)
    harness.sink.acknowledging = False
    with pytest.raises(StopSession):
        harness.session.stream()
    first, second = harness.sink.in_flight_records
    # The second transaction's record is acknowledged first: nothing may be confirmed yet.
    harness.sink.in_flight_records = [first]
    second.on_delivery(None, DeliveredMessage(second))
    harness.session.housekeeping()
    assert harness.store.saved == []
    harness.sink.acknowledging = True
    harness.session.housekeeping()
    assert harness.store.saved == [_commits(FRAMES)[-1]]


def test_a_record_kafka_refuses_is_dead_lettered_and_then_confirmed() -> None:
    harness = Harness(FRAMES)
    harness.sink.refuse_topics[TOPIC_CITY] = KafkaError.MSG_SIZE_TOO_LARGE
    harness.run()
    assert [r.key for r in harness.sink.on_topic(TOPIC_ORDER)] == [b"order-1"]
    (letter,) = harness.sink.on_topic(DEAD_LETTER)
    assert letter.header("cdc_relay.topic") == TOPIC_CITY.encode()
    assert letter.header("cdc_relay.error_code") == b"MSG_SIZE_TOO_LARGE"
    assert letter.header("cdc_relay.event_id") == b"00000000-0000-4000-8000-000000000002"
    assert letter.value is None, "a value too large to travel is left out"
    assert harness.stats.dead_lettered == 1
    assert harness.store.saved[-1] == _commits(FRAMES)[-1]
    assert harness.owner.failure is None


def test_a_record_the_broker_refuses_after_producing_is_dead_lettered() -> None:
    harness = Harness(FRAMES)
    harness.sink.acknowledging = False
    with pytest.raises(StopSession):
        harness.session.stream()
    harness.sink.fail_in_flight(KafkaError.TOPIC_EXCEPTION, "Broker: invalid topic")
    harness.sink.acknowledging = True
    harness.session.housekeeping()  # handles the failures: two dead letters go out
    harness.session.housekeeping()  # and are acknowledged
    assert [r.header("cdc_relay.topic") for r in harness.sink.on_topic(DEAD_LETTER)] == [
        TOPIC_ORDER.encode(),
        TOPIC_CITY.encode(),
    ]
    assert harness.store.saved[-1] == _commits(FRAMES)[-1]


def test_a_transient_delivery_failure_ends_the_session() -> None:
    harness = Harness(FRAMES)
    harness.sink.acknowledging = False
    with pytest.raises(StopSession):
        harness.session.stream()
    harness.sink.fail_in_flight(KafkaError._MSG_TIMED_OUT, "Local: Message timed out")
    with pytest.raises(SinkUnavailable, match="timed out"):
        harness.session.housekeeping()
    assert harness.store.saved == []


def test_the_stop_policy_fails_and_confirms_nothing_past_the_poison_record() -> None:
    harness = Harness(FRAMES, poison_policy="stop")
    harness.sink.refuse_topics[TOPIC_CITY] = KafkaError.MSG_SIZE_TOO_LARGE
    harness.run()
    assert isinstance(harness.owner.failure, PoisonRecordError)
    assert "00000000-0000-4000-8000-000000000002" in str(harness.owner.failure)
    assert harness.sink.on_topic(DEAD_LETTER) == []
    first_commit = _commits(FRAMES)[0]
    assert harness.store.saved == [first_commit], "only the transaction before the poison row"


def test_a_publication_changed_under_the_relay_stops_it_and_nothing_more_is_confirmed() -> None:
    """A write of the position finds another publication: it writes nothing, the relay is told
    to stop at once, and neither the loop nor the clean stop tries again."""
    harness = Harness([*FRAMES, keepalive_frame(0x7000000)])
    harness.store.changed_after = 0
    harness.run()
    assert isinstance(harness.owner.failure, PublicationChanged)
    assert "changed under the relay" in str(harness.owner.failure)
    assert harness.store.saved == []
    assert harness.store.attempts == 1
    assert all(flushed == 0 for _, flushed in harness.source.statuses)


class _FullDeadLetterQueue(FakeSink):
    """A producer whose queue has no room for the dead-letter topic, for ever (a broker that
    never answers, with ``message.timeout.ms=0``); it counts the waits."""

    def __init__(self) -> None:
        super().__init__()
        self.full_waits = 0

    def produce_raw(self, topic: str, *args: Any) -> None:
        if topic == DEAD_LETTER:
            raise BufferError("Local: Queue full")
        super().produce_raw(topic, *args)

    def poll(self, timeout: float = 0) -> int:
        self.full_waits += 1
        return super().poll(timeout)


def test_a_stop_ends_the_wait_for_room_in_a_full_queue_of_dead_letters() -> None:
    sink = _FullDeadLetterQueue()
    # SIGTERM once the second transaction's Begin is read: it may read on for 0.2 s, no longer.
    harness = Harness(FRAMES, stop_after=5, sink=sink, shutdown_timeout=0.2)
    sink.refuse_topics[TOPIC_CITY] = KafkaError.MSG_SIZE_TOO_LARGE
    started = time.monotonic()
    with pytest.raises(StopSession):
        harness.session.stream()
    assert time.monotonic() - started < 2.0
    assert sink.full_waits > 0, "it did wait for room before the deadline"
    harness.session.shutdown()
    assert harness.store.saved == [_commits(FRAMES)[0]], "nothing past the refused row"


def test_a_leader_that_lost_its_lease_stops_waiting_for_dead_letter_room() -> None:
    sink = _FullDeadLetterQueue()
    harness = Harness(FRAMES, sink=sink)
    sink.refuse_topics[TOPIC_CITY] = KafkaError.MSG_SIZE_TOO_LARGE
    harness.owner.leading = False
    with pytest.raises(LeadershipLost):
        harness.session.stream()


def test_an_idle_outbox_follows_the_servers_wal_end() -> None:
    wal_end = 0x5000000
    harness = Harness([keepalive_frame(wal_end - 100), keepalive_frame(wal_end)])
    harness.run()
    assert harness.store.saved[-1] == wal_end
    assert harness.source.statuses[-1] == (wal_end, wal_end)


@pytest.mark.parametrize("size", [1, 9, 17])
def test_a_truncated_keepalive_is_a_protocol_error_not_a_wrong_position(size: int) -> None:
    harness = Harness([keepalive_frame(0x5000000)[:size]])
    with pytest.raises(ProtocolError, match="truncated replication message 'k'"):
        harness.session.stream()
    assert harness.store.saved == []


def test_an_open_transaction_holds_the_idle_advance() -> None:
    begin_only = FRAMES[:3]  # Begin, Relation, Insert: no Commit yet
    harness = Harness([*begin_only, keepalive_frame(0x7000000)], shutdown_timeout=1e-9)
    harness.run()
    assert harness.store.saved == []
    assert all(flushed == 0 for _, flushed in harness.source.statuses)


def test_shutdown_drains_in_flight_deliveries_then_confirms() -> None:
    harness = Harness(FRAMES)
    harness.sink.acknowledging = False
    with pytest.raises(StopSession):
        harness.session.stream()
    assert harness.store.saved == []
    harness.sink.acknowledging = True  # the broker answers while the session drains
    harness.session.shutdown()
    assert harness.sink.in_flight() == 0
    assert harness.store.saved == [_commits(FRAMES)[-1]]


def test_a_stop_inside_a_transaction_reads_on_to_its_commit() -> None:
    harness = Harness(FRAMES, stop_after=2)  # asked to stop after Begin and Relation
    harness.run()
    assert [r.key for r in harness.sink.delivered] == [b"order-1"]
    assert harness.store.saved == [_commits(FRAMES)[0]], "the whole transaction, and no more"


def test_a_stop_that_cannot_wait_leaves_the_transaction_unconfirmed() -> None:
    harness = Harness(FRAMES, stop_after=2, shutdown_timeout=1e-9)
    harness.run()
    assert harness.store.saved == []


def test_a_leader_that_lost_its_lease_confirms_nothing_more() -> None:
    harness = Harness(FRAMES)
    harness.sink.acknowledging = False
    with pytest.raises(StopSession):
        harness.session.stream()
    harness.sink.acknowledging = True
    harness.owner.leading = False  # e.g. it woke from SIGSTOP after a standby took over
    with pytest.raises(LeadershipLost):
        harness.session.housekeeping()
    assert harness.store.saved == []
    assert all(flushed == 0 for _, flushed in harness.source.statuses)


def test_every_record_carries_its_position_and_the_record_its_offsets() -> None:
    harness = Harness(FRAMES)
    harness.run()
    delivered = harness.sink.delivered
    positions = [r.header(POSITION_HEADER) for r in delivered]
    parsed = [parse_position(p) for p in positions if p is not None]
    commits = _commits(FRAMES)
    assert len(parsed) == 2
    assert [p[0] for p in parsed if p] == [harness.settings.slot_name] * 2
    assert all(p is not None and p[2] == 1 for p in parsed)  # one event per transaction
    assert sorted(p[1] for p in parsed if p) == sorted({p[1] for p in parsed if p})
    assert harness.store.saved[-1] == commits[-1]
    assert set(harness.store.offsets[-1]) == {(TOPIC_ORDER, 0), (TOPIC_CITY, 0)}
    # Before the first record to each topic, where its partitions ended (none acknowledged yet).
    assert harness.store.noted == {(TOPIC_ORDER, 0): 0, (TOPIC_CITY, 0): 0}


def _found_first_event(event_id: bytes) -> Reconciliation:
    harness = Harness(FRAMES)
    harness.run()
    first = harness.sink.delivered[0].header(POSITION_HEADER)
    second = harness.sink.delivered[1].header(POSITION_HEADER)
    assert first is not None
    assert second is not None
    lsn = parse_position(second)
    assert lsn is not None
    return Reconciliation(found={first: event_id}, highest_lsn=lsn[1])


def test_an_event_read_back_from_kafka_is_counted_not_sent_again() -> None:
    found = _found_first_event(b"00000000-0000-4000-8000-000000000001")
    harness = Harness(FRAMES, reconciliation=found)
    harness.run()
    assert [r.topic for r in harness.sink.delivered] == [TOPIC_CITY]
    assert harness.stats.skipped_in_kafka == 1
    assert harness.store.saved[-1] == _commits(FRAMES)[-1]  # confirmed past both


def test_the_same_position_with_another_id_is_sent_again() -> None:
    found = _found_first_event(b"another-event")
    harness = Harness(FRAMES, reconciliation=found)
    harness.run()
    assert [r.topic for r in harness.sink.delivered] == [TOPIC_ORDER, TOPIC_CITY]
    assert harness.stats.skipped_in_kafka == 0


def test_a_note_stays_until_an_offset_replaces_it_in_the_record() -> None:
    """An offset acknowledged but not yet recorded must not drop a partition's note: after a
    crash the record would hold neither, and the partition would not be read back (duplicates).
    Seen under load in the integration test of the reconciliation before this fix."""
    harness = Harness(FRAMES, stop_after=3, confirm_interval=3600.0, idle_confirm_interval=3600.0)
    with pytest.raises(StopSession):  # after the first transaction: Begin, Relation, Insert, Commit
        harness.session.stream()
    assert harness.store.noted == {(TOPIC_ORDER, 0): 0}
    harness.session.housekeeping()  # its record is acknowledged, in memory only
    assert harness.sink.on_topic(TOPIC_ORDER)
    assert harness.store.saved == [], "nothing recorded yet"
    harness.owner.stopping = False
    harness.source.stop_after(None)
    with pytest.raises(StopSession):
        harness.session.stream()  # the first record to the second topic notes its partitions
    assert harness.store.noted == {(TOPIC_ORDER, 0): 0, (TOPIC_CITY, 0): 0}


def test_positions_count_on_past_the_precomputed_ordinals() -> None:
    """A transaction of more events than ORDINALS holds: every position is its ordinal, in order,
    the later ones formatted rather than looked up."""
    decode = decoder_for(_settings())
    kinds = [type(decode(memoryview(f))[0]) for f in FRAMES]
    first_insert = kinds.index(Insert)
    first_commit = kinds.index(Commit)
    count = len(ORDINALS) + 5
    frames = [
        *FRAMES[:first_insert],
        *[FRAMES[first_insert]] * count,
        *FRAMES[first_insert + 1 : first_commit + 1],
    ]
    harness = Harness(frames)
    harness.run()
    positions = [r.header(POSITION_HEADER) for r in harness.sink.delivered]
    parsed = [parse_position(p) for p in positions if p is not None]
    assert [p[2] for p in parsed if p] == list(range(1, count + 1))
    prefix = positions[0][: -len(b"1")] if positions[0] else b""
    assert positions[-1] == prefix + b"%d" % count
