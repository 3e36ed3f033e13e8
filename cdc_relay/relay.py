"""The relay: sessions, one after another, until stopped; health, metrics and the sweeper beside.

One *session* (:mod:`cdc_relay.session`) is one replication connection. It starts at the relay's
acknowledged position, reads messages in commit order and publishes every outbox event;
:mod:`cdc_relay.confirmation` confirms the contiguous watermark (first to the relay's own record,
then to the slot). A lost PostgreSQL connection or a Kafka producer that stops making progress
ends the session; the next one starts, after a backoff, from the position everything before which
Kafka acknowledged — never a lost event. Before it publishes again, it reads back from Kafka what
an earlier incarnation already delivered of the unconfirmed tail (:mod:`cdc_relay.reconcile`), so
that those events are not published twice. A session sends ``START_REPLICATION`` as soon as the
checks allow, then loads its code, builds the producer and reads back from Kafka while the server
decodes its way to the start position (start-up time, issue 17). What the relay cannot fix
(configuration, prerequisites, a poison record under ``stop``) ends :meth:`Relay.run` with the
project's error, whose exit code the CLI returns.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import orjson
import psycopg

from cdc_relay.backoff import Backoff
from cdc_relay.checkpoint import (
    PostgresCheckpointStore,
    Record,
    check_missing_slot,
    resolve_start,
)
from cdc_relay.config import Settings
from cdc_relay.decode import plugin_options_for
from cdc_relay.errors import (
    LeadershipLost,
    PositionMismatch,
    RelayError,
    SinkUnavailable,
    SlotInUse,
    SourceUnavailable,
    StopSession,
)
from cdc_relay.leadership import Leadership, terminate_backend
from cdc_relay.lsn import format_lsn
from cdc_relay.observability import launch
from cdc_relay.observability.http import HealthServer
from cdc_relay.observability.stats import RelayStats
from cdc_relay.observability.tracing import Tracing
from cdc_relay.prerequisites import require, require_usable_slot
from cdc_relay.record_origin import history_switches, problem, refusal
from cdc_relay.relayed_filters import differences, recorded_form
from cdc_relay.replication.failover import (
    ensure_failover,
    promotion_note,
    wants_failover,
)
from cdc_relay.replication.source import (
    Heartbeats,
    SlotState,
    SourceDatabase,
    connect,
    retained_wal,
    slot_state,
)
from cdc_relay.replication.stream import (
    ReplicationStream,
    timeline,
    timeline_history,
    timeline_start,
)
from cdc_relay.sweeper import Sweeper

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from cdc_relay.observability.metrics import RelayMetrics
    from cdc_relay.publisher import Publisher
    from cdc_relay.reconcile import Offsets, Reconciliation
    from cdc_relay.topics import TopicRules

log = logging.getLogger(__name__)

Connection = psycopg.Connection[tuple[object, ...]]

READY_PROBE_TIMEOUT = 2.0
SWEEPER_JOIN_TIMEOUT = 10.0
STANDBY_LOG_INTERVAL = 60.0  # a standby says so at start and this often
STANDBY_FIRST_LOG = 1.0  # "at start": once it has been a standby this long
SLOT_RELEASE_POLL = 0.05
CHECKED_FRESH = 5.0  # seconds the start-up check stands for the first session's


class Relay:
    """Runs sessions until asked to stop; raises a RelayError for conditions it cannot fix."""

    def __init__(
        self,
        settings: Settings,
        *,
        tracing: Tracing | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.settings = settings
        self.stats = RelayStats()
        self.tracing = tracing or Tracing()
        self._registry = registry
        self._stop = threading.Event()
        self.stopping = False  # read once per message: a plain attribute, not a property
        self._fatal: RelayError | None = None
        self._confirmed: int | None = None  # acknowledged position carried across sessions
        self._timeline: tuple[str, int] | None = None  # (system id, timeline) it was read on
        self._offsets: Offsets | None = None  # and the acknowledged offsets at that position
        self._publisher: Publisher | None = None
        # The topic creation limit is per process; made with the first session (it needs Kafka).
        self.topic_rules: TopicRules | None = None
        self.leadership = Leadership(settings)
        self.stats.lease_valid = lambda: self.leadership.leading
        self.stats.foreign_lock_holder = self._foreign_lock_holder
        # The start-up check's connection, handed to the first session if this process leads at
        # once: that session then neither connects nor checks again.
        self._checked: Connection | None = None
        self._checked_at = 0.0

    def _foreign_lock_holder(self) -> dict[str, object] | None:
        found = self.leadership.foreign_holder
        return None if found is None else found.as_dict()

    @property
    def leading(self) -> bool:
        """This process holds the leadership (read by the session's housekeeping)."""
        return self.leadership.leading

    def request_stop(self) -> None:
        """Safe from a signal handler: the loop notices within one read timeout."""
        self.stopping = True
        self._stop.set()

    @property
    def failed(self) -> bool:
        """A failure was recorded: the session stops at once, not at its transaction's end."""
        return self._fatal is not None

    def fail(self, error: RelayError) -> None:
        """Stop after the current session's clean shutdown, then raise ``error`` from run()."""
        self._fatal = error
        self.request_stop()

    def readiness(self) -> tuple[bool, str]:
        """For /readyz: streaming, Kafka answering and acknowledging, lag under the bound."""
        stats = self.stats
        if not (stats.leading and stats.streaming):
            return False, "not streaming from the replication slot" if stats.leading else "standby"
        if stats.delivery_stalled:
            return False, "Kafka is not acknowledging records"
        lag = stats.lag_seconds()
        if lag > self.settings.ready_max_lag_seconds:
            return (
                False,
                f"lagging {lag:.0f}s behind (bound {self.settings.ready_max_lag_seconds:g}s)",
            )
        publisher = self._publisher
        if publisher is None:
            return False, "no Kafka producer"
        try:
            publisher.probe(READY_PROBE_TIMEOUT)
        except SinkUnavailable as exc:
            return False, str(exc)
        return True, "streaming"

    def run(self) -> None:
        """Serve metrics and health, sweep published rows, and relay, until stopped."""
        sweeper_thread = None
        if self.settings.sweep_interval > 0:
            sweeper = Sweeper(self.settings, self.stats)
            self.stats.sweeper = sweeper
            # Only the leader sweeps (a stale one could not do harm: see cdc_relay.sweeper).
            sweeper_thread = threading.Thread(
                target=sweeper.run,
                args=(self._stop, lambda: self.leadership.leading),
                name="cdc-relay-sweeper",
                daemon=True,
            )
            sweeper_thread.start()
        metrics = _Metrics(self.stats, self._registry)
        server = None
        if self.settings.http_port:
            server = HealthServer(
                self.settings.http_port,
                self.stats,
                metrics.prometheus_text,
                self.readiness,
                self.settings.http_host,
            )
            server.start()
        try:
            self._lead_or_stand_by()
        finally:
            self.request_stop()  # also stops the sweeper
            if sweeper_thread is not None:
                sweeper_thread.join(SWEEPER_JOIN_TIMEOUT)
            if server is not None:
                server.stop()
            metrics.shutdown()
            self.tracing.shutdown()

    # -- leadership ----------------------------------------------------------------------------

    def _lead_or_stand_by(self) -> None:
        """Stand by until this process leads, relay while it does; again after losing it."""
        self._check_database()
        leadership = self.leadership
        leadership.start()
        try:
            while not self.stopping:
                if not self._await_leadership():
                    break
                self.stats.leader = True
                try:
                    self._run_sessions()
                except LeadershipLost as exc:
                    log.warning(
                        "lost the leadership: dropped what was in flight, now a standby",
                        extra={"fields": {"reason": str(exc)}},
                    )
                    self._confirmed = None  # the next leader's record is the truth now
                    self._offsets = None
                    leadership.resign()
                finally:
                    self.stats.leader = False
                    self.stats.streaming = False
        finally:
            self._drop_checked()
            leadership.release()  # after the clean stop: a standby takes over at once

    def _check_database(self) -> None:
        """Before standing by: the database is usable and the state tables exist (so that a
        standby with a broken configuration fails now, not when it is needed)."""
        backoff = Backoff(0.5, self.settings.reconnect_max_backoff)
        url = self.settings.source_url()
        while not self.stopping:
            try:
                conn = connect(url)
                try:
                    require(conn, self.settings)
                    store = PostgresCheckpointStore(
                        conn, self.settings.state_schema, self.settings.slot_name
                    )
                    store.ensure_table()
                except BaseException:
                    conn.close()
                    raise
                self._checked, self._checked_at = conn, time.monotonic()
                return
            except SourceUnavailable as exc:
                delay = backoff.delay()
                log.warning(
                    "cannot reach PostgreSQL, retrying",
                    extra={"fields": {"reason": str(exc), "retry_in_s": round(delay, 2)}},
                )
                self._retry_after(delay)

    def _retry_after(self, delay: float) -> None:
        """Wait ``delay`` seconds (or until stopped) before retrying: waiting, not stuck, so the
        loop stays alive for /healthz all along (a liveness probe would only restart the wait)."""
        deadline = time.monotonic() + delay
        while not self.stopping:
            now = time.monotonic()
            self.stats.last_loop = now
            if now >= deadline:
                return
            self._stop.wait(min(1.0, deadline - now))

    def _take_checked(self) -> Connection | None:
        """The start-up check's connection while its checks are fresh, else None."""
        conn, self._checked = self._checked, None
        if conn is None or conn.closed:
            return None
        if time.monotonic() - self._checked_at > CHECKED_FRESH:
            conn.close()  # stood by meanwhile: the session connects and checks again
            return None
        return conn

    def _drop_checked(self) -> None:
        conn = self._take_checked()
        if conn is not None:
            conn.close()

    def _await_leadership(self) -> bool:
        """Wait as a standby until leading (True) or stopped (False); alive all along."""
        leadership = self.leadership
        # Not at once: the leadership thread's first try for the lock is still under way, and a
        # relay about to lead would say "standby" at every start.
        next_log = time.monotonic() + STANDBY_FIRST_LOG
        while not self.stopping:
            now = time.monotonic()
            self.stats.last_loop = now
            if leadership.leading:
                return True
            if self._checked is not None and now - self._checked_at > CHECKED_FRESH:
                self._drop_checked()  # a standby keeps no idle connection
            squatter = leadership.foreign_holder
            if now >= next_log and squatter is not None:
                next_log = now + STANDBY_LOG_INTERVAL
                log.error(
                    "standby: the leader lock is held by a session that is no relay",
                    extra={
                        "fields": {
                            "slot": self.settings.slot_name,
                            "pid": squatter.pid,
                            "role": squatter.role,
                            "fix": squatter.fix(self.settings.slot_name),
                        }
                    },
                )
            elif now >= next_log:
                next_log = now + STANDBY_LOG_INTERVAL
                log.info(
                    "standby: another relay leads; taking over when it stops or its lease expires",
                    extra={
                        "fields": {
                            "slot": self.settings.slot_name,
                            "leader": leadership.leader_seen,
                            "lease_timeout_s": self.settings.leader_lease_timeout,
                        }
                    },
                )
            leadership.became_leader.wait(1.0)
        return False

    def _run_sessions(self) -> None:
        backoff = Backoff(0.5, self.settings.reconnect_max_backoff)
        first = True
        try:
            while not self.stopping:
                published_before = self.stats.published
                try:
                    if not self.leadership.leading:
                        # E.g. a PostgreSQL restart took the lock connection down while this
                        # relay waited to retry: the standby may hold the lock by now.
                        raise LeadershipLost("this relay no longer leads: no new session")
                    self._session()
                except LeadershipLost:
                    self._drop_publisher(purge=True)  # late duplicates at most: see README
                    raise
                except (SourceUnavailable, SinkUnavailable, SlotInUse) as exc:
                    self.stats.streaming = False
                    self.stats.reconnects += 1
                    if self.stats.published != published_before:
                        backoff.reset()  # the session did work: this is a new failure
                    if first and isinstance(exc, SlotInUse):
                        raise
                    if not self.leadership.leading:
                        # E.g. a partition: the lease ran out while this session was stuck.
                        self._drop_publisher(purge=True)
                        raise LeadershipLost("this relay's leader lease ran out") from exc
                    if isinstance(exc, SinkUnavailable):
                        self._drop_publisher(purge=True)
                    # Only transient failures get here; permanent ones (ConfigError, a
                    # SourceSetupError such as failed authentication) end run() at once.
                    delay = backoff.delay()
                    log.warning(
                        "session ended, retrying from the confirmed position",
                        extra={
                            "fields": {
                                "transient": True,
                                "reason": str(exc),
                                "retry_in_s": round(delay, 2),
                                "resume_lsn": format_lsn(self._confirmed or 0),
                            }
                        },
                    )
                    self._retry_after(delay)
                first = False
        finally:
            self._drop_publisher(purge=False)
        if self._fatal is not None:
            raise self._fatal

    # -- one session -----------------------------------------------------------------------

    def _session(self) -> None:
        settings = self.settings
        url = settings.source_url()
        checked = self._take_checked()
        with checked or connect(url) as conn:
            start = self._prepare(conn, checked=checked is not None)
            store = self._store(conn)
            offsets, noted = store.load_offsets()
            stream = ReplicationStream(
                url,
                settings.slot_name,
                start,
                plugin_options_for(settings),
                coalesce=settings.read_coalesce_ms / 1000,
            )
            stream.open()
            try:
                self._note_stream(conn, stream)
                # The rest of the start-up overlaps the server's: while the walsender decodes the
                # WAL up to ``start``, the read-back from Kafka runs on a thread of its own and
                # this one loads the session's code and builds the producer. Nothing is
                # published before both are done.
                self._streaming(conn, store, stream, start=start, offsets=offsets, noted=noted)
            finally:
                stream.close()

    def _note_stream(self, conn: Connection, stream: ReplicationStream) -> None:
        """START_REPLICATION was sent and accepted: note where, and when (the first time)."""
        self._timeline = stream.timeline
        self.leadership.record_stream(conn, stream.backend_pid)
        if self.stats.start_replication_monotonic is None:
            instant = launch.now()
            self.stats.start_replication_monotonic = instant.monotonic
            self.stats.start_replication_after_launch_s = instant.since_launch

    def _streaming(
        self,
        conn: Connection,
        store: PostgresCheckpointStore,
        stream: ReplicationStream,
        *,
        start: int,
        offsets: Offsets | None,
        noted: Offsets | None,
    ) -> None:
        """Relay from the opened ``stream`` until the session ends."""
        # Late: what only a streaming leader needs (the producer, the decoder, Kafka's client).
        from cdc_relay.publisher import Publisher  # noqa: PLC0415
        from cdc_relay.session import Session  # noqa: PLC0415
        from cdc_relay.topics import TopicRules, in_background, wait_serving  # noqa: PLC0415

        settings = self.settings
        reconciling = in_background(self._reconcile, start, offsets, noted, name="reconcile")
        if self._publisher is None:
            self._publisher = Publisher(settings.producer_config(), self.stats)
        if self.topic_rules is None:
            self.topic_rules = TopicRules(settings)
        keepalive = _Keepalive(stream, start)
        reconciliation = wait_serving(reconciling, keepalive)
        if reconciliation is not None and noted and reconciliation.renoted:
            noted = {**noted, **reconciliation.renoted}
            store.note_written_from(noted)
        self.stats.sessions += 1
        self.stats.streaming = True
        log.info(
            "streaming",
            extra={
                "fields": {
                    "slot": settings.slot_name,
                    "start_lsn": format_lsn(start),
                    "start_replication_after_launch_s": _rounded(
                        self.stats.start_replication_after_launch_s
                    ),
                }
            },
        )
        session = Session(
            self,
            settings,
            self.stats,
            self.tracing,
            self.topic_rules,
            source=stream,
            sink=self._publisher,
            store=store,
            start=start,
            heartbeat=Heartbeats(conn),
            retained_wal=lambda: retained_wal(conn, settings.slot_name),
            offsets=offsets,
            reconciliation=reconciliation,
            noted=noted,
        )
        try:
            session.stream()
        except StopSession:
            session.shutdown()
        except SourceUnavailable:
            # Deliveries still in flight count toward the position the next session resumes at.
            session.drain()
            raise
        finally:
            self._confirmed = session.confirmer.acknowledged()
            self._offsets = dict(session.watermark.offsets)
            self.stats.streaming = False

    def _reconcile(
        self, start: int, offsets: Offsets | None, noted: Offsets | None
    ) -> Reconciliation | None:
        """What an earlier incarnation already delivered after ``start`` (None: not asked to)."""
        if not self.settings.reconcile:
            return None
        from cdc_relay.publisher import admin_config  # noqa: PLC0415
        from cdc_relay.reconcile import reconcile_with_kafka  # noqa: PLC0415

        # The previous incarnation is gone (killed, or this process's purged producer): what it
        # delivered after ``start`` is all in Kafka now.
        return reconcile_with_kafka(
            admin_config(self.settings.producer_config()),
            self.settings.slot_name,
            start,
            offsets=offsets,
            noted=noted,
            timeout=self.settings.reconcile_timeout,
            stopping=lambda: self.stopping,  # a stop does not wait for the read
        )

    def _prepare(self, conn: Connection, *, checked: bool = False) -> int:
        """Check the database, create what is missing, and decide where to start.

        ``checked``: ``conn`` is the one the start-up check has just run on (require() and the
        state tables): not done twice.
        """
        settings = self.settings
        source = SourceDatabase(
            conn,
            settings.tables(),
            settings.publication_name,
            settings.slot_name,
            settings.plugin.value,
        )
        if not checked:
            require(conn, settings)
        failover = wants_failover(conn, settings)  # exit 3 for "true" on PostgreSQL < 17
        if source.ensure_publication():
            log.info(
                "created publication", extra={"fields": {"publication": settings.publication_name}}
            )
        changed = source.ensure_row_filters()  # exit 3 naming the fix when it may not
        store = self._store(conn)
        if not checked:
            store.ensure_table()
        if changed is not None:
            log.warning(
                "set the publication's row filters as configured; rows committed before are "
                "not swept",
                extra={"fields": {"publication": settings.publication_name,
                                  "was": changed.describe()}},
            )  # fmt: skip
            store.restart_sweep_boundary()
        record = store.load_record()
        recorded, reset = self._trusted_position(conn, record)
        carried = self._carried_position()
        if carried is not None and (recorded is None or carried > recorded):
            # What the previous session had acknowledged but not yet recorded.
            # The offsets belong to the acknowledged position: not to one capped below it.
            store.save(carried, self._offsets if carried == self._confirmed else None)
            recorded = carried
        slot = source.slot()
        if slot is None:
            warning = check_missing_slot(settings.slot_name, recorded, settings.allow_slot_reset)
            slot = source.create_slot(failover)
            log.info(
                "created replication slot",
                extra={"fields": {"slot": slot.name, "failover": failover}},
            )
            start = slot.confirmed_flush or 0
            store.save(start, new_slot=True)
            recorded = start
            reset = False
        else:
            slot = self._await_free_slot(conn, slot)
            require_usable_slot(conn, settings, slot)
            ensure_failover(conn, settings, slot)
            start, warning = resolve_start(
                settings.slot_name,
                slot.confirmed_flush or 0,
                recorded,
                settings.allow_slot_reset,
                promotion_note(conn, settings, slot, recorded),
            )
        if warning:
            log.warning(warning)
        if recorded != start or reset:
            store.save(start, new_slot=reset)  # a refused record's boundary and offsets go too
        filters = recorded_form(settings.tables())
        refiltered = (
            record.row_filters is not None
            and differences(record.row_filters, settings.tables()) != []
        )
        if refiltered:
            log.warning(
                "the row filters differ from those the relay last relayed with; rows committed "
                "before are not swept",
                extra={"fields": {"was": orjson.dumps(record.row_filters).decode()[:4096]}},
            )
        store.record_row_filters(filters, refiltered)
        self.stats.confirmed_lsn = start
        return start

    def _trusted_position(self, conn: Connection, record: Record) -> tuple[int | None, bool]:
        """The recorded position, refused (PositionMismatch, exit 4, before anything streams or
        the slot is touched) when the server cannot have it (:mod:`cdc_relay.record_origin`);
        with CDC_RELAY_ALLOW_SLOT_RESET, dropped instead: (None, True), to be recorded afresh
        (a new sweep boundary, no offsets)."""
        settings = self.settings
        if record.stamp is None:
            return None, False
        url = settings.source_url()
        reason = problem(
            record.stamp, record.server, lambda tli: history_switches(timeline_history(url, tli))
        )
        if reason is None:
            return record.stamp.position, False
        slot = slot_state(conn, settings.slot_name)
        message = refusal(
            reason,
            settings.state_schema,
            settings.slot_name,
            slot.confirmed_flush if slot is not None else None,
        )
        if not settings.allow_slot_reset:
            raise PositionMismatch(message)
        log.warning(f"{message}; starting anyway because slot reset is allowed")
        return None, True

    def _store(self, conn: Connection) -> PostgresCheckpointStore:
        """The position record, written only while this process holds the leader lease."""
        settings = self.settings
        return PostgresCheckpointStore(
            conn, settings.state_schema, settings.slot_name, holder=self.leadership.holder
        )

    def _await_free_slot(self, conn: Connection, slot: SlotState) -> SlotState:
        """The slot as it is once its previous leader's walsender has let go of it.

        The predecessor's walsender (its pid is in the lease) is ended; another holder gets up
        to the lease timeout to let go (a relay that lost its lock stops within a renewal), and
        is then reported by require_usable_slot (SlotInUse).
        """
        deadline = time.monotonic() + self.settings.leader_lease_timeout
        current: SlotState | None = slot
        while current is not None and current.active_pid is not None:
            if current.active_pid == self.leadership.predecessor_stream_pid:
                log.warning(
                    "ending the previous leader's walsender",
                    extra={"fields": {"pid": current.active_pid}},
                )
                terminate_backend(conn, current.active_pid)
            if time.monotonic() >= deadline or self.stopping:
                break
            self._stop.wait(SLOT_RELEASE_POLL)
            current = slot_state(conn, self.settings.slot_name)
        if current is None:
            raise SourceUnavailable("the replication slot disappeared while waiting for it")
        return current

    def _carried_position(self) -> int | None:
        """The previous session's acknowledged position, as far as it holds on this server.

        A multi-host URL may have brought the relay to a promoted standby since. Its history is
        the old primary's only up to the point where its timeline began: a position beyond that
        was read from WAL this server never had, and its own transactions there must be streamed.
        """
        position, previous = self._confirmed, self._timeline
        if position is None or previous is None:
            return position  # nothing to carry, or not known where it was read: nothing to ask
        url = self.settings.source_url()
        current = timeline(url)
        if previous == current:
            return position
        if previous[0] != current[0]:
            log.warning("the database URL now leads to another cluster: not carrying the position")
            return None
        switch = timeline_start(url, current[1], since=previous[1])
        if switch is not None and position > switch:
            log.warning(
                "the server was promoted before the relay's last position: resuming from the "
                "promotion point",
                extra={
                    "fields": {
                        "acknowledged": format_lsn(position),
                        "promoted_at": format_lsn(switch),
                    }
                },
            )
            return switch
        return position

    def _drop_publisher(self, purge: bool) -> None:
        if self._publisher is not None:
            self._publisher.close(purge=purge)
            self._publisher = None


KEEPALIVE_INTERVAL = 1.0  # seconds between standby status updates while the session prepares


class _Keepalive:
    """While the session waits for the read-back, the walsender still hears from the relay: a
    status update at the start position (recorded already) every second, so that a slow
    read-back (up to CDC_RELAY_RECONCILE_TIMEOUT) never trips wal_sender_timeout."""

    def __init__(self, stream: ReplicationStream, start: int) -> None:
        self._stream = stream
        self._start = start
        self._next = time.monotonic() + KEEPALIVE_INTERVAL

    def __call__(self) -> None:
        now = time.monotonic()
        if now >= self._next:
            self._next = now + KEEPALIVE_INTERVAL
            self._stream.send_status(self._start, self._start)


class _Metrics:
    """The OpenTelemetry metrics, built when first scraped (``/metrics``).

    The SDK and the Prometheus client cost ~0.1 s of imports that the start does not need: every
    instrument is an observable one reading :class:`RelayStats` at collection time, so nothing is
    lost by building them late. With an OTLP exporter configured, they are built at once (it
    pushes on its own schedule).
    """

    def __init__(self, stats: RelayStats, registry: CollectorRegistry | None) -> None:
        self._stats = stats
        self._registry = registry
        self._metrics: RelayMetrics | None = None
        self._lock = threading.Lock()
        from cdc_relay.observability.otel_env import otlp_metrics_configured  # noqa: PLC0415

        if otlp_metrics_configured():
            self._built()

    def _built(self) -> RelayMetrics:
        with self._lock:
            if self._metrics is None:
                from cdc_relay.observability.metrics import (  # noqa: PLC0415 - see the class
                    RelayMetrics,
                    process_registry,
                )

                self._metrics = RelayMetrics(self._stats, self._registry or process_registry())
            return self._metrics

    def prometheus_text(self) -> bytes:
        return self._built().prometheus_text()

    def shutdown(self) -> None:
        with self._lock:
            metrics = self._metrics
        if metrics is not None:
            metrics.shutdown()


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 3)
