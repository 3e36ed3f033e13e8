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

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import orjson
import psycopg
from psycopg import sql

from cdc_relay.config import sql_name
from cdc_relay.ddl import ROLE_SQL, STATE_SQL, state_table_ddl
from cdc_relay.errors import (
    LeadershipLost,
    PositionMismatch,
    RelayError,
    SourceSetupError,
)
from cdc_relay.lsn import format_lsn, parse_lsn
from cdc_relay.postgres_errors import During, error_for
from cdc_relay.publication_stamp import PublicationStamp, StampQuery, change_error
from cdc_relay.reconcile import Offsets, decode_offsets, encode_offsets
from cdc_relay.record_origin import SERVER_SQL, STAMP_SQL, Server, Stamp, server_from_row
from cdc_relay.recovery.horizon import Fence, Horizon, HorizonTracker, Snapshot, horizon_from_json
from cdc_relay.recovery.loss import refusal as loss_refusal
from cdc_relay.recovery.loss import what_happened
from cdc_relay.recovery.plan import Cause, Plan
from cdc_relay.waits import POSITION_MEANS, STATE_DDL_MEANS, Watched, unwatched

STATE_TABLE = "slot_position"
LEASE_TABLE = "leader_lease"  # which relay leads (cdc_relay.leadership)
STATE_COLUMNS = {
    STATE_TABLE: (
        "slot_name",
        "confirmed_lsn",
        "updated_at",
        "sweep_from_xid",
        "acked_offsets",
        "written_from",
        "system_identifier",
        "timeline_id",
        "row_filters",
        "publication_stamp",
        "stamp_checked_xid",
        "sweep_horizons",
        "recovery_horizon",
        "recovery",
    ),
    LEASE_TABLE: ("slot_name", "holder", "lock_pid", "stream_pid", "renewed_at", "expires_at"),
}
STATE_PRIVILEGES = ("SELECT", "INSERT", "UPDATE")
# Another relay (or setup) created the state tables between this one's look and its own CREATE:
# the catalog's unique index refuses the second; the file, run again, finds them there.
_CREATED_MEANWHILE = (
    psycopg.errors.UniqueViolation,
    psycopg.errors.DuplicateSchema,
    psycopg.errors.DuplicateTable,
    psycopg.errors.DuplicateObject,
)
DDL_ATTEMPTS = 3

_OVERRIDE = "CDC_RELAY_ALLOW_SLOT_RESET=true (or --allow-slot-reset)"
# Written with the publication's stamp: the oldest transaction running at that check. Rows of
# later transactions may have been decoded after a change the next check finds.
CHECKED_XID = "pg_snapshot_xmin(pg_current_snapshot())"

# What each write of the position returns: its fence (cdc_relay.recovery.horizon) and the record.
_FENCE_SQL = (
    "pg_current_snapshot()::text, pg_current_wal_insert_lsn()::text, pg_current_xact_id()::text, "
    "p.sweep_from_xid::text, p.acked_offsets::text, p.written_from::text, "
    "p.recovery_horizon::text"
)
_NEXT_XID = "pg_snapshot_xmax(pg_current_snapshot())"  # a boundary taken in a statement
_NOTHING_RETURNED = sql.SQL("1")


def _new_slot_horizon(boundary: str, position: str) -> str:
    """The horizon of a new slot's boundary (SQL, braces doubled for ``sql.SQL.format``): nothing
    proven, and every record of a row of it still to come (no offsets).

    Exact only there: creating the slot waited for every transaction running, so none at or after
    the boundary committed before the slot's start. A boundary restarted under a running relay
    (a row filter or the publication changed) gets none (NULL): a transaction may then be waiting
    for a synchronous standby with its commit already streamed, and its id above the boundary;
    the relay's next writes take the first horizon from their own fences."""
    return (
        f"jsonb_build_object('boundary', ({boundary})::text, 'snapshot', ({boundary})::text "
        f"|| ':' || ({boundary})::text || ':', 'offsets', '{{{{}}}}'::jsonb, "
        f"'noted', '{{{{}}}}'::jsonb, 'position', ({position})::text)"
    )


def fence_from_row(row: tuple[object, ...], position: int) -> tuple[Fence, Horizon | None]:
    """A write's fence and the horizon it left, from its :data:`_FENCE_SQL` columns."""
    snapshot, insert_lsn, xid, boundary, offsets, noted, horizon = row
    parsed = Snapshot.parse(str(snapshot))
    assert parsed is not None  # PostgreSQL's own text
    fence = Fence(
        boundary=int(str(boundary)) if boundary is not None else 0,
        snapshot=parsed,
        insert_lsn=parse_lsn(str(insert_lsn)),
        xid=int(str(xid)),
        position=position,
        offsets=decode_offsets(offsets) or {},
        noted=decode_offsets(noted) or {},
    )
    return fence, horizon_from_json(horizon)


def fenced(rowcount: int, outcome: str) -> None:
    """A write fenced by the lease (it names this holder, or the statement writes nothing) wrote
    nothing: another relay leads now. The one place that cause ends a leadership."""
    if rowcount != 1:
        raise LeadershipLost(f"another relay holds the leader lease: {outcome}")


@dataclass(frozen=True)
class StateTable:
    """The state table as this role finds it (see :meth:`PostgresCheckpointStore.inspect`)."""

    name: str
    exists: bool
    missing_columns: tuple[str, ...]  # of a table that exists
    lacking_privileges: tuple[str, ...]  # USAGE (on the schema), SELECT, INSERT, UPDATE
    may_create: bool  # this role may run sql/002_cdc_relay_state.sql

    def grant_hint(self, user: str) -> str:
        grants = []
        if "USAGE" in self.lacking_privileges:
            grants.append(f"GRANT USAGE ON SCHEMA {sql_name(self.schema)} TO {user}")
        table = [p for p in self.lacking_privileges if p != "USAGE"]
        if table:
            grants.append(f"GRANT {', '.join(table)} ON {self.sql_name} TO {user}")
        return f"{user} may not use the relay's state table {self.name}: run {'; '.join(grants)}"

    def create_hint(self, user: str) -> str:
        what = (
            f"lacks column(s) {', '.join(self.missing_columns)}"
            if self.exists
            else "does not exist"
        )
        return (
            f"the relay's state table {self.name} {what}, and {user} may not create it: run "
            f"sql/{STATE_SQL} as an owner (or python -m cdc_relay setup as one), then GRANT "
            f"USAGE ON SCHEMA {sql_name(self.schema)} TO {user}; GRANT SELECT, INSERT, UPDATE "
            f"ON {self.sql_name} TO {user} (sql/{ROLE_SQL}); or set CDC_RELAY_STATE_SCHEMA to "
            f"a schema {user} may create tables in"
        )

    @property
    def schema(self) -> str:
        return self.name.rsplit(".", 1)[0]

    @property
    def sql_name(self) -> str:
        return sql_name(self.schema, self.name.rsplit(".", 1)[1])


@dataclass(frozen=True)
class Record:
    """The position record as one statement read it, with the server it was read on."""

    stamp: Stamp | None  # None: no record for this slot
    sweep_from_xid: int | None
    row_filters: object  # as stored (JSON); judged by cdc_relay.relayed_filters
    server: Server
    publication_stamp: object = None  # as stored (JSON); see cdc_relay.publication_stamp
    stamp_checked_xid: int | None = None  # the oldest transaction running at its last check
    updated_at: str | None = None  # when the position was last written
    horizon: Horizon | None = None  # what the record proves published (cdc_relay.recovery)
    recovery: object = None  # a recovery's plan and progress, as stored (JSON)


class CheckpointStore(Protocol):
    """Where the relay records the position it confirmed."""

    def load(self) -> int | None: ...

    def save(self, lsn: int, offsets: Mapping[tuple[str, int], int] | None = None) -> None: ...


class PostgresCheckpointStore:
    """One row per slot in ``<state_schema>.slot_position`` of the source database."""

    def __init__(
        self,
        conn: psycopg.Connection[tuple[object, ...]],
        schema: str,
        slot_name: str,
        holder: str | None = None,
        watched: Watched = unwatched,
    ) -> None:
        self._conn = conn
        # Its statements, watched: a wait on a lock is named, and ends (cdc_relay.waits).
        self._watched = watched
        self._table = sql.Identifier(schema, STATE_TABLE)
        self._lease = sql.Identifier(schema, LEASE_TABLE)
        self._schema = schema
        self._slot = slot_name
        # The relay's leadership id: every write is then fenced by the lease (see save()).
        self._holder = holder
        # The publication the relay verified (see verify()): every write then requires it.
        self._verified: tuple[PublicationStamp, sql.Composed] | None = None
        # What the writes of the position proved published (cdc_relay.recovery.horizon).
        self.horizons = HorizonTracker()

    def verify(self, stamp: PublicationStamp) -> None:
        """From now on every write of the position (and of the row filters) happens only while
        the catalogs still read ``stamp``, in the same statement, and records it: else it writes
        nothing and raises PublicationChanged (:mod:`cdc_relay.publication_stamp`)."""
        query = StampQuery.like(stamp, self._conn.info.server_version)
        self._verified = (stamp, query.expression())

    def inspect(self, table: str = STATE_TABLE) -> StateTable:
        """What the catalogs say about a state table, for this role; reads, never writes."""
        row = self._conn.execute(
            "SELECT n.oid IS NOT NULL, c.oid IS NOT NULL, "
            "n.oid IS NOT NULL AND has_schema_privilege(n.oid, 'USAGE'), "
            "n.oid IS NOT NULL AND has_schema_privilege(n.oid, 'CREATE'), "
            "c.oid IS NOT NULL AND pg_has_role(c.relowner, 'USAGE'), "
            "has_database_privilege(current_database(), 'CREATE'), "
            "coalesce((SELECT array_agg(a.attname::text) FROM pg_attribute a "
            "  WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped), '{}'), "
            "coalesce((SELECT array_agg(p) FROM unnest(%s::text[]) p "
            "  WHERE c.oid IS NULL OR NOT has_table_privilege(c.oid, p)), '{}') "
            "FROM (SELECT 1) one "
            "LEFT JOIN pg_namespace n ON n.nspname = %s "
            "LEFT JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = %s",
            (list(STATE_PRIVILEGES), self._schema, table),
        ).fetchone()
        assert row is not None
        schema_exists, exists, usage, schema_create, owner, db_create, columns, lacking = row
        present = set(columns) if isinstance(columns, list) else set()
        lacking_privileges = list(lacking) if isinstance(lacking, list) and exists else []
        if schema_exists and not usage:
            lacking_privileges.insert(0, "USAGE")
        # The file's statements check privileges before existence: CREATE SCHEMA IF NOT EXISTS
        # needs CREATE on the database, CREATE TABLE on the schema, ALTER TABLE ownership.
        may_create = bool(
            db_create and (not schema_exists or schema_create) and (not exists or owner)
        )
        return StateTable(
            name=f"{self._schema}.{table}",
            exists=bool(exists),
            missing_columns=tuple(c for c in STATE_COLUMNS[table] if exists and c not in present),
            lacking_privileges=tuple(str(p) for p in lacking_privileges),
            may_create=may_create,
        )

    def inspect_all(self) -> tuple[StateTable, ...]:
        """Both state tables: the position record and the leader lease."""
        return tuple(self.inspect(table) for table in STATE_COLUMNS)

    def ensure_table(self) -> bool:
        """Create (or complete) the state tables when they are not usable as they are; True if
        it ran the DDL. No DDL at all when both are complete: a role granted only SELECT, INSERT
        and UPDATE on them (and USAGE on their schema) runs the relay."""
        states = self.inspect_all()
        incomplete = [s for s in states if not s.exists or s.missing_columns]
        if not incomplete:
            for state in states:
                if state.lacking_privileges:
                    raise SourceSetupError(state.grant_hint(self._user()))
            return False
        state = incomplete[0]
        for candidate in incomplete:
            if not candidate.may_create:
                raise SourceSetupError(candidate.create_hint(self._user()))
        what = f"creating the relay's state tables in {self._schema}"
        attempts = DDL_ATTEMPTS
        while True:
            attempts -= 1
            try:
                with self._watched(what, STATE_DDL_MEANS), self._conn.transaction():
                    self._conn.execute(state_table_ddl(self._schema))
                return True
            except psycopg.errors.InsufficientPrivilege as exc:
                raise SourceSetupError(
                    f"cannot create the relay's state table {state.name}: "
                    f"{exc.diag.message_primary}. {state.create_hint(self._user())}"
                ) from None
            except _CREATED_MEANWHILE as exc:
                if not attempts:
                    raise error_for(exc, During.STATEMENT, what) from None

    def _user(self) -> str:
        row = self._conn.execute("SELECT current_user").fetchone()
        return str(row[0]) if row else "the relay's role"

    def load(self) -> int | None:
        query = sql.SQL("SELECT confirmed_lsn::text FROM {} WHERE slot_name = %s").format(
            self._table
        )
        row = self._run(query, (self._slot,)).fetchone()
        return parse_lsn(str(row[0])) if row else None

    def load_record(self) -> Record:
        """The record, its stamps, the sweep boundary and the row filters, and the server's
        identity and WAL end — all in one snapshot (:mod:`cdc_relay.record_origin`)."""
        query = sql.SQL(
            "SELECT p.confirmed_lsn::text, p.system_identifier, p.timeline_id, "
            "p.sweep_from_xid::text, p.row_filters, p.publication_stamp, "
            "p.stamp_checked_xid::text, p.updated_at::text, p.recovery_horizon::text, "
            f"p.recovery, {SERVER_SQL} "
            "FROM (SELECT 1) one LEFT JOIN {} p ON p.slot_name = %s"
        ).format(self._table)
        try:
            row = self._run(query, (self._slot,)).fetchone()
        except psycopg.errors.InsufficientPrivilege as exc:
            user = self._user()
            raise SourceSetupError(
                f"cannot read the relay's position record: {exc.diag.message_primary}. "
                f"{user} needs SELECT on {sql_name(self._schema, STATE_TABLE)} (sql/{ROLE_SQL}) "
                "and EXECUTE on pg_control_system(), which PUBLIC has unless it was revoked: "
                f"GRANT EXECUTE ON FUNCTION pg_control_system() TO {user}"
            ) from None
        assert row is not None
        (
            lsn,
            system_identifier,
            timeline,
            boundary,
            filters,
            published,
            checked,
            updated,
            horizon,
            recovery,
            *server,
        ) = row
        stamp = (
            None
            if lsn is None
            else Stamp(
                parse_lsn(str(lsn)),
                None if system_identifier is None else str(system_identifier),
                None if timeline is None else int(str(timeline)),
            )
        )
        return Record(
            stamp,
            None if boundary is None else int(str(boundary)),
            filters,
            server_from_row(tuple(server)),
            published,
            None if checked is None else int(str(checked)),
            None if updated is None else str(updated),
            horizon_from_json(horizon),
            recovery,
        )

    def save(
        self,
        lsn: int,
        offsets: Mapping[tuple[str, int], int] | None = None,
        new_slot: bool = False,
    ) -> None:
        """Record ``lsn``, and with ``offsets`` the acknowledged offset per partition at or below
        it (without, the recorded offsets stay: older ones only make a start read more). With
        ``new_slot`` (the slot was just created) the sweep boundary is set afresh and the offsets
        are cleared; otherwise the boundary is set only when missing.

        With a ``holder`` (the relay), the write happens only while the lease row names this
        holder, in the same statement: the lease row is locked (``FOR UPDATE``), so a takeover
        that rewrites the lease either commits first — this write then finds another holder,
        writes nothing and raises LeadershipLost — or waits until this write has committed, and
        the new leader reads the position afterwards. A stale leader cannot write a record.

        Every write stamps the record with the server it is written on (see
        :mod:`cdc_relay.record_origin`): a primary, the one whose slot the position is of.
        """
        horizon = self.horizons.to_record(lsn)
        values = (
            f"%s, %s::pg_lsn, {_NEXT_XID}, %s::jsonb, {STAMP_SQL}, "
            f"CASE WHEN %s THEN {_new_slot_horizon(_NEXT_XID, '%s::pg_lsn')} END"
        )
        upsert = (
            "ON CONFLICT (slot_name) DO UPDATE SET confirmed_lsn = EXCLUDED.confirmed_lsn, "
            "system_identifier = EXCLUDED.system_identifier, "
            "timeline_id = EXCLUDED.timeline_id, "
            "updated_at = now(), sweep_from_xid = CASE WHEN %s THEN EXCLUDED.sweep_from_xid "
            "ELSE coalesce(p.sweep_from_xid, EXCLUDED.sweep_from_xid) END, "
            "acked_offsets = CASE WHEN %s THEN EXCLUDED.acked_offsets "
            "ELSE coalesce(EXCLUDED.acked_offsets, p.acked_offsets) END, "
            "written_from = CASE WHEN %s THEN NULL ELSE p.written_from END, "
            # A new boundary starts with nothing proven; a horizon is written only under the
            # boundary it is of (cdc_relay.recovery.horizon).
            "recovery_horizon = CASE WHEN %s THEN EXCLUDED.recovery_horizon "
            "WHEN p.sweep_from_xid = (%s::jsonb->>'boundary')::xid8 THEN %s::jsonb "
            "WHEN p.sweep_from_xid IS NULL THEN NULL ELSE p.recovery_horizon END"
        )
        columns = (
            "(slot_name, confirmed_lsn, sweep_from_xid, acked_offsets, system_identifier, "
            "timeline_id, recovery_horizon"
        )
        encoded = encode_offsets(offsets).decode() if offsets is not None else None
        text = None if horizon is None else horizon.text
        head = (self._slot, format_lsn(lsn), encoded, new_slot, format_lsn(lsn))
        tail = (new_slot, new_slot, new_slot, new_slot, text, text)
        returned: tuple[object, ...] | None
        if self._verified is not None:
            stamp, _ = self._verified
            returned = self._checked_write(
                sql.SQL(
                    f"INSERT INTO {{table}} AS p {columns}, publication_stamp, stamp_checked_xid) "
                    f"SELECT {values}, found.stamp, {CHECKED_XID} FROM {{sources}} "
                    f"WHERE found.stamp = %s::jsonb {upsert}, "
                    "publication_stamp = EXCLUDED.publication_stamp, "
                    "stamp_checked_xid = EXCLUDED.stamp_checked_xid"
                ),
                (*head, stamp.text, *tail),
                "the position was not recorded",
                returning=sql.SQL(_FENCE_SQL),
            )
        elif self._holder is None:
            query = sql.SQL(
                f"INSERT INTO {{}} AS p {columns}) VALUES ({values}) {upsert} "
                f"RETURNING {_FENCE_SQL}"
            ).format(self._table)
            found = self._write(query, (*head, *tail)).fetchone()
            returned = None if found is None else tuple(found)
        else:
            query = sql.SQL(
                "WITH lease AS (SELECT 1 FROM {} WHERE slot_name = %s AND holder = %s FOR UPDATE) "
                f"INSERT INTO {{}} AS p {columns}) SELECT {values} FROM lease {upsert} "
                f"RETURNING {_FENCE_SQL}"
            ).format(self._lease, self._table)
            cursor = self._write(query, (self._slot, self._holder, *head, *tail))
            fenced(cursor.rowcount, "the position was not recorded")
            found = cursor.fetchone()
            returned = None if found is None else tuple(found)
        if returned is not None:
            fence, stored = fence_from_row(returned, lsn)
            self.horizons.written(fence, stored)

    def _checked_write(
        self,
        write: sql.SQL,
        params: tuple[object, ...],
        outcome: str,
        returning: sql.Composable = _NOTHING_RETURNED,
    ) -> tuple[object, ...]:
        """``write`` (reading ``found.stamp`` from ``{sources}``, the lease row and the stamp
        found now, and writing only while it is the verified one) as one statement: written (what
        it returned, ``returning``), or LeadershipLost (another holder), or PublicationChanged
        (another stamp)."""
        assert self._verified is not None
        verified, expression = self._verified
        lease = (
            sql.SQL("SELECT 1 FROM {} WHERE slot_name = %s AND holder = %s FOR UPDATE").format(
                self._lease
            )
            if self._holder is not None
            else sql.SQL("SELECT 1")
        )
        query = sql.SQL(
            "WITH lease AS ({lease}), found AS (SELECT {expression} AS stamp), "
            "written AS ({write} RETURNING {returning}) SELECT (SELECT count(*) FROM written), "
            "(SELECT count(*) FROM lease), (SELECT stamp::text FROM found), w.* "
            "FROM (SELECT 1) one LEFT JOIN written w ON true"
        ).format(
            lease=lease,
            expression=expression,
            returning=returning,
            write=write.format(table=self._table, sources=sql.SQL("lease, found")),
        )
        leased = (self._slot, self._holder) if self._holder is not None else ()
        row = self._write(query, (*leased, *params)).fetchone()
        assert row is not None
        written, lease_rows, found, *returned = row
        if written == 1:
            return tuple(returned)
        fenced(int(str(lease_rows)), outcome)
        now = PublicationStamp(orjson.loads(str(found)))
        if now.data == verified.data:
            fenced(0, outcome)  # no record to update: not this relay's to write any more
        raise self._changed(verified, now)

    def _changed(self, verified: PublicationStamp, now: PublicationStamp) -> RelayError:
        """The error of a write that found ``now``: named in detail when the catalogs answer."""
        try:
            resume_at = self.load()
            return change_error(
                self._conn, verified, now, None if resume_at is None else format_lsn(resume_at)
            )
        except (psycopg.Error, RelayError):  # the connection went too: said without detail
            return change_error(None, verified, now, None)

    def record_row_filters(self, filters: Mapping[str, str | None], changed: bool) -> None:
        """Record the row filters the relay relays with (:mod:`cdc_relay.relayed_filters`);
        ``changed`` (they are not those recorded): take the sweep boundary afresh in the same
        statement, for rows decoded under the old filters may not have been published. Fenced by
        the lease like :meth:`save`, and, once verified, records the publication's stamp too."""
        encoded = orjson.dumps(dict(filters)).decode()
        boundary = (
            "sweep_from_xid = CASE WHEN %s THEN pg_snapshot_xmax(pg_current_snapshot()) "
            "ELSE sweep_from_xid END, recovery_horizon = CASE WHEN %s THEN NULL "
            "ELSE recovery_horizon END"
        )
        if self._verified is not None:
            stamp, _ = self._verified
            self._checked_write(
                sql.SQL(
                    f"UPDATE {{table}} SET row_filters = %s::jsonb, {boundary}, "
                    f"publication_stamp = found.stamp, stamp_checked_xid = {CHECKED_XID} "
                    "FROM {sources} WHERE slot_name = %s AND found.stamp = %s::jsonb"
                ),
                (encoded, changed, changed, self._slot, stamp.text),
                "nothing was recorded",
            )
            return
        if self._holder is None:
            query = sql.SQL(
                f"UPDATE {{}} SET row_filters = %s::jsonb, {boundary} WHERE slot_name = %s"
            ).format(self._table)
            self._run(query, (encoded, changed, changed, self._slot))
            return
        query = sql.SQL(
            "WITH lease AS (SELECT 1 FROM {} WHERE slot_name = %s AND holder = %s FOR UPDATE) "
            f"UPDATE {{}} SET row_filters = %s::jsonb, {boundary} WHERE slot_name = %s "
            "AND EXISTS (SELECT 1 FROM lease)"
        ).format(self._lease, self._table)
        cursor = self._run(query, (self._slot, self._holder, encoded, changed, changed, self._slot))
        fenced(cursor.rowcount, "nothing was recorded")

    def load_offsets(self) -> tuple[Offsets | None, Offsets | None]:
        """The acknowledged offsets recorded with the position, and the offsets noted before
        first writes (each None: none recorded, or unreadable)."""
        query = sql.SQL(
            "SELECT acked_offsets::text, written_from::text FROM {} WHERE slot_name = %s"
        ).format(self._table)
        row = self._run(query, (self._slot,)).fetchone()
        return (decode_offsets(row[0]), decode_offsets(row[1])) if row else (None, None)

    def note_written_from(self, offsets: Mapping[tuple[str, int], int]) -> None:
        """Per partition the relay is about to write for the first time since the recorded
        position, an offset at or below its end: where a start reads it back from. Fenced by the
        lease like :meth:`save`: a stale leader's note could hide the new leader's records."""
        encoded = encode_offsets(offsets).decode()
        if self._holder is None:
            query = sql.SQL("UPDATE {} SET written_from = %s::jsonb WHERE slot_name = %s").format(
                self._table
            )
            self._run(query, (encoded, self._slot))
            return
        query = sql.SQL(
            "WITH lease AS (SELECT 1 FROM {} WHERE slot_name = %s AND holder = %s FOR UPDATE) "
            "UPDATE {} SET written_from = %s::jsonb WHERE slot_name = %s AND EXISTS "
            "(SELECT 1 FROM lease)"
        ).format(self._lease, self._table)
        cursor = self._run(query, (self._slot, self._holder, encoded, self._slot))
        fenced(cursor.rowcount, "nothing was noted")

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

    def restart_sweep_boundary(self, gap: Plan | None = None) -> int | None:
        """Take the sweep boundary afresh (a publication's row filter just changed, or the
        publication itself): rows of transactions from before are left alone, for they were
        decoded under the old one and may not have been published. Returns the new boundary;
        None: no record yet (the first :meth:`save` takes it).

        With ``gap`` (the publication changed under the relay), the recovery of the rows it may
        have kept from the slot is planned in the same statement, unless another recovery has
        not ended: up to the new boundary, those its snapshot sees (committed before it; later
        ones are streamed), the positions of its records from the WAL's end now
        (:mod:`cdc_relay.recovery`)."""
        plan = (
            "recovery = CASE WHEN %s::jsonb IS NULL OR coalesce(recovery->>'state', 'done') "
            "<> 'done' THEN recovery ELSE %s::jsonb || jsonb_build_object('snapshot', "
            f"pg_current_snapshot()::text, 'below', {_NEXT_XID}::text, 'slot_lsn', "
            "pg_current_wal_insert_lsn()::text, 'commit_order', CASE WHEN "
            "current_setting('track_commit_timestamp') = 'on' THEN 'commit_timestamp' "
            "ELSE 'xid' END) END"
        )
        query = sql.SQL(
            f"UPDATE {{}} SET sweep_from_xid = {_NEXT_XID}, recovery_horizon = NULL, {plan} "
            "WHERE slot_name = %s RETURNING sweep_from_xid::text"
        ).format(self._table)
        text = None if gap is None else gap.text
        row = self._run(query, (text, text, self._slot)).fetchone()
        return None if row is None else int(str(row[0]))

    def _run(
        self, query: sql.Composed, params: tuple[object, ...]
    ) -> psycopg.Cursor[tuple[object, ...]]:
        """A statement whose lost connection or timeout is SourceUnavailable; what the server
        refuses (a missing table, a privilege) stays psycopg's, for the caller that answers it."""
        try:
            with self._watched("using the position record", POSITION_MEANS):
                return self._conn.execute(query, params)
        except psycopg.OperationalError as exc:
            # Reads too (the sweeper, the start): not "cannot record".
            raise error_for(exc, During.STATEMENT, "the position record is unreachable") from None

    def _write(
        self, query: sql.Composed, params: tuple[object, ...]
    ) -> psycopg.Cursor[tuple[object, ...]]:
        """A write of the position: every failure becomes the project's error, by
        :mod:`cdc_relay.postgres_errors`' table (the confirmation path catches no psycopg error)."""
        try:
            with self._watched("recording the position", POSITION_MEANS):
                return self._conn.execute(query, params)
        except psycopg.Error as exc:
            raise error_for(exc, During.STATEMENT, "cannot record the position") from None


def check_missing_slot(slot_name: str, recorded: int | None, allow_reset: bool) -> str | None:
    """The slot does not exist. Creating it is fine on first run; otherwise events may be lost.

    Returns a warning to log when the override lets the relay go on, None when all is well.
    """
    if recorded is None:
        return None
    if not allow_reset:
        raise PositionMismatch(loss_refusal(slot_name, Cause.DROPPED, recorded, None))
    gap = what_happened(slot_name, Cause.DROPPED, recorded, None)
    return (
        f"{gap}, and events committed after that and before a new slot are skipped; starting "
        "anyway because slot reset is allowed"
    )


def resolve_start(
    slot_name: str,
    slot_confirmed: int,
    recorded: int | None,
    allow_reset: bool,
    promoted: str | None = None,
) -> tuple[int, str | None]:
    """Where to start streaming an existing slot, and a warning to log (or None).

    ``recorded`` may be ahead of the slot (see module doc): starting at the record skips only
    transactions Kafka already acknowledged. A slot ahead of the record was recreated or advanced by
    someone else, and the events between the two may never have reached Kafka — unless it is a
    failover slot that came through a promotion, its position from before the promotion
    (``promoted``: the note to log, from :func:`cdc_relay.replication.failover.promoted_slot`):
    then the record merely lags, having reached this server by physical replication.
    """
    if recorded is None or slot_confirmed == recorded:
        return slot_confirmed, None
    if slot_confirmed < recorded:
        return recorded, None
    if promoted is not None:
        return slot_confirmed, promoted
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
