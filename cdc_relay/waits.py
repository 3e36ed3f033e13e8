"""Every wait on PostgreSQL is bounded or visible: the one owner of "who blocks us".

A statement can wait on the server for ever: behind a lock another session holds (a row of the
position record, a table a DDL statement alters), for transactions to end (creating a logical
slot waits for every transaction that holds a transaction id when it begins), or on a server that
took the connection but no longer answers. None of these raises an error by itself, and a relay
waiting in silence looks healthy. So:

- :func:`blockers_of` asks the server who blocks a waiting backend (``pg_blocking_pids``,
  ``pg_locks``, ``pg_stat_activity``): pid, role, application, state, since when its transaction
  runs, the lock it holds. Any role may read these, but another role's state and transaction start
  show only to its members and to ``pg_read_all_stats``: they are then reported as hidden.
- :class:`WaitWatch` watches the statements run inside :meth:`WaitWatch.watching`. One that has
  run for ``notice_after`` seconds (:data:`NOTICE_AFTER`; the start passes half its lock timeout
  when that is shorter, so that the holder is still there to name) is named in a WARNING — what
  waits, what it waits for, who holds it, what that means and how to end it — and again every
  :data:`REPEAT_INTERVAL` while it lasts. A statement still running :data:`STOP_GRACE` after a
  stop was requested, or past its ``deadline``, is cancelled; a server that does not act on the
  cancel within :data:`CANCEL_GRACE` has the connection's socket shut, so the statement fails at
  once even on a server that does not answer. Such a failure, and a server-side lock timeout,
  surface as SourceUnavailable naming the blockers last seen.

Which wait is bounded by what (the operators' page, ``docs/operations/waits-and-locks.md``, has
the same table):

- the start's statements and its writes of the relay's state (the position record, the lease's
  walsender pid, the state tables' and the publication's DDL) run with ``lock_timeout``
  :func:`write_lock_timeout`: a fifth of the lease, at most :data:`MAX_WRITE_WAIT`; their failure
  ends the start or the session, and the next one is retried with backoff;
- the position writes while streaming likewise: a leader that cannot record its position stops
  streaming (its session ends) instead of publishing on unconfirmed, and retries;
- creating the slot waits as long as the transactions it waits for run (a retry would start
  waiting afresh), named, and cancelled by a stop;
- ``setup`` waits for its DDL and the slot, named; Ctrl-C or SIGTERM ends it;
- the leader lease's statements have their own ``statement_timeout``, and are watched with a
  deadline a little past it (:mod:`cdc_relay.leadership`); the sweeper's have their own lock and
  statement timeouts (:mod:`cdc_relay.sweeper`).

``python -m cdc_relay check`` reports what would hold the relay up now (:func:`held_up_by`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

import psycopg
from psycopg import sql

from cdc_relay.errors import SourceError
from cdc_relay.postgres_errors import During, error_for

log = logging.getLogger(__name__)

NOTICE_AFTER = 1.0  # seconds a statement runs before its wait is named
REPEAT_INTERVAL = 30.0  # and again this often while it lasts
STOP_GRACE = 1.0  # a statement still running this long after a stop request is cancelled
CANCEL_GRACE = 2.0  # a cancel not acted on within this long: the connection's socket is shut
POLL_INTERVAL = 0.2  # the watch's look at a stop request and at deadlines while statements run
WRITE_WAIT_SHARE = 0.2  # of the lease: below a renewal's statement timeout (a quarter of it)
MAX_WRITE_WAIT = 5.0  # seconds: a stop's last confirm is never held up longer
# A statement waiting on no lock and not answered this long past its lock timeout: the server is
# taken for one that does not answer (a statement's ``deadline`` is its lock timeout plus this).
ANSWER_MARGIN = 5.0
NAMING_TIMEOUT = "5s"  # statement_timeout of the watch's own connection
# lock_timeout, statement_timeout: the server ended a statement that waited too long.
_TIMEOUTS = (psycopg.errors.LockNotAvailable, psycopg.errors.QueryCanceled)

Connection = psycopg.Connection[tuple[object, ...]]

# What each wait means, for the line that names it.
START_MEANS = "the relay's start waits for it: nothing is streamed before"
SLOT_MEANS = (
    "creating a logical slot waits for every transaction that holds a transaction id when it "
    "begins: the slot cannot be created until this transaction ends; end it with "
    "pg_terminate_backend(pid), or wait"
)
PUBLICATION_MEANS = "the publication cannot be created or changed until this lock is released"
STATE_DDL_MEANS = (
    "the relay's state tables cannot be created or completed until this lock is released"
)
POSITION_MEANS = (
    "the relay cannot record its position (nor confirm the slot) while this is held: the write "
    "gives up after its lock timeout, the session ends and the relay retries, publishing "
    "nothing new meanwhile"
)
SETUP_MEANS = "setup waits until this lock is released"


def write_lock_timeout(lease_timeout: float) -> float:
    """Seconds a write of the relay's state, or a start's DDL, waits for a lock.

    A position write locks the lease row first (the fence, :mod:`cdc_relay.checkpoint`), so a
    renewal waits behind it: this stays below a renewal's statement timeout (a quarter of the
    lease), and a blocked position record never costs the leadership. At most
    :data:`MAX_WRITE_WAIT`, so that a stop's last confirm is not held up longer."""
    return min(MAX_WRITE_WAIT, lease_timeout * WRITE_WAIT_SHARE)


def lock_timeout_statement(seconds: float) -> sql.Composed:
    """``SET lock_timeout`` to ``seconds`` (whole milliseconds, at least one: 0 would be none)."""
    return sql.SQL("SET lock_timeout = {}").format(
        sql.Literal(f"{max(1, math.ceil(seconds * 1000))}ms")
    )


# -- who blocks a backend ------------------------------------------------------------------------


@dataclass(frozen=True)
class Blocker:
    """A session that holds what a waiting backend waits for (or waits ahead of it)."""

    pid: int
    role: str | None
    application: str | None
    state: str | None  # None: hidden from this role
    xact_start: datetime | None  # None: no transaction, or hidden from this role
    holds: str  # the lock it holds that the waiter waits for ("" : it is queued ahead)
    hidden: bool  # pg_stat_activity hides its state and transaction start from this role

    def describe(self) -> str:
        if self.pid == 0:
            return f"a prepared transaction (pg_prepared_xacts), holding {self.holds or 'it'}"
        who = [f"role {self.role or 'unknown'}", f"application {self.application or '(none)'!r}"]
        if self.hidden:
            who.append("state and transaction start hidden (pg_read_all_stats shows them)")
        else:
            who.append(self.state or "state unknown")
            if self.xact_start is not None:
                who.append(f"transaction open since {self.xact_start.isoformat(sep=' ')}")
        holding = f", holding {self.holds}" if self.holds else ", queued ahead for the same lock"
        return f"pid {self.pid} ({', '.join(who)}){holding}"

    def fix(self) -> str:
        if self.pid == 0:
            return "COMMIT PREPARED or ROLLBACK PREPARED it (its gid is in pg_prepared_xacts)"
        return (
            f"end its transaction (COMMIT or ROLLBACK in that session), or end the session: "
            f"SELECT pg_terminate_backend({self.pid}) as a superuser or a member of role "
            f"{self.role or 'unknown'}"
        )


@dataclass(frozen=True)
class Waiting:
    """What a waiting backend waits for, and who holds it."""

    lock: str  # "" : it waits on no lock (a slow or unanswering server, or I/O)
    since: datetime | None  # when it began waiting for the lock
    blockers: tuple[Blocker, ...]

    def describe(self) -> str:
        if not self.blockers:
            return (
                "no session holds a lock it waits for: the server is slow to answer, or does "
                "not answer"
                if not self.lock
                else f"waits for {self.lock}, held by no session it can see"
            )
        return "; ".join(b.describe() for b in self.blockers)


_LOCK_KEY = (
    "locktype",
    "database",
    "relation",
    "page",
    "tuple",
    "virtualxid",
    "transactionid",
    "classid",
    "objid",
    "objsubid",
)
_SAME_LOCK = " AND ".join(f"h.{c} IS NOT DISTINCT FROM w.{c}" for c in _LOCK_KEY)
# The lock backend %(pid)s waits for (if any), and per backend pg_blocking_pids names: who it is
# and the modes in which it holds that lock (none: it is queued ahead of the waiter).
_WAITING_SQL = (
    "WITH w AS (SELECT * FROM pg_locks WHERE pid = %(pid)s AND NOT granted LIMIT 1) "
    "SELECT w.locktype, w.relation::regclass::text, w.transactionid::text, w.classid, w.objid, "
    "w.objsubid, w.mode, w.waitstart, b.pid, a.usename, a.application_name, a.state, "
    "a.xact_start, a.pid IS NOT NULL AND a.backend_start IS NULL, "
    "(SELECT string_agg(DISTINCT h.mode, ', ') FROM pg_locks h "
    f" WHERE h.pid = b.pid AND h.granted AND {_SAME_LOCK}) "
    "FROM (SELECT 1) one LEFT JOIN w ON true "
    "LEFT JOIN unnest(pg_blocking_pids(%(pid)s)) b(pid) ON true "
    "LEFT JOIN pg_stat_activity a ON a.pid = b.pid ORDER BY b.pid"
)


def describe_lock(lock: Sequence[object]) -> str:
    """A ``pg_locks`` row's target in words: ``lock`` is its locktype, relation (as text),
    transactionid, classid, objid and objsubid."""
    locktype, relation, transaction, classid, objid, objsubid = lock
    if locktype == "relation":
        return f"table {relation}"
    if locktype == "tuple":
        return f"a row of {relation}"
    if locktype == "transactionid":
        return f"transaction {transaction}"
    if locktype == "advisory":
        return f"advisory lock ({classid}, {objid}, {objsubid})"
    if locktype == "virtualxid":
        return "a virtual transaction"
    return f"a {locktype} lock" + (f" on {relation}" if relation else "")


def _text(value: object) -> str | None:
    return None if value is None else str(value)


def blockers_of(conn: Connection, pid: int) -> Waiting:
    """What backend ``pid`` waits for and who holds it, as ``conn``'s role can see it."""
    rows = conn.execute(_WAITING_SQL, {"pid": pid}).fetchall()
    if not rows or rows[0][0] is None:
        return Waiting("", None, ())
    target = describe_lock(rows[0][:6])
    mode, waitstart = rows[0][6:8]
    blockers = tuple(
        Blocker(
            pid=int(str(row[8])),
            role=_text(row[9]),
            application=_text(row[10]),
            state=_text(row[11]),
            xact_start=row[12] if isinstance(row[12], datetime) else None,
            holds="" if row[14] is None else f"{target} ({row[14]})",
            hidden=bool(row[13]),
        )
        for row in rows
        if row[8] is not None
    )
    since = waitstart if isinstance(waitstart, datetime) else None
    return Waiting(f"{target} ({mode})", since, blockers)


# -- what would hold the relay up (check) --------------------------------------------------------

SECOND_LOOK = 1.0  # seconds: a holder still there at a second look holds on, it is not passing by

# Sessions holding a transaction id open (each holds its own transactionid lock): a slot created
# now would wait for every one of them. A prepared transaction's lock has no pid.
_OPEN_TRANSACTIONS_SQL = (
    "SELECT k.pid, k.transactionid::text, a.usename, a.application_name, a.state, a.xact_start, "
    "a.pid IS NOT NULL AND a.backend_start IS NULL FROM pg_locks k "
    "LEFT JOIN pg_stat_activity a ON a.pid = k.pid "
    "WHERE k.locktype = 'transactionid' AND k.mode = 'ExclusiveLock' AND k.granted "
    "AND k.pid IS DISTINCT FROM pg_backend_pid() ORDER BY k.pid"
)
# Sessions holding what the relay's writes of its state would wait for: a row of this slot in
# either state table (locked or updated by an open transaction: the row's xmax is its transaction
# id), or either table in a mode that conflicts with a write.
_STATE_LOCKS_SQL = (
    "SELECT k.pid, t.what, a.usename, a.application_name, a.state, a.xact_start, "
    "a.pid IS NOT NULL AND a.backend_start IS NULL FROM ("
    " SELECT xmax, {position_row} AS what FROM {position} WHERE slot_name = %(slot)s"
    " UNION ALL SELECT xmax, {lease_row} FROM {lease} WHERE slot_name = %(slot)s) t "
    "JOIN pg_locks k ON k.locktype = 'transactionid' AND k.transactionid = t.xmax "
    " AND k.mode = 'ExclusiveLock' AND k.granted "
    "LEFT JOIN pg_stat_activity a ON a.pid = k.pid "
    "WHERE k.pid IS DISTINCT FROM pg_backend_pid() "
    "UNION ALL SELECT k.pid, 'a ' || k.mode || ' lock on table ' || k.relation::regclass::text, "
    "a.usename, a.application_name, a.state, a.xact_start, "
    "a.pid IS NOT NULL AND a.backend_start IS NULL FROM pg_locks k "
    "LEFT JOIN pg_stat_activity a ON a.pid = k.pid "
    "WHERE k.locktype = 'relation' AND k.granted AND k.relation IN (%(position)s::regclass, "
    "%(lease)s::regclass) AND k.mode IN ('ShareLock', 'ShareRowExclusiveLock', 'ExclusiveLock', "
    "'AccessExclusiveLock') AND k.pid IS DISTINCT FROM pg_backend_pid() ORDER BY 1"
)
# The relay's own backends (any relay's, by application name) waiting for a lock.
_WAITING_RELAYS_SQL = (
    "SELECT DISTINCT k.pid, a.application_name FROM pg_locks k "
    "JOIN pg_stat_activity a ON a.pid = k.pid "
    "WHERE NOT k.granted AND a.application_name LIKE 'cdc-relay%' "
    "AND k.pid <> pg_backend_pid() ORDER BY 1"
)


def _holder(row: Sequence[object], holds: str) -> Blocker:
    """A :class:`Blocker` from (pid, -, role, application, state, xact_start, hidden)."""
    return Blocker(
        pid=0 if row[0] is None else int(str(row[0])),
        role=_text(row[2]),
        application=_text(row[3]),
        state=_text(row[4]),
        xact_start=row[5] if isinstance(row[5], datetime) else None,
        holds=holds,
        hidden=bool(row[6]),
    )


def held_up_by(
    conn: Connection,
    state_tables: tuple[sql.Identifier, sql.Identifier] | None,
    slot: str,
    slot_exists: bool,
    pause: Callable[[float], object] = time.sleep,
) -> list[str]:
    """What would hold a relay of ``slot`` up now, for ``check``: relay backends waiting for a
    lock (and who holds it), sessions holding this slot's rows of the state tables
    (``state_tables``: the position record's and the lease's, None when they do not exist yet)
    or those tables in a conflicting mode, and — the slot not created yet — transactions its
    creation would wait for. A holder counts only if it still holds the same at a second look
    :data:`SECOND_LOOK` later (a relay's own write passes in milliseconds)."""

    def look() -> dict[tuple[object, ...], str]:
        found: dict[tuple[object, ...], str] = {}
        for pid, application in conn.execute(_WAITING_RELAYS_SQL).fetchall():
            waiting = blockers_of(conn, int(str(pid)))
            if waiting.blockers:
                found[("relay", pid, waiting.lock)] = (
                    f"relay backend {pid} ({application}) waits for {waiting.lock}: held by "
                    f"{waiting.describe()}; {'; '.join(b.fix() for b in waiting.blockers)}"
                )
        if state_tables is not None:
            position, lease = state_tables
            query = sql.SQL(_STATE_LOCKS_SQL).format(
                position=position,
                lease=lease,
                position_row=sql.Literal(f"a row lock on slot {slot}'s position record"),
                lease_row=sql.Literal(f"a row lock on slot {slot}'s leader lease"),
            )
            names = {
                "slot": slot,
                "position": position.as_string(conn),
                "lease": lease.as_string(conn),
            }
            for row in conn.execute(query, names).fetchall():
                holder = _holder(row, str(row[1]))
                found[("state", row[0], row[1])] = (
                    f"{holder.describe()}: the relay cannot record its position while it holds "
                    f"it; {holder.fix()}"
                )
        if not slot_exists:
            for row in conn.execute(_OPEN_TRANSACTIONS_SQL).fetchall():
                holder = _holder(row, f"transaction {row[1]}")
                found[("xact", row[0], row[1])] = (
                    f"{holder.describe()}: creating slot {slot} waits until it ends; "
                    f"{holder.fix()}, or wait"
                )
        return found

    first = look()
    if not first:
        return []
    pause(SECOND_LOOK)
    second = look()
    return [text for key, text in second.items() if key in first]


# -- the watch -----------------------------------------------------------------------------------


class Watched(Protocol):
    """A statement (or a few) about to run on a connection, watched while it runs."""

    def __call__(
        self, what: str, means: str, *, deadline: float | None = None
    ) -> AbstractContextManager[None]: ...


@contextmanager
def unwatched(what: str, means: str, *, deadline: float | None = None) -> Iterator[None]:
    """:class:`Watched` for callers that watch nothing (the default)."""
    del what, means, deadline
    yield


@dataclass(eq=False)
class _Wait:
    conn: Connection
    pid: int
    what: str
    means: str
    started: float
    notice_at: float
    deadline_at: float | None
    cancelled_at: float | None = None
    cancelled_for: str = ""
    shut: bool = False
    seen: Waiting | None = None  # as last named
    naming: bool = False
    notices: int = 0


class WaitWatch:
    """Names the statements that wait, and ends those that may wait no longer (see module doc).

    Its threads start with the first statement watched: the watch's own (deadlines, stop
    requests, cancels; it never waits on the server for longer than :data:`CANCEL_GRACE`), and a
    short-lived one per naming, on a connection of its own opened with the first, so that a server
    that does not answer can hold up a naming but never a cancel.
    """

    def __init__(
        self,
        database_url: str,
        stopping: Callable[[], bool] = lambda: False,
        *,
        connect: Callable[[str], Connection] | None = None,
        waiting: Callable[[], None] = lambda: None,
    ) -> None:
        self._url = database_url
        self._stopping = stopping
        self._connect = connect
        # Called while statements are watched: the relay counts a named wait as waiting, not as
        # stuck (its /healthz stays up: a liveness restart would only begin the wait again).
        self._waiting = waiting
        self._waits: set[_Wait] = set()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._thread: threading.Thread | None = None
        self._namer: Connection | None = None
        self._namer_lock = threading.Lock()

    def stop_requested(self) -> bool:
        """A stop was asked for (what others that wait on the server without a watch ask)."""
        return self._stopping()

    def for_connection(
        self, conn: Connection, deadline: float | None = None, notice_after: float = NOTICE_AFTER
    ) -> Watched:
        """:class:`Watched` for statements on ``conn``: with ``deadline`` unless given another,
        named after ``notice_after`` seconds."""
        default = deadline

        def watched(
            what: str, means: str, *, deadline: float | None = default
        ) -> AbstractContextManager[None]:
            return self.watching(conn, what, means, deadline=deadline, notice_after=notice_after)

        return watched

    @contextmanager
    def watching(
        self,
        conn: Connection,
        what: str,
        means: str,
        *,
        deadline: float | None = None,
        notice_after: float = NOTICE_AFTER,
    ) -> Iterator[None]:
        """Run the block's statements on ``conn`` watched: named once they have run
        ``notice_after`` seconds, cancelled on a stop or past ``deadline`` seconds. A lock or
        statement timeout, and a statement this watch ended, raise SourceUnavailable naming what
        it waited for (what else psycopg raises passes unchanged)."""
        now = time.monotonic()
        wait = _Wait(
            conn,
            conn.info.backend_pid,
            what,
            means,
            now,
            now + notice_after,
            None if deadline is None else now + deadline,
        )
        with self._wake:
            closed = self._closed
            if not closed:
                self._waits.add(wait)
            if self._thread is None and not closed:
                self._thread = threading.Thread(
                    target=self._run, name="cdc-relay-waits", daemon=True
                )
                self._thread.start()
            self._wake.notify()
        if closed:  # the process is on its way out: unwatched
            yield
            return
        try:
            yield
        except psycopg.OperationalError as exc:
            ended = wait.cancelled_at is not None
            if not (ended or isinstance(exc, _TIMEOUTS)):
                raise
            raise self._failure(wait, exc) from None
        finally:
            with self._wake:
                self._waits.discard(wait)

    def close(self) -> None:
        """End the threads (statements still watched are left alone, later ones run unwatched)
        and the naming connection."""
        with self._wake:
            self._closed = True
            self._wake.notify()
            thread = self._thread
        if thread is not None:
            thread.join(CANCEL_GRACE * 2)
        if self._namer_lock.acquire(timeout=0.1):  # not while a naming waits on the server
            try:
                if self._namer is not None:
                    with contextlib.suppress(psycopg.Error):
                        self._namer.close()
                    self._namer = None
            finally:
                self._namer_lock.release()

    # -- the watch's thread --------------------------------------------------------------------

    def _run(self) -> None:
        stop_seen: float | None = None
        with self._wake:
            while not self._closed:
                if not self._waits:
                    self._wake.wait()
                    continue
                now = time.monotonic()
                due = min(self._next_due(w) for w in self._waits)
                self._wake.wait(max(0.0, min(due - now, POLL_INTERVAL)))
                now = time.monotonic()
                if stop_seen is None and self._stopping():
                    stop_seen = now
                if self._waits:
                    self._waiting()
                # Under the lock: a statement's block cannot end (nor the next statement on its
                # connection begin) while it is cancelled, so a cancel never hits another one.
                for wait in list(self._waits):
                    try:
                        self._tend(wait, now, stop_seen)
                    except Exception:  # a bug here must not end the watch
                        log.exception("unexpected error watching a statement")

    def _next_due(self, wait: _Wait) -> float:
        due = wait.notice_at
        if wait.deadline_at is not None:
            due = min(due, wait.deadline_at)
        if wait.cancelled_at is not None and not wait.shut:
            due = min(due, wait.cancelled_at + CANCEL_GRACE)
        return due

    def _tend(self, wait: _Wait, now: float, stop_seen: float | None) -> None:
        if wait.cancelled_at is None:
            if stop_seen is not None and now >= max(stop_seen, wait.started) + STOP_GRACE:
                self._cancel(wait, now, "the relay is stopping")
            elif wait.deadline_at is not None and now >= wait.deadline_at:
                self._cancel(wait, now, f"no answer within {now - wait.started:.1f}s")
        elif not wait.shut and now >= wait.cancelled_at + CANCEL_GRACE:
            wait.shut = True
            log.warning(
                "PostgreSQL did not act on the cancel: shutting the connection",
                extra={"fields": {"waiting": wait.what, "pid": wait.pid}},
            )
            _shut(wait.conn)
        if now >= wait.notice_at and not wait.naming:
            wait.notice_at = now + REPEAT_INTERVAL
            wait.naming = True
            threading.Thread(
                target=self._name, args=(wait, now), name="cdc-relay-waits-naming", daemon=True
            ).start()

    def _cancel(self, wait: _Wait, now: float, reason: str) -> None:
        wait.cancelled_at = now
        wait.cancelled_for = reason
        try:
            wait.conn.cancel_safe(timeout=CANCEL_GRACE)
        except (psycopg.Error, OSError) as exc:
            log.debug("cannot cancel a statement", extra={"fields": {"error": str(exc)}})

    # -- naming --------------------------------------------------------------------------------

    def _name(self, wait: _Wait, now: float) -> None:
        try:
            try:
                seen = self._blockers(wait.pid)
            except (psycopg.Error, SourceError, OSError) as exc:
                seen = None
                error = str(exc).strip()
            else:
                wait.seen = seen
                error = ""
            wait.notices += 1
            fields: dict[str, object] = {
                "waiting": wait.what,
                "waited_s": round(now - wait.started, 1),
                "pid": wait.pid,
            }
            if seen is None:
                fields["blocked_by"] = f"cannot ask the server who blocks it: {error}"
            else:
                if seen.lock:
                    fields["waits_for"] = seen.lock
                if seen.since is not None:
                    fields["waiting_since"] = seen.since.isoformat(sep=" ")
                fields["blocked_by"] = seen.describe()
            fields["meaning"] = wait.means
            if seen is not None and seen.blockers:
                fields["fix"] = "; ".join(b.fix() for b in seen.blockers)
            log.warning(f"waiting on PostgreSQL: {wait.what}", extra={"fields": fields})
        finally:
            wait.naming = False

    def _blockers(self, pid: int) -> Waiting:
        with self._namer_lock:
            conn = self._namer
            if conn is None or conn.closed or conn.broken:
                conn = self._open_namer()
                self._namer = conn
            try:
                return blockers_of(conn, pid)
            except psycopg.OperationalError:
                conn.close()
                self._namer = None
                raise

    def _open_namer(self) -> Connection:
        if self._connect is not None:
            conn = self._connect(self._url)
        else:
            from cdc_relay.replication.source import connect  # noqa: PLC0415 - a cycle otherwise

            conn = connect(self._url)
        try:
            conn.execute("SET application_name = 'cdc-relay waits'")
            conn.execute(sql.SQL("SET statement_timeout = {}").format(sql.Literal(NAMING_TIMEOUT)))
        except psycopg.Error:
            conn.close()
            raise
        return conn

    def _failure(self, wait: _Wait, exc: psycopg.OperationalError) -> SourceError:
        seen = wait.seen
        doing = wait.what
        if wait.cancelled_at is not None:
            doing += f": ended by the relay ({wait.cancelled_for})"
        if seen is not None and seen.blockers:
            doing += f"; blocked by {seen.describe()}"
        return error_for(exc, During.STATEMENT, doing)


def _shut(conn: Connection) -> None:
    """Shut ``conn``'s socket (not close it: another thread is inside libpq with it), so that the
    statement waiting on it fails at once."""
    with contextlib.suppress(OSError, psycopg.Error):
        fd = os.dup(conn.fileno())
        with socket.socket(fileno=fd) as sock:
            sock.shutdown(socket.SHUT_RDWR)
