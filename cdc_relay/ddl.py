"""The DDL files shipped in ``cdc_relay/sql/`` (the repository's ``sql/``), as the code runs them.

One owner per statement: an operator runs these files with ``psql`` as they are; ``setup`` and the
relay run the same files, with the names the settings choose put in through :mod:`psycopg.sql`
(``Identifier``, ``Literal``) — never by pasting text into SQL.
"""

from __future__ import annotations

import importlib.resources
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

from cdc_relay.errors import SourceSetupError

if TYPE_CHECKING:
    from cdc_relay.config import OutboxTable

OUTBOX_SQL = "001_outbox.sql"
STATE_SQL = "002_cdc_relay_state.sql"
PUBLICATION_SQL = "003_publication.sql"
EMIT_SQL = "004_outbox_emit.sql"
ROLE_SQL = "005_relay_role.sql"

# The state schema as 002_cdc_relay_state.sql spells it (CDC_RELAY_STATE_SCHEMA's default).
_FILE_STATE_SCHEMA = re.compile(r"\bcdc_relay\b")
# 004_outbox_emit.sql: the function's body between its dollar quotes, and the prefix argument in
# it; then the statements that make it the only way to emit (its grants, the REVOKEs from PUBLIC).
_EMIT_BODY = re.compile(
    r"^(?P<head>.*?\n)AS \$\$\n(?P<body>.*?\n)\$\$;\n(?P<tail>.*\S.*)$", re.DOTALL
)
_EMIT_PREFIX_LINE = "        'outbox',\n"
# 003_publication.sql: a DO block; the publication's name (as a value and as a name) and its table.
_DO_BLOCK = re.compile(r"^(?P<head>.*\n)DO \$\$\n(?P<body>.*\n)\$\$;\s*$", re.DOTALL)
_FILE_PUBLICATION = ("'cdc_relay_outbox'", "cdc_relay_outbox", "public.outbox")
_CREATE_PUBLICATION = re.compile(r"CREATE PUBLICATION .*?;", re.DOTALL)


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


def _emit_parts() -> re.Match[str]:
    match = _EMIT_BODY.match(packaged_sql(EMIT_SQL))
    if match is None or match["body"].count(_EMIT_PREFIX_LINE) != 1:
        raise SourceSetupError(f"sql/{EMIT_SQL} does not have the expected prefix argument")
    return match


def emit_function_ddl(prefix: str, conn: psycopg.Connection[Any] | None) -> sql.Composed:
    """``sql/004_outbox_emit.sql``'s ``CREATE FUNCTION`` with its message prefix set to ``prefix``.

    The prefix is a literal inside the function body, and the body a literal of the
    ``CREATE FUNCTION``: both quoted by psycopg (for ``conn``), so no prefix can end either early.
    """
    match = _emit_parts()
    before, after = match["body"].split(_EMIT_PREFIX_LINE)
    body = before + f"        {sql.Literal(prefix).as_string(conn)},\n" + after
    return sql.Composed([sql.SQL(match["head"] + "AS "), sql.Literal(body), sql.SQL(";")])


def emit_privileges_ddl() -> bytes:
    """The rest of ``sql/004_outbox_emit.sql``: ``outbox_emit`` not executable by PUBLIC,
    nor any overload of ``pg_logical_emit_message``. Our own text, no names from settings."""
    return _emit_parts()["tail"].encode()


def _publication_template() -> str:
    """The DO block's body of ``sql/003_publication.sql`` with ``{literal}`` (the publication's
    name as a value), ``{name}`` and ``{tables}`` where the file names its own."""
    match = _DO_BLOCK.match(packaged_sql(PUBLICATION_SQL))
    body = match["body"] if match else ""
    if "{" in body or "}" in body or any(body.count(token) == 0 for token in _FILE_PUBLICATION):
        raise SourceSetupError(f"sql/{PUBLICATION_SQL} is not the file this version expects")
    literal, identifier, table = _FILE_PUBLICATION
    template = body.replace(literal, "{literal}").replace(table, "{tables}")
    return template.replace(identifier, "{name}")


def publication_tables(tables: Sequence[OutboxTable], row_filters: bool = True) -> sql.Composable:
    """The table list of a publication: each table, with its row filter when it has one and the
    server takes them (``row_filters``: PostgreSQL 15+)."""
    items: list[sql.Composable] = []
    for table in tables:
        item: sql.Composable = sql.Identifier(*table.schema_and_name)
        condition = table.filter
        if row_filters and condition is not None:
            item = sql.SQL("{} WHERE ({})").format(item, condition.render())
        items.append(item)
    return sql.SQL(", ").join(items)


def _render_publication(
    template: str,
    name: str,
    tables: Sequence[OutboxTable],
    conn: psycopg.Connection[Any] | None,
    row_filters: bool,
) -> str:
    return (
        sql.SQL(template)
        .format(
            literal=sql.Literal(name),
            name=sql.Identifier(name),
            tables=publication_tables(tables, row_filters),
        )
        .as_string(conn)
    )


def publication_ddl(
    name: str,
    tables: Sequence[OutboxTable],
    conn: psycopg.Connection[Any] | None,
    row_filters: bool = True,
) -> sql.Composed:
    """``sql/003_publication.sql`` for the publication ``name`` of ``tables``.

    The block's body is passed as one literal (``DO '...'``) rather than between dollar quotes,
    so that no name — ``$$`` included — can end it early.
    """
    body = _render_publication(_publication_template(), name, tables, conn, row_filters)
    return sql.Composed([sql.SQL("DO "), sql.Literal(body), sql.SQL(";")])


def create_publication_statement(
    name: str,
    tables: Sequence[OutboxTable],
    conn: psycopg.Connection[Any] | None,
    row_filters: bool = True,
) -> str:
    """The ``CREATE PUBLICATION`` statement of ``sql/003_publication.sql``, for an operator to run
    as the tables' owner."""
    match = _CREATE_PUBLICATION.search(_publication_template())
    if match is None:
        raise SourceSetupError(f"sql/{PUBLICATION_SQL} is not the file this version expects")
    return _render_publication(match.group(), name, tables, conn, row_filters)


def set_row_filters_statement(name: str, tables: Sequence[OutboxTable]) -> sql.Composed:
    """Give ``tables`` in publication ``name`` their row filters (or none): drop and add them
    again, leaving the publication's other tables as they are. One transaction's worth."""
    listed = sql.SQL(", ").join(sql.Identifier(*t.schema_and_name) for t in tables)
    return sql.SQL(
        "ALTER PUBLICATION {name} DROP TABLE {listed}; ALTER PUBLICATION {name} ADD TABLE {tables}"
    ).format(name=sql.Identifier(name), listed=listed, tables=publication_tables(tables))
