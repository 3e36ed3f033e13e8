"""A column's value rewritten by a regular expression and a replacement: topics and keys from parts
of a column (Debezium's ``route.by.field`` + ``route.topic.regex`` / ``route.topic.replacement``).

Why this module exists: tables written by other software keep routing information inside one
column (``shop::order-5f0c…`` = context, category, aggregate id), and a topic template can only
paste whole values. The transform is: the regular expression must match the column's *whole*
value (Python :mod:`re` syntax, ``re.fullmatch``; Java's ``(?<name>…)`` is read as
``(?P<name>…)``); the result is the replacement with ``$1`` …
``$99`` or ``${name}`` replaced by the capture groups (Debezium's syntax, so its settings can be
copied); ``$$`` or ``\\$`` is a literal ``$``, ``\\\\`` a literal backslash. A group that did not
take part in the match contributes nothing. A value that does not match is refused (the row is
dead-lettered), never routed elsewhere.

Catastrophic backtracking. Python's ``re`` has no time limit, so three guards, two of them
settings rules checked at start: a pattern may not repeat (``*``, ``+``, ``{n,}``, ``{n,m}`` with
m > 1) a group that itself holds a repetition or an alternation — the shapes (``(a+)+``,
``(a|aa)*``) whose matching time grows exponentially; it may repeat at most
:data:`MAX_REPETITIONS` atoms, the degree of the polynomial a pattern like ``.*.*.*x`` costs; and
a value longer than :data:`MAX_INPUT` characters is refused before it is matched. Together they
bound one match to about ``MAX_INPUT ** 3`` steps: ~0.3 s for ``.*.*.*x`` against 1,024
characters that never match, on this project's test machine (patterns with literal separators,
like ``([^:]+)::([^-]+)-(.*)``, match in microseconds).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

MAX_INPUT = 1024  # characters of a column value a transform matches against
MAX_REPETITIONS = 3  # repeated atoms in a pattern: matching costs up to MAX_INPUT ** this
MAX_PATTERN = 1024  # characters of a pattern

# A replacement part: a literal text, or a group (number or name) to insert.
_Part = str | int


class TransformError(ValueError):
    """A pattern or replacement that cannot be used; the message says why."""


@dataclass(frozen=True)
class ColumnTransform:
    """A compiled transform; :meth:`apply` is the per-row work."""

    pattern: re.Pattern[str]
    parts: tuple[tuple[bool, _Part], ...]  # (is a group, literal text or group reference)
    template: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # The replacement as a str.format template over (group 0, group 1, …), unmatched "".
        fields = []
        for is_group, part in self.parts:
            if not is_group:
                fields.append(str(part).replace("{", "{{").replace("}", "}}"))
            else:
                number = self.pattern.groupindex[part] if isinstance(part, str) else part
                fields.append(f"{{{number}}}")
        object.__setattr__(self, "template", "".join(fields))

    def apply(self, value: str) -> str | None:
        """The replacement for ``value``, or None when it is too long or does not match."""
        if len(value) > MAX_INPUT:
            return None
        match = self.pattern.fullmatch(value)
        if match is None:
            return None
        return self.template.format(match.group(0), *match.groups(""))


def compile_transform(regex: str, replacement: str) -> ColumnTransform:
    """Check and compile a transform; raise TransformError naming the part that is wrong."""
    pattern = compile_pattern(regex)
    return ColumnTransform(pattern, parse_replacement(replacement, pattern))


def compile_pattern(regex: str) -> re.Pattern[str]:
    if len(regex) > MAX_PATTERN:
        raise TransformError(f"regex is longer than {MAX_PATTERN} characters")
    regex = _JAVA_NAMED_GROUP.sub("(?P<", regex)
    try:
        pattern = re.compile(regex)
    except re.error as exc:
        raise TransformError(f"regex does not compile: {exc}") from None
    nested, repetitions = _scan(regex)
    if nested is not None:
        raise TransformError(
            f"regex repeats a group holding a repetition or alternation at position {nested} "
            "(exponential backtracking); write it without the nesting"
        )
    if repetitions > MAX_REPETITIONS:
        raise TransformError(
            f"regex repeats {repetitions} atoms, more than {MAX_REPETITIONS} (polynomial "
            "backtracking); use fewer repetitions"
        )
    return pattern


def parse_replacement(text: str, pattern: re.Pattern[str]) -> tuple[tuple[bool, _Part], ...]:
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


# Java's (and so Debezium's) named group ``(?<name>…)``, which Python spells ``(?P<name>…)``;
# not a lookbehind ``(?<=`` / ``(?<!``, not an escaped parenthesis.
_JAVA_NAMED_GROUP = re.compile(r"(?<!\\)\(\?<(?=[A-Za-z_])")

_REPEAT = re.compile(r"[*+]|\{[0-9]*,[0-9]*\}|\{[0-9]+\}")


def nested_repetition(regex: str) -> int | None:
    """Where a group holding a repetition or an alternation is itself repeated, or None.

    A scan of the pattern's text (escapes and character classes skipped), conservative: it may
    refuse a safe pattern, never pass one of the exponential shapes.
    """
    return _scan(regex)[0]


def repetitions(regex: str) -> int:
    """How many atoms or groups ``regex`` repeats more than once (``*``, ``+``, ``{n,m}``)."""
    return _scan(regex)[1]


def _scan(regex: str) -> tuple[int | None, int]:
    # Per open group: does it hold a repetition or alternation?
    stack: list[bool] = [False]
    count = 0
    i = 0
    n = len(regex)
    while i < n:
        char = regex[i]
        if char == "\\":  # an escaped character or class (\d, \w): an atom like any other
            i, repeated = _repetition_after(regex, i + 2)
            if repeated:
                stack[-1] = True
                count += 1
            continue
        if char == "[":
            i = _class_end(regex, i)
            i, repeated = _repetition_after(regex, i)
            if repeated:
                stack[-1] = True
                count += 1
            continue
        if char == "(":
            stack.append(False)
            i += 1
            continue
        if char == ")":
            inner = stack.pop() if len(stack) > 1 else False
            end, repeated = _repetition_after(regex, i + 1)
            if repeated and inner:
                return i, count + 1
            if repeated or inner:
                stack[-1] = True
            count += repeated
            i = end
            continue
        if char == "|":
            stack[-1] = True
            i += 1
            continue
        end, repeated = _repetition_after(regex, i + 1)
        if repeated:
            stack[-1] = True
            count += 1
        i = end
    return None, count


def _repetition_after(regex: str, i: int) -> tuple[int, bool]:
    """After an atom ending before ``i``: (where the next atom starts, is it repeated > once)."""
    match = _REPEAT.match(regex, i)
    if match is None:
        if i < len(regex) and regex[i] == "?":  # zero or one: not a repetition
            return i + 1, False
        return i, False
    token = match.group()
    end = match.end()
    if end < len(regex) and regex[end] in "?+":  # lazy or possessive
        end += 1
    if token.startswith("{"):
        low, _, high = token[1:-1].partition(",")
        if "," not in token:
            return end, int(low or "0") > 1
        return end, high == "" or int(high) > 1
    return end, True


def _class_end(regex: str, i: int) -> int:
    """The index after the character class opening at ``i``."""
    j = i + 1
    if j < len(regex) and regex[j] == "^":
        j += 1
    if j < len(regex) and regex[j] == "]":
        j += 1
    while j < len(regex):
        if regex[j] == "\\":
            j += 2
            continue
        if regex[j] == "]":
            return j + 1
        j += 1
    return j
