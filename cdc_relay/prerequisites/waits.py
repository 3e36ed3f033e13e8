"""The check of what would hold the relay up now: locks and transactions it would wait for
(:func:`cdc_relay.waits.held_up_by`) — a relay's backend waiting, a lock on this slot's rows of
the state tables, a transaction that creating the slot would wait for."""

from __future__ import annotations

from psycopg import sql

from cdc_relay.checkpoint import LEASE_TABLE, STATE_TABLE
from cdc_relay.prerequisites.probe import Checks, Unmet
from cdc_relay.waits import held_up_by


class WaitChecks(Checks):
    """Locks and transactions the relay would wait for."""

    def waits(self) -> str:
        schema = self.settings.state_schema
        present = self.conn.execute(
            "SELECT to_regclass(%s) IS NOT NULL AND to_regclass(%s) IS NOT NULL",
            (
                sql.Identifier(schema, STATE_TABLE).as_string(self.conn),
                sql.Identifier(schema, LEASE_TABLE).as_string(self.conn),
            ),
        ).fetchone()
        tables = (
            (sql.Identifier(schema, STATE_TABLE), sql.Identifier(schema, LEASE_TABLE))
            if present and present[0]
            else None
        )
        slot = self._slot()
        found = held_up_by(self.conn, tables, self.settings.slot_name, slot is not None)
        if found:
            raise Unmet("; ".join(found))
        return "no lock or transaction holds the relay up"
