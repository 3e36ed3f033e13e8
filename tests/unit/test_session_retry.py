"""A relay that lost its leadership while it waited to retry a session starts no new one.

Seen in an operator's chaos trial: after a PostgreSQL restart the leader's session failed, its
lock connection died during the retry wait (so the standby could take the lock), and the old
leader still ran START_REPLICATION once more — the lease row still named it — and both relays read
Kafka back at once. The loop now asks the leadership before every session, and the walsender's pid
is written into the lease only while the lease is valid by the local clock.
"""

from __future__ import annotations

import pytest

from cdc_relay.config import Settings
from cdc_relay.errors import LeadershipLost, SourceUnavailable
from cdc_relay.leadership import Leadership
from cdc_relay.relay import Relay


def _settings() -> Settings:
    return Settings.model_validate(
        {
            "database_url": "postgresql://relay@127.0.0.1:1/app",
            "kafka_bootstrap_servers": "127.0.0.1:1",
            "reconnect_max_backoff": 0.01,
        }
    )


def test_no_new_session_once_the_leadership_was_lost_during_the_retry_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    relay = Relay(_settings())
    sessions = 0
    leading = True

    def session() -> None:
        nonlocal sessions
        sessions += 1
        raise SourceUnavailable("the server closed the connection")

    def retry_wait(timeout: float) -> bool:
        nonlocal leading
        leading = False  # the lock connection dies while the relay waits to retry
        return False

    monkeypatch.setattr(relay, "_session", session)
    monkeypatch.setattr(relay._stop, "wait", retry_wait)
    monkeypatch.setattr(Leadership, "leading", property(lambda self: leading))
    with pytest.raises(LeadershipLost):
        relay._run_sessions()
    assert sessions == 1


def test_a_session_that_fails_while_still_leading_is_retried(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    relay = Relay(_settings())
    sessions = 0

    def session() -> None:
        nonlocal sessions
        sessions += 1
        if sessions < 3:
            raise SourceUnavailable("the server closed the connection")
        relay.stopping = True  # the third one ends cleanly

    monkeypatch.setattr(relay, "_session", session)
    monkeypatch.setattr(Leadership, "leading", property(lambda self: True))
    relay._run_sessions()
    assert sessions == 3


def test_the_walsender_is_not_recorded_once_the_lease_ran_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    leadership = Leadership(_settings())
    monkeypatch.setattr(Leadership, "leading", property(lambda self: False))
    with pytest.raises(LeadershipLost):
        leadership.record_stream(None, 4242)  # type: ignore[arg-type]  # never reached
