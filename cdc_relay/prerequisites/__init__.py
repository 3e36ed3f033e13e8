"""What the relay needs of its database, checked in one place for its two callers.

The checks are grouped by what they check, one module each: the server and the role
(:mod:`.server`), the outbox tables (:mod:`.tables`), the publication (:mod:`.publication`), the
slot (:mod:`.slot`), the state tables and leadership (:mod:`.state`), table-less messages
(:mod:`.messages`), locks and transactions the relay would wait for (:mod:`.waits`). Each
returns what it found (an ``ok`` line's detail) or raises :class:`Unmet` with what to do about it.
:class:`Prerequisites` holds them all on one connection:

* the relay's start (and ``setup``) calls :func:`require`: the prerequisites it cannot stream
  without (server, role, tables, an existing publication's coverage), in order, stopping at the
  first unmet one with the project's error (exit 3);
  :func:`require_usable_slot` then judges the slot it found;
* ``python -m cdc_relay check`` runs every check of :meth:`Prerequisites.report` and prints one
  line each (:func:`outcome`).

Messages about the slot that only the relay's own record can explain (a slot dropped or advanced
behind the relay's back) belong to :mod:`cdc_relay.checkpoint`, which decides where to start.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import psycopg

from cdc_relay.config import Settings
from cdc_relay.errors import RelayError, SourceUnavailable
from cdc_relay.postgres_errors import message
from cdc_relay.prerequisites.messages import MessageChecks
from cdc_relay.prerequisites.probe import Probe, Unmet
from cdc_relay.prerequisites.publication import PublicationChecks
from cdc_relay.prerequisites.server import ServerChecks
from cdc_relay.prerequisites.slot import SlotChecks
from cdc_relay.prerequisites.state import StateChecks
from cdc_relay.prerequisites.tables import TableChecks
from cdc_relay.prerequisites.waits import WaitChecks
from cdc_relay.publication_filter import find_mismatch
from cdc_relay.publication_stamp import PublicationStamp, StampQuery, read_stamp
from cdc_relay.replication.source import Connection, SlotState

__all__ = [
    "CheckResult",
    "Prerequisites",
    "Unmet",
    "outcome",
    "require",
    "require_usable_slot",
    "verified_stamp",
]

log = logging.getLogger(__name__)

Check = Callable[[], "str | None"]


@dataclass(frozen=True)
class CheckResult:
    """One check's verdict: ``ok   <name>: <what was found>`` or ``FAIL <name>: <what to do>``."""

    name: str
    ok: bool
    detail: str

    def __str__(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'} {self.name}: {self.detail}"


def outcome(name: str, probe: Check) -> CheckResult | None:
    """Run one check for a report; None when it does not apply to these settings."""
    try:
        detail = probe()
    except Unmet as exc:
        return CheckResult(name, False, exc.fix)
    except RelayError as exc:
        return CheckResult(name, False, str(exc).strip())
    except psycopg.Error as exc:
        return CheckResult(name, False, message(exc))
    return None if detail is None else CheckResult(name, True, detail)


class Prerequisites:
    """Every check of the source database, on one connection, grouped by what it checks."""

    def __init__(self, conn: Connection, settings: Settings) -> None:
        probe = Probe(conn, settings)
        self.tables = probe.tables
        self.server = ServerChecks(probe)
        self.outbox = TableChecks(probe)
        self.publication = PublicationChecks(probe)
        self.slot = SlotChecks(probe)
        self.state = StateChecks(probe)
        self.messages = MessageChecks(probe)
        self.waits = WaitChecks(probe)

    def report(self) -> list[tuple[str, Check]]:
        """What ``check`` runs, named, in the order it prints them."""
        server, slot, state = self.server, self.slot, self.state
        checks: list[tuple[str, Check]] = [
            ("server version", server.server_version),
            ("wal_level", server.wal_level),
            ("replication slots", server.replication_slots),
            ("wal senders", server.wal_senders),
            ("privileges", server.privileges),
            ("output plugin", server.output_plugin),
        ]
        checks += [(f"table {t.table}", partial(self.outbox.table, t)) for t in self.tables]
        checks += [
            ("state table", state.state_table),
            ("publication", self.publication.publication),
            ("slot", slot.slot),
            ("messages", self.messages.messages),
            ("leadership", state.leadership),
            ("waits", self.waits.waits),
            ("failover", slot.failover),
            ("wal2json", slot.wal2json),
        ]
        return checks


def require(conn: Connection, settings: Settings) -> None:
    """The relay's start: what it cannot stream without, in order; raises at the first unmet
    prerequisite (SourceSetupError, exit 3) with the statement that fixes it."""
    checks = Prerequisites(conn, settings)
    steps: list[tuple[str, Callable[[], object]]] = [
        ("server version", checks.server.server_version),
        ("wal_level", checks.server.wal_level),
        ("privileges", checks.server.replication_role),
        ("output plugin", checks.server.output_plugin),
    ]
    steps += [(f"table {t.table}", partial(checks.outbox.table_columns, t)) for t in checks.tables]
    steps.append(("publication", checks.publication.publication_covers))
    if settings.messages:
        steps.append(("messages", checks.messages.messages))
    _require_steps(steps)
    if not settings.messages and checks.messages.emit_functions():
        log.warning(
            "table-less messages are off, yet outbox_emit exists: what it writes is not relayed",
            extra={"fields": {"fix": "set CDC_RELAY_MESSAGES=true if writers use it"}},
        )


def verified_stamp(conn: Connection, settings: Settings) -> PublicationStamp:
    """The publication's stamp (:mod:`cdc_relay.publication_stamp`), read, then verified: each
    outbox table is a table, the publication exists and covers every outbox table's inserts and
    columns, with the row filters the settings say — what the stamp's later checks then prove
    unchanged. SourceSetupError at the first unmet one; SourceUnavailable (start again) when the
    filters differ from those the start has just set."""
    query = StampQuery.of(
        settings.plugin, settings.publication_name, settings.tables(), conn.info.server_version
    )
    stamp = read_stamp(conn, query)
    checks = Prerequisites(conn, settings)
    steps: list[tuple[str, Callable[[], object]]] = [
        (f"table {t.table}", partial(checks.outbox.table_kind, t)) for t in checks.tables
    ]
    steps.append(("publication", checks.publication.publication_streams))
    _require_steps(steps)
    mismatch = find_mismatch(conn, settings.publication_name, checks.tables)
    if mismatch is not None:
        raise SourceUnavailable(
            f"publication {mismatch.publication}'s row filters changed while the relay started "
            f"({mismatch.describe()}): starting again"
        )
    return stamp


def _require_steps(steps: list[tuple[str, Callable[[], object]]]) -> None:
    """Run named checks in order; the first unmet one raises its error, named."""
    for name, probe in steps:
        try:
            probe()
        except Unmet as exc:
            raise exc.error(f"{name}: {exc.fix}") from None


def require_usable_slot(conn: Connection, settings: Settings, slot: SlotState) -> None:
    """The slot the relay is about to stream: for its plugin, in this database, held by nobody
    (SlotInUse, retried later, when another process streams from it)."""
    checks = Prerequisites(conn, settings)
    try:
        checks.slot.slot_kind(slot)
        checks.slot.slot_free(slot)
    except Unmet as exc:
        raise exc.error(f"slot: {exc.fix}") from None
