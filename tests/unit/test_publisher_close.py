"""Closing the publisher ends its librdkafka client there and then, whoever still holds a bound
method of it: the session keeps ``produce_raw`` for its hot path, and the first session, frozen by
the collector (cdc_relay.collector.settled), keeps it for the life of the process. A client left
alive keeps its threads and its broker connections after its session, and runs them through the
interpreter's finalization and the process's exit."""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from pathlib import Path

import pytest

from cdc_relay.errors import SinkUnavailable
from cdc_relay.observability.stats import RelayStats
from cdc_relay.publisher import Publisher, await_closed

NO_BROKER = {"bootstrap.servers": "127.0.0.1:9", "enable.idempotence": "true"}


def _librdkafka_threads() -> int:
    """This process's threads that librdkafka started (it names them ``rdk:…``)."""
    count = 0
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            count += (task / "comm").read_text().startswith("rdk:")
    return count


def _settled(expected: int, timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    while (count := _librdkafka_threads()) > expected and time.monotonic() < deadline:
        time.sleep(0.02)
    return count


def test_close_ends_the_client_while_the_session_still_holds_its_produce() -> None:
    gc.collect()  # clients other tests left to the collector go first
    before = _librdkafka_threads()
    publisher = Publisher(NO_BROKER, RelayStats())
    assert _librdkafka_threads() > before
    held = publisher.produce_raw  # as Session keeps it
    for _ in range(100):  # queued, never delivered (no broker)
        held("t", b"v", None, -1, lambda err, msg: None, None, 0, [("h", b"1")])

    started = time.monotonic()
    publisher.close()

    assert await_closed(5.0)  # as the relay waits before it exits
    assert time.monotonic() - started < 5.0  # what was queued is dropped, not waited for
    assert _settled(before) <= before  # the client's threads are gone
    with pytest.raises(RuntimeError):  # and what is still held of it refuses to work
        held("t", b"v", None, -1, None, None, 0, [])


def test_close_waits_for_a_metadata_request_of_another_thread() -> None:
    """The readiness probe (HTTP thread) or a topic's helper thread may be inside librdkafka's
    metadata call when the session closes the publisher: close() destroys the client once that
    call returned (librdkafka alone would wait for the request too; the count also covers the
    moment between fetching the producer and entering librdkafka), and that thread gets the
    relay's own error, as does a probe after the close."""
    publisher = Publisher(NO_BROKER, RelayStats())
    outcome: list[BaseException | None] = []

    def probe() -> None:
        try:
            publisher.probe(1.0)  # no broker: waits its whole timeout
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=probe)
    thread.start()
    time.sleep(0.2)  # inside list_topics
    publisher.close()
    assert await_closed(5.0)
    thread.join(5.0)
    assert len(outcome) == 1
    assert isinstance(outcome[0], SinkUnavailable)
    with pytest.raises(SinkUnavailable):  # a probe after the close: the same, no crash
        publisher.probe(1.0)


def test_destroyed_producers_are_not_kept() -> None:
    """A relay rebuilds its producer after each broker outage, for as long as it runs: the
    threads that destroyed the earlier ones are not kept."""
    from cdc_relay import publisher as module  # noqa: PLC0415

    for _ in range(5):
        Publisher(NO_BROKER, RelayStats()).close()
        for closing in list(module._closing):
            closing.join(5.0)  # destroyed, and the relay has not exited
    Publisher(NO_BROKER, RelayStats()).close()
    assert len(module._closing) <= 1
    assert await_closed(5.0)
