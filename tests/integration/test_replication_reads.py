"""ReplicationStream against a real walsender: how much one wake-up takes in from the socket.

libpq reads into a 16 KiB input buffer; a catch-up taken in 16 KiB at a time makes the loop wake,
select and call libpq once per ~50 outbox rows. The stream must take in more per wake-up.
"""

from __future__ import annotations

import time

import psycopg

from cdc_relay.replication.protocol import XLOG_DATA, XLOG_DATA_PAYLOAD_OFFSET
from cdc_relay.replication.stream import INPUT_BUFFER_DOUBLINGS, ReplicationStream

ROWS = 20_000  # ~6 MB of pgoutput messages with the payload below
PAYLOAD = "x" * 200
INSERT = ord("I")
INPUT_BUFFER_DOUBLINGS_CAP = 16 * 1024 * 2**INPUT_BUFFER_DOUBLINGS  # libpq's 16 KiB, doubled


def test_a_wake_up_takes_in_more_than_libpqs_first_buffer(database: str) -> None:
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("CREATE TABLE backlog (id bigint PRIMARY KEY, payload text)")
        conn.execute("CREATE PUBLICATION reads_pub FOR TABLE backlog")
        conn.execute("SELECT pg_create_logical_replication_slot('reads', 'pgoutput')")
        conn.execute(
            "INSERT INTO backlog SELECT i, %s FROM generate_series(1, %s) i", (PAYLOAD, ROWS)
        )
    stream = ReplicationStream(
        database, "reads", 0, {"proto_version": "1", "publication_names": '"reads_pub"'}
    )
    stream.open()
    per_wake: list[int] = []
    try:
        deadline = time.monotonic() + 60
        inserts = 0
        while inserts < ROWS and time.monotonic() < deadline:
            time.sleep(0.05)  # a loop busy elsewhere: the socket fills meanwhile
            if not stream.wait(1.0):
                continue
            taken = 0
            while (data := stream.read()) is not None:
                taken += len(data)
                if data[0] == XLOG_DATA and data[XLOG_DATA_PAYLOAD_OFFSET] == INSERT:
                    inserts += 1
            per_wake.append(taken)
    finally:
        stream.close()
    assert inserts == ROWS, "the backlog was not streamed within 60 s"
    # libpq's first buffer alone gives a wake-up at most 16 KiB (plus the rest of a message begun).
    assert max(per_wake) > 64 * 1024, per_wake
    assert sum(per_wake) / len(per_wake) > 32 * 1024, per_wake
    # ... and never more than the capped buffer holds, however far ahead the server sends.
    assert max(per_wake) <= INPUT_BUFFER_DOUBLINGS_CAP, per_wake
