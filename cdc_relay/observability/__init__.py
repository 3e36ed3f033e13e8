"""Observability at the edge: counters the relay keeps, and how they leave the process.

The relay's hot path only touches :class:`~cdc_relay.observability.stats.RelayStats` (plain
integers, a bucket array). OpenTelemetry reads them when a scrape or an export asks
(``metrics``), the health server serves them (``http``), and traces follow an outbox row's
``traceparent`` into Kafka (``tracing``).
"""
