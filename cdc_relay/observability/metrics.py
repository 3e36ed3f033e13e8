"""OpenTelemetry metrics: a Prometheus scrape endpoint by default, OTLP when configured.

Instruments are *observable*: OpenTelemetry calls back into :class:`RelayStats` at collection time,
so publishing an event costs no SDK call. The latency histograms (end to end, and the database's
share of it) are aggregated by :class:`~cdc_relay.observability.stats.LatencyHistogram` and
appended to each collection as cumulative histograms (see ``_with_latency``). Names follow
OpenTelemetry's style (``cdc_relay.events.published``); Prometheus shows them as
``cdc_relay_events_published_total``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricReader,
    MetricsData,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource
from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

from cdc_relay import __version__
from cdc_relay.observability.otel_env import otlp_metrics_configured
from cdc_relay.observability.stats import LatencyHistogram, RelayStats

LATENCY_METRIC = "cdc_relay.event.latency"
RECEIVE_LATENCY_METRIC = "cdc_relay.transaction.receive_latency"
_HISTOGRAMS = (
    (
        LATENCY_METRIC,
        "End-to-end latency of an event: commit in PostgreSQL to Kafka acknowledgement",
        "latency",
    ),
    (
        RECEIVE_LATENCY_METRIC,
        "Commit in PostgreSQL to the relay reading that commit, per transaction with events: "
        "the database's share of the end-to-end latency",
        "receive_latency",
    ),
)


def _histogram_metric(
    name: str, description: str, histogram: LatencyHistogram, start_ns: int
) -> Metric:
    point = HistogramDataPoint(
        attributes={},
        start_time_unix_nano=start_ns,
        time_unix_nano=time.time_ns(),
        count=histogram.count,
        sum=histogram.sum,
        bucket_counts=list(histogram.counts),
        explicit_bounds=list(histogram.boundaries),
        min=histogram.min if histogram.count else 0.0,
        max=histogram.max if histogram.count else 0.0,
    )
    return Metric(
        name=name,
        description=description,
        unit="s",
        data=Histogram(
            data_points=[point], aggregation_temporality=AggregationTemporality.CUMULATIVE
        ),
    )


def _with_latency(data: MetricsData, stats: RelayStats, start_ns: int) -> MetricsData:
    """``data`` plus the latency histograms, in the first scope of the first resource."""
    if not data.resource_metrics or not data.resource_metrics[0].scope_metrics:
        return data
    histograms = [
        _histogram_metric(name, description, getattr(stats, attribute), start_ns)
        for name, description, attribute in _HISTOGRAMS
    ]
    resource = data.resource_metrics[0]
    scope = resource.scope_metrics[0]
    scope = replace(scope, metrics=[*scope.metrics, *histograms])
    resource = replace(resource, scope_metrics=[scope, *resource.scope_metrics[1:]])
    return MetricsData(resource_metrics=[resource, *data.resource_metrics[1:]])


class _PrometheusReader(PrometheusMetricReader):
    def __init__(self, stats: RelayStats, registry: CollectorRegistry) -> None:
        super().__init__(registry=registry)
        self._stats = stats
        self._start_ns = int(stats.started_at * 1e9)  # built late: counted since the start

    def _receive_metrics(self, metrics_data: MetricsData, *args: Any, **kwargs: Any) -> None:
        super()._receive_metrics(
            _with_latency(metrics_data, self._stats, self._start_ns), *args, **kwargs
        )


class _OtlpReader(PeriodicExportingMetricReader):
    def __init__(self, stats: RelayStats, exporter: Any) -> None:
        super().__init__(exporter)
        self._stats = stats
        self._start_ns = int(stats.started_at * 1e9)  # built late: counted since the start

    def _receive_metrics(self, metrics_data: MetricsData, *args: Any, **kwargs: Any) -> None:
        super()._receive_metrics(
            _with_latency(metrics_data, self._stats, self._start_ns), *args, **kwargs
        )


def process_registry() -> CollectorRegistry:
    """A registry of our own (several relays may share a process in tests) with process metrics."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


class RelayMetrics:
    """The MeterProvider, its readers, and the instruments over a RelayStats."""

    def __init__(self, stats: RelayStats, registry: CollectorRegistry = REGISTRY) -> None:
        self.stats = stats
        self.registry = registry
        readers: list[MetricReader] = [_PrometheusReader(stats, registry)]
        if otlp_metrics_configured():
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import (  # noqa: PLC0415
                OTLPMetricExporter,
            )

            readers.append(_OtlpReader(stats, OTLPMetricExporter()))
        resource = Resource.create({"service.name": "cdc-relay", "service.version": __version__})
        self.provider = MeterProvider(metric_readers=readers, resource=resource)
        self._instruments()

    def _instruments(self) -> None:
        meter = self.provider.get_meter("cdc_relay", __version__)
        stats = self.stats

        def single(value: float) -> Iterable[Observation]:
            return [Observation(value)]

        def counter(name: str, description: str, read: Any, unit: str = "{event}") -> None:
            meter.create_observable_counter(
                name, [lambda _o: single(read())], unit=unit, description=description
            )

        def gauge(name: str, description: str, read: Any, unit: str) -> None:
            meter.create_observable_gauge(
                name, [lambda _o: single(read())], unit=unit, description=description
            )

        def published(_options: CallbackOptions) -> Iterable[Observation]:
            return [
                Observation(count, {"messaging.destination.name": topic})
                for topic, count in list(stats.published_by_topic.items())
            ]

        meter.create_observable_counter(
            "cdc_relay.events.published",
            [published],
            unit="{event}",
            description="Events acknowledged by Kafka, by topic",
        )
        counter(
            "cdc_relay.events.dead_lettered",
            "Events sent to the dead-letter topic",
            lambda: stats.dead_lettered,
        )
        counter(
            "cdc_relay.transactions.relayed",
            "Source transactions with outbox events read to their commit",
            lambda: stats.transactions,
            "{transaction}",
        )
        counter(
            "cdc_relay.kafka_transactions.committed",
            "Kafka transactions committed (CDC_RELAY_EXACTLY_ONCE)",
            lambda: stats.kafka_transactions_committed,
            "{transaction}",
        )
        counter(
            "cdc_relay.kafka_transactions.aborted",
            "Kafka transactions aborted, their events sent again (CDC_RELAY_EXACTLY_ONCE)",
            lambda: stats.kafka_transactions_aborted,
            "{transaction}",
        )
        counter(
            "cdc_relay.reconnects",
            "Replication sessions restarted after a failure",
            lambda: stats.reconnects,
            "{reconnect}",
        )
        counter(
            "cdc_relay.producer.errors",
            "Kafka client errors and failed deliveries",
            lambda: stats.producer_errors,
            "{error}",
        )
        gauge(
            "cdc_relay.role",
            "1 while this relay leads (streams), 0 while it stands by",
            lambda: int(stats.leading),
            "{role}",
        )
        gauge(
            "cdc_relay.events.in_flight",
            "Records produced and not yet acknowledged",
            lambda: stats.in_flight,
            "{event}",
        )
        gauge(
            "cdc_relay.replication.lag",
            "Server WAL end minus the confirmed position",
            lambda: stats.lag_bytes,
            "By",
        )
        gauge(
            "cdc_relay.replication.lag_time",
            "Now minus the commit time of the newest acknowledged transaction (0 when caught up)",
            stats.lag_seconds,
            "s",
        )
        gauge(
            "cdc_relay.slot.retained_wal",
            "WAL the replication slot keeps on the server",
            lambda: stats.retained_wal_bytes or 0,
            "By",
        )
        gauge(
            "cdc_relay.slot.lost",
            "1 while this relay's last start found its slot dropped or invalidated, until it is "
            "recovered",
            lambda: int(stats.slot_lost),
            "{slot}",
        )
        gauge(
            "cdc_relay.recovery.rows_remaining",
            "Outbox rows a recovery of the lost slot still owes Kafka (0 when none runs)",
            stats.recovery_rows_remaining,
            "{row}",
        )

        counter(
            "cdc_relay.sweeper.rows_deleted",
            "Published outbox rows the sweeper deleted",
            lambda: stats.sweeper.deleted_total if stats.sweeper else 0,
            "{row}",
        )
        gauge(
            "cdc_relay.sweeper.rows_waiting",
            "Outbox rows selected for deletion, waiting for the confirmed position",
            lambda: stats.sweeper.rows_waiting if stats.sweeper else 0,
            "{row}",
        )

    def prometheus_text(self) -> bytes:
        return generate_latest(self.registry)

    def shutdown(self) -> None:
        self.provider.shutdown()
