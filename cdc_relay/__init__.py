"""cdc-relay: relay transactional-outbox events from PostgreSQL to Kafka by tailing the WAL."""

__version__ = "0.1.0"
