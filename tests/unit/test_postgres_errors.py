"""The PostgreSQL boundary (cdc_relay.postgres_errors): the one table, and who may catch psycopg.

The SQLSTATE rules are checked against an oracle written out code by code: what a connection
attempt, START_REPLICATION (and the end of its stream) and a replication command each answer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import psycopg
import pytest
from hypothesis import given
from hypothesis import strategies as st
from psycopg import errors

from cdc_relay.errors import ConfigError, SlotInUse, SourceSetupError, SourceUnavailable
from cdc_relay.postgres_errors import (
    PG_ERROR_MAP,
    During,
    connect_error,
    error_for,
    kind_of,
    mapped,
    one_line,
)

PACKAGE = Path(__file__).resolve().parents[2] / "cdc_relay"
# The modules that hold a PostgreSQL connection (or read a URL with libpq) and so may catch what
# psycopg raises; every other module sees only cdc_relay.errors.
ADAPTERS = {
    "checkpoint.py",
    "commands/check.py",
    "commands/demo.py",
    "commands/setup.py",
    "commands/status.py",
    "database_url.py",
    "demo_writer.py",
    "leadership.py",
    "local/postgres.py",
    "postgres_errors.py",
    "prerequisites/__init__.py",
    "prerequisites/server.py",
    "prerequisites/slot.py",
    "prerequisites/state.py",
    "publication_filter.py",
    "replication/source.py",
    "replication/stream.py",
    "sweeper.py",
    "waits.py",
}

# The oracle: refused for good at connect; what else START_REPLICATION answers for an operator.
PERMANENT_AT_CONNECT = {"28000", "28P01", "3D000", "42501"}
SETUP_WHEN_REPLICATING = PERMANENT_AT_CONNECT | {"42704", "55000"}
SLOT_IN_USE = "55006"


def expected(sqlstate: str, during: During) -> type[Exception]:
    if during is During.CONNECT:
        return SourceSetupError if sqlstate in PERMANENT_AT_CONNECT else SourceUnavailable
    if sqlstate == SLOT_IN_USE:
        return SlotInUse
    if sqlstate in SETUP_WHEN_REPLICATING:
        return SourceSetupError
    if during is During.COMMAND and sqlstate[:2] in ("42", "55", "0A"):
        return SourceSetupError
    return SourceUnavailable


SQLSTATE = st.text(alphabet="0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ", min_size=5, max_size=5)
KNOWN = st.sampled_from(sorted(code for code in errors._sqlcodes if len(code) == 5))


@pytest.mark.parametrize(
    ("error", "during", "kind"),
    [
        (errors.ObjectInUse, During.REPLICATION, SlotInUse),
        (errors.ObjectInUse, During.COMMAND, SlotInUse),
        (errors.ObjectInUse, During.CONNECT, SourceUnavailable),
        (errors.InvalidAuthorizationSpecification, During.CONNECT, SourceSetupError),
        (errors.InvalidPassword, During.CONNECT, SourceSetupError),
        (errors.InvalidCatalogName, During.CONNECT, SourceSetupError),
        (errors.InsufficientPrivilege, During.CONNECT, SourceSetupError),
        (errors.InsufficientPrivilege, During.REPLICATION, SourceSetupError),
        (errors.UndefinedObject, During.CONNECT, SourceUnavailable),
        (errors.UndefinedObject, During.REPLICATION, SourceSetupError),
        (errors.ObjectNotInPrerequisiteState, During.CONNECT, SourceUnavailable),
        (errors.ObjectNotInPrerequisiteState, During.REPLICATION, SourceSetupError),
        (errors.UndefinedTable, During.REPLICATION, SourceUnavailable),
        (errors.UndefinedTable, During.COMMAND, SourceSetupError),
        (errors.FeatureNotSupported, During.COMMAND, SourceSetupError),
        (errors.TooManyConnections, During.CONNECT, SourceUnavailable),
        (errors.CannotConnectNow, During.REPLICATION, SourceUnavailable),
        (errors.QueryCanceled, During.STATEMENT, SourceUnavailable),
        (errors.LockNotAvailable, During.STATEMENT, SourceUnavailable),
        (errors.ObjectInUse, During.STATEMENT, SourceUnavailable),
        (errors.InsufficientPrivilege, During.STATEMENT, SourceSetupError),
        (errors.UndefinedTable, During.STATEMENT, SourceSetupError),
        (psycopg.OperationalError, During.STATEMENT, SourceUnavailable),
        (psycopg.InterfaceError, During.STATEMENT, SourceSetupError),
    ],
)
def test_each_class_has_its_kind(error: type[psycopg.Error], during: During, kind: type) -> None:
    assert kind_of(getattr(error, "sqlstate", None), during, error) is kind


@given(
    sqlstate=st.one_of(SQLSTATE, KNOWN),
    during=st.sampled_from([During.CONNECT, During.REPLICATION, During.COMMAND]),
)
def test_a_sqlstate_means_what_it_meant_in_each_situation(sqlstate: str, during: During) -> None:
    assert kind_of(sqlstate, during) is expected(sqlstate, during)


@given(sqlstate=KNOWN)
def test_a_statement_passes_what_psycopg_calls_operational(sqlstate: str) -> None:
    raised = errors.lookup(sqlstate)
    operational = issubclass(raised, psycopg.OperationalError)
    assert kind_of(sqlstate, During.STATEMENT) is (
        SourceUnavailable if operational else SourceSetupError
    )


def test_no_sqlstate_is_a_transient_failure_except_for_statements() -> None:
    for during in (During.CONNECT, During.REPLICATION, During.COMMAND):
        assert kind_of(None, during) is SourceUnavailable
        assert kind_of("", during) is SourceUnavailable


def test_every_row_names_a_psycopg_class_and_a_source_error() -> None:
    for error, kind, situations in PG_ERROR_MAP:
        assert issubclass(error, psycopg.Error)
        assert kind in (SlotInUse, SourceSetupError, SourceUnavailable)
        assert situations


def test_error_for_keeps_the_message_and_says_what_failed() -> None:
    exc = errors.InsufficientPrivilege("permission denied for table slot_position")
    mapped_error = error_for(exc, During.STATEMENT, "cannot record the position")
    assert isinstance(mapped_error, SourceSetupError)
    assert (
        str(mapped_error) == "cannot record the position: permission denied for table slot_position"
    )
    assert str(error_for(psycopg.OperationalError("gone"), During.STATEMENT)) == "gone"


def test_mapped_turns_psycopg_errors_into_the_projects_and_lets_others_pass() -> None:
    with pytest.raises(SourceUnavailable) as info, mapped(During.STATEMENT):
        raise psycopg.OperationalError("server closed the connection")
    assert str(info.value) == "server closed the connection"
    with pytest.raises(SlotInUse), mapped(During.REPLICATION):
        raise errors.ObjectInUse("replication slot is active")
    with pytest.raises(KeyError), mapped(During.STATEMENT):
        raise KeyError("not psycopg's")


def test_connect_error_sorts_config_permanent_and_transient() -> None:
    url = "postgresql://relay:s3cret@db/app"
    config = connect_error('invalid sslmode value: "bogus"', None, url, "cannot connect")
    assert isinstance(config, ConfigError)
    refused = connect_error("FATAL: password s3cret refused", "28P01", url, "cannot connect")
    assert isinstance(refused, SourceSetupError)
    assert "s3cret" not in str(refused)
    assert isinstance(connect_error("timeout expired", None, url, "x"), SourceUnavailable)
    assert isinstance(connect_error("too many clients", "53300", url, "x"), SourceUnavailable)


def _catches_psycopg(handler: ast.ExceptHandler | ast.With) -> bool:
    node = handler.type if isinstance(handler, ast.ExceptHandler) else handler
    return node is not None and "psycopg" in ast.unparse(node)


def test_only_the_adapters_catch_what_psycopg_raises() -> None:
    catching = set()
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ExceptHandler) and _catches_psycopg(node):
                catching.add(path.relative_to(PACKAGE).as_posix())
            if isinstance(node, ast.With) and any(
                "suppress" in ast.unparse(item.context_expr)
                and "psycopg" in ast.unparse(item.context_expr)
                for item in node.items
            ):
                catching.add(path.relative_to(PACKAGE).as_posix())
    assert catching, "the scan found nothing: it is broken"
    assert catching <= ADAPTERS, sorted(catching - ADAPTERS)


# -- libpq's messages as one line -----------------------------------------------------------------

REFUSED = (
    'connection failed: connection to server at "127.0.0.1", port 9 failed: Connection refused\n'
    "\tIs the server running on that host and accepting TCP/IP connections?"
)
CLOSED = (
    "server closed the connection unexpectedly\n\tThis probably means the server terminated "
    "abnormally\n\tbefore or while processing the request."
)
TWO_HOSTS = (
    'connection to server at "a" (10.0.0.1), port 5432 failed: timeout expired\n'
    'connection to server at "b" (10.0.0.2), port 5432 failed: Connection refused\n'
)


@pytest.mark.parametrize(
    ("text", "line"),
    [
        (
            REFUSED,
            'connection failed: connection to server at "127.0.0.1", port 9 failed: Connection '
            "refused; Is the server running on that host and accepting TCP/IP connections?",
        ),
        (
            CLOSED,
            "server closed the connection unexpectedly; This probably means the server "
            "terminated abnormally before or while processing the request.",
        ),
        (
            TWO_HOSTS,
            'connection to server at "a" (10.0.0.1), port 5432 failed: timeout expired; '
            'connection to server at "b" (10.0.0.2), port 5432 failed: Connection refused',
        ),
        ("relation does not exist", "relation does not exist"),
    ],
)
def test_libpq_messages_become_one_line(text: str, line: str) -> None:
    assert one_line(text) == line
    assert line in connect_error(text, None, "", "cannot connect").args[0]


@given(st.text())
def test_one_line_keeps_every_character_but_the_line_breaks(text: str) -> None:
    line = one_line(text)
    assert len(line.splitlines()) <= 1

    def visible(value: str) -> str:
        return "".join(value.split()).replace(";", "")

    assert visible(line) == visible(text)
