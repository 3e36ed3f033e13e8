"""The C publish path (``_tuple_reader.Publisher``) decodes and publishes an Insert's ordinary row
exactly as its Python reference does (``PgOutputDecoder.decode_xlog``, then the session's loop
and ``Session.publish``), and changes nothing when it leaves a frame to them: the same frames
through the session's loop, once with the C path and once without, leave the same records,
headers, delivery accounting, dead letters, confirmations and errors."""

from __future__ import annotations

import gc
import struct
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from confluent_kafka import KafkaError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdc_relay import session as session_module
from cdc_relay import watermark
from cdc_relay.config import load_settings
from cdc_relay.decode.messages import UNCHANGED_TOAST, Relation
from cdc_relay.decode.pgoutput import PgOutputDecoder
from cdc_relay.errors import RelayError, StopSession
from cdc_relay.observability.stats import RelayStats
from cdc_relay.observability.tracing import Tracing
from cdc_relay.reconcile import POSITION_HEADER, Reconciliation, parse_position
from cdc_relay.relations import Relations
from cdc_relay.replication.protocol import XLOG_DATA_PAYLOAD_OFFSET
from cdc_relay.session import Session
from cdc_relay.topics import TopicRules
from cdc_relay.watermark import PendingTransaction
from tests.built_extension import load_tuple_reader
from tests.fakes import FakeOwner, FakeSink, FakeSource, FakeStore, captured_frames, xlog_frame

READER = load_tuple_reader()
# The mypyc build's PendingTransaction has no __slots__: the C path is never used there
# (test_it_needs_the_transactions_slots); its equivalence runs in the source tiers.
COMPILED = not str(watermark.__file__).endswith(".py")
needs_slots = pytest.mark.skipif(COMPILED, reason="compiled PendingTransaction: C path unused")

DEAD_LETTER = "dead.letters"
RELATION_FRAME = captured_frames("basic_insert")[1]  # public.outbox: 7 columns, jsonb payload
RELATION_ID = 16385
OTHER_RELATION_ID = 16999
COLUMNS = 7  # id, aggregate_type, aggregate_id, event_type, payload, headers, created_at


def _insert(relation_id: int, values: list[Any]) -> bytes:
    parts = [b"I", struct.pack(">I", relation_id), b"N", struct.pack(">H", len(values))]
    for value in values:
        if value is None:
            parts.append(b"n")
        elif value is UNCHANGED_TOAST:
            parts.append(b"u")
        else:
            parts.append(b"t" + struct.pack(">I", len(value)) + value)
    return b"".join(parts)


def _begin(final_lsn: int, xid: int) -> bytes:
    return b"B" + struct.pack(">QqI", final_lsn, 0, xid)


def _commit(commit_lsn: int, end_lsn: int) -> bytes:
    return b"C" + struct.pack(">BQQq", 0, commit_lsn, end_lsn, 0)


def _transactions(transactions: list[list[bytes]]) -> list[bytes]:
    """XLogData frames: the relation, then each transaction's Insert payloads between its Begin
    and Commit."""
    frames = [RELATION_FRAME]
    lsn = 0x1000000
    for xid, inserts in enumerate(transactions, start=1000):
        final = lsn + 16 * (len(inserts) + 1)
        frames.append(xlog_frame(_begin(final, xid), lsn))
        frames.extend(xlog_frame(payload, lsn + 16 * (i + 1)) for i, payload in enumerate(inserts))
        frames.append(xlog_frame(_commit(final, final + 8), final))
        lsn = final + 64
    return frames


class FullOnceSink(FakeSink):
    """Refuses the n-th produce calls once each with BufferError (a full queue), as librdkafka
    does; the session then waits for room and produces again."""

    def __init__(self, full_at: set[int]) -> None:
        super().__init__()
        self.full_at = set(full_at)
        self.calls = 0

    def produce_raw(self, *args: Any) -> None:
        self.calls += 1
        if self.calls in self.full_at:
            raise BufferError("Local: Queue full")
        super().produce_raw(*args)


class Counted:
    """The C Publisher, counting the frames it published itself."""

    def __init__(self, publisher: Callable[[memoryview, Any], bool]) -> None:
        self.publisher = publisher
        self.published = 0

    def __call__(self, frame: memoryview, txn: Any) -> bool:
        done = self.publisher(frame, txn)
        self.published += done
        return done


@contextmanager
def _c_path(counted: list[Counted], enabled: bool) -> Iterator[None]:
    """Sessions made meanwhile use the C path (counted) or, not enabled, only Python."""

    def counting(*args: Any) -> Counted:
        made = Counted(READER.Publisher(*args))
        counted.append(made)
        return made

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(session_module, "_PUBLISHER", counting if enabled else None)
        yield


def _run(
    frames: list[bytes],
    *,
    fast: bool,
    refuse: str | None,
    full_at: set[int],
    reconciliation: Reconciliation | None = None,
) -> tuple[dict[str, Any], int]:
    """The frames through a session's loop: what it leaves behind, and how many frames the C path
    published."""
    counted: list[Counted] = []
    with _c_path(counted, fast):
        relay_settings = load_settings(
            database_url="postgresql://relay@db/app",
            kafka_bootstrap_servers="k:9092",
            dead_letter_topic=DEAD_LETTER,
            confirm_interval=1e-9,
            idle_confirm_interval=1e-9,
            shutdown_timeout=1.0,
        )
        journal: list[Any] = []
        owner = FakeOwner()
        sink = FullOnceSink(full_at)
        if refuse is not None:
            sink.refuse_topics[refuse] = KafkaError.MSG_SIZE_TOO_LARGE
        stats = RelayStats()
        session = Session(
            owner,
            relay_settings,
            stats,
            Tracing(),
            TopicRules(relay_settings),
            source=FakeSource(frames, owner, journal),
            sink=sink,
            store=FakeStore(journal),
            start=0,
            heartbeat=lambda: None,
            retained_wal=lambda: None,
            reconciliation=reconciliation,
        )
        error: str | None = None
        try:
            session.stream()
        except StopSession:
            session.shutdown()
        except RelayError as exc:
            error = f"{type(exc).__name__}: {exc}"
    records = [
        (r.topic, r.key, r.value, r.headers, _bound(r.on_delivery))
        for r in sink.delivered + sink.in_flight_records
    ]
    outcome = {
        "records": records,
        "journal": journal,
        "published": stats.published,
        "dead_lettered": stats.dead_lettered,
        "known_topics": sorted(session.known_topics),
        "failure": None if owner.failure is None else str(owner.failure),
        "error": error,
        "produce_calls": sink.calls,
        "skipped_in_kafka": stats.skipped_in_kafka,
    }
    return outcome, sum(c.published for c in counted)


def _bound(callback: Any) -> tuple[Any, ...]:
    """What a record's delivery callback was bound to (a transaction by its commit LSN)."""
    bound = callback.__self__ if hasattr(callback, "__self__") else callback.args
    flat = bound[-1] if isinstance(bound[-1], tuple) else bound  # a dead letter's partial
    return tuple(f"txn {v.commit_lsn}" if isinstance(v, PendingTransaction) else v for v in flat)


IDS = st.one_of(
    st.uuids().map(lambda u: str(u).encode()),
    st.binary(max_size=12),  # invalid UTF-8 among them: a dead letter
)
TYPES = st.sampled_from([b"order", b"payment", b"city", b"\xff\xfe"])
EVENTS = st.sampled_from([b"created", b"paid"])
PAYLOADS = st.sampled_from([b'{"a": 1}', b"{}", b"", b"not json"])
HEADERS = st.sampled_from([None, b'{"k": "v"}', b"[1]", UNCHANGED_TOAST])
MISSING = st.sampled_from([None, UNCHANGED_TOAST])


@st.composite
def rows(draw: st.DrawFn) -> bytes:
    values: list[Any] = [
        draw(IDS),
        draw(TYPES),
        draw(st.binary(min_size=1, max_size=8)),
        draw(EVENTS),
        draw(PAYLOADS),
        draw(HEADERS),
        b"2024-05-06 07:08:09+00",
    ]
    for _ in range(draw(st.integers(0, 1))):  # now and then a column missing or not bytes
        values[draw(st.integers(0, COLUMNS - 1))] = draw(MISSING)
    shape = draw(st.sampled_from(["row", "row", "row", "short", "long", "other", "malformed"]))
    if shape == "short":  # fewer values than the relation has columns
        values = values[: draw(st.integers(0, COLUMNS - 1))]
    elif shape == "long":
        values.append(b"extra")
    relation_id = OTHER_RELATION_ID if shape == "other" else RELATION_ID
    payload = _insert(relation_id, values)
    if shape == "malformed":  # cut short: the decoder names the error, the session stops
        payload = payload[: draw(st.integers(6, len(payload) - 1))]
    return payload


@needs_slots
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    transactions=st.lists(st.lists(rows(), min_size=0, max_size=6), min_size=1, max_size=4),
    refuse=st.sampled_from([None, "outbox.event.order", "outbox.event.city"]),
    full_at=st.sets(st.integers(1, 12), max_size=3),
)
def test_the_c_path_leaves_what_the_python_path_leaves(
    transactions: list[list[bytes]], refuse: str | None, full_at: set[int]
) -> None:
    frames = _transactions(transactions)
    python, none = _run(frames, fast=False, refuse=refuse, full_at=full_at)
    c, _ = _run(frames, fast=True, refuse=refuse, full_at=full_at)
    assert none == 0
    assert c == python


@needs_slots
def test_ordinary_rows_are_published_by_the_c_path() -> None:
    """Not vacuous: after each topic's first row (ensured in Python), the C path publishes, and
    ordinals past the precomputed ones are numbered as publish numbers them."""
    row = [b"00000000-0000-4000-8000-000000000001", b"order", b"o-1", b"created", b"{}", None, b"t"]
    frames = _transactions([[_insert(RELATION_ID, row)] * 3, [_insert(RELATION_ID, row)] * 4100])
    python, _ = _run(frames, fast=False, refuse=None, full_at=set())
    c, published = _run(frames, fast=True, refuse=None, full_at=set())
    assert published == 3 + 4100 - 1
    assert c == python
    positions = [dict(r[3])[POSITION_HEADER] for r in c["records"]]
    assert positions[3].endswith(b"/1")
    assert positions[-1].endswith(b"/4100")
    assert c["published"] == 4103


@needs_slots
def test_past_the_events_found_in_kafka_the_c_path_publishes() -> None:
    """While a restart's replayed window is looked up in Kafka the Python path publishes (it
    skips what was found, and its first event past the window ends the lookups); from the next
    Commit on, the C path."""
    row = [b"00000000-0000-4000-8000-000000000001", b"order", b"o-1", b"created", b"{}", None, b"t"]
    frames = _transactions([[_insert(RELATION_ID, row)] * 2] * 3)
    first, _ = _run(frames, fast=False, refuse=None, full_at=set())
    position = dict(first["records"][0][3])[POSITION_HEADER]
    parsed = parse_position(dict(first["records"][1][3])[POSITION_HEADER])
    assert parsed is not None
    found = {position: row[0]}

    def window() -> Reconciliation:
        return Reconciliation(found=dict(found), highest_lsn=parsed[1])

    python, _ = _run(frames, fast=False, refuse=None, full_at=set(), reconciliation=window())
    c, published = _run(frames, fast=True, refuse=None, full_at=set(), reconciliation=window())
    assert c == python
    assert python["skipped_in_kafka"] == 1
    assert len(python["records"]) == 5
    assert published == 2  # the window's transaction and the next in Python, then C


@needs_slots
def test_a_produce_that_raised_goes_to_publishs_handler() -> None:
    """The C path's produce raised: the event is counted, as publish counts it before producing,
    and the session's produce_failed gets what publish gives it; an error that is no Exception
    propagates, as from publish."""
    produced: list[tuple[Any, ...]] = []
    failed = Calls()
    refusing: list[BaseException] = [BufferError("Local: Queue full"), KeyboardInterrupt()]

    def produce(*args: Any) -> None:
        if refusing:
            raise refusing.pop(0)
        produced.append(args)

    publisher, txn, frame = _publisher(produce, {"outbox.event.order"}, failed.append_args)
    assert publisher(frame, txn) is True
    error, failed_txn, table, topic, key, value, headers, event_id, on_delivery = failed.pop()
    assert isinstance(error, BufferError)
    assert error.__traceback__ is not None
    assert (failed_txn, table, topic, key, value) == (
        txn, "public.outbox", "outbox.event.order", b"o-1", b"{}",
    )  # fmt: skip
    assert event_id == "00000000-0000-4000-8000-000000000001"
    assert headers[-1] == (POSITION_HEADER, b"slot/0/1")
    assert on_delivery.__self__ == (txn, "public.outbox", "outbox.event.order", headers)
    assert (txn.events, txn.pending, produced) == (1, 0, [])  # produce_failed counts it
    with pytest.raises(KeyboardInterrupt):
        publisher(frame, txn)
    assert (txn.events, txn.pending, produced, failed) == (2, 0, [], [])
    assert publisher(frame, txn) is True
    assert (txn.events, txn.pending) == (3, 1)
    topic, value, key, partition, on_delivery, alias, timestamp, headers = produced[0]
    assert (topic, value, key, partition, alias, timestamp) == (
        "outbox.event.order", b"{}", b"o-1", -1, None, 0,
    )  # fmt: skip
    assert headers[-1] == (POSITION_HEADER, b"slot/0/3")
    assert on_delivery.__self__ == (txn, "public.outbox", "outbox.event.order", headers)


@needs_slots
def test_an_unknown_topic_or_a_stream_block_is_left_to_python() -> None:
    produced: list[Any] = []
    publisher, txn, frame = _publisher(lambda *a: produced.append(a), known=set())
    assert publisher(frame, txn) is False  # the topic is ensured first, in Python
    decoder = PgOutputDecoder()
    decoder._in_stream = True
    inside = READER.Publisher(
        decoder, XLOG_DATA_PAYLOAD_OFFSET, PendingTransaction, {}, {"outbox.event.order"},
        produced.append, print, lambda *a: None, POSITION_HEADER, UNCHANGED_TOAST,
    )  # fmt: skip
    assert inside(frame, txn) is False
    assert publisher(b"not a frame", txn) is False
    assert publisher(frame, None) is False
    assert (txn.events, produced) == (0, [])


def test_it_needs_the_transactions_and_the_decoders_slots() -> None:
    class Plain:
        pass

    with pytest.raises(TypeError):
        READER.Publisher(
            PgOutputDecoder(), 25, Plain, {}, set(), print, print, print, POSITION_HEADER, None
        )
    with pytest.raises(TypeError):
        READER.Publisher(
            Plain(), 25, PendingTransaction, {}, set(), print, print, print, POSITION_HEADER, None
        )


@needs_slots
def test_references_are_balanced() -> None:
    """2,000 calls of each path leave every input's reference count as it was."""
    sent: list[Any] = []

    def produce(*args: Any) -> None:
        if len(sent) % 3 == 2:
            sent.append(None)
            raise BufferError("Local: Queue full")
        sent.append(args[0])

    failed = Calls()
    publisher, txn, frame = _publisher(produce, {"outbox.event.order"}, failed.append_args)
    state = next(iter(publisher_states.values()))
    watched = [frame, txn, state, *state, POSITION_HEADER, UNCHANGED_TOAST, produce, txn.position]
    for _ in range(50):  # warm: caches filled, small ints interned
        publisher(frame, txn)
    sent.clear()
    failed.clear()
    gc.collect()  # the mapping's cycle (its partial binds its own method), freed by now
    before = [sys.getrefcount(o) for o in watched]
    for _ in range(2000):
        publisher(frame, txn)
        publisher(frame, None)
        publisher(b"x", txn)
    assert len(failed) > 600
    sent.clear()
    failed.clear()
    assert [sys.getrefcount(o) for o in watched] == before


publisher_states: dict[int, tuple[object, ...]] = {}


class Calls(list[tuple[Any, ...]]):
    def append_args(self, *args: Any) -> None:
        self.append(args)


def _publisher(
    produce: Callable[..., None],
    known: set[str],
    produce_failed: Callable[..., None] = print,
) -> tuple[Callable[[Any, Any], bool], PendingTransaction, memoryview]:
    relations = Relations(
        load_settings(database_url="postgresql://relay@db/app", kafka_bootstrap_servers="k:9092")
    )
    relation = PgOutputDecoder().decode_xlog(memoryview(RELATION_FRAME))[0]
    assert isinstance(relation, Relation)
    relations.on_relation(relation)
    publisher_states.clear()
    publisher_states.update(relations.fast_states)
    row = [b"00000000-0000-4000-8000-000000000001", b"order", b"o-1", b"created", b"{}", None, b"t"]
    # the topic cached by a first mapping, as the session's first row of a topic does
    relations.mappings[RELATION_ID].map_fields(tuple(row))
    publisher = READER.Publisher(
        PgOutputDecoder(), XLOG_DATA_PAYLOAD_OFFSET, PendingTransaction, relations.fast_states,
        known, produce, produce_failed, lambda *a: None, POSITION_HEADER, UNCHANGED_TOAST,
    )  # fmt: skip
    txn = PendingTransaction(1, 0.0, b"slot/0/")
    return publisher, txn, memoryview(xlog_frame(_insert(RELATION_ID, row), 1))
