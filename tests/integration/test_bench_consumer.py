"""The steady-state bench's consumer: what it reads, when, and what it reports.

A long window on the test broker leaves a consumer reading during it behind (the broker serves
fetches more slowly the more it holds): the bench must then report the events it read and those
missing, not abort the whole run. Where it only counts, the consumer reads after the window: the
events written during it are read then, each once, and none before.
"""

from __future__ import annotations

import time

import orjson
import pytest
from confluent_kafka import Producer

from bench.harness import TOPIC, TOPIC_PARTITIONS
from bench.steady import ConsumerChild, consumer_timeout
from cdc_relay.local import LocalBroker
from tests.conftest import own_services_only

pytestmark = [
    pytest.mark.integration,
    own_services_only("starts a broker of its own"),
]


def test_consumer_past_its_deadline_reports_what_it_read() -> None:
    with LocalBroker() as broker:
        broker.create_topic(TOPIC, partitions=TOPIC_PARTITIONS)
        consumer = ConsumerChild(broker.bootstrap_servers, warmup=1)
        try:
            consumer.wait_for("ready", 30)
            producer = Producer({"bootstrap.servers": broker.bootstrap_servers})
            for seq in (-1, 0, 1, 2):  # the warm-up event, then three of five expected
                producer.produce(TOPIC, orjson.dumps({"seq": seq, "ts": 0.0}), partition=0)
            assert producer.flush(10) == 0
            consumer.wait_for("warm", 30)
            result = consumer.result(5, timeout=2.0)
        finally:
            consumer.close()
    assert result["timed_out"] is True
    assert result["received"] == 3
    assert sorted(result["seqs"]) == [0, 1, 2]


def test_consumer_timeout_grows_with_the_window() -> None:
    assert consumer_timeout(60) > consumer_timeout(30) >= 120


@pytest.mark.parametrize("read_after", [True, False], ids=["after the window", "during it"])
def test_a_consumer_reading_after_the_window_reads_every_event_once_and_only_then(
    read_after: bool,
) -> None:
    with LocalBroker() as broker:
        broker.create_topic(TOPIC, partitions=TOPIC_PARTITIONS)
        consumer = ConsumerChild(broker.bootstrap_servers, warmup=1, read_after=read_after)
        try:
            consumer.wait_for("ready", 30)
            producer = Producer({"bootstrap.servers": broker.bootstrap_servers})
            producer.produce(TOPIC, orjson.dumps({"seq": -1, "ts": 0.0}), partition=0)
            assert producer.flush(10) == 0
            consumer.wait_for("warm", 30)
            for seq in range(30):  # the window: every partition, one event sent twice
                value = orjson.dumps({"seq": seq, "ts": time.time()})
                producer.produce(TOPIC, value, partition=seq % TOPIC_PARTITIONS)
            producer.produce(TOPIC, orjson.dumps({"seq": 7, "ts": 0.0}), partition=1)
            assert producer.flush(10) == 0
            time.sleep(1.5)  # a consumer fetching during the window has read them by now
            window_over = time.time()
            result = consumer.result(30, timeout=30.0)
        finally:
            consumer.close()
    assert result["timed_out"] is False
    assert sorted(result["seqs"]) == list(range(30))
    assert (result["received"], result["duplicates"]) == (30, 1)
    if read_after:
        assert result["first_read_at"] >= window_over
        assert result["latencies_ms"] == []
    else:
        assert result["first_read_at"] < window_over
        assert len(result["latencies_ms"]) == 30


def test_a_consumer_reading_after_the_window_reads_a_long_window_in_seconds() -> None:
    # ~27,000 batches of 11 events, as the relay's ~450 batches a second leave after a 60 s
    # window at 5,000 events/s: the test broker lists all of a partition's batches on every fetch.
    events = 300_000
    with LocalBroker() as broker:
        broker.create_topic(TOPIC, partitions=TOPIC_PARTITIONS)
        consumer = ConsumerChild(broker.bootstrap_servers, warmup=1, read_after=True)
        try:
            consumer.wait_for("ready", 30)
            producer = Producer(
                {
                    "bootstrap.servers": broker.bootstrap_servers,
                    "linger.ms": 0,
                    "batch.num.messages": 11,
                    "compression.type": "lz4",
                    "enable.idempotence": True,
                }
            )
            producer.produce(TOPIC, orjson.dumps({"seq": -1, "ts": 0.0}), partition=0)
            assert producer.flush(10) == 0
            consumer.wait_for("warm", 30)
            pad = "x" * 200
            for seq in range(events):
                value = orjson.dumps({"seq": seq, "ts": 0.0, "pad": pad})
                while True:
                    try:
                        producer.produce(TOPIC, value, partition=seq % TOPIC_PARTITIONS)
                        break
                    except BufferError:
                        producer.poll(0.01)
            assert producer.flush(60) == 0
            started = time.monotonic()
            result = consumer.result(events, timeout=30.0)
            took = time.monotonic() - started
        finally:
            consumer.close()
    assert result["timed_out"] is False, result["received"]
    assert (result["received"], result["duplicates"]) == (events, 0)
    assert took < 15, took
