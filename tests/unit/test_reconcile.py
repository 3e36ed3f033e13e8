"""The reconciliation's pure core: which replayed events are provably in Kafka (and never more)."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from cdc_relay.reconcile import (
    ENTRY_OVERHEAD,
    ORDINALS,
    POSITION_HEADER,
    ReadBack,
    ReadBackCheck,
    decode_offsets,
    encode_offsets,
    parse_position,
    position_prefix,
    reconcile,
)

SLOT = "slot_a"
RECORDED = 0x1000

slots = st.from_regex(r"[a-z0-9_]{1,63}", fullmatch=True)
lsns = st.integers(min_value=0, max_value=2**64 - 1)
ordinals = st.integers(min_value=1, max_value=10**6)


def position(lsn: int, ordinal: int, slot: str = SLOT) -> bytes:
    return position_prefix(slot, lsn) + b"%d" % ordinal


def ours(offset: int, lsn: int, ordinal: int, event_id: str, topic: str = "t") -> ReadBack:
    headers = (("id", event_id.encode()), (POSITION_HEADER, position(lsn, ordinal)))
    return ReadBack(topic, 0, offset, headers)


@given(slots, lsns, ordinals)
def test_a_position_parses_back(slot: str, lsn: int, ordinal: int) -> None:
    assert parse_position(position(lsn, ordinal, slot)) == (slot, lsn, ordinal)


@given(st.binary(max_size=80))
def test_any_header_value_parses_or_is_refused(value: bytes) -> None:
    parsed = parse_position(value)
    if parsed is not None:  # only the canonical spelling is a position
        assert position(parsed[1], parsed[2], parsed[0]) == value


def test_non_canonical_positions_are_refused() -> None:
    for value in (b"slot_a/0x10/1", b"slot_a/10/0", b"slot_a/010/1", b"/10/1", b"slot_a/10/01"):
        assert parse_position(value) is None


@given(
    st.dictionaries(
        st.tuples(st.text(min_size=1, max_size=20), st.integers(0, 1000)),
        st.integers(0, 2**62),
        max_size=20,
    )
)
def test_offsets_round_trip(offsets: dict[tuple[str, int], int]) -> None:
    assert decode_offsets(encode_offsets(offsets)) == offsets


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=10,
)


@given(json_values)
def test_any_recorded_json_decodes_or_is_none(value: object) -> None:
    decoded = decode_offsets(json.dumps(value))
    assert decoded is None or all(o >= 0 for o in decoded.values())


def test_a_malformed_record_means_no_offsets() -> None:
    assert decode_offsets(b"{not json") is None
    assert decode_offsets('{"t": {"0": -1}}') is None
    assert decode_offsets('{"t": {"x": 1}}') is None
    assert decode_offsets(None) is None


def test_only_this_slots_events_after_the_recorded_position_are_found() -> None:
    records = [
        ours(5, RECORDED, 3, "e-acked"),  # the acknowledged offset: at the recorded position
        ours(6, RECORDED + 8, 1, "e1"),
        ReadBack("t", 0, 7, (("id", b"x"),)),  # another producer
        ReadBack("t", 0, 8, (("id", b"y"), (POSITION_HEADER, position(RECORDED + 9, 1, "other")))),
        ours(9, RECORDED - 8, 1, "old"),  # at or below the recorded position: ignored
        ours(10, RECORDED + 16, 2, "e2"),
    ]
    result = reconcile(SLOT, RECORDED, {("t", 0): 5}, {("t", 0): records}, [("t", 0)])
    assert result.doubt is None
    assert result.found == {position(RECORDED + 8, 1): b"e1", position(RECORDED + 16, 2): b"e2"}
    assert result.highest_lsn == RECORDED + 16
    assert result.in_kafka(position(RECORDED + 8, 1), "e1")
    assert not result.in_kafka(position(RECORDED + 8, 1), "another id at that position")
    assert not result.in_kafka(position(RECORDED + 8, 2), "e1")
    assert not result.in_kafka(position(RECORDED - 8, 1), "old")


def test_a_dead_letter_is_matched_by_its_metadata_event_id() -> None:
    headers = ((POSITION_HEADER, position(RECORDED + 8, 1)), ("cdc_relay.event_id", b""))
    records = [ours(0, RECORDED, 1, "a"), ReadBack("t", 0, 1, headers)]
    result = reconcile(SLOT, RECORDED, {("t", 0): 0}, {("t", 0): records}, [("t", 0)])
    assert result.in_kafka(position(RECORDED + 8, 1), None)


def test_a_forged_position_before_the_relays_own_is_ignored() -> None:
    forged = (POSITION_HEADER, position(RECORDED + 8, 2))
    real = (POSITION_HEADER, position(RECORDED + 8, 1))
    records = [ours(0, RECORDED, 1, "a"), ReadBack("t", 0, 1, (("id", b"e"), forged, real))]
    result = reconcile(SLOT, RECORDED, {("t", 0): 0}, {("t", 0): records}, [("t", 0)])
    assert set(result.found) == {position(RECORDED + 8, 1)}


DOUBTS = {
    "partition empty (the broker lost data)": ([], True),
    "first record at another offset": (
        [ours(6, RECORDED, 1, "a"), ours(7, RECORDED + 8, 1, "b")],
        True,
    ),
    "first record not ours": (
        [ReadBack("t", 0, 5, (("id", b"x"),)), ours(6, RECORDED + 8, 1, "b")],
        True,
    ),
    "first record after the recorded position": (
        [ours(5, RECORDED + 1, 1, "a"), ours(6, RECORDED + 8, 1, "b")],
        True,
    ),
    "not read to the end": ([ours(5, RECORDED, 1, "a"), ours(6, RECORDED + 8, 1, "b")], False),
}


def test_anything_unexpected_skips_nothing() -> None:
    for name, (records, ended) in DOUBTS.items():
        result = reconcile(
            SLOT, RECORDED, {("t", 0): 5}, {("t", 0): records}, [("t", 0)] if ended else []
        )
        assert result.found == {}, name
        assert result.doubted[("t", 0)], name


def test_a_partition_that_is_not_what_the_relay_left_is_not_used_the_others_are() -> None:
    # t[1]: its record at the acknowledged offset carries no position of this slot (a dead
    # letter whose headers were cut before the position was kept in its metadata, a recreated
    # topic). Its events are published again; what was read back from t[0] is still in Kafka.
    good = [ours(0, RECORDED, 1, "a"), ours(1, RECORDED + 8, 1, "b")]
    stripped = [
        ReadBack("t", 1, 4, (("cdc_relay.event_id", b"x"),)),
        ReadBack("t", 1, 5, (("id", b"c"), (POSITION_HEADER, position(RECORDED + 8, 2)))),
    ]
    offsets = {("t", 0): 0, ("t", 1): 4}
    for later in ([], stripped):
        read = {("t", 0): good, ("t", 1): later}
        result = reconcile(SLOT, RECORDED, offsets, read, [("t", 0), ("t", 1)])
        assert result.doubt is None
        assert set(result.found) == {position(RECORDED + 8, 1)}
        assert list(result.doubted) == [("t", 1)]
        assert not result.in_kafka(position(RECORDED + 8, 2), "c")


def test_other_producers_records_are_not_kept_and_the_relays_are_kept_within_a_budget() -> None:
    big = b"h" * 1_000_000
    check = ReadBackCheck(SLOT, RECORDED, {("t", 0): 0}, budget=10 * (ENTRY_OVERHEAD + 14))
    check.add(ours(0, RECORDED, 1, "a"))
    for offset in range(1, 301):  # read one at a time, each dropped once looked at
        check.add(ReadBack("t", 0, offset, (("id", big), (POSITION_HEADER, big))))
    assert check.retained == 0
    for ordinal in range(1, 10):
        check.add(ours(300 + ordinal, RECORDED + 8, ordinal, "e"))
    assert check.doubt is None
    check.add(ours(310, RECORDED + 8, 10, "e"))
    check.add(ours(311, RECORDED + 8, 11, "e"))
    assert check.done, "past the budget: nothing more to read"
    check.end("t", 0)
    result = check.result()
    assert result.found == {}
    assert result.doubt is not None
    assert "keeps" in result.doubt
    assert result.records_read == 311  # the last one came after the read gave up


# A read partition as hypothesis draws it: each record ours (at some LSN, with an id), another
# slot's, or another producer's; optionally damaged the ways a broker can surprise us.
record_kinds = st.one_of(
    st.tuples(st.just("ours"), st.integers(0, 4), st.integers(1, 3), st.sampled_from("abc")),
    st.tuples(st.just("other_slot"), st.integers(0, 4), st.integers(1, 3), st.sampled_from("abc")),
    st.tuples(st.just("foreign"), st.just(0), st.just(1), st.sampled_from("abc")),
)


@given(
    st.lists(record_kinds, max_size=12),
    st.booleans(),
    st.booleans(),
    st.integers(0, 2),
)
def test_what_is_found_was_read_back_and_is_this_slots_after_the_recording(
    kinds: list[tuple[str, int, int, str]], first_is_ours: bool, ended: bool, shift: int
) -> None:
    acked = 10
    records = []
    if first_is_ours:
        records.append(ours(acked + shift, RECORDED, 1, "acked"))
    for i, (kind, step, ordinal, event_id) in enumerate(kinds):
        offset = acked + shift + 1 + i
        lsn = RECORDED - 16 + 8 * step  # below, at and above the recorded position
        if kind == "ours":
            records.append(ours(offset, lsn, ordinal, event_id))
        elif kind == "other_slot":
            headers = (("id", event_id.encode()), (POSITION_HEADER, position(lsn, ordinal, "s2")))
            records.append(ReadBack("t", 0, offset, headers))
        else:
            records.append(ReadBack("t", 0, offset, (("id", event_id.encode()),)))
    result = reconcile(
        SLOT, RECORDED, {("t", 0): acked}, {("t", 0): records}, [("t", 0)] if ended else []
    )
    if not (first_is_ours and ended and shift == 0):
        assert result.found == {}
        assert result.doubt or result.doubted
        return
    read_back = {
        dict(r.headers)[POSITION_HEADER]: dict(r.headers)["id"]
        for r in records[1:]
        if POSITION_HEADER in dict(r.headers)
    }
    for found, found_id in result.found.items():
        parsed = parse_position(found)
        assert parsed is not None
        assert parsed[0] == SLOT
        assert parsed[1] > RECORDED
        assert read_back.get(found) == found_id
    if result.doubt is None:  # every one of ours after the recording is found
        expected = {
            p
            for r in records[1:]
            if (p := dict(r.headers).get(POSITION_HEADER)) is not None
            and (parsed := parse_position(p)) is not None
            and parsed[0] == SLOT
            and parsed[1] > RECORDED
        }
        assert set(result.found) == expected
    else:  # the same position with two ids: nothing
        assert result.found == {}


def test_a_noted_partition_is_read_from_its_note_without_a_check() -> None:
    records = [ReadBack("t", 1, 3, (("id", b"x"),)), ours(4, RECORDED + 8, 1, "b")]
    records = [ReadBack("t", 1, r.offset, r.headers) for r in records]
    result = reconcile(
        SLOT,
        RECORDED,
        {},
        {("t", 1): records},
        [("t", 1), ("t", 2)],
        noted={("t", 1): 3, ("t", 2): 7},
    )
    assert result.doubt is None
    assert set(result.found) == {position(RECORDED + 8, 1)}
    # Only the partition without a record of ours may move its note on, to where the read ended.
    assert result.renoted == {("t", 2): 7}


def test_an_acknowledged_offset_wins_over_a_note() -> None:
    records = [ours(5, RECORDED, 1, "a"), ours(6, RECORDED + 8, 1, "b")]
    result = reconcile(
        SLOT, RECORDED, {("t", 0): 5}, {("t", 0): records}, [("t", 0)], noted={("t", 0): 0}
    )
    assert set(result.found) == {position(RECORDED + 8, 1)}
    assert result.renoted == {}


def test_offset_gaps_of_apache_kafka_are_not_doubts() -> None:
    """On Apache Kafka a partition's offsets have gaps a consumer never sees: transaction markers
    (control records, one offset each, written by any transactional producer of the topic) and
    records removed by compaction. The read-back needs increasing offsets, not consecutive ones;
    a noted partition's note moves to just after the last record read, at or below the end.
    (Compaction of the acknowledged record itself is DOUBTS' "first record at another offset".)"""
    records = [
        ours(5, RECORDED, 1, "acked"),
        ours(7, RECORDED + 8, 1, "e1"),  # 6: a commit marker of another producer's transaction
        ours(12, RECORDED + 8, 2, "e2"),  # 8-11: compacted away
    ]
    foreign = [ReadBack("u", 0, 3, (("id", b"x"),)), ReadBack("u", 0, 9, (("id", b"y"),))]
    result = reconcile(
        SLOT,
        RECORDED,
        {("t", 0): 5},
        {("t", 0): records, ("u", 0): foreign},
        [("t", 0), ("u", 0)],
        noted={("u", 0): 2},
    )
    assert result.doubt is None
    assert result.found == {position(RECORDED + 8, 1): b"e1", position(RECORDED + 8, 2): b"e2"}
    # The end of u[0] may be past 10 (a marker after offset 9): a lower note only reads more.
    assert result.renoted == {("u", 0): 10}


def test_the_precomputed_ordinals_are_the_ordinals_as_text() -> None:
    """The hot path joins a transaction's prefix and ORDINALS[n]; past the table it formats."""
    assert all(text == b"%d" % ordinal for ordinal, text in enumerate(ORDINALS))
    assert len(ORDINALS) >= 1024
