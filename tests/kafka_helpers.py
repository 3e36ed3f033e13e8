"""Reading back what was produced, for tests.

Consumers here use ``assign()`` with the partitions from the topic metadata, never a consumer
group ``subscribe()``: the first group assignment takes seconds on Tansu. One loop reads for all
of them (:class:`Reader`): :func:`consume_all` reads to a count once, :class:`BackgroundReader`
reads in a thread while a test runs and notes when each record arrived.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from confluent_kafka import OFFSET_BEGINNING, Consumer, Message, TopicPartition

__all__ = [
    "Arrival",
    "BackgroundReader",
    "Reader",
    "Record",
    "consume_all",
    "consume_with_grace",
]

Isolation = Literal["read_uncommitted", "read_committed"]


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


class Reader:
    """A consumer of every partition of ``topics`` from the beginning, read batch by batch.

    Each record (topic, partition, offset) is returned once: a fetch that brings records again
    (after a broker pause) is not a second copy in Kafka. Errors that are not fatal are kept in
    ``errors`` (partition EOF, transient transport errors); a fatal one raises. Topics that do not
    exist within ``timeout`` seconds leave the reader with nothing assigned (``assigned`` False).
    """

    def __init__(
        self,
        bootstrap: str,
        topics: str | Iterable[str],
        *,
        isolation: Isolation = "read_uncommitted",
        timeout: float = 30.0,
        config: dict[str, Any] | None = None,
    ) -> None:
        self.errors: list[str] = []
        self._seen: set[tuple[str, int, int]] = set()
        self._consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"test-reader-{uuid.uuid4().hex[:8]}",
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
                "enable.partition.eof": False,
                "allow.auto.create.topics": False,
                "isolation.level": isolation,
                "fetch.wait.max.ms": 50,
                "log_level": 3,
                **(config or {}),
            }
        )
        deadline = time.monotonic() + timeout
        assignment = [
            TopicPartition(topic, partition, OFFSET_BEGINNING)
            for topic in ([topics] if isinstance(topics, str) else topics)
            for partition in _partitions(self._consumer, topic, deadline)
        ]
        self.assigned = bool(assignment)
        if assignment:
            self._consumer.assign(assignment)

    def poll(self, timeout: float = 0.1, max_records: int = 1000) -> list[Record]:
        """The records of one batch (waiting up to ``timeout`` seconds), each offset once."""
        if not self.assigned:
            time.sleep(timeout)
            return []
        records = []
        for message in self._consumer.consume(num_messages=max_records, timeout=timeout):
            error = message.error()
            if error is not None:
                if error.fatal():
                    raise RuntimeError(f"consume error: {error}")
                self.errors.append(str(error))
                continue
            record = _record(message)
            place = (record.topic, record.partition, record.offset)
            if place not in self._seen:
                self._seen.add(place)
                records.append(record)
        return records

    def read_until(self, done: Callable[[list[Record]], bool], timeout: float) -> list[Record]:
        """Records read from now on until ``done(records)`` or ``timeout`` seconds."""
        records: list[Record] = []
        deadline = time.monotonic() + timeout
        while not done(records) and time.monotonic() < deadline:
            records += self.poll(min(0.1, max(0.0, deadline - time.monotonic())))
        return records

    def close(self) -> None:
        self._consumer.close()


def consume_all(
    bootstrap: str,
    topics: str | Iterable[str],
    expected_count: int,
    timeout: float = 30.0,
    *,
    grace: float = 0.0,
    isolation: Isolation = "read_uncommitted",
) -> list[Record]:
    """Read ``topics`` from the beginning until ``expected_count`` records or ``timeout`` seconds.

    Returns what was read, in arrival order (ordered per partition), possibly fewer records than
    expected. With ``grace > 0`` it keeps reading that many more seconds after the count is
    reached, so extra or duplicate records show up in the result. A ``None`` header value is
    returned as ``b""``.
    """
    deadline = time.monotonic() + timeout
    reader = Reader(bootstrap, topics, isolation=isolation, timeout=timeout)
    records: list[Record] = []
    try:
        if not reader.assigned:
            return records
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
            records += reader.poll(min(0.2, stop_at - now))
    finally:
        reader.close()
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


@dataclass(frozen=True)
class Arrival:
    at: float  # time.monotonic() when the batch that brought it was read
    record: Record

    @property
    def event_id(self) -> str:
        return (self.record.header("id") or b"").decode()


class _Writers(Protocol):
    def began_at(self, event_id: str) -> float | None:
        """When the transaction that wrote ``event_id`` began (monotonic), if it is known."""


class BackgroundReader:
    """Reads ``topic`` from the beginning in a thread of its own while a test runs, noting when
    each record arrived (``isolation`` sets what a ``read_committed`` consumer would not see).

    A fetch error or a reader that stopped is kept in ``errors``; the topic must exist.
    """

    def __init__(self, bootstrap: str, topic: str, *, isolation: Isolation = "read_uncommitted"):
        # A short fetch wait: arrival times measure takeovers.
        self._reader = Reader(
            bootstrap, topic, isolation=isolation, config={"fetch.wait.max.ms": 10}
        )
        assert self._reader.assigned, f"no topic {topic!r} to read"
        self.errors = self._reader.errors
        self._arrivals: list[Arrival] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"reader-{topic}")
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                records = self._reader.poll(0.02)
                now = time.monotonic()
                with self._lock:
                    self._arrivals.extend(Arrival(now, record) for record in records)
        except Exception as exc:  # the test sees it in errors
            self.errors.append(f"the reader stopped: {exc!r}")

    def __enter__(self) -> BackgroundReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._reader.close()

    def snapshot(self) -> list[Arrival]:
        """What arrived so far, in arrival order (ordered per partition)."""
        with self._lock:
            return list(self._arrivals)

    def event_ids(self) -> set[str]:
        return {arrival.event_id for arrival in self.snapshot()}

    def duplicates(self) -> int:
        """Records beyond the first of each event id."""
        counts = Counter(arrival.event_id for arrival in self.snapshot())
        return sum(n - 1 for n in counts.values())

    def first_new_event_after(self, fault: float, writers: _Writers, timeout: float) -> float:
        """Seconds from ``fault`` to the arrival of the first event whose transaction began
        after it (only a relay at work after the fault can have published it)."""
        deadline = time.monotonic() + timeout
        index = 0
        while time.monotonic() < deadline:
            arrivals = self.snapshot()
            for arrival in arrivals[index:]:
                began = writers.began_at(arrival.event_id)
                if began is not None and began > fault:
                    return arrival.at - fault
            index = len(arrivals)
            time.sleep(0.01)
        raise AssertionError(f"no event begun after the fault arrived within {timeout}s")
