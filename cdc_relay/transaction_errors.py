"""What a Kafka transactional call's error means to the relay: the one table.

``init_transactions`` (the fence at a leadership's start, and ``check``), ``commit_transaction``
and the producer's fatal errors end in one of three outcomes: refuse to start and name the fix
(the broker or the principal cannot do transactions: exit 2), stand by (another producer of the
slot fenced this one), or retry (the coordinator is moving or the broker is unreachable).
A call that timed out may be called again (librdkafka resumes it); a transaction librdkafka
calls abortable is not committed (:class:`TransactionAborted`): the session ends, and what it held
is sent again. A commit that failed otherwise — timed out for good, the broker unreachable — may
have committed: :mod:`cdc_relay.kafka_transaction` leaves its outcome to be settled.
:func:`transaction_failure` turns one error into the relay's own (:mod:`cdc_relay.errors`).
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from confluent_kafka import KafkaError

from cdc_relay.errors import ConfigError, LeadershipLost, RelayError, SinkUnavailable

ACL_FIX = (
    "grant the relay's principal WRITE and DESCRIBE on TransactionalId with the PREFIXED pattern "
    "'cdc-relay.' (and IDEMPOTENT_WRITE on the cluster for brokers before 3.0): README, "
    "Exactly once"
)
BROKER_FIX = (
    "the broker must allow transactions (Kafka 0.11+; a one-node cluster needs "
    "transaction.state.log.replication.factor=1 and transaction.state.log.min.isr=1), or set "
    "CDC_RELAY_EXACTLY_ONCE=false: README, Exactly once"
)
TIMEOUT_FIX = (
    "transaction.timeout.ms is above the broker's transaction.max.timeout.ms: lower it in the "
    "Kafka producer properties"
)


class TransactionAborted(SinkUnavailable):
    """The Kafka transaction did not commit and cannot (librdkafka: it must be aborted): what it
    held is sent again, its outcome known."""


class Outcome(Enum):
    REFUSE = "refuse"  # the setup cannot work: exit 2 with the fix
    FENCED = "fenced"  # a newer producer of the slot took over: stand by
    RETRY = "retry"  # transient: the session is rebuilt


_REFUSALS: dict[int, str] = {
    KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED: ACL_FIX,
    KafkaError.CLUSTER_AUTHORIZATION_FAILED: ACL_FIX,
    KafkaError.UNSUPPORTED_VERSION: BROKER_FIX,
    KafkaError._UNSUPPORTED_FEATURE: BROKER_FIX,
    KafkaError.INVALID_TRANSACTION_TIMEOUT: TIMEOUT_FIX,
}
_FENCED = frozenset(
    {KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH}
)


def outcome(code: int) -> Outcome:
    """What an error code of a transactional call means."""
    if code in _REFUSALS:
        return Outcome.REFUSE
    if code in _FENCED:
        return Outcome.FENCED
    return Outcome.RETRY


def fix(code: int) -> str | None:
    """The operator's fix for a refusal, or None when the error is not one."""
    return _REFUSALS.get(code)


def resumable(error: Any) -> bool:
    """A call that timed out and may be called again to resume it (librdkafka's retriable)."""
    return bool(error.retriable()) and outcome(error.code()) is Outcome.RETRY


def transaction_failure(error: Any, doing: str) -> RelayError:
    """The relay's error for librdkafka's ``error`` (a KafkaError) while ``doing`` something:
    ConfigError (exit 2) naming the fix, LeadershipLost (stand by), else SinkUnavailable (the
    session ends, the producer is rebuilt, the uncommitted part is sent again) —
    TransactionAborted when librdkafka says the transaction must be aborted."""
    code = int(error.code())
    found = outcome(code)
    if found is Outcome.REFUSE:
        return ConfigError(f"Kafka refused {doing}: {error.str()}; {fix(code)}")
    if found is Outcome.FENCED:
        return LeadershipLost(f"fenced while {doing}: another producer of the slot took over")
    if error.txn_requires_abort():
        return TransactionAborted(f"{doing} failed: {error.str()}")
    return SinkUnavailable(f"{doing} failed: {error.str()}")
