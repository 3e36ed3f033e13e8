"""Whether the slot is lost, and what an operator is told. Pure: the start
(:mod:`cdc_relay.start.sequence`), ``check`` and ``setup`` ask; :mod:`cdc_relay.recovery.run`
recovers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cdc_relay.lsn import format_lsn
from cdc_relay.recovery.plan import Cause, Plan, State, plan_from_json
from cdc_relay.replication.source import SlotState

if TYPE_CHECKING:
    from cdc_relay.checkpoint import Record

RECOVER = "cdc-relay recover"
ON_LOSS = "CDC_RELAY_ON_SLOT_LOSS=recover"
ACCEPT_GAP = "CDC_RELAY_ALLOW_SLOT_RESET=true (or --allow-slot-reset)"


def slot_loss(slot: SlotState | None, recorded: int | None) -> Cause | None:
    """Why the slot must be recovered: gone, or invalidated by the server, after the relay
    recorded a position from it (None: it is usable, or the relay never used it)."""
    if recorded is None:
        return None
    if slot is None:
        return Cause.DROPPED
    if invalidated(slot):
        return Cause.INVALIDATED
    return None


def invalidated(slot: SlotState) -> bool:
    """The server gave up WAL the slot needed (``wal_status = 'lost'``), or invalidated it for
    another reason (PostgreSQL 17+: ``invalidation_reason``): it can never stream again."""
    return slot.wal_status == "lost" or slot.invalidation is not None


def in_progress(recorded_plan: object) -> Plan | None:
    """The recorded recovery that has not ended (None: none)."""
    plan = plan_from_json(recorded_plan)
    return plan if plan is not None and plan.state is not State.DONE else None


def publication_gap(record: Record) -> Plan | None:
    """The recovery of the rows a publication change may have kept from the slot: those of
    transactions from the oldest one running at the last write that found the publication
    unchanged (``stamp_checked_xid``; else the sweep boundary) on, not proven published by the
    horizon recorded before the change (its snapshot, its end and the new boundary are written
    with the boundary, in one statement: :meth:`~cdc_relay.checkpoint.PostgresCheckpointStore.
    restart_sweep_boundary`). None: no recorded position to start from."""
    start = record.stamp_checked_xid if record.stamp_checked_xid is not None else None
    if start is None:
        start = record.sweep_from_xid
    if record.stamp is None or start is None:
        return None
    horizon = record.horizon
    if horizon is not None and horizon.boundary != record.sweep_from_xid:
        horizon = None
    return Plan(
        cause=Cause.PUBLICATION,
        state=State.PUBLISHING,
        boundary=start,
        lost_at=record.stamp.position,
        horizon=horizon,
    )


def what_happened(slot_name: str, cause: Cause, recorded: int, slot: SlotState | None) -> str:
    """The loss in words, for the refusal and the recovery's log."""
    if cause is Cause.DROPPED:
        return (
            f"replication slot {slot_name!r} is missing, but the relay had confirmed up to "
            f"{format_lsn(recorded)}: it was dropped after the relay used it"
        )
    reason = slot.invalidation if slot is not None and slot.invalidation else None
    why = (
        f"invalidation_reason {reason}"
        if reason
        else "its WAL was removed: it retained more than max_slot_wal_keep_size"
    )
    return (
        f"replication slot {slot_name!r} was invalidated by the server ({why}; wal_status "
        f"{slot.wal_status if slot is not None else 'unknown'}), the relay having confirmed up "
        f"to {format_lsn(recorded)}: it can never stream again"
    )


def refusal(slot_name: str, cause: Cause, recorded: int, slot: SlotState | None) -> str:
    """Why the relay will not start, and the two ways on (exit code 4)."""
    return (
        f"{what_happened(slot_name, cause, recorded, slot)}. No new slot is created over that "
        "gap (the relay refuses to start, exit code 4), but the events committed since it last "
        "streamed are still in the outbox table (the sweeper never deletes an unpublished row). "
        f"Recover them: run `{RECOVER}` once (a new slot; every row the relay has not provably "
        f"published is published, in commit order, none twice), or start the relay with "
        f"{ON_LOSS} to do the same at its start. Or accept the gap: start once with {ACCEPT_GAP}"
    )


def interrupted(slot_name: str, plan: Plan) -> str:
    """A recovery began and has not ended: the relay will not stream before it has."""
    return (
        f"a recovery of replication slot {slot_name!r} began and has not ended ({plan.done} of "
        f"{plan.rows} rows done): run `{RECOVER}` to finish it, or start the relay with {ON_LOSS}"
    )
