"""The recovery's pure parts: the plan as recorded, its position headers, the loss and what an
operator is told, the read-back's sorting of records, and the start's three answers to a loss
(refuse, recover, accept the gap) driven with a server in memory."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cdc_relay.config import Settings
from cdc_relay.errors import PositionMismatch
from cdc_relay.observability.stats import RelayStats
from cdc_relay.reconcile import POSITION_HEADER, ReadBack, parse_position
from cdc_relay.recovery.horizon import Horizon, Snapshot
from cdc_relay.recovery.kafka_check import Earlier, Own, RecoveryCheck, starts_for
from cdc_relay.recovery.loss import interrupted, refusal, slot_loss
from cdc_relay.recovery.plan import Cause, Plan, State, plan_from_json
from cdc_relay.start import StartSequence
from tests.fakes import FakeLeadership, FakeStartDatabase, slot_at

SLOT = "orders_slot"


def _plan(**changes: object) -> Plan:
    plan = Plan(
        cause=Cause.DROPPED,
        state=State.PUBLISHING,
        boundary=1000,
        lost_at=0x1_6B3F28,
        horizon=Horizon(1000, Snapshot(1500, 1503, frozenset({1501})), {("t", 0): 4}, {}, 0x1000),
        slot_lsn=0x1_A0AFA0,
        snapshot=Snapshot(2000, 2004, frozenset({2001, 2003})),
        commit_order="commit_timestamp",
        rows=4080,
        done=2000,
        offsets={("t", 0): 90, ("t", 1): 12},
        noted={("t", 2): 0},
        published=1500,
        dead_lettered=3,
        in_kafka=497,
    )
    return replace(plan, **changes)  # type: ignore[arg-type]


def test_a_plan_survives_the_record() -> None:
    plan = _plan()
    assert plan_from_json(plan.text) == plan
    assert plan_from_json(plan.to_json()) == plan
    creating = _plan(state=State.CREATING, snapshot=None, slot_lsn=0, horizon=None)
    assert plan_from_json(creating.text) == creating


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
        lambda inner: (
            st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=6)
        ),
        max_leaves=20,
    )
)
def test_a_hostile_plan_is_none_or_a_plan(value: object) -> None:
    found = plan_from_json(value)
    assert found is None or isinstance(found, Plan)


@given(st.dictionaries(st.sampled_from(list(_plan().to_json())), st.integers() | st.text()))
def test_a_plan_with_fields_replaced_by_junk_is_refused_or_read(junk: dict[str, object]) -> None:
    value = {**_plan().to_json(), **junk}
    found = plan_from_json(value)
    assert found is None or found.rows >= 0


@given(st.integers(16, 2**64 - 1))
def test_a_recoverys_position_is_never_a_commits_and_below_the_slots_start(slot_lsn: int) -> None:
    plan = _plan(slot_lsn=slot_lsn)
    assert plan.record_lsn < slot_lsn
    assert plan.record_lsn % 8 == 7  # WAL records start 8-byte aligned: no commit is here
    position = plan.position_prefix(SLOT) + b"17"
    assert parse_position(position) == (SLOT, plan.record_lsn, 17)


def test_a_loss_is_a_used_slot_gone_or_invalidated() -> None:
    assert slot_loss(None, None) is None  # never used: a first start creates it
    assert slot_loss(None, 0x100) is Cause.DROPPED
    assert slot_loss(slot_at(0x100), 0x100) is None
    lost = replace(slot_at(0x100), wal_status="lost")
    assert slot_loss(lost, 0x100) is Cause.INVALIDATED
    idle = replace(slot_at(0x100), invalidation="idle_timeout")
    assert slot_loss(idle, 0x100) is Cause.INVALIDATED


def test_the_refusal_says_what_happened_and_both_ways_on() -> None:
    lost = replace(slot_at(0x100), wal_status="lost")
    message = refusal(SLOT, Cause.INVALIDATED, 0x1_6B3F28, lost)
    assert "invalidated by the server" in message
    assert "max_slot_wal_keep_size" in message
    assert "0/16B3F28" in message
    assert "run `cdc-relay recover`" in message
    assert "CDC_RELAY_ON_SLOT_LOSS=recover" in message
    assert "CDC_RELAY_ALLOW_SLOT_RESET=true" in message
    assert "4080 rows" in interrupted(SLOT, _plan())


def _record(position: bytes, event_id: bytes | None = None, *, dead: bool = False) -> ReadBack:
    headers = [(POSITION_HEADER, position)]
    if event_id is not None:
        headers.append(("cdc_relay.event_id" if dead else "id", event_id))
    return ReadBack("t", 0, 0, tuple(headers))


def test_the_read_back_sorts_this_slots_records_into_earlier_and_own() -> None:
    plan = _plan()
    own_prefix = plan.position_prefix(SLOT)
    check = RecoveryCheck(SLOT, plan.record_lsn, {("t", 0): 0}, Earlier(), Own(plan.rows))
    check.add(_record(b"orders_slot/16B3F28/1", b"e-1"))  # the stream before the loss
    check.add(_record(b"orders_slot/16B3F28/2", b"e-2", dead=True))  # its dead letter
    check.add(_record(b"orders_slot/16B3F28/3", b"e-1"))  # a duplicate of the stream's
    check.add(_record(own_prefix + b"7", b"e-7"))  # an interrupted run's own
    check.add(_record(b"other_slot/16B3F28/1", b"e-9"))  # another slot's
    check.add(_record(b"elsewhere", b"e-10"))  # another producer's
    check.add(_record(b"orders_slot/16B3F28/4"))  # no id: nothing to know its row by
    check.end("t", 0)
    assert check.done
    assert check.earlier.counts == {b"e-1": 2, b"e-2": 1}
    assert check.own.has(7, "e-7")
    assert not check.own.has(7, "e-8")
    assert not check.own.has(8, "e-7")
    assert check.earlier.take("e-1")
    assert check.earlier.take("e-1")
    assert not check.earlier.take("e-1")  # each record stands for one row
    assert not check.earlier.take("e-9")


def test_past_its_budget_the_read_back_takes_nothing_for_published() -> None:
    check = RecoveryCheck(SLOT, 7, {("t", 0): 0}, Earlier(), Own(0), budget=400)
    for n in range(10):
        check.add(_record(b"orders_slot/16B3F28/%d" % (n + 1), b"e-%d" % n))
    assert check.earlier.doubt is not None
    assert not check.earlier.take("e-1")


def test_an_ordinal_beyond_the_plan_is_ignored() -> None:
    own = Own(3)
    own.add(10**9, b"e")  # a hostile position cannot make it allocate
    own.add(0, b"e")
    assert own.found == 0


def test_read_starts_take_the_lower_of_two_and_the_beginning_for_the_rest() -> None:
    starts = starts_for({("t", 0): 5, ("t", 1): 9}, {("t", 1): 7, ("u", 0): 3}, {("v", 0)})
    assert starts[("t", 0)] == 5
    assert starts[("t", 1)] == 7
    assert starts[("u", 0)] == 3
    assert starts[("v", 0)] < 0  # OFFSET_BEGINNING


# -- the start's answers to a loss -------------------------------------------------------------


def _sequence(database: FakeStartDatabase, **settings: object) -> StartSequence:
    values = {
        "database_url": "postgresql://relay@127.0.0.1:1/app",
        "kafka_bootstrap_servers": "127.0.0.1:1",
        **settings,
    }
    return StartSequence(
        Settings.model_validate(values),
        RelayStats(),
        database.leadership,
        connect=lambda: database,
        read_back=lambda start, offsets, noted: None,
        stopping=lambda: False,
        sleep=lambda seconds: None,
    )


def _start(sequence: StartSequence) -> int:
    with sequence.session() as started:
        return started.start


def test_a_dropped_slot_is_refused_by_default_naming_recover() -> None:
    database = FakeStartDatabase(FakeLeadership())
    database.recorded = 0x3000
    with pytest.raises(PositionMismatch, match="run `cdc-relay recover`") as info:
        _start(_sequence(database))
    assert info.value.exit_code == 4
    assert "create_slot" not in database.journal
    assert not database.streams


def test_an_invalidated_slot_is_refused_by_default_naming_the_cause() -> None:
    database = FakeStartDatabase(FakeLeadership(), slot=replace(slot_at(0x3000), wal_status="lost"))
    database.recorded = 0x3000
    with pytest.raises(PositionMismatch, match="invalidated by the server"):
        _start(_sequence(database))
    assert not database.streams


def test_with_recover_the_leader_recovers_then_streams_from_the_new_slot() -> None:
    database = FakeStartDatabase(FakeLeadership(), slot=replace(slot_at(0x3000), wal_status="lost"))
    database.recorded = 0x3000
    assert _start(_sequence(database, on_slot_loss="recover")) == database.wal_end
    assert ("recover", "invalidated") in database.journal
    assert database.journal.index(("recover", "invalidated")) < database.journal.index(
        ("START_REPLICATION", database.wal_end)
    )


def test_an_unfinished_recovery_is_finished_first_or_refused() -> None:
    database = FakeStartDatabase(FakeLeadership(), slot=slot_at(0x5000))
    database.recorded = 0x3000
    database.recovery = _plan(slot_lsn=0x5000).to_json()
    with pytest.raises(PositionMismatch, match="has not ended"):
        _start(_sequence(database))
    _start(_sequence(database, on_slot_loss="recover"))
    assert ("recover", "dropped") in database.journal


def test_accepting_the_gap_drops_an_invalidated_slot_and_creates_one() -> None:
    database = FakeStartDatabase(FakeLeadership(), slot=replace(slot_at(0x3000), wal_status="lost"))
    database.recorded = 0x3000
    assert _start(_sequence(database, allow_slot_reset=True)) == database.wal_end
    assert database.journal.index("drop_slot") < database.journal.index("create_slot")


def test_a_first_start_with_an_adoption_condition_adopts_then_streams() -> None:
    database = FakeStartDatabase(FakeLeadership())
    start = _start(_sequence(database, adopt_condition="published_at IS NULL"))
    assert start == database.wal_end
    assert ("recover", "adopted") in database.journal
    assert "create_slot" not in database.journal  # the adoption created it, with its snapshot


def test_the_condition_applies_only_to_a_first_start() -> None:
    database = FakeStartDatabase(FakeLeadership(), slot=slot_at(0x3000))
    database.recorded = 0x3000
    _start(_sequence(database, adopt_condition="published_at IS NULL"))
    assert not any(isinstance(entry, tuple) and entry[0] == "recover" for entry in database.journal)


def test_an_adoptions_condition_must_be_of_the_row_filters_grammar() -> None:
    adopted = _plan(cause=Cause.ADOPTED, condition="published_at IS NULL")
    assert plan_from_json(adopted.text) == adopted
    forged = {**adopted.to_json(), "condition": "1 = 1; DROP TABLE outbox"}
    assert plan_from_json(forged) is None


# -- republish's selection ---------------------------------------------------------------------


def test_a_replays_selection_is_checked_before_anything_is_read() -> None:
    from datetime import UTC, datetime  # noqa: PLC0415

    from cdc_relay.commands.republish import parse_time  # noqa: PLC0415
    from cdc_relay.config import OutboxColumns, OutboxTable  # noqa: PLC0415
    from cdc_relay.errors import ConfigError  # noqa: PLC0415
    from cdc_relay.recovery.replay import Selection  # noqa: PLC0415

    table = OutboxTable(table="public.outbox")
    no_time = OutboxTable(table="public.other", columns=OutboxColumns(created_at=None))
    Selection(aggregate_type="order", topic="orders.replay").check((table, no_time))
    with pytest.raises(ConfigError, match="legal Kafka topic"):
        Selection(topic="no spaces!").check((table,))
    with pytest.raises(ConfigError, match="created_at"):
        Selection(since=datetime(2026, 1, 1, tzinfo=UTC)).check((table, no_time))
    moment = datetime(2026, 1, 1, tzinfo=UTC)
    with pytest.raises(ConfigError, match="before --until"):
        Selection(since=moment, until=moment).check((table,))
    assert parse_time("2026-11-28T13:00:00") == datetime(2026, 11, 28, 13, tzinfo=UTC)
    with pytest.raises(ConfigError, match="ISO 8601"):
        parse_time("yesterday")


def _gap() -> Plan:
    return _plan(
        cause=Cause.PUBLICATION,
        slot_lsn=0x2000,
        below=2004,
        rows=0,
        done=0,
        offsets={},
        noted={},
        published=0,
        dead_lettered=0,
        in_kafka=0,
    )


def test_a_publication_gap_lets_the_relay_stream_on_until_recovered() -> None:
    database = FakeStartDatabase(FakeLeadership(), slot=slot_at(0x3000))
    database.recorded = 0x3000
    database.recovery = _gap().to_json()
    assert _start(_sequence(database)) == 0x3000  # refused? no: pubwatch names it, it streams
    assert not any(isinstance(entry, tuple) and entry[0] == "recover" for entry in database.journal)
    _start(_sequence(database, on_slot_loss="recover"))
    assert ("recover", "publication") in database.journal


def test_a_publication_gap_is_planned_from_the_record_before_the_change() -> None:
    from cdc_relay.checkpoint import Record  # noqa: PLC0415
    from cdc_relay.record_origin import Server, Stamp  # noqa: PLC0415
    from cdc_relay.recovery.loss import publication_gap  # noqa: PLC0415

    horizon = Horizon(1000, Snapshot(1500, 1500), {}, {}, 0x1000)
    record = Record(
        Stamp(0x3000, "1", 1),
        1000,
        None,
        Server("1", 1, 0x4000),
        stamp_checked_xid=1700,
        horizon=horizon,
    )
    gap = publication_gap(record)
    assert gap is not None
    assert (gap.cause, gap.boundary, gap.horizon, gap.lost_at) == (
        Cause.PUBLICATION,
        1700,
        horizon,
        0x3000,
    )
    assert not gap.replaces_slot
    assert publication_gap(replace(record, stamp=None)) is None
