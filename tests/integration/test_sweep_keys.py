"""The sweeper's delete against a real PostgreSQL: exactly the candidate keys, whatever their text,
at a small client cost per key (the sweeper runs beside the loop, in the relay's process)."""

from __future__ import annotations

import time

import psycopg
import pytest
from psycopg import sql

from cdc_relay.config import OutboxTable
from cdc_relay.sweep_queries import delete_batch
from tests.fakes import SweptTableStub, eligible_since

pytestmark = pytest.mark.integration

# Key texts a writer may choose: quoting, escaping and array syntax, NULL's spelling, blanks.
HOSTILE_KEYS = (
    'a"b', "a\\b", "{x}", "{", "}", "a,b", " padded ", "NULL", "null", "", "ü€😀", "x\ty\nz",
    "'quote'", "(1,2)", "\\\\", '"', ",",
)  # fmt: skip
KEYS = 20_000
# Client CPU per key of one delete (adapting the keys, reading back the deleted ones). Sent as a
# text array, each key is matched against psycopg's quoting regex and escaped: ~1.6 µs per key
# for the adaptation alone (~2 in all); as a binary array ~0.2 (~0.5 in all).
CPU_PER_KEY_MAX = 1.2e-6


def _boundary(conn: psycopg.Connection[tuple[object, ...]]) -> int:
    row = conn.execute("SELECT txid_current()").fetchone()
    assert row is not None
    return int(str(row[0]))


def test_a_delete_removes_exactly_its_keys_whatever_their_text(database: str) -> None:
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("CREATE TABLE swept_keys (k text PRIMARY KEY)")
        boundary = _boundary(conn)
        ordinary = [f"key-{n}" for n in range(200)]
        conn.execute(
            "INSERT INTO swept_keys SELECT unnest(%s::text[])", ([*HOSTILE_KEYS, *ordinary],)
        )
        swept = SweptTableStub(OutboxTable(table="swept_keys"), ("k",), [sql.SQL("text")])
        chosen = (*HOSTILE_KEYS, *ordinary[:100])
        deleted = delete_batch(conn, swept, chosen, eligible_since(conn, "swept_keys", boundary))
        assert sorted(deleted) == sorted(chosen)  # type: ignore[type-var]
        left = {str(r[0]) for r in conn.execute("SELECT k FROM swept_keys").fetchall()}
        assert left == set(ordinary[100:])


def test_a_deletes_client_cpu_per_key_is_small(database: str) -> None:
    """CPU time of this thread only (not the server's, not wall time), best of three deletes."""
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("CREATE TABLE swept_keys (k uuid PRIMARY KEY)")
        swept = SweptTableStub(OutboxTable(table="swept_keys"), ("k",), [sql.SQL("uuid")])
        best = float("inf")
        for _ in range(3):
            eligible = eligible_since(conn, "swept_keys", _boundary(conn))
            rows = conn.execute(
                "INSERT INTO swept_keys SELECT gen_random_uuid() FROM generate_series(1, %s) "
                "RETURNING k::text",
                (KEYS,),
            ).fetchall()
            keys = tuple(str(r[0]) for r in rows)
            started = time.thread_time()
            deleted = delete_batch(conn, swept, keys, eligible)
            best = min(best, time.thread_time() - started)
            assert len(deleted) == KEYS
        assert best / KEYS <= CPU_PER_KEY_MAX, f"{best / KEYS * 1e6:.2f} µs per key"
