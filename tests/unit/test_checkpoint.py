"""Unit tests for the pure rules of cdc_relay.checkpoint: slot position vs the relay's record."""

from __future__ import annotations

import pytest

from cdc_relay.checkpoint import check_missing_slot, resolve_start
from cdc_relay.errors import PositionMismatch, SourceError
from cdc_relay.lsn import parse_lsn

SLOT = "orders_slot"
LOW = parse_lsn("1/A0")
HIGH = parse_lsn("2/B0")


# -- resolve_start --------------------------------------------------------------------------------


@pytest.mark.parametrize("allow_reset", [False, True])
def test_first_run_starts_at_the_slot(allow_reset: bool) -> None:
    assert resolve_start(SLOT, LOW, None, allow_reset) == (LOW, None)


@pytest.mark.parametrize("allow_reset", [False, True])
def test_slot_equal_to_record(allow_reset: bool) -> None:
    assert resolve_start(SLOT, HIGH, HIGH, allow_reset) == (HIGH, None)


@pytest.mark.parametrize("allow_reset", [False, True])
def test_slot_behind_record_starts_at_the_record(allow_reset: bool) -> None:
    # A crash between recording and confirming: Kafka already has everything up to the record.
    assert resolve_start(SLOT, LOW, HIGH, allow_reset) == (HIGH, None)


def test_slot_at_zero_with_record() -> None:
    assert resolve_start(SLOT, 0, LOW, False) == (LOW, None)


def test_slot_ahead_of_record_refuses_to_start() -> None:
    with pytest.raises(PositionMismatch) as info:
        resolve_start(SLOT, HIGH, LOW, False)
    message = str(info.value)
    assert "CDC_RELAY_ALLOW_SLOT_RESET" in message
    assert "--allow-slot-reset" in message
    assert repr(SLOT) in message
    assert "2/B0" in message  # the slot's position
    assert "1/A0" in message  # the record
    assert "Refusing to start" in message
    assert info.value.exit_code == 4
    assert isinstance(info.value, SourceError)


def test_slot_one_byte_ahead_is_still_refused() -> None:
    with pytest.raises(PositionMismatch, match="CDC_RELAY_ALLOW_SLOT_RESET"):
        resolve_start(SLOT, LOW + 1, LOW, False)


def test_slot_ahead_with_override_starts_at_the_slot_with_a_warning() -> None:
    start, warning = resolve_start(SLOT, HIGH, LOW, True)
    assert start == HIGH
    assert warning is not None
    assert repr(SLOT) in warning
    assert "2/B0" in warning
    assert "1/A0" in warning
    assert "starting anyway" in warning


# -- check_missing_slot ---------------------------------------------------------------------------


@pytest.mark.parametrize("allow_reset", [False, True])
def test_missing_slot_on_first_run_is_fine(allow_reset: bool) -> None:
    assert check_missing_slot(SLOT, None, allow_reset) is None


def test_missing_slot_with_a_record_refuses_to_start() -> None:
    with pytest.raises(PositionMismatch) as info:
        check_missing_slot(SLOT, HIGH, False)
    message = str(info.value)
    assert "CDC_RELAY_ALLOW_SLOT_RESET" in message
    assert "--allow-slot-reset" in message
    assert repr(SLOT) in message
    assert "missing" in message
    assert "2/B0" in message
    assert "the relay refuses to start" in message
    assert "No new slot is created" in message  # read by setup and check as well
    assert "run `cdc-relay recover`" in message
    assert "CDC_RELAY_ON_SLOT_LOSS=recover" in message
    assert info.value.exit_code == 4


def test_missing_slot_with_a_zero_record_still_refuses() -> None:
    # A record of 0/0 is still a record: the relay has run before.
    with pytest.raises(PositionMismatch, match="0/0"):
        check_missing_slot(SLOT, 0, False)


def test_missing_slot_with_override_returns_a_warning() -> None:
    warning = check_missing_slot(SLOT, HIGH, True)
    assert warning is not None
    assert repr(SLOT) in warning
    assert "missing" in warning
    assert "2/B0" in warning
    assert "starting anyway" in warning
