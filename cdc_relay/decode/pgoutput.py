"""Decoder for PostgreSQL's ``pgoutput`` logical replication messages.

Why this module exists: the relay tails the WAL through a logical replication slot that uses the
built-in ``pgoutput`` plugin, which emits a compact binary protocol (the "Logical Replication
Message Formats" section of the PostgreSQL protocol documentation). psycopg hands us those
messages as raw bytes, and nothing else in our dependency set parses them. Keeping the parser
here, pure (bytes in, immutable message objects out, no I/O, no clock, no logging), means it can be
tested exhaustively against byte fixtures captured from a real server, benchmarked on its own,
and reused by every component that touches the replication stream.

Conventions (the messages' own are in :mod:`cdc_relay.decode.messages`):

* Column values: a text-format value (``'t'``) and a binary-format value (``'b'``) are both
  returned as ``bytes``; SQL NULL (``'n'``) is ``None``; an unchanged TOASTed value (``'u'``) is
  :data:`~cdc_relay.decode.messages.UNCHANGED_TOAST`.
* Fields are read in wire order, one handler per message type, dispatched on the first byte.
* Malformed input (unknown type byte, truncated buffer, bad tuple kind, invalid UTF-8) raises
  :class:`~cdc_relay.decode.messages.DecodeError`, never ``IndexError`` or ``struct.error``.
  Trailing bytes after the last known field are ignored, so that fields appended by newer
  protocol versions do not break us.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, Final, TypeAlias

from cdc_relay import c_extension
from cdc_relay.decode.messages import (
    UNCHANGED_TOAST,
    Begin,
    BeginPrepare,
    Commit,
    CommitPrepared,
    DecodeError,
    Delete,
    Insert,
    LogicalMessage,
    Message,
    Origin,
    Prepare,
    Relation,
    RelationColumn,
    RollbackPrepared,
    StreamAbort,
    StreamCommit,
    StreamPrepare,
    StreamStart,
    StreamStop,
    Truncate,
    TupleData,
    Type,
    Update,
    Value,
)
from cdc_relay.replication.protocol import XLOG_DATA_PAYLOAD_OFFSET

# The same readers in C where the extension is built; this module's are the reference and the
# fallback (cdc_relay.c_extension).
_read_row = c_extension.read_tuple
_read_message = c_extension.read_message
# Module-level Final names are C statics in the compiled build, other globals a dict lookup.
_READ_MESSAGE: Final = _read_message
_INSERT: Final = Insert
_BEGIN_TYPE: Final = Begin
_COMMIT_TYPE: Final = Commit
_UNCHANGED: Final = UNCHANGED_TOAST

__all__ = ["PgOutputDecoder"]


# --------------------------------------------------------------------------------------------
# Low-level readers. They raise _WireError(reason, offset); PgOutputDecoder.decode turns that
# into a DecodeError that also names the message type.
# --------------------------------------------------------------------------------------------


class _WireError(Exception):
    def __init__(self, reason: str, offset: int) -> None:
        super().__init__(reason, offset)
        self.reason = reason
        self.offset = offset


# Network byte order. LSNs and OIDs/xids are unsigned; timestamps, typmods and lengths signed.
_U8: Final = struct.Struct(">B")
_U16: Final = struct.Struct(">H")
_U32: Final = struct.Struct(">I")
_I32: Final = struct.Struct(">i")
_U64: Final = struct.Struct(">Q")
_U8_U32: Final = struct.Struct(">BI")  # a tuple column's kind and length
_U32_U8: Final = struct.Struct(">IB")  # Insert/Update/Delete head: relation id + tuple marker
_U32_U32: Final = struct.Struct(">II")
_U32_I32: Final = struct.Struct(">Ii")  # Relation column tail: type oid + type modifier
_U32_U32_U8: Final = struct.Struct(">IIB")  # streamed Insert head: xid, relation id, marker
_U64_I64: Final = struct.Struct(">Qq")
_BEGIN: Final = struct.Struct(">QqI")
_COMMIT: Final = struct.Struct(">BQQq")
_STREAM_START: Final = struct.Struct(">IB")
_STREAM_COMMIT: Final = struct.Struct(">IBQQq")
_BEGIN_PREPARE: Final = struct.Struct(">QQqI")
_PREPARE: Final = struct.Struct(">BQQqI")  # Prepare, Commit Prepared, Stream Prepare
_ROLLBACK_PREPARED: Final = struct.Struct(">BQQqqI")
_MESSAGE_HEAD: Final = struct.Struct(">BQ")

_TUPLE_NEW: Final = 0x4E  # 'N'
# A NamedTuple's constructor is a Python function; tuple.__new__ builds the very same object in C
# (~1,000 instructions less per message). Used for the messages of every transaction.
_new: Final = tuple.__new__
_TUPLE_KEY: Final = 0x4B  # 'K'
_TUPLE_OLD: Final = 0x4F  # 'O'


def _unpack(st: struct.Struct, buf: bytes, pos: int) -> tuple[Any, ...]:
    if pos + st.size > len(buf):
        raise _WireError(f"truncated: need {st.size} bytes, {max(len(buf) - pos, 0)} left", pos)
    return st.unpack_from(buf, pos)


def _read_xid(buf: bytes, pos: int, streamed: bool) -> tuple[int | None, int]:
    """Read the leading xid that proto v2+ puts on data messages inside a stream block."""
    if not streamed:
        return None, pos
    return _unpack(_U32, buf, pos)[0], pos + 4


def _read_string(buf: bytes, pos: int) -> tuple[str, int]:
    end = buf.find(b"\x00", pos)
    if end < 0:
        raise _WireError("unterminated string", pos)
    try:
        return buf[pos:end].decode("utf-8"), end + 1
    except UnicodeDecodeError as exc:
        raise _WireError(f"invalid UTF-8 in string ({exc.reason})", pos + exc.start) from None


def _read_tuple(buf: bytes, pos: int) -> tuple[TupleData, int]:
    """TupleData: Int16 column count, then per column a kind byte and, for 't'/'b', a value.

    In one C call where the extension is built, else :func:`_read_tuple_pure`; malformed input
    either way ends in :func:`_read_tuple_checked`, which names the error.
    """
    if _read_row is not None:
        found = _read_row(buf, pos, UNCHANGED_TOAST)
        return found if found is not None else _read_tuple_checked(buf, pos)
    return _read_tuple_pure(buf, pos)


def _read_tuple_pure(buf: bytes, pos: int) -> tuple[TupleData, int]:
    """The reference reader of a TupleData (the C one must return exactly what it returns).

    The hot path of the whole relay (every column of every row), so it checks bounds once, at
    the end: lengths are read unsigned, so a bad one can only overshoot the buffer, and any
    overrun raises or ends past it. Malformed input is walked again by the careful reader, which
    says exactly what is wrong and where. One struct call reads a column's kind and length
    together (a 'n' or 'u' column has no length: what follows it is read, and not used).
    """
    start_pos = pos
    try:
        (ncols,) = _U16.unpack_from(buf, pos)
        pos += 2
        values: list[Value] = []
        append = values.append
        unpack_head = _U8_U32.unpack_from
        for _ in range(ncols):
            try:
                kind, length = unpack_head(buf, pos)
            except struct.error:  # fewer than 5 bytes left: only a last 'n' or 'u' fits
                kind, length = buf[pos], 0
            # 't' text, 'b' binary: the bytes. Two compares cost less than a set lookup here.
            if kind == 0x74 or kind == 0x62:  # noqa: PLR1714
                start = pos + 5
                pos = start + length
                append(buf[start:pos])
            elif kind == 0x6E:  # 'n' NULL
                append(None)
                pos += 1
            elif kind == 0x75:  # 'u' unchanged TOASTed value, not sent
                append(UNCHANGED_TOAST)
                pos += 1
            else:
                break
        else:
            if pos <= len(buf):
                return tuple(values), pos
    except (IndexError, struct.error):
        pass
    return _read_tuple_checked(buf, start_pos)


# The fast reader's loop again, deliberately: checking every bound there would slow each row.
def _read_tuple_checked(buf: bytes, pos: int) -> tuple[TupleData, int]:
    """:func:`_read_tuple` with every bound checked: raises the precise error for bad input."""
    size = len(buf)
    if pos + 2 > size:
        raise _WireError("truncated tuple: missing column count", pos)
    (ncols,) = _U16.unpack_from(buf, pos)
    pos += 2
    values: list[Value] = []
    append = values.append
    unpack_length = _I32.unpack_from
    for _ in range(ncols):
        if pos >= size:
            raise _WireError(f"truncated tuple: missing column {len(values)}", pos)
        kind = buf[pos]
        if kind in (0x74, 0x62):  # 't' text, 'b' binary: Int32 length, then the bytes
            start = pos + 5
            if start > size:
                raise _WireError(f"truncated tuple: column {len(values)} length", pos + 1)
            (length,) = unpack_length(buf, pos + 1)
            pos = start + length
            if length < 0 or pos > size:
                raise _WireError(
                    f"truncated tuple: column {len(values)} value of {length} bytes, "
                    f"{size - start} left",
                    start,
                )
            append(buf[start:pos])
        elif kind == 0x6E:  # 'n' NULL
            append(None)
            pos += 1
        elif kind == 0x75:  # 'u' unchanged TOASTed value, not sent
            append(UNCHANGED_TOAST)
            pos += 1
        else:
            raise _WireError(f"bad tuple column kind {bytes([kind])!r}", pos)
    return tuple(values), pos


def _expect_new_tuple(buf: bytes, pos: int) -> tuple[TupleData, int]:
    if pos >= len(buf):
        raise _WireError("truncated: missing 'N' tuple marker", pos)
    if buf[pos] != _TUPLE_NEW:
        raise _WireError(f"expected 'N' tuple marker, got {buf[pos : pos + 1]!r}", pos)
    return _read_tuple(buf, pos + 1)


# --------------------------------------------------------------------------------------------
# One handler per message type. Each receives the whole message (type byte at offset 0) and
# whether we are inside a Stream Start/Stop block.
# --------------------------------------------------------------------------------------------


# Begin, Commit and Insert unpack first and ask _unpack (which names the shortfall) only on error.


def _decode_begin(buf: bytes, streamed: bool) -> Begin:
    try:
        return _new(Begin, _BEGIN.unpack_from(buf, 1))
    except struct.error:
        return Begin(*_unpack(_BEGIN, buf, 1))


def _decode_commit(buf: bytes, streamed: bool) -> Commit:
    try:
        return _new(Commit, _COMMIT.unpack_from(buf, 1))
    except struct.error:
        return Commit(*_unpack(_COMMIT, buf, 1))


def _decode_origin(buf: bytes, streamed: bool) -> Origin:
    (commit_lsn,) = _unpack(_U64, buf, 1)
    name, _ = _read_string(buf, 9)
    return Origin(commit_lsn, name)


def _decode_relation(buf: bytes, streamed: bool) -> Relation:
    xid, pos = _read_xid(buf, 1, streamed)
    (relation_id,) = _unpack(_U32, buf, pos)
    namespace, pos = _read_string(buf, pos + 4)
    name, pos = _read_string(buf, pos)
    (replica_identity,) = _unpack(_U8, buf, pos)
    (ncols,) = _unpack(_U16, buf, pos + 1)
    pos += 3
    columns = []
    for _ in range(ncols):
        (flags,) = _unpack(_U8, buf, pos)
        col_name, pos = _read_string(buf, pos + 1)
        type_oid, type_modifier = _unpack(_U32_I32, buf, pos)
        pos += 8
        columns.append(RelationColumn(flags, col_name, type_oid, type_modifier))
    return Relation(relation_id, namespace, name, chr(replica_identity), tuple(columns), xid)


def _decode_type(buf: bytes, streamed: bool) -> Type:
    xid, pos = _read_xid(buf, 1, streamed)
    (type_oid,) = _unpack(_U32, buf, pos)
    namespace, pos = _read_string(buf, pos + 4)
    name, _ = _read_string(buf, pos)
    return Type(type_oid, namespace, name, xid)


def _decode_insert(buf: bytes, streamed: bool) -> Insert:
    if streamed:
        xid, relation_id, marker = _unpack(_U32_U32_U8, buf, 1)
        pos = 10
    else:
        xid = None
        try:
            relation_id, marker = _U32_U8.unpack_from(buf, 1)
        except struct.error:
            relation_id, marker = _unpack(_U32_U8, buf, 1)
        pos = 6
    if marker != _TUPLE_NEW:
        raise _WireError(f"expected 'N' tuple marker, got {bytes([marker])!r}", pos - 1)
    if _read_row is not None:  # _read_tuple inlined: the row of every event
        found = _read_row(buf, pos, UNCHANGED_TOAST)
        new = found[0] if found is not None else _read_tuple_checked(buf, pos)[0]
    else:
        new, _ = _read_tuple_pure(buf, pos)
    return _new(Insert, (relation_id, new, xid))


def _decode_update(buf: bytes, streamed: bool) -> Update:
    xid, pos = _read_xid(buf, 1, streamed)
    relation_id, marker = _unpack(_U32_U8, buf, pos)
    pos += 4
    old = key = None
    if marker == _TUPLE_OLD:
        old, pos = _read_tuple(buf, pos + 1)
    elif marker == _TUPLE_KEY:
        key, pos = _read_tuple(buf, pos + 1)
    new, _ = _expect_new_tuple(buf, pos)
    return Update(relation_id, old, key, new, xid)


def _decode_delete(buf: bytes, streamed: bool) -> Delete:
    xid, pos = _read_xid(buf, 1, streamed)
    relation_id, marker = _unpack(_U32_U8, buf, pos)
    pos += 5
    if marker == _TUPLE_OLD:
        old, _ = _read_tuple(buf, pos)
        return Delete(relation_id, old, None, xid)
    if marker == _TUPLE_KEY:
        key, _ = _read_tuple(buf, pos)
        return Delete(relation_id, None, key, xid)
    raise _WireError(f"expected 'K' or 'O' tuple marker, got {bytes([marker])!r}", pos - 1)


def _decode_truncate(buf: bytes, streamed: bool) -> Truncate:
    xid, pos = _read_xid(buf, 1, streamed)
    (nrels,) = _unpack(_U32, buf, pos)
    (options,) = _unpack(_U8, buf, pos + 4)
    relation_ids = _unpack(struct.Struct(f">{nrels}I"), buf, pos + 5)
    return Truncate(relation_ids, options, xid)


def _decode_message(buf: bytes, streamed: bool) -> LogicalMessage:
    xid, pos = _read_xid(buf, 1, streamed)
    flags, lsn = _unpack(_MESSAGE_HEAD, buf, pos)
    prefix, pos = _read_string(buf, pos + 9)
    (length,) = _unpack(_I32, buf, pos)
    start = pos + 4
    if length < 0 or start + length > len(buf):
        raise _WireError(f"truncated content: {length} bytes, {len(buf) - start} left", start)
    return LogicalMessage(bool(flags & 1), lsn, prefix, buf[start : start + length], xid)


def _decode_stream_start(buf: bytes, streamed: bool) -> StreamStart:
    xid, first_segment = _unpack(_STREAM_START, buf, 1)
    return StreamStart(xid, first_segment == 1)


def _decode_stream_stop(buf: bytes, streamed: bool) -> StreamStop:
    return StreamStop()


def _decode_stream_commit(buf: bytes, streamed: bool) -> StreamCommit:
    xid, flags, commit_lsn, end_lsn, commit_ts = _unpack(_STREAM_COMMIT, buf, 1)
    return StreamCommit(xid, flags, commit_lsn, end_lsn, commit_ts)


def _decode_stream_abort(buf: bytes, streamed: bool) -> StreamAbort:
    xid, subxid = _unpack(_U32_U32, buf, 1)
    if len(buf) == 9:  # proto v2/v3, or v4 without parallel streaming
        return StreamAbort(xid, subxid, None, None)
    abort_lsn, abort_ts = _unpack(_U64_I64, buf, 9)
    return StreamAbort(xid, subxid, abort_lsn, abort_ts)


def _decode_begin_prepare(buf: bytes, streamed: bool) -> BeginPrepare:
    prepare_lsn, end_lsn, prepare_ts, xid = _unpack(_BEGIN_PREPARE, buf, 1)
    gid, _ = _read_string(buf, 1 + _BEGIN_PREPARE.size)
    return BeginPrepare(prepare_lsn, end_lsn, prepare_ts, xid, gid)


def _decode_prepare(buf: bytes, streamed: bool) -> Prepare:
    flags, prepare_lsn, end_lsn, prepare_ts, xid = _unpack(_PREPARE, buf, 1)
    gid, _ = _read_string(buf, 1 + _PREPARE.size)
    return Prepare(flags, prepare_lsn, end_lsn, prepare_ts, xid, gid)


def _decode_commit_prepared(buf: bytes, streamed: bool) -> CommitPrepared:
    flags, commit_lsn, end_lsn, commit_ts, xid = _unpack(_PREPARE, buf, 1)
    gid, _ = _read_string(buf, 1 + _PREPARE.size)
    return CommitPrepared(flags, commit_lsn, end_lsn, commit_ts, xid, gid)


def _decode_rollback_prepared(buf: bytes, streamed: bool) -> RollbackPrepared:
    flags, prepare_end_lsn, rollback_end_lsn, prepare_ts, rollback_ts, xid = _unpack(
        _ROLLBACK_PREPARED, buf, 1
    )
    gid, _ = _read_string(buf, 1 + _ROLLBACK_PREPARED.size)
    return RollbackPrepared(
        flags, prepare_end_lsn, rollback_end_lsn, prepare_ts, rollback_ts, xid, gid
    )


def _decode_stream_prepare(buf: bytes, streamed: bool) -> StreamPrepare:
    flags, prepare_lsn, end_lsn, prepare_ts, xid = _unpack(_PREPARE, buf, 1)
    gid, _ = _read_string(buf, 1 + _PREPARE.size)
    return StreamPrepare(flags, prepare_lsn, end_lsn, prepare_ts, xid, gid)


_Handler: TypeAlias = Callable[[bytes, bool], Message]

_STREAM_START_BYTE: Final = ord("S")
_STREAM_STOP_BYTE: Final = ord("E")

# Type byte -> (handler, human-readable name used in error messages).
_HANDLERS: Final[dict[int, tuple[_Handler, str]]] = {
    ord(type_char): (handler, f"{name} ({type_char!r})")
    for type_char, handler, name in (
        ("B", _decode_begin, "Begin"),
        ("C", _decode_commit, "Commit"),
        ("O", _decode_origin, "Origin"),
        ("R", _decode_relation, "Relation"),
        ("Y", _decode_type, "Type"),
        ("I", _decode_insert, "Insert"),
        ("U", _decode_update, "Update"),
        ("D", _decode_delete, "Delete"),
        ("T", _decode_truncate, "Truncate"),
        ("M", _decode_message, "Message"),
        ("S", _decode_stream_start, "Stream Start"),
        ("E", _decode_stream_stop, "Stream Stop"),
        ("c", _decode_stream_commit, "Stream Commit"),
        ("A", _decode_stream_abort, "Stream Abort"),
        ("b", _decode_begin_prepare, "Begin Prepare"),
        ("P", _decode_prepare, "Prepare"),
        ("K", _decode_commit_prepared, "Commit Prepared"),
        ("r", _decode_rollback_prepared, "Rollback Prepared"),
        ("p", _decode_stream_prepare, "Stream Prepare"),
    )
}


class PgOutputDecoder:
    """Stateful only in one respect: whether we are inside a Stream Start/Stop block, because inside
    it Relation/Type/Insert/Update/Delete/Truncate/Message carry a leading xid (proto v2+).

    Use one decoder per replication connection, feeding it every message in order.
    """

    __slots__ = ("_in_stream",)

    def __init__(self) -> None:
        self._in_stream = False

    @property
    def in_stream(self) -> bool:
        """True between a Stream Start and the following Stream Stop."""
        return self._in_stream

    def decode_xlog(self, frame: memoryview) -> tuple[Message, ...]:
        """The message of one XLogData frame as received (its header first), as the session
        reads frames (:data:`cdc_relay.decode.plugin.XLogDecoder`).

        An Insert, Begin or Commit (every event, every transaction) is read straight from the
        frame in one C call where the extension is built (None for anything else or anything
        malformed); the rest goes through :meth:`decode`, which is the reference and names every
        error.
        """
        if _READ_MESSAGE is not None and not self._in_stream:
            found = _READ_MESSAGE(
                frame, XLOG_DATA_PAYLOAD_OFFSET, _INSERT, _BEGIN_TYPE, _COMMIT_TYPE, _UNCHANGED
            )
            if found is not None:
                return (found,)
        # Copying the whole frame and slicing the copy is cheaper than slicing the view first.
        return (self.decode(frame.tobytes()[XLOG_DATA_PAYLOAD_OFFSET:]),)

    def decode(self, data: bytes | memoryview) -> Message:
        """Decode one pgoutput message (the ``data`` of one XLogData / slot-function row)."""
        buf = data if type(data) is bytes else bytes(data)
        if not buf:
            raise DecodeError(
                "empty pgoutput message at byte offset 0", offset=0, message_type=None
            )
        type_byte = buf[0]
        entry = _HANDLERS.get(type_byte)
        if entry is None:
            raise DecodeError(
                f"unknown pgoutput message type byte {buf[:1]!r} (0x{type_byte:02x}) "
                "at byte offset 0",
                offset=0,
                message_type=None,
            )
        handler, name = entry
        try:
            message = handler(buf, self._in_stream)
        except _WireError as exc:
            raise DecodeError(
                f"{name} message: {exc.reason} at byte offset {exc.offset} "
                f"(message is {len(buf)} bytes)",
                offset=exc.offset,
                message_type=name,
            ) from None
        if type_byte == _STREAM_START_BYTE:
            self._in_stream = True
        elif type_byte == _STREAM_STOP_BYTE:
            self._in_stream = False
        return message
