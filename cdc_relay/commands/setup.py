"""``python -m cdc_relay setup [--create-outbox]``: create, idempotently, what the relay needs.

The outbox table (on request), the relay's state table, the ``outbox_emit`` SQL helper, the
publication and the slot — each from its file in ``sql/`` (see :mod:`cdc_relay.ddl`) — with one
line per item (``created …`` / ``exists …``). It checks what the relay's start checks first
(:func:`cdc_relay.prerequisites.require`), and never creates a slot over one the relay has lost.

What it waits for — a lock its DDL needs, the transactions creating the slot waits for — it waits
for as long as it takes, and names in a log line within a second, again every half minute
(:mod:`cdc_relay.waits`); Ctrl-C or SIGTERM ends it.
"""

from __future__ import annotations

from collections.abc import Callable

import psycopg
from psycopg import sql

from cdc_relay.checkpoint import LEASE_TABLE, PostgresCheckpointStore, check_missing_slot
from cdc_relay.commands.output import print_line
from cdc_relay.config import OutboxColumns, OutboxTable, Settings
from cdc_relay.ddl import EMIT_SQL, OUTBOX_SQL, emit_function_ddl, emit_privileges_ddl, packaged_sql
from cdc_relay.errors import PositionMismatch, RelayError, SourceSetupError
from cdc_relay.exit_codes import ExitCode
from cdc_relay.lsn import format_lsn
from cdc_relay.prerequisites import Prerequisites, Unmet, require, verified_stamp
from cdc_relay.publication_filter import FilterMismatch, find_mismatch
from cdc_relay.relayed_filters import recorded_form
from cdc_relay.replication.failover import wants_failover
from cdc_relay.replication.source import (
    Connection,
    SourceDatabase,
    connect,
    relation_oid,
    scalar,
)
from cdc_relay.waits import PUBLICATION_MEANS, SETUP_MEANS, SLOT_MEANS, WaitWatch

Output = Callable[[str], None]

DEFAULT_OUTBOX_TABLE = "public.outbox"
EMIT_SIGNATURE = "outbox_emit(text, text, text, jsonb, jsonb)"


class _SetupFailed(Exception):
    """Ends setup: ``line`` is printed after ``FAIL``, ``exit_code`` returned."""

    def __init__(self, line: str, exit_code: int) -> None:
        super().__init__(line)
        self.line = line
        self.exit_code = exit_code


def setup(settings: Settings, create_outbox: bool = False, out: Output = print_line) -> int:
    """Create what is missing; one line per item. Returns the exit code."""
    try:
        if create_outbox and not _default_outbox(settings):
            raise _SetupFailed(
                f"table: --create-outbox creates {DEFAULT_OUTBOX_TABLE} as in sql/{OUTBOX_SQL}, "
                "for the default single-table configuration only; create "
                f"{', '.join(t.table for t in settings.tables())} yourself and run setup "
                "without it",
                ExitCode.CONFIGURATION,
            )
        waits = WaitWatch(settings.source_url())
        try:
            with connect(settings.source_url()) as conn:
                _Setup(conn, settings, out, waits).run(create_outbox)
        finally:
            waits.close()
    except _SetupFailed as exc:
        out(f"FAIL {exc.line}")
        return exc.exit_code
    except RelayError as exc:
        out(f"FAIL {exc}")
        return exc.exit_code
    return ExitCode.OK


class _Setup:
    def __init__(self, conn: Connection, settings: Settings, out: Output, waits: WaitWatch) -> None:
        self.conn = conn
        self.settings = settings
        self.out = out
        self.watched = waits.for_connection(conn)
        self.store = PostgresCheckpointStore(
            conn, settings.state_schema, settings.slot_name, watched=self.watched
        )
        self.source = SourceDatabase(
            conn,
            settings.tables(),
            settings.publication_name,
            settings.slot_name,
            settings.plugin.value,
        )

    def report(self, created: bool, item: str) -> None:
        self.out(f"{'created' if created else 'exists':<7} {item}")

    def run(self, create_outbox: bool) -> None:
        conn, settings = self.conn, self.settings
        if create_outbox:
            exists = relation_oid(conn, OutboxTable(table=DEFAULT_OUTBOX_TABLE)) is not None
            if not exists:
                with self.watched(f"creating table {DEFAULT_OUTBOX_TABLE}", SETUP_MEANS):
                    conn.execute(packaged_sql(OUTBOX_SQL).encode())  # our own trusted DDL
            self.report(not exists, f"table {DEFAULT_OUTBOX_TABLE}")

        try:
            created = self.store.ensure_table()
        except SourceSetupError as exc:
            raise _SetupFailed(f"state table: {exc}", exc.exit_code) from None
        self.report(created, f"state table {self.store.inspect().name}")

        self.messages()

        try:
            require(conn, settings)
        except SourceSetupError as exc:
            raise _SetupFailed(f"prerequisites: {exc}", exc.exit_code) from None
        try:
            with self.watched("creating the publication", PUBLICATION_MEANS):
                created = self.source.ensure_publication()
                mismatch = find_mismatch(conn, settings.publication_name, settings.tables())
                if mismatch is not None:
                    self.refuse_beside_a_relay(mismatch)
                changed = self.source.ensure_row_filters()
            if changed is not None:
                self.store.restart_sweep_boundary()
                self.out(f"changed publication {settings.publication_name}: {changed.describe()}")
        except SourceSetupError as exc:
            raise _SetupFailed(
                f"publication {settings.publication_name}: {exc}", exc.exit_code
            ) from None
        tables = ", ".join(t.table for t in settings.tables())
        self.report(created, f"publication {settings.publication_name} ({tables}; inserts)")
        self.slot()

    def refuse_beside_a_relay(self, mismatch: FilterMismatch) -> None:
        """Setup would change the publication's row filters while a relay streams the slot (a
        walsender holds it, or a leader's lease is live): what it streams would change under it
        — it would stop, naming the change. Refused: the relays' settings own the filters."""
        slot = self.settings.slot_name
        state = self.source.slot()
        holder = state.active_pid if state is not None else None
        try:
            lease = self.conn.execute(
                sql.SQL("SELECT holder FROM {} WHERE slot_name = %s AND expires_at > now()").format(
                    sql.Identifier(self.settings.state_schema, LEASE_TABLE)
                ),
                (slot,),
            ).fetchone()
        except (psycopg.errors.UndefinedTable, psycopg.errors.InsufficientPrivilege):
            lease = None
        if holder is None and lease is None:
            return
        who = (
            f"walsender pid {holder}"
            if holder is not None
            else f"leader {lease[0] if lease else ''}"
        )
        raise _SetupFailed(
            f"publication {mismatch.publication}: a relay streams slot {slot} now ({who}), and "
            f"setup would change the row filters it streams with ({mismatch.describe()}): it "
            "would stop, and the rows the new filter leaves out until then would never reach "
            "it. Stop the relays of the slot first and give them the same row filter (a relay "
            "sets the publication's filters as its settings say when it starts), or run setup "
            "with the relays' settings",
            SourceSetupError.exit_code,
        )

    def messages(self) -> None:
        """With messages on, ``sql/004_outbox_emit.sql``: ``outbox_emit`` (re)made the writers'
        one way to emit, and PUBLIC's EXECUTE on ``pg_logical_emit_message`` revoked — verified,
        as a REVOKE by a role that may not only warns. With messages off, nothing."""
        conn, settings = self.conn, self.settings
        if not settings.messages:
            return
        exists = scalar(conn, "SELECT to_regprocedure(%s) IS NOT NULL", EMIT_SIGNATURE) is True
        checks = Prerequisites(conn, settings)
        try:
            checks.messages.messages()
            revoked = False
        except Unmet:
            revoked = True  # PUBLIC may emit now: this run revokes it
        try:
            with self.watched(f"creating {EMIT_SIGNATURE}", SETUP_MEANS), conn.transaction():
                conn.execute(emit_function_ddl(settings.message_prefix, conn))
                conn.execute(emit_privileges_ddl())  # our own trusted DDL
        except psycopg.errors.InsufficientPrivilege as exc:
            raise _SetupFailed(
                f"function {EMIT_SIGNATURE}: {exc.diag.message_primary or exc}: run setup (or "
                f"sql/{EMIT_SQL}) as a superuser",
                3,
            ) from None
        prefix = settings.message_prefix
        self.report(not exists, f"function {EMIT_SIGNATURE} (message prefix {prefix!r})")
        try:
            found = checks.messages.messages()
        except Unmet as exc:
            raise _SetupFailed(f"privileges on pg_logical_emit_message: {exc.fix}", 3) from None
        self.report(revoked, f"privileges on pg_logical_emit_message: not PUBLIC's; {found}")

    def slot(self) -> None:
        settings = self.settings
        name = settings.slot_name
        slot = self.source.slot()
        if slot is None:
            try:
                check_missing_slot(name, self.store.load(), allow_reset=False)
            except PositionMismatch as exc:
                raise _SetupFailed(f"replication slot {name}: {exc}", exc.exit_code) from None
            try:
                failover = wants_failover(self.conn, settings)
                with self.watched(f"creating replication slot {name}", SLOT_MEANS):
                    slot = self.source.create_slot(failover)
            except SourceSetupError as exc:
                raise _SetupFailed(f"replication slot {name}: {exc}", exc.exit_code) from None
            start = slot.confirmed_flush or 0
            # As the relay does after creating its slot: from now on a lost slot is detected,
            # and a publication changed before the relay first starts is too.
            self.store.save(start, new_slot=True)
            try:
                self.store.verify(verified_stamp(self.conn, settings))
            except RelayError as exc:
                raise _SetupFailed(
                    f"publication {settings.publication_name}: {exc}", exc.exit_code
                ) from None
            self.store.record_row_filters(recorded_form(settings.tables()), changed=False)
            self.report(True, f"replication slot {name} ({slot.plugin}) at {format_lsn(start)}")
            return
        try:
            Prerequisites(self.conn, settings).slot.slot_kind(slot)
        except Unmet as exc:
            raise _SetupFailed(f"replication slot {name}: {exc.fix}", exc.error.exit_code) from None
        confirmed = format_lsn(slot.confirmed_flush or 0)
        self.report(False, f"replication slot {name} ({slot.plugin}) at {confirmed}")


def _default_outbox(settings: Settings) -> bool:
    return (
        not settings.outbox_tables
        and settings.outbox_table == DEFAULT_OUTBOX_TABLE
        and settings.outbox_columns == OutboxColumns()
    )
