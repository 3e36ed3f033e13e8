"""Stand-ins for the session's collaborators, so unit tests can drive the real loop.

:class:`~cdc_relay.session.Session` talks to a replication source, a Kafka sink and a position
store through small Protocols. These fakes implement them in memory: captured pgoutput messages
become the source's frames, the sink acknowledges (or refuses) on ``poll`` the way librdkafka's
delivery reports do, and every write to the store and every status update to the slot lands in
one shared ``journal``, so a test can assert the order of the two.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from cdc_relay.errors import RelayError
from cdc_relay.lsn import parse_lsn
from cdc_relay.publisher import ANY_PARTITION, NO_TIMESTAMP, refusal

PGOUTPUT_FIXTURES = Path(__file__).resolve().parent / "fixtures" / "pgoutput"
_XLOG_HEADER = struct.Struct(">cQQQ")
_KEEPALIVE = struct.Struct(">cQQB")


def xlog_frame(payload: bytes, lsn: int) -> bytes:
    """A CopyData XLogData frame around one pgoutput message, as the walsender sends it."""
    return _XLOG_HEADER.pack(b"w", lsn, lsn, 0) + payload


def keepalive_frame(wal_end: int, reply: bool = False) -> bytes:
    return _KEEPALIVE.pack(b"k", wal_end, 0, int(reply))


def captured_frames(case: str, capture: str = "v1") -> list[bytes]:
    """Every message of a captured pgoutput fixture, in order, as XLogData frames."""
    fixture = json.loads((PGOUTPUT_FIXTURES / f"{case}.json").read_text())
    return [
        xlog_frame(bytes.fromhex(m["hex"]), parse_lsn(m["lsn"]))
        for m in fixture["messages"]
        if m["capture"] == capture
    ]


@dataclass
class FakeOwner:
    """The relay as a session sees it."""

    stopping: bool = False
    failure: RelayError | None = None
    leading: bool = True

    @property
    def failed(self) -> bool:
        return self.failure is not None

    def fail(self, error: RelayError) -> None:
        self.failure = error
        self.stopping = True


class FakeSource:
    """Hands out ``frames`` one per read; once they run out (or after ``stop_after`` of them),
    asks ``owner`` to stop."""

    def __init__(
        self,
        frames: list[bytes],
        owner: FakeOwner,
        journal: list[Any],
        stop_after: int | None = None,
    ) -> None:
        self.frames = list(frames)
        self._owner = owner
        self._journal = journal
        self._stop_after = stop_after  # frames read before a stop is requested
        self.read_count = 0
        self.statuses: list[tuple[int, int]] = []

    def stop_after(self, frames: int | None) -> None:
        """Ask for a stop once ``frames`` frames have been read in all (None: when they run out)."""
        self._stop_after = frames

    def read(self) -> memoryview | None:
        if not self.frames or self.read_count == self._stop_after:
            self._owner.stopping = True
        if not self.frames:
            return None
        self.read_count += 1
        return memoryview(self.frames.pop(0))

    def wait(self, timeout: float) -> bool:
        return bool(self.frames)

    def send_status(self, written: int, flushed: int, reply: bool = False) -> None:
        self.statuses.append((written, flushed))
        self._journal.append(("slot", flushed))


class FakeStore:
    def __init__(self, journal: list[Any]) -> None:
        self._journal = journal
        self.saved: list[int] = []
        self.noted: dict[tuple[str, int], int] = {}
        self.offsets: list[dict[tuple[str, int], int]] = []

    def save(self, lsn: int, offsets: Mapping[tuple[str, int], int] | None = None) -> None:
        self.saved.append(lsn)
        self.offsets.append(dict(offsets or {}))
        self._journal.append(("record", lsn))

    def note_written_from(self, offsets: Mapping[tuple[str, int], int]) -> None:
        self.noted = dict(offsets)


class DeliveredMessage:
    """What a delivery report's ``msg`` offers."""

    def __init__(self, record: Record) -> None:
        self._record = record

    def key(self) -> bytes | None:
        return self._record.key

    def value(self) -> bytes | None:
        return self._record.value

    def topic(self) -> str:
        return self._record.topic

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return self._record.offset


class DeliveryError:
    def __init__(self, code: int, reason: str) -> None:
        self._code, self._reason = code, reason

    def code(self) -> int:
        return self._code

    def str(self) -> str:
        return self._reason


@dataclass
class Record:
    topic: str
    value: bytes | None
    key: bytes | None
    headers: list[tuple[str, bytes]]
    on_delivery: Callable[[Any, Any], None] = field(repr=False)
    offset: int = 0

    def header(self, name: str) -> bytes | None:
        return next((v for n, v in self.headers if n == name), None)


class FakeSink:
    """A Kafka producer in memory: records wait in flight until ``poll`` acknowledges them.

    ``acknowledging`` False holds every record in flight (a broker that does not answer);
    ``refuse_topics`` maps a topic to the librdkafka error code produce raises for it.
    """

    def __init__(self) -> None:
        self.acknowledging = True
        self.refuse_topics: dict[str, int] = {}
        self.in_flight_records: list[Record] = []
        self.delivered: list[Record] = []
        self.topics_checked: list[str] = []

    def partition_ends(self, topic: str) -> dict[int, int]:
        return {0: sum(1 for r in self.delivered if r.topic == topic)}

    def produce_raw(
        self,
        topic: str,
        value: bytes | None,
        key: bytes | None,
        partition: int,
        on_delivery: Callable[[Any, Any], None],
        on_delivery_alias: None,
        timestamp: int,
        headers: list[tuple[str, bytes]],
    ) -> None:
        """confluent-kafka's positional order (see :data:`cdc_relay.publisher.ANY_PARTITION`)."""
        assert (partition, on_delivery_alias, timestamp) == (ANY_PARTITION, None, NO_TIMESTAMP)
        code = self.refuse_topics.get(topic)
        if code is not None:
            raise KafkaException(KafkaError(code, f"refused by the fake for {topic}"))
        self.in_flight_records.append(Record(topic, value, key, list(headers), on_delivery))

    def produce(
        self,
        topic: str,
        value: bytes | None,
        key: bytes | None,
        headers: list[tuple[str, bytes]],
        on_delivery: Callable[[Any, Any], None],
    ) -> None:
        try:
            self.produce_raw(
                topic, value, key, ANY_PARTITION, on_delivery, None, NO_TIMESTAMP, headers
            )
        except KafkaException as exc:
            raise refusal(exc) from None

    def poll(self, timeout: float = 0) -> int:
        if not self.acknowledging:
            return 0
        served = self.in_flight_records
        self.in_flight_records = []
        for record in served:
            record.offset = len(self.delivered)
            self.delivered.append(record)
            record.on_delivery(None, DeliveredMessage(record))
        return len(served)

    def fail_in_flight(self, code: int, reason: str) -> None:
        """The broker refuses every record in flight (delivery reports with an error)."""
        served = self.in_flight_records
        self.in_flight_records = []
        for record in served:
            record.on_delivery(DeliveryError(code, reason), DeliveredMessage(record))

    def in_flight(self) -> int:
        return len(self.in_flight_records)

    def check_fatal(self) -> None:
        return None

    def ensure_topic(
        self,
        topic: str,
        create: bool,
        partitions: int,
        replication_factor: int,
        may_create: Callable[[], None] | None = None,
    ) -> bool:
        self.topics_checked.append(topic)
        return False

    def on_topic(self, topic: str) -> list[Record]:
        return [r for r in self.delivered if r.topic == topic]
