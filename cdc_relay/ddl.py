"""The DDL files shipped in ``cdc_relay/sql/`` (the repository's ``sql/``), as the code runs them.

One owner per statement: an operator runs these files with ``psql`` as they are; ``setup`` and the
relay run the same files, with the names the settings choose put in through :mod:`psycopg.sql`
(``Identifier``, ``Literal``) — never by pasting text into SQL.
"""

from __future__ import annotations

import importlib.resources
import re
from typing import Any

import psycopg
from psycopg import sql

from cdc_relay.errors import SourceSetupError

OUTBOX_SQL = "001_outbox.sql"
STATE_SQL = "002_cdc_relay_state.sql"
EMIT_SQL = "004_outbox_emit.sql"
ROLE_SQL = "005_relay_role.sql"

# The state schema as 002_cdc_relay_state.sql spells it (CDC_RELAY_STATE_SCHEMA's default).
_FILE_STATE_SCHEMA = re.compile(r"\bcdc_relay\b")
# 004_outbox_emit.sql: the function's body between its dollar quotes, and the prefix argument in it.
_EMIT_BODY = re.compile(r"^(?P<head>.*\n)AS \$\$\n(?P<body>.*\n)\$\$;\s*$", re.DOTALL)
_EMIT_PREFIX_LINE = "        'outbox',\n"


def packaged_sql(name: str) -> str:
    """A DDL file shipped inside the package (``cdc_relay/sql/``)."""
    return (importlib.resources.files("cdc_relay") / "sql" / name).read_text("utf-8")


def state_table_ddl(schema: str) -> sql.Composed:
    """``sql/002_cdc_relay_state.sql`` for the state schema ``schema`` (an exact identifier)."""
    text = packaged_sql(STATE_SQL)
    if "{" in text or "}" in text or not _FILE_STATE_SCHEMA.search(text):
        raise SourceSetupError(f"sql/{STATE_SQL} is not the file this version expects")
    template = _FILE_STATE_SCHEMA.sub("{schema}", text)
    return sql.SQL(template).format(schema=sql.Identifier(schema))


def emit_function_ddl(prefix: str, conn: psycopg.Connection[Any] | None) -> sql.Composed:
    """``sql/004_outbox_emit.sql`` with its message prefix set to ``prefix``.

    The prefix is a literal inside the function body, and the body a literal of the
    ``CREATE FUNCTION``: both quoted by psycopg (for ``conn``), so no prefix can end either early.
    """
    match = _EMIT_BODY.match(packaged_sql(EMIT_SQL))
    if match is None or match["body"].count(_EMIT_PREFIX_LINE) != 1:
        raise SourceSetupError(f"sql/{EMIT_SQL} does not have the expected prefix argument")
    before, after = match["body"].split(_EMIT_PREFIX_LINE)
    body = before + f"        {sql.Literal(prefix).as_string(conn)},\n" + after
    return sql.Composed([sql.SQL(match["head"] + "AS "), sql.Literal(body), sql.SQL(";")])
