"""The condition grammar of row filters and sweep conditions: parsing, SQL rendering, evaluation
on decoded rows, and reading PostgreSQL's rendering back."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cdc_relay.row_filter import (
    Condition,
    ConditionError,
    Operator,
    Term,
    parse,
    parse_deparsed,
)

KEYWORDS = {"and", "in", "is", "not", "null", "or", "any", "all", "array"}

columns = st.from_regex(r"[A-Za-z_][A-Za-z0-9_$]{0,20}", fullmatch=True).filter(
    lambda c: c.lower() not in KEYWORDS
)
literals = st.text(
    st.characters(exclude_characters="\x00", categories=("L", "N", "P", "S", "Z", "Cc")),
    max_size=12,
)


@st.composite
def terms(draw: st.DrawFn) -> Term:
    column = draw(columns)
    ops: list[Operator] = ["=", "<>", "in", "not in", "is null", "is not null"]
    op = draw(st.sampled_from(ops))
    if op in ("is null", "is not null"):
        return Term(column, op)
    count = 1 if op in ("=", "<>") else draw(st.integers(1, 4))
    return Term(column, op, tuple(draw(literals) for _ in range(count)))


conditions = st.lists(terms(), min_size=1, max_size=4).map(lambda ts: Condition(tuple(ts)))


@given(conditions)
def test_a_condition_reads_back_from_its_text(condition: Condition) -> None:
    again = parse(str(condition))
    assert again == condition


@given(st.text(max_size=80))
def test_any_text_is_a_condition_or_a_condition_error(text: str) -> None:
    try:
        condition = parse(text)
    except ConditionError:
        return
    assert condition.terms


@given(conditions)
def test_the_sql_keeps_every_literal_inside_its_quotes(condition: Condition) -> None:
    rendered = condition.render().as_string(None)
    # Remove the literals (psycopg's quoting: '' inside, maybe an E prefix for backslashes) and
    # the quoted identifiers: what is left is the grammar's own words and punctuation.
    rest = re.sub(r"E?'(?:[^']|'')*'", "", rendered)
    rest = re.sub(r'"(?:[^"]|"")*"', "", rest)
    assert set(re.findall(r"[A-Za-z]+", rest)) <= {"AND", "IN", "NOT", "IS", "NULL"}, rendered
    assert ";" not in rest


def _reference(term: Term, value: bytes | None) -> bool:
    if term.op == "is null":
        return value is None
    if term.op == "is not null":
        return value is not None
    if value is None:
        return False  # NULL = x and NULL IN (...) are not true
    text = value.decode()
    return (text in term.values) == (term.op in ("=", "in"))


@given(conditions, st.data())
def test_rows_match_as_sql_would_compare_their_text(
    condition: Condition, data: st.DataObject
) -> None:
    names = list(dict.fromkeys(t.column for t in condition.terms))
    positions = {name: i for i, name in enumerate(names)}
    values = [
        data.draw(
            st.one_of(
                st.none(),
                st.sampled_from([v for t in condition.terms for v in t.values] or ["x"]),
                literals,
            ).map(lambda v: None if v is None else v.encode())
        )
        for _ in names
    ]
    row = tuple(values)
    expected = all(_reference(t, row[positions[t.column]]) for t in condition.terms)
    assert condition.matcher(positions)(row) is expected


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", "empty"),
        ("status = published", "expected a 'quoted' literal"),
        ("status = 'a' OR x = 'b'", "expected AND"),
        ("status = 'a'; DROP TABLE outbox", "unexpected character"),
        ("status > 'a'", "unexpected character"),
        ("lower(status) = 'a'", "expected =, <>, IN or IS"),
        ("status IN ()", "expected a 'quoted' literal"),
        ("status IS 'a'", "expected NULL"),
        ("and = 'a'", "expected a column name"),
        ("status = 'a\x00'", "NUL"),
        ("status = 'open", "unexpected character"),
    ],
)
def test_what_is_not_in_the_grammar_is_refused(text: str, problem: str) -> None:
    with pytest.raises(ConditionError, match=problem):
        parse(text)


def test_keywords_are_case_insensitive_and_names_literal() -> None:
    condition = parse("Status in ('a', 'it''s') and X is not null AND y != 'q'")
    assert condition.terms == (
        Term("Status", "in", ("a", "it's")),
        Term("X", "is not null"),
        Term("y", "<>", ("q",)),
    )
    assert condition.render().as_string(None) == (
        "(\"Status\" IN ('a', 'it''s')) AND (\"X\" IS NOT NULL) AND (\"y\" <> 'q')"
    )


@pytest.mark.parametrize(
    ("deparsed", "setting"),
    [  # as PostgreSQL 15-18 print pg_publication_tables.rowfilter
        ("((target_broker)::text = 'kafka'::text)", "target_broker = 'kafka'"),
        ("(status = 'a''b'::text)", "status = 'a''b'"),
        (
            "((target_broker)::text = ANY ((ARRAY['a'::character varying, "
            "'b'::character varying])::text[]))",
            "target_broker IN ('b', 'a')",
        ),
        ("(s <> ALL (ARRAY['a'::text, 'b'::text]))", "s NOT IN ('a', 'b')"),
        ('(("Status" IS NULL) AND (x IS NOT NULL))', "x IS NOT NULL AND Status IS NULL"),
        ("((a)::text <> 'x'::text)", "a <> 'x'"),
    ],
)
def test_postgresqls_rendering_reads_back(deparsed: str, setting: str) -> None:
    found = parse_deparsed(deparsed)
    assert found is not None
    assert found.same_as(parse(setting))


@pytest.mark.parametrize(
    "deparsed",
    [
        "(lower((s)::text) = 'a'::text)",
        "((a)::text = 'x'::text) OR (b IS NULL)",
        "(n > 3)",
        "((a)::text = (b)::text)",
    ],
)
def test_other_filters_are_not_taken_for_ours(deparsed: str) -> None:
    assert parse_deparsed(deparsed) is None


def test_a_different_filter_is_not_the_same() -> None:
    assert not parse("a = 'x'").same_as(parse("a = 'y'"))
    assert not parse("a = 'x'").same_as(parse("a = 'x' AND b IS NULL"))
    assert parse("a IN ('x')").same_as(parse("a = 'x'"))


def _as_postgresql_prints(condition: Condition, varchar: bool) -> str:
    """pg_get_expr's rendering of the filter the relay creates, for text or varchar columns."""

    def name(column: str) -> str:
        plain = re.fullmatch(r"[a-z_][a-z0-9_$]*", column) and column not in KEYWORDS
        quoted = column if plain else '"' + column.replace('"', '""') + '"'
        return f"({quoted})::text" if varchar else quoted

    def lit(value: str, kind: str = "text") -> str:
        return "'" + value.replace("'", "''") + "'::" + kind

    parts = []
    for term in condition.terms:
        if term.op in ("is null", "is not null"):
            parts.append(f"({name(term.column).removesuffix('::text')} {term.op.upper()})")
        elif term.op in ("=", "<>"):
            parts.append(f"({name(term.column)} {term.op} {lit(term.values[0])})")
        else:
            kind = "character varying" if varchar else "text"
            array = "ARRAY[" + ", ".join(lit(v, kind) for v in term.values) + "]"
            if varchar:
                array = f"({array})::text[]"
            quantifier = "= ANY" if term.op == "in" else "<> ALL"
            parts.append(f"({name(term.column)} {quantifier} ({array}))")
    return parts[0] if len(parts) == 1 else "(" + " AND ".join(parts) + ")"


@given(conditions, st.booleans())
def test_postgresqls_rendering_of_any_filter_reads_back(
    condition: Condition, varchar: bool
) -> None:
    deparsed = _as_postgresql_prints(condition, varchar)
    found = parse_deparsed(deparsed)
    assert found is not None, deparsed
    assert found.same_as(condition), deparsed


@given(st.text(max_size=120))
def test_any_rendering_is_a_condition_or_none(text: str) -> None:
    found = parse_deparsed(text)
    assert found is None or found.terms
