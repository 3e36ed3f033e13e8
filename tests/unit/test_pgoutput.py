"""Tests for cdc_relay.decode.pgoutput against pgoutput bytes captured from a real PostgreSQL 15.

The fixtures are produced by tests/fixtures/capture_pgoutput.py (run by hand). LSNs, xids, OIDs
and commit timestamps change on every capture, so they are only asserted through relations
between messages or against values recorded in the fixture file itself.
"""

from __future__ import annotations

import copy
import hashlib
import json
import pickle
import struct
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cdc_relay.decode import pgoutput
from cdc_relay.decode.messages import (
    UNCHANGED_TOAST,
    Begin,
    BeginPrepare,
    Commit,
    CommitPrepared,
    DecodeError,
    Delete,
    Insert,
    LogicalMessage,
    Message,
    Origin,
    Prepare,
    Relation,
    RollbackPrepared,
    StreamAbort,
    StreamCommit,
    StreamPrepare,
    StreamStart,
    StreamStop,
    Truncate,
    Type,
    UnchangedToast,
    Update,
    pg_timestamp_to_datetime,
)
from cdc_relay.decode.pgoutput import PgOutputDecoder

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "pgoutput"
FIXTURE_FILES = sorted(FIXTURES.glob("*.json"))

# Well-known type OIDs (pg_type.dat).
INT4, TEXT, NUMERIC, UUID, JSONB, TIMESTAMPTZ = 23, 25, 1700, 2950, 3802, 1184

# The name the capture script gives each message type (last part of "description").
KIND_BY_CLASS: dict[type[Any], str] = {
    Begin: "Begin",
    Commit: "Commit",
    Origin: "Origin",
    Relation: "Relation",
    Type: "Type",
    Insert: "Insert",
    Update: "Update",
    Delete: "Delete",
    Truncate: "Truncate",
    LogicalMessage: "Message",
    StreamStart: "Stream Start",
    StreamStop: "Stream Stop",
    StreamCommit: "Stream Commit",
    StreamAbort: "Stream Abort",
    BeginPrepare: "Begin Prepare",
    Prepare: "Prepare",
    CommitPrepared: "Commit Prepared",
    RollbackPrepared: "Rollback Prepared",
    StreamPrepare: "Stream Prepare",
}

M = TypeVar("M")


# ---------------------------------------------------------------------------------------------
# Fixture helpers
# ---------------------------------------------------------------------------------------------


@cache
def load(case: str) -> dict[str, Any]:
    fixture: dict[str, Any] = json.loads((FIXTURES / f"{case}.json").read_text())
    return fixture


def parse_lsn(text: str) -> int:
    high, low = text.split("/")
    return (int(high, 16) << 32) | int(low, 16)


@cache
def decoded(case: str, capture: str) -> list[tuple[dict[str, Any], Message]]:
    """Decode one capture of one case, in order, with a single decoder (as a consumer would)."""
    decoder = PgOutputDecoder()
    entries = [e for e in load(case)["messages"] if e["capture"] == capture]
    assert entries, f"{case}: no messages for capture {capture}"
    return [(e, decoder.decode(bytes.fromhex(e["hex"]))) for e in entries]


def messages(case: str, capture: str, step: str | None = None) -> list[Message]:
    """Decoded messages, optionally only those produced by the step whose description is given."""
    return [
        msg
        for entry, msg in decoded(case, capture)
        if step is None or entry["description"].startswith(step + ": ")
    ]


def of_type(msgs: list[Message], cls: type[M]) -> list[M]:
    return [m for m in msgs if isinstance(m, cls)]


def one(msgs: list[Message], cls: type[M]) -> M:
    found = of_type(msgs, cls)
    assert len(found) == 1, f"expected one {cls.__name__}, got {found}"
    return found[0]


def step_names(case: str) -> list[str]:
    return [s["description"] for s in load(case)["steps"]]


def all_captures() -> Iterator[tuple[str, str]]:
    for path in FIXTURE_FILES:
        fixture = json.loads(path.read_text())
        for capture in fixture["captures"]:
            yield fixture["case"], capture


def md5_chain(first: int, last: int) -> str:
    return "".join(hashlib.md5(str(i).encode()).hexdigest() for i in range(first, last + 1))


def column_names(rel: Relation) -> list[str]:
    return [c.name for c in rel.columns]


# ---------------------------------------------------------------------------------------------
# Every captured message
# ---------------------------------------------------------------------------------------------


def test_fixtures_present() -> None:
    assert {p.stem for p in FIXTURE_FILES} >= {
        "basic_insert",
        "toast",
        "relation_altered",
        "dml_misc",
        "streaming",
        "two_phase",
    }
    for path in FIXTURE_FILES:
        fixture = json.loads(path.read_text())
        assert fixture["server_version"].startswith("15.")
        assert fixture["steps"], path
        assert all(step["sql"] for step in fixture["steps"]), path


@pytest.mark.parametrize(("case", "capture"), list(all_captures()))
def test_every_message_decodes_to_the_type_the_server_labelled(case: str, capture: str) -> None:
    pairs = decoded(case, capture)
    for entry, msg in pairs:
        assert entry["description"].endswith(": " + KIND_BY_CLASS[type(msg)]), entry["description"]
    # Streams always close, and xid prefixes appear exactly inside Stream Start/Stop blocks.
    in_stream = False
    for _, msg in pairs:
        if isinstance(msg, StreamStart):
            assert not in_stream
            in_stream = True
        elif isinstance(msg, StreamStop):
            assert in_stream
            in_stream = False
        elif isinstance(msg, Relation | Type | Insert | Update | Delete | Truncate):
            assert (msg.xid is not None) == in_stream, msg
    assert not in_stream


@pytest.mark.parametrize(("case", "capture"), list(all_captures()))
def test_begin_commit_pairs_agree(case: str, capture: str) -> None:
    pairs = decoded(case, capture)
    begin: Begin | None = None
    commits = 0
    for entry, msg in pairs:
        if isinstance(msg, Begin):
            assert begin is None, "nested Begin"
            begin = msg
        elif isinstance(msg, Commit):
            assert begin is not None, "Commit without Begin"
            assert msg.flags == 0
            assert msg.commit_lsn == begin.final_lsn
            assert msg.commit_lsn < msg.end_lsn
            assert msg.commit_ts == begin.commit_ts
            # The slot function reports a Commit at the transaction's end LSN.
            assert parse_lsn(entry["lsn"]) == msg.end_lsn
            begin = None
            commits += 1
        elif isinstance(msg, StreamCommit):
            commits += 1
    assert begin is None, "Begin without Commit"
    if case in ("basic_insert", "toast", "relation_altered", "dml_misc"):
        assert commits >= 2


@pytest.mark.parametrize(("case", "capture"), list(all_captures()))
def test_commit_order_follows_wal_order(case: str, capture: str) -> None:
    ends = [
        m.end_lsn
        for m in messages(case, capture)
        if isinstance(m, Commit | StreamCommit | Prepare | CommitPrepared | StreamPrepare)
    ]
    assert ends == sorted(ends)
    assert len(set(ends)) == len(ends)


# ---------------------------------------------------------------------------------------------
# Case 1: outbox inserts
# ---------------------------------------------------------------------------------------------

OUTBOX_COLUMNS = [
    ("id", UUID, True),
    ("aggregate_type", TEXT, False),
    ("aggregate_id", TEXT, False),
    ("event_type", TEXT, False),
    ("payload", JSONB, False),
    ("headers", JSONB, False),
    ("created_at", TIMESTAMPTZ, False),
]
UNICODE = "Zürich 東京 🚀"


@pytest.mark.parametrize("capture", ["v1", "v2-streaming", "v2-binary"])
def test_outbox_relation(capture: str) -> None:
    relations = of_type(messages("basic_insert", capture), Relation)
    assert len(relations) == 2  # each slot-function call starts a fresh relation cache
    rel = relations[0]
    assert rel == relations[1]
    assert (rel.namespace, rel.name, rel.replica_identity, rel.xid) == (
        "public",
        "outbox",
        "d",
        None,
    )
    assert [(c.name, c.type_oid, c.is_key) for c in rel.columns] == OUTBOX_COLUMNS
    assert all(c.type_modifier == -1 for c in rel.columns)


@pytest.mark.parametrize("capture", ["v1", "v2-streaming"])
def test_outbox_insert_text_values(capture: str) -> None:
    msgs = messages("basic_insert", capture)
    rel = one(msgs[:3], Relation)
    first, second = of_type(msgs, Insert)
    assert first.relation_id == second.relation_id == rel.relation_id
    assert first.xid is None
    assert len(first.new) == len(rel.columns) == 7

    assert first.new == (
        b"00000000-0000-4000-8000-000000000001",
        b"order",
        b"order-1",
        b"OrderCreated",
        b'{"total": 42, "currency": "EUR"}',
        None,  # headers IS NULL
        b"2024-05-06 07:08:09.123456+00",  # rendered in the decoding session's TimeZone (UTC)
    )

    values = dict(zip(column_names(rel), second.new, strict=True))
    assert values["id"] == b"00000000-0000-4000-8000-000000000002"
    assert isinstance(values["aggregate_id"], bytes)
    assert values["aggregate_id"].decode("utf-8") == UNICODE
    assert isinstance(values["payload"], bytes)
    assert json.loads(values["payload"]) == {"name": UNICODE}
    assert isinstance(values["headers"], bytes)
    assert json.loads(values["headers"]) == {"trace": "ñ-✓"}
    assert isinstance(values["created_at"], bytes)
    created_at = datetime.fromisoformat(values["created_at"].decode())  # default now()
    assert created_at.utcoffset() is not None
    assert created_at.year >= 2024


def test_outbox_insert_binary_values() -> None:
    """With ``binary 'true'`` values arrive as 'b' in each type's send/recv format."""
    msgs = messages("basic_insert", "v2-binary")
    first, second = of_type(msgs, Insert)
    id_, aggregate_type, _, _, payload, headers, created_at = first.new
    assert id_ == uuid.UUID("00000000-0000-4000-8000-000000000001").bytes
    assert aggregate_type == b"order"  # text's binary format is its UTF-8 bytes
    assert payload == b'\x01{"total": 42, "currency": "EUR"}'  # jsonb: version byte, then text
    assert headers is None
    assert isinstance(created_at, bytes)
    (micros,) = struct.unpack(">q", created_at)  # timestamptz: int64 us since 2000-01-01 UTC
    assert pg_timestamp_to_datetime(micros) == datetime(2024, 5, 6, 7, 8, 9, 123456, tzinfo=UTC)

    assert isinstance(second.new[2], bytes)
    assert second.new[2].decode() == UNICODE
    assert isinstance(second.new[4], bytes)
    assert json.loads(second.new[4][1:]) == {"name": UNICODE}


def test_text_captures_agree_across_protocol_versions() -> None:
    v1 = [e["hex"] for e in load("basic_insert")["messages"] if e["capture"] == "v1"]
    v2 = [e["hex"] for e in load("basic_insert")["messages"] if e["capture"] == "v2-streaming"]
    assert v1 == v2  # outside streams, proto v2 adds nothing to these messages


# ---------------------------------------------------------------------------------------------
# Case 2: TOAST
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("capture", ["v1", "v2-streaming"])
def test_toasted_value_arrives_whole_then_unchanged(capture: str) -> None:
    fixture = load("toast")
    insert_step, update_step = step_names("toast")
    insert = one(messages("toast", capture, insert_step), Insert)
    payload = insert.new[4]
    assert isinstance(payload, bytes)
    assert len(payload) == fixture["observations"]["payload_octet_length"] > 200_000
    assert fixture["observations"]["payload_pg_column_size"] > 8160  # stored out of line
    assert json.loads(payload) == {"blob": md5_chain(1, 6250)}

    update = one(messages("toast", capture, update_step), Update)
    assert update.relation_id == insert.relation_id
    assert update.old is None
    assert update.key is None  # the key did not change
    assert update.new[:4] == (
        b"00000000-0000-4000-8000-0000000000aa",
        b"blob",
        b"blob-1",
        b"BlobTouched",
    )
    assert update.new[4] is UNCHANGED_TOAST
    assert update.new[5] is None
    assert update.new[6] == b"2024-05-06 07:08:09+00"


def test_toasted_insert_is_streamed_with_logical_decoding_work_mem_64kb() -> None:
    insert_step, _ = step_names("toast")
    msgs = messages("toast", "v2-streaming", insert_step)
    assert [type(m) for m in msgs] == [StreamStart, Relation, Insert, StreamStop, StreamCommit]
    start, rel, insert, _, commit = msgs
    assert isinstance(start, StreamStart)
    assert isinstance(rel, Relation)
    assert isinstance(insert, Insert)
    assert isinstance(commit, StreamCommit)
    assert start.first_segment
    assert start.xid == rel.xid == insert.xid == commit.xid
    assert commit.commit_lsn < commit.end_lsn


# ---------------------------------------------------------------------------------------------
# Case 3: relation altered mid-stream
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("capture", ["v1", "v2-streaming"])
def test_second_relation_message_carries_the_added_column(capture: str) -> None:
    msgs = messages("relation_altered", capture)
    before, after = of_type(msgs, Relation)
    assert before.relation_id == after.relation_id
    assert before.name == after.name == "widgets"
    assert [(c.name, c.type_oid, c.is_key) for c in before.columns] == [
        ("id", INT4, True),
        ("name", TEXT, False),
    ]
    assert [(c.name, c.type_oid, c.is_key) for c in after.columns] == [
        ("id", INT4, True),
        ("name", TEXT, False),
        ("extra", INT4, False),
    ]
    first, second = of_type(msgs, Insert)
    assert first.new == (b"1", b"before")
    assert second.new == (b"2", b"after", b"42")
    # Each Insert follows the Relation describing its shape.
    assert msgs.index(before) < msgs.index(first) < msgs.index(after) < msgs.index(second)


# ---------------------------------------------------------------------------------------------
# Case 4: update/delete identities, truncate, type, logical messages, origin
# ---------------------------------------------------------------------------------------------

MISC_CAPTURES = ["v1", "v2-streaming"]


def relations_by_name(case: str, capture: str) -> dict[str, Relation]:
    return {r.name: r for r in of_type(messages(case, capture), Relation)}


@pytest.mark.parametrize("capture", MISC_CAPTURES)
def test_enum_column_sends_type_message_before_relation(capture: str) -> None:
    msgs = messages("dml_misc", capture, step_names("dml_misc")[0])
    type_msg = one(msgs, Type)
    assert (type_msg.namespace, type_msg.name, type_msg.xid) == ("public", "mood", None)
    rels = {r.name: r for r in of_type(msgs, Relation)}
    full = rels["accounts_full"]
    assert msgs.index(type_msg) == msgs.index(full) - 1
    assert [(c.name, c.type_oid) for c in full.columns] == [
        ("id", INT4),
        ("owner", TEXT),
        ("balance", NUMERIC),
        ("mood", type_msg.type_oid),
    ]
    assert full.replica_identity == "f"
    assert all(c.is_key for c in full.columns)  # FULL: every column is part of the identity
    # numeric(12,2): typmod = ((12 << 16) | 2) + VARHDRSZ
    assert full.columns[2].type_modifier == ((12 << 16) | 2) + 4
    default = rels["accounts_default"]
    assert default.replica_identity == "d"
    assert [c.name for c in default.columns if c.is_key] == ["id"]
    assert of_type(msgs, Insert)[3].new == (b"2", b"dave", None)


@pytest.mark.parametrize("capture", MISC_CAPTURES)
def test_updates_and_deletes_by_replica_identity(capture: str) -> None:
    steps = step_names("dml_misc")
    rels = relations_by_name("dml_misc", capture)

    full_update = one(messages("dml_misc", capture, steps[1]), Update)
    assert full_update.relation_id == rels["accounts_full"].relation_id
    assert full_update.old == (b"1", b"alice", b"100.50", b"happy")
    assert full_update.key is None
    assert full_update.new == (b"1", b"alice", b"101.50", b"neutral")

    key_update = one(messages("dml_misc", capture, steps[2]), Update)
    assert key_update.relation_id == rels["accounts_default"].relation_id
    assert key_update.old is None
    assert key_update.key == (b"1", None, None)  # non-identity columns are sent as NULL
    assert key_update.new == (b"10", b"carol", b"first")

    plain_update = one(messages("dml_misc", capture, steps[3]), Update)
    assert (plain_update.old, plain_update.key) == (None, None)
    assert plain_update.new == (b"2", b"dave", b"changed")

    full_delete = one(messages("dml_misc", capture, steps[4]), Delete)
    assert full_delete.relation_id == rels["accounts_full"].relation_id
    assert full_delete.old == (b"2", b"bob", b"7.00", b"sad")
    assert full_delete.key is None

    key_delete = one(messages("dml_misc", capture, steps[5]), Delete)
    assert key_delete.relation_id == rels["accounts_default"].relation_id
    assert key_delete.old is None
    assert key_delete.key == (b"10", None, None)


@pytest.mark.parametrize("capture", MISC_CAPTURES)
def test_truncate(capture: str) -> None:
    steps = step_names("dml_misc")
    msgs = messages("dml_misc", capture, steps[6])
    names = {r.relation_id: r.name for r in of_type(msgs, Relation)}
    both = one(msgs, Truncate)
    assert [names[r] for r in both.relation_ids] == ["accounts_default", "truncate_me"]
    assert (both.options, both.cascade, both.restart_identity) == (0, False, False)

    msgs = messages("dml_misc", capture, steps[7])
    names = {r.relation_id: r.name for r in of_type(msgs, Relation)}
    restart = one(msgs, Truncate)
    assert [names[r] for r in restart.relation_ids] == ["truncate_me"]
    assert (restart.options, restart.cascade, restart.restart_identity) == (3, True, True)


@pytest.mark.parametrize("capture", MISC_CAPTURES)
def test_logical_messages(capture: str) -> None:
    steps = step_names("dml_misc")
    msgs = messages("dml_misc", capture, steps[8])
    assert [type(m) for m in msgs] == [Begin, LogicalMessage, Commit]
    begin, message, commit = msgs
    assert isinstance(begin, Begin)
    assert isinstance(message, LogicalMessage)
    assert isinstance(commit, Commit)
    assert message.transactional
    assert (message.prefix, message.content, message.xid) == ("outbox", b'{"a":1}', None)
    # PostgreSQL 15 reports the *end* of the message's WAL record, here where the commit starts.
    assert begin.final_lsn >= message.lsn
    assert message.lsn <= commit.commit_lsn

    # Non-transactional: sent on its own, no Begin/Commit; content is length-prefixed, so a NUL
    # byte in it survives.
    msgs = messages("dml_misc", capture, steps[9])
    nontx = one(msgs, LogicalMessage)
    assert len(msgs) == 1
    assert not nontx.transactional
    assert (nontx.prefix, nontx.content) == ("outbox-nontx", b"hi\x00w")
    assert nontx.lsn > commit.end_lsn


@pytest.mark.parametrize("capture", MISC_CAPTURES)
def test_origin(capture: str) -> None:
    msgs = messages("dml_misc", capture, step_names("dml_misc")[10])
    assert [type(m) for m in msgs[:2]] == [Begin, Origin]
    begin, origin = msgs[0], msgs[1]
    assert isinstance(begin, Begin)
    assert isinstance(origin, Origin)
    assert origin.name == "upstream-eu"
    assert origin.commit_lsn == 0x0ABCDEF0  # pg_replication_origin_xact_setup('0/ABCDEF0', ...)
    # The origin's commit timestamp replaces the local one.
    assert pg_timestamp_to_datetime(begin.commit_ts) == datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert one(msgs, Insert).new == (b"3", b"erin", b"1.00", b"happy")


# ---------------------------------------------------------------------------------------------
# Case 5: streaming
# ---------------------------------------------------------------------------------------------


def split_segments(msgs: list[Message]) -> list[list[Message]]:
    """Messages between each Stream Start and its Stream Stop (Start included)."""
    segments: list[list[Message]] = []
    for msg in msgs:
        if isinstance(msg, StreamStart):
            segments.append([msg])
        elif isinstance(msg, StreamStop):
            pass
        elif segments and not isinstance(msg, StreamCommit | StreamAbort | StreamPrepare):
            segments[-1].append(msg)
    return segments


def test_streamed_committed_transaction() -> None:
    msgs = messages("streaming", "v2-streaming", step_names("streaming")[0])
    starts = of_type(msgs, StreamStart)
    xid = starts[0].xid
    assert len(starts) >= 2  # 500 rows exceed 64kB of logical_decoding_work_mem
    assert [s.first_segment for s in starts] == [True] + [False] * (len(starts) - 1)
    assert {s.xid for s in starts} == {xid}
    assert not of_type(msgs, Begin)
    assert not of_type(msgs, Commit)

    rel = one(msgs, Relation)  # sent once per streamed transaction, in its first segment
    assert rel.xid == xid
    assert split_segments(msgs)[0][1] == rel

    inserts = of_type(msgs, Insert)
    assert len(inserts) == 500
    assert {i.xid for i in inserts} == {xid}
    assert [i.new for i in inserts] == [
        (str(n).encode(), hashlib.md5(str(n).encode()).hexdigest().encode()) for n in range(1, 501)
    ]
    commit = one(msgs, StreamCommit)
    assert msgs[-1] == commit
    assert (commit.xid, commit.flags) == (xid, 0)
    assert commit.commit_lsn < commit.end_lsn
    assert pg_timestamp_to_datetime(commit.commit_ts).year >= 2024


def test_streamed_transaction_with_rolled_back_subtransaction() -> None:
    msgs = messages("streaming", "v2-streaming", step_names("streaming")[1])
    top = of_type(msgs, StreamStart)[0].xid
    abort = one(msgs, StreamAbort)
    assert abort.xid == top
    assert abort.subxid != top
    assert (abort.abort_lsn, abort.abort_ts) == (None, None)  # proto v2: not sent

    # Inside a stream the leading xid is that of the (sub)transaction that made the change.
    inserts = of_type(msgs, Insert)
    before_abort = of_type(msgs[: msgs.index(abort)], Insert)
    after_abort = of_type(msgs[msgs.index(abort) :], Insert)
    assert before_abort[0].xid == top
    assert before_abort[0].new == (b"1000", b"kept-before-savepoint")
    rolled_back = before_abort[1:]
    assert rolled_back
    assert {i.xid for i in rolled_back} == {abort.subxid}
    assert all(2001 <= int(i.new[0]) <= 2500 for i in rolled_back if isinstance(i.new[0], bytes))
    # After ROLLBACK TO SAVEPOINT the savepoint is re-established: a new subtransaction.
    (kept,) = after_abort
    assert kept.new == (b"1001", b"kept-after-rollback")
    assert kept.xid not in (top, abort.subxid)
    assert len(inserts) == len(before_abort) + 1

    commit = one(msgs, StreamCommit)
    assert commit.xid == top
    assert msgs.index(abort) < msgs.index(commit) == len(msgs) - 1


def test_streamed_transaction_aborted_before_decoding_sends_empty_block() -> None:
    """Decoded only after the abort: PG 15 streams an empty block, then Stream Abort."""
    msgs = messages("streaming", "v2-streaming", step_names("streaming")[2])
    assert [type(m) for m in msgs] == [StreamStart, StreamStop, StreamAbort]
    start, _, abort = msgs
    assert isinstance(start, StreamStart)
    assert isinstance(abort, StreamAbort)
    assert start.first_segment
    assert (abort.xid, abort.subxid) == (start.xid, start.xid)


def test_streamed_transaction_aborted_entirely_via_walsender() -> None:
    capture = "v2-streaming-walsender"
    assert load("streaming")["captures"][capture]["method"] == "walsender"
    msgs = messages("streaming", capture)
    starts = of_type(msgs, StreamStart)
    xid = starts[0].xid
    assert starts[0].first_segment
    assert {s.xid for s in starts} == {xid}
    assert one(msgs, Relation).xid == xid
    inserts = of_type(msgs, Insert)
    assert inserts
    assert {i.xid for i in inserts} == {xid}
    assert [i.new[0] for i in inserts] == [
        str(n).encode() for n in range(4001, 4001 + len(inserts))
    ]
    abort = one(msgs, StreamAbort)
    assert msgs[-1] == abort
    assert (abort.xid, abort.subxid) == (xid, xid)  # whole transaction: subxid == xid
    assert not of_type(msgs, StreamCommit)


def test_decoder_tracks_stream_blocks() -> None:
    decoder = PgOutputDecoder()
    seen = []
    for entry in load("streaming")["messages"][:600]:
        msg = decoder.decode(bytes.fromhex(entry["hex"]))
        seen.append((type(msg), decoder.in_stream))
    assert (StreamStart, True) in seen
    assert (StreamStop, False) in seen
    assert all(in_stream for cls, in_stream in seen if cls is Insert)


# ---------------------------------------------------------------------------------------------
# Two-phase (proto v3)
# ---------------------------------------------------------------------------------------------


def test_prepare_then_commit_prepared() -> None:
    steps = step_names("two_phase")
    msgs = messages("two_phase", "v3-two-phase", steps[0])
    assert [type(m) for m in msgs] == [BeginPrepare, Relation, Insert, Prepare]
    begin, _, insert, prepare = msgs
    assert isinstance(begin, BeginPrepare)
    assert isinstance(insert, Insert)
    assert isinstance(prepare, Prepare)
    assert begin.gid == prepare.gid == "gid-commit"
    assert begin.xid == prepare.xid
    assert (begin.prepare_lsn, begin.end_lsn) == (prepare.prepare_lsn, prepare.end_lsn)
    assert begin.prepare_ts == prepare.prepare_ts
    assert prepare.prepare_lsn < prepare.end_lsn
    assert insert.new == (b"1", b"prepared-then-committed")

    commit = one(messages("two_phase", "v3-two-phase", steps[1]), CommitPrepared)
    assert (commit.gid, commit.xid, commit.flags) == ("gid-commit", prepare.xid, 0)
    assert prepare.end_lsn <= commit.commit_lsn < commit.end_lsn
    assert commit.commit_ts >= prepare.prepare_ts


def test_prepare_then_rollback_prepared() -> None:
    steps = step_names("two_phase")
    prepare = one(messages("two_phase", "v3-two-phase", steps[2]), Prepare)
    assert prepare.gid == "gid-rollback"
    rollback = one(messages("two_phase", "v3-two-phase", steps[3]), RollbackPrepared)
    assert (rollback.gid, rollback.xid, rollback.flags) == ("gid-rollback", prepare.xid, 0)
    assert rollback.prepare_end_lsn == prepare.end_lsn
    assert rollback.prepare_ts == prepare.prepare_ts
    assert rollback.rollback_end_lsn > rollback.prepare_end_lsn
    assert rollback.rollback_ts >= rollback.prepare_ts


def test_streamed_prepare() -> None:
    steps = step_names("two_phase")
    msgs = messages("two_phase", "v3-two-phase", steps[4])
    xid = of_type(msgs, StreamStart)[0].xid
    assert len(of_type(msgs, Insert)) == 500
    assert {i.xid for i in of_type(msgs, Insert)} == {xid}
    prepare = one(msgs, StreamPrepare)
    assert msgs[-1] == prepare
    assert (prepare.gid, prepare.xid, prepare.flags) == ("gid-stream", xid, 0)
    assert prepare.prepare_lsn < prepare.end_lsn
    commit = one(messages("two_phase", "v3-two-phase", steps[5]), CommitPrepared)
    assert (commit.gid, commit.xid) == ("gid-stream", xid)


# ---------------------------------------------------------------------------------------------
# Hand-built bytes: malformed input and fields the fixtures cannot show
# ---------------------------------------------------------------------------------------------


def insert_bytes(*columns: bytes, relation_id: int = 16385) -> bytes:
    return b"I" + struct.pack(">IcH", relation_id, b"N", len(columns)) + b"".join(columns)


def text_col(value: bytes) -> bytes:
    return b"t" + struct.pack(">i", len(value)) + value


def test_hand_built_insert_with_every_tuple_kind() -> None:
    data = insert_bytes(text_col(b"abc"), b"n", b"u", b"b" + struct.pack(">i", 2) + b"\x00\xff")
    msg = PgOutputDecoder().decode(memoryview(data))
    assert msg == Insert(16385, (b"abc", None, UNCHANGED_TOAST, b"\x00\xff"), None)


def test_unknown_message_type() -> None:
    with pytest.raises(DecodeError, match=r"0x5a.*offset 0") as info:
        PgOutputDecoder().decode(b"Z\x00\x00\x00\x01")
    assert info.value.offset == 0
    assert info.value.message_type is None
    assert isinstance(info.value, ValueError)


def test_empty_message() -> None:
    with pytest.raises(DecodeError, match="offset 0"):
        PgOutputDecoder().decode(b"")


def test_bad_tuple_kind_names_offset_and_type() -> None:
    data = insert_bytes(text_col(b"ok"), b"x")
    bad_at = len(data) - 1
    with pytest.raises(DecodeError, match=rf"Insert \('I'\).*kind b'x'.*offset {bad_at}") as info:
        PgOutputDecoder().decode(data)
    assert info.value.offset == bad_at
    assert info.value.message_type == "Insert ('I')"


def test_bad_tuple_markers() -> None:
    decoder = PgOutputDecoder()
    with pytest.raises(DecodeError, match=r"expected 'N'.*offset 5"):
        decoder.decode(b"I" + struct.pack(">IcH", 1, b"X", 0))
    with pytest.raises(DecodeError, match=r"Delete.*'K' or 'O'.*offset 5"):
        decoder.decode(b"D" + struct.pack(">IcH", 1, b"N", 0))
    with pytest.raises(DecodeError, match=r"Update.*expected 'N'"):
        decoder.decode(b"U" + struct.pack(">IcH", 1, b"K", 0) + b"Z")


def test_negative_value_length() -> None:
    data = insert_bytes(b"t" + struct.pack(">i", -5) + b"abc")
    with pytest.raises(DecodeError, match="-5 bytes"):
        PgOutputDecoder().decode(data)


def test_invalid_utf8_in_relation_name() -> None:
    data = b"R" + struct.pack(">I", 1) + b"public\x00bad\xff\x00d" + struct.pack(">H", 0)
    with pytest.raises(DecodeError, match=r"UTF-8.*offset 15"):
        PgOutputDecoder().decode(data)


def test_truncated_insert() -> None:
    data = insert_bytes(text_col(b"hello"), b"n")
    decoder = PgOutputDecoder()
    with pytest.raises(DecodeError, match=r"Insert.*value of 5 bytes, 2 left.*offset 13"):
        decoder.decode(data[:-4])


_TUPLE_PARTS = st.one_of(
    st.binary(max_size=12).map(text_col),
    st.sampled_from([b"n", b"u", b"t", b"b\x00\x00", b"x", b"t\xff\xff\xff\xfb"]),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(_TUPLE_PARTS, max_size=6), st.integers(0, 8), st.integers(0, 3))
def test_fast_tuple_reader_agrees_with_the_checked_one(
    parts: list[bytes], declared_extra: int, cut: int
) -> None:
    """The unchecked fast path returns what the careful reader returns, or the same error."""
    body = struct.pack(">H", max(len(parts) + declared_extra - 4, 0)) + b"".join(parts)
    buf = b"I" + body[: len(body) - cut]

    def outcome(reader: Any) -> object:
        try:
            return reader(buf, 1)
        except Exception as exc:
            return (type(exc), str(exc))

    assert outcome(pgoutput._read_tuple) == outcome(pgoutput._read_tuple_checked)


def truncation_samples() -> Iterator[tuple[str, int, bytes]]:
    """Every distinct message type/shape from the fixtures, with its streaming state."""
    seen: set[tuple[str, bool]] = set()
    for path in FIXTURE_FILES:
        fixture = json.loads(path.read_text())
        for capture in fixture["captures"]:
            decoder = PgOutputDecoder()
            for entry in fixture["messages"]:
                if entry["capture"] != capture:
                    continue
                in_stream = decoder.in_stream
                data = bytes.fromhex(entry["hex"])
                decoder.decode(data)
                key = (entry["description"].rsplit(": ", 1)[1], in_stream)
                if key not in seen and len(data) < 2000:
                    seen.add(key)
                    yield f"{fixture['case']}-{capture}-{key[0]}-{in_stream}", in_stream, data


@pytest.mark.parametrize(
    ("in_stream", "data"),
    [pytest.param(s, d, id=name) for name, s, d in truncation_samples()],
)
def test_every_truncation_of_real_messages_raises_decode_error(
    in_stream: bool, data: bytes
) -> None:
    for cut in range(len(data)):
        decoder = PgOutputDecoder()
        if in_stream:
            decoder.decode(b"S" + struct.pack(">IB", 1, 1))
        with pytest.raises(DecodeError) as info:
            decoder.decode(data[:cut])
        assert 0 <= info.value.offset <= cut


def test_stream_abort_with_parallel_streaming_fields() -> None:
    decoder = PgOutputDecoder()
    v2 = decoder.decode(b"A" + struct.pack(">II", 7, 8))
    assert v2 == StreamAbort(7, 8, None, None)
    v4 = decoder.decode(b"A" + struct.pack(">IIQq", 7, 7, 0x1_0000_0010, 757479845000000))
    assert v4 == StreamAbort(7, 7, 0x1_0000_0010, 757479845000000)
    with pytest.raises(DecodeError, match="Stream Abort"):
        decoder.decode(b"A" + struct.pack(">IIQ", 7, 7, 1))


def test_xid_prefix_only_inside_stream_block() -> None:
    decoder = PgOutputDecoder()
    body = struct.pack(">IcH", 42, b"N", 1) + text_col(b"v")
    assert decoder.decode(b"I" + body) == Insert(42, (b"v",), None)
    assert decoder.decode(b"S" + struct.pack(">IB", 900, 1)) == StreamStart(900, True)
    assert decoder.in_stream
    assert decoder.decode(b"I" + struct.pack(">I", 901) + body) == Insert(42, (b"v",), 901)
    message = b"M" + struct.pack(">IBQ", 900, 1, 5) + b"p\x00" + struct.pack(">i", 1) + b"x"
    assert decoder.decode(message) == LogicalMessage(True, 5, "p", b"x", 900)
    assert decoder.decode(b"E") == StreamStop()
    assert not decoder.in_stream
    assert decoder.decode(b"I" + body) == Insert(42, (b"v",), None)


def test_decode_error_leaves_stream_state_unchanged() -> None:
    decoder = PgOutputDecoder()
    with pytest.raises(DecodeError):
        decoder.decode(b"S\x00\x00")
    assert not decoder.in_stream


def test_unchanged_toast_is_a_singleton() -> None:
    assert UnchangedToast() is UNCHANGED_TOAST
    assert copy.deepcopy(UNCHANGED_TOAST) is UNCHANGED_TOAST
    assert pickle.loads(pickle.dumps(UNCHANGED_TOAST)) is UNCHANGED_TOAST
    assert repr(UNCHANGED_TOAST) == "UNCHANGED_TOAST"


def test_messages_are_frozen() -> None:
    msg = PgOutputDecoder().decode(insert_bytes(text_col(b"a")))
    assert isinstance(msg, Insert)
    with pytest.raises(AttributeError):
        msg.relation_id = 1  # type: ignore[misc]
