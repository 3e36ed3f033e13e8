"""A column's value rewritten by a regular expression and a replacement: topics and keys from parts
of a column (Debezium's ``route.by.field`` + ``route.topic.regex`` / ``route.topic.replacement``).

Why this module exists: tables written by other software keep routing information inside one
column (``shop::order-5f0c…`` = context, category, aggregate id), and a topic template can only
paste whole values. The transform is: the regular expression must match the column's *whole*
value (RE2's syntax, matched in linear time: :mod:`cdc_relay.patterns`; Java's ``(?<name>…)``
names a group as Python's ``(?P<name>…)`` does); the result is the replacement with ``$1`` …
``$99`` or ``${name}`` replaced by the capture groups (Debezium's syntax, so its settings can be
copied); ``$$`` or ``\\$`` is a literal ``$``, ``\\\\`` a literal backslash. A group that did not
take part in the match contributes nothing. A value that does not match, or is longer than
:data:`MAX_INPUT` characters, is refused (the row is dead-lettered), never routed elsewhere: with
the pattern's size bound, the cap bounds what one row's match can cost.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from cdc_relay.patterns import Pattern, PatternError, compile_pattern

MAX_INPUT = 1024  # characters of a column value a transform matches against

# A replacement part: a literal text, or a group (number or name) to insert.
_Part = str | int


class TransformError(PatternError):
    """A pattern or replacement that cannot be used; the message says why."""


@dataclass(frozen=True)
class ColumnTransform:
    """A compiled transform; :meth:`apply` is the per-row work."""

    pattern: Pattern
    parts: tuple[tuple[bool, _Part], ...]  # (is a group, literal text or group reference)
    # The replacement as (UTF-8 literal, group number) steps and a closing literal: a plain loop,
    # which costs less per row than a comprehension or a str.format template over the groups.
    steps: tuple[tuple[bytes, int], ...] = field(init=False, repr=False)
    tail: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        steps: list[tuple[bytes, int]] = []
        literal = b""
        for is_group, part in self.parts:
            if not is_group:
                literal += str(part).encode()
            else:
                number = self.pattern.groupindex[part] if isinstance(part, str) else part
                steps.append((literal, number))
                literal = b""
        object.__setattr__(self, "steps", tuple(steps))
        object.__setattr__(self, "tail", literal)

    def apply(self, value: str) -> str | None:
        """The replacement for ``value``, or None when it is too long or does not match."""
        if len(value) > MAX_INPUT:
            return None
        data = value.encode()
        spans = self.pattern.match(data, 0, len(data))
        if spans[0][0] < 0:
            return None
        # A group that took no part has the span (-1, -1): its slice is empty. Group boundaries
        # fall between characters (\C is refused), so the UTF-8 decodes.
        result = b""
        for literal, group in self.steps:
            start, end = spans[group]
            result += literal + data[start:end]
        return (result + self.tail).decode()


def compile_transform(regex: str, replacement: str) -> ColumnTransform:
    """Check and compile a transform; raise TransformError naming the part that is wrong."""
    try:
        pattern = compile_pattern(regex)
    except PatternError as exc:
        raise TransformError(str(exc)) from None
    return ColumnTransform(pattern, parse_replacement(replacement, pattern))


def parse_replacement(text: str, pattern: Pattern) -> tuple[tuple[bool, _Part], ...]:
    """``$1``, ``${name}``, ``$$``, ``\\x`` → parts; every group must exist in ``pattern``."""
    parts: list[tuple[bool, _Part]] = []
    literal: list[str] = []
    i = 0
    while i < len(text):
        char = text[i]
        if char == "\\":
            if i + 1 >= len(text):
                raise TransformError("replacement ends with a lone backslash")
            literal.append(text[i + 1])
            i += 2
            continue
        if char != "$":
            literal.append(char)
            i += 1
            continue
        if text.startswith("$$", i):
            literal.append("$")
            i += 2
            continue
        group: _Part
        if text.startswith("${", i):
            end = text.find("}", i)
            name = text[i + 2 : end] if end > 0 else ""
            if not name:
                raise TransformError("replacement has ${ without a group name and }")
            if name not in pattern.groupindex:
                raise TransformError(f"replacement names group {name!r}, which regex lacks")
            group, i = name, end + 1
        else:
            digits = re.match(r"[0-9]+", text[i + 1 :])
            if digits is None:
                raise TransformError("replacement has a $ not followed by a group; $$ is a $")
            # Like Java's Matcher: take digits while they still name an existing group.
            number = int(digits.group()[0])
            used = 1
            for digit in digits.group()[1:]:
                if number * 10 + int(digit) > pattern.groups:
                    break
                number, used = number * 10 + int(digit), used + 1
            if number > pattern.groups:
                raise TransformError(f"replacement uses group {number}, which regex lacks")
            group, i = number, i + 1 + used
        if literal:
            parts.append((False, "".join(literal)))
            literal = []
        parts.append((True, group))
    if literal:
        parts.append((False, "".join(literal)))
    return tuple(parts)
