"""Row conditions from settings — a small grammar, never SQL text pasted into a statement.

Used for the row filter (which outbox rows are relayed at all) and for the sweeper's condition
(which published rows it may delete). The grammar::

    condition := term ( AND term )*
    term      := column = 'literal' | column <> 'literal'
               | column [NOT] IN ( 'literal' [, 'literal']... )
               | column IS [NOT] NULL
    column    := a plain identifier ([A-Za-z_][A-Za-z0-9_$]*, at most 63), taken as the catalog
                 spells it
    literal   := single-quoted text; '' is a quote inside it

Keywords are case-insensitive. The columns must be ``text`` or ``varchar`` (checked at start):
values are compared as text, which PostgreSQL and the relay then agree on (a ``boolean`` or
``numeric`` has several spellings of one value) — byte for byte, so the columns' collations must
be deterministic (checked at start too). NULL matches nothing but ``IS NULL``, as in SQL.

A parsed :class:`Condition` renders itself with :class:`psycopg.sql.Identifier` and
:class:`psycopg.sql.Literal` only, and evaluates itself on a decoded row (for wal2json, which
ignores publications, and PostgreSQL 14, which has no row filters). :func:`parse_deparsed` reads
back PostgreSQL's own rendering of a publication's row filter (``pg_publication_tables.rowfilter``)
so that the relay can tell whether an existing publication filters as the settings say.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from psycopg import sql

Operator = Literal["=", "<>", "in", "not in", "is null", "is not null"]

MAX_LENGTH = 4096  # characters of a condition; a setting, not a document

_TOKEN = re.compile(
    r"""
    \s*(?:
      (?P<string>'(?:[^']|'')*')
    | (?P<quoted>"(?:[^"]|"")+")
    | (?P<word>[A-Za-z_][A-Za-z0-9_$]*)
    | (?P<op><>|!=|=|::|\(|\)|,|\[|\]|\.)
    )""",
    re.VERBOSE,
)
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_$]{0,62}\Z")
_KEYWORDS = frozenset({"and", "in", "is", "not", "null", "or", "any", "all", "array"})


class ConditionError(ValueError):
    """The text is not a condition of the grammar; the message says where and why."""


@dataclass(frozen=True)
class Term:
    column: str
    op: Operator
    values: tuple[str, ...] = ()

    def render(self) -> sql.Composable:
        column = sql.Identifier(self.column)
        if self.op in ("is null", "is not null"):
            return sql.SQL("{} {}").format(column, sql.SQL(self.op.upper()))
        if self.op in ("=", "<>"):
            return sql.SQL("{} {} {}").format(column, sql.SQL(self.op), sql.Literal(self.values[0]))
        items = sql.SQL(", ").join(sql.Literal(v) for v in self.values)
        return sql.SQL("{} {} ({})").format(column, sql.SQL(self.op.upper()), items)

    def matcher(self, index: int) -> Callable[[Sequence[object]], bool]:
        """A test of the row's ``index``-th value (bytes: the value's text; None: NULL)."""
        if self.op == "is null":
            return lambda row: row[index] is None
        if self.op == "is not null":
            return lambda row: row[index] is not None
        wanted = frozenset(v.encode() for v in self.values)
        if self.op in ("=", "in"):
            return lambda row: type(value := row[index]) is bytes and value in wanted
        return lambda row: type(value := row[index]) is bytes and value not in wanted


@dataclass(frozen=True)
class Condition:
    """Terms that must all hold (AND)."""

    terms: tuple[Term, ...]

    @property
    def columns(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(t.column for t in self.terms))

    def render(self) -> sql.Composable:
        """The condition as SQL, each term parenthesised."""
        return sql.SQL(" AND ").join(sql.SQL("({})").format(t.render()) for t in self.terms)

    def same_as(self, other: Condition) -> bool:
        """The same terms, in any order (AND commutes)."""
        return frozenset(_normal(t) for t in self.terms) == frozenset(
            _normal(t) for t in other.terms
        )

    def matcher(self, positions: Mapping[str, int]) -> Callable[[Sequence[object]], bool]:
        """A test of decoded rows whose columns are at ``positions``; KeyError for a column the
        relation lacks."""
        tests = [t.matcher(positions[t.column]) for t in self.terms]
        if len(tests) == 1:
            return tests[0]
        return lambda row: all(test(row) for test in tests)

    def __str__(self) -> str:
        return " AND ".join(_text(t) for t in self.terms)


def _normal(term: Term) -> Term:
    values = tuple(sorted(set(term.values)))
    if term.op == "in" and len(values) == 1:
        return Term(term.column, "=", values)
    if term.op == "not in" and len(values) == 1:
        return Term(term.column, "<>", values)
    return Term(term.column, term.op, values)


def _text(term: Term) -> str:
    name = term.column  # the grammar takes names as written: no quotes
    quoted = [f"'{v.replace(chr(39), chr(39) * 2)}'" for v in term.values]
    if term.op in ("is null", "is not null"):
        return f"{name} {term.op.upper()}"
    if term.op in ("=", "<>"):
        return f"{name} {term.op} {quoted[0]}"
    return f"{name} {term.op.upper()} ({', '.join(quoted)})"


# -- parsing the setting ---------------------------------------------------------------------


def _tokens(text: str) -> Iterator[tuple[str, str, int]]:
    pos = 0
    while pos < len(text):
        if text[pos:].strip() == "":
            return
        match = _TOKEN.match(text, pos)
        if match is None:
            start = len(text) - len(text[pos:].lstrip())
            raise ConditionError(f"unexpected character at position {start + 1}")
        kind = match.lastgroup
        assert kind is not None
        yield kind, match.group(kind), match.start(kind)
        pos = match.end()


class _Reader:
    def __init__(self, tokens: list[tuple[str, str, int]], what: str) -> None:
        self.tokens = tokens
        self.at = 0
        self.what = what

    def peek(self) -> tuple[str, str, int] | None:
        return self.tokens[self.at] if self.at < len(self.tokens) else None

    def take(self) -> tuple[str, str, int]:
        token = self.peek()
        if token is None:
            raise ConditionError(f"{self.what} ends too early")
        self.at += 1
        return token

    def keyword(self, *words: str) -> bool:
        token = self.peek()
        if token is not None and token[0] == "word" and token[1].lower() in words:
            self.at += 1
            return True
        return False

    def expect(self, kind: str, value: str | None = None) -> str:
        token = self.take()
        if token[0] != kind or (value is not None and token[1].lower() != value):
            wanted = value or ("a 'quoted' literal" if kind == "string" else kind)
            raise ConditionError(f"expected {wanted} at position {token[2] + 1}")
        return token[1]

    def comma(self) -> bool:
        token = self.peek()
        if token is not None and token[1] == ",":
            self.at += 1
            return True
        return False

    def fail(self, reason: str) -> ConditionError:
        token = self.peek()
        where = f" at position {token[2] + 1}" if token else " at the end"
        return ConditionError(f"{reason}{where}")


def _literal(text: str) -> str:
    value = text[1:-1].replace("''", "'")
    if "\x00" in value:
        raise ConditionError("a literal may not contain NUL")
    return value


def parse(text: str) -> Condition:
    """A condition of the grammar in the module documentation; ConditionError otherwise."""
    if len(text) > MAX_LENGTH:
        raise ConditionError(f"longer than {MAX_LENGTH} characters")
    reader = _Reader(list(_tokens(text)), "the condition")
    if reader.peek() is None:
        raise ConditionError("empty: leave the setting unset for no condition")
    terms = [_term(reader)]
    while reader.peek() is not None:
        if not reader.keyword("and"):
            raise reader.fail("expected AND (only AND combines terms)")
        terms.append(_term(reader))
    return Condition(tuple(terms))


def _term(reader: _Reader) -> Term:
    kind, word, at = reader.take()
    if kind != "word" or word.lower() in _KEYWORDS:
        raise ConditionError(f"expected a column name at position {at + 1}")
    if not _IDENTIFIER.match(word):
        raise ConditionError(f"column name too long at position {at + 1}")
    if reader.keyword("is"):
        negated = reader.keyword("not")
        if not reader.keyword("null"):
            raise reader.fail("expected NULL")
        return Term(word, "is not null" if negated else "is null")
    if reader.keyword("not"):
        if not reader.keyword("in"):
            raise reader.fail("expected IN after NOT")
        return Term(word, "not in", _list(reader))
    if reader.keyword("in"):
        return Term(word, "in", _list(reader))
    token = reader.take()
    if token[0] != "op" or token[1] not in ("=", "<>", "!="):
        raise ConditionError(f"expected =, <>, IN or IS at position {token[2] + 1}")
    op: Operator = "=" if token[1] == "=" else "<>"
    return Term(word, op, (_literal(reader.expect("string")),))


def _list(reader: _Reader) -> tuple[str, ...]:
    reader.expect("op", "(")
    values = [_literal(reader.expect("string"))]
    while reader.comma():
        values.append(_literal(reader.expect("string")))
    reader.expect("op", ")")
    return tuple(values)


# -- reading back PostgreSQL's rendering of a publication's row filter ----------------------


def parse_deparsed(text: str) -> Condition | None:
    """PostgreSQL's rendering of a row filter (``pg_get_expr``) as a condition of the grammar,
    or None when it is not one (any other filter).

    What PostgreSQL adds is dropped: parentheses, casts (``::text``, ``::character varying[]``),
    ``ARRAY[...]``; ``= ANY (ARRAY[...])`` reads as IN, ``<> ALL (ARRAY[...])`` as NOT IN.
    """
    try:
        tokens = [t for t in _tokens(text) if t[1] not in ("(", ")")]
    except ConditionError:
        return None
    plain: list[tuple[str, str, int]] = []
    i = 0
    while i < len(tokens):
        kind, value, at = tokens[i]
        if value == "::":  # a cast: a type name of one or two words, maybe an array
            i += 1
            if i < len(tokens) and tokens[i][1].lower() in ("character", "double"):
                i += 1
            i += 1
            if i + 1 < len(tokens) and tokens[i][1] == "[" and tokens[i + 1][1] == "]":
                i += 2
            continue
        if kind == "quoted":
            kind, value = "word", value[1:-1].replace('""', '"')
        plain.append((kind, value, at))
        i += 1
    reader = _Reader(plain, "the filter")
    try:
        terms = [_deparsed_term(reader)]
        while reader.peek() is not None:
            if not reader.keyword("and"):
                return None
            terms.append(_deparsed_term(reader))
    except ConditionError:
        return None
    return Condition(tuple(terms))


def _deparsed_term(reader: _Reader) -> Term:
    kind, column, at = reader.take()
    if kind != "word" or column.lower() in _KEYWORDS:
        raise ConditionError(f"expected a column at {at}")
    if reader.keyword("is"):
        negated = reader.keyword("not")
        reader.expect("word", "null")
        return Term(column, "is not null" if negated else "is null")
    op = reader.expect("op")
    if op not in ("=", "<>"):
        raise ConditionError("unexpected operator")
    if reader.keyword("any", "all"):
        quantifier = reader.tokens[reader.at - 1][1].lower()
        if (op, quantifier) not in (("=", "any"), ("<>", "all")):
            raise ConditionError("unexpected quantifier")
        reader.expect("word", "array")
        reader.expect("op", "[")
        values = [_literal(reader.expect("string"))]
        while reader.comma():
            values.append(_literal(reader.expect("string")))
        reader.expect("op", "]")
        return Term(column, "in" if op == "=" else "not in", tuple(values))
    return Term(column, "=" if op == "=" else "<>", (_literal(reader.expect("string")),))
