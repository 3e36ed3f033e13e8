"""Which rows of a table (or of each partition) are younger than the sweep boundary — told apart
with 32-bit row ids, exactly, for as long as the relay runs. Pure: the catalog and the table's
rows are read by :mod:`cdc_relay.sweep_queries`, and the sweeper (:mod:`cdc_relay.sweeper`)
applies what this decides.

The boundary (``slot_position.sweep_from_xid``) is a 64-bit transaction id (``xid8``); a row only
has its 32-bit ``xmin`` — the raw id even once the row is frozen (PostgreSQL keeps it and marks the
tuple), so a frozen row's ``age(xmin)`` is not "the greatest": it wraps like any other. A row's
full id is derived from the statement's own next id ``X`` (its snapshot's ``xmax``) and the
modular distance ``d = (X - xmin) mod 2^32`` (taken in 1..2^32): ``X - d``. That *image* is the
row's id exactly while the row is younger than 2^32 transactions; an older row's image is its id
plus a multiple of 2^32 — it looks younger than it is.

A row younger than the boundary stays so whatever the distance (its image is never below its id).
The danger is only a row *older* than the boundary (it predates the slot, a row-filter change, or
its partition's attach: never published): its image moves up by 2^32 once ``X`` reaches its image
plus 2^32, and past the boundary. So, per table (per partition, each with its own *effective
boundary*, ``since``: the boundary, or just after the transaction that attached it):

- the sweeper *looks* at it: one scan for the rows older than ``since`` (and the oldest
  transaction still running, which may still add such rows). None, and no older transaction
  running: the partition is **settled** — no row older than ``since`` can ever appear again (new
  rows get newer ids), nothing is left to tell apart, and it is swept for good, whatever ``X``;
- otherwise the look gives its **horizon** (``until``): the image of the oldest such row (or
  running transaction) plus 2^32, the first ``X`` at which one could look younger. Each delete
  checks ``X < until`` in its own statement; the sweeper warns :data:`WARN_MARGIN` transactions
  before it and stops deleting from it :data:`REFUSE_MARGIN` before, naming the rows to remove;
  it looks again every :data:`RESCAN_SECONDS` (while ``X < until`` a look is exact), and settles
  once they are gone;
- a *table rewrite* (``ALTER TABLE … TYPE``, ``VACUUM FULL``, ``CLUSTER``: a new ``relfilenode``)
  may give every row the rewriting transaction's id, older rows too. A settled partition has none
  to confuse (it is looked at again all the same: a new ``relfilenode`` under a known oid could
  also be another table); for one that is not, ``since`` moves past the last change of its
  catalog row (the rewrite), keeping every row it holds then — rows it had published included,
  left for the operator — and it is looked at again. At a first look ``since`` is also past that
  change, should the table have been rewritten between the boundary and the look.

What was learnt is kept in ``slot_position.sweep_horizons`` (per partition oid, with the boundary
and the attach it is of): after a restart, 2^32 transactions later, the sweeper still knows. The
first look must come before the older rows' ids could have come round: a first look more than
:data:`FIRST_LOOK_LIMIT` transactions after ``since`` that finds any row taken for younger cannot
tell them apart, and that partition is refused until a new boundary is taken (the fix it names).
The sweeper looks within one pass of a new boundary or partition; what it cannot see is a row that
was already older than 2^32 transactions at that first look and whose id happens to fall among the
ids assigned between ``since`` and the look (a few in 4 billion per such row, per second of delay).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

SPAN = 1 << 32  # 32-bit transaction ids come round every SPAN transactions
FIRST_LOOK_LIMIT = 1 << 31  # a first look later than this after ``since`` is refused
WARN_MARGIN = 1 << 31  # warn this many transactions before a horizon
REFUSE_MARGIN = 1 << 28  # stop deleting this many before it (about 7 h at 10,000 per second)
RESCAN_SECONDS = 300.0  # a partition that is not settled is looked at again this often
NO_HORIZON = (1 << 63) - 1  # a settled partition's horizon in the statements: never reached


def image(raw: int, now: int) -> int:
    """The latest 64-bit id below ``now`` whose low 32 bits are ``raw``: the id of a transaction
    younger than 2^32 transactions, the id plus a multiple of 2^32 of an older one."""
    return now - ((now - raw - 1) % SPAN + 1)


@dataclass(frozen=True)
class Leaf:
    """A table the outbox's rows live in (the outbox itself, or one of its leaf partitions), as
    the catalog says at the start of a pass."""

    oid: int
    name: str
    attached: tuple[int, ...]  # raw xmins of its pg_inherits rows, up to the outbox's root
    filenode: int
    altered: int  # raw xmin of its pg_class row: the transaction that last changed it


@dataclass(frozen=True)
class Horizon:
    """What a look at a leaf found, for the boundary and attach it was taken under."""

    boundary: int
    attached: tuple[int, ...]
    filenode: int
    since: int  # rows of transactions before this are never deleted from it
    until: int | None  # the first next id at which one of them could look younger; None: settled
    older: int  # rows older than ``since`` when it looked

    def to_json(self) -> dict[str, object]:
        return {
            "b": self.boundary,
            "a": list(self.attached),
            "n": self.filenode,
            "s": self.since,
            "u": self.until,
            "o": self.older,
        }


def from_json(value: object) -> Horizon | None:
    """A stored horizon, or None for anything that is not one (a hostile or older value: the
    leaf is looked at afresh, which is always safe)."""
    if not isinstance(value, Mapping):
        return None
    fields = [value.get(k) for k in ("b", "n", "s", "o")]
    until, attached = value.get("u"), value.get("a")
    if not all(type(f) is int for f in fields) or not isinstance(attached, list):
        return None
    if until is not None and type(until) is not int:
        return None
    if not all(type(a) is int for a in attached):
        return None
    boundary, filenode, since, older = (int(str(f)) for f in fields)
    return Horizon(
        boundary,
        tuple(int(str(a)) for a in attached),
        filenode,
        since,
        None if until is None else int(str(until)),
        older,
    )


@dataclass(frozen=True)
class Look:
    """A leaf to scan: from ``since``, replacing ``previous`` (None: a first look)."""

    since: int
    previous: Horizon | None


@dataclass(frozen=True)
class Scan:
    """One scan of a leaf, all read in one statement."""

    now: int  # the statement's next transaction id
    oldest_running: int  # its snapshot's xmin: the oldest transaction still running
    older: int  # rows older than ``since``
    oldest_older: int | None  # the smallest image among them
    younger: int  # rows taken for younger


def plan(
    leaf: Leaf, known: Horizon | None, boundary: int, now: int, scanned_ago: float | None
) -> Horizon | Look:
    """What to do with ``leaf`` this pass: sweep it by what is ``known``, or look at it.
    ``scanned_ago``: seconds since this sweeper last looked (None: not in this process)."""
    if known is None or known.boundary != boundary or known.attached != leaf.attached:
        since = max([boundary, *(image(a, now) + 1 for a in leaf.attached)])
        # A rewrite since the boundary would have given older rows a newer id: from after it.
        return Look(max(since, image(leaf.altered, now) + 1), None)
    if leaf.filenode != known.filenode:
        if known.until is None:
            # Rewritten (or, after an oid came round, another table): settled again by a look
            # unless it holds older rows after all; a rewrite of a settled one has none to confuse.
            return Look(known.since, known)
        return Look(max(known.since, image(leaf.altered, now) + 1), known)
    if known.until is None:
        return known
    if scanned_ago is None or scanned_ago >= RESCAN_SECONDS:
        return Look(known.since, known)
    return known


def settle(leaf: Leaf, look: Look, boundary: int, scan: Scan) -> Horizon | str:
    """The horizon a scan shows, or why it cannot be trusted (the leaf is then refused)."""
    previous = look.previous
    if previous is not None and previous.until is not None and scan.now >= previous.until:
        return (
            f"{leaf.name}: {previous.older} row(s) predate the sweep boundary and have been there "
            "2^32 transactions: their 32-bit transaction ids now look younger than it, so the "
            "sweeper cannot tell them from published rows"
        )
    if previous is None and scan.younger and scan.now - look.since >= FIRST_LOOK_LIMIT:
        return (
            f"{leaf.name}: the sweeper first looked at it {scan.now - look.since} transactions "
            "after its sweep boundary, too late to tell a row older than 2^32 transactions from "
            "a younger one"
        )
    limits = [scan.oldest_older] if scan.oldest_older is not None else []
    if scan.oldest_running < look.since:
        limits.append(scan.oldest_running)
    until = min(limits) + SPAN if limits else None
    return Horizon(boundary, leaf.attached, leaf.filenode, look.since, until, scan.older)


def left(horizon: Horizon, now: int) -> int | None:
    """Transactions until ``horizon`` could be wrong (None: never)."""
    return None if horizon.until is None else horizon.until - now
