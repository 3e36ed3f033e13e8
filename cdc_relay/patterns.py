"""Patterns that operators write and rows are matched against, in time linear in the text.

Why this module exists: a pattern in the settings (``CDC_RELAY_TOPIC_ALLOWLIST``, the ``regex`` of
``topic_from`` / ``key_from``) meets text that any writer of the outbox chooses. Python's :mod:`re`
backtracks: ``([a-z0-9]+[_-]?)+`` takes time exponential in the length of a value it does not
match, and no inspection of a pattern's text tells every such pattern apart. RE2 (the
``google-re2`` package) runs a pattern as an automaton, never backtracking: one match costs at
most a constant times the text's length times the compiled program's size. It refuses what only
a backtracking engine can do (backreferences, lookaround, atomic groups, possessive quantifiers,
conditionals), and this module refuses those at start with the reason (:class:`PatternError`, a
ValueError the settings report with the setting's name: exit 2).

The syntax is RE2's, which is Python's for everything both accept, except: ``\\d``, ``\\w``,
``\\s`` and ``\\b`` are ASCII only (as in Java, where Debezium's patterns come from); the end of the
text is ``\\z`` (Python's ``\\Z`` is refused with that hint; every match is of the whole text
anyway); there is no ``(?x)`` verbose mode and no ``(?#…)`` comment; ``(?<name>…)`` (Java's) and
``(?P<name>…)`` both name a group; ``\\C`` (one byte, which may split a character) is refused; a
group repeated by ``*`` or ``+`` whose body can match nothing captures its last non-empty
iteration, where Python captures an empty one. A pattern has at most
:data:`MAX_PATTERN` characters and compiles to at most :data:`MAX_PROGRAM` instructions: with the
callers' cap on the text's length, that bounds one match (see ``docs/security.md``).

The per-row call is RE2's own match on UTF-8 bytes (:attr:`Pattern.match`), without the ``re2``
module's Python-level offset translation, which costs several times the match itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from functools import partial
from typing import Any, Final

MAX_PATTERN: Final = 1024  # characters of a pattern
MAX_PROGRAM: Final = 5_000  # RE2 instructions: a match costs up to about this much per byte
_RE2_REPETITION_LIMIT = 1000  # RE2's own limit on a counted repetition {n,m}

Span = tuple[int, int]  # byte offsets of a group in the text; (-1, -1) when it took no part


class PatternError(ValueError):
    """A pattern that cannot be used; the message says why."""


class Pattern:
    """A compiled pattern, matched against the *whole* text (like ``re.fullmatch``)."""

    __slots__ = ("groupindex", "groups", "match", "program_size", "regex")

    def __init__(self, regex: str, compiled: Any, anchor: Any) -> None:
        self.regex = regex
        # RE2's own call, for a per-row caller: match(data, 0, len(data)) gives every group's
        # span, group 0 first, and group 0's span is (-1, -1) when the text does not match.
        self.match: Callable[[bytes, int, int], list[Span]] = partial(compiled.Match, anchor)
        self.groups: int = compiled.NumberOfCapturingGroups()
        self.program_size: int = compiled.ProgramSize()
        self.groupindex: Mapping[str, int] = {
            name.decode(): index for name, index in compiled.NamedCapturingGroups()
        }

    def spans(self, data: bytes) -> list[Span] | None:
        """Group 0's span and every group's in UTF-8 ``data``; None when it does not match."""
        spans = self.match(data, 0, len(data))
        return None if spans[0][0] < 0 else spans

    def fullmatch(self, text: str) -> bool:
        """Does ``text`` match as a whole?"""
        try:
            data = text.encode()
        except UnicodeEncodeError:  # a lone surrogate: no pattern matches what is not text
            return False
        return self.spans(data) is not None


def compile_pattern(regex: str, *, capture: bool = True) -> Pattern:
    """Check and compile ``regex``; PatternError naming what is wrong. Without ``capture`` the
    groups only group (no spans are kept: the fastest match, for a yes or no)."""
    if len(regex) > MAX_PATTERN:
        raise PatternError(f"regex is longer than {MAX_PATTERN} characters")
    for escaped in _escapes(regex):
        if escaped == "C":
            raise PatternError(r"\C (a single byte, which may split a character) is not supported")
        if escaped == "Z":
            raise PatternError(
                r"\Z is written \z here (RE2's syntax); the whole value must match anyway"
            )
    try:
        data = regex.encode()
    except UnicodeEncodeError:
        raise PatternError("regex is not valid text (a lone surrogate)") from None
    from re2 import _re2  # noqa: PLC0415 (only relays with a pattern load RE2)

    options = _re2.RE2.Options()
    options.log_errors = False  # the reason goes into our error, not to stderr
    options.never_capture = not capture
    compiled = _re2.RE2(data, options)
    if not compiled.ok():
        raise PatternError(_reason(regex, compiled.error().decode(errors="replace")))
    pattern = Pattern(regex, compiled, _re2.RE2.Anchor.ANCHOR_BOTH)
    if pattern.program_size > MAX_PROGRAM:
        raise PatternError(
            f"regex compiles to {pattern.program_size} instructions, more than {MAX_PROGRAM} "
            "(every byte matched may cost that many steps): use smaller counted repetitions "
            "{n,m}, or + and *"
        )
    return pattern


_UNSUPPORTED: Final = (
    # (what RE2's error shows, why it is refused); the first that applies names the reason
    ("(?=", "lookahead (?=…) is not supported (linear-time matching)"),
    ("(?!", "negative lookahead (?!…) is not supported (linear-time matching)"),
    ("(?<=", "lookbehind (?<=…) is not supported (linear-time matching)"),
    ("(?<!", "negative lookbehind (?<!…) is not supported (linear-time matching)"),
    ("(?>", "atomic groups (?>…) are not supported (linear-time matching)"),
    ("(?(", "conditionals (?(…)…) are not supported (linear-time matching)"),
    ("(?#", "comments (?#…) are not supported"),
    ("(?x", "verbose mode (?x) is not supported"),
)
_BACKREFERENCE: Final = "backreferences are not supported (linear-time matching)"


def _reason(regex: str, error: str) -> str:
    """RE2's error, said in terms of the pattern an operator wrote."""
    escaped = error.removeprefix("invalid escape sequence: \\")[:1]  # \1, \k<name>: references
    if (error.endswith(": (?P") and "(?P=" in regex) or (escaped and escaped in "0123456789kg"):
        return _BACKREFERENCE  # RE2 shows only the "(?P" of "(?P=name)"
    for shown, reason in _UNSUPPORTED:
        if error.endswith(f": {shown}"):
            return reason
    if error.startswith("bad repetition operator:") and error.endswith("+"):
        return "possessive quantifiers (*+, ++, ?+, {n}+) are not supported (linear-time matching)"
    if error.startswith("invalid repetition size"):
        return (
            f"{error}: a counted repetition {{n,m}}, nested ones multiplied, may repeat at most "
            f"{_RE2_REPETITION_LIMIT} times"
        )
    what = (
        "compiles to more than RE2's memory limit allows"
        if "too large" in error
        else "does not compile"
    )
    return f"regex {what}: {error}"


def _escapes(regex: str) -> Iterator[str]:
    """The characters that follow a backslash (an escape), in and outside character classes."""
    i = regex.find("\\")
    while 0 <= i < len(regex) - 1:
        yield regex[i + 1]
        i = regex.find("\\", i + 2)
