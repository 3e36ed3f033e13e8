-- The relay's own role, with the least it needs. Run as a superuser, after 001-003 (they create
-- the outbox table, the state table and the publication, owned by whoever ran them), then give
-- the role a password: \password relay. Idempotent.
--
-- REPLICATION is the one strong privilege here: it lets the role create logical replication
-- slots and stream the WAL of *every* table of the database (not only the outbox) through any
-- slot or publication it can create or use, and a slot it creates keeps WAL on the server until
-- it is dropped. Treat the role's credentials like those of an owner of the data.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'relay') THEN
        CREATE ROLE relay;
    END IF;
END
$$;
ALTER ROLE relay WITH LOGIN REPLICATION NOSUPERUSER NOCREATEDB NOCREATEROLE NOBYPASSRLS;

-- The outbox: SELECT (the relay checks it at start; the sweeper finds published rows) and DELETE
-- (the sweeper removes them; leave DELETE out with CDC_RELAY_SWEEP_INTERVAL=0).
GRANT USAGE ON SCHEMA public TO relay;
GRANT SELECT, DELETE ON public.outbox TO relay;

-- The relay's record of its confirmed position (sql/002_cdc_relay_state.sql).
GRANT USAGE ON SCHEMA cdc_relay TO relay;
GRANT SELECT, INSERT, UPDATE ON cdc_relay.slot_position TO relay;
-- Which relay leads (several relays may run; one streams): the lease row, renewed by the leader.
-- Taking over from a hung leader ends its backends with pg_terminate_backend, which a role may do
-- to backends of the same role without any grant: run every relay of a slot as this one role.
GRANT SELECT, INSERT, UPDATE ON cdc_relay.leader_lease TO relay;

-- Heartbeats (CDC_RELAY_HEARTBEAT_INTERVAL) are non-transactional logical messages with a prefix
-- of their own, never relayed. PUBLIC may emit them unless table-less messages are on
-- (sql/004_outbox_emit.sql revokes that); the relay's role keeps the right either way. Only the
-- overload with text content, which the heartbeats call: pg_logical_emit_message(boolean, text,
-- text) up to PostgreSQL 16, (boolean, text, text, boolean) from 17 on (a flush argument), so its
-- signature is read from the catalog.
DO $$
DECLARE
    emit regprocedure;
BEGIN
    FOR emit IN SELECT oid::regprocedure FROM pg_proc
            WHERE proname = 'pg_logical_emit_message'
            AND pronamespace = 'pg_catalog'::regnamespace
            AND proargtypes[2] = 'text'::regtype LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO relay', emit);
    END LOOP;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'pg_catalog.pg_logical_emit_message with text content not found';
    END IF;
END
$$;

-- Not granted, because not needed: CREATE on the database or any schema (no DDL at start when
-- the objects above exist), ownership of the outbox (only to create the publication, which
-- sql/003_publication.sql does as the owner). CONNECT on the database comes from PUBLIC; if you
-- revoked that: GRANT CONNECT ON DATABASE <your database> TO relay.
