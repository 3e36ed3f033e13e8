"""What every group of checks shares: one connection, the settings, what the first checks read.

A check returns what it found (an ``ok`` line's detail) or raises :class:`Unmet` with what to do
about it; :class:`Checks` is the base of each group, on one :class:`Probe`.
"""

from __future__ import annotations

from cdc_relay.checkpoint import PostgresCheckpointStore
from cdc_relay.config import Settings
from cdc_relay.errors import RelayError, SourceSetupError
from cdc_relay.replication.source import Connection, SlotState, slot_state

# Amazon RDS and Aurora grant the right to stream by membership in their role rds_replication
# and leave rolreplication false, the master user's included. The membership counts only on such a
# server (its parameter rds.logical_replication exists), not on one where anybody with CREATEROLE
# could make a role of that name.
RDS_REPLICATION = (
    "CASE WHEN current_setting('rds.logical_replication', true) IS NOT NULL "
    "AND to_regrole('rds_replication') IS NOT NULL "
    "THEN pg_has_role(current_user, to_regrole('rds_replication'), 'MEMBER') ELSE false END"
)


class Unmet(Exception):
    """A prerequisite that does not hold. ``fix`` says what to do; ``error`` is what the relay
    raises for it."""

    def __init__(self, fix: str, error: type[RelayError] = SourceSetupError) -> None:
        super().__init__(fix)
        self.fix = fix
        self.error = error


class Probe:
    """The source database on one connection, as the checks see it."""

    def __init__(self, conn: Connection, settings: Settings) -> None:
        self.conn = conn
        self.settings = settings
        self.tables = settings.tables()
        # What the first checks read, in one round trip: each round trip delays the relay's start.
        row = conn.execute(
            "SELECT current_user, current_setting('server_version_num'), "
            "current_setting('server_version'), current_setting('wal_level'), "
            "r.rolsuper, r.rolreplication, " + RDS_REPLICATION + " "
            "FROM pg_roles r WHERE r.rolname = current_user"
        ).fetchone()
        if row is None:  # no pg_roles row for the session's role: it was just dropped
            raise SourceSetupError("the connection's role does not exist (any more)")
        self.user = str(row[0])
        self.version_num = int(str(row[1]))
        self.version = str(row[2]).split()[0]
        self.wal_level = str(row[3])
        self.superuser, self.replication = bool(row[4]), bool(row[5])
        self.rds_replication = bool(row[6])


class Checks:
    """A group of checks on one :class:`Probe`."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.conn = probe.conn
        self.settings = probe.settings
        self.tables = probe.tables
        self.user = probe.user

    def _slot(self) -> SlotState | None:
        return slot_state(self.conn, self.settings.slot_name)

    def _store(self) -> PostgresCheckpointStore:
        return PostgresCheckpointStore(
            self.conn, self.settings.state_schema, self.settings.slot_name
        )
