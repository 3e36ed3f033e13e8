"""``python -m cdc_relay check``: the preflight an operator runs before (or next to) the relay.

One line per check, ``ok   <check>: <detail>`` or ``FAIL <check>: <what to do>``; the exit code is
non-zero when any check failed. It changes nothing (the wal2json probe creates a temporary slot and
drops it). The database checks are the relay's own (:mod:`cdc_relay.prerequisites`), all of them
reported rather than stopping at the first; the broker and topic checks are this command's.
"""

from __future__ import annotations

import string
from collections.abc import Callable
from typing import Any

from cdc_relay.commands.output import print_line
from cdc_relay.config import (
    MissingTopics,
    Settings,
    configured_names,
    redact_url,
    unknown_variables,
)
from cdc_relay.patterns import compile_pattern
from cdc_relay.prerequisites import CheckResult, Prerequisites, Unmet, outcome
from cdc_relay.publisher import admin_config
from cdc_relay.replication.source import Connection, connect, scalar

Output = Callable[[str], None]

EXIT_CHECK_FAILED = 1
BROKER_TIMEOUT = 5.0


def check(settings: Settings, out: Output = print_line) -> int:
    """Run every check, print one line each (escaped: details quote what the database holds,
    such as the lease's holder); 0 when all passed."""
    lines = run_checks(settings, lambda line: out(str(line)))
    return 0 if all(line.ok for line in lines) else EXIT_CHECK_FAILED


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
        user = scalar(connected[0], "SELECT current_user")
        return f"{redact_url(settings.database_url.get_secret_value())} as {user}"

    run("settings", _settings)
    run("connection", connection)
    if connected:
        with connected[0] as conn:
            for name, probe in Prerequisites(conn, settings).report():
                run(name, probe)
    metadata: list[Any] = []
    run("broker", lambda: _broker(settings, metadata))
    if metadata:
        run("topics", lambda: _topics(settings, metadata[0]))
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
