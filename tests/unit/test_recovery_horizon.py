"""The acknowledged-below horizon (cdc_relay.recovery.horizon): its parsing, and — against a model
of PostgreSQL's transaction ids, commit records and snapshots — that what it proves holds."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given
from hypothesis import strategies as st

from cdc_relay.recovery.horizon import (
    MAX_FENCES,
    Fence,
    Horizon,
    HorizonTracker,
    Snapshot,
    horizon_from_json,
)


def test_a_snapshot_reads_as_postgresql_prints_it() -> None:
    snapshot = Snapshot.parse("726:731:727,729")
    assert snapshot == Snapshot(726, 731, frozenset({727, 729}))
    assert snapshot.text == "726:731:727,729"
    assert [x for x in range(724, 733) if snapshot.visible(x)] == [724, 725, 726, 728, 730]
    assert Snapshot.parse("726:726:") == Snapshot.below(726)


@given(st.text(max_size=40) | st.binary(max_size=20) | st.integers() | st.none())
def test_anything_else_is_no_snapshot(value: object) -> None:
    parsed = Snapshot.parse(value)
    if parsed is not None:  # only what PostgreSQL prints, in its own order
        assert isinstance(value, str)
        assert parsed.xmin <= parsed.xmax
        assert all(parsed.xmin <= x < parsed.xmax for x in parsed.xip)


@given(
    st.lists(st.integers(0, 50), max_size=8),
    st.integers(3, 2**40),
    st.dictionaries(
        st.tuples(st.sampled_from(["a", "b.c"]), st.integers(0, 9)), st.integers(0, 2**62)
    ),
)
def test_a_horizon_survives_the_record(xip: list[int], base: int, offsets: dict) -> None:  # type: ignore[type-arg]
    snapshot = Snapshot(base, base + 51, frozenset(base + x for x in xip))
    horizon = Horizon(base - 3, snapshot, offsets, {("n", 0): 5}, 0x16B3F28)
    assert horizon_from_json(horizon.text) == horizon
    assert horizon_from_json(horizon.to_json()) == horizon


@given(
    st.recursive(
        st.none() | st.integers() | st.text(max_size=10),
        lambda c: st.lists(c) | st.dictionaries(st.text(max_size=8), c),
    )
)
def test_a_hostile_horizon_proves_nothing(value: object) -> None:
    assert horizon_from_json(value) is None or isinstance(value, dict)


# -- the model ----------------------------------------------------------------------------------


@dataclass
class Database:
    """Transaction ids assigned in order (no WAL); a commit writes its record at the WAL's end,
    then leaves the running set (no WAL) — perhaps much later (a synchronous standby's wait)."""

    lsn: int = 100
    next_xid: int = 1000
    running: list[int] = field(default_factory=list)
    completed: list[int] = field(default_factory=list)
    committed_at: dict[int, int] = field(default_factory=dict)  # xid -> commit record's end
    latest_completed: int = 999

    def step(self) -> int:
        self.lsn += 8
        return self.lsn

    def begin(self) -> int:
        xid = self.next_xid
        self.next_xid += 1
        self.running.append(xid)
        return xid

    def write_commit(self, xid: int) -> None:
        self.committed_at[xid] = self.step()

    def leave(self, xid: int) -> None:
        self.running.remove(xid)
        self.latest_completed = max(self.latest_completed, xid)

    def snapshot(self) -> Snapshot:
        xmax = self.latest_completed + 1
        xip = frozenset(x for x in self.running if x < xmax)
        return Snapshot(min([*self.running, xmax]), xmax, xip)


OPS = st.lists(
    st.tuples(st.sampled_from(["begin", "commit", "leave", "wal", "save"]), st.integers(0, 5)),
    min_size=1,
    max_size=120,
)


@given(OPS)
def test_what_a_horizon_proves_holds(ops: list[tuple[str, int]]) -> None:
    """Every transaction the recorded horizon's snapshot sees committed at or below the position
    recorded with it; every other one committed after the horizon's read-back position."""
    db = Database()
    tracker = HorizonTracker()
    # The slot is created before any transaction: its boundary, nothing proven.
    tracker.written(
        Fence(1000, Snapshot.below(1000), 100, 999, 100, {}, {}), Horizon.nothing(1000, {}, {}, 100)
    )
    decided = 100  # the relay's confirmed position: everything committed below it is in Kafka
    written_with: list[tuple[Horizon, int]] = []  # each horizon, and the position it came with
    for op, pick in ops:
        if op == "begin":
            db.begin()
        elif op == "commit":
            pending = [x for x in db.running if x not in db.committed_at]
            if pending:
                db.write_commit(pending[pick % len(pending)])
        elif op == "wal":
            db.step()  # another table's write
        elif op == "leave":
            done = [x for x in db.running if x in db.committed_at]
            if done:
                db.leave(done[pick % len(done)])
        else:
            # The relay has Kafka's acknowledgement of every commit below ``decided``.
            decided = max(decided, db.lsn - 8 * pick)
            position = decided
            horizon = tracker.to_record(position)
            # The write: a statement with a snapshot, its own id, the insert position after.
            snapshot = db.snapshot()
            xid = db.begin()
            insert_lsn = db.lsn
            db.write_commit(xid)
            db.leave(xid)
            stored = horizon if horizon is not None else tracker.recorded
            if horizon is not None:
                written_with.append((horizon, position))
            fence = Fence(1000, snapshot, insert_lsn, xid, position, {}, {})
            tracker.written(fence, stored)
        for horizon, position in written_with:
            for xid, committed in db.committed_at.items():
                if xid < horizon.boundary:
                    continue
                if horizon.snapshot.visible(xid) and xid not in db.running:
                    assert committed <= position, (xid, horizon)
                elif not horizon.snapshot.visible(xid):
                    assert committed > horizon.position, (xid, horizon)


def test_fences_are_bounded() -> None:
    tracker = HorizonTracker()
    for n in range(MAX_FENCES * 3):
        # A transaction older than every fence keeps running: the horizon cannot move.
        snapshot = Snapshot(10, 1000 + n, frozenset({10}))
        tracker.written(Fence(1, snapshot, 100 + n, 1000 + n, 50 + n, {}, {}), None)
        assert tracker.to_record(10**6) is None
    assert tracker.fences <= MAX_FENCES + 1


def test_notes_written_after_a_fence_join_its_read_back() -> None:
    tracker = HorizonTracker()
    first = Fence(1, Snapshot(100, 100), 500, 100, 400, {("t", 0): 7}, {})
    tracker.written(first, Horizon.nothing(1, {("t", 0): 7}, {}, 400))
    # A topic first written after that write: its note is returned by the next one.
    second = Fence(1, Snapshot(101, 101), 600, 101, 550, {("t", 0): 9}, {("u", 0): 3, ("u", 1): 0})
    tracker.written(second, tracker.recorded)
    horizon = tracker.to_record(600)
    assert horizon is not None
    assert horizon.snapshot == Snapshot(101, 101)
    assert horizon.offsets == {("t", 0): 7}  # where the rows it does not see may begin
    assert horizon.noted == {("u", 0): 3, ("u", 1): 0}
    assert horizon.position == 400


def test_a_horizon_of_another_boundary_is_dropped() -> None:
    tracker = HorizonTracker()
    tracker.written(
        Fence(2, Snapshot(100, 100), 500, 100, 400, {}, {}), Horizon.nothing(1, {}, {}, 0)
    )
    assert tracker.recorded is None
