"""Heartbeats when the relay's role may not emit logical messages (pg_logical_emit_message revoked
from PUBLIC for table-less messages): said once, then off; the relay runs on."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any, cast

import psycopg
import pytest

from cdc_relay.replication.source import HEARTBEAT_PREFIX, Heartbeats


class _Conn:
    def __init__(self, refuse: bool, server_version: int = 150000) -> None:
        self.refuse = refuse
        self.calls: list[tuple[str, object]] = []
        self.info = SimpleNamespace(user="relay", server_version=server_version)

    def execute(self, query: str, params: object = None) -> None:
        self.calls.append((query, params))
        if self.refuse:
            raise psycopg.errors.InsufficientPrivilege("permission denied")


def test_a_heartbeat_is_a_message_with_its_own_prefix() -> None:
    conn = _Conn(refuse=False)
    beat = Heartbeats(cast("Any", conn))
    beat()
    beat()
    assert [params for _, params in conn.calls] == [(HEARTBEAT_PREFIX,)] * 2


@pytest.mark.parametrize(
    ("server_version", "signature"),
    [
        (140000, "pg_logical_emit_message(boolean, text, text) TO relay"),
        (160004, "pg_logical_emit_message(boolean, text, text) TO relay"),
        # PostgreSQL 17 gave the function a fourth argument, flush (with a default)
        (170000, "pg_logical_emit_message(boolean, text, text, boolean) TO relay"),
        (180004, "pg_logical_emit_message(boolean, text, text, boolean) TO relay"),
    ],
)
def test_a_refused_heartbeat_is_said_once_then_heartbeats_are_off(
    caplog: pytest.LogCaptureFixture, server_version: int, signature: str
) -> None:
    conn = _Conn(refuse=True, server_version=server_version)
    beat = Heartbeats(cast("Any", conn))
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            beat()
    assert len(conn.calls) == 1
    warnings = [r for r in caplog.records if "heartbeats are off" in r.getMessage()]
    assert len(warnings) == 1
    fix = warnings[0].__dict__["fields"]["fix"]
    assert f"GRANT EXECUTE ON FUNCTION pg_catalog.{signature} " in fix
