"""The steady-state bench's consumer reports what it read when the bench's deadline passes.

A long window on the test broker leaves the consumer behind (the broker serves fetches more
slowly the more it holds): the bench must then report the events it read and those missing, not
abort the whole run.
"""

from __future__ import annotations

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
