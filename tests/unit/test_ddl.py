"""The packaged DDL files as the code renders them: the same statements an operator runs."""

from __future__ import annotations

from psycopg import sql

from cdc_relay.ddl import STATE_SQL, emit_function_ddl, packaged_sql, state_table_ddl


def test_the_default_state_schema_renders_the_file_unchanged() -> None:
    assert state_table_ddl("cdc_relay").as_string(None) == packaged_sql(STATE_SQL).replace(
        "cdc_relay", '"cdc_relay"'
    )


def test_another_state_schema_is_an_exact_identifier_everywhere() -> None:
    text = state_table_ddl('My"Schema').as_string(None)
    assert text.count('"My""Schema"') == 3  # CREATE SCHEMA, CREATE TABLE, ALTER TABLE
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
