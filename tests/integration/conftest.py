"""Integration fixtures: the relay-core tests run once per output plugin."""

from __future__ import annotations

import os

import psycopg
import pytest

from tests.conftest import PostgresServer

PLUGINS = ("pgoutput", "wal2json")


@pytest.fixture(scope="session")
def wal2json_missing(postgres: PostgresServer) -> str | None:
    """Why wal2json cannot be used on the test server, or None when it can."""
    probe = f"wal2json_probe_{os.getpid()}"
    with psycopg.connect(postgres.url("postgres"), autocommit=True) as conn:
        try:
            conn.execute(
                "SELECT pg_create_logical_replication_slot(%s, 'wal2json', true)", (probe,)
            )
        except psycopg.errors.UndefinedFile:
            major = conn.info.server_version // 10000
            return (
                f"wal2json is not installed on the test server (PostgreSQL {major}; Debian/Ubuntu:"
                f" apt-get install postgresql-{major}-wal2json; the PostgreSQL wheel has none)"
            )
    return None


@pytest.fixture(params=PLUGINS)
def plugin(
    request: pytest.FixtureRequest, wal2json_missing: str | None, monkeypatch: pytest.MonkeyPatch
) -> str:
    """The output plugin under test; the relay child processes inherit CDC_RELAY_PLUGIN."""
    name = str(request.param)
    if name == "wal2json" and wal2json_missing:
        pytest.skip(wal2json_missing)
    monkeypatch.setenv("CDC_RELAY_PLUGIN", name)
    return name
