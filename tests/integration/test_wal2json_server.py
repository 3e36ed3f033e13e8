"""The wal2json decoder against a live server: which LSN of a transaction confirms it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pytest

from cdc_relay.decode.messages import Begin, Commit, Insert
from cdc_relay.decode.wal2json import Wal2JsonDecoder, Wal2JsonMessage, plugin_options
from cdc_relay.lsn import format_lsn, parse_lsn
from tests.unit.test_wal2json import of_type

pytestmark = pytest.mark.integration


def _changes(conn: psycopg.Connection[Any], slot: str) -> list[tuple[str, str]]:
    options = plugin_options(["public.outbox"])
    args = [item for pair in options.items() for item in pair]
    placeholders = ", ".join(["%s"] * len(args))
    rows = conn.execute(
        f"SELECT lsn::text, data FROM pg_logical_slot_peek_changes(%s, NULL, NULL, {placeholders})",
        [slot, *args],
    ).fetchall()
    return [(lsn, data) for lsn, data in rows]


def _decode_all(rows: list[tuple[str, str]]) -> list[Wal2JsonMessage]:
    decoder = Wal2JsonDecoder()
    return [m for lsn, data in rows for m in decoder.decode(data.encode(), parse_lsn(lsn))]


def test_end_lsn_against_the_server(
    database: str, unique: str, wal2json_missing: str | None
) -> None:
    """Confirming Commit.end_lsn skips exactly that transaction; Commit.commit_lsn does not."""
    if wal2json_missing:
        pytest.skip(wal2json_missing)
    # Slot names are the server's: unique ones, in case the server is shared.
    w_end, w_commit = f"w_end_{unique}", f"w_commit_{unique}"
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("SET synchronous_commit = on")  # slot functions read flushed WAL only
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'wal2json')", (w_end,))
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'wal2json')", (w_commit,))
        conn.execute((Path(__file__).resolve().parents[2] / "sql" / "001_outbox.sql").read_text())
        for n in (1, 2):
            conn.execute(
                "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)"
                " VALUES (gen_random_uuid(), 'order', %s, 'Created', '{}')",
                [f"order-{n}"],
            )
        decoded_all = _decode_all(_changes(conn, w_end))
        begins = of_type(decoded_all, Begin)
        commits = of_type(decoded_all, Commit)
        inserts = of_type(decoded_all, Insert)
        assert [i.new[2] for i in inserts] == [b"order-1", b"order-2"]
        # begins[0] is the CREATE TABLE transaction.
        first = commits[1]
        conn.execute(
            "SELECT pg_replication_slot_advance(%s, %s::pg_lsn)",
            [w_end, format_lsn(first.end_lsn)],
        )
        conn.execute(
            "SELECT pg_replication_slot_advance(%s, %s::pg_lsn)",
            [w_commit, format_lsn(first.commit_lsn)],
        )
        after_end = _decode_all(_changes(conn, w_end))
        after_commit = _decode_all(_changes(conn, w_commit))
    assert [b.xid for b in of_type(after_end, Begin)] == [begins[2].xid]
    assert [i.new[2] for i in of_type(after_end, Insert)] == [b"order-2"]
    assert [b.xid for b in of_type(after_commit, Begin)] == [begins[1].xid, begins[2].xid]
