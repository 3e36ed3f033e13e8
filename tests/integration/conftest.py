"""Integration fixtures: the relay-core tests run once per output plugin; what the test server
lacks (a plugin, ICU, publication row filters) is read from the server itself, never inferred from
its version number, and the tests that need it skip naming it."""

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
        except psycopg.errors.InsufficientPrivilege as exc:
            return (
                f"the test server refuses wal2json ({exc.diag.message_primary}): add it to "
                "output_plugin_libraries"
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


@pytest.fixture(scope="session")
def icu_missing(postgres: PostgresServer) -> str | None:
    """Why ICU collations cannot be created on the test server, or None when they can."""
    with psycopg.connect(postgres.url("postgres")) as conn:
        try:
            conn.execute(
                "CREATE COLLATION icu_probe (provider = icu, locale = 'und-u-ks-level2', "
                "deterministic = false)"
            )
        except psycopg.errors.FeatureNotSupported as exc:
            return f"this PostgreSQL was built without ICU ({exc.diag.message_primary})"
        finally:
            conn.rollback()
    return None


def _publication_lacks(postgres: PostgresServer, column: str, what: str) -> str | None:
    """Why publications on the test server lack ``what`` (their catalog has no ``column``)."""
    with psycopg.connect(postgres.url("postgres"), autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_attribute WHERE attrelid = 'pg_publication_rel'::regclass "
            "AND attname = %s",
            (column,),
        ).fetchone()
        version = conn.execute("SHOW server_version").fetchone()
    if row is not None and row[0]:
        return None
    shown = version[0] if version else "?"
    return f"publications of PostgreSQL {shown} have no {what} (pg_publication_rel.{column})"


@pytest.fixture(scope="session")
def row_filters_missing(postgres: PostgresServer) -> str | None:
    """Why publications on the test server cannot filter rows, or None when they can."""
    return _publication_lacks(postgres, "prqual", "row filters")


@pytest.fixture(scope="session")
def column_lists_missing(postgres: PostgresServer) -> str | None:
    """Why publications on the test server cannot list columns, or None when they can."""
    return _publication_lacks(postgres, "prattrs", "column lists")
