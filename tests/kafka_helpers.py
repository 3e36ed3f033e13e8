"""Reading back what was produced, for tests.

Consumers here use ``assign()`` with the partitions from the topic metadata, never a consumer
group ``subscribe()``: the first group assignment takes seconds on Tansu.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, Message, TopicPartition

__all__ = ["Record", "consume_all", "consume_with_grace"]


@dataclass(frozen=True)
class Record:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]

    def header(self, name: str) -> bytes | None:
        """Value of the first header called ``name``."""
        for key, value in self.headers:
            if key == name:
                return value
        return None


def _partitions(consumer: Consumer, topic: str, deadline: float) -> list[int]:
    """Partition ids of ``topic``, waiting for it to exist until ``deadline``."""
    while True:
        remaining = max(0.1, deadline - time.monotonic())
        metadata = consumer.list_topics(topic, timeout=min(remaining, 5.0))
        info = metadata.topics.get(topic)
        if info is not None and info.error is None and info.partitions:
            return sorted(info.partitions)
        if time.monotonic() >= deadline:
            return []
        time.sleep(0.05)


def _bytes(value: str | bytes | None) -> bytes:
    if value is None:
        return b""
    return value.encode() if isinstance(value, str) else value


def _record(message: Message) -> Record:
    raw = message.headers() or []
    pairs = raw.items() if isinstance(raw, dict) else raw
    topic, partition, offset = message.topic(), message.partition(), message.offset()
    assert topic is not None
    assert partition is not None
    assert offset is not None
    return Record(
        topic=topic,
        partition=partition,
        offset=offset,
        key=message.key(),
        value=message.value(),
        headers=[(name, _bytes(value)) for name, value in pairs],
    )


def consume_all(
    bootstrap: str,
    topics: str | Iterable[str],
    expected_count: int,
    timeout: float = 30.0,
    *,
    grace: float = 0.0,
    config: dict[str, Any] | None = None,
) -> list[Record]:
    """Read ``topics`` from the beginning until ``expected_count`` records or ``timeout`` seconds.

    Returns what was read, in arrival order (ordered per partition), possibly fewer records than
    expected. With ``grace > 0`` it keeps reading that many more seconds after the count is
    reached, so extra or duplicate records show up in the result. A ``None`` header value is
    returned as ``b""``.
    """
    topic_list = [topics] if isinstance(topics, str) else list(topics)
    deadline = time.monotonic() + timeout
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"test-reader-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "enable.partition.eof": False,
            "allow.auto.create.topics": False,
            "fetch.wait.max.ms": 50,
            "log_level": 3,
            **(config or {}),
        }
    )
    records: list[Record] = []
    try:
        assignment = [
            TopicPartition(topic, partition, OFFSET_BEGINNING)
            for topic in topic_list
            for partition in _partitions(consumer, topic, deadline)
        ]
        if not assignment:
            return records
        consumer.assign(assignment)
        stop_at = deadline
        in_grace = False
        while True:
            if len(records) >= expected_count and not in_grace:
                if grace <= 0:
                    break
                in_grace = True
                stop_at = time.monotonic() + grace
            now = time.monotonic()
            if now >= stop_at:
                break
            batch = consumer.consume(num_messages=1000, timeout=min(0.2, stop_at - now))
            for message in batch:
                error = message.error()
                if error is not None:
                    if error.fatal():
                        raise RuntimeError(f"consume error: {error}")
                    continue  # partition EOF, transient transport errors: keep polling
                records.append(_record(message))
    finally:
        consumer.close()
    return records


def consume_with_grace(
    bootstrap: str,
    topics: str | Iterable[str],
    expected_count: int,
    timeout: float = 30.0,
    grace: float = 1.0,
) -> list[Record]:
    """:func:`consume_all` that keeps reading ``grace`` seconds after reaching the count."""
    return consume_all(bootstrap, topics, expected_count, timeout, grace=grace)
