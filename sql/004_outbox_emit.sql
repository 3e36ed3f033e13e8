-- Table-less outbox events, as a trusted path (CDC_RELAY_MESSAGES=true; skip this file otherwise).
--
-- outbox_emit(): an outbox event without an outbox row. It writes a transactional logical
-- decoding message (prefix 'outbox', CDC_RELAY_MESSAGE_PREFIX's default) into the WAL of the
-- calling transaction. cdc-relay publishes it exactly like an outbox row once that transaction
-- commits; a rollback discards it. Nothing is stored in any table, so nothing needs sweeping.
--
--   BEGIN;
--   UPDATE orders SET status = 'paid' WHERE id = 'o-42';
--   SELECT outbox_emit('order', 'o-42', 'order_paid', '{"amount": 12.5}');  -- returns the id
--   COMMIT;
--
-- The message content is the JSON object {"id", "aggregate_type", "aggregate_id", "event_type",
-- "payload", "headers"}; "id" (a new uuid) becomes the Kafka header id.
--
-- Who may publish: any role that can execute pg_logical_emit_message can write such a message,
-- and PostgreSQL lets PUBLIC execute it. So this file revokes that from PUBLIC (every overload),
-- and outbox_emit runs as its owner (SECURITY DEFINER, fixed search_path, this prefix only,
-- transactional only): writers get EXECUTE on outbox_emit, nothing else. Run it as a superuser,
-- then grant each writer:
--   GRANT EXECUTE ON FUNCTION outbox_emit(text, text, text, jsonb, jsonb) TO <writer>;
-- The relay refuses to start with messages on while PUBLIC may still emit them. Idempotent.
CREATE OR REPLACE FUNCTION outbox_emit(
    aggregate_type text,
    aggregate_id   text,
    event_type     text,
    payload        jsonb,
    headers        jsonb DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    event_id uuid := gen_random_uuid();
BEGIN
    -- Refused here, in the writer's transaction, rather than dead-lettered by the relay later.
    IF coalesce(aggregate_type, '') = '' OR coalesce(aggregate_id, '') = ''
            OR coalesce(event_type, '') = '' THEN
        RAISE EXCEPTION 'outbox_emit: aggregate_type, aggregate_id and event_type must be non-empty'
            USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF payload IS NULL THEN
        RAISE EXCEPTION 'outbox_emit: payload must not be NULL'
            USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF headers IS NOT NULL AND jsonb_typeof(headers) <> 'object' THEN
        RAISE EXCEPTION 'outbox_emit: headers must be a JSON object or NULL'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM pg_logical_emit_message(
        true,
        'outbox',
        json_build_object(
            'id', event_id,
            'aggregate_type', aggregate_type,
            'aggregate_id', aggregate_id,
            'event_type', event_type,
            'payload', payload,
            'headers', headers
        )::text
    );
    RETURN event_id;
END
$$;
-- A new function is executable by PUBLIC: only the writers granted above may call this one.
REVOKE EXECUTE ON FUNCTION outbox_emit(text, text, text, jsonb, jsonb) FROM PUBLIC;
-- Every overload of pg_logical_emit_message (PostgreSQL 17 added one with a flush argument).
DO $$
DECLARE
    emit regprocedure;
BEGIN
    FOR emit IN SELECT oid::regprocedure FROM pg_proc
            WHERE proname = 'pg_logical_emit_message'
            AND pronamespace = 'pg_catalog'::regnamespace LOOP
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', emit);
    END LOOP;
END
$$;
