"""The sweep boundary's arithmetic and decisions (cdc_relay.sweep_boundary), against a model of a
table whose rows carry their true 64-bit transaction ids but show only the low 32 bits."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cdc_relay.sweep_boundary import (
    FIRST_LOOK_LIMIT,
    NO_HORIZON,
    REFUSE_MARGIN,
    RESCAN_SECONDS,
    SPAN,
    Horizon,
    Leaf,
    Look,
    Scan,
    from_json,
    image,
    left,
    plan,
    settle,
)

LOW = SPAN - 1


def _scan(ids: list[int], now: int, since: int, running: int | None = None) -> Scan:
    """What the scan statement reads of rows with these true ids, at ``now``."""
    images = [image(i & LOW, now) for i in ids]
    older = [m for m in images if m < since]
    return Scan(
        now=now,
        oldest_running=now if running is None else running,
        older=len(older),
        oldest_older=min(older) if older else None,
        younger=len(images) - len(older),
    )


def _taken(true_id: int, now: int, horizon: Horizon) -> bool:
    """The statements' condition for one row (sweep_queries._eligible), with the sweeper's
    refusal near the horizon."""
    since, until = (0, NO_HORIZON) if horizon.until is None else (horizon.since, horizon.until)
    remaining = left(horizon, now)
    if remaining is not None and remaining <= REFUSE_MARGIN:
        return False
    distance = (now - (true_id & LOW) - 1) % SPAN + 1
    return distance <= now - since and now < until


@given(st.integers(SPAN, 1 << 60), st.integers(1, SPAN))
def test_an_image_is_the_id_while_younger_than_2_32_and_never_below_it(now: int, age: int) -> None:
    true_id = now - age
    assert image(true_id & LOW, now) == true_id
    older = true_id - SPAN * 3
    assert image(older & LOW, now) >= older


@given(
    boundary=st.integers(SPAN * 2, 1 << 50),
    older_ages=st.lists(st.integers(1, SPAN - (1 << 20)), max_size=5),
    younger_after=st.lists(st.integers(0, 1 << 40), max_size=8),
    first_look=st.integers(0, 1 << 20),
    later=st.lists(st.integers(1, 1 << 34), min_size=1, max_size=6),
)
def test_an_older_row_is_never_taken_however_many_transactions_pass(
    boundary: int,
    older_ages: list[int],
    younger_after: list[int],
    first_look: int,
    later: list[int],
) -> None:
    """Rows older than the boundary (younger than 2^32 transactions at the first look), rows
    after it; the sweeper looks once, then at any later point takes no older row, and takes
    every younger one it sees while it has not refused the table."""
    now = boundary + first_look
    older = [boundary - age for age in older_ages]
    leaf = Leaf(1, "public.outbox", (), filenode=7, altered=(boundary - SPAN // 2) & LOW)
    decided = plan(leaf, None, boundary, now, None)
    assert isinstance(decided, Look)
    younger_now = [boundary + a for a in younger_after if boundary + a < now]
    horizon = settle(leaf, decided, boundary, _scan(older + younger_now, now, decided.since))
    assert isinstance(horizon, Horizon)
    assert (horizon.until is None) == (not older)
    for step in sorted(later):
        at = now + step
        younger = [boundary + a for a in younger_after if boundary + a < at]
        assert not any(_taken(i, at, horizon) for i in older)
        if horizon.until is None or at < horizon.until - REFUSE_MARGIN:
            assert all(_taken(i, at, horizon) for i in younger)


@given(
    boundary=st.integers(SPAN * 2, 1 << 50),
    age=st.integers(1, SPAN // 2),
    behind=st.integers(0, REFUSE_MARGIN - 1),
)
def test_a_look_within_the_horizon_settles_once_the_older_rows_are_gone(
    boundary: int, age: int, behind: int
) -> None:
    leaf = Leaf(1, "public.outbox", (), 7, 5)
    first = settle(
        leaf, Look(boundary, None), boundary, _scan([boundary - age], boundary, boundary)
    )
    assert isinstance(first, Horizon)
    assert first.until == boundary - age + SPAN
    at = first.until - 1 - behind  # refused now: within the margin
    assert not _taken(boundary + 1, at, first)
    again = plan(leaf, first, boundary, at, RESCAN_SECONDS)
    assert again == Look(boundary, first)
    settled = settle(leaf, again, boundary, _scan([boundary + 1], at, boundary))
    assert isinstance(settled, Horizon)
    assert settled.until is None
    assert _taken(boundary + 1, at + SPAN * 5, settled)
    # Past the horizon a look cannot be trusted: an older row may show a younger id by now.
    late = settle(leaf, Look(boundary, first), boundary, _scan([], first.until, boundary))
    assert isinstance(late, str)
    assert "2^32 transactions" in late


def test_a_transaction_older_than_the_boundary_still_running_keeps_it_open() -> None:
    leaf = Leaf(1, "public.outbox", (), 7, 5)
    boundary = 10 * SPAN
    found = settle(
        leaf, Look(boundary, None), boundary, _scan([], boundary + 3, boundary, boundary - 2)
    )
    assert isinstance(found, Horizon)
    assert found.until == boundary - 2 + SPAN


def test_a_late_first_look_is_refused_unless_no_row_could_be_mistaken() -> None:
    leaf = Leaf(1, "public.outbox", (), 7, 5)
    boundary = 10 * SPAN
    now = boundary + FIRST_LOOK_LIMIT
    refused = settle(leaf, Look(boundary, None), boundary, _scan([now - 5], now, boundary))
    assert isinstance(refused, str)
    assert "first looked" in refused
    empty = settle(leaf, Look(boundary, None), boundary, _scan([], now, boundary))
    assert isinstance(empty, Horizon)
    assert empty.until is None


def test_a_rewrite_moves_an_unsettled_boundary_past_it_and_an_attach_starts_afresh() -> None:
    boundary = 10 * SPAN
    now = boundary + 1000
    known = Horizon(boundary, (), 7, boundary, boundary - 5 + SPAN, 2)
    rewritten = Leaf(1, "public.outbox", (), 8, (now - 10) & LOW)
    assert plan(rewritten, known, boundary, now, 1.0) == Look(now - 9, known)
    settled = Horizon(boundary, (), 7, boundary, None, 0)
    # Nothing left to confuse, but looked at again (the same oid could be another table).
    assert plan(rewritten, settled, boundary, now, 1.0) == Look(boundary, settled)
    assert plan(Leaf(1, "public.outbox", (), 7, 5), settled, boundary, now, 1.0) == settled
    attached = Leaf(2, "public.outbox_p", ((now - 50) & LOW,), 7, (now - 50) & LOW)
    assert plan(attached, settled, boundary, now, 1.0) == Look(now - 49, None)
    unchanged = Leaf(1, "public.outbox", (), 7, (boundary - 100) & LOW)
    assert plan(unchanged, known, boundary + 1, now, 1.0) == Look(
        boundary + 1, None
    )  # another boundary


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(), st.lists))
def test_a_stored_value_that_is_not_a_horizon_is_none(value: object) -> None:
    assert from_json(value) is None
    assert from_json({"b": 1, "a": [value], "n": 2, "s": 3, "u": None, "o": 0}) is None or (
        type(value) is int
    )


def test_a_horizon_reads_back_as_it_was_kept() -> None:
    kept = Horizon(5 * SPAN, (17, 4), 16384, 5 * SPAN + 3, 6 * SPAN - 2, 12)
    assert from_json(kept.to_json()) == kept
    settled = Horizon(5 * SPAN, (), 16384, 5 * SPAN, None, 0)
    assert from_json(settled.to_json()) == settled
    assert from_json({**kept.to_json(), "u": "6"}) is None
    assert from_json({**kept.to_json(), "b": True}) is None
