"""Trace propagation through the outbox: the row's ``traceparent`` continues into Kafka.

A writing service stores its W3C trace context in the outbox row (column ``traceparent``, or
Debezium's ``tracingspancontext``). The relay starts a PRODUCER span that is a child of it, ends it
when Kafka acknowledges the record (with partition and offset), and sends the span's own context
as the record's ``traceparent`` header, so consumers continue the same trace. With tracing off
(no exporter configured) the stored ``traceparent`` is passed through unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from cdc_relay import __version__

_PROPAGATOR = TraceContextTextMapPropagator()


def otlp_traces_configured() -> bool:
    exporters = os.environ.get("OTEL_TRACES_EXPORTER", "")
    return "otlp" in exporters or bool(
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


class Tracing:
    """Publish spans, when an exporter (or, in tests, a processor) is configured."""

    def __init__(self, processor: SpanProcessor | None = None) -> None:
        if processor is None and otlp_traces_configured():
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # noqa: PLC0415
                OTLPSpanExporter,
            )

            processor = BatchSpanProcessor(OTLPSpanExporter())
        self.enabled = processor is not None
        self._provider: TracerProvider | None = None
        self._tracer: trace.Tracer | None = None
        if processor is not None:
            resource = Resource.create(
                {"service.name": "cdc-relay", "service.version": __version__}
            )
            self._provider = TracerProvider(resource=resource)
            self._provider.add_span_processor(processor)
            self._tracer = self._provider.get_tracer("cdc_relay", __version__)

    def start_publish(self, traceparent: bytes, event_id: str, topic: str) -> tuple[Span, bytes]:
        """A child span of the row's context, and the ``traceparent`` to send with the record."""
        assert self._tracer is not None
        parent = _PROPAGATOR.extract({"traceparent": traceparent.decode("ascii", "replace")})
        span = self._tracer.start_span(
            f"{topic} publish",
            context=parent,
            kind=SpanKind.PRODUCER,
            attributes={
                "messaging.system": "kafka",
                "messaging.operation.type": "publish",
                "messaging.destination.name": topic,
                "messaging.message.id": event_id,
            },
        )
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
        return span, carrier.get("traceparent", "").encode() or traceparent

    @staticmethod
    def end_publish(span: Span, err: Any, msg: Any) -> None:
        if err is None:
            span.set_attribute("messaging.kafka.destination.partition", msg.partition())
            span.set_attribute("messaging.kafka.message.offset", msg.offset())
        else:
            span.set_status(Status(StatusCode.ERROR, err.str()))
        span.end()

    @staticmethod
    def traced(  # noqa: PLR0917 - a delivery callback's shape, four of them bound by partial
        span: Span,
        callback: Callable[[str, list[tuple[str, bytes]], Any, Any], None],
        topic: str,
        headers: list[tuple[str, bytes]],
        err: Any,
        msg: Any,
    ) -> None:
        """A record's delivery callback that ends its publish span first."""
        Tracing.end_publish(span, err, msg)
        callback(topic, headers, err, msg)

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()
