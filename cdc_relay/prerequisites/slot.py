"""Checks of the replication slot: its kind, who streams it, its WAL, whether the relay's position
record can be this server's, failover, and whether the wal2json plugin is installed."""

from __future__ import annotations

import os

import psycopg
from psycopg import sql

from cdc_relay.checkpoint import LEASE_TABLE, check_missing_slot, resolve_start
from cdc_relay.config import OnSlotLoss, Plugin
from cdc_relay.errors import PositionMismatch, RelayError, SlotInUse, SourceSetupError
from cdc_relay.lsn import format_lsn
from cdc_relay.prerequisites.probe import Checks, Unmet
from cdc_relay.record_origin import history_switches, problem, refusal
from cdc_relay.recovery.loss import ON_LOSS, in_progress, interrupted, invalidated
from cdc_relay.recovery.loss import refusal as loss_refusal
from cdc_relay.recovery.plan import Cause
from cdc_relay.replication.failover import describe, promotion_note
from cdc_relay.replication.source import SlotState, connect, plugin_missing, scalar
from cdc_relay.replication.stream import timeline_history

PROBE_TIMEOUT = "5s"


class SlotChecks(Checks):
    """The slot: kind, holder, WAL, the position record beside it, failover, the plugin."""

    def slot(self) -> str:
        """The slot as ``check`` judges it: usable by this relay, healthy, where the record is."""
        settings = self.settings
        name = settings.slot_name
        unfinished = self._unfinished_recovery()
        if unfinished is not None:
            if settings.on_slot_loss is OnSlotLoss.RECOVER:
                return f"{unfinished}; the leader finishes it at its start ({ON_LOSS})"
            raise Unmet(unfinished, PositionMismatch)
        slot = self._slot()
        recorded = self._recorded()
        if slot is None:
            warning = check_missing_slot(name, recorded, settings.allow_slot_reset)
            created = (
                f"{name} does not exist yet: setup or the relay's first start creates it "
                "(events are relayed from then on)"
            )
            return f"{created}; {warning}" if warning else created
        problems: list[str] = []
        leader = self._streaming_leader(slot)  # a standby design: the leader streams, fine
        for probe in (self.slot_kind,) if leader else (self.slot_kind, self.slot_free):
            try:
                probe(slot)
            except Unmet as exc:
                problems.append(exc.fix)
        if invalidated(slot):
            problems.append(
                loss_refusal(name, Cause.INVALIDATED, recorded or 0, slot)
                if recorded is not None
                else f"{name} was invalidated by the server (wal_status {slot.wal_status}): it can "
                "never stream again. Drop it (SELECT pg_drop_replication_slot(...)): the relay "
                "has recorded no position from it, so nothing was relayed from it"
            )
        confirmed = slot.confirmed_flush or 0
        origin = self._record_problem(confirmed)
        if origin is not None:
            problems.append(origin)
        promoted = promotion_note(self.conn, settings, slot, recorded)
        try:
            _, warning = resolve_start(
                name, confirmed, recorded, settings.allow_slot_reset, promoted
            )
        except PositionMismatch as exc:
            problems.append(str(exc))
            warning = None
        if problems:
            raise Unmet("; ".join(problems))
        retained = _size(slot.retained_wal) if slot.retained_wal is not None else "unknown"
        detail = (
            f"{name} ({slot.plugin}) {leader or 'idle'}, confirmed {format_lsn(confirmed)}, "
            f"retained WAL {retained}, wal_status {slot.wal_status}"
        )
        if slot.wal_status == "unreserved":
            detail += " (beyond max_wal_size: at risk of being lost; is the relay running?)"
        if warning:
            detail += f"; {warning}"
        return detail

    def _unfinished_recovery(self) -> str | None:
        """A recovery (of a lost slot, a publication gap, an adoption) the record shows begun
        and not ended, in words; None: none."""
        try:
            record = self._store().load_record()
        except (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn, SourceSetupError):
            return None  # reported by the state table check
        plan = in_progress(record.recovery)
        return None if plan is None else interrupted(self.settings.slot_name, plan)

    def _streaming_leader(self, slot: SlotState) -> str | None:
        """Who streams the slot, when that is the leading relay: its walsender is the one its
        valid lease names. None when the slot is idle or held by anything else."""
        if slot.active_pid is None:
            return None
        lease = sql.Identifier(self.settings.state_schema, LEASE_TABLE)
        try:
            row = self.conn.execute(
                sql.SQL(
                    "SELECT l.holder, a.backend_start, l.expires_at FROM {} l "
                    "LEFT JOIN pg_stat_activity a ON a.pid = l.stream_pid "
                    "WHERE l.slot_name = %s AND l.stream_pid = %s AND l.expires_at > now()"
                ).format(lease),
                (self.settings.slot_name, slot.active_pid),
            ).fetchone()
        except (psycopg.errors.UndefinedTable, psycopg.errors.InsufficientPrivilege):
            return None
        if row is None:
            return None
        holder, since, expires = row
        return (
            f"streamed by the leading relay {holder} (walsender {slot.active_pid}, streaming "
            f"since {since or 'unknown'}; lease valid until {expires})"
        )

    def failover(self) -> str:
        """Whether the slot follows a promotion (PostgreSQL 17+), and whether standbys are held
        back until they have what the relay reads (``synchronized_standby_slots``)."""
        try:
            return describe(self.conn, self.settings, self._slot())
        except SourceSetupError as exc:
            raise Unmet(str(exc)) from None

    def slot_kind(self, slot: SlotState) -> str:
        """A logical slot for the configured plugin, in this database."""
        wanted = self.settings.plugin.value
        here = str(scalar(self.conn, "SELECT current_database()"))
        if slot.kind != "logical" or slot.plugin != wanted or slot.database != here:
            raise Unmet(
                f"{slot.name} is a {slot.kind} slot for plugin {slot.plugin!r} in database "
                f"{slot.database!r}, but this relay needs a logical {wanted!r} slot in {here!r} "
                "(CDC_RELAY_PLUGIN): drop it (after stopping whatever uses it) or choose another "
                "CDC_RELAY_SLOT_NAME"
            )
        return f"logical {wanted} slot in {here}"

    def slot_free(self, slot: SlotState) -> str:
        """No other process streams from the slot (SlotInUse: that may end, so it is retried)."""
        if slot.active_pid is not None:
            raise Unmet(self._holder(slot.name, slot.active_pid), SlotInUse)
        return "idle"

    def _holder(self, name: str, pid: int) -> str:
        row = self.conn.execute(
            "SELECT application_name, client_addr::text, usename FROM pg_stat_activity "
            "WHERE pid = %s",
            (pid,),
        ).fetchone()
        who = ""
        if row is not None:
            app, client, user = row
            where = f" from {client}" if client else ""
            who = f" (application_name {app!r}, user {user}{where})"
        return (
            f"{name} is in use by process {pid}{who}: another relay or replication client is "
            "streaming from it. Stop it before starting this relay, or give this relay its own "
            "CDC_RELAY_SLOT_NAME"
        )

    def _recorded(self) -> int | None:
        try:
            return self._store().load()
        except (psycopg.errors.UndefinedTable, psycopg.errors.InsufficientPrivilege):
            return None  # reported by the state table check

    def _record_problem(self, slot_confirmed: int) -> str | None:
        """Why the position record cannot be this server's (cdc_relay.record_origin), if so."""
        try:
            record = self._store().load_record()
        except (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn):
            return None  # reported by the state table check
        except SourceSetupError as exc:
            return str(exc)
        if record.stamp is None:
            return None
        url = self.settings.source_url()

        def history(timeline: int) -> list[tuple[int, int]]:
            try:
                return history_switches(timeline_history(url, timeline))
            except RelayError:
                return []  # unreadable: the stamp's timeline counts as not in it

        reason = problem(record.stamp, record.server, history)
        if reason is None:
            return None
        settings = self.settings
        return refusal(reason, settings.state_schema, settings.slot_name, slot_confirmed)

    def wal2json(self) -> str | None:
        if self.settings.plugin is not Plugin.WAL2JSON:
            return None
        probe_name = f"cdc_relay_check_{os.getpid()}"
        url = self.settings.source_url()
        with connect(url) as probe:
            probe.execute(sql.SQL("SET statement_timeout = {}").format(sql.Literal(PROBE_TIMEOUT)))
            try:
                probe.execute(
                    "SELECT pg_create_logical_replication_slot(%s, 'wal2json', true)",
                    (probe_name,),
                )
            except psycopg.errors.UndefinedFile:
                major = int(str(scalar(self.conn, "SHOW server_version_num"))) // 10000
                raise Unmet(plugin_missing(Plugin.WAL2JSON.value, major)) from None
            except psycopg.errors.QueryCanceled:
                # The plugin loaded; creating the slot then waits for running transactions.
                return "installed (the probe slot was still waiting for a long transaction)"
            except psycopg.Error as exc:
                slot = self._slot()
                if slot is not None and slot.plugin == Plugin.WAL2JSON.value:
                    return f"slot {self.settings.slot_name} uses it"
                raise Unmet(
                    f"cannot tell whether wal2json is installed: creating a probe slot failed: "
                    f"{exc.diag.message_primary or exc}"
                ) from None
            probe.execute("SELECT pg_drop_replication_slot(%s)", (probe_name,))
        return "installed"


def _size(value: int) -> str:
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"
