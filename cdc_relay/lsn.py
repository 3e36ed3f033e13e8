"""PostgreSQL log sequence numbers: the ``X/Y`` text form and the 64-bit integer form."""

from __future__ import annotations

import re

_LSN_TEXT = re.compile(r"^([0-9A-Fa-f]{1,8})/([0-9A-Fa-f]{1,8})$")


def parse_lsn(text: str) -> int:
    """``'16/B374D848'`` -> integer. Raises ValueError on anything else."""
    match = _LSN_TEXT.match(text.strip())
    if match is None:
        raise ValueError(f"not an LSN: {text!r}")
    return (int(match.group(1), 16) << 32) | int(match.group(2), 16)


def format_lsn(value: int) -> str:
    """Integer -> ``'16/B374D848'``, the form PostgreSQL prints and accepts."""
    if not 0 <= value < 1 << 64:
        raise ValueError(f"LSN out of range: {value}")
    return f"{value >> 32:X}/{value & 0xFFFFFFFF:X}"
