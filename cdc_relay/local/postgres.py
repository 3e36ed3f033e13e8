"""A throw-away PostgreSQL cluster in a temporary directory.

:class:`LocalPostgres` runs ``initdb`` into a fresh temporary directory and manages the server
with ``pg_ctl``. The cluster is configured for logical replication and for speed (no fsync),
never for durability against an operating-system crash: data survives :meth:`LocalPostgres.stop`,
:meth:`LocalPostgres.kill` (a crash of the server processes, followed by crash recovery on the
next start) and :meth:`LocalPostgres.restart`, but not a power loss.

``initdb`` refuses to run as root. When the current process is root, the temporary directory is
handed to the service user (``postgres``, see :mod:`cdc_relay.local.postgres_binaries`, which
also says where the binaries come from) and every server binary runs as that user.

:class:`ExternalPostgres` offers the same ``url()`` / ``create_database()`` /
``drop_database()`` API for a server somebody else runs (CI service container, docker-compose).
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from urllib.parse import quote, urlencode, urlsplit, urlunsplit

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from cdc_relay.local.lifetime import ThrowAway, Watchdog, stat_fields
from cdc_relay.local.postgres_binaries import find_bindir, service_user, usable_bindir

__all__ = ["MAX_TRANSACTION_ID_STEP", "ExternalPostgres", "LocalPostgres", "drop_database"]

_SUPERUSER = "postgres"  # the cluster's superuser role (initdb -U)
_START_TIMEOUT = 30.0
_STOP_TIMEOUT = 30.0

_DEFAULT_SETTINGS: dict[str, str] = {
    "wal_level": "logical",
    "max_replication_slots": "20",
    "max_wal_senders": "20",
    "listen_addresses": "127.0.0.1",
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "wal_sender_timeout": "60s",
    "max_connections": "100",
    "shared_buffers": "128MB",
}

# The newest minor releases (15.19, 16.15, 17.11, 18.6 and later) let REPLICATION roles, and
# superusers, decode only through the output plugins this setting lists (pgoutput, test_decoding
# by default): the throw-away cluster adds wal2json, the relay's other plugin, where the server
# has the setting (an unknown setting would stop an older one from starting).
_OUTPUT_PLUGIN_SETTING = "output_plugin_libraries"
_OUTPUT_PLUGINS = "pgoutput, test_decoding, wal2json"

# One pg_xact segment: 32 pages of 8 KiB, two status bits per transaction.
_XACTS_PER_CLOG_SEGMENT = 32 * 8192 * 4
# How far advance_transaction_ids may move at once: below PostgreSQL's stop limit (2^31 - 3M past
# the oldest unfrozen id), with room for the transactions of the freezing itself.
MAX_TRANSACTION_ID_STEP = (1 << 31) - 10_000_000

_SETTING_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")


# --------------------------------------------------------------------------------------------
# helpers


def _process_alive(pid: int) -> bool:
    """True when ``pid`` exists and is not a zombie (a zombie has already released everything)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    state = stat_fields(Path(f"/proc/{pid}/stat"))
    # None: no procfs, trust kill(0)
    return not state or state[0] not in ("Z", "X")


def _group_alive(pgid: int) -> bool:
    """True while any non-zombie process of process group ``pgid`` exists."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        fields = stat_fields(entry / "stat")
        # fields: state, ppid, pgrp, ...
        if (
            fields is not None
            and len(fields) >= 3
            and fields[2] == str(pgid)
            and fields[0] not in ("Z", "X")
        ):
            return True
    return False


def _read_pid(lock_file: Path) -> int | None:
    """The pid on the first line of a PostgreSQL lock file, if the file exists."""
    try:
        return int(lock_file.read_text().split("\n", 1)[0].strip())
    except (OSError, ValueError):
        return None


def _quote_setting(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "''") + "'"


def _with_dbname(admin_url: str, dbname: str, params: Mapping[str, object]) -> str:
    """``admin_url`` pointed at ``dbname`` (URI or key=value conninfo), plus extra params."""
    if admin_url.startswith(("postgresql://", "postgres://")):
        parts = urlsplit(admin_url)
        query = parts.query
        if params:
            extra = urlencode({k: str(v) for k, v in params.items()}, quote_via=quote)
            query = f"{query}&{extra}" if query else extra
        return urlunsplit((parts.scheme, parts.netloc, "/" + quote(dbname, safe=""), query, ""))
    return make_conninfo(admin_url, dbname=dbname, **{k: str(v) for k, v in params.items()})


def _create_database(admin_url: str, name: str) -> None:
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


def drop_database(admin_url: str, name: str, *, timeout: float = 15.0) -> None:
    """Drop database ``name`` through a connection to ``admin_url`` (another database).

    Terminates the database's backends and walsenders, drops the replication slots that belong to
    it, then drops it. Missing databases are ignored.
    """
    deadline = time.monotonic() + timeout
    with psycopg.connect(admin_url, autocommit=True) as conn:
        while True:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = %s AND pid <> pg_backend_pid()",
                (name,),
            )
            conn.execute(
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots "
                "WHERE database = %s AND active_pid IS NOT NULL",
                (name,),
            )
            try:
                conn.execute(
                    "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                    "WHERE database = %s",
                    (name,),
                )
                conn.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
                )
            except psycopg.errors.ObjectInUse:
                # A slot's walsender or a backend has not exited yet.
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
                continue
            return


# --------------------------------------------------------------------------------------------
# the cluster


class LocalPostgres(ThrowAway):
    """A PostgreSQL cluster in a temporary directory, configured for logical replication.

    >>> with LocalPostgres() as pg:
    ...     url = pg.url()                       # postgresql://postgres@127.0.0.1:PORT/postgres

    The cluster is initialised lazily by the first :meth:`start` (``__enter__`` starts it).
    Server settings are written to ``postgresql.auto.conf``, so they survive :meth:`restart` and
    :meth:`kill` + :meth:`start`; ``settings`` overrides the defaults (``wal_level=logical``,
    ``fsync=off``, ``synchronous_commit=off`` ...), e.g. ``{"wal_level": "replica"}``.

    ``synchronous_commit=off`` means a transaction committed less than ~0.6 s before
    :meth:`kill` may be lost by crash recovery; tests that kill the server and expect their
    last commit to survive should ``SET synchronous_commit = on`` in that session.
    """

    _DIRECTORY_PREFIX = "cdc-relay-pg-"  # holds data/, the server log and the Unix socket

    def __init__(
        self,
        port: int | None = None,
        settings: Mapping[str, str] | None = None,
        base_dir: Path | None = None,
        bindir: Path | None = None,
    ) -> None:
        super().__init__(port, base_dir)
        self._settings = dict(settings or {})
        for key in self._settings:
            if not _SETTING_NAME.match(key):
                raise ValueError(f"invalid PostgreSQL setting name: {key!r}")
        self._requested_bindir = bindir  # None: find_bindir()'s choice
        self._bindir: Path | None = None
        self._as_root = os.geteuid() == 0
        self._initialised = False
        self._postmaster_pid: int | None = None

    # ---------------------------------------------------------------- properties

    @property
    def bindir(self) -> Path:
        """The server binaries' directory (see :mod:`cdc_relay.local.postgres_binaries`)."""
        return self._bin("postgres").parent

    @property
    def data_dir(self) -> Path:
        return self.directory / "data"

    @property
    def log_path(self) -> Path:
        return self.directory / "postgresql.log"

    @property
    def settings(self) -> dict[str, str]:
        """The effective server settings written into ``postgresql.auto.conf``."""
        merged = dict(_DEFAULT_SETTINGS)
        merged["port"] = str(self.port)
        merged["unix_socket_directories"] = str(self.directory)
        merged.update(self._settings)
        return merged

    @property
    def running(self) -> bool:
        pid = self._read_postmaster_pid()
        return pid is not None and _process_alive(pid)

    # ---------------------------------------------------------------- URLs and databases

    def url(self, dbname: str = "postgres", **params: str | int | float) -> str:
        """libpq URI ``postgresql://postgres@127.0.0.1:PORT/DBNAME[?params]``."""
        base = f"postgresql://{_SUPERUSER}@127.0.0.1:{self.port}/{quote(dbname, safe='')}"
        if params:
            base += "?" + urlencode({k: str(v) for k, v in params.items()}, quote_via=quote)
        return base

    def create_database(self, name: str) -> str:
        """Create database ``name`` and return its URL."""
        _create_database(self.url(), name)
        return self.url(name)

    def drop_database(self, name: str) -> None:
        """Drop ``name`` after terminating its sessions and dropping its replication slots."""
        drop_database(self.url(), name)

    # ---------------------------------------------------------------- lifecycle

    def start(self, timeout: float = _START_TIMEOUT) -> None:
        """Start the server (initialising the cluster first if needed) and wait for connections."""
        if self._watchdog is None:
            self._watchdog = Watchdog(self.directory, self.data_dir / "postmaster.pid")
        if not self._initialised:
            self._initdb()
        if self.running:
            return
        self._remove_stale_lockfiles()
        deadline = time.monotonic() + timeout
        result = self._run(
            [
                str(self._bin("pg_ctl")),
                "start",
                "-D",
                str(self.data_dir),
                "-l",
                str(self.log_path),
                "-w",
                "-t",
                str(max(1, int(timeout))),
            ],
            check=False,
            timeout=timeout + 10,
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"PostgreSQL failed to start (pg_ctl exit {result.returncode}): "
                f"{result.stdout.strip()} {result.stderr.strip()}\n"
                f"{self._log_tail()}"
            )
        self._postmaster_pid = self._read_postmaster_pid()
        self._wait_accepting(deadline)

    def stop(self, mode: str = "fast") -> None:
        """Stop the server with ``pg_ctl stop -m MODE`` (``smart``, ``fast`` or ``immediate``)."""
        if mode not in ("smart", "fast", "immediate"):
            raise ValueError(f"unknown shutdown mode {mode!r}")
        if not self._initialised or not self.running:
            return
        result = self._run(
            [
                str(self._bin("pg_ctl")),
                "stop",
                "-D",
                str(self.data_dir),
                "-m",
                mode,
                "-w",
                "-t",
                str(int(_STOP_TIMEOUT)),
            ],
            check=False,
            timeout=_STOP_TIMEOUT + 10,
        )
        if result.returncode != 0 and self.running:
            raise RuntimeError(
                f"PostgreSQL did not stop (pg_ctl exit {result.returncode}): "
                f"{result.stdout.strip()} {result.stderr.strip()}\n"
                f"{self._log_tail()}"
            )
        self._postmaster_pid = None

    def kill(self, timeout: float = 10.0) -> None:
        """Crash the server: SIGKILL the postmaster and all its children at once.

        The next :meth:`start` runs crash recovery. WAL that the server had written survives
        (it is in the OS page cache); WAL still in shared memory is lost, which with
        ``synchronous_commit=off`` can include the latest commits.
        """
        pid = self._read_postmaster_pid() or self._postmaster_pid
        if pid is None or not _process_alive(pid):
            return
        # pg_ctl starts the postmaster with setsid(): it leads its own process group, which holds
        # every backend and auxiliary process and nothing else.
        try:
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + timeout
        while _process_alive(pid) or _group_alive(pid):
            if time.monotonic() > deadline:
                raise RuntimeError(f"PostgreSQL processes of group {pid} survived SIGKILL")
            time.sleep(0.01)
        self._postmaster_pid = None

    # ---------------------------------------------------------------- physical standby

    @classmethod
    def standby_of(
        cls,
        primary: LocalPostgres,
        slot_name: str,
        *,
        settings: Mapping[str, str] | None = None,
        sync_dbname: str = "postgres",
    ) -> LocalPostgres:
        """A hot standby of ``primary`` (same binaries), streaming through physical slot
        ``slot_name``, which this creates on the primary; :meth:`start` starts it.

        The data directory is a ``pg_basebackup`` of the running primary. The standby's own
        ``postgresql.auto.conf`` replaces the copied one: its port and socket directory,
        ``primary_conninfo`` (with ``dbname=sync_dbname`` and ``application_name=slot_name``, so
        that ``sync_replication_slots = on`` in ``settings`` can synchronise failover slots, and
        ``synchronous_standby_names`` on the primary can name it), ``primary_slot_name`` and
        ``hot_standby_feedback = on``; then ``settings``. The primary's own settings are not
        inherited (``synchronized_standby_slots`` would make a promoted standby wait for itself).
        """
        standby = cls(settings=settings, bindir=primary.bindir)
        conninfo = make_conninfo(
            host="127.0.0.1",
            port=str(primary.port),
            user=_SUPERUSER,
            dbname=sync_dbname,
            application_name=slot_name,
        )
        standby._settings = {
            "primary_conninfo": conninfo,
            "primary_slot_name": slot_name,
            "hot_standby_feedback": "on",
            **standby._settings,
        }
        with psycopg.connect(primary.url(), autocommit=True) as conn:
            conn.execute("SELECT pg_create_physical_replication_slot(%s, true)", (slot_name,))
        root = standby.directory
        try:
            if standby._as_root:
                user = service_user()
                os.chown(root, user.uid, user.gid)
            standby._run(
                [
                    str(standby._bin("pg_basebackup")),
                    "-D",
                    str(standby.data_dir),
                    "-d",
                    conninfo,  # pg_basebackup ignores its dbname
                    "-X",
                    "stream",
                    "-c",
                    "fast",
                    "--no-sync",
                ]
            )
            (standby.data_dir / "standby.signal").touch()
            standby._write_settings()
        except BaseException:
            standby.cleanup()
            raise
        standby._initialised = True
        return standby

    # ---------------------------------------------------------------- major upgrade

    def upgrade_from(self, old: LocalPostgres, timeout: float = 300.0) -> None:
        """``pg_upgrade`` ``old``'s cluster into this one, as an operator upgrades a major version:
        both stopped, this one freshly initialised (by this call) with its own settings; then
        :meth:`start` runs the upgraded cluster. ``old`` is left stopped."""
        old.stop()
        if not self._initialised:
            # pg_upgrade needs both clusters alike in data checksums (on by default from 18).
            control = old._run([str(old._bin("pg_controldata")), str(old.data_dir)]).stdout
            checksums = "Data page checksum version:" in control and not re.search(
                r"Data page checksum version:\s+0\b", control
            )
            accepted = self._run([str(self._bin("initdb")), "--help"]).stdout
            if checksums:
                self._initdb("--data-checksums")
            elif "--no-data-checksums" in accepted:
                self._initdb("--no-data-checksums")
            else:
                self._initdb()
        self.stop()
        self._run(
            [
                str(self._bin("pg_upgrade")),
                "--old-bindir",
                str(old.bindir),
                "--new-bindir",
                str(self.bindir),
                "--old-datadir",
                str(old.data_dir),
                "--new-datadir",
                str(self.data_dir),
                "--username",
                _SUPERUSER,
                "--old-port",
                str(old.port),
                "--new-port",
                str(self.port),
                "--socketdir",
                str(self.directory),
                "--no-sync",
            ],
            timeout=timeout,
        )

    @property
    def in_recovery(self) -> bool:
        """True while the server is a standby (``pg_is_in_recovery()``)."""
        with psycopg.connect(self.url(), autocommit=True, connect_timeout=5) as conn:
            row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
        return bool(row and row[0])

    def promote(self, timeout: float = _START_TIMEOUT) -> None:
        """Promote a standby to a primary (``pg_ctl promote``) and wait until it accepts writes."""
        self._run(
            [
                str(self._bin("pg_ctl")),
                "promote",
                "-D",
                str(self.data_dir),
                "-w",
                "-t",
                str(max(1, int(timeout))),
            ],
            timeout=timeout + 10,
        )
        deadline = time.monotonic() + timeout
        while self.in_recovery:
            if time.monotonic() > deadline:
                raise RuntimeError(f"standby on port {self.port} still in recovery after promote")
            time.sleep(0.05)

    # ---------------------------------------------------------------- transaction ids

    def next_transaction_id(self) -> int:
        """The 64-bit id the next transaction will get (``pg_snapshot_xmax`` of a snapshot)."""
        with psycopg.connect(self.url(), autocommit=True) as conn:
            row = conn.execute("SELECT pg_snapshot_xmax(pg_current_snapshot())::text").fetchone()
        assert row is not None
        return int(str(row[0]))

    def advance_transaction_ids(self, full_xid: int) -> None:
        """Move the next 64-bit transaction id forward to ``full_xid``, as if that many
        transactions had run: for tests of what happens after billions of them.

        Every database is first frozen (``VACUUM FREEZE``, as autovacuum would have done over those
        transactions: a tuple keeps its raw 32-bit ``xmin``, marked frozen), then the stopped
        cluster's next id is set with ``pg_resetwal -x`` (and ``-e`` for the epoch, the upper 32
        bits), with the commit-log segment that id needs, and the server started again.
        ``pg_resetwal`` also starts a new WAL: replication slots cannot stream across the jump.
        PostgreSQL refuses ids more than 2^31 - 3M past the oldest unfrozen one, so a step is at
        most :data:`MAX_TRANSACTION_ID_STEP`; larger moves take several calls.
        """
        current = self.next_transaction_id()
        if not 0 < full_xid - current <= MAX_TRANSACTION_ID_STEP:
            raise ValueError(
                f"can move transaction ids forward by 1..{MAX_TRANSACTION_ID_STEP} at once, "
                f"not from {current} to {full_xid}"
            )
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute("ALTER DATABASE template0 WITH ALLOW_CONNECTIONS true")
            names = [str(r[0]) for r in conn.execute("SELECT datname FROM pg_database").fetchall()]
        for name in names:
            with psycopg.connect(self.url(name), autocommit=True) as conn:
                conn.execute("VACUUM FREEZE")
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute("ALTER DATABASE template0 WITH ALLOW_CONNECTIONS false")
        self.stop()
        epoch, xid = divmod(full_xid, 1 << 32)
        pg_xact = self.data_dir / "pg_xact"
        width = max((len(p.name) for p in pg_xact.iterdir()), default=4)
        segment = pg_xact / f"{xid // _XACTS_PER_CLOG_SEGMENT:0{width}X}"
        self._run(
            [str(self._bin("pg_resetwal")), "-x", str(xid), "-e", str(epoch), str(self.data_dir)]
        )
        if not segment.exists():
            self._run(["dd", "if=/dev/zero", f"of={segment}", "bs=8192", "count=32"])
        self.start()

    def restart(self, mode: str = "fast") -> None:
        """Stop (``mode``) and start again on the same port, with the same settings."""
        self.stop(mode)
        self.start()

    def cleanup(self) -> None:
        """Stop the server if it runs (killing it if it does not stop) and delete the directory."""
        try:
            if self._initialised and self.running:
                try:
                    self.stop("fast")
                except Exception:
                    self.kill()
        finally:
            self._initialised = False
            self._postmaster_pid = None
            self._release()

    def __repr__(self) -> str:
        return f"LocalPostgres(port={self._port}, directory={self._root})"

    # ---------------------------------------------------------------- internals

    def _bin(self, name: str) -> Path:
        if self._bindir is None:
            self._bindir = usable_bindir(self._requested_bindir or find_bindir())
        return self._bindir / name

    def _run(
        self, argv: Sequence[str], *, check: bool = True, timeout: float = 120.0
    ) -> subprocess.CompletedProcess[str]:
        """Run a server binary, as the service user when we are root."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env["LC_ALL"] = "C"
        user = service_user() if self._as_root else None
        cmd = list(argv)
        result = subprocess.run(
            cmd,
            cwd=self.directory,
            env=env,
            user=None if user is None else user.uid,
            group=None if user is None else user.gid,
            extra_groups=None if user is None else [],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and result.returncode != 0:
            raise RuntimeError(
                f"{shlex.join(cmd)} failed with exit code {result.returncode}:\n"
                f"{result.stdout}\n{result.stderr}"
            )
        return result

    def _initdb(self, *options: str) -> None:
        initdb = self._bin("initdb")  # raises the install hint before any directory is made
        root = self.directory
        if self._as_root:
            user = service_user()
            os.chown(root, user.uid, user.gid)
        self._run(
            [
                str(initdb),
                "-D",
                str(self.data_dir),
                "-A",
                "trust",
                "-U",
                _SUPERUSER,
                "-E",
                "UTF8",
                "--no-locale",
                "--no-sync",
                *options,
            ]
        )
        self._write_settings()
        self._initialised = True

    def _write_settings(self) -> None:
        settings = self.settings
        if _OUTPUT_PLUGIN_SETTING not in settings and self._knows(_OUTPUT_PLUGIN_SETTING):
            settings[_OUTPUT_PLUGIN_SETTING] = _OUTPUT_PLUGINS
        lines = [
            "# Written by cdc_relay.local.LocalPostgres; ALTER SYSTEM may append below.",
            *(f"{key} = {_quote_setting(value)}" for key, value in settings.items()),
        ]
        auto_conf = self.data_dir / "postgresql.auto.conf"
        # Opening the existing file keeps its owner (postgres when we run as root).
        with auto_conf.open("w") as fh:
            fh.write("\n".join(lines) + "\n")

    def _knows(self, setting: str) -> bool:
        """Whether this server has ``setting`` (``postgres -C`` on the stopped data directory)."""
        probe = [str(self._bin("postgres")), "-D", str(self.data_dir), "-C", setting]
        return self._run(probe, check=False, timeout=30).returncode == 0

    def _read_postmaster_pid(self) -> int | None:
        if self._root is None:
            return None
        return _read_pid(self.data_dir / "postmaster.pid")

    def _remove_stale_lockfiles(self) -> None:
        """Delete ``postmaster.pid`` and the socket lock file left behind by a killed server.

        The server itself ignores a lock file whose pid is gone, but not one whose pid is a zombie
        (the killed postmaster until its new parent, often PID 1, reaps it) or was recycled.
        """
        for lock in (
            self.data_dir / "postmaster.pid",
            self.directory / f".s.PGSQL.{self.port}.lock",
        ):
            pid = _read_pid(lock)
            if pid is not None and not _process_alive(pid):
                with contextlib.suppress(FileNotFoundError):
                    lock.unlink()

    def _wait_accepting(self, deadline: float) -> None:
        last_error: Exception | None = None
        while True:
            try:
                with psycopg.connect(self.url(), connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.OperationalError as exc:
                last_error = exc
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"PostgreSQL on port {self.port} did not accept connections: {last_error}\n"
                    f"{self._log_tail()}"
                )
            time.sleep(0.05)


class ExternalPostgres:
    """A server somebody else runs, reached through a superuser (or CREATEDB) ``admin_url``.

    Offers the :class:`LocalPostgres` database API; it cannot be stopped, killed or restarted.
    """

    def __init__(self, admin_url: str) -> None:
        self.admin_url = admin_url

    def url(self, dbname: str = "postgres", **params: str | int | float) -> str:
        return _with_dbname(self.admin_url, dbname, params)

    def create_database(self, name: str) -> str:
        _create_database(self.admin_url, name)
        return self.url(name)

    def drop_database(self, name: str) -> None:
        drop_database(self.admin_url, name)

    def __repr__(self) -> str:
        return "ExternalPostgres(<admin url>)"
