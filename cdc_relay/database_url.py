"""The database URL, read by libpq's own rules: validated, shown without secrets.

The URL is a credential. Anything that prints it goes through :func:`redact_url`, which parses it
with libpq (``psycopg.conninfo``) and rebuilds a ``key=value`` string with the passwords masked —
never a pattern over the raw text, which libpq may read differently (a ``#`` or ``?`` in a
password is part of the password to libpq, a fragment or a query to ``urllib``). libpq's own parse
errors quote the offending text, the password included, so they are reduced to the words before
the first quoted part and never shown verbatim.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

MASK = "***"
UNPARSEABLE = "<not a valid connection string>"
_SECRET_FRAGMENT = "password"  # noqa: S105 - a key name: password, sslpassword
_DISPLAY_ORDER = ("host", "hostaddr", "port", "dbname", "user", "password")
# libpq options with a fixed set of values; anything else fails every connection attempt.
_CHOICES = {
    "sslmode": ("disable", "allow", "prefer", "require", "verify-ca", "verify-full"),
    "gssencmode": ("disable", "prefer", "require"),
    "channel_binding": ("disable", "prefer", "require"),
    "target_session_attrs": (
        "any",
        "read-write",
        "read-only",
        "primary",
        "standby",
        "prefer-standby",
    ),
}
_SAFE_WORDS = re.compile(r"[A-Za-z ,-]*")
_PERCENT_HINT = (
    "percent-encode special characters of the user name and password "
    "(@ %40, / %2F, # %23, ? %3F, % %25, space %20)"
)


class InvalidDatabaseUrl(ValueError):
    """Why the URL is unusable, in words that never contain any part of it."""


def parse(url: str) -> dict[str, str]:
    """The connection parameters libpq reads from ``url`` (a URI or ``key=value`` pairs).

    Raises InvalidDatabaseUrl for what libpq refuses, for option values every connection attempt
    would refuse, and for URIs libpq reads differently from what their author meant (an
    unencoded ``@`` or ``/`` in the password moves part of it into the host or database name).
    """
    try:
        params = _params(url)
    except psycopg.Error as exc:
        raise InvalidDatabaseUrl(_reason(str(exc))) from None
    if re.match(r"^postgres(ql)?://", url, re.IGNORECASE):
        if any(c.isspace() for c in url):
            # RFC 3986 has no whitespace in a URI; libpq 16 (psycopg-binary 3.2.1) read it as part
            # of the value, libpq 18 refuses it: refused whatever the libpq.
            raise InvalidDatabaseUrl(f"whitespace in the URI; {_PERCENT_HINT}")
        _check_uri_authority(url.split("://", 1)[1])
    for key, choices in _CHOICES.items():
        value = params.get(key)
        if value is not None and value not in choices:
            raise InvalidDatabaseUrl(f"{key} must be one of {', '.join(choices)}")
    for port in params.get("port", "").split(","):
        if port and not (port.isdigit() and 0 < int(port) < 65536):
            raise InvalidDatabaseUrl(f"a port must be a number from 1 to 65535; {_PERCENT_HINT}")
    return params


def redact_url(url: str) -> str:
    """``url`` as libpq reads it, ``key=value`` with every password masked; safe to print."""
    try:
        params = _params(url)
    except psycopg.Error:
        return UNPARSEABLE
    shown = {key: params[key] for key in _DISPLAY_ORDER if key in params}
    shown |= {key: value for key, value in params.items() if key not in shown}
    masked = {k: (MASK if _SECRET_FRAGMENT in k.lower() else v) for k, v in shown.items()}
    return make_conninfo(**masked)


def with_defaults(url: str, defaults: Mapping[str, str]) -> str:
    """``url`` with each of ``defaults`` that it does not set itself: what the URL says wins.

    A ``key=value`` string (libpq reads a URI and ``key=value`` pairs alike). A URL libpq cannot
    read comes back unchanged, for the connection attempt to report it (without its text).
    """
    try:
        params = _params(url)
    except psycopg.Error:
        return url
    missing = {key: value for key, value in defaults.items() if key not in params}
    return make_conninfo(url, **missing) if missing else url


def has_password(url: str) -> bool:
    try:
        params = _params(url)
    except psycopg.Error:
        return False
    return any(_SECRET_FRAGMENT in key.lower() and value for key, value in params.items())


def _params(url: str) -> dict[str, str]:
    return {key: str(value) for key, value in conninfo_to_dict(url).items() if value is not None}


def _check_uri_authority(rest: str) -> None:
    # libpq takes the user info up to the first "@", and only if no "/" comes before it: a
    # second "@", or a "/" before the "@", means part of the password lands elsewhere.
    ats = rest.count("@")
    if ats > 1 or (ats == 1 and "/" in rest[: rest.index("@")]):
        raise InvalidDatabaseUrl(f"'@' or '/' outside its place in the URI; {_PERCENT_HINT}")


def _reason(message: str) -> str:
    # libpq quotes what it refuses ("invalid percent-encoded token: "hun%zz""): keep the words
    # before the first quote or other punctuation, which are libpq's, never the input's.
    first_line = message.strip().splitlines()[0] if message.strip() else ""
    words = _SAFE_WORDS.match(first_line)
    prefix = words.group().strip(" ,-") if words else ""
    reason = prefix if len(prefix.split()) >= 2 else "not a valid libpq connection string"
    return f"{reason} (value not shown); {_PERCENT_HINT}"


def scrub(text: str, url: str) -> str:
    """``text`` (a libpq or server message) with every password of ``url`` masked."""
    try:
        params = _params(url)
    except psycopg.Error:
        return _reason(text)  # the secrets are unknown: only libpq's own words are safe
    for key, value in params.items():
        if _SECRET_FRAGMENT in key.lower() and value:
            text = text.replace(value, MASK)
    return text
