"""A recovery's writes to the position record: its plan as it goes, and its end. SQL only through
``psycopg.sql``; every write is fenced by the leader lease, as the position's own
(:meth:`cdc_relay.checkpoint.PostgresCheckpointStore.save`): a relay that no longer leads writes
nothing and stops with :class:`~cdc_relay.errors.LeadershipLost`.

Until its end a recovery leaves the recorded position, boundary, offsets and horizon as they
were before the loss: a sweeper (the relay's, or ``cdc-relay sweep`` beside it, of any version)
deletes only rows that position covers, all published before the loss. The end is one statement:
the new slot's start as the position, the recovery's acknowledged offsets, and a horizon that
proves what the recovery owed (:func:`horizon_after`).
"""

from __future__ import annotations

import psycopg
from psycopg import sql

from cdc_relay.checkpoint import LEASE_TABLE, STATE_TABLE, fenced
from cdc_relay.errors import PositionMismatch
from cdc_relay.lsn import format_lsn
from cdc_relay.postgres_errors import During, mapped
from cdc_relay.reconcile import Offsets, encode_offsets
from cdc_relay.recovery.horizon import Horizon, horizon_from_json
from cdc_relay.recovery.plan import Plan
from cdc_relay.waits import POSITION_MEANS, Watched, unwatched

Connection = psycopg.Connection[tuple[object, ...]]


def horizon_after(plan: Plan, earlier: dict[tuple[str, int], int]) -> Horizon:
    """What the record proves once ``plan`` is done: every owed row was published, so the rows its
    snapshot sees below its ``xmin``; any other one is read back from where the rows in doubt
    were (``earlier``: the starts of this recovery's read-back of earlier records) or where the
    recovery wrote (its notes), whichever is lower; the stream's records come after both."""
    assert plan.snapshot is not None
    starts = dict(plan.noted)
    for key, offset in earlier.items():
        if offset >= 0:
            starts[key] = min(offset, starts.get(key, offset))
    return Horizon(plan.boundary, plan.snapshot, {}, starts, plan.slot_lsn)


class RecoveryRecord:
    """The ``recovery`` column of one slot's position record, on an autocommit connection."""

    def __init__(
        self,
        conn: Connection,
        schema: str,
        slot: str,
        holder: str | None,
        watched: Watched = unwatched,
    ) -> None:
        self._conn = conn
        self._watched = watched
        self._table = sql.Identifier(schema, STATE_TABLE)
        self._lease = sql.Identifier(schema, LEASE_TABLE)
        self._slot = slot
        self._holder = holder

    def begin(self, plan: Plan) -> None:
        """Keep ``plan`` in a record of its own: adopting a table at the first start, when
        there is none yet. Its position (0/0) and missing sweep boundary cover no row: no sweeper
        deletes anything on it."""
        lease = (
            sql.SQL(
                "FROM (SELECT 1 FROM {} WHERE slot_name = %s AND holder = %s FOR UPDATE) lease"
            ).format(self._lease)
            if self._holder is not None
            else sql.SQL("")
        )
        leased = (self._slot, self._holder) if self._holder is not None else ()
        query = sql.SQL(
            "INSERT INTO {} (slot_name, confirmed_lsn, recovery) SELECT %s, '0/0', %s::jsonb {} "
            "ON CONFLICT (slot_name) DO UPDATE SET recovery = EXCLUDED.recovery"
        ).format(self._table, lease)
        with (
            mapped(During.STATEMENT, "cannot record the adoption"),
            self._watched("recording the adoption's plan", POSITION_MEANS),
        ):
            cursor = self._conn.execute(query, (self._slot, plan.text, *leased))
        if self._holder is not None:
            fenced(cursor.rowcount, "the adoption was not recorded")

    def write(self, plan: Plan) -> None:
        """Keep ``plan`` (its state and progress)."""
        self._update(sql.SQL("recovery = %s::jsonb"), (plan.text,), "the recovery's progress")

    def finish(self, plan: Plan, offsets: Offsets, horizon: Horizon | None) -> None:
        """The end: the new slot's start is the position, ``offsets`` (acknowledged at the
        recovery's last record) the offsets, ``horizon`` what the record proves (None: nothing
        yet, an adoption's), and ``plan`` kept as done."""
        self._update(
            sql.SQL(
                "confirmed_lsn = %s::pg_lsn, acked_offsets = %s::jsonb, written_from = NULL, "
                "recovery_horizon = %s::jsonb, recovery = %s::jsonb, updated_at = now()"
            ),
            (
                format_lsn(plan.slot_lsn),
                encode_offsets(offsets).decode(),
                None if horizon is None else horizon.text,
                plan.text,
            ),
            "the recovery's end",
        )

    def horizon(self) -> Horizon | None:
        row = self._conn.execute(
            sql.SQL("SELECT recovery_horizon::text FROM {} WHERE slot_name = %s").format(
                self._table
            ),
            (self._slot,),
        ).fetchone()
        return None if row is None else horizon_from_json(row[0])

    def _update(self, changes: sql.Composable, params: tuple[object, ...], what: str) -> None:
        lease = (
            sql.SQL(
                "AND EXISTS (SELECT 1 FROM {} WHERE slot_name = %s AND holder = %s FOR UPDATE)"
            ).format(self._lease)
            if self._holder is not None
            else sql.SQL("")
        )
        leased = (self._slot, self._holder) if self._holder is not None else ()
        query = sql.SQL("UPDATE {} SET {} WHERE slot_name = %s {}").format(
            self._table, changes, lease
        )
        with (
            mapped(During.STATEMENT, f"cannot record {what}"),
            self._watched(f"recording {what}", POSITION_MEANS),
        ):
            cursor = self._conn.execute(query, (*params, self._slot, *leased))
        if cursor.rowcount != 1:
            if self._holder is not None:
                fenced(cursor.rowcount, f"{what} was not recorded")
            raise PositionMismatch(f"the position record is gone: {what} was not recorded")
