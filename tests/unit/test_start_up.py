"""Start-up time: what the start path imports, and the launch figure the relay reports.

The relay sends START_REPLICATION before it loads what only streaming needs, and never loads what
its configuration does not use (the other plugin's decoder, the OpenTelemetry SDK and exporters,
the Prometheus client before the first scrape). Each import pinned here cost start-up time once;
these tests keep a later change from bringing one back unnoticed.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
import time

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from cdc_relay.observability import launch
from cdc_relay.observability.stats import RelayStats
from cdc_relay.relay import _Metrics
from cdc_relay.start import Keepalive

# Loaded by nothing a pgoutput relay does before START_REPLICATION (without OTEL_* variables).
NOT_BEFORE_START_REPLICATION = (
    "cdc_relay.decode.wal2json",
    "cdc_relay.decode.pgoutput",
    "cdc_relay.session",
    "cdc_relay.outbox",
    "cdc_relay.topics",
    "cdc_relay.observability.metrics",
    "opentelemetry",
    "prometheus_client",
    "http.server",
)


def _modules_after(code: str, **env: str) -> set[str]:
    """The modules a fresh interpreter has loaded after running ``code``."""
    script = (
        textwrap.dedent(code) + "\nimport sys\nprint(__import__('json').dumps(list(sys.modules)))"
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("CDC_RELAY_", "OTEL_"))}
    result = subprocess.run(
        [sys.executable, "-c", script],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return set(orjson.loads(result.stdout.strip().splitlines()[-1]))


def _loaded(modules: set[str], names: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == n or m.startswith(n + ".") for n in names))


RELAY_START = """
from cdc_relay.cli import build_parser, settings_from_args
from cdc_relay.decode import plugin_options_for
from cdc_relay.config import check_producer_config
from cdc_relay.relay import Relay, _Metrics

settings = settings_from_args(build_parser().parse_args(["run"]))
check_producer_config(settings.producer_config())  # what cli.run does first
relay = Relay(settings)
_Metrics(relay.stats, None)  # what Relay.run builds before the HTTP server starts
plugin_options_for(settings)  # the START_REPLICATION options
"""

SETTINGS = {
    "CDC_RELAY_DATABASE_URL": "postgresql://relay@127.0.0.1:1/app",
    "CDC_RELAY_KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1",
}


def test_the_start_path_of_a_pgoutput_relay_loads_nothing_it_does_not_need_yet() -> None:
    modules = _modules_after(RELAY_START, **SETTINGS)
    assert "cdc_relay.relay" in modules  # the probe ran what it says
    assert _loaded(modules, NOT_BEFORE_START_REPLICATION) == []


def test_a_streaming_pgoutput_relay_never_loads_wal2json_nor_the_sdk() -> None:
    code = (
        RELAY_START
        + """
from cdc_relay.decode import decoder_for
from cdc_relay.session import Session  # everything a session loads
decoder_for(settings)
"""
    )
    modules = _modules_after(code, **SETTINGS)
    assert "cdc_relay.decode.pgoutput" in modules
    assert _loaded(modules, ("cdc_relay.decode.wal2json", "opentelemetry")) == []


def test_wal2json_loads_its_own_decoder_and_not_pgoutputs() -> None:
    code = (
        RELAY_START
        + """
from cdc_relay.decode import decoder_for
decoder_for(settings)
"""
    )
    modules = _modules_after(code, **SETTINGS, CDC_RELAY_PLUGIN="wal2json")
    assert "cdc_relay.decode.wal2json" in modules
    assert "cdc_relay.decode.pgoutput" not in modules


def test_help_loads_neither_the_relay_nor_kafka_nor_opentelemetry() -> None:
    code = """
import contextlib, io
from cdc_relay.cli import main
with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
    main(["--help"])
"""
    modules = _modules_after(code)
    assert "cdc_relay.cli" in modules
    assert _loaded(modules, ("cdc_relay.relay", "confluent_kafka", "opentelemetry")) == []


def test_tracing_configured_loads_the_sdk() -> None:
    code = """
from cdc_relay.observability.tracing import Tracing
Tracing()
"""
    modules = _modules_after(code, OTEL_TRACES_EXPORTER="otlp")
    assert "opentelemetry.sdk.trace" in modules


def test_metrics_are_built_at_the_first_scrape_and_count_from_the_start() -> None:
    stats = RelayStats()
    stats.published_by_topic["orders"] = 7
    metrics = _Metrics(stats, CollectorRegistry())
    assert metrics._metrics is None
    text = metrics.prometheus_text().decode()
    published = [
        line
        for line in text.splitlines()
        if line.startswith("cdc_relay_events_published_total{")
        and 'messaging_destination_name="orders"' in line
    ]
    assert len(published) == 1
    assert published[0].endswith(" 7.0")
    assert metrics.prometheus_text().decode() == text  # built once
    metrics.shutdown()


def test_the_metrics_stack_built_at_the_first_scrape_is_never_walked_by_the_collector() -> None:
    """~13,000 objects (the SDK, the Prometheus client) that live as long as the process: left
    young, the next collection of the young generation walked them all, a 15-35 ms pause of the
    relay's loop at 5,000 events/s. Frozen once built, the collector walks only what follows."""
    script = textwrap.dedent(
        """
        import gc, json
        from prometheus_client import CollectorRegistry
        from cdc_relay.observability.stats import RelayStats
        from cdc_relay.relay import _Metrics
        gc.freeze()  # what start-up froze (cli)
        metrics = _Metrics(RelayStats(), CollectorRegistry())
        young = len(gc.get_objects())
        text = metrics.prometheus_text()
        print(json.dumps({
            "young_before": young,
            "young_after": len(gc.get_objects()),
            "scraped": b"cdc_relay_event_latency_seconds_bucket" in text,
            "metrics_walked": any(o is metrics._metrics for o in gc.get_objects()),
        }))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    found = orjson.loads(result.stdout.strip().splitlines()[-1])
    assert found["scraped"]
    assert not found["metrics_walked"]
    assert found["young_after"] - found["young_before"] < 1000, found


# -- the launch figure -------------------------------------------------------------------------

COMMANDS = st.text(st.characters(exclude_categories=["Cs"]), max_size=20)


@given(
    command=COMMANDS,
    started=st.integers(0, 10**12),
    after=st.integers(0, 10**6),
    hz=st.sampled_from([100, 250, 1000]),
)
def test_the_start_time_is_read_whatever_the_command_name(
    command: str, started: int, after: int, hz: int
) -> None:
    # Field 2 is the command name in parentheses; it may contain ") " itself.
    fields = ["S", *map(str, range(4, 22)), str(started), "1000", "2000"]
    stat = f"4242 ({command}) " + " ".join(fields)
    boottime = (started + after) / hz
    age = launch.process_age(stat, boottime, hz)
    assert age is not None
    # Two float roundings of numbers the size of boottime (up to 1e10 s here: ulp ~2e-6).
    assert abs(age - after / hz) <= 1e-9 + 4 * math.ulp(boottime)


@given(st.text(max_size=60))
def test_a_line_that_is_no_stat_line_gives_no_age(text: str) -> None:
    age = launch.process_age(text, 1000.0, 100)
    assert age is None or age >= 0


def test_the_age_counts_from_the_launch_not_from_the_first_import() -> None:
    code = """
import time
time.sleep(0.3)
from cdc_relay import relay as relay_module
from cdc_relay.observability import launch
instant = launch.now()
print(instant.since_launch, instant.monotonic, time.monotonic())
"""
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    since_launch, monotonic, later = map(float, result.stdout.split())
    assert 0.29 <= since_launch < 30  # the kernel's tick is 10 ms
    assert started < monotonic <= later  # one clock for every process of the machine
    assert monotonic - started >= 0.3


class _Stream:
    def __init__(self) -> None:
        self.sent: list[tuple[int, int]] = []

    def send_status(self, written: int, flushed: int, reply: bool = False) -> None:
        self.sent.append((written, flushed))


def test_while_the_read_back_runs_the_walsender_hears_the_start_position_every_second(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    stream = _Stream()
    keepalive = Keepalive(stream, 0x1234)  # type: ignore[arg-type]
    for _ in range(10):  # served every 50 ms for half a second: nothing yet
        clock[0] += 0.05
        keepalive()
    assert stream.sent == []
    clock[0] += 0.6
    keepalive()
    keepalive()
    assert stream.sent == [(0x1234, 0x1234)]  # the recorded start: confirms nothing new
    clock[0] += 1.0
    keepalive()
    assert stream.sent == [(0x1234, 0x1234)] * 2
