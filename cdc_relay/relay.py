"""The relay's lifecycle: lead or stand by, run sessions one after another, back off.

A process competes for the leadership (:mod:`cdc_relay.leadership`) and stands by, alive, until
it leads. As the leader it runs *sessions*: each one started by :mod:`cdc_relay.start` (the
checks, the position, the slot, ``START_REPLICATION``, the read-back from Kafka) and streamed by
:mod:`cdc_relay.session`, one replication connection each. A lost PostgreSQL connection or a
Kafka producer that stops making progress ends a session; the next one starts, after a backoff,
from the position everything before which Kafka acknowledged — never a lost event. A lost
leadership (:class:`~cdc_relay.errors.LeadershipLost`, handled in :meth:`Relay._lead` only)
drops what is in flight and makes a standby again. Publishing exactly once
(``CDC_RELAY_EXACTLY_ONCE``), the producer is transactional and fences every older producer of
the slot before the read-back; a session that ends without a clean stop aborts its open Kafka
transaction, drops its producer, and the next one resumes at the committed position it carries,
without a read-back (:mod:`cdc_relay.kafka_transaction`) — unless a commit's outcome is unknown:
then the next session's new producer fences, and the read-back settles it before anything is sent
again. What the relay cannot fix (configuration, prerequisites, a poison record under ``stop``)
ends :meth:`Relay.run` with the project's error, whose exit code the CLI returns. The HTTP server,
the metrics and the sweeper run beside.

The relay talks to the leadership and to the start through the Protocols below, so the unit
tests drive its lifecycle with fakes (``tests/fakes.py``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from cdc_relay import collector
from cdc_relay.backoff import Backoff
from cdc_relay.config import Settings
from cdc_relay.errors import (
    LeadershipLost,
    RelayError,
    SinkUnavailable,
    SlotInUse,
    SourceUnavailable,
    StopSession,
)
from cdc_relay.leadership import ForeignHolder, Leadership, require_lease
from cdc_relay.lsn import format_lsn
from cdc_relay.observability.http import HealthServer
from cdc_relay.observability.stats import RelayStats
from cdc_relay.observability.tracing import Tracing
from cdc_relay.start import PostgresStart, Started, StartSequence, kafka_read_back
from cdc_relay.sweeper import Sweeper
from cdc_relay.waits import WaitWatch

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from prometheus_client import CollectorRegistry

    from cdc_relay.kafka_transaction import Resend
    from cdc_relay.observability.metrics import RelayMetrics
    from cdc_relay.publisher import Publisher
    from cdc_relay.reconcile import Offsets, Reconciliation
    from cdc_relay.topics import TopicRules

log = logging.getLogger(__name__)

READY_PROBE_TIMEOUT = 2.0
SWEEPER_JOIN_TIMEOUT = 10.0
STANDBY_LOG_INTERVAL = 60.0  # a standby says so at start and this often
STANDBY_FIRST_LOG = 1.0  # "at start": once it has been a standby this long


class RelayLeadership(Protocol):
    """Which relay leads (:class:`~cdc_relay.leadership.Leadership`), as the relay sees it."""

    became_leader: threading.Event
    leader_seen: str | None  # the lease's holder, as a standby last read it
    foreign_holder: ForeignHolder | None

    @property
    def leading(self) -> bool: ...

    def start(self) -> None: ...

    def resign(self) -> None: ...

    def release(self) -> None: ...


class RelayStart(Protocol):
    """The start of sessions (:class:`~cdc_relay.start.StartSequence`), as the relay sees it."""

    @property
    def resume_position(self) -> int: ...

    @property
    def resumes_carried(self) -> bool:
        """The started session resumes at the position the previous one of this leadership
        carried over (:meth:`carry`)."""

    def check_database(self) -> None: ...

    def drop_stale(self) -> None: ...

    def close(self) -> None: ...

    def session(self) -> AbstractContextManager[Started]: ...

    def read_back(
        self, started: Started, meanwhile: Callable[[], None]
    ) -> tuple[Reconciliation | None, Offsets | None]: ...

    def carry(self, position: int, offsets: Offsets) -> None: ...

    def forget(self) -> None: ...


class Relay:
    """Runs sessions until asked to stop; raises a RelayError for conditions it cannot fix."""

    def __init__(
        self,
        settings: Settings,
        *,
        tracing: Tracing | None = None,
        registry: CollectorRegistry | None = None,
        leadership: RelayLeadership | None = None,
        start: RelayStart | None = None,
    ) -> None:
        self.settings = settings
        self.stats = RelayStats()
        self.tracing = tracing or Tracing()
        self._registry = registry
        self._stop = threading.Event()
        self.stopping = False  # read once per message: a plain attribute, not a property
        self._fatal: RelayError | None = None
        # Names the statements that wait on PostgreSQL, and ends them on a stop (cdc_relay.waits).
        self.waits: WaitWatch | None = None
        self._publisher: Publisher | None = None
        # Exactly once: what the next session of this leadership must know to send again.
        self._resend: Resend | None = None
        # The topic creation limit is per process; made with the first session (it needs Kafka).
        self.topic_rules: TopicRules | None = None
        if (leadership is None) != (start is None):
            raise ValueError("give both the leadership and the start, or neither")
        if leadership is None or start is None:
            self.waits = WaitWatch(
                settings.source_url(), lambda: self.stopping, waiting=self._waiting_on_database
            )
            own = Leadership(settings, self.waits)
            leadership, start = own, self._start_sequence(own, self.waits)
        self.leadership: RelayLeadership = leadership
        self.start: RelayStart = start
        self.stats.lease_valid = lambda: self.leadership.leading
        self.stats.foreign_lock_holder = self._foreign_lock_holder

    def _start_sequence(self, leadership: Leadership, waits: WaitWatch) -> StartSequence:
        settings = self.settings
        return StartSequence(
            settings,
            self.stats,
            leadership,
            connect=lambda: PostgresStart(settings, leadership, waits, self.stats),
            read_back=kafka_read_back(settings, lambda: self.stopping),
            stopping=lambda: self.stopping,
            sleep=self._stop.wait,
        )

    def _waiting_on_database(self) -> None:
        """A statement waits on PostgreSQL, watched (cdc_relay.waits: named, bounded or ended by
        a stop): the relay is waiting, not stuck."""
        self.stats.last_loop = time.monotonic()

    def _foreign_lock_holder(self) -> dict[str, object] | None:
        found = self.leadership.foreign_holder
        return None if found is None else found.as_dict()

    def require_leading(self) -> None:
        """LeadershipLost unless this process still leads (the session's housekeeping asks)."""
        require_lease(self.leadership.leading, "nothing more confirmed")

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
            if self.waits is not None:
                self.waits.close()
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
                self._lead()
        finally:
            self.start.close()
            leadership.release()  # after the clean stop: a standby takes over at once

    def _lead(self) -> None:
        """One term as the leader: sessions until stopped or the leadership is lost."""
        self.stats.leader = True
        try:
            self._run_sessions()
        except LeadershipLost as exc:
            self._drop_publisher()  # late duplicates at most: see README
            log.warning(
                "lost the leadership: dropped what was in flight, now a standby",
                extra={"fields": {"reason": str(exc)}},
            )
            self.start.forget()  # the next leader's record is the truth now
            self._resend = None
            self.leadership.resign()
        finally:
            self._drop_publisher()
            self.stats.leader = False
            self.stats.streaming = False

    def _check_database(self) -> None:
        """Before standing by: the database is usable and the state tables exist (so that a
        standby with a broken configuration fails now, not when it is needed)."""
        backoff = Backoff(0.5, self.settings.reconnect_max_backoff)
        while not self.stopping:
            try:
                self.start.check_database()
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
            self.start.drop_stale()
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
        """Sessions one after another, with backoff, until stopped (LeadershipLost: no longer
        the leader, handled by :meth:`_lead`)."""
        backoff = Backoff(0.5, self.settings.reconnect_max_backoff)
        first = True
        while not self.stopping:
            published_before = self.stats.published
            # E.g. a PostgreSQL restart took the lock connection down while this relay waited
            # to retry: the standby may hold the lock by now.
            require_lease(self.leadership.leading, "no new session")
            try:
                self._session()
            except StopSession:
                pass  # stopped while the session started (its Kafka fence waited): no retry
            except (SourceUnavailable, SinkUnavailable, SlotInUse) as exc:
                self.stats.streaming = False
                self.stats.reconnects += 1
                if self.stats.published != published_before:
                    backoff.reset()  # the session did work: this is a new failure
                if first and isinstance(exc, SlotInUse):
                    raise
                # E.g. a partition: the lease ran out while this session was stuck.
                require_lease(self.leadership.leading, "no retry")
                if isinstance(exc, SinkUnavailable):
                    self._drop_publisher()
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
                            "resume_lsn": format_lsn(self.start.resume_position),
                        }
                    },
                )
                self._retry_after(delay)
            first = False
        if self._fatal is not None:
            raise self._fatal

    # -- one session -----------------------------------------------------------------------

    def _session(self) -> None:
        """Start (:mod:`cdc_relay.start`), then stream until the session ends."""
        with self.start.session() as started:
            self._streaming(started)

    def _streaming(self, started: Started) -> None:
        """Relay from the opened stream until the session ends."""
        # Late: what only a streaming leader needs (the producer, the decoder, Kafka's client).
        from cdc_relay.publisher import Publisher  # noqa: PLC0415
        from cdc_relay.session import Session  # noqa: PLC0415
        from cdc_relay.topics import TopicRules  # noqa: PLC0415

        settings = self.settings

        def build_publishing() -> None:
            if self._publisher is None:
                self._publisher = Publisher(settings.producer_config(), self.stats)
            if self.topic_rules is None:
                self.topic_rules = TopicRules(settings)

        if settings.exactly_once:
            reconciliation, noted = self._fence_then_read_back(started)
        else:
            # The rest of the start-up overlaps the server's: while the walsender decodes the WAL
            # up to the start, the read-back from Kafka runs on a thread of its own and this one
            # loads the session's code and builds the producer. Nothing is published before both
            # are done.
            reconciliation, noted = self.start.read_back(started, meanwhile=build_publishing)
        assert self._publisher is not None
        assert self.topic_rules is not None
        self.stats.sessions += 1
        self.stats.streaming = True
        log.info(
            "streaming",
            extra={
                "fields": {
                    "slot": settings.slot_name,
                    "start_lsn": format_lsn(started.start),
                    "start_replication_after_launch_s": _rounded(
                        self.stats.start_replication_after_launch_s
                    ),
                }
            },
        )
        database = started.database
        session = Session(
            self,
            settings,
            self.stats,
            self.tracing,
            self.topic_rules,
            source=started.stream,
            sink=self._publisher,
            store=started.store,
            start=started.start,
            heartbeat=database.heartbeat,
            retained_wal=database.retained_wal,
            offsets=started.offsets,
            reconciliation=reconciliation,
            noted=noted,
            resend=self._resend,
            table_oids=started.table_oids,
        )
        if self.stats.sessions == 1:
            collector.settled()  # its code, the producer, Kafka's client: ~20,000 objects
        clean = False
        try:
            session.stream()
        except StopSession:
            session.shutdown()
            clean = True
        except SourceUnavailable:
            if session.window is None:
                # Deliveries in flight count toward the position the next session resumes at.
                session.drain()
            raise
        finally:
            self.start.carry(session.confirmer.acknowledged(), dict(session.watermark.offsets))
            self.stats.streaming = False
            if session.window is not None:
                self._resend = session.resend
                if not clean:
                    # Nothing uncommitted is confirmed; the next producer's fence ends it too.
                    session.window.abandon()
                    self._drop_publisher()

    def _fence_then_read_back(
        self, started: Started
    ) -> tuple[Reconciliation | None, Offsets | None]:
        """Exactly once: the transactional producer fences every older producer of the slot,
        and only then is Kafka read back (``read_committed``), so that no zombie can append
        between the read and the fence. A session resuming at the position the previous one of
        this leadership committed reads nothing back: nothing after it is committed by us —
        unless a commit's outcome is unknown (it may have committed): then a new producer fences
        (the broker finishes or aborts that commit first) and the read-back settles it."""
        from cdc_relay.publisher import Publisher  # noqa: PLC0415
        from cdc_relay.start import Keepalive  # noqa: PLC0415
        from cdc_relay.topics import TopicRules  # noqa: PLC0415
        from cdc_relay.transactional_id import transactional_id  # noqa: PLC0415

        settings = self.settings
        unsettled = self._resend is not None and self._resend.unsettled
        if unsettled:
            self._drop_publisher()  # the fence is a new producer's init_transactions
            log.warning(
                "settling a Kafka commit of unknown outcome: fencing, then reading back what "
                "committed before anything is sent again",
                extra={"fields": {"resume_lsn": format_lsn(started.start),
                                  "read_back": settings.reconcile}},
            )  # fmt: skip
        timeline = started.stream.timeline or started.database.timeline()
        if self._publisher is None:
            publisher = Publisher(
                settings.producer_config(),
                self.stats,
                transactional_id(timeline[0], settings.slot_name),
            )
            keepalive = Keepalive(started.stream, started.start)

            def serve() -> None:
                keepalive()
                if self.stopping:  # nothing is sent before the fence: nothing to wait for
                    raise StopSession

            try:
                publisher.init_transactions(serve)
            except BaseException:
                publisher.close()
                raise
            self._publisher = publisher
        if self.topic_rules is None:
            self.topic_rules = TopicRules(settings)
        if self.start.resumes_carried and not unsettled:
            return None, started.noted
        return self.start.read_back(started, meanwhile=lambda: None)

    def _drop_publisher(self) -> None:
        if self._publisher is not None:
            self._publisher.close()
            self._publisher = None


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
                collector.settled()  # the SDK, the Prometheus client: ~13,000 objects
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
