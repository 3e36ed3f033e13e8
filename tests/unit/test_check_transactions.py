"""``check``'s ``transactions`` line without a broker: which id it probes, the producer it builds,
and what each answer of ``init_transactions`` prints — a refusal with the fix from the one table
(:mod:`cdc_relay.transaction_errors`), a timeout as a broker that did not answer."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException
from hypothesis import given
from hypothesis import strategies as st

from cdc_relay.commands.check import (
    PROBE_SUFFIX,
    TRANSACTIONS_TIMEOUT,
    ProbeId,
    transactions,
)
from cdc_relay.config import Settings
from cdc_relay.prerequisites import Unmet
from cdc_relay.transaction_errors import ACL_FIX, BROKER_FIX, Outcome, fix, outcome

RELAY_ID = "cdc-relay.7312345678901234567.cdc_relay"
SASL_PASSWORD = "s3cret-sasl-Pw"
NO_LEADER = ProbeId(RELAY_ID, None)
LEADER = ProbeId(RELAY_ID, "relay host/1/abc leads (lease valid until 2030-01-01)")


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No CDC_RELAY_* variable from the outer environment, and no stray .env file."""
    for name in list(os.environ):
        if name.upper().startswith("CDC_RELAY_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)


def _settings(**properties: str) -> Settings:
    values: dict[str, object] = {
        "database_url": "postgresql://relay@db.example/app",
        "kafka_bootstrap_servers": "kafka:9092",
        "exactly_once": True,
        "kafka_producer_config": {
            "security.protocol": "SASL_SSL",
            "sasl.username": "relay",
            "sasl.password": SASL_PASSWORD,
            **properties,
        },
    }
    return Settings(**values)  # type: ignore[arg-type]


class FakeProducer:
    """What ``check`` builds: records its configuration, answers ``init_transactions`` as told."""

    def __init__(self, error: KafkaError | None = None) -> None:
        self.error = error
        self.config: dict[str, Any] = {}
        self.calls: list[float] = []

    def __call__(self, config: dict[str, Any]) -> FakeProducer:
        self.config = config
        return self

    def init_transactions(self, timeout: float) -> None:
        self.calls.append(timeout)
        if self.error is not None:
            raise KafkaException(self.error)


def _fails(producer: FakeProducer, target: ProbeId = NO_LEADER) -> str:
    with pytest.raises(Unmet) as info:
        transactions(_settings(), target, producer)
    return info.value.fix


def test_no_relay_leads_the_probe_uses_the_relays_own_id() -> None:
    producer = FakeProducer()
    line = transactions(_settings(), NO_LEADER, producer)
    assert producer.config["transactional.id"] == RELAY_ID
    assert producer.calls == [TRANSACTIONS_TIMEOUT]
    assert line == (
        f"the broker accepts init_transactions for {RELAY_ID}, the relay's own transactional.id "
        "(no relay leads the slot)"
    )


def test_beside_a_leader_the_probe_uses_the_check_id_and_says_why() -> None:
    producer = FakeProducer()
    line = transactions(_settings(), LEADER, producer)
    assert producer.config["transactional.id"] == RELAY_ID + PROBE_SUFFIX
    assert line == (
        f"the broker accepts init_transactions for {RELAY_ID}.check, not the relay's {RELAY_ID}: "
        "relay host/1/abc leads (lease valid until 2030-01-01), and its own id would fence it"
    )


def test_the_probe_reaches_the_cluster_as_the_relay_and_with_its_transaction_timeout() -> None:
    producer = FakeProducer()
    settings = _settings(**{"transaction.timeout.ms": "30000", "linger.ms": "50"})
    transactions(settings, NO_LEADER, producer)
    config = producer.config
    assert config["bootstrap.servers"] == "kafka:9092"
    assert config["sasl.password"] == SASL_PASSWORD  # the relay's principal, hence its ACLs
    assert config["transaction.timeout.ms"] == "30000"  # the broker may refuse it: probe it too
    # Nothing of the relay's publishing: a message timeout of 0 would not even build.
    assert "linger.ms" not in config
    assert "message.timeout.ms" not in config


@pytest.mark.parametrize(
    ("code", "wanted"),
    [
        (KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED, ACL_FIX),
        (KafkaError.CLUSTER_AUTHORIZATION_FAILED, ACL_FIX),
        (KafkaError.UNSUPPORTED_VERSION, BROKER_FIX),
        (KafkaError._UNSUPPORTED_FEATURE, BROKER_FIX),
    ],
)
def test_a_refusal_fails_naming_the_fix(code: int, wanted: str) -> None:
    detail = _fails(FakeProducer(KafkaError(code, "refused by the broker")), LEADER)
    assert detail.startswith(
        f"the broker refused init_transactions for {RELAY_ID}{PROBE_SUFFIX} ("
    ), detail
    assert "refused by the broker" in detail
    assert detail.endswith(f"): {wanted}")


def test_a_timeout_says_the_broker_did_not_answer() -> None:
    error = KafkaError(KafkaError._TIMED_OUT, "Timed out", retriable=True)
    detail = _fails(FakeProducer(error))
    assert detail.startswith(
        f"the broker did not answer init_transactions for {RELAY_ID} within "
        f"{TRANSACTIONS_TIMEOUT:g}s"
    ), detail
    assert "transaction.state.log.replication.factor=1" in detail


def test_a_transient_error_says_to_run_check_again() -> None:
    detail = _fails(FakeProducer(KafkaError(KafkaError.COORDINATOR_NOT_AVAILABLE, "moving")))
    assert detail.startswith(f"init_transactions for {RELAY_ID} failed (COORDINATOR_NOT_AVAILABLE")
    assert detail.endswith("the relay retries such an error: run check again")


def test_a_configuration_librdkafka_refuses_is_named_as_such() -> None:
    def refuse(_config: dict[str, Any]) -> FakeProducer:
        raise KafkaException(KafkaError(KafkaError._INVALID_ARG, "bad value"))

    with pytest.raises(Unmet) as info:
        transactions(_settings(), NO_LEADER, refuse)
    assert info.value.fix == "invalid Kafka client configuration: bad value"


def test_what_the_database_could_not_tell_fails_the_line_without_a_broker_call() -> None:
    producer = FakeProducer()
    with pytest.raises(Unmet) as info:
        transactions(_settings(), Unmet("cannot read the system identifier"), producer)
    assert info.value.fix == "cannot read the system identifier"
    assert producer.calls == []


@given(st.integers(min_value=-200, max_value=120).filter(lambda c: c != KafkaError._TIMED_OUT))
def test_any_error_fails_the_line_and_only_a_refusal_names_a_fix(code: int) -> None:
    detail = _fails(FakeProducer(KafkaError(code, "the broker's words")))
    assert "the broker's words" in detail
    refusal = fix(code)
    assert (refusal is not None) == detail.endswith(f"): {refusal}")
    assert (refusal is not None) == detail.startswith("the broker refused")
    assert ("run check again" in detail) == (outcome(code) is Outcome.RETRY)
    assert SASL_PASSWORD not in detail
