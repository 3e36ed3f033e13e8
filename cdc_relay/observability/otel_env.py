"""Whether OpenTelemetry's standard variables ask for an OTLP exporter (metrics, traces).

Kept apart from the modules that use the SDK, so that the relay can decide whether it needs the
SDK at all without importing it (importing it costs start-up time).
"""

from __future__ import annotations

import os


def _otlp(signal: str) -> bool:
    return "otlp" in os.environ.get(f"OTEL_{signal}_EXPORTER", "") or bool(
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or os.environ.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT")
    )


def otlp_metrics_configured() -> bool:
    return _otlp("METRICS")


def otlp_traces_configured() -> bool:
    return _otlp("TRACES")
