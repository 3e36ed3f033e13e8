"""Prepare and inspect the source database: preflight checks, the publication, the slot.

Everything here runs on an ordinary (non-replication) connection. Each failed prerequisite becomes a
:class:`SourceSetupError` whose message says what to run to fix it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import psycopg
from psycopg import sql

from cdc_relay.config import OutboxTable
from cdc_relay.database_url import connect_error
from cdc_relay.errors import SlotInUse, SourceSetupError, SourceUnavailable
from cdc_relay.lsn import parse_lsn
from cdc_relay.replication.stream import APPLICATION_NAME

MIN_SERVER_VERSION = 140000


@dataclass(frozen=True)
class SlotState:
    name: str
    plugin: str
    database: str
    active_pid: int | None
    confirmed_flush: int | None


def connect(database_url: str) -> psycopg.Connection[tuple[object, ...]]:
    """An autocommit connection; connection failures become SourceUnavailable / SetupError."""
    try:
        return psycopg.connect(
            database_url, autocommit=True, application_name=APPLICATION_NAME, connect_timeout=10
        )
    except psycopg.OperationalError as exc:
        raise connect_error(
            str(exc), exc.sqlstate, database_url, "cannot connect to PostgreSQL"
        ) from None
    except psycopg.Error as exc:
        # libpq refused the connection string itself; its message would quote it.
        raise connect_error(str(exc), None, "", "cannot connect to PostgreSQL") from None


class SourceDatabase:
    """The checks and DDL the relay needs before it can stream."""

    def __init__(
        self,
        conn: psycopg.Connection[tuple[object, ...]],
        tables: Sequence[OutboxTable],
        publication_name: str,
        slot_name: str,
        plugin: str = "pgoutput",
    ) -> None:
        self._conn = conn
        self._plugin = plugin
        self._tables = tuple(tables)
        self._publication = publication_name
        self._slot = slot_name

    def _scalar(self, query: sql.Composable | str, *params: object) -> object:
        row = self._conn.execute(query, params or None).fetchone()  # type: ignore[arg-type]
        return row[0] if row else None

    def preflight(self) -> None:
        """Server version, wal_level, REPLICATION privilege, the outbox tables and columns."""
        version = int(str(self._scalar("SHOW server_version_num")))
        if version < MIN_SERVER_VERSION:
            raise SourceSetupError(
                f"PostgreSQL {version // 10000} is too old: cdc-relay needs 14 or newer"
            )
        wal_level = self._scalar("SHOW wal_level")
        if wal_level != "logical":
            raise SourceSetupError(
                f"wal_level is {wal_level!r}, logical replication needs 'logical': run "
                "ALTER SYSTEM SET wal_level = logical; then restart PostgreSQL"
            )
        can_replicate = self._scalar(
            "SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user"
        )
        if not can_replicate:
            user = self._scalar("SELECT current_user")
            raise SourceSetupError(
                f"role {user!r} may not stream the WAL: run ALTER ROLE {user} WITH REPLICATION"
            )
        for table in self._tables:
            missing = missing_columns(self._conn, table)
            if missing is None:
                raise SourceSetupError(
                    f"outbox table {table.table} does not exist"
                    f"{missing_table_hint(self._conn, table)}: create it with "
                    "sql/001_outbox.sql (or set CDC_RELAY_OUTBOX_TABLE)"
                )
            if missing:
                raise SourceSetupError(
                    f"outbox table {table.table} lacks column(s) {', '.join(missing)} "
                    "(see CDC_RELAY_OUTBOX_COLUMNS)"
                )

    def ensure_publication(self) -> bool:
        """Create the insert-only publication of the outbox tables if missing. True if created."""
        names = ", ".join(t.sql_name for t in self._tables)
        exists = self._scalar(
            "SELECT pubinsert FROM pg_publication WHERE pubname = %s", self._publication
        )
        if exists is None:
            statement = sql.SQL("CREATE PUBLICATION {} FOR TABLE {} WITH (publish = 'insert')")
            try:
                self._conn.execute(
                    statement.format(
                        sql.Identifier(self._publication),
                        sql.SQL(", ").join(
                            sql.Identifier(*t.schema_and_name) for t in self._tables
                        ),
                    )
                )
            except psycopg.errors.InsufficientPrivilege as exc:
                raise SourceSetupError(
                    f"cannot create publication {self._publication}: {exc.diag.message_primary}. "
                    f"Ask the table owner to run: CREATE PUBLICATION {self._publication} FOR TABLE "
                    f"{names} WITH (publish = 'insert')"
                ) from None
            return True
        if not exists:
            raise SourceSetupError(f"publication {self._publication} does not publish inserts")
        for table in self._tables:
            schema, name = table.schema_and_name
            covered = self._scalar(
                "SELECT 1 FROM pg_publication_tables WHERE pubname = %s AND schemaname = %s "
                "AND tablename = %s",
                self._publication,
                schema,
                name,
            )
            if covered is None:
                raise SourceSetupError(
                    f"publication {self._publication} exists but does not include "
                    f"{table.table}: run ALTER PUBLICATION {self._publication} ADD TABLE "
                    f"{table.sql_name}"
                )
        return False

    def slot(self) -> SlotState | None:
        row = self._conn.execute(
            "SELECT slot_name, plugin, database, active_pid, confirmed_flush_lsn::text "
            "FROM pg_replication_slots WHERE slot_name = %s",
            (self._slot,),
        ).fetchone()
        if row is None:
            return None
        name, plugin, database, pid, confirmed = row
        return SlotState(
            name=str(name),
            plugin=str(plugin),
            database=str(database),
            active_pid=int(str(pid)) if pid is not None else None,
            confirmed_flush=parse_lsn(str(confirmed)) if confirmed is not None else None,
        )

    def check_slot(self, slot: SlotState) -> None:
        """The slot must be logical, pgoutput, in this database, and not held by someone else."""
        here = self._scalar("SELECT current_database()")
        if slot.plugin != self._plugin or slot.database != here:
            raise SourceSetupError(
                f"replication slot {slot.name!r} exists but is for plugin {slot.plugin!r} in "
                f"database {slot.database!r}; this relay needs {self._plugin!r} in {here!r} "
                "(CDC_RELAY_PLUGIN): drop the slot or choose another CDC_RELAY_SLOT_NAME"
            )
        if slot.active_pid is not None:
            raise SlotInUse(
                f"replication slot {slot.name!r} is in use by process {slot.active_pid}: another "
                "relay may be running. Stop it, or give this relay its own CDC_RELAY_SLOT_NAME"
            )

    def create_slot(self) -> SlotState:
        try:
            self._conn.execute(
                "SELECT pg_create_logical_replication_slot(%s, %s)", (self._slot, self._plugin)
            )
        except psycopg.errors.UndefinedFile:
            raise SourceSetupError(
                f"the output plugin {self._plugin!r} is not installed on the server: install it "
                f"(Debian/Ubuntu: apt-get install postgresql-<major>-{self._plugin}) or use "
                "CDC_RELAY_PLUGIN=pgoutput, which is built in"
            ) from None
        except psycopg.errors.DuplicateObject:
            pass  # created concurrently; the checks below decide whether it is usable
        except psycopg.errors.ConfigurationLimitExceeded as exc:
            raise SourceSetupError(
                f"cannot create replication slot {self._slot!r}: {exc.diag.message_primary}. "
                "Raise max_replication_slots or drop an unused slot"
            ) from None
        except psycopg.errors.InsufficientPrivilege as exc:
            raise SourceSetupError(
                f"cannot create replication slot: {exc.diag.message_primary}"
            ) from None
        slot = self.slot()
        if slot is None:
            raise SourceSetupError(f"replication slot {self._slot!r} vanished after creation")
        return slot

    def current_wal_lsn(self) -> int:
        return parse_lsn(str(self._scalar("SELECT pg_current_wal_lsn()::text")))


def retained_wal(conn: psycopg.Connection[tuple[object, ...]], slot_name: str) -> int | None:
    """Bytes of WAL the slot keeps on the server (None if the slot is gone)."""
    try:
        row = conn.execute(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint "
            "FROM pg_replication_slots WHERE slot_name = %s",
            (slot_name,),
        ).fetchone()
    except psycopg.OperationalError as exc:
        raise SourceUnavailable(f"cannot read the slot's retained WAL: {exc}") from None
    return int(str(row[0])) if row and row[0] is not None else None


def relation_oid(conn: psycopg.Connection[tuple[object, ...]], table: OutboxTable) -> int | None:
    """The oid of ``table``, its schema and name matched exactly as configured.

    Names in settings are identifiers taken literally (as pgoutput reports them and as the DDL
    quotes them): ``public.Outbox`` is the table created as ``"Outbox"``, never ``outbox``.
    """
    schema, name = table.schema_and_name
    row = conn.execute(
        "SELECT c.oid FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s AND c.relname = %s",
        (schema, name),
    ).fetchone()
    return int(str(row[0])) if row else None


def missing_table_hint(conn: psycopg.Connection[tuple[object, ...]], table: OutboxTable) -> str:
    """For a table that does not exist: the one that differs only in case, if any."""
    schema, name = table.schema_and_name
    rows = conn.execute(
        "SELECT n.nspname, c.relname FROM pg_class c JOIN pg_namespace n "
        "ON n.oid = c.relnamespace WHERE lower(n.nspname) = lower(%s) "
        "AND lower(c.relname) = lower(%s) AND c.relkind IN ('r', 'p') ORDER BY 1, 2 LIMIT 1",
        (schema, name),
    ).fetchall()
    if not rows:
        return ""
    return (
        f" (names are case-sensitive and taken as written: did you mean {rows[0][0]}.{rows[0][1]}?)"
    )


def missing_columns(
    conn: psycopg.Connection[tuple[object, ...]], table: OutboxTable
) -> list[str] | None:
    """The mapped columns ``table`` lacks, or None when the table does not exist."""
    oid = relation_oid(conn, table)
    if oid is None:
        return None
    rows = conn.execute(
        "SELECT attname FROM pg_attribute WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped",
        (oid,),
    ).fetchall()
    present = {str(r[0]) for r in rows}
    columns = table.columns
    wanted = [*columns.required, *columns.header_columns]
    wanted += [c for c in (columns.topic, columns.key) if c is not None]
    return [c for c in wanted if c not in present]


HEARTBEAT_PREFIX = "cdc_relay_heartbeat"


def emit_heartbeat(conn: psycopg.Connection[tuple[object, ...]]) -> None:
    """A little WAL of our own, so that keepalives move the confirmed position on databases whose
    other writes are invisible to the slot (e.g. managed services writing to other databases).
    Non-transactional and with its own prefix: never relayed."""
    try:
        conn.execute("SELECT pg_logical_emit_message(false, %s, '')", (HEARTBEAT_PREFIX,))
    except psycopg.OperationalError as exc:
        raise SourceUnavailable(f"cannot emit a heartbeat: {exc}") from None
