-- The relay's own record of the position it confirmed to its replication slot, one row per slot.
-- The relay creates this itself when it may; run this file as an owner when it may not.
-- It lets the relay refuse to start when the slot was dropped, recreated or advanced behind its
-- back (which would silently skip events). Idempotent.
CREATE SCHEMA IF NOT EXISTS cdc_relay;
CREATE TABLE IF NOT EXISTS cdc_relay.slot_position (
    slot_name     text        PRIMARY KEY,
    confirmed_lsn pg_lsn      NOT NULL,
    updated_at    timestamptz NOT NULL DEFAULT now()
);
-- The first transaction id whose outbox rows the slot is sure to stream: set when the slot is
-- created. The sweeper never deletes rows of older transactions (they may predate the slot).
ALTER TABLE cdc_relay.slot_position ADD COLUMN IF NOT EXISTS sweep_from_xid xid8;
-- Per topic-partition, the offset of the last record Kafka acknowledged at or below confirmed_lsn
-- (a JSON object: topic -> partition -> offset): where a start reads Kafka back from to find the events an
-- earlier run already delivered after that position, so that they are not published twice.
ALTER TABLE cdc_relay.slot_position ADD COLUMN IF NOT EXISTS acked_offsets jsonb;
-- Per partition the relay had no acknowledged record in at confirmed_lsn, an offset at or below
-- its end taken before the relay first wrote there: where a start reads it back from.
ALTER TABLE cdc_relay.slot_position ADD COLUMN IF NOT EXISTS written_from jsonb;
-- The server each write of the record was made on (pg_control_system()'s system identifier, the
-- timeline): the relay refuses a record another cluster or another branch of the WAL wrote (e.g.
-- restored from a backup), and one ahead of the WAL, rather than stream or sweep from it.
ALTER TABLE cdc_relay.slot_position ADD COLUMN IF NOT EXISTS system_identifier text;
ALTER TABLE cdc_relay.slot_position ADD COLUMN IF NOT EXISTS timeline_id integer;
-- The row filters the relay relays with (a JSON object: table -> condition, null for none), set
-- at its start: the sweeper deletes only rows of these filters, and refuses to sweep with others.
ALTER TABLE cdc_relay.slot_position ADD COLUMN IF NOT EXISTS row_filters jsonb;
-- What the relay verified its publication and outbox tables to be at its start (the identities
-- of their catalog rows): every write of confirmed_lsn requires them unchanged, so no position
-- is recorded past WAL decoded under another publication; the sweeper deletes nothing while
-- they differ. And the oldest transaction running at the last write that found them so: after a
-- change, rows of transactions from it on may never have been streamed; the next start names
-- them and takes sweep_from_xid afresh.
ALTER TABLE cdc_relay.slot_position ADD COLUMN IF NOT EXISTS publication_stamp jsonb;
ALTER TABLE cdc_relay.slot_position ADD COLUMN IF NOT EXISTS stamp_checked_xid xid8;
-- What the sweeper learnt of the rows older than sweep_from_xid, per outbox table or partition (a
-- JSON object: oid -> the boundary it is of, its effective boundary, and the transaction id from
-- which one of those rows could look younger, or none): 32-bit row ids come round every 2^32
-- transactions, and this lets a sweeper started later still tell them apart (see sweeper.py).
ALTER TABLE cdc_relay.slot_position ADD COLUMN IF NOT EXISTS sweep_horizons jsonb;
-- What the relay has provably published (a JSON object: the sweep boundary, a snapshot whose
-- outbox rows Kafka acknowledged, and the offsets after which the records of any later row lie),
-- written with the position: `cdc-relay recover` re-publishes only rows it does not prove.
ALTER TABLE cdc_relay.slot_position ADD COLUMN IF NOT EXISTS recovery_horizon jsonb;
-- A recovery of a lost slot, while it runs and after (a JSON object: its new slot, its snapshot,
-- what it has published so far): an interrupted recovery is resumed from it, without duplicates.
ALTER TABLE cdc_relay.slot_position ADD COLUMN IF NOT EXISTS recovery jsonb;
-- Which relay leads for this slot (issue 12): the leader holds a session-level advisory lock on a
-- connection of its own and renews this lease every few seconds; a standby takes over when the
-- lock is free, or when the lease has expired (a hung leader), ending the stale holder's backends.
-- The relay's position record is written only while its lease row names it (see checkpoint.py).
CREATE TABLE IF NOT EXISTS cdc_relay.leader_lease (
    slot_name  text        PRIMARY KEY,
    holder     text        NOT NULL,
    lock_pid   integer     NOT NULL,
    stream_pid integer,
    renewed_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz NOT NULL
);
