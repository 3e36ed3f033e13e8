"""Whether a position record can be this server's: ahead of the WAL, another system identifier,
a timeline not in the history (or a position beyond where the history left it)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cdc_relay.lsn import format_lsn
from cdc_relay.record_origin import Server, Stamp, history_switches, problem, refusal

SYSTEM = "7312345678901234567"
SERVER = Server(SYSTEM, 3, 0x5000000)
# Timeline 3's history: it left 1 at 0/3000000, and 2 at 0/4000000.
HISTORY = {3: [(1, 0x3000000), (2, 0x4000000)]}


def _history(timeline: int) -> list[tuple[int, int]]:
    return HISTORY.get(timeline, [])


def test_a_record_of_this_server_is_trusted() -> None:
    assert problem(Stamp(0x4800000, SYSTEM, 3), SERVER, _history) is None
    assert problem(Stamp(0x5000000, SYSTEM, 3), SERVER, _history) is None  # at the WAL end
    assert problem(Stamp(0x4800000, None, None), SERVER, _history) is None  # not yet stamped


def test_a_record_ahead_of_the_wal_is_refused() -> None:
    found = problem(Stamp(0xF0000000, SYSTEM, 3), SERVER, _history)
    assert found is not None
    assert "0/F0000000, ahead of the server's WAL end 0/5000000" in found
    assert problem(Stamp(0xF0000000, None, None), SERVER, _history) is not None


def test_a_record_of_another_cluster_is_refused() -> None:
    found = problem(Stamp(0x100, "42", 3), SERVER, _history)
    assert found is not None
    assert "system identifier 42" in found
    assert SYSTEM in found


def test_a_record_of_an_ancestor_timeline_is_trusted_up_to_where_the_history_left_it() -> None:
    assert problem(Stamp(0x3000000, SYSTEM, 1), SERVER, _history) is None
    assert problem(Stamp(0x3800000, SYSTEM, 2), SERVER, _history) is None
    beyond = problem(Stamp(0x3000001, SYSTEM, 1), SERVER, _history)
    assert beyond is not None
    assert "left that timeline at 0/3000000" in beyond


def test_a_timeline_not_in_the_history_is_refused() -> None:
    assert "not in its history" in (problem(Stamp(0x100, SYSTEM, 7), SERVER, _history) or "")
    branch = Server(SYSTEM, 4, 0x5000000)  # timeline 4 branched from 1: 2 is not an ancestor
    history = {4: [(1, 0x2000000)]}
    found = problem(Stamp(0x100, SYSTEM, 2), branch, lambda t: history.get(t, []))
    assert found is not None
    assert "not in the history of this server's timeline 4" in found


def test_without_the_history_another_timeline_is_refused_and_unknown_is_not() -> None:
    assert problem(Stamp(0x100, SYSTEM, 2), SERVER, None) is not None
    standby = Server(SYSTEM, None, 0x5000000)
    assert problem(Stamp(0x100, SYSTEM, 2), standby, None) is None


@given(
    st.integers(0, 2**64 - 1),
    st.integers(0, 2**64 - 1),
    st.one_of(st.none(), st.sampled_from([SYSTEM, "1"])),
    st.one_of(st.none(), st.integers(1, 9)),
)
def test_never_trusted_ahead_of_the_wal_or_from_another_system(
    position: int, wal_end: int, system: str | None, timeline: int | None
) -> None:
    server = Server(SYSTEM, 3, wal_end)
    found = problem(Stamp(position, system, timeline), server, _history)
    if position > wal_end or (system is not None and system != SYSTEM):
        assert found is not None
    if found is None and timeline is not None and timeline != 3:
        assert dict(_history(3))[timeline] >= position


@given(st.binary(max_size=200))
def test_any_history_file_reads_as_switches_or_nothing(content: bytes) -> None:
    for parent, lsn in history_switches(content):
        assert parent >= 0
        assert 0 <= lsn < 2**64


def test_the_history_file_as_postgresql_writes_it() -> None:
    text = b"1\t0/3000000\tno recovery target specified\n\n2\t0/4000000\tat restore point\n"
    assert history_switches(text) == [(1, 0x3000000), (2, 0x4000000)]
    assert history_switches(b"\\x" + text.hex().encode()) == [(1, 0x3000000), (2, 0x4000000)]


def test_the_refusal_names_the_fix_and_the_slot_position() -> None:
    text = refusal("it is ahead", "cdc_relay", "cdc_relay", 0x1932FF8)
    assert "CDC_RELAY_ALLOW_SLOT_RESET=true" in text
    assert format_lsn(0x1932FF8) in text
    assert "DELETE FROM cdc_relay.slot_position WHERE slot_name = 'cdc_relay'" in text
