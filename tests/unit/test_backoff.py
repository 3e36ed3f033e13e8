"""Unit tests for cdc_relay.backoff: the delays the relay and the sweeper wait between retries."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from cdc_relay.backoff import Backoff


def test_doubles_from_the_first_delay_up_to_the_limit() -> None:
    backoff = Backoff(0.5, 5.0)
    assert [backoff.delay() for _ in range(7)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0]


def test_reset_starts_over_at_the_first_delay() -> None:
    backoff = Backoff(0.5, 30.0)
    backoff.delay()
    backoff.delay()
    backoff.reset()
    assert [backoff.delay() for _ in range(2)] == [0.5, 1.0]


def test_the_first_delay_is_kept_even_above_the_limit() -> None:
    # The relay starts at 0.5 s whatever CDC_RELAY_RECONNECT_MAX_BACKOFF says.
    backoff = Backoff(0.5, 0.1)
    assert [backoff.delay() for _ in range(3)] == [0.5, 0.1, 0.1]


@given(
    first=st.floats(min_value=0.001, max_value=100),
    limit=st.floats(min_value=0.001, max_value=1000),
    retries=st.integers(min_value=1, max_value=60),
)
def test_delays_never_shrink_below_the_limit_nor_exceed_it(
    first: float, limit: float, retries: int
) -> None:
    backoff = Backoff(first, limit)
    delays = [backoff.delay() for _ in range(retries)]
    assert delays[0] == first
    for before, after in itertools.pairwise(delays):
        assert after == min(before * 2, limit)
        assert after <= max(limit, first)
