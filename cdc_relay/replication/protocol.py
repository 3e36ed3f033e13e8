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

from cdc_relay.errors import ProtocolError

POSTGRES_EPOCH_UNIX = 946_684_800  # 2000-01-01T00:00:00Z in Unix seconds

XLOG_DATA = 0x77  # 'w'
PRIMARY_KEEPALIVE = 0x6B  # 'k'

# Header of XLogData: data start, WAL end, send time. The plugin message follows it.
XLOG_DATA_HEADER = struct.Struct(">QQq")
XLOG_DATA_PAYLOAD_OFFSET = 1 + XLOG_DATA_HEADER.size
_KEEPALIVE = struct.Struct(">QqB")
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
    """Frame one CopyData payload received during START_REPLICATION."""
    view = memoryview(buf)
    if not view:
        raise ProtocolError("empty CopyData message from the server")
    kind = view[0]
    try:
        if kind == XLOG_DATA:
            start, end, sent = XLOG_DATA_HEADER.unpack_from(view, 1)
            return XLogData(start, end, sent, view[XLOG_DATA_PAYLOAD_OFFSET:])
        if kind == PRIMARY_KEEPALIVE:
            end, sent, reply = _KEEPALIVE.unpack_from(view, 1)
            return PrimaryKeepalive(end, sent, bool(reply))
    except struct.error:
        raise ProtocolError(f"truncated replication message {chr(kind)!r}") from None
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
