"""A new logical slot whose start is a snapshot: ``CREATE_REPLICATION_SLOT``, exporting one.

The server creates the slot, waits for the transactions running then, and exports a snapshot of
the moment its decoding begins (the *consistent point*): every transaction committed before that
point is visible in the snapshot and is never decoded; every one committed after it is decoded by
the slot and invisible in the snapshot. The snapshot lives as long as the replication connection
that created the slot stays idle, so :class:`SlotWithSnapshot` keeps it open while another
connection imports the snapshot (``SET TRANSACTION SNAPSHOT``) and reads in it.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from types import TracebackType

import psycopg
from psycopg import sql

from cdc_relay.errors import SourceUnavailable
from cdc_relay.lsn import parse_lsn
from cdc_relay.replication.stream import Answering, _run, _text, replication_conninfo

SNAPSHOT_OPTION_VERSION = 150000  # (SNAPSHOT 'export'); 14 spells it EXPORT_SNAPSHOT
FAILOVER_VERSION = 170000  # (FAILOVER true)
# Creating the slot waits for the transactions running when it begins, as long as they run: a
# retry would wait for those running then. A stop ends the wait (and so does the watch).
CREATE_TIMEOUT = 24 * 3600.0

Connection = psycopg.Connection[tuple[object, ...]]
# Watches the creation (cdc_relay.waits: named while it waits, cancelled on a stop).
Watching = Callable[[Connection], AbstractContextManager[None]]


@dataclass(frozen=True)
class ExportedSlot:
    """The slot just created: where its decoding begins, and the snapshot of that moment."""

    name: str
    consistent_point: int
    snapshot_name: str


def create_command(slot: str, plugin: str, server_version: int, failover: bool) -> str:
    """The replication command creating ``slot`` with an exported snapshot (names quoted as
    identifiers: the walsender's grammar takes them)."""
    name = sql.Identifier(slot).as_string(None)
    output = sql.Identifier(plugin).as_string(None)
    if server_version < SNAPSHOT_OPTION_VERSION:
        return f"CREATE_REPLICATION_SLOT {name} LOGICAL {output} EXPORT_SNAPSHOT"
    options = ["SNAPSHOT 'export'"]
    if failover and server_version >= FAILOVER_VERSION:
        options.append("FAILOVER true")
    return f"CREATE_REPLICATION_SLOT {name} LOGICAL {output} ({', '.join(options)})"


class SlotWithSnapshot:
    """``with SlotWithSnapshot(url, slot, plugin, failover) as created:`` — the slot is created on
    entry; its snapshot can be imported until the block ends (the connection closes)."""

    def __init__(
        self,
        database_url: str,
        slot: str,
        plugin: str,
        failover: bool,
        *,
        stopping: Callable[[], bool],
        watching: Watching | None = None,
    ) -> None:
        self._conninfo = replication_conninfo(database_url)
        self._slot = slot
        self._plugin = plugin
        self._failover = failover
        self._stopping = stopping
        self._watching = watching
        self._conn: Connection | None = None

    def __enter__(self) -> ExportedSlot:
        answering = Answering(CREATE_TIMEOUT, self._stopping)
        conn = answering.connect(self._conninfo)
        self._conn = conn
        try:
            command = create_command(
                self._slot, self._plugin, conn.info.server_version, self._failover
            )
            watch = self._watching(conn) if self._watching is not None else nullcontext()
            with watch:
                rows = _run(conn.pgconn, command, answering)
        except BaseException:
            self.close()
            raise
        if not rows or rows[0][1] is None or rows[0][2] is None:
            self.close()
            raise SourceUnavailable("CREATE_REPLICATION_SLOT returned no snapshot")
        return ExportedSlot(self._slot, parse_lsn(_text(rows[0][1])), _text(rows[0][2]))

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
