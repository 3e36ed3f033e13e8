"""``python -m cdc_relay status``: where the relay stands, from the database and the running relay.

The database side (slot, recorded position, what it proves published and the last recovery of a
lost slot, retained WAL, which relay holds the leader lease and every relay of the slot it can
see: the leader and its standbys, by their leadership connections) is read directly; the live
numbers (events published since start, in flight, lag) come from the running relay's
``/status`` endpoint — the same counters ``/metrics`` exports.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from typing import Any

import orjson
import psycopg
from psycopg import sql

from cdc_relay.checkpoint import LEASE_TABLE, STATE_TABLE
from cdc_relay.commands.output import printable
from cdc_relay.config import Settings
from cdc_relay.errors import SourceError
from cdc_relay.exit_codes import ExitCode
from cdc_relay.leadership import application_name
from cdc_relay.recovery.horizon import horizon_from_json
from cdc_relay.recovery.plan import plan_from_json
from cdc_relay.replication.source import connect

STATUS_TIMEOUT = 3.0  # seconds for the whole /status answer
STATUS_MAX_BYTES = 1 << 20  # a real answer is a few hundred bytes


def database_status(settings: Settings) -> dict[str, Any]:
    with connect(settings.source_url()) as conn:
        slot = conn.execute(
            "SELECT active_pid, confirmed_flush_lsn::text, wal_status, "
            "pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint, "
            "pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint "
            "FROM pg_replication_slots WHERE slot_name = %s",
            (settings.slot_name,),
        ).fetchone()
        result: dict[str, Any] = {"slot": settings.slot_name, "slot_exists": slot is not None}
        if slot is not None:
            pid, confirmed, wal_status, retained, behind = slot
            result |= {
                "slot_active_pid": pid,
                "confirmed_lsn": confirmed,
                "wal_status": wal_status,
                "retained_wal_bytes": retained,
                "unconfirmed_wal_bytes": behind,
            }
        try:
            row = conn.execute(
                sql.SQL(
                    "SELECT confirmed_lsn::text, updated_at FROM {} WHERE slot_name = %s"
                ).format(sql.Identifier(settings.state_schema, STATE_TABLE)),
                (settings.slot_name,),
            ).fetchone()
        except psycopg.errors.UndefinedTable:
            row = None
        result["recorded_lsn"] = row[0] if row else None
        result["recorded_at"] = str(row[1]) if row else None
        result |= _recovery(conn, settings)
        result |= _lease(conn, settings)
    return result


def _recovery(conn: psycopg.Connection[tuple[object, ...]], settings: Settings) -> dict[str, Any]:
    """What the record proves published (:mod:`cdc_relay.recovery.horizon`), and the last
    recovery of the slot, running or ended (rows, seconds)."""
    try:
        row = conn.execute(
            sql.SQL(
                "SELECT recovery_horizon::text, recovery::text FROM {} WHERE slot_name = %s"
            ).format(sql.Identifier(settings.state_schema, STATE_TABLE)),
            (settings.slot_name,),
        ).fetchone()
    except (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn):
        return {}
    if row is None:
        return {}
    horizon, recorded_plan = horizon_from_json(row[0]), plan_from_json(row[1])
    result: dict[str, Any] = {
        "published_below_xid": None if horizon is None else horizon.snapshot.xmin
    }
    if recorded_plan is not None:
        result |= {f"recovery_{key}": value for key, value in recorded_plan.summary().items()}
    return result


def _lease(conn: psycopg.Connection[tuple[object, ...]], settings: Settings) -> dict[str, Any]:
    """Who leads for the slot (:mod:`cdc_relay.leadership`): holder, and whether its lease holds."""
    try:
        row = conn.execute(
            sql.SQL(
                "SELECT l.holder, l.renewed_at, l.expires_at, l.expires_at > now(), "
                "l.stream_pid, a.backend_start FROM {} l "
                "LEFT JOIN pg_stat_activity a ON a.pid = l.stream_pid WHERE l.slot_name = %s"
            ).format(sql.Identifier(settings.state_schema, LEASE_TABLE)),
            (settings.slot_name,),
        ).fetchone()
    except psycopg.errors.UndefinedTable:
        row = None
    result: dict[str, Any] = {"leader": None}
    if row is not None:
        holder, renewed, expires, current, stream_pid, streaming_since = row
        result = {
            "leader": holder,
            "leader_renewed_at": str(renewed),
            "leader_lease_expires_at": str(expires),
            "leader_lease_current": current,
            "leader_stream_pid": stream_pid,
            "leader_streaming_since": str(streaming_since) if streaming_since else None,
        }
    return result | _relays(conn, settings)


def _relays(conn: psycopg.Connection[tuple[object, ...]], settings: Settings) -> dict[str, Any]:
    """Every relay of the slot this role can see, by its leadership connection (a relay keeps
    one open, leading or standing by): the one whose lock connection the lease names leads.

    ``application_name`` is whatever a client says it is: any role that may connect here could
    pose as a standby, so this is what the server shows, not proof."""
    lease = sql.Identifier(settings.state_schema, LEASE_TABLE)
    query = sql.SQL(
        "SELECT a.pid, a.pid = l.lock_pid AND l.expires_at > now(), a.usename, "
        "a.client_addr::text, a.backend_start FROM pg_stat_activity a "
        "LEFT JOIN {} l ON l.slot_name = %s "
        "WHERE a.datname = current_database() AND a.application_name = %s "
        "ORDER BY 2 DESC, a.backend_start, a.pid"
    ).format(lease)
    try:
        rows = conn.execute(query, (settings.slot_name, application_name(settings.slot_name)))
    except psycopg.errors.UndefinedTable:
        return {"relays_seen": 0}
    found: dict[str, Any] = {}
    for number, (pid, leads, user, client, since) in enumerate(rows.fetchall(), start=1):
        role = "leader" if leads else "standby"
        where = f" from {client}" if client else ""
        found[f"relay_session.{number}"] = (
            f"{role}: pid {pid}, user {user}{where}, connected since {since}"
        )
    return {"relays_seen": len(found), **found}


def relay_status(port: int, host: str = "127.0.0.1") -> dict[str, Any] | None:
    """The running relay's live counters, or None when it does not answer."""
    if not port:
        return None
    deadline = time.monotonic() + STATUS_TIMEOUT
    body = bytearray()
    try:
        # Whatever answers on that port is read for a bounded time and size: a process that
        # is not the relay may send an endless or slow answer.
        url = f"http://{host}:{port}/status"
        with urllib.request.urlopen(url, timeout=STATUS_TIMEOUT) as response:
            while len(body) <= STATUS_MAX_BYTES and time.monotonic() < deadline:
                chunk = response.read1(65536)
                if not chunk:
                    break
                body += chunk
            else:
                return None
        data = orjson.loads(body)
    except (urllib.error.URLError, OSError, orjson.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def main(settings: Settings, relay_host: str = "127.0.0.1") -> int:
    try:
        database = database_status(settings)
    except SourceError as exc:
        print(f"database: {printable(exc)}")
        return exc.exit_code
    # Every value (and the keys of /status, which any process on that port may answer) is
    # printed escaped: a lease holder or a role name may hold newlines and terminal escapes.
    for key, value in database.items():
        print(f"{key}: {printable(value)}")
    live = relay_status(settings.http_port, relay_host)
    if live is None:
        print(f"relay: not answering on port {settings.http_port} (not running, or elsewhere)")
    else:
        for key, value in live.items():
            print(f"relay.{printable(key, 100)}: {printable(value)}")
    return ExitCode.OK if database["slot_exists"] else ExitCode.FAILED
