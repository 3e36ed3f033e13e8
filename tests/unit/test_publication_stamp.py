"""The publication's stamp (:mod:`cdc_relay.publication_stamp`) as pure logic: what a difference
between two stamps means to an operator, which differences can have kept rows from the slot for
each plugin, what a recorded stamp may be, and the statement that reads one. PostgreSQL's side
(which DDL writes which catalog row) is proven in tests/integration/test_dba_changes.py."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given
from hypothesis import strategies as st

from cdc_relay.config import OutboxTable, Plugin
from cdc_relay.errors import PublicationChanged
from cdc_relay.publication_stamp import (
    PublicationStamp,
    StampQuery,
    change_error,
    changes,
    parse,
    unrelayed_changes,
    unrelayed_message,
)
from tests.fakes import publication_stamp

VERIFIED = publication_stamp()


def _whats(before: PublicationStamp, now: PublicationStamp) -> list[str]:
    return [change.what for change in changes(None, before, now)]


def test_the_same_stamp_has_no_changes() -> None:
    assert changes(None, VERIFIED, publication_stamp()) == []
    assert unrelayed_changes(None, VERIFIED, publication_stamp()) == []


def test_each_catalog_row_names_its_change() -> None:
    assert _whats(VERIFIED, publication_stamp(rel=[])) == [
        "public.outbox was dropped from publication cdc_relay_outbox and added again, or its "
        "row filter or column list was set (ALTER PUBLICATION ... SET TABLE)"
    ]
    gone = PublicationStamp({**VERIFIED.data, "tables": [{**VERIFIED.tables()[0], "rel": None}]})
    assert _whats(VERIFIED, gone) == ["public.outbox is no longer in publication cdc_relay_outbox"]
    assert _whats(VERIFIED, publication_stamp(pub=["16396", "800"])) == [
        "publication cdc_relay_outbox was altered (ALTER PUBLICATION ... SET, RENAME or OWNER TO)"
    ]
    assert _whats(VERIFIED, publication_stamp(pub=["17000", "800"])) == [
        "publication cdc_relay_outbox was dropped and created again"
    ]
    dropped = PublicationStamp({**VERIFIED.data, "pub": None})
    assert _whats(VERIFIED, dropped) == [
        "publication cdc_relay_outbox no longer exists (dropped, or renamed)"
    ]
    recreated = publication_stamp(oid="17001", rel=[])
    recreated = PublicationStamp(
        {**recreated.data, "tables": [{**recreated.tables()[0], "rel": None}]}
    )
    assert _whats(VERIFIED, recreated) == [
        "public.outbox was dropped and re-created (oid 16400, now 17001, a table), and the new "
        "one is not in publication cdc_relay_outbox"
    ]


def test_a_change_stops_the_relay_naming_it_and_the_fix() -> None:
    error = change_error(None, VERIFIED, publication_stamp(rel=[]), "0/16B3748")
    assert isinstance(error, PublicationChanged)
    assert error.exit_code == 3
    assert str(error).startswith(
        "the publication or an outbox table changed under the relay: public.outbox was dropped "
        "from publication cdc_relay_outbox and added again"
    )
    assert "Fix: make publication cdc_relay_outbox publish the inserts of every outbox" in str(
        error
    )
    assert "(it resumes at 0/16B3748)" in str(error)


def test_pgoutput_loses_nothing_to_a_rename_and_wal2json_may() -> None:
    """Renamed and back (only the row type's pg_type row shows it): pgoutput sends by oid."""
    renamed = publication_stamp(type_xmin="900")
    assert [c.what for c in unrelayed_changes(None, VERIFIED, renamed)] == []
    assert _whats(VERIFIED, renamed) == [
        "public.outbox was renamed (and back), or its owner changed"
    ]
    wal2json = publication_stamp(plugin="wal2json")
    found = unrelayed_changes(None, wal2json, publication_stamp(plugin="wal2json", type_xmin="9"))
    assert [c.what for c in found] == ["public.outbox was renamed (and back), or its owner changed"]


def test_a_table_configured_under_its_new_name_is_lossless_only_for_pgoutput() -> None:
    moved = publication_stamp(table="public.outbox_old")
    assert unrelayed_changes(None, VERIFIED, moved) == []
    found = unrelayed_changes(
        None,
        publication_stamp(plugin="wal2json"),
        publication_stamp(plugin="wal2json", table="public.outbox_old"),
    )
    assert [c.what for c in found] == [
        "public.outbox (oid 16400) is configured as public.outbox_old now: wal2json selects rows "
        "by name, and did not send those written under the other one"
    ]


def test_wal2json_does_not_read_the_publication() -> None:
    stamp = publication_stamp(plugin="wal2json")
    assert set(stamp.data) == {"plugin", "publication", "tables"}
    assert "rel" not in stamp.tables()[0]


def test_nothing_recorded_or_another_plugin_or_publication_names_nothing() -> None:
    assert unrelayed_changes(None, None, VERIFIED) == []
    assert unrelayed_changes(None, publication_stamp(plugin="wal2json"), VERIFIED) == []
    other = PublicationStamp({**VERIFIED.data, "publication": "another"})
    assert unrelayed_changes(None, other, publication_stamp(rel=[])) == []


def test_table_oids_are_the_tables_found_at_the_start() -> None:
    assert VERIFIED.table_oids() == {16400: "public.outbox"}
    assert publication_stamp(oid=None).table_oids() == {}


def test_a_recorded_stamp_is_one_of_ours_or_none() -> None:
    assert parse(VERIFIED.data) == VERIFIED
    assert parse(orjson.loads(VERIFIED.text)) == VERIFIED
    assert parse(None) is None
    assert parse({"plugin": "decoderbufs", "publication": "p", "tables": []}) is None
    assert parse({"plugin": "pgoutput", "publication": "p", "tables": [{"table": 1}]}) is None
    many = [dict(VERIFIED.tables()[0])] * 257
    assert parse({**VERIFIED.data, "tables": many}) is None


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


@given(JSON)
def test_any_json_a_record_holds_parses_or_is_refused_never_raises(value: Any) -> None:
    stamp = parse(value)
    if stamp is not None:
        stamp.table_oids()


@given(
    st.fixed_dictionaries(
        {"plugin": st.sampled_from(["pgoutput", "wal2json"]), "publication": st.text(max_size=8)}
    ),
    st.lists(
        st.fixed_dictionaries(
            {
                "table": st.text(max_size=8),
                "schema": st.text(max_size=8),
                "name": st.text(max_size=8),
            },
            optional={"oid": st.none() | st.text(max_size=6), "rel": JSON, "type": JSON},
        ),
        max_size=3,
    ),
)
def test_any_two_recorded_stamps_compare_without_raising(
    head: dict[str, str], tables: list[dict[str, Any]]
) -> None:
    recorded = parse({**head, "tables": tables})
    assert recorded is not None
    unrelayed_changes(None, recorded, VERIFIED)
    changes(None, recorded, VERIFIED)


def test_the_statement_takes_names_as_literals_whatever_they_hold() -> None:
    """Names reach it as literals (a recorded stamp's too, which anyone with UPDATE on the
    record may have written), never as SQL text."""
    tables = (("public", "x'); DROP TABLE t; --", "public.x"),)
    text = StampQuery("pgoutput", "p'; --", tables, 150000).expression().as_string(None)
    assert "'p''; --'" in text
    assert "x''); DROP TABLE t; --" in text
    assert "pg_publication_namespace" in text
    older = StampQuery("pgoutput", "p", tables, 140000).expression().as_string(None)
    assert "pg_publication_namespace" not in older
    wal2json = StampQuery("wal2json", "p", tables, 150000).expression().as_string(None)
    assert "pg_publication" not in wal2json
    table = OutboxTable(table="public.outbox")
    assert StampQuery.of(Plugin.WAL2JSON, "p", [table], 150000) == StampQuery(
        "wal2json", "p", (("public", "outbox", "public.outbox"),), 150000
    )


def test_a_stamp_read_again_by_what_it_records() -> None:
    query = StampQuery.like(VERIFIED, 150000)
    assert query == StampQuery(
        "pgoutput", "cdc_relay_outbox", (("public", "outbox", "public.outbox"),), 150000
    )


def test_the_rows_named_at_a_start_are_found_by_a_query() -> None:
    message, fields = unrelayed_message(
        changes(None, VERIFIED, publication_stamp(rel=[])),
        [OutboxTable(table="public.outbox")],
        from_xid=(1 << 32) + 700,
        to_xid=(1 << 32) + 750,
        since="2026-01-01 00:00:00+00",
    )
    assert "may not have been relayed" in message
    assert fields["from_xid"] == (1 << 32) + 700
    assert fields["find"] == (
        'SELECT "id" FROM "public"."outbox" WHERE age(xmin) <= age(\'700\'::xid) AND '
        "age(xmin) > age('750'::xid)"
    )
