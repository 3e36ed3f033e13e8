"""The relay's own record of its confirmed position, and the rules that compare it with the slot.

The slot's ``confirmed_flush_lsn`` is the resume point. The record, kept in a small table in the
source database, exists to catch the slot being dropped, recreated or advanced behind the relay's
back — which would otherwise skip events silently. The record is always written *before* the same
position is confirmed to the server, so for the relay's own slot ``confirmed_flush <= record``
holds at all times (it can be lower: a crash between the two steps, or a PostgreSQL crash, which
loses an unflushed confirmation). A slot *ahead* of the record, or a missing one, means events
may never have been relayed.
"""

from __future__ import annotations

from typing import Protocol

import psycopg
from psycopg import sql

from cdc_relay.errors import PositionMismatch, SourceSetupError, SourceUnavailable
from cdc_relay.lsn import format_lsn, parse_lsn

STATE_TABLE = "slot_position"

_OVERRIDE = "CDC_RELAY_ALLOW_SLOT_RESET=true (or --allow-slot-reset)"


class CheckpointStore(Protocol):
    """Where the relay records the position it confirmed."""

    def load(self) -> int | None: ...

    def save(self, lsn: int) -> None: ...


class PostgresCheckpointStore:
    """One row per slot in ``<state_schema>.slot_position`` of the source database."""

    def __init__(
        self, conn: psycopg.Connection[tuple[object, ...]], schema: str, slot_name: str
    ) -> None:
        self._conn = conn
        self._table = sql.Identifier(schema, STATE_TABLE)
        self._schema = schema
        self._slot = slot_name

    def ensure_table(self) -> None:
        statements = [
            sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(self._schema)),
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {} (slot_name text PRIMARY KEY, "
                "confirmed_lsn pg_lsn NOT NULL, updated_at timestamptz NOT NULL DEFAULT now())"
            ).format(self._table),
            sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS sweep_from_xid xid8").format(
                self._table
            ),
        ]
        try:
            for statement in statements:
                self._conn.execute(statement)
        except psycopg.errors.InsufficientPrivilege as exc:
            raise SourceSetupError(
                f"cannot create the relay's state table {self._schema}.{STATE_TABLE}: "
                f"{exc.diag.message_primary}. Run sql/002_cdc_relay_state.sql as an "
                "owner, or set CDC_RELAY_STATE_SCHEMA to a schema this user may write"
            ) from None

    def load(self) -> int | None:
        query = sql.SQL("SELECT confirmed_lsn::text FROM {} WHERE slot_name = %s").format(
            self._table
        )
        row = self._run(query, (self._slot,)).fetchone()
        return parse_lsn(str(row[0])) if row else None

    def save(self, lsn: int, new_slot: bool = False) -> None:
        """Record ``lsn``. With ``new_slot`` (the slot was just created) the sweep boundary is
        set afresh; otherwise it is set only when missing."""
        query = sql.SQL(
            "INSERT INTO {} AS p (slot_name, confirmed_lsn, sweep_from_xid) "
            "VALUES (%s, %s::pg_lsn, pg_snapshot_xmax(pg_current_snapshot())) "
            "ON CONFLICT (slot_name) DO UPDATE SET confirmed_lsn = EXCLUDED.confirmed_lsn, "
            "updated_at = now(), sweep_from_xid = CASE WHEN %s THEN EXCLUDED.sweep_from_xid "
            "ELSE coalesce(p.sweep_from_xid, EXCLUDED.sweep_from_xid) END"
        ).format(self._table)
        self._run(query, (self._slot, format_lsn(lsn), new_slot))

    def load_sweep_boundary(self) -> int | None:
        """The first transaction id whose outbox rows the slot is sure to have streamed.

        Taken when the slot was created (or first adopted): creating a logical slot waits for
        the transactions running then, so any transaction id assigned afterwards commits after
        the slot's consistent point and is decoded. Rows of older transactions — those that
        predate the slot — may never have been published, and the sweeper leaves them alone.
        """
        query = sql.SQL("SELECT sweep_from_xid::text FROM {} WHERE slot_name = %s").format(
            self._table
        )
        row = self._run(query, (self._slot,)).fetchone()
        return int(str(row[0])) if row and row[0] is not None else None

    def _run(
        self, query: sql.Composed, params: tuple[object, ...]
    ) -> psycopg.Cursor[tuple[object, ...]]:
        try:
            return self._conn.execute(query, params)
        except psycopg.OperationalError as exc:
            raise SourceUnavailable(f"cannot record the position: {exc}") from None


def check_missing_slot(slot_name: str, recorded: int | None, allow_reset: bool) -> str | None:
    """The slot does not exist. Creating it is fine on first run; otherwise events may be lost.

    Returns a warning to log when the override lets the relay go on, None when all is well.
    """
    if recorded is None:
        return None
    gap = (
        f"replication slot {slot_name!r} is missing, but the relay had confirmed up to "
        f"{format_lsn(recorded)}: events committed after that and before a new slot would be "
        "skipped"
    )
    if not allow_reset:
        raise PositionMismatch(
            f"{gap}. Refusing to start. If you accept that gap (or re-publish those events "
            f"yourself), start once with {_OVERRIDE}"
        )
    return f"{gap}; starting anyway because slot reset is allowed"


def resolve_start(
    slot_name: str, slot_confirmed: int, recorded: int | None, allow_reset: bool
) -> tuple[int, str | None]:
    """Where to start streaming an existing slot, and a warning to log (or None).

    ``recorded`` may be ahead of the slot (see module doc): starting at the record skips only
    transactions Kafka already acknowledged. A slot ahead of the record was recreated or advanced by
    someone else, and the events between the two may never have reached Kafka.
    """
    if recorded is None or slot_confirmed == recorded:
        return slot_confirmed, None
    if slot_confirmed < recorded:
        return recorded, None
    gap = (
        f"replication slot {slot_name!r} is at {format_lsn(slot_confirmed)}, ahead of the "
        f"relay's recorded position {format_lsn(recorded)}: it was recreated or advanced outside "
        "the relay, so events in between may never have been published"
    )
    if not allow_reset:
        raise PositionMismatch(
            f"{gap}. Refusing to start. To accept the gap, start with {_OVERRIDE}"
        )
    return slot_confirmed, f"{gap}; starting anyway because slot reset is allowed"
