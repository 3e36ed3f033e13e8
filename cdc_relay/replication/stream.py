"""The replication connection: START_REPLICATION over psycopg's libpq layer, CopyBoth in and out.

psycopg 3 has no replication API, but its ``pq.PGconn`` exposes the libpq calls the protocol needs.
This module is the only place that touches that connection; libpq/psycopg failures leave it as
:class:`SourceUnavailable` (retry) or :class:`SourceSetupError` (an operator must act), sorted by
:mod:`cdc_relay.postgres_errors`.
"""

from __future__ import annotations

import select
import time
from collections.abc import Callable

import psycopg
from psycopg import pq, sql
from psycopg.conninfo import make_conninfo

from cdc_relay.database_url import scrub
from cdc_relay.errors import ProtocolError, SlotInUse, SourceSetupError, SourceUnavailable
from cdc_relay.lsn import format_lsn, parse_lsn
from cdc_relay.postgres_errors import During, connect_error, kind_of, message
from cdc_relay.replication.protocol import standby_status_update

APPLICATION_NAME = "cdc-relay"
# libpq reads the socket into an input buffer of 16 KiB, which it enlarges (doubles) only when
# asked to read while the buffer is full, and then keeps for the connection. At 16 KiB a catch-up
# takes in ~50 outbox rows per wake-up of the loop: a select, a recv and a pass of the loop each.
# So a wake-up that finds more still waiting after a read reads again, this many times per
# connection in all (16 KiB → 512 KiB); from then on one read takes in what the socket holds, up
# to the buffer's size. A cap, not a loop for as long as data waits: that would grow the buffer
# to whatever the TCP window lets the server send ahead (megabytes).
INPUT_BUFFER_DOUBLINGS = 5
# How long a replication command (and the connection before it) may go unanswered: a server that
# took the connection but does not answer is given up on (the session ends, and is retried). A
# stop ends the wait at once, whatever this is. The start passes its own, from the lease.
ANSWER_TIMEOUT = 30.0
POLL_INTERVAL = 0.2  # the look at a stop request while a command waits


def _never() -> bool:
    return False


def replication_conninfo(database_url: str) -> str:
    return make_conninfo(
        database_url,
        replication="database",
        application_name=APPLICATION_NAME,
        client_encoding="UTF8",
    )


class ReplicationStream:
    """One streaming session of a logical slot, from ``start_lsn``."""

    def __init__(
        self,
        database_url: str,
        slot_name: str,
        start_lsn: int,
        plugin_options: dict[str, str],
        *,
        coalesce: float = 0.0,
        stopping: Callable[[], bool] = _never,
        answer_timeout: float = ANSWER_TIMEOUT,
    ) -> None:
        self._conninfo = replication_conninfo(database_url)  # timeouts: Settings.source_url()
        self._stopping = stopping
        self._answer_timeout = answer_timeout
        self._slot_name = slot_name
        self._start_lsn = start_lsn
        self._options = plugin_options
        self._connection: psycopg.Connection[tuple[object, ...]] | None = None  # owns _conn
        self._conn: pq.abc.PGconn | None = None
        self._coalesce = coalesce
        self._fed = False  # the last wait brought data
        self._woke_at = 0.0
        self._doublings = INPUT_BUFFER_DOUBLINGS
        self.timeline: tuple[str, int] | None = None  # the server's, read by open()

    @property
    def backend_pid(self) -> int:
        """The walsender's process id (``pg_replication_slots.active_pid`` while streaming)."""
        assert self._conn is not None
        return int(self._conn.backend_pid)

    def open(self) -> None:
        """Connect and ``START_REPLICATION``; no step waits past the answer timeout or a stop."""
        answering = Answering(self._answer_timeout, self._stopping)
        connection = answering.connect(self._conninfo)
        conn = connection.pgconn
        try:
            # Where this stream reads (one round trip here, rather than a connection of its own).
            self.timeline = _system(_run(conn, "IDENTIFY_SYSTEM", answering))
        except BaseException:
            connection.close()
            raise
        # A replication command, not SQL: names are quoted identifiers (psycopg's Identifier;
        # wal2json's options have dashes), but the walsender's grammar knows only plain '...'
        # strings with '' for a quote — no E'' strings, which sql.Literal may produce.
        options = ", ".join(
            f"{sql.Identifier(k).as_string(None)} '{v.replace(chr(39), chr(39) * 2)}'"
            for k, v in self._options.items()
        )
        command = (
            f"START_REPLICATION SLOT {sql.Identifier(self._slot_name).as_string(None)} LOGICAL "
            f"{format_lsn(self._start_lsn)} ({options})"
        )
        try:
            result = answering.result(conn, command, "START_REPLICATION")
        except BaseException:
            connection.close()
            raise
        if result is None or result.status != pq.ExecStatus.COPY_BOTH:
            sqlstate = _text(result.error_field(pq.DiagnosticField.SQLSTATE)) if result else ""
            message = _text(result.get_error_message()) if result else ""
            message = message or _text(conn.get_error_message())
            connection.close()
            _raise_for_sqlstate(sqlstate, message, self._slot_name)
        self._connection, self._conn = connection, conn
        self._doublings = INPUT_BUFFER_DOUBLINGS  # a new connection's buffer is 16 KiB again

    @property
    def fileno(self) -> int:
        return self._require().socket

    def read(self) -> memoryview | None:
        """The next CopyData payload already received, or None. Never waits."""
        conn = self._conn  # once per message: _require() inlined, a Python call saved
        if conn is None:
            raise ProtocolError("replication stream used before open() or after close()")
        try:
            size, data = conn.get_copy_data(1)
        except psycopg.OperationalError as exc:
            raise SourceUnavailable(f"replication connection lost: {message(exc)}") from None
        if size > 0:
            return data
        if size == 0:
            return None
        self._raise_stream_end()
        raise AssertionError("unreachable")

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the server to send more and take it in.

        False when nothing arrived. A relay woken for every message of a moderate stream spends
        most of its CPU being woken (measured ~150 µs per event at 1,000 one-row transactions/s
        on 2 shared cores, against ~10 µs in a catch-up). So after a wake-up that brought data,
        when nothing more is waiting yet, the next wait first sleeps until ``coalesce`` seconds
        have passed since that wake-up: what arrives meanwhile is read in one go, for at most
        ``coalesce`` seconds of added latency. Data already waiting is always read at once.
        """
        conn = self._require()
        sock = [conn.socket]
        if self._fed and self._coalesce > 0:
            readable, _, _ = select.select(sock, [], [], 0)
            if not readable:
                pause = self._woke_at + self._coalesce - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
                readable, _, _ = select.select(sock, [], [], 0)
        else:
            readable, _, _ = select.select(sock, [], [], timeout)
        self._woke_at = time.monotonic()
        self._fed = bool(readable)
        if readable:
            try:
                conn.consume_input()
                while self._doublings and select.select(sock, [], [], 0)[0]:
                    self._doublings -= 1
                    conn.consume_input()
            except psycopg.OperationalError as exc:
                raise SourceUnavailable(f"replication connection lost: {message(exc)}") from None
        return self._fed

    def send_status(self, written: int, flushed: int, reply: bool = False) -> None:
        conn = self._require()
        try:
            conn.put_copy_data(standby_status_update(written, flushed, flushed, reply=reply))
            conn.flush()
        except psycopg.OperationalError as exc:
            raise SourceUnavailable(f"replication connection lost: {message(exc)}") from None

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = self._conn = None

    def _raise_stream_end(self) -> None:
        """The COPY ended (-1) or failed (-2): find out why from the pending result."""
        conn = self._require()
        message = _text(conn.get_error_message())
        sqlstate = ""
        try:
            result = conn.get_result()
        except psycopg.OperationalError:
            result = None
        if result is not None:
            message = _text(result.get_error_message()) or message
            sqlstate = _text(result.error_field(pq.DiagnosticField.SQLSTATE))
        self.close()
        if kind_of(sqlstate, During.REPLICATION) is SourceSetupError:
            _raise_for_sqlstate(sqlstate, message, self._slot_name)
        raise SourceUnavailable(
            f"replication stream ended: {message or 'server closed the stream'}"
        )

    def _require(self) -> pq.abc.PGconn:
        if self._conn is None:
            raise ProtocolError("replication stream used before open() or after close()")
        return self._conn


def _text(value: bytes | str | None) -> str:
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    return value.strip() if value else ""


def _raise_for_connect(message: str, conninfo: str) -> None:
    lowered = message.lower()
    if "must be superuser or replication role" in lowered or "permission denied" in lowered:
        raise SourceSetupError(
            f"{scrub(message, conninfo)}. Grant it with: ALTER ROLE <user> WITH REPLICATION; "
            "and allow replication connections in pg_hba.conf"
        )
    raise connect_error(message, None, conninfo, "cannot connect for replication")


def _raise_for_sqlstate(sqlstate: str, message: str, slot_name: str) -> None:
    kind = kind_of(sqlstate, During.REPLICATION)
    if kind is SlotInUse:
        raise SlotInUse(
            f"{message}. Another process is streaming from slot {slot_name!r}: stop it, or give "
            "this relay its own slot with CDC_RELAY_SLOT_NAME"
        )
    if kind is SourceSetupError:
        raise SourceSetupError(f"START_REPLICATION failed: {message}")
    raise SourceUnavailable(f"START_REPLICATION failed: {message or 'connection lost'}")


# -- waiting for the server ------------------------------------------------------------------------


class Answering:
    """Waits for a command's answer the way psycopg's generators do — libpq never blocks, the
    socket is watched here — so that a server that took the connection but does not answer (a
    stopped walsender, a network cut while the kernel still acknowledges) holds a command for at
    most ``timeout`` seconds from the start of the exchange, and a stop ends the wait within
    :data:`POLL_INTERVAL` (SourceUnavailable either way)."""

    def __init__(self, timeout: float, stopping: Callable[[], bool] = _never) -> None:
        self._timeout = timeout
        self._deadline = time.monotonic() + timeout
        self._stopping = stopping

    @staticmethod
    def connect(conninfo: str) -> psycopg.Connection[tuple[object, ...]]:
        """A replication connection, made by psycopg: it walks a multi-host URL host by host,
        each within ``connect_timeout`` (Settings.source_url), waiting in ``select`` — libpq's
        own blocking connect would hold the interpreter, and so the relay's other threads
        (leadership, health), for the whole attempt. The protocol then runs on its ``pgconn``."""
        try:
            return psycopg.Connection.connect(conninfo, autocommit=True)
        except psycopg.OperationalError as exc:
            _raise_for_connect(message(exc), conninfo)
            raise AssertionError("unreachable") from None

    def result(self, conn: pq.abc.PGconn, command: str, what: str) -> pq.abc.PGresult | None:
        """Send ``command``; its first result (a COPY's begins the copy), or None."""
        try:
            conn.send_query(command.encode())
        except psycopg.OperationalError as exc:
            raise SourceUnavailable(f"{what} failed: {message(exc)}") from None
        return self.next_result(conn, what)

    def next_result(self, conn: pq.abc.PGconn, what: str) -> pq.abc.PGresult | None:
        """The command's next result once libpq has it (None: the command is done)."""
        try:
            while True:
                conn.consume_input()
                if not conn.is_busy():
                    return conn.get_result()
                self._wait(conn.socket, what)
        except psycopg.OperationalError as exc:
            raise SourceUnavailable(f"{what} failed: {message(exc)}") from None

    def _wait(self, fileno: int, what: str) -> None:
        if self._stopping():
            raise SourceUnavailable(f"stopped while waiting for the server to answer {what}")
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise SourceUnavailable(
                f"the server did not answer {what} within {self._timeout:g} s (it accepted the "
                "connection but does not answer: overloaded, stopped, or cut off)"
            )
        select.select([fileno], [], [], min(left, POLL_INTERVAL))


# -- one-off replication commands -----------------------------------------------------------------


def _command(
    database_url: str, command: str, answer_timeout: float = ANSWER_TIMEOUT
) -> list[tuple[bytes | None, ...]]:
    """Run one replication command on a connection of its own; its rows, as raw values."""
    answering = Answering(answer_timeout)
    with answering.connect(replication_conninfo(database_url)) as connection:
        return _run(connection.pgconn, command, answering)


def _run(conn: pq.abc.PGconn, command: str, answering: Answering) -> list[tuple[bytes | None, ...]]:
    """One replication command on an open replication connection; its rows, as raw values."""
    name = command.split(maxsplit=1)[0]
    result = answering.result(conn, command, name)
    # The rest of a simple query's results, up to its end (ReadyForQuery).
    while answering.next_result(conn, name) is not None:
        pass
    if result is None:
        raise SourceUnavailable(f"{name} failed: {_text(conn.get_error_message()) or 'no result'}")
    if result.status not in (pq.ExecStatus.TUPLES_OK, pq.ExecStatus.COMMAND_OK):
        sqlstate = _text(result.error_field(pq.DiagnosticField.SQLSTATE))
        message = _text(result.get_error_message()) or _text(conn.get_error_message())
        failed = f"{command.split(maxsplit=1)[0]} failed: {message or 'connection lost'}"
        raise kind_of(sqlstate, During.COMMAND)(failed)
    return [
        tuple(result.get_value(row, col) for col in range(result.nfields))
        for row in range(result.ntuples)
    ]


def enable_failover(database_url: str, slot_name: str) -> None:
    """Make an existing (idle) logical slot a failover slot: ``ALTER_REPLICATION_SLOT`` (PG 17+),
    a replication command, so over a replication connection."""
    slot = sql.Identifier(slot_name).as_string(None)
    _command(database_url, f"ALTER_REPLICATION_SLOT {slot} (FAILOVER true)")


def timeline(database_url: str, answer_timeout: float = ANSWER_TIMEOUT) -> tuple[str, int]:
    """The server's system identifier and current timeline (``IDENTIFY_SYSTEM``): a promoted
    standby keeps the first and starts a new second."""
    return _system(_command(database_url, "IDENTIFY_SYSTEM", answer_timeout))


def _system(rows: list[tuple[bytes | None, ...]]) -> tuple[str, int]:
    """(system identifier, timeline) from IDENTIFY_SYSTEM's row."""
    if not rows or rows[0][1] is None:
        raise SourceUnavailable("IDENTIFY_SYSTEM returned no timeline")
    return _text(rows[0][0]), int(_text(rows[0][1]))


def timeline_start(
    database_url: str,
    current: int | None = None,
    since: int | None = None,
    answer_timeout: float = ANSWER_TIMEOUT,
) -> int | None:
    """Where the server's history left timeline ``since`` (default: the parent of its current
    timeline) — for a promoted standby, the WAL position at which it was promoted; None on
    timeline 1 (a server never promoted). From ``IDENTIFY_SYSTEM`` and the ``TIMELINE_HISTORY``
    file, which a REPLICATION role may read."""
    timeline_id = timeline(database_url, answer_timeout)[1] if current is None else current
    if timeline_id <= 1:
        return None
    history = _command(database_url, f"TIMELINE_HISTORY {timeline_id}", answer_timeout)
    content = history[0][1] if history else None
    return switch_point(bytes(content or b""), since)


def timeline_history(
    database_url: str, timeline_id: int, answer_timeout: float = ANSWER_TIMEOUT
) -> bytes:
    """The server's history file of timeline ``timeline_id`` (``TIMELINE_HISTORY``, which a
    REPLICATION role may read); empty for timeline 1, which has none."""
    if timeline_id <= 1:
        return b""
    rows = _command(database_url, f"TIMELINE_HISTORY {int(timeline_id)}", answer_timeout)
    return bytes(rows[0][1] or b"") if rows else b""


def switch_point(history: bytes, since: int | None = None) -> int | None:
    """From a timeline history file (``<parent>\\t<lsn>\\t<reason>`` lines, possibly as bytea
    hex text): where the history left timeline ``since`` (up to there it is that timeline's), or
    without ``since`` the last switch, where the current timeline began. A ``since`` the file does
    not name gives the earliest switch, the conservative answer."""
    if history.startswith(b"\\x"):
        try:
            history = bytes.fromhex(history[2:].decode("ascii"))
        except ValueError:
            return None
    switches: list[tuple[int, int]] = []
    for line in history.decode("utf-8", "replace").splitlines():
        fields = line.strip().split()
        if len(fields) >= 2 and fields[0].isdigit():
            try:
                switches.append((int(fields[0]), parse_lsn(fields[1])))
            except ValueError:
                continue
    if not switches:
        return None
    if since is None:
        return switches[-1][1]
    for parent, lsn in switches:
        if parent >= since:
            return lsn
    return switches[0][1]
