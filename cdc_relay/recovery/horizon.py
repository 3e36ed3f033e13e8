"""The acknowledged-below horizon: which outbox rows the relay has provably published, kept in the
position record as the relay confirms. Pure: the position store
(:class:`cdc_relay.checkpoint.PostgresCheckpointStore`) reads what each of its writes saw and
writes what :class:`HorizonTracker` decides; a recovery (:mod:`cdc_relay.recovery`) reads it.

Each write of the position is also a *fence*, read in the same statement: the statement's
snapshot ``S`` (``pg_current_snapshot()``), the WAL insert position ``L`` read after it, its own
transaction id ``X`` (assigned after the position it writes was decided), the sweep boundary, and
the acknowledged offsets and partition notes it leaves. Two facts about a fence:

- a transaction ``S`` sees committed below ``L``: its commit record was written before it left the
  running set, before ``S`` was taken, and ``L`` was read after that. So once a recorded position
  ``P >= L``, every outbox row of a transaction ``S`` sees, at or after the sweep boundary (the
  slot decoded it) and matching the row filter, was acknowledged by Kafka (or dead-lettered);
- a transaction whose id is above ``X`` got its id after the fence's position ``P_X`` was decided,
  so it committed after ``P_X``: its records, if the relay published it, lie after the offsets
  acknowledged at ``P_X``, in every partition (the relay produces in commit order; a partition
  without such an offset was noted before the relay first wrote it, :mod:`cdc_relay.reconcile`).

The horizon recorded with a position ``P`` is a pair of fences: ``k``, the newest fence with
``L_k <= P`` (its snapshot: the rows proven published), and ``i``, the newest fence at or before
``k`` with ``X_i`` below ``S_k``'s ``xmin`` (its offsets and notes: where the read-back of the
rows ``S_k`` does not see begins — every such row's transaction id is at least ``xmin(S_k)``,
hence above ``X_i``). Without such an ``i`` (a transaction that got its id before every fence
kept is still running) the horizon stays where it was. A horizon belongs to one sweep boundary: a
new boundary (a new slot, a row-filter change) starts afresh with nothing proven, read back from
the offsets at that moment; a horizon of another boundary than the record's proves nothing.

Notes written after a fence (a partition the relay first wrote since) are added to the fences and
the recorded horizon that lack that partition, as each later write returns them: a note stays in
the record at least until the write that records an offset for its partition.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import orjson

from cdc_relay.lsn import format_lsn, parse_lsn
from cdc_relay.reconcile import Offsets, decode_offsets, encode_offsets

MAX_XIP = 1 << 20  # running transactions in one snapshot, at most (a bound on a hostile record)
MAX_FENCES = 256  # fences kept; past it, every other one of the older half goes
MAX_XID = (1 << 64) - 1


@dataclass(frozen=True)
class Snapshot:
    """A ``pg_snapshot`` (``xmin:xmax:xip,...``) with 64-bit transaction ids."""

    xmin: int
    xmax: int
    xip: frozenset[int] = frozenset()

    @classmethod
    def parse(cls, text: object) -> Snapshot | None:
        """A snapshot as PostgreSQL prints it; None for anything that is not one."""
        if not isinstance(text, str) or len(text) > 24 * MAX_XIP:
            return None
        parts = text.split(":")
        if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit():
            return None
        xmin, xmax = int(parts[0]), int(parts[1])
        listed = parts[2].split(",") if parts[2] else []
        if not all(x.isdigit() for x in listed) or len(listed) > MAX_XIP:
            return None
        xip = frozenset(int(x) for x in listed)
        if not xmin <= xmax <= MAX_XID or any(not xmin <= x < xmax for x in xip):
            return None
        return cls(xmin, xmax, xip)

    @classmethod
    def below(cls, xid: int) -> Snapshot:
        """The snapshot that sees exactly the transactions below ``xid``."""
        return cls(xid, xid)

    @property
    def text(self) -> str:
        return f"{self.xmin}:{self.xmax}:{','.join(str(x) for x in sorted(self.xip))}"

    def visible(self, xid: int) -> bool:
        """Whether a committed transaction ``xid`` is visible to this snapshot."""
        return xid < self.xmin or (xid < self.xmax and xid not in self.xip)


@dataclass(frozen=True)
class Horizon:
    """What the record proves: rows of transactions ``snapshot`` sees, at or after ``boundary``,
    were acknowledged; the records of any other row lie after ``offsets`` (and ``noted``, for
    partitions without an offset), acknowledged at ``position``."""

    boundary: int
    snapshot: Snapshot
    offsets: Offsets = field(default_factory=dict)
    noted: Offsets = field(default_factory=dict)
    position: int = 0

    @classmethod
    def nothing(cls, boundary: int, offsets: Offsets, noted: Offsets, position: int) -> Horizon:
        """Nothing proven yet under ``boundary`` (just taken)."""
        return cls(boundary, Snapshot.below(boundary), dict(offsets), dict(noted), position)

    def to_json(self) -> dict[str, object]:
        return {
            "boundary": str(self.boundary),
            "snapshot": self.snapshot.text,
            "offsets": orjson.loads(encode_offsets(self.offsets)),
            "noted": orjson.loads(encode_offsets(self.noted)),
            "position": format_lsn(self.position),
        }

    @property
    def text(self) -> str:
        return orjson.dumps(self.to_json()).decode()

    def with_notes(self, notes: Mapping[tuple[str, int], int]) -> Horizon:
        """The notes of partitions it has no offset or note for, added."""
        added = {k: v for k, v in notes.items() if k not in self.offsets and k not in self.noted}
        return replace(self, noted={**self.noted, **added}) if added else self


def horizon_from_json(value: object) -> Horizon | None:
    """A recorded horizon; None for anything that is not one (it then proves nothing)."""
    if isinstance(value, (bytes, str)):
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError:
            return None
    if not isinstance(value, Mapping):
        return None
    boundary, position = value.get("boundary"), value.get("position")
    snapshot = Snapshot.parse(value.get("snapshot"))
    offsets, noted = decode_offsets(value.get("offsets")), decode_offsets(value.get("noted"))
    if not isinstance(boundary, str) or not boundary.isdigit() or snapshot is None:
        return None
    if offsets is None or noted is None or not isinstance(position, str):
        return None
    try:
        lsn = parse_lsn(position)
    except ValueError:
        return None
    return Horizon(int(boundary), snapshot, offsets, noted, lsn)


@dataclass(frozen=True)
class Fence:
    """What one write of the position read in its own statement (see the module docstring)."""

    boundary: int  # the sweep boundary after the write
    snapshot: Snapshot  # the statement's
    insert_lsn: int  # the WAL insert position, read after the snapshot
    xid: int  # the statement's own transaction id
    position: int  # the position it wrote
    offsets: Offsets  # the acknowledged offsets the record holds after it
    noted: Offsets  # the partition notes it holds after it


class HorizonTracker:
    """One position store's fences, and the horizon to record with each position."""

    def __init__(self) -> None:
        self.recorded: Horizon | None = None  # as the last write returned it, notes added
        self._stored: Horizon | None = None  # as the last write returned it
        self._fences: list[Fence] = []

    @property
    def fences(self) -> int:
        return len(self._fences)

    def to_record(self, position: int) -> Horizon | None:
        """The horizon to write with ``position``; None: keep the recorded one."""
        recorded = self.recorded
        kept = None if recorded == self._stored else recorded  # notes to add, at least
        if not self._fences:
            return kept
        boundary = recorded.boundary if recorded is not None else self._fences[-1].boundary
        fences = [f for f in self._fences if f.boundary == boundary]
        newest = None
        for index, fence in enumerate(fences):
            if fence.insert_lsn <= position:
                newest = index
        if newest is None:
            return kept
        covered = fences[newest]
        start = next(
            (f for f in reversed(fences[: newest + 1]) if f.xid < covered.snapshot.xmin), None
        )
        if start is None:
            return kept
        if recorded is not None and not _sees_more(covered.snapshot, recorded.snapshot):
            return kept
        self._fences = fences[fences.index(start) :]
        return Horizon(
            covered.boundary, covered.snapshot, start.offsets, start.noted, start.position
        )

    def written(self, fence: Fence, stored: Horizon | None) -> None:
        """A write returned ``fence`` and the horizon ``stored`` now in the record (None: none,
        or not one: the first horizon then comes from this store's fences)."""
        notes = fence.noted
        self._fences = [
            replace(f, noted=_added(f, notes)) for f in self._fences if f.boundary == fence.boundary
        ]
        self._fences.append(fence)
        if len(self._fences) > MAX_FENCES:
            half = len(self._fences) // 2
            self._fences = self._fences[:half:2] + self._fences[half:]
        if stored is not None and stored.boundary != fence.boundary:
            stored = None  # of another boundary: proves nothing
        self._stored = stored
        self.recorded = None if stored is None else stored.with_notes(notes)


def _added(fence: Fence, notes: Mapping[tuple[str, int], int]) -> Offsets:
    return {
        **fence.noted,
        **{k: v for k, v in notes.items() if k not in fence.offsets and k not in fence.noted},
    }


def _sees_more(new: Snapshot, old: Snapshot) -> bool:
    """A later fence's snapshot sees at least what an earlier one saw; the recorded horizon only
    moves forward (a horizon read from another store's writes may be ahead of this one's fences)."""
    return new.xmin >= old.xmin and new.xmax >= old.xmax and new != old
