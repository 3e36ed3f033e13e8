"""Whether the relay's position record can be this server's — before anything acts on it.

The record (``<state_schema>.slot_position``) is a row like any other: a restore can bring back
another cluster's, or an old one beside a new slot, and anyone with UPDATE on it can move it.
The relay starts streaming at the record when it is ahead of the slot, and the sweeper deletes
every row below it, so a record the server cannot have silently loses events twice over. Each
write of the record stamps it with the server it was written on (its system identifier and
timeline, :meth:`cdc_relay.checkpoint.PostgresCheckpointStore.save`); a record is refused when

- it is ahead of the server's WAL end (``pg_current_wal_insert_lsn()``; on a standby, what it
  received or replayed): no position the relay confirmed can be beyond the WAL;
- it was stamped with another system identifier: written by another cluster;
- it was stamped with a timeline that is not in the server's history, or on an earlier timeline
  beyond the point where the history left it: a position on a branch of the WAL this server
  never had.

A record written before the stamps existed (NULL) is judged by its position alone, and stamped
by the next write. ``pg_control_system()`` and the WAL functions are executable by PUBLIC (no
grant); the history (``TIMELINE_HISTORY``, a replication command) is read only when the stamp's
timeline is not the server's current one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import psycopg

from cdc_relay.config import sql_name
from cdc_relay.lsn import format_lsn, parse_lsn

Connection = psycopg.Connection[tuple[object, ...]]

# The server's identity and WAL end, by SQL. The current timeline is that of the WAL file the
# next insert goes to (its name's first 8 hex digits); in recovery, where pg_walfile_name is
# refused, it is unknown (NULL) and only the position and the system identifier are judged.
TIMELINE_SQL = "('x' || substr(pg_walfile_name(pg_current_wal_insert_lsn()), 1, 8))::bit(32)::int"
SERVER_SQL = (
    "(SELECT system_identifier::text FROM pg_control_system()), "
    f"CASE WHEN pg_is_in_recovery() THEN NULL ELSE {TIMELINE_SQL} END, "
    "CASE WHEN pg_is_in_recovery() THEN greatest(pg_last_wal_receive_lsn(), "
    "pg_last_wal_replay_lsn())::text ELSE pg_current_wal_insert_lsn()::text END"
)
# What a write of the record stamps it with (on a primary: the record is written there).
STAMP_SQL = f"(SELECT system_identifier::text FROM pg_control_system()), {TIMELINE_SQL}"


@dataclass(frozen=True)
class Server:
    """What the server says of itself."""

    system_identifier: str
    timeline: int | None  # None: in recovery
    wal_end: int | None  # None: a standby that has received and replayed nothing


@dataclass(frozen=True)
class Stamp:
    """A record's position and what it was stamped with (None: written before stamps)."""

    position: int
    system_identifier: str | None
    timeline: int | None


def server_from_row(values: tuple[object, ...]) -> Server:
    """A :class:`Server` from the three columns of :data:`SERVER_SQL`."""
    system_identifier, timeline, wal_end = values
    return Server(
        str(system_identifier),
        None if timeline is None else int(str(timeline)),
        None if wal_end is None else parse_lsn(str(wal_end)),
    )


def read_server(conn: Connection) -> Server:
    row = conn.execute(f"SELECT {SERVER_SQL}").fetchone()
    assert row is not None
    return server_from_row(tuple(row))


def history_switches(history: bytes) -> list[tuple[int, int]]:
    """The switches of a timeline history file (``<parent>\\t<lsn>\\t<reason>`` lines, possibly
    as bytea hex text): (parent timeline, where the history left it), oldest first. Lines that
    are not such a switch are skipped."""
    if history.startswith(b"\\x"):
        try:
            history = bytes.fromhex(history[2:].decode("ascii"))
        except ValueError:
            return []
    switches: list[tuple[int, int]] = []
    for line in history.decode("utf-8", "replace").splitlines():
        fields = line.strip().split()
        if len(fields) >= 2 and fields[0].isdigit() and len(fields[0]) <= 10:
            try:
                switches.append((int(fields[0]), parse_lsn(fields[1])))
            except ValueError:
                continue
    return switches


def problem(
    stamp: Stamp,
    server: Server,
    history: Callable[[int], list[tuple[int, int]]] | None,
) -> str | None:
    """Why the record cannot be this server's, or None when it can.

    ``history(timeline)``: the switches of that timeline's history file; None when it cannot be
    read (the sweeper, which has no replication connection): then a stamp of any other timeline
    than the current one is refused — the relay restamps the record at its next write.
    """
    position = format_lsn(stamp.position)
    if server.wal_end is not None and stamp.position > server.wal_end:
        return (
            f"it is at {position}, ahead of the server's WAL end {format_lsn(server.wal_end)}: "
            "no position the relay confirmed can be beyond the WAL"
        )
    if stamp.system_identifier is not None and stamp.system_identifier != server.system_identifier:
        return (
            f"it was written on the cluster with system identifier {stamp.system_identifier}, "
            f"and this server's is {server.system_identifier}"
        )
    return _timeline_problem(stamp, server, history)


def _timeline_problem(
    stamp: Stamp,
    server: Server,
    history: Callable[[int], list[tuple[int, int]]] | None,
) -> str | None:
    if stamp.timeline is None or server.timeline is None or stamp.timeline == server.timeline:
        return None
    if stamp.timeline > server.timeline:
        return (
            f"it was written on timeline {stamp.timeline}, and this server is on timeline "
            f"{server.timeline}: not in its history"
        )
    if history is None:
        return (
            f"it was written on timeline {stamp.timeline}, and this server is on timeline "
            f"{server.timeline} (the relay restamps it when it next records its position)"
        )
    left = dict(history(server.timeline)).get(stamp.timeline)
    if left is None:
        return (
            f"it was written on timeline {stamp.timeline}, which is not in the history of this "
            f"server's timeline {server.timeline}"
        )
    if stamp.position > left:
        return (
            f"it is at {format_lsn(stamp.position)} on timeline {stamp.timeline}, but this "
            "server's history left "
            f"that timeline at {format_lsn(left)}: a position on WAL this server never had"
        )
    return None


def refusal(reason: str, schema: str, slot_name: str, slot_confirmed: int | None) -> str:
    """The whole message: what is wrong, what it would cost, and the fix."""
    table = sql_name(schema, "slot_position")
    at_slot = (
        f"the slot's own position {format_lsn(slot_confirmed)}"
        if slot_confirmed is not None
        else "a new slot"
    )
    return (
        f"the relay's position record for slot {slot_name!r} ({table}) cannot be this "
        f"server's: {reason}. It was restored from another cluster or an older backup, carried "
        "over by pg_upgrade (a new cluster), or edited; streaming or sweeping from it would skip "
        "events and delete rows never published. The slot is left as it is. Find out where the "
        "record came from; to start "
        f"from {at_slot} instead and record it afresh, start the relay once with "
        f"CDC_RELAY_ALLOW_SLOT_RESET=true (or run DELETE FROM {table} WHERE slot_name = "
        f"'{slot_name.replace(chr(39), chr(39) * 2)}' as its owner)"
    )
