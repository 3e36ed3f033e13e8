"""Step 4 of a recovery (:mod:`cdc_relay.recovery.run`): each owed row, in order, is skipped when
it is in Kafka already, else published (or dead-lettered); the end is recorded once Kafka has
acknowledged every record. Imported only when a recovery runs: it brings Kafka's client."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from cdc_relay.errors import LeadershipLost, SinkUnavailable, StopSession
from cdc_relay.postgres_errors import During, mapped
from cdc_relay.publisher import Publisher
from cdc_relay.reconcile import Offsets
from cdc_relay.recovery.plan import Cause, Plan, State
from cdc_relay.recovery.publishing import RecoveryPublisher
from cdc_relay.recovery.record import horizon_after
from cdc_relay.recovery.rows import merged
from cdc_relay.recovery.run import InKafka, Owed, Recovery, RecoveryStopped
from cdc_relay.replication.source import scalar
from cdc_relay.topics import TopicRules
from cdc_relay.transactional_id import transactional_id

if TYPE_CHECKING:
    import psycopg

log = logging.getLogger("cdc_relay.recovery.run")


class _Sending:
    """The plan as the run advances it, and the writes of its progress."""

    def __init__(self, recovery: Recovery, plan: Plan) -> None:
        self.recovery = recovery
        self.plan = plan
        self.publisher: RecoveryPublisher | None = None
        self.in_kafka = plan.in_kafka
        self.published_before = plan.published
        self.dead_lettered_before = plan.dead_lettered
        self.dead_letters_at_start = recovery.stats.dead_lettered

    def counts(self) -> dict[str, int]:
        publisher = self.publisher
        return {
            "published": self.published_before + (publisher.published if publisher else 0),
            "dead_lettered": self.dead_lettered_before
            + self.recovery.stats.dead_lettered
            - self.dead_letters_at_start,
            "in_kafka": self.in_kafka,
        }

    def rows(self, reader: psycopg.Connection[Any], owed: Owed, found: InKafka) -> None:
        """Each owed row in order: skipped when in Kafka already, else published (or refused)."""
        recovery, publisher = self.recovery, self.publisher
        assert publisher is not None
        done, moved = self.plan.done, self.plan.moved
        earlier, own = found.earlier, found.own
        with (
            mapped(During.STATEMENT, "cannot read the outbox"),
            recovery.reading(reader, "reading the outbox rows owed"),
        ):
            for row in merged(reader, owed.sources, owed.scope):
                if recovery.stopping() or recovery.failure is not None:
                    raise RecoveryStopped("a stop was requested during the recovery")
                mapping, record, reason, event_id = publisher.map(row)
                if row.ordinal <= done:
                    # Acknowledged before: an earlier record its run took for it is taken again.
                    if event_id is not None and not own.has(row.ordinal, event_id):
                        earlier.take(event_id)
                    continue
                if event_id is not None and (
                    own.has(row.ordinal, event_id)
                    or (moved and own.has_id(event_id))
                    or earlier.take(event_id)
                ):
                    self.in_kafka += 1
                    publisher.skip(row)
                    continue
                if record is None:
                    publisher.refuse(row, mapping, reason or "the row cannot be mapped", event_id)
                else:
                    publisher.publish(row, mapping, record)

    def note(self, noted: Offsets) -> None:
        """Partition ends before a first record: kept before that record is sent."""
        self.plan = self.plan.progressed(noted=dict(noted))
        self.recovery.record.write(self.plan)

    def progress(self, done: int, offsets: Offsets) -> None:
        self.plan = self.plan.progressed(done=done, offsets=offsets, **self.counts())
        self.recovery.progressed(self.plan)


def send(recovery: Recovery, reader: psycopg.Connection[Any], owed: Owed) -> Plan:
    """Publish what ``owed.plan`` owes and record the end (see the module docstring)."""
    settings = recovery.settings
    plan = owed.plan
    sending = _Sending(recovery, plan)
    transactional = None
    if settings.exactly_once:
        system = str(
            scalar(recovery.conn, "SELECT system_identifier::text FROM pg_control_system()")
        )
        transactional = transactional_id(system, settings.slot_name)
    sink = Publisher(settings.producer_config(), recovery.stats, transactional)
    try:
        if transactional is not None:
            # The fence: a zombie relay or recovery of the slot can no longer write, and its
            # open transaction is aborted before anything is read back.
            sink.init_transactions(recovery.require_leading)
        found = recovery.read_back(plan)
        publisher = RecoveryPublisher(
            settings,
            recovery.stats,
            sink,
            TopicRules(settings),
            prefix=plan.position_prefix(settings.slot_name),
            done=plan.done,
            offsets=plan.offsets,
            noted=plan.noted,
            note=sending.note,
            progress=sending.progress,
            fail=recovery.fail,
            require_leading=recovery.require_leading,
            stopping=recovery.alive,
        )
        sending.publisher = publisher
        try:
            sending.rows(reader, owed, found)
            done, offsets = publisher.finish(settings.delivery_stall_timeout)
        except (StopSession, RecoveryStopped):
            _interrupted(recovery, sending, publisher)
            failure = recovery.failure
            if failure is not None:
                raise failure from None
            raise RecoveryStopped("a stop was requested during the recovery") from None
        except (SinkUnavailable, LeadershipLost):
            publisher.abandon()
            raise
        plan = sending.plan.progressed(
            state=State.DONE, done=done, offsets=offsets, finished_at=time.time(),
            **sending.counts(),
        )  # fmt: skip
        if plan.replaces_slot:
            # An adoption's rows predate the sweep boundary the relay takes next: nothing
            # proven yet.
            horizon = None if plan.cause is Cause.ADOPTED else horizon_after(plan, found.starts)
            recovery.record.finish(plan, offsets, horizon)
        else:
            recovery.record.write(plan)  # a publication gap: the slot and its position stay
        recovery.on_progress(plan)
        log.info("recovered the slot", extra={"fields": plan.summary()})
        return plan
    finally:
        sink.close()


def _interrupted(recovery: Recovery, sending: _Sending, publisher: RecoveryPublisher) -> None:
    """A stop (or the poison policy ``stop``): what was sent is drained (bounded) and the
    progress kept; an open Kafka transaction is aborted and sent again by the next run."""
    deadline = time.monotonic() + recovery.settings.shutdown_timeout
    try:
        if publisher.window is not None:
            publisher.abandon()
        while publisher.sink.in_flight() and time.monotonic() < deadline:
            publisher.sink.poll(0.05)
        publisher.sink.poll(0)
        confirmed = publisher.watermark.advance()
        if confirmed > sending.plan.done:
            sending.progress(confirmed, dict(publisher.watermark.offsets))
    except (SinkUnavailable, LeadershipLost) as exc:
        log.warning(
            "the interrupted recovery's last progress was not kept",
            extra={"fields": {"error": str(exc)}},
        )
