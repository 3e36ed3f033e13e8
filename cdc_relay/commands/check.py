"""``python -m cdc_relay check``: the preflight an operator runs before (or next to) the relay.

One line per check, ``ok   <check>: <detail>`` or ``FAIL <check>: <what to do>``; the exit code is
non-zero when any check failed. It changes nothing in the database (the wal2json probe creates a
temporary slot and drops it); with exactly once on it registers a transactional producer with the
broker (below). The database checks are the relay's own (:mod:`cdc_relay.prerequisites`), all of
them reported rather than stopping at the first; the broker, topic and transaction checks are this
command's.

With exactly once on, the ``transactions`` line asks the broker for what the relay's start does
first: ``init_transactions`` for the stream's ``transactional.id``. That call fences every other
producer of the id, so while the lease says a relay leads the probe uses ``<id>.check`` instead
(granted by the same PREFIXED ACL), and the relay's own id only when no relay leads, where there
is nothing alive to fence (a dead relay's open Kafka transaction is aborted, as the next leader's
start would abort it).
"""

from __future__ import annotations

import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import psycopg
from psycopg import sql

from cdc_relay import transaction_errors
from cdc_relay.checkpoint import LEASE_TABLE
from cdc_relay.commands.output import print_line
from cdc_relay.config import (
    MissingTopics,
    Settings,
    configured_names,
    redact_url,
    unknown_variables,
)
from cdc_relay.exit_codes import ExitCode
from cdc_relay.patterns import compile_pattern
from cdc_relay.prerequisites import CheckResult, Prerequisites, Unmet, outcome
from cdc_relay.publisher import admin_config, error_name
from cdc_relay.replication.source import Connection, connect, scalar
from cdc_relay.transactional_id import transactional_id
from cdc_relay.waits import MAX_WRITE_WAIT, lock_timeout_statement

Output = Callable[[str], None]

EXIT_CHECK_FAILED = ExitCode.FAILED
BROKER_TIMEOUT = 5.0
# init_transactions: a new cluster's coordinator first creates its transaction log.
TRANSACTIONS_TIMEOUT = 10.0
PROBE_SUFFIX = ".check"
# Producer properties init_transactions depends on, beyond how to reach the cluster.
_TRANSACTION_PROPERTIES = ("transaction.timeout.ms",)


def check(settings: Settings, out: Output = print_line) -> int:
    """Run every check, print one line each (escaped: details quote what the database holds,
    such as the lease's holder); 0 when all passed."""
    lines = run_checks(settings, lambda line: out(str(line)))
    return ExitCode.OK if all(line.ok for line in lines) else EXIT_CHECK_FAILED


def run_checks(settings: Settings, emit: Callable[[CheckResult], None]) -> list[CheckResult]:
    lines: list[CheckResult] = []

    def run(name: str, probe: Callable[[], str | None]) -> None:
        line = outcome(name, probe)
        if line is not None:  # None: not applicable
            lines.append(line)
            emit(line)

    url = settings.source_url()
    connected: list[Connection] = []

    def connection() -> str:
        connected.append(connect(url))
        # No check waits for a lock for long: one held is reported (the waits line), not waited on.
        connected[0].execute(lock_timeout_statement(MAX_WRITE_WAIT))
        user = scalar(connected[0], "SELECT current_user")
        return f"{redact_url(settings.database_url.get_secret_value())} as {user}"

    run("settings", _settings)
    run("connection", connection)
    probe_ids: list[ProbeId | Unmet] = []
    if connected:
        with connected[0] as conn:
            for name, probe in Prerequisites(conn, settings).report():
                run(name, probe)
            if settings.exactly_once:
                probe_ids.append(probe_id(conn, settings))
    metadata: list[Any] = []
    run("broker", lambda: _broker(settings, metadata))
    if metadata:
        run("topics", lambda: _topics(settings, metadata[0]))
    if not settings.exactly_once:
        run("transactions", lambda: TRANSACTIONS_OFF)
    elif metadata and probe_ids:
        run("transactions", lambda: transactions(settings, probe_ids[0]))
    return lines


def _settings() -> str:
    unknown = unknown_variables(configured_names())
    if unknown:
        raise Unmet("; ".join(unknown))
    return "every CDC_RELAY_* variable set is a setting"


def _broker(settings: Settings, metadata: list[Any]) -> str:
    from confluent_kafka import KafkaException  # noqa: PLC0415 - only this command needs Kafka
    from confluent_kafka.admin import AdminClient  # noqa: PLC0415

    errors: list[Any] = []
    config: dict[str, Any] = admin_config(settings.producer_config())
    config["log_level"] = 0  # errors are collected and reported in one line instead
    config["error_cb"] = errors.append
    bootstrap = settings.kafka_bootstrap_servers
    try:
        admin = AdminClient(config)
    except KafkaException as exc:
        raise Unmet(
            f"invalid Kafka client configuration: {_kafka_reason(exc.args[0] if exc.args else exc)}"
        ) from None
    try:
        found = admin.list_topics(timeout=BROKER_TIMEOUT)
    except KafkaException as exc:
        detail = _kafka_reason(exc.args[0] if exc.args else exc)
        admin.poll(0)  # serves error_cb: the reason, e.g. "Connection refused"
        reasons = [_kafka_reason(e) for e in errors if "brokers are down" not in str(e)]
        if reasons:
            detail = reasons[0]
        raise Unmet(
            f"cannot reach Kafka at {bootstrap} within {BROKER_TIMEOUT:g}s: {detail}. Check "
            "CDC_RELAY_KAFKA_BOOTSTRAP_SERVERS and the security properties in "
            "CDC_RELAY_KAFKA_PRODUCER_CONFIG"
        ) from None
    metadata.append(found)
    cluster = f", cluster {found.cluster_id}" if found.cluster_id else ""
    return f"{len(found.brokers)} broker(s) at {bootstrap}{cluster}"


def _topics(settings: Settings, metadata: Any) -> str:
    topics: dict[str, Any] = metadata.topics
    wanted = [("dead-letter topic", settings.dead_letter_topic)]
    templates = {settings.topic_template} | {
        t.topic_template for t in settings.tables() if t.topic_template
    }
    for template in sorted(templates):
        if not any(name for _, name, _, _ in string.Formatter().parse(template)):
            wanted.append(("topic", template))  # a fixed topic name, no per-row fields
    allowlist = (
        None if settings.topic_allowlist is None else compile_pattern(settings.topic_allowlist)
    )
    refused = [
        topic
        for role, topic in wanted
        if role == "topic" and allowlist is not None and not allowlist.fullmatch(topic)
    ]
    if refused:
        raise Unmet(
            f"topic {', '.join(refused)} does not match CDC_RELAY_TOPIC_ALLOWLIST: every event "
            "would be refused; fix the template or the allow-list"
        )
    present: list[str] = []
    absent: list[str] = []
    for role, topic in wanted:
        info = topics.get(topic)
        if info is not None and info.error is None:
            present.append(f"{role} {topic} exists ({len(info.partitions)} partitions)")
        else:
            absent.append(f"{role} {topic}")
    if absent and settings.missing_topics is MissingTopics.FAIL:
        raise Unmet(
            f"{', '.join(absent)} does not exist and CDC_RELAY_MISSING_TOPICS=fail: create it "
            "(kafka-topics.sh --create --topic <name>), or let the relay create topics with "
            "CDC_RELAY_MISSING_TOPICS=create"
        )
    later = [f"{name} is created when first needed" for name in absent]
    return "; ".join(present + later + _created_topics(settings, templates))


def _created_topics(settings: Settings, templates: set[str]) -> list[str]:
    """How many topics rows can have the relay create: the cap counts per process (afresh at
    each start), so only the allow-list bounds them for good."""
    limit = settings.max_created_topics
    from_rows = any(
        name for template in templates for _, name, _, _ in string.Formatter().parse(template)
    ) or any(t.columns.topic or t.columns.topic_from for t in settings.tables())
    if settings.missing_topics is not MissingTopics.CREATE or not limit or not from_rows:
        return []
    if settings.topic_allowlist is None:
        return [
            f"rows choose topics, and each run of the relay creates up to {limit} new ones "
            "(CDC_RELAY_MAX_CREATED_TOPICS counts per process, afresh at each start): set "
            "CDC_RELAY_TOPIC_ALLOWLIST to bound them for good"
        ]
    return [
        f"new topics only as CDC_RELAY_TOPIC_ALLOWLIST allows, up to {limit} per run of the relay"
    ]


def _kafka_reason(error: Any) -> str:
    text = error.str() if hasattr(error, "str") else str(error)
    return str(text)


TRANSACTIONS_OFF = (
    "off (CDC_RELAY_EXACTLY_ONCE): at least once, consumers drop repeats by the id header"
)


@dataclass(frozen=True)
class ProbeId:
    """The ``transactional.id`` the probe may use, and why it is that one."""

    relay_id: str  # the stream's, shared by every relay of the slot
    leader: str | None  # who leads by the lease, with until when; None: no relay leads

    @property
    def probed(self) -> str:
        return self.relay_id + PROBE_SUFFIX if self.leader else self.relay_id

    def describe(self) -> str:
        if self.leader is None:
            return f"{self.relay_id}, the relay's own transactional.id (no relay leads the slot)"
        return (
            f"{self.probed}, not the relay's {self.relay_id}: {self.leader}, and its own id would "
            "fence it"
        )


def probe_id(conn: Connection, settings: Settings) -> ProbeId | Unmet:
    """The stream's id (the system identifier of the database ``check`` is connected to) and
    whether a relay leads it. A lease that cannot be read counts as a leader: the probe must not
    fence one."""
    try:
        system_identifier = scalar(conn, "SELECT system_identifier::text FROM pg_control_system()")
    except psycopg.Error as exc:
        return Unmet(
            "cannot read the database's system identifier, which the relay's transactional.id "
            f"names: {(exc.diag.message_primary or str(exc)).strip()} (GRANT EXECUTE ON FUNCTION "
            "pg_control_system() TO the relay's role)"
        )
    relay_id = transactional_id(str(system_identifier), settings.slot_name)
    lease = sql.Identifier(settings.state_schema, LEASE_TABLE)
    try:
        row = conn.execute(
            sql.SQL(
                "SELECT holder, expires_at FROM {} WHERE slot_name = %s AND expires_at > now()"
            ).format(lease),
            (settings.slot_name,),
        ).fetchone()
    except psycopg.errors.UndefinedTable:
        return ProbeId(relay_id, None)  # no relay has started here yet
    except psycopg.Error:
        return ProbeId(relay_id, "the leader lease cannot be read, so a relay may lead")
    if row is None:
        return ProbeId(relay_id, None)
    holder, expires = row
    return ProbeId(relay_id, f"relay {holder} leads (lease valid until {expires})")


class TransactionalProducer(Protocol):
    def init_transactions(self, timeout: float) -> None: ...


def _producer(config: dict[str, Any]) -> TransactionalProducer:
    from confluent_kafka import Producer  # noqa: PLC0415 - only this command needs Kafka

    return Producer(config)


def transactions(
    settings: Settings,
    target: ProbeId | Unmet,
    producer: Callable[[dict[str, Any]], TransactionalProducer] = _producer,
) -> str:
    """``init_transactions`` for the id :func:`probe_id` chose; a refusal names its fix
    (:mod:`cdc_relay.transaction_errors`)."""
    from confluent_kafka import KafkaError, KafkaException  # noqa: PLC0415

    if isinstance(target, Unmet):
        raise target
    wanted = settings.producer_config()
    config: dict[str, Any] = admin_config(wanted)
    config.update({key: wanted[key] for key in _TRANSACTION_PROPERTIES if key in wanted})
    config.update({"transactional.id": target.probed, "log_level": 0, "error_cb": _ignore})
    try:
        client = producer(config)
    except KafkaException as exc:
        raise Unmet(
            f"invalid Kafka client configuration: {_kafka_reason(exc.args[0] if exc.args else exc)}"
        ) from None
    try:
        client.init_transactions(TRANSACTIONS_TIMEOUT)
    except KafkaException as exc:
        error = exc.args[0] if exc.args else None
        code = error.code() if isinstance(error, KafkaError) else KafkaError._FAIL
        reason = f"{error_name(code)}: {_kafka_reason(error if error is not None else exc)}"
        refusal = transaction_errors.fix(code)
        if refusal is not None:
            raise Unmet(
                f"the broker refused init_transactions for {target.probed} ({reason}): {refusal}"
            ) from None
        if code == KafkaError._TIMED_OUT:
            raise Unmet(
                f"the broker did not answer init_transactions for {target.probed} within "
                f"{TRANSACTIONS_TIMEOUT:g}s: no transaction coordinator became available. A "
                "one-node cluster needs transaction.state.log.replication.factor=1 and "
                "transaction.state.log.min.isr=1 (README: Exactly once); a new cluster creates "
                "its transaction log at the first transactional client, so run check again"
            ) from None
        transient = transaction_errors.outcome(code) is transaction_errors.Outcome.RETRY
        raise Unmet(
            f"init_transactions for {target.probed} failed ({reason})"
            + ("; the relay retries such an error: run check again" if transient else "")
        ) from None
    return f"the broker accepts init_transactions for {target.describe()}"


def _ignore(_error: object) -> None:
    """librdkafka's error callback: the call's own error is what the line reports."""
