"""Types of the optional C tuple reader (``_tuple_reader.c``; ``pgoutput.py`` is its reference)."""

from cdc_relay.decode.messages import TupleData, UnchangedToast

def read_tuple(buf: bytes, pos: int, unchanged: UnchangedToast, /) -> tuple[TupleData, int] | None:
    """One TupleData from ``buf[pos:]`` and the offset after it; None when malformed."""
