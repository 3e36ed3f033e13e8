"""Publishing retained outbox rows again, for a consumer that lost its topic: ``cdc-relay
republish``. A replay, not a recovery: every selected row is sent, whether or not it was published
before, and each record says so.

The rows are those still in the table — published rows the sweeper keeps for
``CDC_RELAY_SWEEP_RETENTION_SECONDS``, and any not yet swept — selected by creation time (the
table's ``created_at`` column) and/or aggregate type and id, read in one snapshot in commit order
(:mod:`cdc_relay.recovery.rows`) and mapped by the relay's own mapping. Each record carries the
``cdc_relay.replay`` header (``<slot>/<when the replay began>``) instead of the relay's position
header: a consumer tells a replay from the stream, and no read-back of the relay's (a start's, a
recovery's) takes it for one of the relay's own records. It goes to the record's own topic, or to
``--to-topic``. A row that cannot be mapped, or a record Kafka refuses, is counted and named, not
dead-lettered again (the dead-letter topic has it from when it was first relayed); the command
then exits 1. No slot, position or leadership is touched: it runs beside the relays, with an
idempotent producer that is not transactional (its records are visible at once to
``read_committed`` consumers too, and it fences no relay).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import psycopg
from psycopg import sql

from cdc_relay.config import OutboxTable, Settings, env_name, legal_topic
from cdc_relay.errors import ConfigError, SinkUnavailable
from cdc_relay.logs import cut
from cdc_relay.observability.stats import RelayStats
from cdc_relay.postgres_errors import During, mapped
from cdc_relay.recovery.rows import (
    Scope,
    Source,
    commit_timestamps,
    count_rows,
    merged,
    relation_of,
)
from cdc_relay.replication.source import connect, relation_oid

log = logging.getLogger(__name__)

REPLAY_HEADER = "cdc_relay.replay"
NAMED_FAILURES = 10  # failures named in the report; the rest are counted
DRAIN_POLL = 0.05

Connection = psycopg.Connection[Any]


@dataclass(frozen=True)
class Selection:
    """Which retained rows to send again, and where."""

    since: datetime | None = None
    until: datetime | None = None
    aggregate_type: str | None = None
    aggregate_id: str | None = None
    topic: str | None = None  # None: each record's own topic

    def check(self, tables: tuple[OutboxTable, ...]) -> None:
        """ConfigError naming what a table lacks for this selection (or an illegal topic)."""
        if self.topic is not None and not legal_topic(self.topic):
            raise ConfigError(f"--to-topic {cut(self.topic)!r} is not a legal Kafka topic name")
        if self.since is not None and self.until is not None and self.since >= self.until:
            raise ConfigError("--from must be before --until")
        for table in tables:
            columns = table.columns
            if (self.since or self.until) and columns.created_at is None:
                raise ConfigError(
                    f"{table.table} has no created_at column mapped: --from and --until select "
                    f'by it ("created_at" in {env_name("outbox_columns")})'
                )
            if self.aggregate_type is not None and columns.aggregate_type is None:
                raise ConfigError(f"{table.table} has no aggregate_type column mapped")
            if self.aggregate_id is not None and columns.aggregate_id is None:
                raise ConfigError(f"{table.table} has no aggregate_id column mapped")


@dataclass
class Replayed:
    """What a replay did."""

    rows: int = 0
    sent: int = 0
    acknowledged: int = 0
    failed: int = 0
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0
    replay: str = ""

    def fail(self, what: str) -> None:
        self.failed += 1
        if len(self.failures) < NAMED_FAILURES:
            self.failures.append(what)


def _time_condition(
    conn: Connection, table: OutboxTable, selection: Selection, zone: str
) -> list[tuple[sql.Composable, tuple[object, ...]]]:
    """The creation-time bounds; a ``timestamp`` (or ``date``) column read in ``zone``."""
    column = table.columns.created_at
    assert column is not None
    row = conn.execute(
        "SELECT format_type(atttypid, NULL) FROM pg_attribute WHERE attrelid = %s "
        "AND attname = %s AND NOT attisdropped",
        (relation_oid(conn, table), column),
    ).fetchone()
    local = row is not None and row[0] in ("timestamp without time zone", "date")
    found: list[tuple[sql.Composable, tuple[object, ...]]] = []
    for bound, op in ((selection.since, ">="), (selection.until, "<")):
        if bound is None:
            continue
        value: sql.Composable = sql.SQL("%s::timestamptz")
        if local:
            value = sql.SQL("(%s::timestamptz AT TIME ZONE {})").format(sql.Literal(zone))
        found.append(
            (sql.SQL("t.{} {} {}").format(sql.Identifier(column), sql.SQL(op), value), (bound,))
        )
    return found


def selection_scope(conn: Connection, settings: Settings, selection: Selection) -> Scope:
    """The rows of ``selection``, every table's (no boundary: any retained row)."""
    extra: dict[str, tuple[sql.Composable, tuple[object, ...]]] = {}
    for table in settings.tables():
        parts: list[tuple[sql.Composable, tuple[object, ...]]] = []
        if selection.since is not None or selection.until is not None:
            parts += _time_condition(conn, table, selection, settings.sweep_time_zone)
        for value, column in (
            (selection.aggregate_type, table.columns.aggregate_type),
            (selection.aggregate_id, table.columns.aggregate_id),
        ):
            if value is not None and column is not None:
                parts.append((sql.SQL("t.{}::text = %s").format(sql.Identifier(column)), (value,)))
        if parts:
            extra[table.table] = (
                sql.SQL(" AND ").join(p for p, _ in parts),
                tuple(v for _, values in parts for v in values),
            )
    return Scope(0, None, None, commit_timestamps(conn), extra=extra)


def republish(
    settings: Settings,
    selection: Selection,
    *,
    dry_run: bool = False,
    stopping: Callable[[], bool] = lambda: False,
    progress: Callable[[Replayed], None] = lambda replayed: None,
) -> Replayed:
    """Send the selected retained rows again (or, ``dry_run``, count them)."""
    selection.check(settings.tables())
    started = time.monotonic()
    replayed = Replayed(replay=f"{settings.slot_name}/{datetime.now(UTC).isoformat()}")
    with connect(settings.source_url()) as conn, mapped(During.STATEMENT, "cannot read the outbox"):
        conn.autocommit = False
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        conn.read_only = True
        scope = selection_scope(conn, settings, selection)
        sources = [
            Source(table, relation_of(conn, table, settings.publication_name))
            for table in settings.tables()
        ]
        replayed.rows = count_rows(conn, sources, scope)
        if not dry_run and replayed.rows:
            _send(conn, settings, selection, sources, scope, replayed, stopping, progress)
    replayed.seconds = round(time.monotonic() - started, 3)
    return replayed


def _send(  # noqa: PLR0917 - one call site, the steps of republish
    conn: Connection,
    settings: Settings,
    selection: Selection,
    sources: list[Source],
    scope: Scope,
    replayed: Replayed,
    stopping: Callable[[], bool],
    progress: Callable[[Replayed], None],
) -> None:
    from cdc_relay.publisher import ProduceRefused, Publisher  # noqa: PLC0415 - Kafka: late
    from cdc_relay.shaped_mapping import outbox_mapping  # noqa: PLC0415
    from cdc_relay.topics import TopicRules  # noqa: PLC0415

    sink = Publisher(settings.producer_config(), RelayStats())
    rules = TopicRules(settings)
    known: set[str] = set()
    mappings = {
        source.relation.relation_id: outbox_mapping(
            source.relation,
            source.table.topic_template or settings.topic_template,
            settings.traceparent_column,
            source.table.columns,
        )
        for source in sources
    }
    marker = replayed.replay.encode()

    def delivered(err: Any, msg: Any) -> None:
        if err is None:
            replayed.acknowledged += 1
        else:
            replayed.fail(f"Kafka refused a record for {msg.topic()}: {err.str()}")

    try:
        for row in merged(conn, sources, scope):
            if stopping():
                break
            mapping = mappings[row.source.relation.relation_id]
            try:
                topic, key, value, headers, event_id, _ = mapping.map_fields(row.values)
            except Exception as exc:  # a row that breaks the contract: named, not sent
                replayed.fail(f"row {row.ordinal} of {mapping.table} cannot be mapped: {exc}")
                continue
            topic = selection.topic or topic
            headers.append((REPLAY_HEADER, marker))
            if topic not in known:
                try:
                    rules.ensure(sink, topic, event=selection.topic is None, serve=lambda: None)
                except ProduceRefused as refused:
                    replayed.fail(f"event {cut(event_id)}: {refused.reason}")
                    continue
                known.add(topic)
            while True:
                try:
                    sink.produce(topic, value, key, headers, delivered)
                except BufferError:
                    sink.poll(DRAIN_POLL)
                    continue
                except ProduceRefused as refused:
                    if not refused.permanent:
                        raise SinkUnavailable(f"producing failed: {refused.reason}") from None
                    replayed.fail(f"event {cut(event_id)}: {refused.reason}")
                    break
                replayed.sent += 1
                break
            if replayed.sent % 1000 == 0:
                sink.poll(0)
                progress(replayed)
        deadline = time.monotonic() + settings.delivery_stall_timeout
        while sink.in_flight() and time.monotonic() < deadline:
            sink.poll(DRAIN_POLL)
        if sink.in_flight():
            raise SinkUnavailable(
                f"Kafka acknowledged not every replayed record in "
                f"{settings.delivery_stall_timeout:g}s"
            )
        progress(replayed)
    finally:
        sink.close()
