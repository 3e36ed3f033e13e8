"""The libpq defaults every connection gets: derived from the lease, and never over the URL's."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from psycopg.conninfo import conninfo_to_dict

from cdc_relay.config import load_settings
from cdc_relay.connection_defaults import KEEPALIVES_COUNT, connection_defaults, source_url
from cdc_relay.database_url import UNPARSEABLE, redact_url, with_defaults
from cdc_relay.observability.stats import RelayStats

DEFAULT_KEYS = tuple(connection_defaults(15.0))


def _read(conninfo: str) -> dict[str, str]:
    return {k: str(v) for k, v in conninfo_to_dict(conninfo).items() if v is not None}


def test_the_default_lease_gives_a_dead_connection_about_seven_seconds() -> None:
    assert connection_defaults(15.0) == {
        "keepalives": "1",
        "keepalives_idle": "3",
        "keepalives_interval": "1",
        "keepalives_count": "3",
        "tcp_user_timeout": "7500",
        "connect_timeout": "10",
    }


@given(lease=st.floats(min_value=0.1, max_value=86_400.0))
@example(lease=8.0)  # the interval raised to one second: idle 2 + 3 x 1 exceeded the 4 s budget
def test_a_dead_connection_is_noticed_within_half_the_lease(lease: float) -> None:
    defaults = connection_defaults(lease)
    idle = int(defaults["keepalives_idle"])
    interval = int(defaults["keepalives_interval"])
    assert min(idle, interval) >= 1  # libpq: whole seconds; 0 would mean the system default
    # Unacknowledged data: half the lease (at least a second).
    assert int(defaults["tcp_user_timeout"]) == max(1000, round(lease * 500))
    # An idle connection: idle + count x interval, within half the lease where whole seconds
    # allow it (below that, the least libpq can ask for).
    assert idle + KEEPALIVES_COUNT * interval <= max(lease / 2, 1 + KEEPALIVES_COUNT)


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://relay:s3cret@db.example:5433/app?keepalives_idle=60&tcp_user_timeout=0"
        "&connect_timeout=3",
        "host=db.example port=5433 dbname=app user=relay password=s3cret keepalives_idle=60 "
        "tcp_user_timeout=0 connect_timeout=3",
    ],
)
def test_what_the_url_sets_wins(url: str) -> None:
    merged = _read(source_url(url, 4.0))
    assert merged["keepalives_idle"] == "60"
    assert merged["tcp_user_timeout"] == "0"  # the user's "the system's default", kept
    assert merged["connect_timeout"] == "3"
    assert merged["keepalives_interval"] == "1"  # the rest: the defaults
    assert merged["keepalives"] == "1"
    assert (merged["host"], merged["port"], merged["dbname"]) == ("db.example", "5433", "app")
    assert (merged["user"], merged["password"]) == ("relay", "s3cret")


_VALUES = st.integers(min_value=0, max_value=100_000).map(str)


@given(
    user_set=st.dictionaries(st.sampled_from(DEFAULT_KEYS), _VALUES),
    password=st.text(
        alphabet=st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"),
        min_size=1,
        max_size=20,
    ),
    as_uri=st.booleans(),
    lease=st.floats(min_value=0.5, max_value=600.0),
)
def test_merging_keeps_every_parameter_of_the_url(
    user_set: dict[str, str], password: str, as_uri: bool, lease: float
) -> None:
    password = f"secret-{password}"  # distinct from anything else in the string
    if as_uri:
        query = "&".join(f"{k}={v}" for k, v in user_set.items())
        url = f"postgresql://relay:{quote(password, safe='')}@db:5432/app" + (
            f"?{query}" if query else ""
        )
    else:
        escaped = password.replace("\\", "\\\\").replace("'", "\\'")
        pairs = " ".join(f"{k}={v}" for k, v in user_set.items())
        url = f"host=db port=5432 dbname=app user=relay password='{escaped}' {pairs}"
    original = _read(url)
    merged = _read(source_url(url, lease))
    defaults = connection_defaults(lease)
    assert merged == {**defaults, **original}  # the URL's own parameters win, all kept
    assert merged["password"] == password
    assert password not in redact_url(source_url(url, lease))


def test_an_unreadable_url_comes_back_unchanged_for_the_connection_to_report() -> None:
    broken = "host=db password='unterminated"
    assert with_defaults(broken, {"keepalives": "1"}) == broken
    assert redact_url(broken) == UNPARSEABLE


def test_settings_derive_the_defaults_from_their_lease(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)  # no stray .env file
    monkeypatch.setenv("CDC_RELAY_KAFKA_BOOTSTRAP_SERVERS", "kafka:9092")
    monkeypatch.setenv("CDC_RELAY_DATABASE_URL", "postgresql://relay:pw@db/app?keepalives_count=9")
    monkeypatch.setenv("CDC_RELAY_LEADER_LEASE_TIMEOUT", "30")
    settings = load_settings()
    merged = _read(settings.source_url())
    assert merged["tcp_user_timeout"] == "15000"
    assert merged["keepalives_count"] == "9"
    assert "tcp_user_timeout" not in settings.describe()["database_url"]  # logs: the user's URL


def test_a_leader_whose_lease_ran_out_says_standby_even_if_its_loop_is_stuck() -> None:
    valid = [True]
    stats = RelayStats(leader=True, lease_valid=lambda: valid[0])
    assert (stats.leading, stats.snapshot()["role"]) == (True, "leader")
    valid[0] = False
    assert (stats.leading, stats.snapshot()["role"]) == (False, "standby")
