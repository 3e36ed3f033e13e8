"""Deleting published outbox rows — never a row whose event Kafka has not acknowledged.

The invariant: a row visible to a statement that also reads ``pg_current_wal_insert_lsn()`` was
committed *below* that LSN (a transaction becomes visible only after its commit record is in the
WAL, and the statement's snapshot is taken before the function runs). The relay's own record,
``<state_schema>.slot_position.confirmed_lsn``, is a position below which Kafka acknowledged every
event. So, per outbox table, two phases and no state that must survive a crash:

1. *select*: one short statement returns the fence ``L = pg_current_wal_insert_lsn()`` together
   with up to ``CDC_RELAY_SWEEP_BATCH_SIZE`` candidate row keys (of rows matching the table's row
   filter and sweep condition, older than the retention, if any), in key order; a backlog is read
   as several such pages, each with its own fence, up to :data:`MAX_CANDIDATES_PER_TABLE` per
   pass;
2. *delete*: once the recorded position is ``>= L``, ``DELETE ... WHERE key = ANY(candidates)``
   (and the row filter, sweep condition and sweep boundary, checked again) in a transaction of its
   own: row locks on published rows only, never a table lock, so inserting writers are never
   blocked.

The row key is not the event id: it is the table's primary key or configured unique columns
(:mod:`cdc_relay.row_key`), whatever column feeds the ``id`` header, read with its columns' types
every pass: a key column whose type changed (``ALTER COLUMN id TYPE text``) or a new primary key
drops the candidates selected by the old one, which are selected again. A row the row filter
leaves out is never published, so it is never a candidate either: rows for another destination
stay.

The fence covers commits the slot decoded; it cannot cover rows the slot never decoded — rows of
transactions older than the slot (or than a change of the relay's row filter, or than the
attaching of the partition they are in). The *sweep boundary* (``slot_position.sweep_from_xid``,
a 64-bit transaction id taken when the slot was created) excludes them: a statement only takes a
row of a transaction at or after its table's (its partition's) effective boundary, comparing the
row's 32-bit ``xmin`` through the statement's own next 64-bit id; such rows (which predate the
boundary) are never deleted. :mod:`cdc_relay.sweep_boundary` owns that comparison and why it stays
exact however many transactions pass: it looks at each table once, settles it when no older row is
left, and otherwise keeps the point at which an older row's 32-bit id would come round, stopping
this table's deletes (loudly, naming the rows) before it — what it learnt is kept in
``slot_position.sweep_horizons``, for sweepers started later.

A table rewrite (``ALTER TABLE … TYPE``, ``VACUUM FULL``, ``CLUSTER``) keeps both halves true.
The fence: a rewritten row is visible to the select only once the rewrite committed, after the
row's own insert — below ``L`` too. The boundary: a rewrite may give every row the rewriting
transaction's id, an older row too; a table with no older row left (settled) has none to confuse,
and one that has moves its effective boundary past the rewrite (every row it holds then is kept).
An ``UPDATE`` of an older row does the same to that row and is not seen: outbox rows are written
once.

Candidates wait in memory between passes; after a crash they are simply selected again — with a
new fence, which the relay has to confirm past first (the fence is the WAL's end, always beyond
the record), so a sweeper that starts while the relay is down deletes nothing. The publication
publishes inserts only, so the deletes never reach the relay (nor Kafka).

A partitioned outbox is swept through its root, its key (which includes the partition key) naming
a row in whichever partition holds it; its publication publishes the partitions' rows as the
root's (``publish_via_partition_root``). Each leaf partition has its own effective boundary: after
the transaction that attached it (its ``pg_inherits`` rows, up to the root), so the rows a table
brought with it when it was attached — committed before it was part of the outbox, never
published — are never deleted. Detaching or dropping a partition loses nothing unpublished: rows
committed in it before are in the WAL the slot keeps, and decoded with the catalog of their time.

Several sweepers at once are harmless, each deleting only what the record covers: the relay runs
its own only while it leads (:mod:`cdc_relay.leadership`), but a ``sweep`` command beside it, or a
stale leader's sweeper for the moment before it notices, may sweep too. The record is written only
by the lease holder, and only ever with positions Kafka acknowledged; the horizons only with what a
look at the table found, for the boundary the record holds.

Guards, checked every pass before anything is deleted:

- the record must be one this server can have (:mod:`cdc_relay.record_origin`): at or below its
  WAL end, written under its system identifier and current timeline. A record restored from
  another cluster or edited ahead would cover every row; nothing is deleted (``sweep`` exits 4);
- a table is swept only by the row filter the relay relays it with: the one the relay recorded
  (:mod:`cdc_relay.relayed_filters`) and, on PostgreSQL 15+, the publication's. A sweeper whose
  settings filter otherwise deletes nothing from that table (``sweep`` exits 3): a row outside
  the relay's filter was never published;
- a table is swept only while the relay's publication publishes its inserts (rows of a table the
  relay does not stream are never "published", whatever the recorded position says), and only
  when it has a row key that is unique (the delete names rows by it);
- a table (a partition) whose older rows could soon look younger than its boundary is not swept
  (``sweep`` exits 3) until they are gone.
- nothing is swept while the publication and the outbox tables are not what the relay verified
  and recorded with its position (:mod:`cdc_relay.publication_stamp`): the relay records no
  position past a change, and the start after one takes the sweep boundary afresh; until then,
  rows committed since may never have been streamed;
- nothing is swept while a recovery of a lost slot has not ended (:mod:`cdc_relay.recovery`): it
  names the rows it owes by their place among those in the table, which a delete would move
  (the rows it owes are never deleted anyway: the recorded position covers none of them).

The delete checks the row filter, the sweep condition and the sweep boundary again, as read with
the position that covers it: a relay restarted with another filter takes a new boundary, so rows
it decoded under the old one are never deleted, even from candidates selected before.

Retention compares the creation-time column with ``now()``; a ``timestamp without time zone``
(or ``date``) column is read in ``CDC_RELAY_SWEEP_TIME_ZONE`` (UTC by default), never in the
session's ``TimeZone``, which would shift retention by the server's offset from it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import psycopg
from psycopg import sql

from cdc_relay.backoff import Backoff
from cdc_relay.checkpoint import PostgresCheckpointStore, Record
from cdc_relay.config import OutboxTable, Settings, env_name
from cdc_relay.errors import PositionMismatch, SourceSetupError, SourceUnavailable
from cdc_relay.lsn import format_lsn, parse_lsn
from cdc_relay.observability.stats import RelayStats
from cdc_relay.postgres_errors import During, error_for, message
from cdc_relay.publication_filter import find_mismatch
from cdc_relay.publication_stamp import sweep_refusal
from cdc_relay.record_origin import problem, refusal
from cdc_relay.recovery.loss import in_progress
from cdc_relay.relayed_filters import differences
from cdc_relay.replication.source import connect, relation_oid
from cdc_relay.row_key import key_types, resolve_row_key
from cdc_relay.sweep_boundary import (
    NO_HORIZON,
    REFUSE_MARGIN,
    WARN_MARGIN,
    Horizon,
    Look,
    from_json,
    left,
    plan,
    settle,
)
from cdc_relay.sweep_queries import (
    Eligible,
    delete_batch,
    leaves,
    live_rows,
    load_horizons,
    older_rows,
    published_tables,
    retention,
    save_horizons,
    scan,
    select_page,
)

log = logging.getLogger(__name__)

# Candidate rows held per table between passes (memory: ~100 bytes each). A backlog larger than
# this is worked through over several passes.
MAX_CANDIDATES_PER_TABLE = 100_000
LOCK_TIMEOUT = "2s"  # a row someone else holds locked is retried next pass, never waited for
STATEMENT_TIMEOUT = "60s"
WAIT_POLL = 0.2  # seconds between looks at the recorded position in sweep_until_done
# The share of the interval over which the relay's sweeper spreads a pass's statements. The rest
# of the interval lets the relay confirm past the last page's fence before the next pass.
SPREAD = 0.6

Connection = psycopg.Connection[tuple[object, ...]]


@dataclass(frozen=True)
class Candidates:
    """One selected batch: ids visible to a statement that read ``fence`` as the WAL insert end."""

    fence: int
    ids: tuple[object, ...]


@dataclass(frozen=True)
class SweptBatch:
    """One delete transaction."""

    table: str
    fence: int
    position: int  # the relay's recorded position that covered the fence
    ids: tuple[object, ...]  # the ids actually deleted (RETURNING)
    at: float  # Unix time right after the commit


class CandidateQueue:
    """A table's selected batches, oldest fence first (fences only grow). Pure, no I/O."""

    def __init__(self) -> None:
        self._batches: deque[Candidates] = deque()
        self._rows = 0

    def add(self, fence: int, ids: Sequence[object]) -> None:
        if not ids:
            return
        if self._batches and fence < self._batches[-1].fence:
            raise ValueError("fences must not go backwards")
        self._batches.append(Candidates(fence, tuple(ids)))
        self._rows += len(ids)

    def take_covered(self, position: int | None) -> list[Candidates]:
        """Remove and return the batches whose fence ``position`` covers."""
        taken: list[Candidates] = []
        while position is not None and self._batches and self._batches[0].fence <= position:
            batch = self._batches.popleft()
            self._rows -= len(batch.ids)
            taken.append(batch)
        return taken

    def covered(self, position: int | None) -> int:
        """How many batches :meth:`take_covered` would take."""
        if position is None:
            return 0
        return sum(1 for batch in self._batches if batch.fence <= position)

    def put_back(self, batches: Sequence[Candidates]) -> None:
        """Return batches (taken but not deleted) to the front, keeping fence order."""
        for batch in reversed(batches):
            self._batches.appendleft(batch)
            self._rows += len(batch.ids)

    def clear(self) -> None:
        self._batches.clear()
        self._rows = 0

    @property
    def rows(self) -> int:
        return self._rows

    @property
    def batches(self) -> int:
        return len(self._batches)

    @property
    def highest_fence(self) -> int | None:
        return self._batches[-1].fence if self._batches else None

    def __bool__(self) -> bool:
        return bool(self._batches)


class Pace:
    """When a pass's next statement may start: the statements planned for the pass evenly over
    ``within`` seconds, and never busier than half the time (a rest at least as long as the
    statement before took). Pure, given the clock's readings."""

    def __init__(self, statements: int, within: float, now: float) -> None:
        self._until = now + within
        self._left = statements
        self._took: float | None = None  # the last statement's time; None: none yet

    def rest(self, now: float) -> float:
        """Seconds to rest, at ``now``, before the next statement."""
        if self._took is None:
            return 0.0
        if self._left <= 0:  # more statements than planned: only the half duty cycle
            return self._took
        # The time left shared by the statements left, each taking about as long as the last.
        even = (self._until - now) / self._left - self._took
        return max(self._took, even)

    def ran(self, took: float) -> None:
        """A statement ran for ``took`` seconds."""
        self._took = took
        self._left -= 1


@dataclass
class SweepResult:
    """What one pass (or one ``sweep_until_done``) did and what still waits."""

    deleted: int = 0
    waiting: int = 0  # candidates waiting for the relay, plus an estimate of rows not yet selected
    position: int | None = None  # the relay's recorded position (None: no record yet)
    fence: int | None = None  # the highest fence among waiting candidates
    batches: list[SweptBatch] = field(default_factory=list)
    deleted_by_table: dict[str, int] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # table -> why it was not swept
    # table -> why this sweeper may not sweep it (its row filter is not the relay's, or rows
    # older than its sweep boundary could no longer be told from younger ones)
    refused: dict[str, str] = field(default_factory=dict)
    # table -> what will stop its sweeping if nobody acts (older rows nearing their horizon)
    warnings: dict[str, str] = field(default_factory=dict)

    def add(self, batch: SweptBatch) -> None:
        self.batches.append(batch)
        self.deleted += len(batch.ids)
        self.deleted_by_table[batch.table] = self.deleted_by_table.get(batch.table, 0) + len(
            batch.ids
        )

    def describe(self) -> list[str]:
        """Lines for ``python -m cdc_relay sweep``."""
        lines = []
        for table, count in self.deleted_by_table.items():
            transactions = sum(1 for b in self.batches if b.table == table)
            lines.append(
                f"deleted {count} published row(s) from {table} in {transactions} transaction(s)"
            )
        if not self.deleted_by_table:
            lines.append("deleted nothing")
        for table, error in self.errors.items():
            lines.append(f"not swept {table}: {error}")
        for table, reason in self.refused.items():
            lines.append(f"refused to sweep {table}: {reason}")
        for table, warning in self.warnings.items():
            lines.append(f"warning for {table}: {warning}")
        if self.waiting == 0:
            lines.append("nothing waits")
        elif self.position is None:
            lines.append(
                f"{self.waiting} row(s) wait: the relay has not recorded a position yet "
                "(has it ever run?)"
            )
        elif self.fence is not None and self.fence > self.position:
            lines.append(
                f"{self.waiting} row(s) wait for the relay to confirm past "
                f"{format_lsn(self.fence)} (it has confirmed {format_lsn(self.position)})"
            )
        else:
            lines.append(f"{self.waiting} row(s) wait for the next sweep")
        return lines


class _TableState:
    def __init__(self, table: OutboxTable) -> None:
        self.table = table
        self.queue = CandidateQueue()
        self.unselected = 0  # estimate of eligible rows beyond the candidates (selection capped)
        self.pages = 1  # pages the last selection read: what the next is expected to read
        self.key: tuple[str, ...] = ()  # the row key, resolved each pass
        self.key_types: list[sql.Composable] = []  # of the key's columns, resolved with it
        # Per leaf (the table, or each leaf partition) what the last look found, and when
        # (monotonic), and what this pass's statements may take (cdc_relay.sweep_boundary).
        self.horizons: dict[int, Horizon] = {}
        self.looked: dict[int, float] = {}
        self.unsaved: dict[str, object] = {}  # learnt, not yet kept in the database
        self.eligible = Eligible()
        # Row filter and sweep condition: what a row must match to be deleted at all.
        conditions = [c for c in (table.filter, table.sweep_filter) if c is not None]
        self.condition: sql.Composable | None = (
            sql.SQL(" AND ").join(c.render() for c in conditions) if conditions else None
        )


class Sweeper:
    """Deletes the outbox rows the relay has published; see the module documentation."""

    def __init__(self, settings: Settings, stats: RelayStats | None = None) -> None:
        self.settings = settings
        self.stats = stats  # the relay's; this sweeper's own counters are the attributes below
        self.batch_size = settings.sweep_batch_size
        self.retention = settings.sweep_retention_seconds
        tables = settings.tables()  # a retention has its column: config.py
        self._tables = [_TableState(t) for t in tables]
        self._conn: Connection | None = None
        self._lock = threading.Lock()  # one pass at a time (relay thread vs. a CLI caller)
        self._stop: threading.Event | None = None  # run()'s: a long pass ends early on stop
        # run()'s: the seconds over which a pass spreads its statements (0: as fast as the half
        # duty cycle allows, for a sweep on demand).
        self._spread = 0.0
        self._pace = Pace(0, 0.0, 0.0)
        self._reported: dict[str, str] = {}  # table -> the error last logged for it
        self._warned: set[str] = set()  # tables warned about the last pass
        # Counters for metrics and /status.
        self.deleted_total = 0
        self.last_sweep_at = 0.0  # Unix time of the last completed pass
        self.rows_waiting = 0

    # -- the public API ----------------------------------------------------------------------

    def sweep_once(self) -> SweepResult:
        """One pass: delete the candidates the relay's position now covers, then select more."""
        with self._lock:
            return self._pass(select=True)

    def sweep_until_done(self, timeout: float) -> SweepResult:
        """One selection, then delete as the relay's position covers it, for at most ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._lock:
            total = self._pass(select=True)
            while any(state.queue for state in self._tables):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                if total.position is None or (
                    total.fence is not None and total.fence > total.position
                ):
                    time.sleep(min(WAIT_POLL, remaining))
                result = self._pass(select=False)
                for batch in result.batches:
                    total.add(batch)
                total.waiting, total.position, total.fence = (
                    result.waiting,
                    result.position,
                    result.fence,
                )
                total.errors.update(result.errors)
            return total

    def run(self, stop: threading.Event, may_sweep: Callable[[], bool] | None = None) -> None:
        """Sweep every ``sweep_interval`` seconds until ``stop`` is set; never raises. With
        ``may_sweep``, a pass runs only while it says so (the relay: while it leads)."""
        interval = self.settings.sweep_interval
        if interval <= 0:
            return
        backoff = Backoff(interval, max(self.settings.reconnect_max_backoff, interval))
        self._stop = stop
        self._spread = SPREAD * interval
        try:
            while not stop.is_set():
                delay = interval
                if may_sweep is not None and not may_sweep():
                    stop.wait(min(interval, 1.0))
                    continue
                started = time.monotonic()
                try:
                    result = self.sweep_once()
                except PositionMismatch as exc:
                    self.close()
                    delay = backoff.delay()
                    log.error(
                        "not sweeping: the position record cannot be this server's",
                        extra={"fields": {"error": str(exc), "retry_in_s": delay}},
                    )
                except (SourceUnavailable, SourceSetupError) as exc:
                    self.close()
                    delay = backoff.delay()
                    log.warning(
                        "sweep failed, retrying",
                        extra={"fields": {"error": str(exc).strip(), "retry_in_s": delay}},
                    )
                except Exception:  # a bug must not end the relay's sweeping for good
                    self.close()
                    log.exception("unexpected error while sweeping, retrying")
                    delay = backoff.delay()
                else:
                    backoff.reset()
                    self._log(result)
                    # Passes start every interval: a pass spread over it is not a longer period.
                    delay = max(interval - (time.monotonic() - started), 0.0)
                stop.wait(delay)
        finally:
            self.close()

    def _stopping(self) -> bool:
        return self._stop is not None and self._stop.is_set()

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                conn.close()

    # -- one pass ----------------------------------------------------------------------------

    def _pass(self, select: bool) -> SweepResult:
        conn = self._connection()
        try:
            result = self._sweep(conn, select)
        except psycopg.OperationalError as exc:
            self.close()
            raise SourceUnavailable(
                f"sweeper lost its database connection: {message(exc)}"
            ) from None
        except psycopg.Error as exc:  # e.g. statement_timeout: try again later
            self.close()
            raise SourceUnavailable(f"sweep failed: {message(exc)}") from None
        self.rows_waiting = result.waiting
        self.last_sweep_at = time.time()
        return result

    def _sweep(self, conn: Connection, select: bool) -> SweepResult:
        result = SweepResult()
        record = self._record(conn)
        position = record.stamp.position if record is not None and record.stamp else None
        boundary = record.sweep_from_xid if record is not None else None
        result.position = position
        published = published_tables(conn, self.settings.publication_name)
        refused = self._refused(conn, record) if position is not None else {}
        stored = self._stored_horizons(conn) if boundary is not None else None
        self._pace = Pace(self._planned(position, boundary, select), self._spread, time.monotonic())
        for state in self._tables:
            table = state.table.table
            if table in refused:
                state.queue.clear()  # selected under a filter this pass no longer vouches for
                result.refused[table] = refused[table]
                continue
            if table not in published:
                state.queue.clear()  # selected under a publication that no longer covers it
                result.errors[table] = (
                    f"not in publication {self.settings.publication_name} (inserts): its rows "
                    "are not relayed, so none is ever deleted"
                )
                continue
            key = resolve_row_key(conn, state.table)
            types = key_types(conn, state.table, key.columns) if key.columns else []
            if key.problem is not None or (key.columns, types) != (state.key, state.key_types):
                # A delete by a key that is not unique could also hit a later row; candidates
                # selected by another key, or as another type, are not this key's values.
                state.queue.clear()
                state.key, state.key_types = key.columns, types
            if key.problem is not None:
                result.errors[table] = key.problem
                continue
            if self._stopping():
                break
            try:
                state.eligible = Eligible()
                if boundary is not None:
                    self._judge(conn, state, boundary, stored, result)
                if not state.eligible:  # no boundary yet, or no leaf of it may be swept now
                    state.queue.clear()
                    state.unselected = 0
                    continue
                self._delete_covered(conn, state, position, boundary, result)
                if select and not state.queue:
                    self._select(conn, state, boundary)
            except (
                psycopg.errors.UndefinedTable,
                psycopg.errors.UndefinedColumn,
                psycopg.errors.InsufficientPrivilege,
                psycopg.errors.InvalidParameterValue,
                # The key's type changed between the pass's catalog read and a statement: the
                # next pass reads it again.
                psycopg.errors.UndefinedFunction,
                psycopg.errors.DatatypeMismatch,
                psycopg.errors.InvalidTextRepresentation,
            ) as exc:
                state.queue.clear()
                state.key = ()
                result.errors[table] = self._setup_message(state.table, exc)
        result.waiting = sum(s.queue.rows + s.unselected for s in self._tables)
        fences = [s.queue.highest_fence for s in self._tables if s.queue]
        result.fence = max(f for f in fences if f is not None) if fences else None
        return result

    def _delete_covered(
        self,
        conn: Connection,
        state: _TableState,
        position: int | None,
        boundary: int | None,
        result: SweepResult,
    ) -> None:
        taken = state.queue.take_covered(position if boundary is not None else None)
        for index, batch in enumerate(taken):
            # take_covered returns nothing without a position (nor, as called, a boundary)
            assert position is not None
            self._rest()
            if self._stopping():
                state.queue.put_back(taken[index:])
                return
            started = time.monotonic()
            try:
                ids = self._delete(conn, state, batch, state.eligible)
            except (psycopg.errors.LockNotAvailable, psycopg.errors.QueryCanceled):
                # Somebody holds one of these rows: try again next pass.
                state.queue.put_back(taken[index:])
                return
            finally:
                self._pace.ran(time.monotonic() - started)
            self.deleted_total += len(ids)  # counted at once: a later failure must not lose it
            result.add(SweptBatch(state.table.table, batch.fence, position, ids, time.time()))

    def _rest(self) -> None:
        """Before a statement of the pass (a delete or a page of candidates), rest as the pace
        says: the pass's statements spread over the interval, and at most half the time busy.

        Statements back to back keep a core busy in PostgreSQL beside the writers and fill the
        WAL the walsender must read through: the relay's commit-to-acknowledgement latency
        suffered in those seconds, on a machine whose cores the database, relay and broker share.
        """
        delay = self._pace.rest(time.monotonic())
        if delay <= 0:
            return
        if self._stop is not None:
            self._stop.wait(delay)
        else:
            time.sleep(delay)

    def _planned(self, position: int | None, boundary: int | None, select: bool) -> int:
        """The statements this pass expects to run: the deletes the position covers, and the
        pages a table's last selection read where it will select again (its queue emptied)."""
        covered = position if boundary is not None else None
        planned = 0
        for state in self._tables:
            batches = state.queue.covered(covered)
            planned += batches
            if select and boundary is not None and batches == state.queue.batches:
                planned += max(state.pages, 1)
        return planned

    def _delete(
        self, conn: Connection, state: _TableState, batch: Candidates, eligible: Eligible
    ) -> tuple[object, ...]:
        """Phase 2 for one batch: only rows ``eligible`` allows, as judged with the sweep
        boundary read with the position that covers the batch."""
        return delete_batch(conn, state, batch.ids, eligible)

    def _select(self, conn: Connection, state: _TableState, boundary: int | None) -> None:
        """Phase 1: pages of candidates, each with its own fence, up to the per-table cap."""
        table = state.table
        state.unselected = 0
        if boundary is None:
            return  # no slot recorded yet: nothing is known to be published
        created_at = (
            retention(conn, table, self.retention, self.settings.sweep_time_zone)
            if self.retention > 0
            else None
        )
        after: object = None
        state.pages = 0
        while state.queue.rows < MAX_CANDIDATES_PER_TABLE:
            self._rest()
            if self._stopping():
                break
            started = time.monotonic()
            try:
                fence, ids = select_page(
                    conn, state, after, state.eligible, created_at=created_at, limit=self.batch_size
                )
            finally:
                self._pace.ran(time.monotonic() - started)
            state.pages += 1
            state.queue.add(fence, ids)
            if len(ids) < self.batch_size:
                return
            after = ids[-1]
        # Capped: estimate what is left for later passes (statistics, may lag).
        state.unselected = max(live_rows(conn, table) - state.queue.rows, 0)

    # -- the sweep boundary, per leaf ---------------------------------------------------------

    def _judge(
        self,
        conn: Connection,
        state: _TableState,
        boundary: int,
        stored: dict[str, object] | None,
        result: SweepResult,
    ) -> None:
        """Set ``state.eligible``: the leaves of the table that may be swept, each from its
        effective boundary and below its horizon; look at those that need it (a scan each) and
        keep what was learnt; refuse or warn about the others (:mod:`cdc_relay.sweep_boundary`)."""
        table = state.table
        oid = relation_oid(conn, table)
        if oid is None:
            return
        now, found = leaves(conn, oid)
        plans: dict[int, Horizon | Look] = {}
        for leaf in found:
            known = state.horizons.get(leaf.oid)
            if known is None or known.boundary != boundary:
                known = from_json((stored or {}).get(str(leaf.oid)))
            looked = state.looked.get(leaf.oid)
            ago = None if looked is None else time.monotonic() - looked
            plans[leaf.oid] = plan(leaf, known, boundary, now, ago)
        looks = {o: p for o, p in plans.items() if isinstance(p, Look)}
        scans = scan(conn, table, {o: p.since for o, p in looks.items()}) if looks else {}
        learnt: dict[str, object] = {}
        refusals: list[str] = []
        warnings: list[str] = []
        oids: list[int] = []
        since: list[int] = []
        until: list[int] = []
        for leaf in found:
            decided = plans[leaf.oid]
            if isinstance(decided, Look):
                state.looked[leaf.oid] = time.monotonic()
                judged = settle(leaf, decided, boundary, scans[leaf.oid])
                if isinstance(judged, str):
                    state.horizons.pop(leaf.oid, None)
                    refusals.append(f"{judged}. {self._new_boundary_fix(leaf.name, leaf.attached)}")
                    continue
                decided = judged
                state.horizons[leaf.oid] = judged
                learnt[str(leaf.oid)] = judged.to_json()
            remaining = left(decided, now)
            if remaining is not None and remaining <= WARN_MARGIN:
                what = self._older_rows(table, leaf.oid, leaf.name, decided, remaining)
                if remaining <= REFUSE_MARGIN:
                    refusals.append(f"{what}: the sweeper stops deleting from it now")
                    continue
                warnings.append(
                    f"{what}: the sweeper stops deleting from it {REFUSE_MARGIN} transactions "
                    "before that"
                )
            oids.append(leaf.oid)
            if decided.until is None:  # settled: every row of it is younger than its boundary
                since.append(0)
                until.append(NO_HORIZON)
            else:
                since.append(decided.since)
                until.append(decided.until)
        state.unsaved = {
            k: v for k, v in state.unsaved.items() if from_json(v) == state.horizons.get(int(k))
        }
        state.unsaved.update(learnt)
        if state.unsaved and self._keep_horizons(conn, boundary, state.unsaved):
            state.unsaved = {}
        if refusals:
            result.refused[table.table] = "; ".join(refusals)
        if warnings:
            result.warnings[table.table] = "; ".join(warnings)
        state.eligible = Eligible(tuple(oids), tuple(since), tuple(until))

    def _older_rows(
        self, table: OutboxTable, oid: int, name: str, horizon: Horizon, remaining: int
    ) -> str:
        query = older_rows(table, oid, horizon.since).as_string(self._conn)
        return (
            f"{name}: {horizon.older} row(s) predate the sweep boundary (they were committed "
            "before the relay's slot, a change of its row filter, a rewrite of the table or its "
            "partition's attach, and were never published by it); in "
            f"{max(remaining, 0)} transactions their 32-bit transaction ids come round and "
            "would look younger than the boundary. Delete them once you have checked they were "
            f"published otherwise (find them with: {query}); the sweeper then settles the table"
        )

    def _new_boundary_fix(self, name: str, attached: tuple[int, ...]) -> str:
        settings = self.settings
        statement = sql.SQL(
            "UPDATE {} SET sweep_from_xid = pg_snapshot_xmax(pg_current_snapshot()) "
            "WHERE slot_name = {}"
        ).format(
            sql.Identifier(settings.state_schema, "slot_position"),
            sql.Literal(settings.slot_name),
        )
        again = f" (or detach {name} and attach it again)" if attached else ""
        return (
            "Nothing is deleted from it until a new sweep boundary is taken"
            f"{again}: run {statement.as_string(self._conn)} — every row there then is kept "
            "for good: delete those the relay published yourself"
        )

    def _stored_horizons(self, conn: Connection) -> dict[str, object]:
        """What sweepers of this slot learnt and kept (anything else read as nothing)."""
        settings = self.settings
        try:
            stored = load_horizons(conn, settings.state_schema, settings.slot_name)
        except psycopg.errors.UndefinedColumn as exc:
            raise SourceSetupError(
                f"the relay's state table lacks a column ({exc.diag.message_primary}): the "
                "relay of this version adds it when it starts (or run "
                "sql/002_cdc_relay_state.sql as its owner); nothing is swept until then"
            ) from None
        return {str(k): v for k, v in stored.items()} if isinstance(stored, dict) else {}

    def _keep_horizons(self, conn: Connection, boundary: int, learnt: dict[str, object]) -> bool:
        """Keep what looks found for later sweepers; True once written. A write that cannot be
        made now (the relay holds the record's row) is tried again next pass."""
        settings = self.settings
        try:
            return save_horizons(conn, settings.state_schema, settings.slot_name, boundary, learnt)
        except (
            psycopg.errors.LockNotAvailable,
            psycopg.errors.QueryCanceled,
            psycopg.errors.InsufficientPrivilege,
        ):
            return False

    # -- what the relay has published --------------------------------------------------------

    def _record(self, conn: Connection) -> Record | None:
        """The relay's record, refused (PositionMismatch) when it cannot be this server's;
        None when there is none (the relay never ran: nothing is published)."""
        settings = self.settings
        store = PostgresCheckpointStore(conn, settings.state_schema, settings.slot_name)
        try:
            record = store.load_record()
        except psycopg.errors.UndefinedTable:
            return None
        except psycopg.errors.UndefinedColumn as exc:
            raise SourceSetupError(
                f"the relay's state table lacks a column ({exc.diag.message_primary}): the relay "
                "of this version adds it when it starts (or run sql/002_cdc_relay_state.sql as "
                "its owner); nothing is swept until then"
            ) from None
        reason = None if record.stamp is None else problem(record.stamp, record.server, None)
        if reason is not None:
            for state in self._tables:
                state.queue.clear()
            slot = conn.execute(
                "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                (settings.slot_name,),
            ).fetchone()
            confirmed = parse_lsn(str(slot[0])) if slot and slot[0] is not None else None
            raise PositionMismatch(
                refusal(reason, settings.state_schema, settings.slot_name, confirmed)
            )
        return record

    def _refused(self, conn: Connection, record: Record | None) -> dict[str, str]:
        """Per table, why this sweeper's row filter is not the one the relay relays it with (the
        relay's recorded filters and, on PostgreSQL 15+, the publication's), or why nothing may
        be swept (the publication is not the one the relay recorded with its position)."""
        tables = [s.table for s in self._tables]
        several = bool(self.settings.outbox_tables)  # the per-table setting names the filter
        recovering = in_progress(record.recovery) if record is not None else None
        if recovering is not None and recovering.replaces_slot:
            # A recovery names its rows by their place among those still in the table.
            return {
                t.table: "a recovery of the slot has not ended (cdc-relay recover): nothing is "
                "swept until it has"
                for t in tables
            }
        found = differences(record.row_filters if record is not None else None, tables)
        if found is None:
            return {
                t.table: "the relay has not recorded the row filters it relays with: a relay of "
                "this version records them when it starts; nothing is swept until then"
                for t in tables
            }
        refused = {d.table.table: d.describe(several) for d in found}
        mismatch = find_mismatch(conn, self.settings.publication_name, tables)
        if mismatch is not None:
            for table, text in zip(mismatch.tables, mismatch.found, strict=True):
                mine = str(table.filter) if table.filter is not None else "none"
                refused.setdefault(
                    table.table,
                    f"publication {mismatch.publication} filters {table.table} with "
                    f"{'row filter ' + text if text else 'no row filter'}, and this sweeper's "
                    f"row filter is {mine}: the relay sets the publication's at its start",
                )
        stamped = sweep_refusal(conn, record.publication_stamp if record is not None else None)
        for table in tables if stamped is not None else ():
            refused.setdefault(table.table, str(stamped))
        return refused

    # -- plumbing ----------------------------------------------------------------------------

    def _connection(self) -> Connection:
        if self._conn is None or self._conn.closed:
            conn = connect(self.settings.source_url())
            try:
                conn.execute("SET application_name = 'cdc-relay sweeper'")
                conn.execute(sql.SQL("SET lock_timeout = {}").format(sql.Literal(LOCK_TIMEOUT)))
                conn.execute(
                    sql.SQL("SET statement_timeout = {}").format(sql.Literal(STATEMENT_TIMEOUT))
                )
            except psycopg.Error as exc:
                conn.close()
                raise error_for(
                    exc, During.STATEMENT, "sweeper cannot use its connection"
                ) from None
            self._conn = conn
        return self._conn

    def _setup_message(self, table: OutboxTable, exc: psycopg.Error) -> str:
        detail = exc.diag.message_primary or str(exc).strip()
        if isinstance(exc, psycopg.errors.UndefinedColumn) and self.retention > 0:
            return (
                f"{detail}: {env_name('sweep_retention_seconds')} measures the column "
                f"{table.columns.created_at!r}; add it to {table.table} or map another one "
                f'("created_at" in {env_name("outbox_columns")})'
            )
        if isinstance(exc, psycopg.errors.InsufficientPrivilege):
            return f"{detail}: GRANT SELECT, DELETE ON {table.sql_name} TO the relay's user"
        if isinstance(exc, psycopg.errors.InvalidParameterValue):
            return f"{detail}: check {env_name('sweep_time_zone')} (a name in pg_timezone_names)"
        return detail

    def _log(self, result: SweepResult) -> None:
        if result.deleted:
            log.info(
                "swept published outbox rows",
                extra={
                    "fields": {
                        "deleted": result.deleted,
                        "transactions": len(result.batches),
                        "waiting": result.waiting,
                        "position": format_lsn(result.position or 0),
                    }
                },
            )
        problems = {**result.errors, **result.refused}
        for table, error in problems.items():
            if self._reported.get(table) != error:
                log.error(
                    "outbox table not swept", extra={"fields": {"table": table, "error": error}}
                )
        for table, warning in result.warnings.items():
            # The count of transactions left changes every pass: said once per kind of warning.
            if table not in self._warned:
                log.warning(
                    "outbox table will stop being swept",
                    extra={"fields": {"table": table, "warning": warning}},
                )
        self._reported = problems
        self._warned = set(result.warnings)
