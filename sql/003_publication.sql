-- The publication the relay streams: the outbox table, inserts only, so that deleting published
-- rows never reaches the relay. The relay creates it when missing if its user owns the table.
-- publish_via_partition_root: a partitioned outbox's rows are published as rows of the outbox
-- itself (its name, its columns), not of the partition they landed in, which the relay would not
-- relay (docs/how-to/partitioned-outbox.md); for a table that is not partitioned it changes nothing.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = 'cdc_relay_outbox') THEN
        CREATE PUBLICATION cdc_relay_outbox FOR TABLE public.outbox WITH (publish = 'insert', publish_via_partition_root = true);
    END IF;
END
$$;
