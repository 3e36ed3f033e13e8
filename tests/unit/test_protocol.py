"""Unit tests for cdc_relay.replication.protocol (CopyBoth framing) and cdc_relay.lsn."""

from __future__ import annotations

import struct
import time
from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cdc_relay.errors import ProtocolError, SourceError
from cdc_relay.lsn import format_lsn, parse_lsn
from cdc_relay.replication.protocol import (
    KEEPALIVE_REPLY_REQUESTED,
    KEEPALIVE_WAL_END,
    POSTGRES_EPOCH_UNIX,
    PRIMARY_KEEPALIVE,
    XLOG_DATA,
    XLOG_DATA_PAYLOAD_OFFSET,
    XLOG_DATA_START,
    XLOG_PAYLOAD,
    XLOG_WAL_END,
    PrimaryKeepalive,
    XLogData,
    parse_copy_data,
    postgres_now,
    postgres_time_to_unix,
    standby_status_update,
)

MAX_LSN = (1 << 64) - 1
lsns = st.integers(0, MAX_LSN)
times = st.integers(-(1 << 63), (1 << 63) - 1)


def xlog_data(start: int, end: int, sent: int, payload: bytes) -> bytes:
    return (
        b"w"
        + start.to_bytes(8, "big")
        + end.to_bytes(8, "big")
        + sent.to_bytes(8, "big", signed=True)
        + payload
    )


def keepalive(end: int, sent: int, reply: int) -> bytes:
    return b"k" + end.to_bytes(8, "big") + sent.to_bytes(8, "big", signed=True) + bytes([reply])


# -- framing --------------------------------------------------------------------------------------


def test_constants() -> None:
    assert ord("w") == XLOG_DATA
    assert ord("k") == PRIMARY_KEEPALIVE
    assert XLOG_DATA_PAYLOAD_OFFSET == 25
    assert datetime.fromtimestamp(POSTGRES_EPOCH_UNIX, UTC) == datetime(2000, 1, 1, tzinfo=UTC)


def test_xlog_data() -> None:
    payload = b"B\x00\x00\x00\x00\x01\x02\x03\x04"
    message = parse_copy_data(xlog_data(0x16_B374D848, 0x16_B374D900, 774_000_000_123, payload))
    assert isinstance(message, XLogData)
    assert message.data_start == 0x16_B374D848
    assert message.wal_end == 0x16_B374D900
    assert message.send_time == 774_000_000_123
    assert isinstance(message.payload, memoryview)
    assert bytes(message.payload) == payload


@pytest.mark.parametrize("as_view", [False, True])
def test_xlog_data_from_bytes_or_memoryview(as_view: bool) -> None:
    raw = xlog_data(1, 2, 3, b"payload")
    message = parse_copy_data(memoryview(raw) if as_view else raw)
    assert isinstance(message, XLogData)
    assert (message.data_start, message.wal_end, message.send_time) == (1, 2, 3)
    assert message.payload.tobytes() == b"payload"


def test_xlog_data_edge_values() -> None:
    message = parse_copy_data(xlog_data(0, MAX_LSN, -1, b""))
    assert isinstance(message, XLogData)
    assert message.data_start == 0
    assert message.wal_end == MAX_LSN
    assert message.send_time == -1  # signed: before 2000-01-01
    assert bytes(message.payload) == b""


def test_xlog_data_payload_is_a_view_of_the_buffer() -> None:
    raw = bytearray(xlog_data(1, 2, 3, b"abc"))
    message = parse_copy_data(memoryview(raw))
    assert isinstance(message, XLogData)
    raw[-1] = ord("z")
    assert bytes(message.payload) == b"abz"  # no copy was made


@pytest.mark.parametrize(("reply", "expected"), [(0, False), (1, True)])
def test_keepalive(reply: int, expected: bool) -> None:
    message = parse_copy_data(keepalive(0x1_00000010, 774_000_000_000, reply))
    assert message == PrimaryKeepalive(0x1_00000010, 774_000_000_000, expected)


def test_keepalive_edge_values() -> None:
    message = parse_copy_data(keepalive(MAX_LSN, -(1 << 63), 1))
    assert message == PrimaryKeepalive(MAX_LSN, -(1 << 63), True)


def test_keepalive_trailing_bytes_are_ignored() -> None:
    message = parse_copy_data(keepalive(5, 6, 0) + b"\x00\xff")
    assert message == PrimaryKeepalive(5, 6, False)


# The relay's loop and the decoders read fields in place through the exported positions; the
# parser reads through the same ones. Both must agree with frames built from the documented layout.
@given(lsns, lsns, times, st.binary(max_size=40))
def test_in_place_xlog_data_reads_agree_with_the_parser(
    start: int, end: int, sent: int, payload: bytes
) -> None:
    raw = xlog_data(start, end, sent, payload)
    message = parse_copy_data(raw)
    assert message == XLogData(start, end, sent, memoryview(payload))
    assert int.from_bytes(raw[XLOG_DATA_START], "big") == start
    assert int.from_bytes(raw[XLOG_WAL_END], "big") == end
    assert raw[XLOG_PAYLOAD] == payload == raw[XLOG_DATA_PAYLOAD_OFFSET:]


@given(lsns, times, st.sampled_from([0, 1]), st.binary(max_size=4))
def test_in_place_keepalive_reads_agree_with_the_parser(
    end: int, sent: int, reply: int, trailing: bytes
) -> None:
    raw = keepalive(end, sent, reply) + trailing
    assert parse_copy_data(raw) == PrimaryKeepalive(end, sent, bool(reply))
    assert int.from_bytes(raw[KEEPALIVE_WAL_END], "big") == end
    assert raw[KEEPALIVE_REPLY_REQUESTED] == reply


def test_empty_message() -> None:
    with pytest.raises(ProtocolError, match="empty"):
        parse_copy_data(b"")


@pytest.mark.parametrize("length", range(1, 25))
def test_truncated_xlog_data(length: int) -> None:
    raw = xlog_data(1, 2, 3, b"")
    assert len(raw) == 25
    with pytest.raises(ProtocolError, match="truncated") as info:
        parse_copy_data(raw[:length])
    assert "'w'" in str(info.value)


@pytest.mark.parametrize("length", range(1, 18))
def test_truncated_keepalive(length: int) -> None:
    raw = keepalive(1, 2, 1)
    assert len(raw) == 18
    with pytest.raises(ProtocolError, match="truncated") as info:
        parse_copy_data(raw[:length])
    assert "'k'" in str(info.value)


@pytest.mark.parametrize("kind", [b"r", b"x", b"W", b"\x00", b"\xff"])
def test_unknown_message_type(kind: bytes) -> None:
    with pytest.raises(ProtocolError, match="unknown replication message type") as info:
        parse_copy_data(kind + bytes(24))
    assert f"{kind[0]:#04x}" in str(info.value)


def test_protocol_error_is_a_source_error_with_its_exit_code() -> None:
    with pytest.raises(ProtocolError) as info:
        parse_copy_data(b"?")
    assert isinstance(info.value, SourceError)
    assert info.value.exit_code == 6


# -- standby status update ------------------------------------------------------------------------


def test_standby_status_update_layout() -> None:
    message = standby_status_update(
        0x0102030405060708,
        0x1112131415161718,
        0x2122232425262728,
        now=0x3132333435363738,
        reply=True,
    )
    assert message == (
        b"r"
        + bytes.fromhex("0102030405060708")
        + bytes.fromhex("1112131415161718")
        + bytes.fromhex("2122232425262728")
        + bytes.fromhex("3132333435363738")
        + b"\x01"
    )
    assert len(message) == 34


def test_standby_status_update_no_reply_and_edge_values() -> None:
    message = standby_status_update(MAX_LSN, 0, 1, now=-1)
    assert message == b"r" + b"\xff" * 8 + bytes(8) + (1).to_bytes(8, "big") + b"\xff" * 8 + b"\x00"


def test_standby_status_update_defaults_to_the_current_clock() -> None:
    before = postgres_now()
    message = standby_status_update(10, 10, 10)
    after = postgres_now()
    kind, written, flushed, applied, clock, reply = struct.unpack(">cQQQqB", message)
    assert (kind, written, flushed, applied, reply) == (b"r", 10, 10, 10, 0)
    assert before <= clock <= after


def test_standby_status_update_now_zero_is_used_as_given() -> None:
    assert standby_status_update(1, 2, 3, now=0)[25:33] == bytes(8)


def test_standby_status_update_rejects_out_of_range_lsn() -> None:
    with pytest.raises(struct.error):
        standby_status_update(1 << 64, 0, 0, now=0)


# -- clock ----------------------------------------------------------------------------------------


def test_postgres_clock_conversions() -> None:
    assert postgres_time_to_unix(0) == POSTGRES_EPOCH_UNIX
    assert postgres_time_to_unix(1_500_000) == POSTGRES_EPOCH_UNIX + 1.5
    now = postgres_now()
    assert abs(postgres_time_to_unix(now) - time.time()) < 5
    assert now > 700_000_000 * 1_000_000  # well after 2022 in PostgreSQL microseconds


# -- LSN text -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("0/0", 0),
        ("0/1", 1),
        ("16/B374D848", 0x16_B374D848),
        ("16/b374d848", 0x16_B374D848),
        ("0/FFFFFFFF", 0xFFFFFFFF),
        ("1/0", 1 << 32),
        ("FFFFFFFF/FFFFFFFF", MAX_LSN),
        ("00000000/00000001", 1),
        (" 1/2 ", (1 << 32) | 2),
        ("1/2\n", (1 << 32) | 2),
    ],
)
def test_parse_lsn(text: str, value: int) -> None:
    assert parse_lsn(text) == value


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0, "0/0"),
        (1, "0/1"),
        (0x16_B374D848, "16/B374D848"),
        (0xFFFFFFFF, "0/FFFFFFFF"),
        (1 << 32, "1/0"),
        ((1 << 32) | 0xA, "1/A"),
        (MAX_LSN, "FFFFFFFF/FFFFFFFF"),
    ],
)
def test_format_lsn(value: int, text: str) -> None:
    assert format_lsn(value) == text


@pytest.mark.parametrize(
    "value", [0, 1, 0xFFFFFFFF, 1 << 32, 0x16_B374D848, 0xDEADBEEF_00C0FFEE, MAX_LSN - 1, MAX_LSN]
)
def test_lsn_round_trip(value: int) -> None:
    assert parse_lsn(format_lsn(value)) == value


@pytest.mark.parametrize("text", ["0/0", "16/B374D848", "FFFFFFFF/FFFFFFFF", "1/A"])
def test_lsn_text_round_trip(text: str) -> None:
    assert format_lsn(parse_lsn(text)) == text


@pytest.mark.parametrize(
    "text",
    [
        "",
        "/",
        "0",
        "16B374D848",
        "1/",
        "/1",
        "1/2/3",
        "G/0",
        "0/G",
        "123456789/0",
        "0/123456789",
        "-1/0",
        "+1/0",
        "0x1/0",
        "1 /2",
        "1/ 2",
        "1.0/2",
    ],
)
def test_parse_lsn_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="not an LSN"):
        parse_lsn(text)


@pytest.mark.parametrize("value", [-1, 1 << 64, -(1 << 63)])
def test_format_lsn_rejects_out_of_range(value: int) -> None:
    with pytest.raises(ValueError, match="out of range"):
        format_lsn(value)
