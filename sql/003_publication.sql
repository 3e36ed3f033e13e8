-- The publication the relay streams: the outbox table, inserts only, so that deleting published
-- rows never reaches the relay. The relay creates it when missing if its user owns the table.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = 'cdc_relay_outbox') THEN
        CREATE PUBLICATION cdc_relay_outbox FOR TABLE public.outbox WITH (publish = 'insert');
    END IF;
END
$$;
