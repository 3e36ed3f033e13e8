"""Every transactional error lands in exactly one outcome, and each refusal names its fix."""

from __future__ import annotations

from confluent_kafka import KafkaError
from hypothesis import given
from hypothesis import strategies as st

from cdc_relay.errors import ConfigError, LeadershipLost, SinkUnavailable
from cdc_relay.transaction_errors import (
    ACL_FIX,
    BROKER_FIX,
    Outcome,
    fix,
    outcome,
    resumable,
    transaction_failure,
)


def test_a_missing_acl_and_a_broker_without_transactions_refuse_with_their_fix() -> None:
    assert outcome(KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED) is Outcome.REFUSE
    assert fix(KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED) == ACL_FIX
    assert outcome(KafkaError.UNSUPPORTED_VERSION) is Outcome.REFUSE
    assert fix(KafkaError.UNSUPPORTED_VERSION) == BROKER_FIX


def test_fencing_means_standing_by_and_a_moving_coordinator_a_retry() -> None:
    for code in (KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH):
        assert outcome(code) is Outcome.FENCED
    for code in (
        KafkaError.COORDINATOR_NOT_AVAILABLE,
        KafkaError._TIMED_OUT,
        KafkaError._TRANSPORT,
    ):
        assert outcome(code) is Outcome.RETRY


@given(st.integers(min_value=-300, max_value=200))
def test_any_code_has_one_outcome_and_only_refusals_have_a_fix(code: int) -> None:
    assert (fix(code) is not None) == (outcome(code) is Outcome.REFUSE)


def test_a_failure_becomes_the_relays_error_refusals_naming_the_fix() -> None:
    refused = transaction_failure(
        KafkaError(KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED), "init_transactions"
    )
    assert isinstance(refused, ConfigError)
    assert refused.exit_code == 2
    assert ACL_FIX in str(refused)
    fenced = transaction_failure(KafkaError(KafkaError.PRODUCER_FENCED), "committing")
    assert isinstance(fenced, LeadershipLost)
    timed_out = transaction_failure(KafkaError(KafkaError._TIMED_OUT), "committing")
    assert type(timed_out) is SinkUnavailable


def test_only_a_retriable_timeout_is_resumed() -> None:
    assert resumable(KafkaError(KafkaError._TIMED_OUT, retriable=True))
    assert not resumable(KafkaError(KafkaError._TIMED_OUT, txn_requires_abort=True))
    assert not resumable(KafkaError(KafkaError.PRODUCER_FENCED, retriable=True))
