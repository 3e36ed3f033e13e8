"""The PostgreSQL boundary: what a psycopg/libpq error means, as the project's error.

The adapters — the modules that hold a PostgreSQL connection and run statements or replication
commands on it (``replication/stream.py``, ``replication/source.py``, ``checkpoint.py``,
``leadership.py``, ``sweeper.py``, ``waits.py``, ``prerequisites/``, ``publication_filter.py``, the
operator commands, ``demo_writer.py`` and the throw-away server of ``local/``), and
``database_url.py``, which reads the URL with libpq — turn
what psycopg raises, or the SQLSTATE a libpq result carries, into :mod:`cdc_relay.errors`' kinds
by :data:`PG_ERROR_MAP`, the one table, so that the loop above them reasons about what to do
(retry, stop for an operator, step aside for the slot's holder) and never about psycopg. An adapter
still catches a specific SQLSTATE where it is an answer rather than a failure (a missing state
table at first start, a privilege ``check`` reports).

Connection attempts are sorted here too (:func:`connect_error`): besides the SQLSTATE, libpq's own
client-side refusals (an impossible connection option) have no SQLSTATE and are told by their
message.

What psycopg says becomes one line (:func:`message`): libpq writes a hint after a line break and a
tab, wraps it, and gives one line per host it tried; a report or a log line would show those as
escapes (``\\n\\t``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum

import psycopg
from psycopg import errors

from cdc_relay.database_url import scrub
from cdc_relay.errors import (
    ConfigError,
    RelayError,
    SlotInUse,
    SourceError,
    SourceSetupError,
    SourceUnavailable,
)


class During(Enum):
    """What failed: the same SQLSTATE means something else when connecting and streaming."""

    CONNECT = "a connection attempt"
    REPLICATION = "START_REPLICATION, or the stream it began"
    COMMAND = "a replication command (IDENTIFY_SYSTEM, TIMELINE_HISTORY, ALTER_REPLICATION_SLOT)"
    STATEMENT = "a statement on an ordinary connection"


_CONNECTING = frozenset({During.CONNECT, During.REPLICATION, During.COMMAND})
_REPLICATING = frozenset({During.REPLICATION, During.COMMAND})
_STATEMENTS = frozenset({During.STATEMENT})

# The one table, read top to bottom: the first row whose psycopg class the error is (by its
# SQLSTATE, psycopg.errors.lookup) and whose situations include the failing one decides; no row:
# SourceUnavailable (retry with backoff). SlotInUse and SourceSetupError stop for an operator.
PG_ERROR_MAP: tuple[tuple[type[psycopg.Error], type[SourceError], frozenset[During]], ...] = (
    (errors.ObjectInUse, SlotInUse, _REPLICATING),  # another process streams from the slot
    (errors.InvalidAuthorizationSpecification, SourceSetupError, _CONNECTING),  # pg_hba, no role
    (errors.InvalidPassword, SourceSetupError, _CONNECTING),  # authentication failed
    (errors.InvalidCatalogName, SourceSetupError, _CONNECTING),  # no such database
    (errors.InsufficientPrivilege, SourceSetupError, _CONNECTING),
    (errors.UndefinedObject, SourceSetupError, _REPLICATING),  # no such slot or publication
    (errors.ObjectNotInPrerequisiteState, SourceSetupError, _REPLICATING),  # e.g. wal_level
    # Statements: a lost connection, a timeout, a lock not granted pass; a statement the server
    # refuses for what it says (a privilege, a table gone) does not.
    (psycopg.OperationalError, SourceUnavailable, _STATEMENTS),
    (psycopg.Error, SourceSetupError, _STATEMENTS),
)
# A replication command failing with syntax/access (42), object state (55) or "not supported"
# (0A) fails for an operator to fix, whatever the code within the class (known to psycopg or not).
COMMAND_SETUP_CLASSES = ("42", "55", "0A")


def kind_of(
    sqlstate: str | None, during: During, raised: type[psycopg.Error] | None = None
) -> type[SourceError]:
    """The project's kind for a failure with ``sqlstate`` (and psycopg class ``raised``)."""
    found = raised
    if sqlstate:
        try:
            found = errors.lookup(sqlstate)
        except KeyError:
            found = None  # a SQLSTATE this psycopg does not know: no row matches it
    if found is not None:
        for error, kind, situations in PG_ERROR_MAP:
            if during in situations and issubclass(found, error):
                return kind
    if during is During.COMMAND and sqlstate and sqlstate[:2] in COMMAND_SETUP_CLASSES:
        return SourceSetupError
    return SourceUnavailable


def error_for(exc: psycopg.Error, during: During, doing: str = "") -> SourceError:
    """``exc`` as the project's error; its message ``doing: <psycopg's>``, or psycopg's alone."""
    kind = kind_of(exc.sqlstate, during, type(exc))
    return kind(f"{doing}: {message(exc)}" if doing else message(exc))


def message(exc: psycopg.Error) -> str:
    """What psycopg says about ``exc``, as one line (:func:`one_line`)."""
    return one_line(str(exc))


def one_line(text: str) -> str:
    """libpq's (or the server's) message with its line breaks taken out.

    A line indented and starting in lower case continues the wrapped sentence before it and is
    joined with a space; any other line (a hint, the next host tried, a DETAIL) after a ``"; "``.
    """
    joined = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if not joined:
            joined = line
        elif raw[:1].isspace() and line[:1].islower():
            joined += " " + line
        else:
            joined += "; " + line
    return joined


@contextmanager
def mapped(during: During, doing: str = "") -> Iterator[None]:
    """Whatever psycopg raises inside becomes the project's error (:func:`error_for`)."""
    try:
        yield
    except psycopg.Error as exc:
        raise error_for(exc, during, doing) from None


# -- connection attempts --------------------------------------------------------------------------

# libpq's own client-side refusals: the connection string asks for something impossible.
_CONFIG_MESSAGES = (
    "invalid sslmode",
    "invalid gssencmode",
    "invalid channel_binding",
    "invalid target_session_attrs",
    "invalid port number",
    "invalid integer value",
    "invalid connection option",
    "invalid percent-encoded",
    "could not read root certificate",
    "root certificate file",
    "certificate present, but not private key",
    "could not open certificate file",
    "could not load private key",
    "sslmode value",
)
# What a server answers without a SQLSTATE libpq passes on, that retrying will not fix.
_PERMANENT_MESSAGES = (
    "password authentication failed",
    "no pg_hba.conf entry",
    "does not exist",
    "server does not support ssl, but ssl was required",
    "no password supplied",
    "pg_hba.conf rejects",
)


def connect_failure_kind(message: str, sqlstate: str | None) -> str:
    """``"config"``, ``"permanent"`` or ``"transient"`` for a failed connection attempt.

    Permanent failures (authentication, a missing database or role, an impossible option) are
    for an operator to fix; transient ones (DNS, refused, timeout, too many connections, a
    server starting up) go away by themselves and are retried.
    """
    lowered = message.lower()
    if any(fragment in lowered for fragment in _CONFIG_MESSAGES):
        return "config"
    if kind_of(sqlstate, During.CONNECT) is SourceSetupError or any(
        f in lowered for f in _PERMANENT_MESSAGES
    ):
        return "permanent"
    return "transient"


def connect_error(message: str, sqlstate: str | None, url: str, doing: str) -> RelayError:
    """The project's error for a failed connection attempt, its message scrubbed of secrets.

    ConfigError (exit 2) for a connection string libpq refuses, SourceSetupError (exit 3) for a
    server that refuses this role or database, SourceUnavailable (retried) for the rest.
    """
    text = one_line(scrub(message, url))
    kind = connect_failure_kind(text, sqlstate)
    if kind == "config":
        return ConfigError(f"invalid configuration: CDC_RELAY_DATABASE_URL: {doing}: {text}")
    if kind == "permanent":
        return SourceSetupError(f"{doing}: {text} (permanent: fix the role, database or access)")
    return SourceUnavailable(f"{doing}: {text}")
