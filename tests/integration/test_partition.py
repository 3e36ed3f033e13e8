"""Network partitions: a relay cut off from PostgreSQL with its TCP connections open.

The relay's side of its connections goes through :class:`tests.integration.tcp_proxy.TcpProxy`,
whose ``cut()`` drops every packet while every socket stays open — the case that kill -9, a clean
stop and SIGSTOP (test_high_availability.py) do not cover: the process runs on, its connections
look alive to it, and only TCP's own timeouts (or none) can tell it otherwise. Each step's time is
measured and printed.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Iterator

import orjson
import pytest
from psycopg.conninfo import conninfo_to_dict

from cdc_relay.local.lifetime import free_port
from tests.conftest import KafkaBroker
from tests.integration import tcp_proxy
from tests.integration.relay_support import (
    PositionSampler,
    RelayProcess,
    create_outbox,
    http_get,
    wait_until,
)
from tests.integration.tcp_proxy import TcpProxy
from tests.integration.test_high_availability import (
    LEASE,
    RENEW,
    Writers,
    _by_pid,
    _check_nothing_lost_and_order_kept,
    _env,
    _leader_pid,
    _reader,
    _start,
    relays,  # noqa: F401 - the fixture
)

pytestmark = pytest.mark.integration

BACK_AS_STANDBY = "competing for leadership again"  # the leadership thread reached the database


@pytest.fixture
def proxy(database: str) -> Iterator[TcpProxy]:
    reason = tcp_proxy.unavailable()
    if reason is not None:
        pytest.skip(reason)
    params = conninfo_to_dict(database)
    try:
        made = TcpProxy(str(params["host"]), int(str(params["port"])))
    except subprocess.CalledProcessError as exc:
        denied = ("Operation not permitted", "Permission denied")
        if any(text in exc.stderr.decode(errors="replace") for text in denied):
            pytest.skip(f"no network namespaces here (a container without CAP_SYS_ADMIN): {exc}")
        raise
    with made:
        yield made


def _role(port: int) -> str:
    return str(orjson.loads(http_get(port, "/status")[1])["role"])


def _confirmed_since(relay: RelayProcess, mark: int) -> list[str]:
    return [line for line in relay.logs()[mark:].splitlines() if "confirmation: confirmed" in line]


class RoleWatch:
    """Polls a relay's /status from now on and notes when its role first reads ``role``."""

    def __init__(self, port: int, role: str) -> None:
        self._port = port
        self._role = role
        self._seen: float | None = None
        self._thread = threading.Thread(target=self._run, args=(time.monotonic() + 60,))
        self._thread.start()

    def _run(self, deadline: float) -> None:
        while self._seen is None and time.monotonic() < deadline:
            if _role(self._port) == self._role:
                self._seen = time.monotonic()
            time.sleep(0.05)

    def wait(self, timeout: float) -> float:
        """The monotonic time the role was first seen."""
        self._thread.join(timeout)
        assert self._seen is not None, f"role {self._role!r} not seen within {timeout}s"
        return self._seen


def test_a_partitioned_leader_steps_down_and_comes_back_as_a_working_standby(
    database: str,
    broker: KafkaBroker,
    unique: str,
    relays: list[RelayProcess],  # noqa: F811 - the fixture
    proxy: TcpProxy,
) -> None:
    create_outbox(database)
    slot = f"slot_{unique}"
    ports = [free_port(), free_port()]
    cut_off = _env(proxy.url(database), broker, unique, http_port=str(ports[0]), log_level="DEBUG")
    direct = _env(database, broker, unique, http_port=str(ports[1]), log_level="DEBUG")
    reader = _reader(broker, unique)
    sampler: PositionSampler | None = None
    try:
        old = _start(relays, cut_off).wait_streaming()
        new = _start(relays, direct)
        new.wait_for_log("standby: another relay leads")
        assert _leader_pid(database, slot) == old.pid
        with Writers(database, threads=1, rate=200) as writers:
            sampler = PositionSampler(database, slot)
            reader.first_new_event_after(time.monotonic(), writers, 20)
            wait_until(lambda: bool(_confirmed_since(old, 0)), 20, "old to confirm")
            proxy.cut()
            # Taken once the cut is in place: a transaction begun while `ip` was still deleting
            # the address can reach the old leader, and its event proves no takeover.
            fault = time.monotonic()
            # The cut-off leader says by itself, by its own clock, that it no longer leads.
            role = RoleWatch(ports[0], "standby")
            # The standby takes over once the lease has expired by the database's clock.
            took = reader.first_new_event_after(fault, writers, LEASE + 15)
            assert _by_pid(relays, _leader_pid(database, slot)) is new
            after_takeover = len(old.logs())
            stepped_down = role.wait(LEASE + 10) - fault
            assert http_get(ports[0], "/readyz")[0] == 503
            time.sleep(LEASE)  # a partition longer than the lease and its detection
            mark = len(old.logs())
            healed = time.monotonic()
            proxy.heal()
            wait_until(
                lambda: BACK_AS_STANDBY in old.logs()[mark:], 30, "old to compete again (standby)"
            )
            back = time.monotonic() - healed
            time.sleep(2 * RENEW + 1)  # it stands by while the new leader confirms a few times
            assert _leader_pid(database, slot) == new.pid, "the old leader took the lease back"
            assert _role(ports[0]) == "standby"
            assert not _confirmed_since(old, after_takeover), "the old leader confirmed after"
            # It really is a working standby: it takes over when the new leader dies.
            killed = time.monotonic()
            new.kill()
            retook = reader.first_new_event_after(killed, writers, LEASE + 15)
            assert _leader_pid(database, slot) == old.pid
        sampler.close()
        duplicates, _ = _check_nothing_lost_and_order_kept(reader, writers)
    finally:
        if sampler is not None:
            sampler.close()
        reader.close()
    print(
        f"\npartition (lease {LEASE:g}s, renew {RENEW:g}s): standby took over {took:.2f}s after "
        f"the cut; the cut-off leader said standby {stepped_down:.2f}s after it; after the heal "
        f"it competed again in {back:.2f}s; it took over from a killed leader in {retook:.2f}s; "
        f"{len(writers.events)} events, {duplicates} duplicates"
    )
    assert "ending its connections and taking over" in new.logs()
    sampler.check()
    assert took <= LEASE + 5
    assert stepped_down <= LEASE + 2
    assert back <= 15
    assert retook <= 5


def test_a_partitioned_relay_recovers_by_itself_after_the_heal(
    database: str,
    broker: KafkaBroker,
    unique: str,
    relays: list[RelayProcess],  # noqa: F811 - the fixture
    proxy: TcpProxy,
) -> None:
    create_outbox(database)
    slot = f"slot_{unique}"
    reader = _reader(broker, unique)
    # Far longer than every timeout that detects a dead connection (at most the lease here).
    # Without them TCP's retransmission backoff alone revives the connections, some time after
    # the heal that grows with the partition's length (about as long again).
    partition = 8 * LEASE
    try:
        relay = _start(relays, _env(proxy.url(database), broker, unique)).wait_streaming()
        with Writers(database, threads=1, rate=200) as writers:
            reader.first_new_event_after(time.monotonic(), writers, 20)
            proxy.cut()
            time.sleep(partition)
            healed = time.monotonic()
            proxy.heal()
            recovered = reader.first_new_event_after(healed, writers, 60)
            time.sleep(1)
        duplicates, _ = _check_nothing_lost_and_order_kept(reader, writers)
    finally:
        reader.close()
    print(
        f"\nsingle relay, {partition:g}s partition (lease {LEASE:g}s): relaying again "
        f"{recovered:.2f}s after the heal; {len(writers.events)} events, {duplicates} duplicates"
    )
    assert _leader_pid(database, slot) == relay.pid
    assert relay.stop() == 0
    assert recovered <= 15
