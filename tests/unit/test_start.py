"""The start sequence (:mod:`cdc_relay.start`) driven with a server in memory
(:class:`tests.fakes.FakeStartDatabase`): its order, the leadership lost on the way, a held slot,
the position carried from one session to the next, and the read-back from Kafka."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from cdc_relay.config import Settings
from cdc_relay.errors import LeadershipLost, PublicationChanged, SlotInUse
from cdc_relay.observability.stats import RelayStats
from cdc_relay.publication_stamp import PublicationStamp
from cdc_relay.reconcile import Offsets, Reconciliation
from cdc_relay.start import StartSequence
from tests.fakes import FakeLeadership, FakeStartDatabase, publication_stamp, slot_at

OFFSETS: Offsets = {("orders", 0): 41}


def _settings() -> Settings:
    return Settings.model_validate(
        {
            "database_url": "postgresql://relay@127.0.0.1:1/app",
            "kafka_bootstrap_servers": "127.0.0.1:1",
        }
    )


def _sequence(
    database: FakeStartDatabase,
    *,
    read_back: Callable[[int, Offsets | None, Offsets | None], Reconciliation | None] = (
        lambda start, offsets, noted: None
    ),
    stopping: Callable[[], bool] = lambda: False,
) -> StartSequence:
    return StartSequence(
        _settings(),
        RelayStats(),
        database.leadership,
        connect=lambda: database,
        read_back=read_back,
        stopping=stopping,
        sleep=lambda seconds: None,
    )


def _start(sequence: StartSequence) -> int:
    with sequence.session() as started:
        return started.start


def test_a_first_start_runs_in_the_readmes_order() -> None:
    database = FakeStartDatabase(FakeLeadership())
    sequence = _sequence(database)
    sequence.check_database()
    start = _start(sequence)
    assert database.journal == [
        "require",  # the start-up check, before standing by
        "ensure_table",
        "ensure_publication",  # its connection, fresh, is the first session's: not checked again
        "publication_stamp",  # read, then verified: every write from here on proves it unchanged
        "verify",
        "create_slot",
        ("save", database.wal_end, None, True),
        ("row_filters", False),
        ("START_REPLICATION", database.wal_end),
        ("note_stream", 4242),
    ]
    assert start == database.wal_end
    assert database.closed
    assert database.streams[0].closed


def test_a_start_on_a_new_connection_checks_again() -> None:
    database = FakeStartDatabase(FakeLeadership(), slot=slot_at(0x3000))
    database.recorded = 0x3000
    start = _start(_sequence(database))
    assert database.journal[:3] == ["require", "ensure_publication", "ensure_table"]
    assert start == 0x3000


def test_a_lease_that_ran_out_before_streaming_stops_the_start() -> None:
    leadership = FakeLeadership()
    database = FakeStartDatabase(leadership, slot=slot_at(0x3000))
    leadership.lose()  # e.g. the lock connection died while the slot was prepared
    with pytest.raises(LeadershipLost, match="lease ran out"):
        _start(_sequence(database))
    assert ("note_stream", 4242) not in database.journal
    assert database.streams[0].closed  # START_REPLICATION went out: closed again at once
    assert database.closed


def test_a_lease_taken_by_another_relay_records_nothing_and_streams_nothing() -> None:
    database = FakeStartDatabase(FakeLeadership(), slot=slot_at(0x3000))
    database.recorded, database.row_filters = 0x3000, {"public.outbox": None}
    database.lease_ours = False  # a standby took over while this one was preparing
    with pytest.raises(LeadershipLost, match="another relay holds the leader lease"):
        _start(_sequence(database))
    assert database.recorded == 0x3000
    assert database.row_filters == {"public.outbox": None}
    assert database.streams == []


def test_the_predecessors_walsender_is_ended_and_the_slot_taken() -> None:
    leadership = FakeLeadership()
    leadership.predecessor_stream_pid = 77
    database = FakeStartDatabase(leadership, slot=slot_at(0x3000))
    database.recorded = 0x3000
    database.holders = [77]
    assert _start(_sequence(database)) == 0x3000
    assert ("end_backend", 77) in database.journal


def test_a_slot_held_by_another_process_is_waited_for_then_refused() -> None:
    database = FakeStartDatabase(FakeLeadership(), slot=slot_at(0x3000))
    database.holders = [99]  # not the predecessor's walsender: never ended
    looks = iter(range(3))
    with pytest.raises(SlotInUse):
        _start(_sequence(database, stopping=lambda: next(looks, None) is None))
    assert not any(isinstance(e, tuple) and e[0] == "end_backend" for e in database.journal)
    assert database.streams == []


def test_the_acknowledged_position_is_carried_to_the_next_session() -> None:
    database = FakeStartDatabase(FakeLeadership(), slot=slot_at(0x3000))
    database.recorded = 0x4000
    sequence = _sequence(database)
    assert _start(sequence) == 0x4000
    sequence.carry(0x5000, OFFSETS)  # acknowledged by Kafka, not recorded yet
    assert _start(sequence) == 0x5000
    assert ("save", 0x5000, OFFSETS, False) in database.journal
    assert database.recorded == 0x5000


def test_a_position_beyond_a_promotion_is_carried_only_to_the_promotion_point() -> None:
    database = FakeStartDatabase(FakeLeadership(), slot=slot_at(0x3000))
    database.recorded = 0x4000
    sequence = _sequence(database)
    _start(sequence)
    sequence.carry(0x5000, OFFSETS)
    database.timeline_id, database.promoted_at = 2, 0x4800  # the URL now leads to the promoted
    assert _start(sequence) == 0x4800
    assert ("save", 0x4800, None, False) in database.journal  # offsets belong to 0x5000 only


def test_after_the_leadership_was_lost_nothing_is_carried() -> None:
    database = FakeStartDatabase(FakeLeadership(), slot=slot_at(0x3000))
    database.recorded = 0x4000
    sequence = _sequence(database)
    _start(sequence)
    sequence.carry(0x5000, OFFSETS)
    sequence.forget()  # the next leader's record is the truth now
    assert _start(sequence) == 0x4000


def test_a_doubtful_read_back_is_handed_on_and_moves_no_note() -> None:
    database = FakeStartDatabase(FakeLeadership(), slot=slot_at(0x3000))
    database.recorded, database.offsets = 0x3000, OFFSETS
    database.noted = {("orders", 1): 5}
    doubtful = Reconciliation(doubt="reading failed: broker down", renoted={("orders", 1): 9})
    asked: list[tuple[int, Offsets | None, Offsets | None]] = []

    def read_back(start: int, offsets: Offsets | None, noted: Offsets | None) -> Reconciliation:
        asked.append((start, offsets, noted))
        return doubtful

    sequence = _sequence(database, read_back=read_back)
    built: list[str] = []
    with sequence.session() as started:
        reconciliation, noted = sequence.read_back(started, lambda: built.append("producer"))
    assert asked == [(0x3000, OFFSETS, {("orders", 1): 5})]
    assert built == ["producer"]
    assert reconciliation is doubtful
    assert reconciliation.found == {}  # nothing is skipped: every event is published again
    # A doubtful read moves notes only where it read a partition to its end (renoted).
    assert noted == {("orders", 1): 9}
    assert database.noted == {("orders", 1): 9}


def test_a_read_back_turned_off_leaves_the_notes() -> None:
    database = FakeStartDatabase(FakeLeadership(), slot=slot_at(0x3000))
    database.recorded, database.noted = 0x3000, {("orders", 1): 5}
    sequence = _sequence(database)
    with sequence.session() as started:
        reconciliation, noted = sequence.read_back(started, lambda: None)
    assert reconciliation is None
    assert noted == {("orders", 1): 5}
    assert not any(isinstance(e, tuple) and e[0] == "noted" for e in database.journal)


def test_a_session_resumes_carried_only_at_what_this_leadership_acknowledged() -> None:
    database = FakeStartDatabase(FakeLeadership(), slot=slot_at(0x3000))
    database.recorded = 0x4000
    sequence = _sequence(database)
    _start(sequence)
    assert not sequence.resumes_carried  # a leadership's first session reads back
    sequence.carry(0x5000, OFFSETS)
    _start(sequence)
    assert sequence.resumes_carried  # exactly once: no read-back, nothing after it is ours
    sequence.forget()
    _start(sequence)
    assert not sequence.resumes_carried


# -- the publication's stamp ---------------------------------------------------------------------


def test_a_start_records_the_publication_it_verified() -> None:
    database = FakeStartDatabase(FakeLeadership(), slot=slot_at(0x3000))
    database.recorded = 0x3000
    _start(_sequence(database))
    assert database.recorded_stamp == database.publication.data
    assert "restart_sweep_boundary" not in database.journal


def test_a_publication_changed_since_the_record_names_the_rows_and_keeps_them_from_sweeps(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Dropped from the publication and added again while no relay ran: the start cannot know
    which rows pgoutput left out, so it names the transactions since the last check and takes
    the sweep boundary afresh; the position acknowledged before is not carried past it."""
    database = FakeStartDatabase(FakeLeadership(), slot=slot_at(0x3000))
    database.recorded = 0x4000
    sequence = _sequence(database)
    _start(sequence)
    sequence.carry(0x5000, OFFSETS)
    database.checked_xid = 700
    database.publication = publication_stamp(rel=["17000", "900"])
    with caplog.at_level(logging.ERROR):
        assert _start(sequence) == 0x4000
    assert database.journal.count("restart_sweep_boundary") == 1
    assert ("save", 0x5000, OFFSETS, False) not in database.journal
    [named] = [r for r in caplog.records if "may not have been relayed" in r.getMessage()]
    fields = named.__dict__["fields"]
    assert (fields["from_xid"], fields["to_xid"]) == (700, 1000)
    assert "public.outbox was dropped from publication cdc_relay_outbox" in fields["changes"]
    assert sequence.stats.rows_in_doubt == fields  # and /status shows it
    assert database.recorded_stamp == database.publication.data  # the next start names nothing


def test_a_renamed_table_pgoutput_follows_names_no_rows(caplog: pytest.LogCaptureFixture) -> None:
    database = FakeStartDatabase(FakeLeadership(), slot=slot_at(0x3000))
    database.recorded = 0x3000
    sequence = _sequence(database)
    _start(sequence)
    database.publication = publication_stamp(type_xmin="900")  # renamed and back
    with caplog.at_level(logging.ERROR):
        _start(sequence)
    assert "restart_sweep_boundary" not in database.journal
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_change_while_the_start_runs_records_nothing() -> None:
    """The stamp is read, then the publication verified: a change after the read makes the
    next write (which checks it in its own statement) write nothing and raise."""
    database = FakeStartDatabase(FakeLeadership(), slot=slot_at(0x3000))
    database.recorded = 0x4000  # ahead of the slot: the start records it again
    read = database.publication_stamp

    def then_changed() -> PublicationStamp:
        stamp = read()
        database.publication = publication_stamp(rel=[])
        return stamp

    database.publication_stamp = then_changed  # type: ignore[method-assign]
    with pytest.raises(PublicationChanged, match="changed under the relay"):
        _start(_sequence(database))
    assert ("save", 0x4000, None, False) not in database.journal
    assert database.streams == []
