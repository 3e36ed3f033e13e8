"""Decoder for the ``wal2json`` logical decoding plugin (``format-version`` 2).

Why this module exists: the relay normally reads its slot with the built-in ``pgoutput`` plugin,
which needs a publication, and creating one requires owning the outbox table. Some deployments
(managed services, shared databases, existing CDC slots) only offer ``wal2json`` slots, which
filter by table with a plugin option instead (``add-tables``). This decoder turns wal2json's
JSON messages into exactly the message types of :mod:`cdc_relay.decode.messages` (``Begin``,
``Relation``, ``Insert``, ``Commit`` ...), so the relay loop works unchanged with either plugin.
Like the pgoutput decoder it is pure: bytes in, frozen dataclasses out; no I/O, clock or logging.

Everything below was checked against wal2json 2.5 on PostgreSQL 15 (fixtures in
``tests/fixtures/wal2json``, captured by ``tests/fixtures/capture_wal2json.py``):

* One JSON object per message, ``action`` B (begin), C (commit), I/U/D (changes), T (truncate,
  one message per table) or M (logical message). B and C are sent for *every* transaction, also
  for ones whose changes were all filtered out (DDL, other tables).
* Column values are PostgreSQL's text output, as a JSON string, except: ``boolean`` is a JSON
  ``true``/``false`` (we return ``b"t"``/``b"f"``, the text form pgoutput sends); ``int2``,
  ``int4``, ``int8``, ``oid``, ``float4``, ``float8`` and ``numeric`` are bare JSON numbers
  holding the exact text (``1.10``, ``123456789012345678901234567890``, ``1e+20``), which a
  float-parsing JSON library would round, so those are re-read as text (see :func:`_exact`);
  ``NaN`` and ``[-]Infinity`` of those types become JSON ``null``, indistinguishable from SQL
  NULL (a loss in wal2json 2.5 we cannot undo: they decode to ``None``); ``bytea`` comes without
  its ``\\x`` prefix (we put it back), which is only right while the walsender session has
  ``bytea_output = hex`` (the default): with ``escape`` wal2json cuts the first two characters
  off the escaped form, which we reject when what is left is not hex, but cannot always detect.
  ``json``/``jsonb`` are strings holding the value's text, so a jsonb decodes to exactly the
  bytes of ``SELECT payload::text``. All texts are printed with the decoding session's settings
  (TimeZone, DateStyle), as pgoutput's are.
* Unchanged TOASTed columns are left out of an Update's ``columns``; they become
  :data:`~cdc_relay.decode.messages.UNCHANGED_TOAST` at their position in the table's last Relation.
* Logical message content is written as a C string: it stops at the first NUL byte, and bytes
  that are not UTF-8 are copied raw into the JSON (invalid UTF-8 in the message). We still decode
  such a message, returning the raw bytes up to the NUL.

Relations. wal2json has no Relation message and no table OID, so the decoder makes them up: a
``Relation`` is emitted before the first change of a table and again whenever its column list
(names, types, type OIDs) differs from the last one announced, e.g. after ``ALTER TABLE ... ADD
COLUMN`` (the new column list shows up in the very next change, even inside the transaction that
altered the table). Its ``relation_id`` is synthetic: a 32-bit hash of (schema, table, column
list), stable across decoders, so a changed table gets a new id and positional values can never
be read with an old column list. Relation columns carry ``flags=0`` and ``type_modifier=-1``;
``replica_identity`` is reported as ``'d'`` because wal2json does not say.

LSNs (see :class:`Wal2JsonDecoder` for the reasoning and the evidence): ``Begin.final_lsn`` is B's
``lsn`` (start of the commit record, like pgoutput's), ``Commit.end_lsn`` is C's ``nextlsn`` (end
of the commit record, like pgoutput's); both need ``include-lsn``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from datetime import datetime
from hashlib import blake2b
from operator import itemgetter
from typing import Any, Final, TypeAlias

import orjson

from cdc_relay.decode.messages import (
    PG_EPOCH,
    UNCHANGED_TOAST,
    Begin,
    Commit,
    DecodeError,
    Delete,
    Insert,
    LogicalMessage,
    Relation,
    RelationColumn,
    Truncate,
    TupleData,
    Update,
    Value,
)
from cdc_relay.lsn import parse_lsn

__all__ = [
    "PLUGIN_NAME",
    "PLUGIN_OPTIONS",
    "Wal2JsonDecoder",
    "Wal2JsonMessage",
    "plugin_options",
]

PLUGIN_NAME: Final = "wal2json"

# Options for START_REPLICATION / pg_logical_slot_*_changes. Every field the decoder reads is
# switched on explicitly, so a different default in another wal2json version cannot remove one.
# Deliberately absent:
# - "numeric-data-types-as-string": wal2json 2.5 (Debian bookworm's) rejects it as an unknown
#   option, which fails START_REPLICATION. Numbers are decoded exactly without it; with it (2.6+)
#   they arrive as strings, which the decoder handles too.
# - "include-not-null", "include-pk", "include-default": nothing reads them.
# - "include-typmod": its default (on) is fine: "numeric(10,2)" and "numeric" are then different
#   column types, so a typmod change announces a new Relation.
PLUGIN_OPTIONS: Final[dict[str, str]] = {
    "format-version": "2",
    "include-transaction": "1",  # B and C messages
    "include-xids": "1",  # Begin.xid
    "include-timestamp": "1",  # commit timestamps
    "include-lsn": "1",  # B/C "lsn" (commit record) and "nextlsn" (its end); M "lsn"
    "include-schemas": "1",  # Relation.namespace
    "include-types": "1",  # column type names: part of a table's column signature
    "include-type-oids": "1",  # RelationColumn.type_oid; tells integer columns from numeric ones
}

# add-tables: wal2json splits the list on unescaped commas and schema from table on the first
# unescaped period, trims unescaped whitespace around entries, treats '*' as a wildcard and fails
# to parse an entry with unescaped whitespace inside. A backslash makes the next character
# literal. (Verified on 2.5 with tables named "sp ace", "dot.ted", "com,ma", "st*r", "quo'te",
# "back\slash", "tab<TAB>x" and a schema "My Sch.ema".)
_ADD_TABLES_SPECIAL: Final = re.compile(r"([\\,.*'\s])")
# add-msg-prefixes is split on commas, entries are trimmed, and there is no escaping at all: a
# backslash or quote is taken literally, a prefix with a comma cannot be expressed, one with
# whitespace inside makes wal2json fail to parse the option.
_BAD_PREFIX: Final = re.compile(r"[,\s]")
# One part of a qualified name: a double-quoted identifier ("" is a quote) or a run of non-dots.
_NAME_PART: Final = re.compile(r'"((?:[^"]|"")+)"|([^".]+)')


def plugin_options(
    tables: list[str], message_prefixes: Sequence[str] = ("outbox",)
) -> dict[str, str]:
    """:data:`PLUGIN_OPTIONS` plus ``add-tables`` (and ``add-msg-prefixes``) for ``tables``.

    Each table is ``schema.table`` with the names exactly as in the catalog (case-sensitive, no
    folding); write a part in double quotes when it contains a period (``"my.schema".outbox``).
    Names are escaped for wal2json, so ``*`` is a literal asterisk, not a wildcard. Messages are
    restricted to ``message_prefixes``; pass an empty sequence to receive no prefix filter.

    The values are raw option values: quoting them for a replication command (doubling single
    quotes) is the caller's job.
    """
    if not tables:
        raise ValueError("at least one table is needed: without add-tables wal2json sends all")
    options = dict(PLUGIN_OPTIONS)
    options["add-tables"] = ",".join(_escape_table(name) for name in tables)
    if message_prefixes:
        for prefix in message_prefixes:
            if not prefix or _BAD_PREFIX.search(prefix):
                raise ValueError(
                    f"message prefix {prefix!r} cannot be passed to wal2json: add-msg-prefixes "
                    "has no escaping, so prefixes must be non-empty, without commas or whitespace"
                )
        options["add-msg-prefixes"] = ",".join(message_prefixes)
    return options


def _escape_table(qualified: str) -> str:
    parts: list[str] = []
    pos = 0
    while True:
        match = _NAME_PART.match(qualified, pos)
        if match is None:
            break
        quoted, plain = match.groups()
        parts.append(quoted.replace('""', '"') if quoted is not None else plain)
        pos = match.end()
        if pos == len(qualified) or qualified[pos] != ".":
            break
        pos += 1
    if pos != len(qualified) or len(parts) != 2:
        raise ValueError(
            f"table {qualified!r} is not schema.table (double-quote a part with a period in it)"
        )
    return ".".join(_ADD_TABLES_SPECIAL.sub(r"\\\1", part) for part in parts)


# --------------------------------------------------------------------------------------------
# Messages
# --------------------------------------------------------------------------------------------

Wal2JsonMessage: TypeAlias = (
    Begin | Commit | Relation | Insert | Update | Delete | Truncate | LogicalMessage
)

# Type OIDs (pg_type.dat) whose values need special handling.
_BYTEA_OID: Final = 17
_INTEGER_OIDS: Final = frozenset({20, 21, 23, 26})  # int8, int2, int4, oid: JSON ints are exact

_COLUMN_SIGNATURE: Final = itemgetter("name", "type", "typeoid")
_COLUMN_VALUE: Final = itemgetter("value")
_TRUE: Final = b"t"
_FALSE: Final = b"f"
_U32: Final = 1 << 32

# Numbers as their exact JSON text: the C scanner passes the matched text to parse_float and
# parse_int. Only used for rows that contain float/numeric values, never for outbox rows.
_EXACT_JSON: Final = json.JSONDecoder(parse_float=str, parse_int=str)
# An integer wider than any integer column (int8's 20 characters) is a numeric: kept as its text,
# as int() refuses more than sys.get_int_max_str_digits() digits (4,300) and numeric has 131,072.
_INT_CHARACTERS: Final = 20
_HEX_DIGITS: Final = b"0123456789abcdefABCDEF"

_loads: Final = orjson.loads
_JSONDecodeError: Final = orjson.JSONDecodeError


_Signature: TypeAlias = tuple[tuple[Any, Any, Any], ...]  # (name, type, typeoid) per column


class _Malformed(Exception):
    """A message that parsed as JSON but does not have the shape wal2json sends."""


class _RelationInfo:
    """One announced column list of one table: its Relation and how to convert its values."""

    __slots__ = (
        "bytea",
        "integers",
        "positions",
        "relation",
        "relation_id",
        "signature",
    )

    def __init__(self, relation: Relation, signature: _Signature) -> None:
        self.relation = relation
        self.signature = signature
        self.relation_id = relation.relation_id
        self.positions = {column.name: i for i, column in enumerate(relation.columns)}
        self.bytea = tuple(
            i for i, column in enumerate(relation.columns) if column.type_oid == _BYTEA_OID
        )
        self.integers = frozenset(
            i for i, column in enumerate(relation.columns) if column.type_oid in _INTEGER_OIDS
        )


class Wal2JsonDecoder:
    """Decodes wal2json format-version 2 messages, one per call, into pgoutput message types.

    Stateful only in what it announced: the column list of each table (to emit a Relation when
    it first appears or changes). Use one decoder per replication connection, feeding it every
    message in order, as with :class:`~cdc_relay.decode.pgoutput.PgOutputDecoder`.

    Which LSN marks the end of a transaction. A restarted slot skips a transaction when its
    commit record *starts* before the confirmed position (``start_decoding_at``), so the
    position to confirm after a transaction must be past the start of its commit record and not
    past the start of the next commit record (or non-transactional message); pgoutput's
    ``Commit.end_lsn`` is the end of the commit record. wal2json v2 with ``include-lsn`` puts
    the same two positions in both B and C: ``lsn`` is the start of the commit record
    (= pgoutput's ``Begin.final_lsn`` and ``Commit.commit_lsn``), ``nextlsn`` its end
    (= pgoutput's ``Commit.end_lsn``). So ``Commit.end_lsn = nextlsn``.
    Evidence (PostgreSQL 15.18, wal2json 2.5, in the ``walsender`` fixture and
    ``test_end_lsn_against_the_server``): for the same transaction pgoutput's Begin.final_lsn and
    Commit.end_lsn equal wal2json's lsn and nextlsn; the walsender sends C in an XLogData whose
    ``data_start`` is ``nextlsn``; a slot advanced to a C's ``nextlsn`` (by a standby status
    update or ``pg_replication_slot_advance``) no longer returns that transaction but does return
    the next, while one advanced only to C's ``lsn`` returns the transaction again. ``wal_start``
    is only used when C has no ``nextlsn`` or M no ``lsn`` (``include-lsn`` off), since for those
    the walsender's ``data_start`` is the same position; B's ``data_start`` is the transaction's
    *first* record, not its commit, so B without ``lsn`` is an error.
    """

    __slots__ = ("_by_signature", "_current", "_ids", "_table_ids")

    def __init__(self) -> None:
        self._by_signature: dict[tuple[str, str, _Signature], _RelationInfo] = {}
        self._current: dict[tuple[str, str], _RelationInfo] = {}
        self._ids: set[int] = set()
        self._table_ids: dict[tuple[str, str], int] = {}

    def decode(self, data: bytes | memoryview, wal_start: int) -> list[Wal2JsonMessage]:
        """Decode one wal2json message (the ``data`` of one XLogData or slot-function row).

        ``wal_start`` is the XLogData ``data_start`` (or the row's ``lsn``). Returns the messages
        in order: usually one, a Relation then an Insert/Update when a column list is new.
        Raises :class:`~cdc_relay.decode.messages.DecodeError` for anything that is not a
        wal2json v2 message.
        """
        lossy = False
        try:
            obj = _loads(data)
        except _JSONDecodeError as exc:
            obj = _loads_lossy(data, exc)
            lossy = True
        if type(obj) is not dict:
            raise DecodeError(
                f"wal2json message is not a JSON object but {type(obj).__name__}",
                offset=0,
                message_type=None,
            )
        action = obj.get("action")
        entry = _HANDLERS.get(action) if type(action) is str else None
        if entry is None:
            raise DecodeError(
                f"unknown wal2json action {action!r} (expected one of B, C, I, U, D, T, M; "
                "is format-version 2 set?)",
                offset=0,
                message_type=None,
            )
        handler, name = entry
        try:
            return handler(self, obj, data, wal_start, lossy)
        except KeyError as exc:
            raise DecodeError(
                f"{name} message: missing field {exc.args[0]!r}{_option_hint(exc.args[0])}",
                offset=0,
                message_type=name,
            ) from None
        except (_Malformed, TypeError, ValueError, AttributeError, RecursionError) as exc:
            raise DecodeError(f"{name} message: {exc}", offset=0, message_type=name) from None

    # -- transactions --------------------------------------------------------------------

    def _begin(
        self, obj: dict[str, Any], data: bytes | memoryview, wal_start: int, lossy: bool
    ) -> list[Wal2JsonMessage]:
        return [Begin(_lsn(obj, "lsn"), _timestamp(obj), _xid(obj))]

    def _commit(
        self, obj: dict[str, Any], data: bytes | memoryview, wal_start: int, lossy: bool
    ) -> list[Wal2JsonMessage]:
        end_lsn = _lsn(obj, "nextlsn") if "nextlsn" in obj else wal_start
        return [Commit(0, _lsn(obj, "lsn"), end_lsn, _timestamp(obj))]

    def _message(
        self, obj: dict[str, Any], data: bytes | memoryview, wal_start: int, lossy: bool
    ) -> list[Wal2JsonMessage]:
        transactional = obj["transactional"]
        prefix = obj["prefix"]
        content = obj["content"]
        if type(transactional) is not bool or type(prefix) is not str or type(content) is not str:
            raise _Malformed("transactional must be a boolean, prefix and content strings")
        xid = obj.get("xid")
        if xid is not None and type(xid) is not int:
            raise _Malformed(f"xid must be an integer or null, not {xid!r}")
        lsn = _lsn(obj, "lsn") if "lsn" in obj else wal_start
        if lossy:  # raw non-UTF-8 bytes were carried through as surrogates
            prefix = prefix.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
            body = content.encode("utf-8", "surrogateescape")
        else:
            body = content.encode()
        return [LogicalMessage(transactional, lsn, prefix, body, xid)]

    # -- changes ---------------------------------------------------------------------------

    def _insert(
        self, obj: dict[str, Any], data: bytes | memoryview, wal_start: int, lossy: bool
    ) -> list[Wal2JsonMessage]:
        # The hot path: one outbox row per call. Comparing the column list with the table's
        # current one is cheaper than hashing it.
        columns = obj["columns"]
        try:
            signature = tuple(map(_COLUMN_SIGNATURE, columns))
        except KeyError:
            signature = _partial_signature(columns)
        schema = obj["schema"]
        table = obj["table"]
        info = self._current.get((schema, table))
        if info is None or info.signature != signature:
            info = self._switch(schema, table, signature)
            new = _texts(list(map(_COLUMN_VALUE, columns)), info, data, "columns", lossy)
            return [info.relation, Insert(info.relation_id, new, None)]
        new = _texts(list(map(_COLUMN_VALUE, columns)), info, data, "columns", lossy)
        return [Insert(info.relation_id, new, None)]

    def _update(
        self, obj: dict[str, Any], data: bytes | memoryview, wal_start: int, lossy: bool
    ) -> list[Wal2JsonMessage]:
        schema, table, columns = obj["schema"], obj["table"], obj["columns"]
        signature = _partial_signature(columns)
        values = _texts(list(map(_COLUMN_VALUE, columns)), None, data, "columns", lossy)
        out: list[Wal2JsonMessage] = []
        info = self._current.get((schema, table))
        new: list[Value]
        if info is not None and info.signature == signature:
            new = list(values)
        else:
            positions = _positions(info, signature) if info is not None else None
            if info is None or positions is None:
                # Unknown table, or a column list that is not part of the last one: a new
                # Relation. (If TOASTed columns were left out here, it lacks them: unavoidable.)
                info = self._switch(schema, table, signature)
                out.append(info.relation)
                new = list(values)
            else:
                # Unchanged TOASTed columns are absent from "columns".
                new = [UNCHANGED_TOAST] * len(info.signature)
                for position, value in zip(positions, values, strict=True):
                    new[position] = value
        _fix_bytea(new, info.bytea)
        old, key = self._identity(obj, info, data, lossy)
        out.append(Update(info.relation_id, old, key, tuple(new), None))
        return out

    def _delete(
        self, obj: dict[str, Any], data: bytes | memoryview, wal_start: int, lossy: bool
    ) -> list[Wal2JsonMessage]:
        schema, table = obj["schema"], obj["table"]
        info = self._current.get((schema, table))
        if info is not None:
            old, key = self._identity(obj, info, data, lossy)
            return [Delete(info.relation_id, old, key, None)]
        # No column list known for this table (a Delete carries only the identity columns):
        # refer to it by a table-level id without announcing a Relation that would lack columns.
        identity = obj["identity"]
        _partial_signature(identity)
        key_values = _texts(list(map(_COLUMN_VALUE, identity)), None, data, "identity", lossy)
        return [Delete(self._table_id(schema, table), None, key_values, None)]

    def _truncate(
        self, obj: dict[str, Any], data: bytes | memoryview, wal_start: int, lossy: bool
    ) -> list[Wal2JsonMessage]:
        schema, table = obj["schema"], obj["table"]
        if type(schema) is not str or type(table) is not str:
            raise _Malformed("schema and table must be strings")
        info = self._current.get((schema, table))
        relation_id = info.relation_id if info is not None else self._table_id(schema, table)
        # wal2json sends one T per table and does not report CASCADE / RESTART IDENTITY.
        return [Truncate((relation_id,), 0, None)]

    # -- relations -------------------------------------------------------------------------

    def _switch(self, schema: str, table: str, signature: _Signature) -> _RelationInfo:
        """Make ``signature`` the table's current column list; the caller emits its Relation."""
        if type(schema) is not str or type(table) is not str:
            raise _Malformed("schema and table must be strings")
        key = (schema, table, signature)
        info = self._by_signature.get(key)
        if info is None:
            columns = []
            for name, type_name, type_oid in signature:
                if type(name) is not str or (type_name is not None and type(type_name) is not str):
                    raise _Malformed("column name and type must be strings")
                if type_oid is not None and (type(type_oid) is not int or type_oid < 0):
                    raise _Malformed(f"column typeoid must be an OID, not {type_oid!r}")
                columns.append(RelationColumn(0, name, type_oid or 0, -1))
            relation_id = self._new_id(repr(key).encode())
            relation = Relation(relation_id, schema, table, "d", tuple(columns), None)
            info = _RelationInfo(relation, signature)
            self._by_signature[key] = info
        self._current[(schema, table)] = info
        return info

    def _new_id(self, seed: bytes) -> int:
        """A synthetic relation id: a hash of ``seed``, probed past ids already in use and 0."""
        candidate = int.from_bytes(blake2b(seed, digest_size=4).digest(), "big")
        while candidate == 0 or candidate in self._ids:
            candidate = (candidate + 1) % _U32
        self._ids.add(candidate)
        return candidate

    def _table_id(self, schema: str, table: str) -> int:
        if type(schema) is not str or type(table) is not str:
            raise _Malformed("schema and table must be strings")
        relation_id = self._table_ids.get((schema, table))
        if relation_id is None:
            relation_id = self._new_id(repr(("table", schema, table)).encode())
            self._table_ids[(schema, table)] = relation_id
        return relation_id

    def _identity(
        self, obj: dict[str, Any], info: _RelationInfo, data: bytes | memoryview, lossy: bool
    ) -> tuple[TupleData | None, TupleData | None]:
        """The old row as pgoutput would give it: ``(old, None)`` when the identity holds every
        column (REPLICA IDENTITY FULL), else ``(None, key)``, non-key columns NULL.

        Unlike pgoutput, which sends the key of an Update only when it changed, wal2json always
        sends it, so ``Update.key`` is always set for tables with a primary key.
        """
        identity = obj.get("identity")
        if identity is None:
            return None, None
        signature = _partial_signature(identity)
        values = _texts(list(map(_COLUMN_VALUE, identity)), None, data, "identity", lossy)
        positions = _positions(info, signature)
        if positions is None:
            raise _Malformed(
                f"identity columns {[c[0] for c in signature]} are not columns of "
                f"{info.relation.namespace}.{info.relation.name}"
            )
        row: list[Value] = [None] * len(info.positions)
        for position, value in zip(positions, values, strict=True):
            row[position] = value
        _fix_bytea(row, info.bytea)
        if len(positions) == len(info.positions):
            return tuple(row), None
        return None, tuple(row)


# --------------------------------------------------------------------------------------------
# Values
# --------------------------------------------------------------------------------------------


def _texts(
    values: list[Any],
    info: _RelationInfo | None,
    data: bytes | memoryview,
    field: str,
    lossy: bool,
) -> TupleData:
    """Column values as pgoutput's text-format bytes; ``info`` is the relation they belong to
    (``None``: the caller maps them and fixes bytea itself)."""
    if not lossy:
        try:
            new: list[Value] = [value if value is None else value.encode() for value in values]
        except AttributeError:  # a boolean or a number
            new = _texts_slow(values, info, data, field)
    else:
        new = _texts_slow(values, info, data, field)
    if info is not None and info.bytea:
        _fix_bytea(new, info.bytea)
    return tuple(new)


def _texts_slow(
    values: list[Any], info: _RelationInfo | None, data: bytes | memoryview, field: str
) -> list[Value]:
    new: list[Value] = []
    exact: list[Any] | None = None
    for i, value in enumerate(values):
        kind = type(value)
        if value is None:
            new.append(None)
        elif kind is str:
            # surrogateescape: invalid UTF-8 (a non-UTF-8 database) comes back byte for byte.
            new.append(value.encode("utf-8", "surrogateescape"))
        elif kind is bool:
            new.append(_TRUE if value else _FALSE)
        elif kind is int and info is not None and i in info.integers:
            new.append(str(value).encode())  # integer types print canonically: exact
        elif kind is int or kind is float:
            if exact is None:
                exact = _exact(data, field)
            text = exact[i] if i < len(exact) else None
            if type(text) is not str:
                raise _Malformed(f"cannot re-read number {value!r} of {field}[{i}] as text")
            new.append(text.encode())
        else:
            raise _Malformed(f"{field}[{i}] has a JSON {kind.__name__} value, not a scalar")
    return new


def _exact(data: bytes | memoryview, field: str) -> list[Any]:
    """The values of ``field`` with every JSON number as its exact text.

    wal2json prints float4/float8/numeric values as bare JSON numbers in PostgreSQL's text form;
    a double cannot hold ``1.10`` (scale), ``123456789012345678901234567890`` or ``-0`` exactly.
    """
    text = bytes(data).decode("utf-8", "surrogateescape")
    obj = _EXACT_JSON.decode(text)
    return [column.get("value") for column in obj[field]]


def _fix_bytea(values: list[Value], positions: tuple[int, ...]) -> None:
    for i in positions:
        value = values[i]
        if isinstance(value, bytes):
            # Deleting the hex digits leaves nothing of a hex text: checked without a copy of
            # the value (it may be hundreds of megabytes).
            if len(value) % 2 or value.translate(None, _HEX_DIGITS):
                raise _Malformed(
                    "bytea value is not hex: wal2json strips the first two characters of "
                    "bytea's text, which only loses nothing with bytea_output = 'hex'"
                )
            values[i] = b"\\x" + value


def _partial_signature(columns: list[Any]) -> _Signature:
    """Column signature without assuming include-types / include-type-oids."""
    if type(columns) is not list:
        raise _Malformed(f"columns must be a list, not {type(columns).__name__}")
    signature = []
    for column in columns:
        if type(column) is not dict:
            raise _Malformed(f"a column must be an object, not {type(column).__name__}")
        signature.append((column["name"], column.get("type"), column.get("typeoid")))
    return tuple(signature)


def _positions(info: _RelationInfo, signature: _Signature) -> list[int] | None:
    """Where each column of ``signature`` sits in ``info``'s Relation, or None if one is not
    there with the same name, type and type OID."""
    positions = []
    for column in signature:
        position = info.positions.get(column[0])
        if position is None or info.signature[position] != column:
            return None
        positions.append(position)
    return positions


# --------------------------------------------------------------------------------------------
# Fields
# --------------------------------------------------------------------------------------------


def _lsn(obj: dict[str, Any], field: str) -> int:
    value = obj[field]
    if type(value) is not str:
        raise _Malformed(f"{field} must be an LSN string like '0/16B3748', not {value!r}")
    try:
        return parse_lsn(value)
    except ValueError:
        raise _Malformed(f"{field} is not an LSN: {value!r}") from None


def _xid(obj: dict[str, Any]) -> int:
    xid = obj["xid"]
    if type(xid) is not int or xid < 0:
        raise _Malformed(f"xid must be a transaction id, not {xid!r}")
    return xid


def _timestamp(obj: dict[str, Any]) -> int:
    """``timestamp`` as microseconds since 2000-01-01 UTC, like pgoutput's commit timestamps.

    wal2json prints it with ``timestamptz_to_str``: ISO style, in the decoding session's TimeZone,
    fractional seconds without trailing zeros (``2024-05-06 12:38:09.12345+05:30``).
    """
    value = obj["timestamp"]
    if type(value) is not str:
        raise _Malformed(f"timestamp must be a string, not {value!r}")
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise _Malformed(f"timestamp is not an ISO timestamp with offset: {value!r}") from None
    if moment.tzinfo is None:
        raise _Malformed(f"timestamp has no UTC offset: {value!r}")
    delta = moment - PG_EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


_HINTS: Final = {
    "lsn": "include-lsn",
    "nextlsn": "include-lsn",
    "xid": "include-xids",
    "timestamp": "include-timestamp",
    "schema": "include-schemas",
}


def _option_hint(field: object) -> str:
    option = _HINTS.get(field) if isinstance(field, str) else None
    return f" (set the wal2json option {option} '1')" if option else ""


def _loads_lossy(data: bytes | memoryview, error: orjson.JSONDecodeError) -> Any:
    """Parse a message that orjson refused, with the standard library's parser. Two kinds of
    valid message land here: a number beyond a double's range (a ``numeric`` column holding
    ``1e400``, which wal2json prints as 401 digits, or up to numeric's 131,072 + 16,383 digits),
    and invalid UTF-8 (wal2json copies a logical message's content, and in a non-UTF-8 database
    every text, unchecked): read with the invalid bytes as surrogates, restored exactly later.
    Numbers other than small integers are read as their exact text (:data:`_LOSSY_JSON`)."""
    raw = bytes(data)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None:
        try:
            return _LOSSY_JSON.decode(text)
        except json.JSONDecodeError:
            detail = error.args[0] if error.args else str(error)
            raise DecodeError(
                f"wal2json message is not valid JSON: {detail} (message is {len(raw)} bytes)",
                offset=error.pos,
                message_type=None,
            ) from None
        except RecursionError:
            raise _too_deep(raw) from None
    try:
        return _LOSSY_JSON.decode(raw.decode("utf-8", "surrogateescape"))
    except json.JSONDecodeError as exc:
        raise DecodeError(
            f"wal2json message is not valid JSON: {exc.msg} at character {exc.pos} "
            f"(and it is not UTF-8)",
            offset=exc.pos,
            message_type=None,
        ) from None
    except RecursionError:
        raise _too_deep(raw) from None


def _int_or_text(text: str) -> int | str:
    return int(text) if len(text) <= _INT_CHARACTERS else text


# The lossy path's parser: integers that fit an integer column as ints (an xid must be one), every
# other number as its text, which is what a column value needs (the decoder encodes texts as they
# are) and never meets a conversion limit.
_LOSSY_JSON: Final = json.JSONDecoder(parse_float=str, parse_int=_int_or_text)


def _too_deep(raw: bytes) -> DecodeError:
    return DecodeError(
        f"wal2json message is nested too deeply to parse (message is {len(raw)} bytes)",
        offset=0,
        message_type=None,
    )


_Handler: TypeAlias = Callable[
    [Wal2JsonDecoder, dict[str, Any], bytes | memoryview, int, bool], list[Wal2JsonMessage]
]

# action -> (handler, name used in error messages)
_HANDLERS: Final[dict[str, tuple[_Handler, str]]] = {
    "B": (Wal2JsonDecoder._begin, "Begin ('B')"),
    "C": (Wal2JsonDecoder._commit, "Commit ('C')"),
    "I": (Wal2JsonDecoder._insert, "Insert ('I')"),
    "U": (Wal2JsonDecoder._update, "Update ('U')"),
    "D": (Wal2JsonDecoder._delete, "Delete ('D')"),
    "T": (Wal2JsonDecoder._truncate, "Truncate ('T')"),
    "M": (Wal2JsonDecoder._message, "Message ('M')"),
}
