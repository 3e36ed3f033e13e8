"""Unit tests for the pure parts of cdc_relay.sweeper: candidate queue, settings rule, output."""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from psycopg import sql

from cdc_relay.config import OutboxColumns, OutboxTable, Settings, load_settings
from cdc_relay.errors import ConfigError
from cdc_relay.lsn import format_lsn, parse_lsn
from cdc_relay.sweep_queries import Eligible, select_page
from cdc_relay.sweeper import CandidateQueue, Pace, Sweeper, SweepResult, SweptBatch

L1, L2, L3 = parse_lsn("0/100"), parse_lsn("0/200"), parse_lsn("0/300")


def _settings(**values: object) -> Settings:
    base: dict[str, object] = {
        "database_url": "postgresql://relay@db.example/app",
        "kafka_bootstrap_servers": "kafka:9092",
        "sweep_retention_seconds": 0,
        "outbox_tables": (),
    }
    base.update(values)
    return Settings(**base)  # type: ignore[arg-type]


def _load(**values: object) -> Settings:
    """Settings as the relay loads them: a rule between settings is a ConfigError."""
    base: dict[str, object] = {
        "database_url": "postgresql://relay@db.example/app",
        "kafka_bootstrap_servers": "kafka:9092",
        "outbox_tables": (),
    }
    return load_settings(**(base | values))


# -- CandidateQueue -------------------------------------------------------------------------------


def test_nothing_is_taken_without_a_recorded_position() -> None:
    queue = CandidateQueue()
    queue.add(L1, ["a", "b"])
    assert queue.take_covered(None) == []
    assert queue.rows == 2
    assert queue.highest_fence == L1


def test_only_batches_whose_fence_is_covered_are_taken() -> None:
    queue = CandidateQueue()
    queue.add(L1, ["a", "b"])
    queue.add(L2, ["c"])
    queue.add(L3, ["d", "e", "f"])
    assert queue.take_covered(L1 - 1) == []
    taken = queue.take_covered(L2)  # equal to the fence counts as covered
    assert [b.ids for b in taken] == [("a", "b"), ("c",)]
    assert queue.rows == 3
    assert queue.highest_fence == L3
    assert [b.ids for b in queue.take_covered(L3 + 10)] == [("d", "e", "f")]
    assert not queue
    assert queue.rows == 0
    assert queue.highest_fence is None


def test_put_back_restores_order_and_counts() -> None:
    queue = CandidateQueue()
    queue.add(L1, ["a"])
    queue.add(L2, ["b", "c"])
    queue.add(L3, ["d"])
    taken = queue.take_covered(L2)
    queue.put_back(taken[1:])  # the first was deleted, the second could not be
    assert queue.rows == 3
    assert [b.ids for b in queue.take_covered(L3)] == [("b", "c"), ("d",)]


def test_empty_selections_are_not_queued_and_fences_never_go_back() -> None:
    queue = CandidateQueue()
    queue.add(L2, [])
    assert not queue
    queue.add(L2, ["a"])
    with pytest.raises(ValueError, match="backwards"):
        queue.add(L1, ["b"])


def test_covered_counts_what_take_covered_would_take() -> None:
    queue = CandidateQueue()
    queue.add(L1, ["a"])
    queue.add(L2, ["b", "c"])
    queue.add(L3, ["d"])
    assert queue.batches == 3
    assert queue.covered(None) == 0
    assert queue.covered(L2) == 2 == len(queue.take_covered(L2))
    assert queue.batches == 1


# -- Pace -----------------------------------------------------------------------------------------


def test_the_first_statement_of_a_pass_does_not_wait() -> None:
    assert Pace(10, 5.0, now=100.0).rest(100.0) == 0.0


def test_planned_statements_are_spread_evenly_over_the_time_given() -> None:
    pace = Pace(10, 1.0, now=0.0)
    starts, now = [], 0.0
    for _ in range(10):
        now += pace.rest(now)
        starts.append(now)
        now += 0.01  # each statement takes 10 ms
        pace.ran(0.01)
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    # The first at once; the other nine share what is left of the second, equally.
    assert all(gap == pytest.approx(0.99 / 9, abs=1e-9) for gap in gaps), gaps
    assert now == pytest.approx(1.0)  # the last one ends as the time given does


def test_never_busier_than_half_the_time() -> None:
    # Without time to spread over (a sweep on demand), or once the time is used up, or past the
    # statements planned: a rest as long as the statement before took.
    on_demand = Pace(10, 0.0, now=0.0)
    on_demand.ran(0.03)
    assert on_demand.rest(0.03) == 0.03
    late = Pace(3, 1.0, now=0.0)
    late.ran(0.2)
    assert late.rest(0.9) == 0.2
    unplanned = Pace(1, 60.0, now=0.0)
    unplanned.ran(0.05)
    assert unplanned.rest(0.05) == 0.05


# -- configuration --------------------------------------------------------------------------------


def test_retention_without_a_creation_time_column_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="CDC_RELAY_SWEEP_RETENTION_SECONDS") as info:
        _load(sweep_retention_seconds=60, outbox_columns=OutboxColumns(created_at=None))
    assert "public.outbox" in str(info.value)
    assert info.value.exit_code == 2


def test_retention_names_every_table_that_lacks_the_column() -> None:
    with pytest.raises(ConfigError, match=r"app\.b has none"):
        _load(
            sweep_retention_seconds=5,
            outbox_tables=(
                OutboxTable(table="app.a"),
                OutboxTable(table="app.b", columns=OutboxColumns(created_at=None)),
            ),
        )


def test_without_retention_no_creation_time_column_is_needed() -> None:
    sweeper = Sweeper(_settings(outbox_columns=OutboxColumns(created_at=None)))
    assert sweeper.deleted_total == 0
    assert sweeper.rows_waiting == 0
    assert sweeper.last_sweep_at == 0.0


# -- SweepResult.describe -------------------------------------------------------------------------


def test_describe_a_pass_that_deleted_everything() -> None:
    result = SweepResult(position=L3)
    result.add(SweptBatch("public.outbox", L1, L3, ("a", "b"), 0.0))
    result.add(SweptBatch("public.outbox", L2, L3, ("c",), 0.0))
    assert result.deleted == 3
    assert result.describe() == [
        "deleted 3 published row(s) from public.outbox in 2 transaction(s)",
        "nothing waits",
    ]


def test_describe_rows_waiting_for_the_relay() -> None:
    result = SweepResult(waiting=7, position=L1, fence=L2)
    assert result.describe() == [
        "deleted nothing",
        "7 row(s) wait for the relay to confirm past 0/200 (it has confirmed 0/100)",
    ]


def test_describe_rows_waiting_without_any_record() -> None:
    lines = SweepResult(waiting=2, position=None, fence=L2).describe()
    assert lines[-1].startswith("2 row(s) wait: the relay has not recorded a position yet")


def test_describe_tables_not_swept() -> None:
    result = SweepResult(errors={"app.a": "not in publication p (inserts)"})
    assert "not swept app.a: not in publication p (inserts)" in result.describe()


# -- select_page: the fence of a page -------------------------------------------------------------


class _PageConn:
    """A connection whose one statement returns ``rows`` (the fence's text, then the key)."""

    def __init__(self, rows: list[tuple[str, str]]) -> None:
        self.rows = rows

    def execute(self, statement: object, params: object) -> _PageConn:
        return self

    def fetchall(self) -> list[tuple[str, str]]:
        return self.rows


def _page(rows: list[tuple[str, str]]) -> tuple[int, list[object]]:
    swept = SimpleNamespace(
        table=OutboxTable(table="outbox"), key=("id",), key_types=[sql.SQL("uuid")], condition=None
    )
    conn: Any = _PageConn(rows)
    return select_page(conn, swept, None, Eligible(), created_at=None, limit=len(rows) or 1)


@given(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=50))
def test_a_pages_fence_is_the_lowest_wal_position_any_row_read(positions: list[int]) -> None:
    rows = [(format_lsn(p), f"key-{i}") for i, p in enumerate(positions)]
    fence, keys = _page(rows)
    assert fence == min(positions)
    assert keys == [key for _, key in rows]


def test_a_pages_fence_is_parsed_once_per_distinct_position_not_per_row(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A page of 1,000 rows reads the WAL's insert position with every row, nearly always the
    same: parsing each costs ~0.7 µs of the relay's CPU per swept row."""
    parsed: list[str] = []

    def counting(text: str) -> int:
        parsed.append(text)
        return parse_lsn(text)

    monkeypatch.setattr("cdc_relay.sweep_queries.parse_lsn", counting)
    rows = [("0/2000" if n % 500 else "0/1F00", f"key-{n}") for n in range(1000)]
    fence, keys = _page(rows)
    assert fence == parse_lsn("0/1F00")
    assert len(keys) == 1000
    assert len(parsed) <= 2
