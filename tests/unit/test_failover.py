"""Unit tests for the pure parts of failover: the timeline history, the promoted-slot rule, the
setting."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from psycopg.conninfo import conninfo_to_dict

from cdc_relay.checkpoint import resolve_start
from cdc_relay.config import Settings, SlotFailover
from cdc_relay.database_url import parse, redact_url
from cdc_relay.errors import PositionMismatch
from cdc_relay.lsn import format_lsn, parse_lsn
from cdc_relay.replication.stream import replication_conninfo, switch_point

SLOT = "orders_slot"
RECORD = parse_lsn("0/3000100")
SLOT_AHEAD = parse_lsn("0/3000200")

HISTORY = (
    b"1\t0/3000A28\tno recovery target specified\n\n2\t0/5001F10\tno recovery target specified\n"
)


def test_switch_point_is_where_the_current_timeline_began() -> None:
    assert switch_point(HISTORY) == parse_lsn("0/5001F10")


def test_switch_point_since_a_timeline_is_where_that_timeline_ended() -> None:
    assert switch_point(HISTORY, since=1) == parse_lsn("0/3000A28")
    assert switch_point(HISTORY, since=2) == parse_lsn("0/5001F10")
    # A timeline the file does not name: the earliest switch, the conservative answer.
    assert switch_point(HISTORY, since=7) == parse_lsn("0/3000A28")


def test_switch_point_reads_bytea_hex_text_and_pg18_padding() -> None:
    assert switch_point(b"\\x" + HISTORY.hex().encode()) == parse_lsn("0/5001F10")
    assert switch_point(b"1\t0/03000A28\treason\n") == parse_lsn("0/3000A28")


@pytest.mark.parametrize("content", [b"", b"# comment only\n", b"\\xzz", b"garbage\tline\n"])
def test_switch_point_of_nothing_usable_is_none(content: bytes) -> None:
    assert switch_point(content) is None


lsns = st.integers(min_value=0, max_value=(1 << 64) - 1)
timelines = st.lists(st.tuples(st.integers(1, 1000), lsns), min_size=1, max_size=8)


@given(timelines, st.booleans())
def test_switch_point_round_trips_any_history(lines: list[tuple[int, int]], hexed: bool) -> None:
    text = "".join(f"{tli}\t{format_lsn(lsn)}\treason {i}\n" for i, (tli, lsn) in enumerate(lines))
    content = text.encode()
    if hexed:
        content = b"\\x" + content.hex().encode()
    assert switch_point(content) == lines[-1][1]


@given(st.binary(max_size=300))
def test_switch_point_never_fails_on_hostile_content(content: bytes) -> None:
    result = switch_point(content)
    assert result is None or 0 <= result < 1 << 64


def test_a_promoted_slot_ahead_of_the_record_starts_at_the_slot() -> None:
    note = "synchronised from the former primary"
    assert resolve_start(SLOT, SLOT_AHEAD, RECORD, False, note) == (SLOT_AHEAD, note)


def test_without_the_promotion_a_slot_ahead_still_refuses() -> None:
    with pytest.raises(PositionMismatch):
        resolve_start(SLOT, SLOT_AHEAD, RECORD, False, None)


def test_the_promotion_note_changes_nothing_when_the_slot_is_not_ahead() -> None:
    assert resolve_start(SLOT, RECORD, SLOT_AHEAD, False, "note") == (SLOT_AHEAD, None)
    assert resolve_start(SLOT, RECORD, RECORD, False, "note") == (RECORD, None)


@pytest.mark.parametrize("value", ["auto", "true", "false"])
def test_slot_failover_setting(value: str) -> None:
    settings = Settings.model_validate(
        {
            "database_url": "postgresql://relay@a:5432,b:5432/app?target_session_attrs=read-write",
            "kafka_bootstrap_servers": "k:9092",
            "slot_failover": value,
        }
    )
    assert settings.slot_failover is SlotFailover(value)


def test_slot_failover_defaults_to_auto() -> None:
    assert Settings.model_fields["slot_failover"].default is SlotFailover.AUTO


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://relay:s3cret@db-a:5432,db-b:5433/app?target_session_attrs=read-write",
        "host=db-a,db-b port=5432,5433 dbname=app user=relay password=s3cret "
        "target_session_attrs=read-write",
    ],
)
def test_a_multi_host_url_keeps_its_hosts_everywhere(url: str) -> None:
    """Validation accepts it, the shown form keeps every host and hides the password, and the
    replication connection asks the same hosts for the writable one."""
    assert parse(url)["host"] == "db-a,db-b"
    shown = redact_url(url)
    assert "host=db-a,db-b port=5432,5433" in shown
    assert "target_session_attrs=read-write" in shown
    assert "s3cret" not in shown
    replication = conninfo_to_dict(replication_conninfo(url))
    assert replication["host"] == "db-a,db-b"
    assert replication["port"] == "5432,5433"
    assert replication["target_session_attrs"] == "read-write"
    assert replication["replication"] == "database"
