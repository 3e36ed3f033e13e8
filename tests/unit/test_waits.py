"""The wait watch's logic (:mod:`cdc_relay.waits`) with stand-ins for psycopg's connections: when
a wait is named and with what, when a statement is cancelled and its socket shut, what a wait that
ends in an error becomes. The real server's side — the lock, the open transaction, the row lock,
the backend that stops answering — is ``tests/integration/test_waits.py``'s."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any, cast

import psycopg
import pytest

from cdc_relay import waits
from cdc_relay.errors import SourceUnavailable
from cdc_relay.waits import (
    MAX_WRITE_WAIT,
    Blocker,
    Waiting,
    WaitWatch,
    blockers_of,
    lock_timeout_statement,
    write_lock_timeout,
)

SINCE = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
# A _WAITING_SQL row: the waited lock (locktype .. waitstart), then one blocker.
WAITED = ("transactionid", None, "735", None, None, None, "ShareLock", SINCE)
BLOCKER_ROW = (*WAITED, 4242, "app", "psql", "idle in transaction", SINCE, False, "ExclusiveLock")


class _Cursor:
    def __init__(self, rows: list[tuple[object, ...]]) -> None:
        self._rows = rows

    def fetchall(self) -> list[tuple[object, ...]]:
        return self._rows


class _Namer:
    """The watch's own connection: answers the blockers query with ``rows``."""

    def __init__(self, rows: list[tuple[object, ...]]) -> None:
        self.rows = rows
        self.closed = False
        self.broken = False

    def execute(self, query: object, params: object = None) -> _Cursor:
        return _Cursor(self.rows if isinstance(params, dict) else [])

    def close(self) -> None:
        self.closed = True


class _Watched:
    """A connection whose statement the watch may cancel (counted)."""

    def __init__(self, pid: int = 99) -> None:
        self.info = SimpleNamespace(backend_pid=pid)
        self.cancelled = threading.Event()

    def cancel_safe(self, timeout: float) -> None:
        self.cancelled.set()

    def fileno(self) -> int:
        return -1


def _watch(rows: list[tuple[object, ...]], stopping: Any = lambda: False) -> WaitWatch:
    return WaitWatch("postgresql://unused", stopping, connect=lambda _url: cast(Any, _Namer(rows)))


def _warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage().startswith("waiting on PostgreSQL: ")]


@pytest.fixture(autouse=True)
def _fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(waits, "POLL_INTERVAL", 0.01)
    monkeypatch.setattr(waits, "STOP_GRACE", 0.05)
    monkeypatch.setattr(waits, "CANCEL_GRACE", 0.1)


def test_the_write_lock_timeout_stays_below_a_renewal_and_is_bounded() -> None:
    assert write_lock_timeout(15.0) == pytest.approx(3.0)
    assert write_lock_timeout(15.0) < 15.0 * 0.25  # a renewal's statement timeout
    assert write_lock_timeout(3600.0) == MAX_WRITE_WAIT
    assert write_lock_timeout(1.0) == pytest.approx(0.2)


def test_a_lock_timeout_is_whole_milliseconds_and_never_zero() -> None:
    assert lock_timeout_statement(3.0).as_string(None) == "SET lock_timeout = '3000ms'"
    assert lock_timeout_statement(0.0001).as_string(None) == "SET lock_timeout = '1ms'"


def test_a_blocker_is_described_with_what_the_role_may_see() -> None:
    seen = Blocker(4242, "app", "psql", "idle in transaction", SINCE, "transaction 735 (X)", False)
    assert seen.describe() == (
        "pid 4242 (role app, application 'psql', idle in transaction, transaction open since "
        "2026-01-02 03:04:05+00:00), holding transaction 735 (X)"
    )
    assert "SELECT pg_terminate_backend(4242)" in seen.fix()
    assert "member of role app" in seen.fix()
    hidden = Blocker(7, "owner", None, None, None, "", True)
    assert hidden.describe() == (
        "pid 7 (role owner, application '(none)', state and transaction start hidden "
        "(pg_read_all_stats shows them)), queued ahead for the same lock"
    )
    prepared = Blocker(0, None, None, None, None, "transaction 9 (ExclusiveLock)", True)
    assert prepared.describe().startswith("a prepared transaction")
    assert "ROLLBACK PREPARED" in prepared.fix()


def test_a_wait_on_no_lock_is_told_apart_from_one_held_by_an_unseen_session() -> None:
    assert "does not answer" in Waiting("", None, ()).describe()
    assert "held by no session it can see" in Waiting("table t (X)", None, ()).describe()


def test_blockers_of_reads_the_waited_lock_and_its_holders() -> None:
    conn = cast(Any, _Namer([BLOCKER_ROW]))
    waiting = blockers_of(conn, 99)
    assert waiting.lock == "transaction 735 (ShareLock)"
    assert waiting.since == SINCE
    (blocker,) = waiting.blockers
    assert blocker.pid == 4242
    assert blocker.holds == "transaction 735 (ExclusiveLock)"
    nothing = blockers_of(cast(Any, _Namer([(None,) * len(BLOCKER_ROW)])), 99)
    assert nothing == Waiting("", None, ())


def test_a_long_wait_is_named_once_it_lasts(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="cdc_relay.waits")
    watch = _watch([BLOCKER_ROW])
    conn = cast(Any, _Watched())
    try:
        with watch.watching(conn, "creating replication slot s", "it means", notice_after=0.05):
            deadline = time.monotonic() + 5
            while not _warnings(caplog) and time.monotonic() < deadline:
                time.sleep(0.01)
        with watch.watching(conn, "a quick one", "it means", notice_after=0.5):
            pass
    finally:
        watch.close()
    (record,) = _warnings(caplog)
    fields = record.__dict__["fields"]
    assert record.getMessage() == "waiting on PostgreSQL: creating replication slot s"
    assert fields["pid"] == 99
    assert fields["waits_for"] == "transaction 735 (ShareLock)"
    assert "pid 4242 (role app, application 'psql'" in fields["blocked_by"]
    assert fields["meaning"] == "it means"
    assert "pg_terminate_backend(4242)" in fields["fix"]
    assert not conn.cancelled.is_set()


def _run(watch: WaitWatch, conn: _Watched, body: Callable[[], None], **options: Any) -> None:
    """``body`` as the statement ``watch`` watches on ``conn``."""
    with watch.watching(cast(Any, conn), "recording the position", "m", **options):
        body()


def _until(condition: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + 5
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_stop_cancels_a_waiting_statement_and_shuts_a_server_that_ignores_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shut: list[object] = []
    monkeypatch.setattr(waits, "_shut", shut.append)
    stopping = threading.Event()
    watch = _watch([], stopping.is_set)
    conn = _Watched()

    def hung() -> None:
        stopping.set()
        _until(conn.cancelled.is_set, "not cancelled")
        _until(lambda: shut == [conn], "the socket was not shut")
        raise psycopg.OperationalError("server closed the connection unexpectedly")

    try:
        with pytest.raises(SourceUnavailable, match=r"ended by the relay \(the relay is stopping"):
            _run(watch, conn, hung)
    finally:
        watch.close()


def test_a_deadline_cancels_a_statement_the_server_does_not_answer() -> None:
    watch = _watch([])
    conn = _Watched()

    def unanswered() -> None:
        _until(conn.cancelled.is_set, "not cancelled at its deadline")
        raise psycopg.errors.QueryCanceled("canceling statement due to user request")

    try:
        with pytest.raises(SourceUnavailable, match="no answer within"):
            _run(watch, conn, unanswered, deadline=0.05)
    finally:
        watch.close()


def test_a_lock_timeout_names_the_blockers_and_other_errors_pass_unchanged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="cdc_relay.waits")
    watch = _watch([BLOCKER_ROW])
    conn = _Watched()

    def blocked() -> None:
        _until(lambda: _warnings(caplog), "not named")
        raise psycopg.errors.LockNotAvailable("canceling statement due to lock timeout")

    def refused() -> None:
        raise psycopg.errors.UndefinedFile('could not access file "wal2json"')

    try:
        with pytest.raises(SourceUnavailable) as raised:
            _run(watch, conn, blocked, notice_after=0.01)
        assert str(raised.value).startswith("recording the position; blocked by pid 4242")
        with pytest.raises(psycopg.errors.UndefinedFile):
            _run(watch, conn, refused)
    finally:
        watch.close()


def test_a_closed_watch_runs_statements_unwatched() -> None:
    watch = _watch([])
    watch.close()
    with watch.watching(cast(Any, _Watched()), "late", "m"):
        pass


def test_a_watched_wait_counts_as_waiting_not_stuck() -> None:
    """While a statement is watched the relay hears of it (its /healthz stays up)."""
    heard = threading.Event()
    watch = WaitWatch(
        "postgresql://unused", connect=lambda _url: cast(Any, _Namer([])), waiting=heard.set
    )
    try:
        _run(watch, _Watched(), lambda: _until(heard.is_set, "not heard of"), notice_after=10)
    finally:
        watch.close()
