"""Trace propagation through the outbox: the row's ``traceparent`` continues into Kafka.

A writing service stores its W3C trace context in the outbox row (column ``traceparent``, or
Debezium's ``tracingspancontext``). The relay starts a PRODUCER span that is a child of it, ends it
when Kafka acknowledges the record (with partition and offset), and sends the span's own context
as the record's ``traceparent`` header, so consumers continue the same trace. With tracing off
(no exporter configured) the stored ``traceparent`` is passed through unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from cdc_relay import __version__
from cdc_relay.observability.otel_env import otlp_traces_configured

if TYPE_CHECKING:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
    from opentelemetry.trace import Span

# OpenTelemetry's trace API, SDK and propagator: imported only when tracing is on (~0.05 s of
# start-up otherwise spent for nothing); what the span methods use, bound once.
_otel: Any = None


def _load_otel() -> Any:
    global _otel  # noqa: PLW0603 - one import for the process, on first use
    if _otel is None:
        from opentelemetry import trace  # noqa: PLC0415
        from opentelemetry.sdk.resources import Resource  # noqa: PLC0415
        from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415
        from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: PLC0415
        from opentelemetry.trace import SpanKind, Status, StatusCode  # noqa: PLC0415
        from opentelemetry.trace.propagation.tracecontext import (  # noqa: PLC0415
            TraceContextTextMapPropagator,
        )

        _otel = SimpleNamespace(
            trace=trace,
            Resource=Resource,
            TracerProvider=TracerProvider,
            BatchSpanProcessor=BatchSpanProcessor,
            SpanKind=SpanKind,
            Status=Status,
            StatusCode=StatusCode,
            propagator=TraceContextTextMapPropagator(),
        )
    return _otel


class Tracing:
    """Publish spans, when an exporter (or, in tests, a processor) is configured."""

    def __init__(self, processor: SpanProcessor | None = None) -> None:
        if processor is None and otlp_traces_configured():
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # noqa: PLC0415
                OTLPSpanExporter,
            )

            processor = _load_otel().BatchSpanProcessor(OTLPSpanExporter())
        self.enabled = processor is not None
        self._provider: TracerProvider | None = None
        self._tracer: trace.Tracer | None = None
        if processor is not None:
            otel = _load_otel()
            resource = otel.Resource.create(
                {"service.name": "cdc-relay", "service.version": __version__}
            )
            self._provider = otel.TracerProvider(resource=resource)
            self._provider.add_span_processor(processor)
            self._tracer = self._provider.get_tracer("cdc_relay", __version__)

    def start_publish(self, traceparent: bytes, event_id: str, topic: str) -> tuple[Span, bytes]:
        """A child span of the row's context, and the ``traceparent`` to send with the record."""
        assert self._tracer is not None
        otel = _otel
        parent = otel.propagator.extract({"traceparent": traceparent.decode("ascii", "replace")})
        span = self._tracer.start_span(
            f"{topic} publish",
            context=parent,
            kind=otel.SpanKind.PRODUCER,
            attributes={
                "messaging.system": "kafka",
                "messaging.operation.type": "publish",
                "messaging.destination.name": topic,
                "messaging.message.id": event_id,
            },
        )
        carrier: dict[str, str] = {}
        otel.propagator.inject(carrier, context=otel.trace.set_span_in_context(span))
        return span, carrier.get("traceparent", "").encode() or traceparent

    @staticmethod
    def end_publish(span: Span, err: Any, msg: Any) -> None:
        if err is None:
            span.set_attribute("messaging.kafka.destination.partition", msg.partition())
            span.set_attribute("messaging.kafka.message.offset", msg.offset())
        else:
            span.set_status(_otel.Status(_otel.StatusCode.ERROR, err.str()))
        span.end()

    @staticmethod
    def traced(span: Span, callback: Callable[[Any, Any, Any], None], record: Any, err: Any,
               msg: Any) -> None:  # fmt: skip
        """A record's delivery callback (its ``record`` bound: the session's BoundRecord) that
        ends its publish span first."""
        Tracing.end_publish(span, err, msg)
        callback(record, err, msg)

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()
