"""A fenced transactional producer, on the real test broker: whatever serves its callbacks next
(a poll, the close) says "fenced" in the relay's terms, and the close never raises.

The sequence is the woken zombie's, made deterministic: the relay's producer has records waiting
in a Kafka transaction when a newer producer of the same ``transactional.id`` fences it — here
before the transaction registers its partition, so librdkafka learns of the fence at once, as a
*fatal* error (``_FENCED``). confluent-kafka raises a fatal error from inside its error callback
and leaves it set; a delivery report served by the same call then returns with that exception
set, and the call raises ``SystemError``. The relay must stand by (``LeadershipLost``), never end
with a traceback (exit 70).
"""

from __future__ import annotations

import time
from functools import partial

import pytest
from confluent_kafka import Producer

from cdc_relay.errors import LeadershipLost
from cdc_relay.observability.stats import RelayStats
from cdc_relay.publisher import DeliveryTracker, Publisher
from cdc_relay.reconcile import position_prefix
from cdc_relay.watermark import PendingTransaction
from tests.conftest import KafkaBroker

pytestmark = pytest.mark.integration

FENCE_KNOWN = 2.0  # seconds for the fenced AddPartitionsToTxn answer to reach the producer


def _fenced_publisher(broker: KafkaBroker, unique: str, **config: str) -> Publisher:
    """A transactional publisher with records waiting in a transaction that a newer producer of
    its transactional.id fenced before they registered their partition."""
    topic = f"{unique}.order"
    broker.create_topic(topic, partitions=1)
    transactional_id = f"cdc-relay.test.{unique}"
    stats = RelayStats()
    config = {"bootstrap.servers": broker.bootstrap_servers, "transaction.timeout.ms": "10000",
              **config}  # fmt: skip
    publisher = Publisher(config, stats, transactional_id)
    publisher.init_transactions(lambda: None)
    fencer = Producer({"bootstrap.servers": broker.bootstrap_servers,
                       "transactional.id": transactional_id})  # fmt: skip
    fencer.init_transactions(30)
    tracker = DeliveryTracker(stats)
    txn = PendingTransaction(0x100, time.time(), position_prefix("slot", 0x100))
    on_delivery = partial(tracker.on_delivery, (txn, "outbox", topic, []))  # as the session's
    publisher.begin_transaction()
    for n in range(5):
        publisher.produce(topic, b"v%d" % n, b"k", [], on_delivery)
        txn.produced()
    time.sleep(FENCE_KNOWN)
    fencer.flush(1)
    return publisher


def test_a_fenced_producer_closes_without_raising(broker: KafkaBroker, unique: str) -> None:
    publisher = _fenced_publisher(broker, unique)
    publisher.close()  # on a zombie woken as a standby: its producer is closed, nothing raised
    assert publisher.fatal_error is not None
    assert "fenced" in publisher.fatal_error


def test_a_fenced_producer_polled_is_a_lost_leadership(broker: KafkaBroker, unique: str) -> None:
    # Its records time out meanwhile: the poll serves their reports with the fatal error.
    publisher = _fenced_publisher(broker, unique, **{"message.timeout.ms": "1000"})
    try:
        with pytest.raises(LeadershipLost, match="fenced"):
            publisher.poll(0.5)
    finally:
        publisher.close()
