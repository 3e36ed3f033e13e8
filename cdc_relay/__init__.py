"""cdc-relay: relay transactional-outbox events from PostgreSQL to Kafka by tailing the WAL."""

from cdc_relay import _hot_path

__version__ = "0.1.0"

_hot_path.install()  # before any per-event module is imported: compiled build or sources
