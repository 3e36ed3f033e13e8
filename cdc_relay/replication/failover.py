"""Failover slots (PostgreSQL 17+): a slot that survives the promotion of a standby.

A logical slot lives on one server. On PostgreSQL 17 and newer it can be created with
``failover = true``; a physical standby with ``sync_replication_slots = on`` then keeps a copy
(``synced = true``), and after a promotion the relay — reconnecting through a multi-host URL with
``target_session_attrs=read-write`` — streams the copy from where it was confirmed. On older
servers the slot is simply missing on the new primary, and :mod:`cdc_relay.checkpoint` refuses to
start over the gap (exit 4), as before.

This module decides whether the relay's slot should be a failover slot
(``CDC_RELAY_SLOT_FAILOVER``), makes an existing one so, reports what ``check`` says about it, and
tells :mod:`cdc_relay.checkpoint` when a slot ahead of the record is the expected trace of a
promotion rather than a gap (:func:`promoted_slot`).
"""

from __future__ import annotations

import logging

from cdc_relay.config import Settings, SlotFailover
from cdc_relay.errors import SourceSetupError
from cdc_relay.lsn import format_lsn
from cdc_relay.replication.source import FAILOVER_SERVER_VERSION, Connection, SlotState, scalar
from cdc_relay.replication.stream import enable_failover, timeline_start

log = logging.getLogger(__name__)

_SETTING = "CDC_RELAY_SLOT_FAILOVER"


def _version(conn: Connection) -> str:
    return str(scalar(conn, "SHOW server_version")).split()[0]


def wants_failover(conn: Connection, settings: Settings) -> bool:
    """Whether the relay's slot should be a failover slot on this server.

    Raises SourceSetupError (exit 3) for ``true`` on a server older than 17."""
    choice = settings.slot_failover
    if choice is SlotFailover.FALSE:
        return False
    if conn.info.server_version >= FAILOVER_SERVER_VERSION:
        return True
    if choice is SlotFailover.TRUE:
        raise SourceSetupError(
            f"{_SETTING}=true, but PostgreSQL {_version(conn)} has no failover slots (they came "
            f"with PostgreSQL 17): upgrade the server, or set {_SETTING}=auto (a failover then "
            "makes the relay refuse to start, exit 4, until you decide about the gap)"
        )
    return False


def ensure_failover(conn: Connection, settings: Settings, slot: SlotState) -> bool:
    """Make the existing, idle slot a failover slot when the setting wants one; True if changed."""
    if slot.failover is not False or not wants_failover(conn, settings):
        return False
    enable_failover(settings.source_url(), slot.name)
    log.info("made the replication slot a failover slot", extra={"fields": {"slot": slot.name}})
    return True


def promotion_note(
    conn: Connection, settings: Settings, slot: SlotState, recorded: int | None
) -> str | None:
    """For a slot ahead of the record (:func:`cdc_relay.checkpoint.resolve_start`): the line to
    log when that is the trace of a promotion (:func:`promoted_slot`), None when it is not."""
    confirmed = slot.confirmed_flush or 0
    if recorded is None or confirmed <= recorded or not promoted_slot(conn, settings, slot):
        return None
    return (
        f"replication slot {slot.name!r} was synchronised from the former primary and is at "
        f"{format_lsn(confirmed)}, ahead of the relay's record {format_lsn(recorded)}, whose last "
        "write had not reached this server when it was promoted; starting at the slot, which the "
        "relay confirmed only after recording it and after Kafka acknowledged everything before it"
    )


def promoted_slot(conn: Connection, settings: Settings, slot: SlotState) -> bool:
    """The slot is a copy synchronised from a former primary, at a position from before this
    server's promotion — so a record behind it is only the record's replication lag.

    Why that is safe: on the old primary the relay confirms a position to the slot only after it
    recorded that position and Kafka acknowledged everything below it. The standby copies the
    slot's position once it has flushed the WAL up to it (and, with
    ``synchronized_standby_slots``, the relay never even received WAL the standby lacked); the
    record, an ordinary row, reaches the standby by physical replication, which may not yet have
    brought its latest write when the standby was promoted. A position at or before the switch
    point of this server's timeline was reached on the old primary; one after it was not, and the
    ordinary rule (refuse) applies.
    """
    if not slot.synced or slot.confirmed_flush is None:
        return False
    if scalar(conn, "SELECT pg_is_in_recovery()") is not False:
        return False
    switch = timeline_start(settings.source_url())
    return switch is not None and slot.confirmed_flush <= switch


def describe(conn: Connection, settings: Settings, slot: SlotState | None) -> str:
    """``check``'s line: failover slot or not, and whether standbys are held back for it."""
    name = settings.slot_name
    if not wants_failover(conn, settings):
        if settings.slot_failover is SlotFailover.FALSE:
            return (
                f"off ({_SETTING}=false): after a standby's promotion {name} is missing there, and "
                "the relay refuses to start until you decide (exit 4)"
            )
        return (
            f"PostgreSQL {_version(conn)} has no failover slots (17+): after a standby's "
            f"promotion {name} is missing there, and the relay refuses to start until you decide "
            "(exit 4)"
        )
    if slot is None:
        state = f"{name} will be created as a failover slot"
    elif slot.failover:
        state = f"{name} is a failover slot"
    else:
        state = (
            f"{name} is not a failover slot yet: the relay's next start makes it one "
            f"(ALTER_REPLICATION_SLOT {name} (FAILOVER true), on a replication connection)"
        )
    return f"{state}; {_standby_slots(conn)}"


def _standby_slots(conn: Connection) -> str:
    value = str(scalar(conn, "SHOW synchronized_standby_slots") or "").strip()
    fix = (
        "ALTER SYSTEM SET synchronized_standby_slots = '<the standby's physical slot>'; "
        "SELECT pg_reload_conf()"
    )
    if not value:
        return (
            "warning: synchronized_standby_slots is empty, so a standby may be behind what the "
            "relay has read: after its promotion the slot there may be missing or ahead of its "
            f"data. With a standby, run {fix} (without one, nothing to do)"
        )
    names = [n.strip().strip('"') for n in value.split(",") if n.strip()]
    rows = conn.execute(
        "SELECT slot_name, slot_type FROM pg_replication_slots WHERE slot_name = ANY(%s)",
        (names,),
    ).fetchall()
    physical = {str(n) for n, kind in rows if kind == "physical"}
    odd = [n for n in names if n not in physical]
    if odd:
        return (
            f"warning: synchronized_standby_slots names {', '.join(odd)}, which is not a "
            f"physical slot here: the relay's walsender waits for it in vain; run {fix}"
        )
    return f"synchronized_standby_slots = {value} (the standby is never behind the relay)"
