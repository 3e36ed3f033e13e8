"""A lost replication slot recovered from the outbox table itself (``cdc-relay recover``,
``CDC_RELAY_ON_SLOT_LOSS=recover``): every committed event reaches Kafka once, each aggregate's
first occurrences in commit order."""

from __future__ import annotations

import pytest

from tests.conftest import KafkaBroker
from tests.integration.recovery_support import (
    Writer,
    consume_covering,
    current_xid,
    drop_slot,
    judge,
    recovery_state,
    run_recover,
    wait_for_horizon,
)
from tests.integration.relay_support import (
    RelayProcess,
    create_outbox,
    new_event,
    relay_env,
    write_transactions,
)

pytestmark = [pytest.mark.integration]


def test_a_slot_dropped_while_writers_run_is_recovered_exactly(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    create_outbox(database)
    topic = f"{unique}.order"
    broker.create_topic(topic, partitions=3)
    env = relay_env(database, broker.bootstrap_servers, unique)
    slot = f"slot_{unique}"
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        with Writer(database) as writer:
            writer.wait_for(1500)
            # The record proves most of them published: only the rest are read back.
            wait_for_horizon(database, slot, current_xid(database))
            writer.wait_for(len(writer.committed) + 500)
            # A DBA drops the slot under the running relay; it stops, refusing to go on.
            drop_slot(database, slot)
            assert relay.wait(60) == 4
            writer.wait_for(len(writer.committed) + 1500)
        logs = relay.logs()
    finally:
        relay.close()
    assert "cdc-relay recover" in logs, logs
    assert "CDC_RELAY_ON_SLOT_LOSS=recover" in logs, logs

    run = run_recover(env)
    assert run.code == 0, run.logs
    assert recovery_state(database, slot)["state"] == "done"
    after = [new_event(aggregate_id=f"a-{i}", payload={"n": -i}) for i in range(5)]
    relay = RelayProcess(env).start()
    try:
        relay.wait_streaming()
        write_transactions(database, [after])
        committed = [*writer.committed, *((e.id, e.aggregate_id) for e in after)]
        records = consume_covering(
            broker.bootstrap_servers, [topic], {e for e, _ in committed}, 120
        )
        assert relay.stop() == 0
    finally:
        relay.close()
    verdict = judge(records, committed)
    print(
        f"\n{verdict.committed} events, recovered in {run.seconds:.1f}s "
        f"(peak RSS {run.peak_rss_mb:.0f} MiB): {len(verdict.missing)} lost, "
        f"{verdict.duplicates} duplicates, {verdict.out_of_order} aggregates out of order"
    )
    assert not verdict.missing, run.logs
    assert verdict.duplicates == 0, run.logs
    assert verdict.position_duplicates == 0
    assert verdict.out_of_order == 0
    print(run.logs)
