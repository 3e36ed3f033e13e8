"""Every wait on PostgreSQL is bounded or visible (:mod:`cdc_relay.waits`), against a real server.

A second connection holds what the relay would wait for — an advisory lock, an open transaction,
a row lock on the position record — as an unprivileged role or an owner's forgotten psql would.
Each test asserts the wait is named in a log line within seconds (the holder's pid and role), that
SIGTERM ends the relay within ``CDC_RELAY_SHUTDOWN_TIMEOUT`` plus a few seconds whatever it waits
on, and that once the holder lets go the relay proceeds and delivers every event.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import psycopg
import pytest
from psycopg import sql

from cdc_relay.local.relay_process import RelayProcess as BaseRelayProcess
from tests.conftest import KafkaBroker, skip_if_external
from tests.integration.relay_support import (
    RelayProcess,
    create_outbox,
    log_field,
    new_event,
    relay_env,
    scalar,
    wait_until,
    write_transactions,
)
from tests.integration.test_admin import cdc_relay, failed
from tests.integration.test_least_privilege import PUBLICATION, least_privilege  # noqa: F401
from tests.integration.test_privileged_paths import MakeRole, login_role  # noqa: F401
from tests.kafka_helpers import Record, consume_all

pytestmark = pytest.mark.integration

# The advisory lock key ("cdcd", the state file's name) a relay of an earlier version held while it
# created its state tables: any role that may connect can take it.
STATE_DDL_LOCK = (0x63646364, "002_cdc_relay_state.sql")
NAMED_WITHIN = 3.0  # seconds a wait lasts before it is named in a log line (the relay: ~1)
START_WITHIN = 30.0
SHUTDOWN_TIMEOUT = 2.0
STOP_GRACE = 5.0  # seconds past CDC_RELAY_SHUTDOWN_TIMEOUT a stop may take, whatever it waits on


def _ids(records: list[Record]) -> list[str]:
    return [(r.header("id") or b"").decode() for r in records]


def test_an_advisory_lock_held_by_a_login_only_role_does_not_hold_up_the_state_tables(
    database: str,
    broker: KafkaBroker,
    unique: str,
    login_role: MakeRole,  # noqa: F811
) -> None:
    """A LOGIN-only role holds the advisory lock that once serialised the state tables' DDL: the
    relay creates its state tables and streams all the same, and ``setup`` finishes."""
    create_outbox(database)
    squatter = login_role("squatter")
    topic = f"{unique}.order"
    broker.create_topic(topic, partitions=1)
    env = relay_env(database, broker.bootstrap_servers, unique)
    with psycopg.connect(squatter, autocommit=True) as held:
        held.execute("SELECT pg_advisory_lock(%s, hashtext(%s))", STATE_DDL_LOCK)
        relay = RelayProcess(env).start()
        try:
            relay.wait_streaming(START_WITHIN)
            events = [new_event("order", "o-1", "created", {"n": n}) for n in range(3)]
            write_transactions(database, [events])
            records = consume_all(broker.bootstrap_servers, [topic], 3, 30)
            assert relay.stop() == 0, relay.logs()
        finally:
            relay.close()
        assert _ids(records) == [e.id for e in events]

        other = relay_env(database, broker.bootstrap_servers, f"{unique}b", state_schema="s2")
        started = time.monotonic()
        result = cdc_relay(other, "setup", timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr
        assert time.monotonic() - started < START_WITHIN
        assert "created state table s2.slot_position" in result.stdout


def _named(relay: BaseRelayProcess, what: str) -> str:
    """The first log line naming a wait for ``what``, once it is there."""
    message = f"waiting on PostgreSQL: {what}"
    wait_until(lambda: message in relay.logs(), START_WITHIN, f"{message!r} logged")
    line = next(line for line in relay.logs().splitlines() if message in line)
    waited = log_field(line, message, "waited_s")
    assert waited is not None, line
    assert float(waited) <= NAMED_WITHIN, line
    return line


def _stopped_in_time(relay: BaseRelayProcess) -> None:
    """SIGTERM ends the relay within its shutdown timeout plus a few seconds."""
    began = time.monotonic()
    code = relay.stop(timeout=60)
    took = time.monotonic() - began
    assert code == 0, relay.logs()
    assert took < SHUTDOWN_TIMEOUT + STOP_GRACE, f"stopped after {took:.1f}s:\n{relay.logs()}"


def test_an_open_transaction_holding_up_the_slot_is_named_and_a_stop_ends_the_wait(
    database: str,
    broker: KafkaBroker,
    unique: str,
    least_privilege: tuple[str, str],  # noqa: F811
    login_role: MakeRole,  # noqa: F811
) -> None:
    """A LOGIN-only role's open transaction (with a transaction id) holds up the slot's creation:
    the relay, as the documented non-superuser role, names it (pid, role, application) within
    seconds, ``check`` names it, SIGTERM ends the wait at once; started again, the relay goes on
    once the transaction ends and delivers every event."""
    relay_url, _owner = least_privilege
    blocker = login_role("app")
    role = f"app_{unique}"
    topic = f"{unique}.order"
    broker.create_topic(topic, partitions=1)
    env = relay_env(
        relay_url,
        broker.bootstrap_servers,
        unique,
        publication_name=PUBLICATION,
        shutdown_timeout=str(SHUTDOWN_TIMEOUT),
        log_level="INFO",
    )
    with psycopg.connect(blocker, autocommit=True, application_name="forgotten psql") as held:
        held.execute("BEGIN")
        held.execute("SELECT txid_current()")
        pid = held.info.backend_pid
        relay = RelayProcess(env).start()
        try:
            line = _named(relay, f"creating replication slot slot_{unique}")
            assert f"pid {pid} (role {role}, application 'forgotten psql'" in line, line
            assert f"pg_terminate_backend({pid})" in line, line
            assert "the slot cannot be created until this transaction ends" in line, line
            checked = failed(cdc_relay(env, "check")).get("waits", "")
            assert f"pid {pid} (role {role}" in checked, checked
            assert f"pg_terminate_backend({pid})" in checked, checked
            _stopped_in_time(relay)
        finally:
            relay.close()
        # No relay running: the slot is not there, and the transaction its creation would wait
        # for is named.
        checked = failed(cdc_relay(env, "check")).get("waits", "")
        assert f"pid {pid} (role {role}, application 'forgotten psql'" in checked, checked
        assert f"creating slot slot_{unique} waits until it ends" in checked, checked

        relay = RelayProcess(env).start()
        try:
            _named(relay, f"creating replication slot slot_{unique}")
            held.execute("COMMIT")
            relay.wait_streaming(START_WITHIN)
            events = [new_event("order", "o-1", "created", {"n": n}) for n in range(3)]
            write_transactions(database, [events[:1], events[1:]])
            records = consume_all(broker.bootstrap_servers, [topic], 3, 30)
            assert relay.stop() == 0, relay.logs()
        finally:
            relay.close()
    assert _ids(records) == [e.id for e in events]


def _recorded(database: str, slot: str) -> str:
    return str(
        scalar(
            database,
            "SELECT confirmed_lsn::text FROM cdc_relay.slot_position WHERE slot_name = %s",
            slot,
        )
    )


def _confirming_relay(
    database: str, broker: KafkaBroker, unique: str
) -> tuple[str, str, dict[str, str]]:
    """An outbox, the relay's slot name, its one-partition topic, and settings that confirm (and
    so write the position record) every fraction of a second and retry sessions soon."""
    create_outbox(database)
    topic = f"{unique}.order"
    broker.create_topic(topic, partitions=1)
    env = relay_env(
        database,
        broker.bootstrap_servers,
        unique,
        confirm_interval="0.2",
        idle_confirm_interval="0.3",
        shutdown_timeout=str(SHUTDOWN_TIMEOUT),
        reconnect_max_backoff="2",
        log_level="INFO",
    )
    return f"slot_{unique}", topic, env


def test_a_row_lock_on_the_position_record_is_named_the_leader_keeps_its_lease_and_loses_nothing(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    """An owner's open psql holds the position record's row (``SELECT ... FOR UPDATE``): the
    blocked write is named (pid, role, application) within seconds and gives up after its lock
    timeout; the leader keeps its lease, streams nothing more while it cannot record, and goes on
    once the lock is gone, delivering every event; SIGTERM ends it within the shutdown timeout
    plus a few seconds while it is blocked."""
    slot, topic, env = _confirming_relay(database, broker, unique)
    events = [new_event("order", "o-1", "created", {"n": n}) for n in range(9)]
    lock_row = sql.SQL("SELECT * FROM cdc_relay.slot_position WHERE slot_name = {} FOR UPDATE")
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming(START_WITHIN)
        write_transactions(database, [events[:3]])
        consume_all(broker.bootstrap_servers, [topic], 3, 30)
        before = _recorded(database, slot)
        with psycopg.connect(database, autocommit=True, application_name="owner psql") as held:
            held.execute("BEGIN")
            held.execute(lock_row.format(sql.Literal(slot)))
            pid = held.info.backend_pid
            write_transactions(database, [events[3:6]])
            line = _named(relay, "recording the position")
            assert f"pid {pid} (role postgres, application 'owner psql'" in line, line
            assert "a row of cdc_relay.slot_position" in line or "transaction" in line, line
            assert f"pg_terminate_backend({pid})" in line, line
            checked = failed(cdc_relay(env, "check")).get("waits", "")
            assert f"pid {pid} (role postgres, application 'owner psql'" in checked, checked
            assert f"row lock on slot {slot}'s position record" in checked, checked
            # The write gives up; the sessions after it cannot record either, and say why.
            wait_until(
                lambda: relay.logs().count("session ended, retrying") >= 2,
                START_WITHIN,
                "the blocked sessions ended and were retried",
            )
            assert _recorded(database, slot) == before
            held.execute("ROLLBACK")
        relay.wait_for_log("streaming", START_WITHIN)
        write_transactions(database, [events[6:]])
        records = consume_all(broker.bootstrap_servers, [topic], 9, 30, grace=1.0)
        wait_until(
            lambda: _recorded(database, slot) != before, START_WITHIN, "the position moved on"
        )
        assert "lost the leadership" not in relay.logs(), relay.logs()
        assert "cannot renew the leader lease" not in relay.logs(), relay.logs()

        with psycopg.connect(database, autocommit=True, application_name="owner psql") as held:
            held.execute("BEGIN")
            held.execute(lock_row.format(sql.Literal(slot)))
            write_transactions(database, [[new_event("order", "o-1", "created", {"n": 9})]])
            marker = relay.logs().count("waiting on PostgreSQL: recording the position")
            wait_until(
                lambda: (
                    relay.logs().count("waiting on PostgreSQL: recording the position") > marker
                ),
                START_WITHIN,
                "the blocked write named again",
            )
            _stopped_in_time(relay)
    finally:
        relay.close()
    ids = list(dict.fromkeys(_ids(records)))
    assert ids == [e.id for e in events]


def _start_backend(database: str, stopped: list[int]) -> int:
    """The pid of the relay's start connection's backend (its position writes, its heartbeats),
    not one ``stopped`` already."""
    pid = scalar(
        database,
        "SELECT pid FROM pg_stat_activity WHERE application_name = 'cdc-relay' "
        "AND backend_type = 'client backend' AND datname = current_database() "
        "AND pid <> ALL(%s)",
        stopped,
    )
    assert pid is not None, "the relay's start connection is not there"
    return int(str(pid))


def test_a_server_that_stops_answering_is_given_up_on_and_a_stop_ends_the_wait(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    """The backend of the relay's position writes is stopped (SIGSTOP): the connection stands,
    the kernel acknowledges, and nothing answers — a server's lock and statement timeouts cannot
    fire. The blocked write is named within seconds and given up on at its deadline; the next
    session records on a new connection and delivers every event. Stopped again, SIGTERM ends
    the relay within the shutdown timeout plus a few seconds."""
    skip_if_external("stops a backend of the test's own server")
    slot, topic, env = _confirming_relay(database, broker, unique)
    events = [new_event("order", "o-1", "created", {"n": n}) for n in range(6)]
    stopped: list[int] = []
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming(START_WITHIN)
        before = _recorded(database, slot)
        stopped.append(_start_backend(database, stopped))
        os.kill(stopped[-1], signal.SIGSTOP)
        write_transactions(database, [events[:3]])
        line = _named(relay, "")  # the first write of the record, whichever it is
        assert "position" in line, line
        assert "does not answer" in line, line
        relay.wait_for_log("session ended, retrying", START_WITHIN)
        write_transactions(database, [events[3:]])
        records = consume_all(broker.bootstrap_servers, [topic], 6, 30, grace=1.0)
        wait_until(
            lambda: _recorded(database, slot) != before, START_WITHIN, "the position moved on"
        )

        stopped.append(_start_backend(database, stopped))
        os.kill(stopped[-1], signal.SIGSTOP)
        write_transactions(database, [[new_event("order", "o-1", "created", {"n": 6})]])
        marker = relay.logs().count("waiting on PostgreSQL: ")
        wait_until(
            lambda: relay.logs().count("waiting on PostgreSQL: ") > marker,
            START_WITHIN,
            "the blocked write named again",
        )
        _stopped_in_time(relay)
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        relay.close()
    ids = list(dict.fromkeys(_ids(records)))
    assert ids == [e.id for e in events]
