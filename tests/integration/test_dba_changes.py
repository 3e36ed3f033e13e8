"""What a DBA may do to the outbox and its publication while the relay runs
(docs/operations/dba-changes.md), each change made between inserts with the relay's own sweeper
on. The rule under test: every committed row reaches Kafka, or the relay stops loudly (exit 3, an
ERROR naming the change and the fix) and the row stays in the outbox — never swept unpublished —
and the documented way on (fix, restart) delivers it or names it. Real PostgreSQL, the real
broker, the real relay; both output plugins where the change means something to both."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import orjson
import psycopg
import pytest
from psycopg import sql

from cdc_relay.sweeper import Sweeper
from tests.conftest import KafkaBroker
from tests.integration.relay_support import (
    OUTBOX_DDL,
    RelayProcess,
    create_outbox,
    relay_env,
    relay_settings,
    scalar,
    wait_until,
)
from tests.integration.test_admin import cdc_relay
from tests.integration.test_least_privilege import PUBLICATION, least_privilege  # noqa: F401
from tests.kafka_helpers import BackgroundReader

pytestmark = pytest.mark.integration

# The relay confirms (and so checks the publication) within a fraction of a second, and sweeps
# its published rows as often.
RELAY = {
    "confirm_interval": "0.2",
    "idle_confirm_interval": "0.3",
    "sweep_interval": "0.3",
    "topic_partitions": "1",
}
STOPPED = "changed under the relay"  # the ERROR of a relay that noticed a change
UNRELAYED = "may not have been relayed"  # the ERROR of a start that names rows


class Run:
    """One test's outbox, relay settings and topic, and every event it wrote."""

    def __init__(self, database: str, broker: KafkaBroker, unique: str, **extra: str) -> None:
        self.database = database
        self.broker = broker
        self.topic = f"{unique}.order"
        broker.create_topic(self.topic, partitions=1)
        self.env = relay_env(database, broker.bootstrap_servers, unique, **{**RELAY, **extra})
        self.publication = self.env["CDC_RELAY_PUBLICATION_NAME"]
        self.slot = self.env["CDC_RELAY_SLOT_NAME"]
        self.written: list[str] = []

    def write(self, count: int, table: str = "outbox", aggregate_type: str = "order") -> list[str]:
        """``count`` events into ``table``, a transaction each; their ids."""
        ids = [str(uuid.uuid4()) for _ in range(count)]
        insert = sql.SQL(
            "INSERT INTO {} (id, aggregate_type, aggregate_id, event_type, payload) "
            "VALUES (%s, %s, 'a-1', 'created', %s::jsonb)"
        ).format(sql.Identifier(table))
        with psycopg.connect(self.database, autocommit=True) as conn:
            for n, event_id in enumerate(ids):
                conn.execute(insert, (event_id, aggregate_type, orjson.dumps({"n": n}).decode()))
        self.written += ids
        return ids

    def ddl(self, *statements: str) -> None:
        with psycopg.connect(self.database, autocommit=True) as conn:
            for statement in statements:
                conn.execute(statement.encode())  # the test's own text

    def remaining(self, table: str = "outbox") -> set[str]:
        with psycopg.connect(self.database, autocommit=True) as conn:
            rows = conn.execute(sql.SQL("SELECT id::text FROM {}").format(sql.Identifier(table)))
            return {str(r[0]) for r in rows.fetchall()}

    def xmins(self, ids: list[str], table: str = "outbox") -> list[int]:
        with psycopg.connect(self.database, autocommit=True) as conn:
            rows = conn.execute(
                sql.SQL("SELECT xmin::text FROM {} WHERE id = ANY(%s::uuid[])").format(
                    sql.Identifier(table)
                ),
                (ids,),
            ).fetchall()
        return [int(str(r[0])) for r in rows]

    def relay(self, **changes: str) -> RelayProcess:
        env = {**self.env, **{f"CDC_RELAY_{k.upper()}": v for k, v in changes.items()}}
        return RelayProcess(env).start()

    @contextmanager
    def streaming(self, **changes: str) -> Iterator[RelayProcess]:
        """A relay streaming for the ``with`` block, which stops it cleanly (exit 0) after."""
        relay = self.relay(**changes)
        try:
            yield relay.wait_streaming()
            assert relay.stop() == 0, relay.logs()
        finally:
            relay.close()

    def sweep(self, **changes: object) -> None:
        """A sweep beside the relay (the ``sweep`` command's code), for a few seconds."""
        sweeper = Sweeper(relay_settings(self.env, **changes))
        try:
            sweeper.sweep_until_done(timeout=2)
        finally:
            sweeper.close()


@pytest.fixture
def run(database: str, broker: KafkaBroker, unique: str) -> Run:
    create_outbox(database)
    return Run(database, broker, unique)


@pytest.fixture
def reader(run: Run) -> Iterator[BackgroundReader]:
    with BackgroundReader(run.broker.bootstrap_servers, run.topic) as found:
        yield found


def _arrive(reader: BackgroundReader, ids: list[str], timeout: float = 30) -> None:
    wait_until(lambda: set(ids) <= reader.event_ids(), timeout, f"{len(ids)} events in Kafka")


def _outcome(relay: RelayProcess, reader: BackgroundReader, ids: list[str], timeout: float) -> int:
    """Waits until every one of ``ids`` arrived or the relay exited: its exit code, or 0 while
    it runs on with everything delivered."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert relay.proc is not None
        code = relay.proc.poll()
        if code is not None:
            return code
        if set(ids) <= reader.event_ids():
            return 0
        time.sleep(0.1)
    raise AssertionError(
        f"neither delivered nor stopped within {timeout}s: "
        f"{len(set(ids) - reader.event_ids())} of {len(ids)} missing\n{relay.logs()}"
    )


def _stopped_loudly(relay: RelayProcess, code: int, *words: str) -> str:
    """The relay stopped with exit 3 and an ERROR naming the change: that line."""
    assert code == 3, relay.logs()
    errors = [line for line in relay.logs().splitlines() if " ERROR " in line and STOPPED in line]
    assert errors, relay.logs()
    for word in words:
        assert word in errors[-1], errors[-1]
    return errors[-1]


def _named(relay: RelayProcess) -> tuple[int, int]:
    """The transactions a start names as possibly not relayed: [from, to) as 32-bit xids."""
    lines = [line for line in relay.logs().splitlines() if " ERROR " in line and UNRELAYED in line]
    assert lines, relay.logs()
    found = re.search(r"from_xid=(\d+) to_xid=(\d+)", lines[-1])
    assert found is not None, lines[-1]
    return int(found.group(1)) & 0xFFFFFFFF, int(found.group(2)) & 0xFFFFFFFF


def _within(xmins: list[int], named: tuple[int, int]) -> bool:
    low, high = named
    return bool(xmins) and all(low <= x < high for x in xmins)


def _named_and_kept(relay: RelayProcess, run: Run, rows: list[str], table: str = "outbox") -> None:
    """The start named the transactions of ``rows``, and passes of its sweeper later every one
    of them is still in the outbox."""
    assert _within(run.xmins(rows, table), _named(relay))
    time.sleep(1.5)  # passes of the relay's sweeper
    assert set(rows) <= run.remaining(table), "a named row was swept"


def _not_named(relay: RelayProcess) -> None:
    assert UNRELAYED not in relay.logs(), relay.logs()


# -- ALTER PUBLICATION ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("off", "on"),
    [
        ("ALTER PUBLICATION {p} DROP TABLE outbox", "ALTER PUBLICATION {p} ADD TABLE outbox"),
        (
            "ALTER PUBLICATION {p} SET (publish = 'update')",
            "ALTER PUBLICATION {p} SET (publish = 'insert')",
        ),
    ],
    ids=["drop-add-table", "publish-off-on"],
)
def test_inserts_unpublished_for_a_while_stop_the_relay_and_are_never_swept(
    run: Run, reader: BackgroundReader, plugin: str, off: str, on: str
) -> None:
    """The publication stops publishing the outbox's inserts, rows are committed, and it
    publishes them again: pgoutput never decoded those rows. The relay stops at its next
    position write (exit 3, naming the change), nothing sweeps them, and the restart names them.
    wal2json ignores publications: everything arrives, the relay runs on."""
    relay = run.relay()
    try:
        relay.wait_streaming()
        before = run.write(3)
        _arrive(reader, before)
        run.ddl(off.format(p=run.publication))
        gap = run.write(3)
        run.ddl(on.format(p=run.publication))
        after = run.write(3)
        code = _outcome(relay, reader, run.written, timeout=20)
        if plugin == "wal2json":
            assert code == 0
            assert reader.duplicates() == 0
            return
        _stopped_loudly(relay, code, run.publication)
        run.sweep()
        assert set(gap) <= run.remaining(), "an unpublished row was swept"
    finally:
        relay.close()
    assert not set(gap) & reader.event_ids()
    with run.streaming() as relay:
        _arrive(reader, after)  # committed once the table was published again
        _named_and_kept(relay, run, gap)


def test_a_row_filter_set_on_the_publication_stops_the_relay(
    run: Run, reader: BackgroundReader, row_filters_missing: str | None
) -> None:
    """A DBA gives the publication a row filter the relay does not have: pgoutput stops
    sending the rows it leaves out. The relay stops; its restart sets its own filter again and
    names the rows the other one kept from it, which stay in the outbox."""
    if row_filters_missing:
        pytest.skip(row_filters_missing)
    relay = run.relay()
    try:
        relay.wait_streaming()
        _arrive(reader, run.write(2))
        run.ddl(f"ALTER PUBLICATION {run.publication} SET TABLE outbox WHERE (event_type = 'x')")
        gap = run.write(3)
        code = _outcome(relay, reader, run.written, timeout=20)
        _stopped_loudly(relay, code, "row filter")
        run.sweep()
        assert set(gap) <= run.remaining()
    finally:
        relay.close()
    with run.streaming() as relay:
        assert _within(run.xmins(gap), _named(relay))
        after = run.write(2)
        _arrive(reader, after)
        assert set(gap) <= run.remaining()


def test_a_column_list_on_the_publication_stops_the_relay_and_its_start(
    run: Run, reader: BackgroundReader, column_lists_missing: str | None
) -> None:
    """A column list without a mapped column: the relay stops, and refuses to start (exit 3,
    naming the statement that fixes it) until every mapped column is published again."""
    if column_lists_missing:
        pytest.skip(column_lists_missing)
    relay = run.relay()
    try:
        relay.wait_streaming()
        _arrive(reader, run.write(2))
        run.ddl(
            f"ALTER PUBLICATION {run.publication} SET TABLE outbox "
            "(id, aggregate_type, aggregate_id, event_type)"
        )
        gap = run.write(2)
        code = _outcome(relay, reader, run.written, timeout=20)
        _stopped_loudly(relay, code, "column list")
    finally:
        relay.close()
    relay = run.relay()
    try:
        assert relay.wait(60) == 3
        assert "payload" in relay.logs()
        assert f'ALTER PUBLICATION "{run.publication}" DROP TABLE "public"."outbox"' in relay.logs()
    finally:
        relay.close()
    run.ddl(f"ALTER PUBLICATION {run.publication} SET TABLE outbox")
    with run.streaming() as relay:
        assert _within(run.xmins(gap), _named(relay))
    assert set(gap) <= run.remaining() | reader.event_ids()


def test_setup_with_another_row_filter_is_refused_while_a_relay_streams(
    run: Run, reader: BackgroundReader, row_filters_missing: str | None
) -> None:
    """``setup`` would give the publication its own row filter: refused (exit 3, naming the
    relay that streams), and the relay streams on untouched."""
    if row_filters_missing:
        pytest.skip(row_filters_missing)
    with run.streaming() as relay:
        _arrive(reader, run.write(2))
        result = cdc_relay({**run.env, "CDC_RELAY_OUTBOX_ROW_FILTER": "event_type = 'x'"}, "setup")
        assert result.returncode == 3, result.stdout + result.stderr
        assert "streams" in result.stdout, result.stdout
        later = run.write(3)
        _arrive(reader, later)
        assert relay.proc is not None
        assert relay.proc.poll() is None, relay.logs()
    rowfilter = scalar(
        run.database,
        "SELECT rowfilter FROM pg_publication_tables WHERE pubname = %s",
        run.publication,
    )
    assert rowfilter is None


# -- the table's identity ------------------------------------------------------------------------


def test_a_renamed_outbox_stops_the_relay_which_resumes_under_the_new_name(
    run: Run, reader: BackgroundReader, plugin: str
) -> None:
    """The outbox renamed, a view keeping the old name for the writers: the relay stops naming
    the new name; set to it, the restart resumes where it stopped. pgoutput follows the table
    (its rows come by its oid), so every row arrives; wal2json selects rows by name, so the rows
    written under the new name before the restart are named, and stay."""
    relay = run.relay()
    try:
        relay.wait_streaming()
        _arrive(reader, run.write(3))
        run.ddl(
            "ALTER TABLE outbox RENAME TO outbox_old",
            "CREATE VIEW outbox AS SELECT * FROM outbox_old",
        )
        renamed = run.write(3)  # through the view
        code = _outcome(relay, reader, run.written, timeout=20)
        if code == 0:  # pgoutput may publish them before the position write that stops it
            assert plugin == "pgoutput"
            code = relay.wait(20)
        _stopped_loudly(relay, code, "public.outbox_old")
        run.sweep(outbox_table="public.outbox_old")
        assert set(renamed) - reader.event_ids() <= run.remaining("outbox_old")
    finally:
        relay.close()
    with run.streaming(outbox_table="public.outbox_old") as relay:
        if plugin == "pgoutput":
            _arrive(reader, renamed)
            _not_named(relay)
        else:
            assert _within(run.xmins(renamed, "outbox_old"), _named(relay))
        after = run.write(2, "outbox_old")
        _arrive(reader, after)
    assert set(renamed) <= reader.event_ids() | run.remaining("outbox_old")
    assert reader.duplicates() == 0


def test_a_dropped_and_recreated_outbox_stops_the_relay_and_its_rows_are_named(
    run: Run, reader: BackgroundReader, plugin: str
) -> None:
    """DROP + CREATE: the new table is not in the publication (pgoutput never sends its rows).
    The relay stops; it will not start until the table is published; then it names the rows it
    cannot relay, which stay. wal2json sends the new table's rows by name: they arrive."""
    relay = run.relay()
    try:
        relay.wait_streaming()
        _arrive(reader, run.write(3))
        run.ddl("DROP TABLE outbox", OUTBOX_DDL)
        fresh = run.write(3)
        code = _outcome(relay, reader, run.written, timeout=20)
        if code == 0:
            assert plugin == "wal2json"
            code = relay.wait(20)
        _stopped_loudly(relay, code, "re-created")
        run.sweep()
        assert set(fresh) - reader.event_ids() <= run.remaining()
    finally:
        relay.close()
    relay = run.relay()
    try:
        assert relay.wait(60) == 3
        assert f"ALTER PUBLICATION {run.publication} ADD TABLE public.outbox" in relay.logs()
    finally:
        relay.close()
    run.ddl(f"ALTER PUBLICATION {run.publication} ADD TABLE outbox")
    with run.streaming() as relay:
        _named(relay)  # named whether or not they arrived: the start cannot tell
        missing = list(set(fresh) - reader.event_ids())
        assert plugin == "wal2json" or set(missing) == set(fresh)
        if missing:
            _named_and_kept(relay, run, missing)
        _arrive(reader, run.write(2))


# -- changes the relay follows -------------------------------------------------------------------


def test_column_type_changes_and_new_columns_lose_nothing(
    run: Run, reader: BackgroundReader, plugin: str
) -> None:
    """ALTER COLUMN ... TYPE of a column that is not the key (a table rewrite), ADD COLUMN
    with a default, DROP COLUMN of an unmapped one: the relay follows each (a new Relation),
    every row arrives once, the relay runs on."""
    with run.streaming() as relay:
        run.write(3)
        run.ddl("ALTER TABLE outbox ALTER COLUMN aggregate_id TYPE varchar(200)")
        run.write(3)
        run.ddl("ALTER TABLE outbox ADD COLUMN tenant text NOT NULL DEFAULT 't-1'")
        run.write(3)
        run.ddl("ALTER TABLE outbox ALTER COLUMN payload TYPE json USING payload::json")
        run.write(3)
        run.ddl("ALTER TABLE outbox DROP COLUMN tenant")
        run.write(3)
        assert _outcome(relay, reader, run.written, timeout=30) == 0
        time.sleep(1)  # position writes after the last change
    assert reader.duplicates() == 0
    assert STOPPED not in relay.logs()


def test_truncate_loses_nothing_committed_before_it(
    run: Run, reader: BackgroundReader, plugin: str
) -> None:
    """TRUNCATE (a new relfilenode) right after rows the relay may not have read yet: they
    come from the WAL all the same, and so do the rows after it."""
    with run.streaming() as relay:
        run.write(5)
        run.ddl("TRUNCATE outbox")
        run.write(5)
        assert _outcome(relay, reader, run.written, timeout=30) == 0
    assert reader.duplicates() == 0
    assert STOPPED not in relay.logs()


# -- while the relay is stopped ------------------------------------------------------------------


def test_a_change_made_while_the_relay_was_stopped_is_named_at_its_start(
    run: Run, reader: BackgroundReader, plugin: str
) -> None:
    """DROP TABLE + inserts + ADD TABLE while no relay runs: the next start cannot see the
    publication as it was, but its record says which one it verified. pgoutput: the start names
    the rows of that time, and no sweep deletes them. wal2json: they arrive."""
    with run.streaming() as relay:
        _arrive(reader, run.write(2))
    run.ddl(f"ALTER PUBLICATION {run.publication} DROP TABLE outbox")
    gap = run.write(3)
    run.ddl(f"ALTER PUBLICATION {run.publication} ADD TABLE outbox")
    run.sweep()
    assert set(gap) <= run.remaining()
    with run.streaming() as relay:
        after = run.write(2)
        _arrive(reader, after)
        if plugin == "wal2json":
            _arrive(reader, gap)
            _not_named(relay)
        else:
            _named_and_kept(relay, run, gap)


def test_a_change_between_setup_and_the_first_start_is_named(
    run: Run, reader: BackgroundReader
) -> None:
    """``setup`` creates the slot (rows are streamed from then on) and records the publication
    it verified with the slot's position, as the relay does: a change before the relay's first
    start is named by it, and nothing sweeps the rows of the meantime."""
    result = cdc_relay(run.env, "setup")
    assert result.returncode == 0, result.stdout + result.stderr
    run.ddl(f"ALTER PUBLICATION {run.publication} DROP TABLE outbox")
    gap = run.write(2)
    run.ddl(f"ALTER PUBLICATION {run.publication} ADD TABLE outbox")
    after = run.write(2)
    with run.streaming() as relay:
        _arrive(reader, after)
        _named_and_kept(relay, run, gap)
    assert not set(gap) & reader.event_ids()


def test_an_unchanged_publication_names_nothing_and_sweeps_as_before(
    run: Run, reader: BackgroundReader
) -> None:
    """The control: stopped and started again with nothing changed, the relay names no rows,
    and its sweeper deletes what it published."""
    with run.streaming():
        _arrive(reader, run.write(3))
    with run.streaming() as relay:
        _arrive(reader, run.write(3))
        wait_until(lambda: not run.remaining(), 20, "the published rows swept")
    _not_named(relay)


# -- as the least-privilege role -----------------------------------------------------------------


def test_the_documented_role_notices_a_change(
    database: str,
    broker: KafkaBroker,
    unique: str,
    least_privilege: tuple[str, str],  # noqa: F811
) -> None:
    """The catalogs the check reads are readable by the relay's role (sql/005): a change made by
    the publication's owner stops a relay running as that role."""
    relay_url, owner = least_privilege
    run = Run(relay_url, broker, unique, publication_name=PUBLICATION)
    run.database = database  # the test writes and alters as the superuser
    with BackgroundReader(broker.bootstrap_servers, run.topic) as reader:
        relay = run.relay()
        try:
            relay.wait_streaming()
            _arrive(reader, run.write(2))
            run.ddl(
                f"SET ROLE {owner}",
                f"ALTER PUBLICATION {PUBLICATION} DROP TABLE outbox",
                f"ALTER PUBLICATION {PUBLICATION} ADD TABLE outbox",
                "RESET ROLE",
            )
            gap = run.write(2)
            code = relay.wait(30)
            _stopped_loudly(relay, code, PUBLICATION)
        finally:
            relay.close()
        assert set(gap) <= run.remaining() | reader.event_ids()


# -- an upgrade ----------------------------------------------------------------------------------


def test_a_state_table_from_before_the_stamp_gains_it_and_names_nothing(
    run: Run, reader: BackgroundReader
) -> None:
    """A record written by an earlier version (no stamp): the relay (here as the table's owner)
    adds the columns, takes the publication it verifies as the recorded one without naming any
    row, and sweeps as before once it has recorded it."""
    with run.streaming():
        _arrive(reader, run.write(2))
    run.ddl(  # as the earlier version left it
        "ALTER TABLE cdc_relay.slot_position DROP COLUMN publication_stamp, "
        "DROP COLUMN stamp_checked_xid"
    )
    later = run.write(2)
    with run.streaming() as relay:
        _arrive(reader, later)
        wait_until(lambda: not run.remaining(), 20, "the published rows swept")
    _not_named(relay)
    recorded = scalar(
        run.database,
        "SELECT publication_stamp->>'publication' FROM cdc_relay.slot_position "
        "WHERE slot_name = %s",
        run.slot,
    )
    assert recorded == run.publication


@pytest.mark.parametrize("how", ["recover-command", "on-slot-loss"])
def test_the_rows_a_publication_change_kept_from_the_slot_are_recovered(
    run: Run, reader: BackgroundReader, how: str
) -> None:
    """The rows named at the start (the table was out of the publication while they were
    committed) are published by `cdc-relay recover` (the relays stopped), or by the start itself
    with CDC_RELAY_ON_SLOT_LOSS=recover: each once, the rest streamed as before."""
    relay = run.relay()
    try:
        relay.wait_streaming()
        before = run.write(3)
        _arrive(reader, before)
        run.ddl(f"ALTER PUBLICATION {run.publication} DROP TABLE outbox")
        gap = run.write(3)
        run.ddl(f"ALTER PUBLICATION {run.publication} ADD TABLE outbox")
        run.write(3)
        _stopped_loudly(relay, _outcome(relay, reader, run.written, timeout=20))
    finally:
        relay.close()
    assert not set(gap) & reader.event_ids()
    if how == "recover-command":
        with run.streaming() as relay:  # names the rows, plans their recovery, streams on
            _named(relay)
            assert "run `cdc-relay recover` (with the relays stopped)" in relay.logs()
        recovered = cdc_relay(run.env, "recover")
        assert recovered.returncode == 0, recovered.stdout + recovered.stderr
    else:
        with run.streaming(on_slot_loss="recover") as relay:
            _arrive(reader, run.written)
            assert "recovered the slot" in relay.logs()
    _arrive(reader, run.written)
    time.sleep(1.0)
    assert reader.duplicates() == 0
    with run.streaming():  # and a later start finds nothing more to do
        pass
    assert reader.duplicates() == 0
