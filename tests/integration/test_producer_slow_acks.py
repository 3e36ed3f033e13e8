"""What the relay's producer costs while acknowledgements are slow: librdkafka's broker thread.

The idempotent producer of librdkafka (2.16) sends a partition no new batch while one of five or
more records of it is in flight, yet wakes its broker thread as soon as the waiting records'
``linger.ms`` ran out: with fewer busy partitions on a connection than
``max.in.flight.requests.per.connection`` (5), the thread polls its socket without pause until the
acknowledgement comes. The steady state on the test broker showed it as the relay's CPU rising
over a run while the broker's answers slowed. ``max.in.flight.requests.per.connection=1``
(README, the producer's configuration) stops it when two or more partitions are busy, at the
price of one request at a time per broker. The broker is paused (SIGSTOP) to hold
acknowledgements back for a fixed time.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from bench.harness import threads_cpu
from cdc_relay.config import Settings
from cdc_relay.local import LocalBroker
from cdc_relay.observability.stats import RelayStats
from cdc_relay.publisher import Publisher
from tests.conftest import own_services_only

pytestmark = [
    pytest.mark.integration,
    own_services_only("pauses a broker of its own"),
]

TOPIC = "slow.acks"
RATE = 5000  # records per second, over 3 partitions
HELD = 1.5  # seconds the broker is paused


def _broker_threads_cpu() -> float:
    """CPU seconds so far of this process's librdkafka broker threads (``rdk:broker<id>``)."""
    return threads_cpu(os.getpid()).get("librdkafka broker", 0.0)


def _cpu_while_acks_are_held(properties: dict[str, str]) -> float:
    """The relay's producer (its configuration, ``properties`` added) sends RATE records a second;
    the broker is paused for HELD seconds: the broker threads' CPU seconds meanwhile."""
    with LocalBroker() as broker:
        broker.create_topic(TOPIC, partitions=3)
        values: dict[str, object] = {
            "database_url": "postgresql://relay@localhost/app",
            "kafka_bootstrap_servers": broker.bootstrap_servers,
            "kafka_producer_config": properties,
        }
        settings = Settings(**values)  # type: ignore[arg-type]
        publisher = Publisher(settings.producer_config(), RelayStats())
        acked: list[int] = []

        def delivered(err: object, _msg: object) -> None:
            if err is None:
                acked.append(1)

        sent = 0
        started = time.monotonic()
        paused_at = cpu_before = None
        cpu = None
        assert broker.pid is not None
        while True:
            now = time.monotonic() - started
            if paused_at is not None and now >= paused_at + HELD + 0.5:
                break
            assert now < 30, f"{len(acked)} of {sent} records acknowledged in 30 s"
            while sent < now * RATE:
                publisher.produce(TOPIC, b"x" * 250, b"key-%d" % sent, [], delivered)
                sent += 1
            publisher.poll(0)
            # Paused once records flow: the connection is up and acknowledgements arrive.
            if paused_at is None and now >= 1.0 and len(acked) >= RATE // 2:
                os.kill(broker.pid, signal.SIGSTOP)
                paused_at, cpu_before = now, _broker_threads_cpu()
            elif cpu is None and paused_at is not None and now >= paused_at + HELD:
                assert cpu_before is not None
                cpu = _broker_threads_cpu() - cpu_before
                os.kill(broker.pid, signal.SIGCONT)
            time.sleep(0.001)
        deadline = time.monotonic() + 20
        while len(acked) < sent and time.monotonic() < deadline:
            publisher.poll(0.1)
        publisher.close()
    assert len(acked) == sent  # every record arrived: the pause only held acknowledgements
    assert cpu is not None
    return cpu


def test_one_request_in_flight_keeps_the_broker_thread_quiet_while_acks_are_held() -> None:
    quiet = _cpu_while_acks_are_held({"max.in.flight.requests.per.connection": "1"})
    assert quiet < 0.05, f"{quiet:.2f} s of CPU in {HELD} s with acknowledgements held"


def test_by_default_the_broker_thread_polls_while_acks_are_held() -> None:
    """librdkafka's behaviour the README describes; when this fails, librdkafka fixed it and the
    paragraph on ``max.in.flight.requests.per.connection`` can go."""
    busy = _cpu_while_acks_are_held({})
    assert busy >= 0.1, f"only {busy:.2f} s of CPU in {HELD} s with acknowledgements held"
