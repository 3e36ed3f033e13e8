"""Checks of the relay's state tables (complete, or creatable by this role) and of who leads
the slot (and whether this role could take over from it)."""

from __future__ import annotations

import psycopg
from psycopg import sql

from cdc_relay.checkpoint import LEASE_TABLE
from cdc_relay.errors import SourceSetupError
from cdc_relay.leadership import foreign_holder
from cdc_relay.lsn import format_lsn
from cdc_relay.prerequisites.probe import Checks, Unmet


class StateChecks(Checks):
    """The state tables and leadership."""

    def state_table(self) -> str:
        # Exactly what the relay's start does (PostgresCheckpointStore.ensure_table): no DDL when
        # the table is complete, the file's DDL when not, which only some roles may run.
        states = self._store().inspect_all()
        incomplete = [s for s in states if not s.exists or s.missing_columns]
        if not incomplete:
            for state in states:
                if state.lacking_privileges:
                    raise Unmet(state.grant_hint(self.user))
            try:  # as the relay reads it: with the server's identity (record_origin)
                record = self._store().load_record()
            except SourceSetupError as exc:
                raise Unmet(str(exc)) from None
            recorded = record.stamp.position if record.stamp is not None else None
            where = f"recorded position {format_lsn(recorded)}" if recorded else "no record yet"
            return f"{', '.join(s.name for s in states)}, {where}"
        for state in incomplete:
            if not state.may_create:
                raise Unmet(state.create_hint(self.user))
        what = "; ".join(
            f"{s.name} lacks column(s) {', '.join(s.missing_columns)}"
            if s.exists
            else f"{s.name} does not exist yet"
            for s in incomplete
        )
        return f"{what}; setup or the relay's first start creates it"

    def leadership(self) -> str:
        """Who leads the slot now, and whether this role could take over from it if it hung:
        that ends the leader's backends (pg_terminate_backend), allowed for backends of a role
        whose privileges this one has, or with pg_signal_backend; a superuser's only to one."""
        lease = sql.Identifier(self.settings.state_schema, LEASE_TABLE)
        slot = self.settings.slot_name
        try:
            squatter = foreign_holder(self.conn, self.settings.state_schema, slot)
        except (psycopg.errors.UndefinedTable, psycopg.errors.InsufficientPrivilege):
            squatter = None  # no lease table to tell relays by: the state table check says why
        if squatter is not None:
            raise Unmet(
                f"the leader lock is held by a session that is no relay ({squatter.describe()}): "
                f"no relay can lead while it holds it; {squatter.fix(slot)}"
            )
        try:
            row = self.conn.execute(
                sql.SQL(
                    "SELECT l.holder, l.expires_at > now(), r.rolname, "
                    "r.oid IS NULL OR ((NOT r.rolsuper OR me.rolsuper) AND "
                    "(pg_has_role(r.oid, 'USAGE') OR pg_has_role('pg_signal_backend', 'USAGE'))) "
                    "FROM {} l JOIN pg_roles me ON me.rolname = current_user "
                    "LEFT JOIN pg_stat_activity a ON a.pid = l.lock_pid "
                    "LEFT JOIN pg_roles r ON r.oid = a.usesysid WHERE l.slot_name = %s"
                ).format(lease),
                (self.settings.slot_name,),
            ).fetchone()
        except (psycopg.errors.UndefinedTable, psycopg.errors.InsufficientPrivilege):
            return "no relay has led this slot yet (the state table above says why)"
        if row is None:
            return "no relay has led this slot yet; the first to start leads, others stand by"
        holder, valid, role, may_end = row
        state = "leads" if valid else "held the lease, expired"
        if not may_end:
            raise Unmet(
                f"relay {holder} {state} as role {role}, whose connections {self.user} may not "
                "end: it could not take over if that relay hung. Run every relay of a slot as "
                f"one role, or GRANT pg_signal_backend TO {self.user}"
            )
        who = f" as role {role}" if role else ""
        return f"relay {holder} {state}{who}; {self.user} may take over from it"
