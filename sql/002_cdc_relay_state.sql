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
