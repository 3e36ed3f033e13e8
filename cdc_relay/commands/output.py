"""Text read from the database (or another process) made safe to print as one terminal line.

``status`` and ``check`` print what they read: the lease's holder, role and application names, a
publication's row filter, the server's error messages. Much of it is chosen by someone other
than the operator — a role that may write the lease row, a client naming its
``application_name`` — and a terminal obeys what it prints: a newline forges another line of the
report, an escape sequence clears the screen, sets the title or hides text. So every printed
value goes through :func:`printable`: control and format characters become visible escapes, the
length is bounded, and what is safe stays as it was.
"""

from __future__ import annotations

VALUE_LIMIT = 1000  # characters of one printed value (``status``)
LINE_LIMIT = 16_384  # characters of one printed line (``check``: a fix may quote long filters)

_SHORT_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}


def printable(value: object, limit: int = VALUE_LIMIT) -> str:
    """``value`` as one line of visible text of at most ``limit`` characters plus a marker.

    Backslashes are doubled and every unsafe character is written as Python writes it in a
    string (``\\n``, ``\\x1b``, ``\\u202e``), so the escaped form is unambiguous; a longer text
    is cut and says how many characters were left out.
    """
    text = value if isinstance(value, str) else str(value)
    parts: list[str] = []
    length = 0
    for index, char in enumerate(text):
        piece = _escape(char)
        if length + len(piece) > limit:
            parts.append(f"… ({len(text) - index} more characters)")
            break
        parts.append(piece)
        length += len(piece)
    return "".join(parts)


def print_line(line: str) -> None:
    """Print one line of a command's report through :func:`printable`."""
    print(printable(line, LINE_LIMIT))


def _escape(char: str) -> str:
    short = _SHORT_ESCAPES.get(char)
    if short is not None:
        return short
    # Not printable: Unicode's "Other" (control, format such as bidirectional overrides,
    # surrogate, private use, unassigned) and "Separator" characters, but for the ASCII space.
    if char.isprintable():
        return char
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"
