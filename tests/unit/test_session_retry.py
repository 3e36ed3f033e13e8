"""The relay's lifecycle, driven through its seams (:class:`tests.fakes.FakeLeadership` and
:class:`tests.fakes.FakeStart`): sessions retried while it leads, none started once it does not.

A relay whose lock connection died while it waited to retry a session (e.g. a PostgreSQL
restart: the standby may hold the lock by then) must not start one more session — it would send
START_REPLICATION and read Kafka back beside the new leader. The loop asks the leadership before
every session, and the walsender's pid is written into the lease only while the lease is valid
by the local clock.
"""

from __future__ import annotations

import pytest

from cdc_relay.config import Settings
from cdc_relay.errors import LeadershipLost, SlotInUse, SourceUnavailable
from cdc_relay.leadership import Leadership
from cdc_relay.relay import Relay
from tests.fakes import FakeLeadership, FakeStart


def _settings() -> Settings:
    return Settings.model_validate(
        {
            "database_url": "postgresql://relay@127.0.0.1:1/app",
            "kafka_bootstrap_servers": "127.0.0.1:1",
            "reconnect_max_backoff": 0.01,
            "http_port": 0,
            "sweep_interval": 0,
        }
    )


def _lost() -> SourceUnavailable:
    return SourceUnavailable("the server closed the connection")


def test_no_new_session_once_the_leadership_was_lost_during_the_retry_wait() -> None:
    leadership = FakeLeadership()

    def failing_then_losing() -> SourceUnavailable:
        # Still leading when the session fails; the lock connection dies while the relay
        # waits to retry: lost at the look after the one that decides to retry.
        leadership.lose_after(1)
        return _lost()

    start = FakeStart([failing_then_losing])
    relay = Relay(_settings(), leadership=leadership, start=start)
    leadership.on_resign = relay.request_stop
    relay.run()
    assert start.sessions == 1
    assert leadership.resigned == 1  # it stood down: a standby again
    assert start.forgotten == 1  # and carries no position into the next leadership
    assert leadership.released == 1


def test_a_session_that_fails_while_still_leading_is_retried() -> None:
    leadership = FakeLeadership()
    relay = Relay(_settings(), leadership=leadership, start=(start := FakeStart([])))

    def stop_then_fail() -> SourceUnavailable:
        relay.request_stop()  # the third one ends cleanly
        return _lost()

    start.failures = [_lost(), _lost(), stop_then_fail]
    relay.run()
    assert start.sessions == 3
    assert leadership.resigned == 0


def test_a_slot_held_at_the_first_start_stops_the_relay() -> None:
    start = FakeStart([SlotInUse("replication slot is in use by pid 99")])
    relay = Relay(_settings(), leadership=FakeLeadership(), start=start)
    with pytest.raises(SlotInUse):
        relay.run()
    assert start.closed


def test_a_lease_lost_while_a_session_starts_makes_a_standby() -> None:
    leadership = FakeLeadership()
    start = FakeStart([LeadershipLost("another relay holds the leader lease: nothing noted")])
    relay = Relay(_settings(), leadership=leadership, start=start)
    leadership.on_resign = relay.request_stop
    relay.run()
    assert (start.sessions, leadership.resigned, start.forgotten) == (1, 1, 1)


def test_the_walsender_is_not_recorded_once_the_lease_ran_out() -> None:
    leadership = Leadership(_settings())  # never won: no lease by its own clock
    with pytest.raises(LeadershipLost):
        leadership.record_stream(None, 4242)  # type: ignore[arg-type]  # never reached
