"""Types of the optional C tuple reader (``_tuple_reader.c``; ``pgoutput.py`` is its reference)."""

from collections import defaultdict
from collections.abc import Callable
from types import MethodType
from typing import Any

from cdc_relay.decode.messages import Begin, Commit, Insert, TupleData, UnchangedToast

def read_tuple(buf: bytes, pos: int, unchanged: UnchangedToast, /) -> tuple[TupleData, int] | None:
    """One TupleData from ``buf[pos:]`` and the offset after it; None when malformed."""

def read_message(
    frame: bytes | memoryview,
    offset: int,
    insert_type: type[Insert],
    begin_type: type[Begin],
    commit_type: type[Commit],
    unchanged: UnchangedToast,
    /,
) -> Insert | Begin | Commit | None:
    """The Insert, Begin or Commit message at ``frame[offset:]`` (outside a stream block); None
    for any other message and for anything malformed."""

def bind(function: Callable[..., Any], obj: object, /) -> MethodType:
    """``types.MethodType(function, obj)``, without the type call's argument tuple."""

class Deliveries:
    """A delivery callback, called as ``(record, err, msg)``: an ordinary success done as
    ``reference`` (``DeliveryTracker``'s on_delivery) does it, without a Python frame; anything
    else is ``reference(record, err, msg)``."""

    def __init__(
        self,
        txn_type: type,
        by_topic: defaultdict[str, int],
        observe: Callable[[float, int], None],
        now: Callable[[], float],
        reference: Callable[[Any, Any, Any], None],
    ) -> None: ...
    def __call__(self, record: Any, err: Any, msg: Any, /) -> None: ...

_Record = tuple[str, bytes, bytes | None, list[tuple[str, bytes]], str, bytes | None]

def record_fields(
    spec: tuple[int | str, ...],
    topics: dict[tuple[bytes, bytes], str],
    last: list[object],
    reference: Callable[[TupleData], _Record] | None,
    row: TupleData,
    /,
) -> _Record | None:
    """The plain outbox mapping of an ordinary row (``OutboxMapping._record_fields`` is the
    reference); for any other row ``reference(row)``, or None without one."""

class Publisher:
    """An XLogData frame decoded and, when it is an Insert's ordinary row, published as
    ``Session.publish`` does it, in one call, as ``(frame, txn)``: True once produced; False,
    with nothing changed, for anything the session must decode and publish in Python.
    ``fast_states`` is ``Relations.fast_states``: relation id -> the mapping's ``fast_state``."""

    def __init__(
        self,
        decoder: object,
        offset: int,
        txn_type: type,
        fast_states: dict[int, tuple[object, ...]],
        known_topics: set[str],
        produce: Callable[..., None],
        produce_failed: Callable[..., None],
        callback: Callable[[Any, Any, Any], None],
        position_header: str,
        unchanged: UnchangedToast,
    ) -> None: ...
    def __call__(self, frame: memoryview, txn: object, /) -> bool: ...
