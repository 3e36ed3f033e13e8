-- The transactional outbox. Services insert one row per event in the same transaction as their
-- business change; cdc-relay streams the inserts from the WAL and publishes them to Kafka.
-- Idempotent: safe to run more than once.
CREATE TABLE IF NOT EXISTS public.outbox (
    id             uuid        PRIMARY KEY,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    event_type     text        NOT NULL,
    payload        jsonb       NOT NULL,
    headers        jsonb       NULL,
    created_at     timestamptz NOT NULL DEFAULT now()
);
