"""The relay's recorded row filters against a sweeper's: the same meaning in any spelling is the
same filter, anything else (or anything unreadable in the record) is a difference."""

from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from cdc_relay.config import OutboxTable
from cdc_relay.relayed_filters import differences, recorded_form, same
from cdc_relay.row_filter import Condition, Term
from tests.unit.test_row_filter import conditions, literals


def _table(condition: Condition | None, name: str = "public.outbox") -> OutboxTable:
    return OutboxTable(table=name, row_filter=None if condition is None else str(condition))


@given(conditions, st.randoms())
def test_the_relays_filter_in_any_order_is_the_same(condition: Condition, random: object) -> None:
    recorded = recorded_form([_table(condition)])
    terms = list(condition.terms)
    random.shuffle(terms)  # type: ignore[attr-defined]
    assert differences(recorded, [_table(Condition(tuple(terms)))]) == []


@given(conditions, literals)
def test_a_filter_with_another_value_is_a_difference(condition: Condition, value: str) -> None:
    first = condition.terms[0]
    if first.op in ("is null", "is not null"):
        changed = Term(first.column, "=", (value,))
    elif first.op in ("=", "<>"):
        changed = Term(first.column, first.op, (first.values[0] + value + "\x01",))
    else:
        changed = Term(first.column, first.op, (*first.values, value + "\x01"))
    other = Condition((changed, *condition.terms[1:]))
    assume(not other.same_as(condition))
    recorded = recorded_form([_table(condition)])
    found = differences(recorded, [_table(other)])
    assert found is not None
    assert [d.relayed for d in found] == [str(condition)]
    assert "Sweep with the relay's settings" in found[0].describe(several=False)


@given(conditions)
def test_no_filter_and_a_filter_differ_both_ways(condition: Condition) -> None:
    assert differences(recorded_form([_table(None)]), [_table(condition)]) != []
    assert differences(recorded_form([_table(condition)]), [_table(None)]) != []
    assert differences(recorded_form([_table(None)]), [_table(None)]) == []


@given(st.one_of(st.none(), st.integers(), st.text(), st.lists(st.text())))
def test_a_record_that_is_not_an_object_has_no_filters(recorded: object) -> None:
    assert differences(recorded, [_table(None)]) is None


@given(st.dictionaries(st.text(max_size=20), st.one_of(st.text(max_size=60), st.none())))
def test_any_recorded_object_is_judged_without_error(recorded: dict[str, str | None]) -> None:
    for table in (_table(None), _table(Condition((Term("dest", "=", ("kafka",)),)))):
        found = differences({**recorded, table.table: recorded.get("x")}, [table])
        assert found is not None
        text = recorded.get("x")
        assert (found == []) == same(text, table.filter)


def test_a_table_the_relay_does_not_relay_is_a_difference() -> None:
    found = differences({"public.other": None}, [_table(None)])
    assert found is not None
    assert not found[0].known
    assert "not among the tables the relay relays" in found[0].describe(several=False)


@pytest.mark.parametrize("value", [3, ["dest = 'kafka'"], {"a": 1}])
def test_a_recorded_value_that_is_not_text_or_null_has_no_filters(value: object) -> None:
    assert differences({"public.outbox": value}, [_table(None)]) is None


def test_the_fix_names_the_setting() -> None:
    relayed = Condition((Term("dest", "=", ("kafka",)),))
    (one,) = differences(recorded_form([_table(relayed)]), [_table(None)]) or []
    assert "CDC_RELAY_OUTBOX_ROW_FILTER=dest = 'kafka'" in one.describe(several=False)
    assert "this sweeper's is none" in one.describe(several=False)
    assert '"row_filter" of public.outbox in CDC_RELAY_OUTBOX_TABLES' in one.describe(True)
