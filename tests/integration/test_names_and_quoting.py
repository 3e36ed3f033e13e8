"""Names and values from settings reach SQL only through ``psycopg.sql``: a hostile message prefix
cannot break out of ``outbox_emit``'s body, and mixed-case names are taken literally everywhere
(catalog lookups, DDL, the publication, pgoutput and wal2json, the sweeper)."""

from __future__ import annotations

import uuid

import psycopg
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from psycopg import sql
from pydantic import ValidationError

from cdc_relay.config import Settings
from cdc_relay.ddl import emit_function_ddl
from tests.conftest import KafkaBroker
from tests.integration.relay_support import (
    OUTBOX_DDL,
    RelayProcess,
    new_event,
    relay_env,
    scalar,
    wait_until,
)
from tests.integration.test_admin import cdc_relay, failed
from tests.kafka_helpers import consume_all

pytestmark = pytest.mark.integration

HOSTILE_PREFIX = "x$$;DROP/**/TABLE/**/outbox;--'\\"


def _emitted_prefixes(database: str, publication: str, call: str) -> list[bytes]:
    """Call ``call`` and return the prefixes of the logical messages its transaction wrote."""
    peek_slot = f"peek_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (peek_slot,))
        conn.execute("SET synchronous_commit = on")  # peeking reads flushed WAL only
        conn.execute(call.encode())
        changes = conn.execute(
            "SELECT data FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, "
            "'proto_version', '1', 'publication_names', %s, 'messages', 'true')",
            (peek_slot, publication),
        ).fetchall()
        conn.execute("SELECT pg_drop_replication_slot(%s)", (peek_slot,))
    prefixes = []
    for (data,) in changes:
        message = bytes(data)
        if message[:1] == b"M":
            prefixes.append(message[10 : message.index(b"\0", 10)])
    return prefixes


def test_a_hostile_message_prefix_is_a_value_never_sql(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    env = relay_env(
        database, broker.bootstrap_servers, unique, message_prefix=HOSTILE_PREFIX, messages="true"
    )
    with psycopg.connect(database, autocommit=True) as conn:
        # As in the report: with bodies unchecked, a prefix ending the $$ body ran its SQL.
        conn.execute(
            sql.SQL("ALTER DATABASE {} SET check_function_bodies = off").format(
                sql.Identifier(conn.info.dbname)
            )
        )
    result = cdc_relay(env, "setup", "--create-outbox")
    assert result.returncode == 0, result.stdout + result.stderr
    assert scalar(database, "SELECT to_regclass('public.outbox') IS NOT NULL") is True
    prefixes = _emitted_prefixes(
        database,
        env["CDC_RELAY_PUBLICATION_NAME"],
        "SELECT outbox_emit('order', 'o-1', 'created', '{}')",
    )
    assert prefixes == [HOSTILE_PREFIX.encode()]
    assert scalar(database, "SELECT to_regclass('public.outbox') IS NOT NULL") is True

    # A prefix wal2json could not be given (whitespace) is refused with the configuration.
    refused = cdc_relay({**env, "CDC_RELAY_MESSAGE_PREFIX": "x$$; DROP TABLE outbox; --"}, "setup")
    assert refused.returncode == 2
    assert "CDC_RELAY_MESSAGE_PREFIX" in refused.stdout + refused.stderr
    assert scalar(database, "SELECT to_regclass('public.outbox') IS NOT NULL") is True


# What CDC_RELAY_MESSAGE_PREFIX accepts: non-empty, no commas, no whitespace (wal2json's limits);
# PostgreSQL text holds no NUL, and a lone surrogate is not UTF-8.
_PREFIXES = st.text(
    st.characters(blacklist_categories=("Cs", "Zs", "Zl", "Zp", "Cc"), blacklist_characters=","),
    min_size=1,
    max_size=40,
) | st.sampled_from([HOSTILE_PREFIX, "$$", "$a$", "'", "\\'", "';--", "E'\\x27'", "$$$$"])


def test_any_accepted_prefix_is_emitted_exactly_as_configured(database: str, unique: str) -> None:
    """Property: for every prefix the settings accept, the installed outbox_emit writes messages
    with exactly that prefix, and the statement that installs it runs nothing else."""
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("SET check_function_bodies = off")
        conn.execute(OUTBOX_DDL.encode())
        conn.execute(sql.SQL("CREATE PUBLICATION {} FOR TABLE outbox").format(
            sql.Identifier(f"pub_{unique}")
        ))  # fmt: skip
        slot = f"peek_{unique}"
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
        conn.execute("SET synchronous_commit = on")

        @settings(max_examples=60, deadline=None)
        @given(_PREFIXES)
        def emits_exactly(prefix: str) -> None:
            assume(load_settings_prefix_ok(prefix))
            conn.execute(emit_function_ddl(prefix, conn))
            conn.execute("SELECT outbox_emit('order', 'o-1', 'created', '{}')")
            changes = conn.execute(
                "SELECT data FROM pg_logical_slot_get_binary_changes(%s, NULL, NULL, "
                "'proto_version', '1', 'publication_names', %s, 'messages', 'true')",
                (slot, f"pub_{unique}"),
            ).fetchall()
            messages = [bytes(c[0]) for c in changes if bytes(c[0])[:1] == b"M"]
            assert [m[10 : m.index(b"\0", 10)] for m in messages] == [prefix.encode()]
            assert conn.execute("SELECT to_regclass('public.outbox') IS NOT NULL").fetchone() == (
                True,
            )
            functions = conn.execute(
                "SELECT count(*) FROM pg_proc WHERE pronamespace = 'public'::regnamespace"
            ).fetchone()
            assert functions == (1,), "only outbox_emit: nothing else was created"

        try:
            emits_exactly()
        finally:
            conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))


def load_settings_prefix_ok(prefix: str) -> bool:
    """Whether the settings accept ``prefix`` (the property covers exactly those)."""
    try:
        Settings.model_validate(
            {"database_url": "postgresql://x@h/db", "kafka_bootstrap_servers": "k:9092",
             "message_prefix": prefix}
        )  # fmt: skip
    except ValidationError:
        return False
    return True


@pytest.mark.usefixtures("plugin")
def test_a_mixed_case_outbox_is_published_and_swept(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    schema, table = "Sales", "Outbox"
    ddl = OUTBOX_DDL.replace("public.outbox", '"Sales"."Outbox"')
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        conn.execute(ddl.encode())  # our own trusted file, pointed at the quoted name
    env = relay_env(
        database,
        broker.bootstrap_servers,
        unique,
        outbox_table=f"{schema}.{table}",
        state_schema="Relay_State",
        publication_name=f"Pub_{unique}",
        sweep_interval="0.2",
        confirm_interval="0.2",
        idle_confirm_interval="0.3",
    )
    setup = cdc_relay(env, "setup")
    assert setup.returncode == 0, setup.stdout + setup.stderr
    check = cdc_relay(env, "check")
    assert not failed(check), check.stdout
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        events = [new_event("order", f"o-{i}", "created", {"n": i}) for i in range(5)]
        with psycopg.connect(database) as conn, conn.cursor() as cur:
            cur.executemany(
                'INSERT INTO "Sales"."Outbox" (id, aggregate_type, aggregate_id, event_type, '
                "payload) VALUES (%s, %s, %s, %s, '{}')",
                [(e.id, e.aggregate_type, e.aggregate_id, e.event_type) for e in events],
            )
        records = consume_all(broker.bootstrap_servers, f"{unique}.order", len(events), 30)
        wait_until(
            lambda: scalar(database, 'SELECT count(*) FROM "Sales"."Outbox"') == 0,
            30,
            "published rows of the mixed-case table swept",
        )
    finally:
        code = relay.stop()
        relay.close()
    assert code == 0, relay.logs()
    assert sorted(r.header("id") or b"" for r in records) == sorted(e.id.encode() for e in events)
    assert scalar(database, 'SELECT count(*) FROM "Relay_State".slot_position') == 1, (
        "the state table under its exact name"
    )


def test_a_name_that_differs_only_in_case_is_refused_with_a_hint(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(OUTBOX_DDL.replace("public.outbox", "public.lower_ob").encode())
    env = relay_env(database, broker.bootstrap_servers, unique, outbox_table="public.LOWER_OB")
    check = cdc_relay(env, "check")
    assert "did you mean public.lower_ob?" in failed(check)["table public.LOWER_OB"]
    relay = RelayProcess(env).start()
    try:
        code = relay.wait(60)
    finally:
        relay.close()
    assert code == 3, relay.logs()
    assert "table public.LOWER_OB: does not exist" in relay.logs()
    assert "did you mean public.lower_ob?" in relay.logs()
    assert "Traceback" not in relay.logs()
