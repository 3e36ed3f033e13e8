"""CopyBoth framing of the streaming replication protocol, with no I/O.

Inside ``START_REPLICATION`` every CopyData payload the server sends is either XLogData (``w``),
carrying one output-plugin message, or a primary keepalive (``k``). The client answers with standby
status updates (``r``) whose *flush* position becomes the slot's ``confirmed_flush_lsn``.
Timestamps on this protocol are microseconds since 2000-01-01 UTC.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass
from typing import Final

from cdc_relay.errors import ProtocolError

POSTGRES_EPOCH_UNIX = 946_684_800  # 2000-01-01T00:00:00Z in Unix seconds

XLOG_DATA = 0x77  # 'w'
PRIMARY_KEEPALIVE = 0x6B  # 'k'

# The one statement of both messages' layout, as positions in the CopyData payload. The relay's
# loop reads a field in place with them (``int.from_bytes(data[XLOG_WAL_END], "big")``): no struct,
# no object per message. Unsigned LSNs and signed timestamps, all big-endian Int64.
# XLogData: data start, WAL end, send time, then one output-plugin message.
XLOG_DATA_START: Final = slice(1, 9)
XLOG_WAL_END: Final = slice(9, 17)
XLOG_SEND_TIME: Final = slice(17, 25)
XLOG_DATA_PAYLOAD_OFFSET: Final = 25
XLOG_PAYLOAD: Final = slice(XLOG_DATA_PAYLOAD_OFFSET, None)
# Primary keepalive: WAL end, send time, then one byte, 1 if the server wants a reply now.
KEEPALIVE_WAL_END: Final = slice(1, 9)
KEEPALIVE_SEND_TIME: Final = slice(9, 17)
KEEPALIVE_REPLY_REQUESTED: Final = 17
KEEPALIVE_SIZE: Final = KEEPALIVE_REPLY_REQUESTED + 1
_STATUS_UPDATE = struct.Struct(">cQQQqB")


@dataclass(frozen=True, slots=True)
class XLogData:
    data_start: int
    wal_end: int
    send_time: int
    payload: memoryview


@dataclass(frozen=True, slots=True)
class PrimaryKeepalive:
    wal_end: int
    send_time: int
    reply_requested: bool


def parse_copy_data(buf: memoryview | bytes) -> XLogData | PrimaryKeepalive:
    """Frame one CopyData payload received during START_REPLICATION, checking its length.

    For readers off the hot path (the fixture capture, tests). The relay's loop indexes the
    constants above in place instead, so this reads through exactly the same positions.
    """
    view = memoryview(buf)
    if not view:
        raise ProtocolError("empty CopyData message from the server")
    kind = view[0]
    if kind == XLOG_DATA:
        if len(view) < XLOG_DATA_PAYLOAD_OFFSET:
            raise ProtocolError("truncated replication message 'w'")
        return XLogData(
            int.from_bytes(view[XLOG_DATA_START], "big"),
            int.from_bytes(view[XLOG_WAL_END], "big"),
            int.from_bytes(view[XLOG_SEND_TIME], "big", signed=True),
            view[XLOG_PAYLOAD],
        )
    if kind == PRIMARY_KEEPALIVE:
        if len(view) < KEEPALIVE_SIZE:
            raise ProtocolError("truncated replication message 'k'")
        return PrimaryKeepalive(
            int.from_bytes(view[KEEPALIVE_WAL_END], "big"),
            int.from_bytes(view[KEEPALIVE_SEND_TIME], "big", signed=True),
            bool(view[KEEPALIVE_REPLY_REQUESTED]),
        )
    raise ProtocolError(f"unknown replication message type {kind:#04x}")


def standby_status_update(
    written: int, flushed: int, applied: int, now: int | None = None, reply: bool = False
) -> bytes:
    """The ``r`` message. ``flushed`` is what the slot may forget up to."""
    return _STATUS_UPDATE.pack(
        b"r", written, flushed, applied, now if now is not None else postgres_now(), int(reply)
    )


def postgres_now() -> int:
    return int((time.time() - POSTGRES_EPOCH_UNIX) * 1_000_000)


def postgres_time_to_unix(value: int) -> float:
    return value / 1_000_000 + POSTGRES_EPOCH_UNIX
