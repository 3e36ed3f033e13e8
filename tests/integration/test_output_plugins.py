"""The output plugins a server lets roles decode through: where it restricts them
(``output_plugin_libraries``, a setting of the newest minor releases), a relay whose plugin is not
listed is refused by ``check`` and at start, naming the statement that lists it; listed, it
streams. Where the server has no such setting, the tests skip saying so."""

from __future__ import annotations

import time
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from cdc_relay.local import LocalPostgres
from cdc_relay.prerequisites.server import OUTPUT_PLUGIN_SETTING, listed_plugins
from tests.conftest import KafkaBroker
from tests.integration.relay_support import (
    RelayProcess,
    create_outbox,
    new_event,
    relay_env,
    write_transactions,
)
from tests.integration.test_admin import cdc_relay, failed, lines_of
from tests.kafka_helpers import consume_all

pytestmark = pytest.mark.integration


def _set_plugins(server: LocalPostgres, plugins: list[str]) -> None:
    """``ALTER SYSTEM`` the list, reload, and wait until new sessions see it."""
    statement = sql.SQL("ALTER SYSTEM SET {} = {}").format(
        sql.Identifier(OUTPUT_PLUGIN_SETTING), sql.SQL(", ").join(map(sql.Literal, plugins))
    )
    _reload_with(server, statement)


def _reload_with(server: LocalPostgres, statement: sql.Composed | bytes) -> None:
    with psycopg.connect(server.url(), autocommit=True) as conn:
        conn.execute(statement)
        conn.execute("SELECT pg_reload_conf()")
        wanted = conn.execute(
            "SELECT setting FROM pg_file_settings WHERE name = %s AND applied IS NOT NULL "
            "ORDER BY seqno DESC LIMIT 1",
            (OUTPUT_PLUGIN_SETTING,),
        ).fetchone()
    deadline = time.monotonic() + 10
    while True:
        with psycopg.connect(server.url(), autocommit=True) as conn:
            now = conn.execute("SELECT current_setting(%s)", (OUTPUT_PLUGIN_SETTING,)).fetchone()
        if (
            wanted is None
            or now is None
            or listed_plugins(str(now[0])) == listed_plugins(str(wanted[0]))
        ):
            return
        assert time.monotonic() < deadline, f"the reload did not apply {wanted[0]!r}: {now[0]!r}"
        time.sleep(0.1)


@pytest.fixture
def restricted(local_postgres: LocalPostgres) -> Iterator[None]:
    """The server lets roles decode through test_decoding only (neither of the relay's plugins);
    its own list again afterwards."""
    with psycopg.connect(local_postgres.url(), autocommit=True) as conn:
        row = conn.execute("SELECT current_setting(%s, true)", (OUTPUT_PLUGIN_SETTING,)).fetchone()
    if row is None or row[0] is None:
        pytest.skip(
            f"this PostgreSQL has no {OUTPUT_PLUGIN_SETTING}: REPLICATION roles may decode "
            "through any installed output plugin"
        )
    original = listed_plugins(str(row[0]))
    _set_plugins(local_postgres, ["test_decoding"])
    try:
        yield
    finally:
        _set_plugins(local_postgres, original)


def test_a_plugin_the_server_does_not_list_is_refused_naming_the_statement_that_lists_it(
    database: str,
    broker: KafkaBroker,
    unique: str,
    local_postgres: LocalPostgres,
    restricted: None,
) -> None:
    create_outbox(database)
    env = relay_env(database, broker.bootstrap_servers, unique, plugin="pgoutput")
    checked = cdc_relay(env, "check")
    assert checked.returncode == 1, checked.stdout
    line = failed(checked)["output plugin"]
    statement = "ALTER SYSTEM SET output_plugin_libraries = 'test_decoding', 'pgoutput'"
    assert f"as a superuser: {statement}; SELECT pg_reload_conf()" in line, line

    relay = RelayProcess(env).start()
    try:
        code = relay.wait(60)
    finally:
        relay.close()
    assert code == 3, relay.logs()
    assert statement in relay.logs()

    _reload_with(local_postgres, statement.encode())  # the fix, as a superuser
    assert lines_of(cdc_relay(env, "check"))["output plugin"].startswith("ok   output plugin: ")
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        event = new_event("order", "o-1")
        write_transactions(database, [[event]])
        records = consume_all(broker.bootstrap_servers, f"{unique}.order", 1, 30)
        assert relay.stop() == 0, relay.logs()
    finally:
        relay.close()
    assert [r.header("id") for r in records] == [event.id.encode()]
