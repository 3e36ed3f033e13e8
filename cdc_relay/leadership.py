"""Which relay streams: leadership through PostgreSQL only, so any number of relays may run.

Every relay of a slot competes for two things in the source database, and leads while it holds
both; the others stand by (alive, ``/readyz`` 503 ``standby``) and take over in seconds:

- a **session-level advisory lock** (``pg_try_advisory_lock``, keyed by the slot's name; advisory
  locks are per database) on a connection of its own. PostgreSQL frees it when that connection
  ends — a leader killed, or stopped cleanly, loses it at once, and a standby, polling every
  :data:`POLL_INTERVAL`, takes it;
- a **lease row** in the state schema (``leader_lease``: holder, the lock connection's pid, the
  walsender's pid, ``expires_at``), renewed every ``CDC_RELAY_LEADER_RENEW_INTERVAL`` by this
  module's thread. A *hung* leader (stopped, or cut off with its TCP connections open) keeps the
  lock but stops renewing: once its lease has expired (the database's clock, so the relays' clocks
  do not matter), a standby ends the holder's lock connection and walsender
  (``pg_terminate_backend``: allowed between backends of the same role) and takes the lock.

The lease is also the fence: the position record is written only in a statement that locks the
lease row naming this holder (:meth:`cdc_relay.checkpoint.PostgresCheckpointStore.save`), so a
leader that wakes after a takeover cannot confirm anything; its walsender was ended, so it cannot
confirm the slot either. It also notices by itself: :attr:`Leadership.leading` turns false when the
last renewal is older than the lease (by the local monotonic clock, which runs on while a process
is stopped), before any database answers. It then purges its producer and becomes a standby.

Cut off by a network partition, a leader learns it from its own connections: each has TCP
keepalives and a ``tcp_user_timeout`` of half the lease (:mod:`cdc_relay.connection_defaults`), so
the renewal fails well within the lease and the leader steps down. A renewal that fails while its
connection stands (e.g. its ``statement_timeout``, a quarter of the lease, behind a lock on the
lease row) does not: the lock and the lease are still this relay's, so it retries while the lease
lasts, and a failover would be needless churn.

Advisory locks need no privilege: any role that can connect may take the lock. Such a holder —
its role is not the relay's, no lease names it (:func:`foreign_holder`) — is reported (log,
``/status``, ``check``) and not waited for: relays then lead by the lease alone, which only the
relay's role may update. A relay takes it only when no live relay holds it (unexpired and its
lock connection still there, :data:`_LEASE_FREE`), in one conditional statement on the locked
row, so one of two wins; takeovers from a dead or hung leader work as above, and the leader takes
the lock back at a renewal once it is free.

Every statement of the lock connection is watched (:mod:`cdc_relay.waits`): a server that does not
answer it within its ``statement_timeout`` and a few seconds more is given up on (the connection's
socket shut), and a stop ends it; so this thread never hangs, and :meth:`Leadership.release` never
waits on it for long.

Two relays that disagree — the old one still believes it leads — can at worst both hand records to
Kafka for a moment (duplicates, which consumers drop by the ``id`` header); neither the position
record nor the slot can be moved by the one that lost.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from contextlib import AbstractContextManager
from dataclasses import dataclass

import psycopg
from psycopg import sql

from cdc_relay.checkpoint import LEASE_TABLE, fenced
from cdc_relay.config import Settings
from cdc_relay.errors import LeadershipLost, SourceError
from cdc_relay.postgres_errors import During, mapped
from cdc_relay.replication.source import connect
from cdc_relay.waits import ANSWER_MARGIN, WaitWatch

log = logging.getLogger(__name__)

LOCK_CLASS = 0x63646372  # "cdcr": the advisory lock's first key; the second is the slot's hash
POLL_INTERVAL = 0.25  # a standby's look at the lock (and at an expired lease)
TERMINATE_WAIT_MS = 2000  # pg_terminate_backend(pid, timeout): wait until the backend is gone
# A renewal's statement_timeout, as a share of the lease: a renewal blocked (e.g. the lease row
# locked by another session) ends early enough to be retried a few times before the lease ends.
RENEWAL_TIMEOUT_SHARE = 0.25
STANDBY_TIMEOUT = 5.0  # statement_timeout of a standby's statements (the terminations: 2 x 2 s)
# Seconds release() waits for the thread (its statements end within ~3 s of a stop: see
# cdc_relay.waits); a thread still waiting then is left, and the lease released by its expiry.
RELEASE_WAIT = 5.0
LEASE_MEANS = (
    "the leader lease cannot be read or written while this is held; a leader whose renewals "
    "keep failing loses the leadership when its lease runs out"
)

Connection = psycopg.Connection[tuple[object, ...]]


def terminate_backend(conn: Connection, pid: int) -> bool:
    """End backend ``pid`` and wait (bounded) until it is gone; True if it went."""
    row = conn.execute("SELECT pg_terminate_backend(%s, %s)", (pid, TERMINATE_WAIT_MS)).fetchone()
    return bool(row and row[0])


@dataclass(frozen=True)
class ForeignHolder:
    """A session holding the leader lock that is no relay of this slot: not of the relay's role,
    and named by no lease. While it holds the lock, relays lead by their lease alone."""

    pid: int
    role: str | None  # None: pg_stat_activity does not show the backend

    def describe(self) -> str:
        return f"pid {self.pid}, role {self.role or 'unknown'}"

    def fix(self, slot: str) -> str:
        return (
            f"end it: as a superuser, SELECT pg_terminate_backend({self.pid}); then find out who "
            f"runs role {self.role or 'unknown'} — any role that may connect to this database can "
            f"take advisory locks such as pg_advisory_lock({LOCK_CLASS}, hashtext('{slot}')), "
            "so let only trusted roles connect (REVOKE CONNECT ON DATABASE … FROM PUBLIC)"
        )

    def as_dict(self) -> dict[str, object]:
        return {"pid": self.pid, "role": self.role}


def foreign_holder(conn: Connection, state_schema: str, slot: str) -> ForeignHolder | None:
    """The session holding ``slot``'s leader lock when it is no relay: its role is not this
    session's and no lease row names it. None when the lock is free or a relay holds it (or may:
    one of the relay's role that has not written its lease yet)."""
    row = conn.execute(
        sql.SQL(
            "SELECT k.pid, a.usename FROM pg_locks k "
            "LEFT JOIN pg_stat_activity a ON a.pid = k.pid "
            "WHERE k.locktype = 'advisory' AND k.granted AND k.classid = %s "
            "AND k.objid = hashtext(%s)::oid AND k.objsubid = 2 "
            "AND k.database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
            "AND a.usename IS DISTINCT FROM session_user "
            "AND NOT EXISTS (SELECT FROM {} l WHERE l.slot_name = %s AND l.lock_pid = k.pid)"
        ).format(sql.Identifier(state_schema, LEASE_TABLE)),
        (LOCK_CLASS, slot, slot),
    ).fetchone()
    if row is None:
        return None
    return ForeignHolder(int(str(row[0])), None if row[1] is None else str(row[1]))


# The lease row's (alias l) lock connection is still there: a backend of this role with its pid
# that began before the last renewal (so not a later backend that reuses the pid).
_LEASE_HOLDER_ALIVE = sql.SQL(
    "EXISTS (SELECT FROM pg_stat_activity a WHERE a.pid = l.lock_pid "
    "AND a.usename = session_user AND a.backend_start <= l.renewed_at)"
)
# The lease row names no live relay: ours (%s: this holder), expired, or its connection gone.
_LEASE_FREE = sql.SQL("l.holder = %s OR l.expires_at < now() OR NOT {}").format(_LEASE_HOLDER_ALIVE)


def require_lease(leading: bool, outcome: str) -> None:
    """This relay's lease ran out by its own clock (:attr:`Leadership.leading` is false): whatever
    it was about to do, it stops with LeadershipLost. The one place that cause ends a leadership;
    the other, a fenced write that found another holder, is :func:`cdc_relay.checkpoint.fenced`.
    """
    if not leading:
        raise LeadershipLost(f"this relay's leader lease ran out: {outcome}")


def holder_id() -> str:
    """This process's name in the lease: host, pid and a random part (pids are reused)."""
    return f"{socket.gethostname()[:60]}/{os.getpid()}/{uuid.uuid4().hex[:8]}"


def application_name(slot: str) -> str:
    """The lock connection's ``application_name``, naming the slot: ``status`` lists the relays
    of a slot by it, leader and standbys (PostgreSQL keeps its first 63 bytes)."""
    return f"cdc-relay leadership {slot}"[:63]


class Leadership:
    """The lock connection and the lease, kept by a thread of its own (:meth:`run`)."""

    def __init__(self, settings: Settings, waits: WaitWatch | None = None) -> None:
        self.settings = settings
        self._waits = waits
        self.holder = holder_id()
        self.became_leader = threading.Event()
        self.leader_seen: str | None = None  # the lease's holder, as a standby last read it
        self.predecessor_stream_pid: int | None = None  # the walsender of the one we replaced
        # A session that is no relay holding the lock, as a standby last saw it (None: none).
        self.foreign_holder: ForeignHolder | None = None
        self._lease = sql.Identifier(settings.state_schema, LEASE_TABLE)
        self._timeout = settings.leader_lease_timeout
        self._conn: Connection | None = None
        self._leading = False
        self._failing = False  # the last look at the database failed
        self._renewal_failing = False  # renewals fail on a live connection (lease still ours)
        renewal_ms = round(self._timeout * RENEWAL_TIMEOUT_SHARE * 1000)
        self._renewal_timeout = sql.Literal(f"{renewal_ms}ms")
        self._renewed_at = 0.0  # monotonic time taken before the last successful renewal
        self._holds_lock = False  # a leader holds the lock, unless a squatter does (lease alone)
        self._resign = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- what the relay asks -------------------------------------------------------------------

    @property
    def leading(self) -> bool:
        """Holds the lock and a lease that has not run out by the local clock."""
        return self._leading and time.monotonic() - self._renewed_at < self._timeout

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="cdc-relay-leadership", daemon=True)
        self._thread.start()

    def resign(self) -> None:
        """The relay stopped leading (lost its lease): release the lock, compete again."""
        self._leading = False
        self.became_leader.clear()
        self._resign.set()

    def release(self, timeout: float = RELEASE_WAIT) -> None:
        """After the last session's clean stop: expire the lease and free the lock at once.

        Not while the thread still waits on the server (its statements are bounded, so only a
        server that does not answer keeps it): the lease then expires, and the lock goes with
        the process's connections."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning(
                    "the leadership thread still waits on PostgreSQL: exiting without releasing "
                    "the lease; a standby takes over when it expires",
                    extra={"fields": {"lease_timeout_s": self._timeout}},
                )
                self._leading = False
                return
        conn, self._conn = self._conn, None
        if conn is not None and not conn.closed:
            with contextlib.suppress(psycopg.Error):
                if self._leading:
                    conn.execute(
                        sql.SQL(
                            "UPDATE {} SET expires_at = now() WHERE slot_name = %s AND holder = %s"
                        ).format(self._lease),
                        (self.settings.slot_name, self.holder),
                    )
            conn.close()  # ends the session: its advisory lock goes with it
        self._leading = False

    def record_stream(self, conn: Connection, pid: int) -> None:
        """Write the walsender's pid into the lease (a successor ends it if it lingers)."""
        # The lease row may still name this relay after its lock connection died.
        require_lease(self.leading, "streaming not begun")
        cursor = conn.execute(
            sql.SQL("UPDATE {} SET stream_pid = %s WHERE slot_name = %s AND holder = %s").format(
                self._lease
            ),
            (pid, self.settings.slot_name, self.holder),
        )
        fenced(cursor.rowcount, "streaming not begun")

    # -- the thread ----------------------------------------------------------------------------

    def run(self) -> None:
        """Compete (standby) or renew (leader) until released; never raises."""
        while not self._stop.is_set():
            wait = POLL_INTERVAL
            try:
                with mapped(During.STATEMENT):
                    if self._resign.is_set():
                        self._resign.clear()
                        self._close()
                    elif self._leading:
                        self._renew()
                        wait = self.settings.leader_renew_interval
                    elif self._try_acquire():
                        wait = self.settings.leader_renew_interval
            except SourceError as exc:
                if self._leading and self._connection_alive() and self.leading:
                    # The connection is alive, so the lock is still ours, and the lease runs on
                    # by the local clock (e.g. the renewal hit its statement_timeout behind a
                    # lock on the lease row): stepping down now would be needless churn. Retry;
                    # ``leading`` turns false by itself if the lease runs out meanwhile.
                    if not self._renewal_failing:
                        log.warning(
                            "cannot renew the leader lease, retrying while it lasts",
                            extra={"fields": {"error": str(exc).strip()}},
                        )
                    self._renewal_failing = True
                    self._stop.wait(self.settings.leader_renew_interval)
                    continue
                if self._leading:
                    self._leading = False
                    log.warning(
                        "lost the leadership connection",
                        extra={"fields": {"error": str(exc).strip()}},
                    )
                else:
                    # Once per outage, not every second of it.
                    log.log(
                        logging.DEBUG if self._failing else logging.WARNING,
                        "cannot compete for leadership, retrying",
                        extra={"fields": {"error": str(exc).strip()}},
                    )
                self._failing = True
                self._close()
                wait = 1.0
            except Exception:  # a bug must not leave a leader without renewals unnoticed
                self._leading = False
                self._close()
                log.exception("unexpected error in the leadership thread")
                wait = 1.0
            else:
                if self._failing:
                    log.info("reached PostgreSQL again: competing for leadership again")
                self._failing = False
            self._stop.wait(wait)

    def _connection(self) -> Connection:
        if self._conn is None or self._conn.closed:
            conn = connect(self.settings.source_url())
            try:
                conn.execute(
                    sql.SQL("SET application_name = {}").format(
                        sql.Literal(application_name(self.settings.slot_name))
                    )
                )
                # A standby's statements; the terminations wait up to 2 x TERMINATE_WAIT_MS.
                conn.execute(
                    sql.SQL("SET statement_timeout = {}").format(
                        sql.Literal(f"{STANDBY_TIMEOUT:g}s")
                    )
                )
            except psycopg.Error:
                conn.close()
                raise
            self._conn = conn
        return self._conn

    def _connection_alive(self) -> bool:
        """The lock connection still stands (a failed statement, not a lost connection)."""
        conn = self._conn
        return conn is not None and not conn.closed and not conn.broken

    def _close(self) -> None:
        self._renewal_failing = False
        self._holds_lock = False
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                conn.close()

    def _watched(self, conn: Connection, what: str, timeout: float) -> AbstractContextManager[None]:
        """``what``'s statements, bounded on the client too: a server that has not ended them
        by their ``timeout`` (and :data:`~cdc_relay.waits.ANSWER_MARGIN` more) does not answer;
        named then, and given up on."""
        if self._waits is None:
            return contextlib.nullcontext()
        bound = timeout + ANSWER_MARGIN
        return self._waits.watching(conn, what, LEASE_MEANS, deadline=bound, notice_after=bound)

    def _try_acquire(self) -> bool:
        conn = self._connection()
        with self._watched(conn, "competing for the leadership", STANDBY_TIMEOUT):
            return self._acquire(conn)

    def _acquire(self, conn: Connection) -> bool:
        slot = self.settings.slot_name
        started = time.monotonic()
        if self._try_lock(conn) or (self._end_hung_holder(conn) and self._try_lock(conn)):
            self._holds_lock = True
        elif self.foreign_holder is not None and self._lease_free(conn):
            self._holds_lock = False  # a squatter holds the lock: lead by the lease alone
        else:
            return False
        # The lock's holder takes the lease as it is. Without the lock, or with a lock a squatter
        # has just let go (a relay may lead by its lease alone), only a lease no live relay holds
        # — checked again on the locked row, so that of two relays one wins.
        conditional = not self._holds_lock or self.foreign_holder is not None
        condition = sql.SQL(" WHERE ") + _LEASE_FREE if conditional else sql.SQL("")
        with conn.transaction():
            previous = conn.execute(
                sql.SQL("SELECT holder, stream_pid FROM {} WHERE slot_name = %s FOR UPDATE").format(
                    self._lease
                ),
                (slot,),
            ).fetchone()
            cursor = conn.execute(
                sql.SQL(
                    "INSERT INTO {} AS l (slot_name, holder, lock_pid, stream_pid, renewed_at, "
                    "expires_at) VALUES (%s, %s, pg_backend_pid(), NULL, now(), "
                    "now() + make_interval(secs => %s)) ON CONFLICT (slot_name) DO UPDATE SET "
                    "holder = EXCLUDED.holder, lock_pid = EXCLUDED.lock_pid, stream_pid = NULL, "
                    "renewed_at = EXCLUDED.renewed_at, expires_at = EXCLUDED.expires_at{}"
                ).format(self._lease, condition),
                (slot, self.holder, self._timeout) + ((self.holder,) if conditional else ()),
            )
        if cursor.rowcount != 1:  # a live relay holds the lease: it takes the lock at its renewal
            if self._holds_lock:
                self._holds_lock = False
                conn.execute(
                    "SELECT pg_advisory_unlock(%s, hashtext(%s))",
                    (LOCK_CLASS, self.settings.slot_name),
                )
            return False
        self.predecessor_stream_pid = (
            int(str(previous[1])) if previous and previous[1] is not None else None
        )
        self._renewed_at = started
        self._leading = True
        self.leader_seen = self.holder
        fields: dict[str, object] = {
            "slot": slot,
            "holder": self.holder,
            "previous": str(previous[0]) if previous else None,
        }
        squatter = self.foreign_holder
        if self._holds_lock:
            self._note_foreign_holder(None)
            log.info("leading", extra={"fields": fields})
        elif squatter is not None:
            fields.update(lock_pid=squatter.pid, lock_role=squatter.role)
            log.warning(
                "leading by the lease alone: the leader lock is held by a session that is no relay",
                extra={"fields": fields},
            )
        self.became_leader.set()
        return True

    def _lease_free(self, conn: Connection) -> bool:
        """Without the lock (a squatter holds it): may this relay take the lease? Yes unless a
        live relay holds it unexpired; a holder that has hung (expired, its backend still there)
        has its connections ended first, as :meth:`_end_hung_holder` does."""
        row = conn.execute(
            sql.SQL(
                "SELECT l.holder, l.expires_at < now(), l.lock_pid, l.stream_pid, {} "
                "FROM {} l WHERE l.slot_name = %s"
            ).format(_LEASE_HOLDER_ALIVE, self._lease),
            (self.settings.slot_name,),
        ).fetchone()
        if row is None:
            return True
        holder, expired, lock_pid, stream_pid, alive = row
        if not alive or holder == self.holder:
            return True  # its relay is gone (its walsender is ended when streaming starts)
        self.leader_seen = str(holder)
        if not expired:
            return False
        return self._end_connections(conn, str(holder), int(str(lock_pid)), stream_pid)

    def _note_foreign_holder(self, found: ForeignHolder | None) -> None:
        previous, self.foreign_holder = self.foreign_holder, found
        if found is not None and found != previous:
            log.error(
                "the leader lock is held by a session that is no relay: relays of this slot lead "
                "by their lease alone while it holds it",
                extra={
                    "fields": {
                        "slot": self.settings.slot_name,
                        "pid": found.pid,
                        "role": found.role,
                        "fix": found.fix(self.settings.slot_name),
                    }
                },
            )
        elif found is None and previous is not None:
            log.info(
                "the session that held the leader lock is gone",
                extra={"fields": {"pid": previous.pid, "role": previous.role}},
            )

    def _try_lock(self, conn: Connection) -> bool:
        row = conn.execute(
            "SELECT pg_try_advisory_lock(%s, hashtext(%s))",
            (LOCK_CLASS, self.settings.slot_name),
        ).fetchone()
        return bool(row and row[0])

    def _renew(self) -> None:
        conn = self._connection()
        renewal = self._timeout * RENEWAL_TIMEOUT_SHARE
        with self._watched(conn, "renewing the leader lease", max(renewal, STANDBY_TIMEOUT)):
            self._renew_on(conn)

    def _renew_on(self, conn: Connection) -> None:
        started = time.monotonic()
        if not self._holds_lock and self._try_lock(conn):
            self._holds_lock = True  # the squatter let go: the lock is ours again
            self._note_foreign_holder(None)
        with conn.transaction():
            conn.execute(sql.SQL("SET LOCAL statement_timeout = {}").format(self._renewal_timeout))
            cursor = conn.execute(
                sql.SQL(
                    "UPDATE {} SET renewed_at = now(), "
                    "expires_at = now() + make_interval(secs => %s) "
                    "WHERE slot_name = %s AND holder = %s AND lock_pid = pg_backend_pid()"
                ).format(self._lease),
                (self._timeout, self.settings.slot_name, self.holder),
            )
        if cursor.rowcount != 1:
            self._leading = False
            log.warning("another relay took the leader lease", extra={"fields": {}})
            self._close()
            return
        self._renewed_at = started
        if self._renewal_failing:
            self._renewal_failing = False
            log.info("renewed the leader lease again", extra={"fields": {}})

    def _end_hung_holder(self, conn: Connection) -> bool:
        """The lock is held: by whom, and is its lease still valid? True when this ended the
        connections of a holder whose lease had expired (a hung leader)."""
        slot = self.settings.slot_name
        row = conn.execute(
            sql.SQL(
                "SELECT l.holder, l.expires_at < now(), l.lock_pid, l.stream_pid FROM {} l "
                "JOIN pg_locks k ON k.pid = l.lock_pid AND k.locktype = 'advisory' "
                "AND k.granted AND k.classid = %s AND k.objid = hashtext(%s)::oid "
                "AND k.objsubid = 2 "
                "AND k.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
                " WHERE l.slot_name = %s"
            ).format(self._lease),
            (LOCK_CLASS, slot, slot),
        ).fetchone()
        if row is None:
            # The lock's holder has not written its lease yet (it just took the lock), or it is
            # no relay at all: never end a backend whose lease we cannot see, but say so when it
            # is not of the relay's role — relays then lead by their lease alone.
            self._note_foreign_holder(foreign_holder(conn, self.settings.state_schema, slot))
            return False
        self._note_foreign_holder(None)
        holder, expired, lock_pid, stream_pid = row
        self.leader_seen = str(holder)
        if not expired:
            return False
        return self._end_connections(conn, str(holder), int(str(lock_pid)), stream_pid)

    def _end_connections(
        self, conn: Connection, holder: str, lock_pid: int, stream_pid: object
    ) -> bool:
        """End a hung leader's lock connection and walsender; True when that was allowed."""
        slot = self.settings.slot_name
        log.warning(
            "the leader's lease expired: ending its connections and taking over",
            extra={"fields": {"slot": slot, "stale_holder": holder}},
        )
        try:
            conn.execute(
                "SELECT pg_terminate_backend(%s, %s), (SELECT pg_terminate_backend(s.active_pid, "
                "%s) FROM pg_replication_slots s WHERE s.slot_name = %s AND s.active_pid = %s)",
                (lock_pid, TERMINATE_WAIT_MS, TERMINATE_WAIT_MS, slot, stream_pid),
            )
        except psycopg.errors.InsufficientPrivilege as exc:
            log.error(
                "cannot end the hung leader's connections: run every relay of a slot as one role "
                "(or GRANT pg_signal_backend TO this one)",
                extra={"fields": {"error": exc.diag.message_primary or str(exc)}},
            )
            return False
        return True
