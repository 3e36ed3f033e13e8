"""The packaged DDL files as the code renders them: the same statements an operator runs."""

from __future__ import annotations

from psycopg import sql

from cdc_relay.config import OutboxTable
from cdc_relay.ddl import (
    STATE_SQL,
    create_publication_statement,
    emit_function_ddl,
    emit_privileges_ddl,
    packaged_sql,
    publication_ddl,
    state_table_ddl,
)


def test_the_default_state_schema_renders_the_file_unchanged() -> None:
    assert state_table_ddl("cdc_relay").as_string(None) == packaged_sql(STATE_SQL).replace(
        "cdc_relay", '"cdc_relay"'
    )


def test_another_state_schema_is_an_exact_identifier_everywhere() -> None:
    text = state_table_ddl('My"Schema').as_string(None)
    # CREATE SCHEMA, CREATE TABLE, 11 x ALTER TABLE, CREATE TABLE (the leader lease)
    assert text.count('"My""Schema"') == 14
    assert "cdc_relay" not in text


def test_the_emit_function_body_is_one_literal_holding_the_prefix_literal() -> None:
    prefix = "x$$;DROP/**/TABLE/**/outbox;--'"
    rendered = emit_function_ddl(prefix, None).as_string(None)
    head, _, body = rendered.partition("\nAS ")
    assert "$$" not in head
    assert body.endswith("';")
    # The body is a single literal: the prefix appears in it quoted twice over (once as the
    # literal inside the function, once more as part of the function's body literal).
    inner = sql.Literal(prefix).as_string(None)
    assert inner.replace("'", "''") in body


def test_outbox_emit_runs_as_its_owner_and_is_the_only_way_to_emit() -> None:
    head = emit_function_ddl("outbox", None).as_string(None).partition("\nAS ")[0]
    assert "SECURITY DEFINER" in head
    assert "SET search_path = pg_catalog, pg_temp" in head
    tail = emit_privileges_ddl().decode()
    assert tail.startswith("-- ")
    assert (
        "REVOKE EXECUTE ON FUNCTION outbox_emit(text, text, text, jsonb, jsonb) FROM PUBLIC;"
        in tail
    )
    assert "proname = 'pg_logical_emit_message'" in tail
    assert "REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC" in tail
    assert "CREATE" not in tail


OUTBOX = (OutboxTable(table="public.outbox"),)


def test_the_default_publication_renders_the_files_statements() -> None:
    rendered = publication_ddl("cdc_relay_outbox", OUTBOX, None).as_string(None)
    assert rendered.startswith("DO '")
    assert rendered.endswith("';")
    body = rendered[len("DO '") : -len("';")].replace("''", "'")
    assert "WHERE pubname = 'cdc_relay_outbox') THEN" in body
    assert (
        'CREATE PUBLICATION "cdc_relay_outbox" FOR TABLE "public"."outbox" '
        "WITH (publish = 'insert', publish_via_partition_root = true);" in body
    )
    assert "IF NOT EXISTS" in packaged_sql("003_publication.sql")
    assert "IF NOT EXISTS" in body


def test_a_hostile_publication_name_stays_inside_its_quotes() -> None:
    name = "x$$;DROP/**/TABLE/**/outbox;--'\""
    tables = (OutboxTable(table="public.outbox"), OutboxTable(table="s.MyTable"))
    rendered = publication_ddl(name, tables, None).as_string(None)
    # One literal: the block's body can be ended by nothing a name contains.
    assert rendered.startswith("DO '")
    assert rendered.endswith("';")
    body = rendered[len("DO '") : -len("';")]
    assert "'" not in body.replace("''", "")
    statement = create_publication_statement(name, tables, None)
    assert statement == (
        f"CREATE PUBLICATION {sql.Identifier(name).as_string(None)} FOR TABLE "
        '"public"."outbox", "s"."MyTable" WITH (publish = \'insert\', '
        "publish_via_partition_root = true);"
    )
    assert statement.replace("'", "''") in body
