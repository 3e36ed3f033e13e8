"""``docs/reference/metrics.md`` documents every metric the relay exports, as the code exports it.

The metrics are read from a real :class:`~cdc_relay.observability.metrics.RelayMetrics`: its
instruments through an in-memory OpenTelemetry reader (name, kind, unit, description, attribute
keys), the histograms it appends, and what ``/metrics`` serves (Prometheus names and types). Each
must have a section on the page with the same facts, and the page no section for a metric that
does not exist.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import Gauge, InMemoryMetricReader, Sum
from prometheus_client import CollectorRegistry

from cdc_relay.observability import metrics
from cdc_relay.observability.stats import RelayStats

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "metrics.md"
SECTION = re.compile(
    r"^### `(?P<name>[a-z_.]+)`\n\n(?P<description>.+)\n\n"
    r"\| Prometheus \| type \| unit \| attributes \|\n\|---\|---\|---\|---\|\n"
    r"\| `(?P<prometheus>\w+)` \| (?P<kind>\w+) \| `(?P<unit>[^`]+)` \| (?P<attributes>.+) \|\n\n"
    r"- \*\*Answers:\*\* (?P<answers>.+(?:\n  .+)*)\n"
    r"- \*\*Alert when:\*\* (?P<alert>.+(?:\n  .+)*)\n",
    re.MULTILINE,
)


@dataclass(frozen=True)
class Exported:
    name: str
    kind: str  # counter, gauge, histogram
    unit: str
    description: str
    attributes: frozenset[str]


def exported(monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, Exported], str]:
    """What a relay exports: its instruments by name, and its ``/metrics`` text."""
    memory = InMemoryMetricReader()

    class Recording(MeterProvider):
        def __init__(self, metric_readers: list[Any], resource: Any) -> None:
            super().__init__(metric_readers=[*metric_readers, memory], resource=resource)

    monkeypatch.setattr(metrics, "MeterProvider", Recording)
    stats = RelayStats()
    stats.published_by_topic["orders"] = 1  # a topic: the published counter's attribute shows
    relay_metrics = metrics.RelayMetrics(stats, CollectorRegistry())
    found: dict[str, Exported] = {}
    data = memory.get_metrics_data()
    assert data is not None
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                kind = "counter" if isinstance(metric.data, Sum) else "gauge"
                assert isinstance(metric.data, Sum | Gauge)
                keys = frozenset(k for p in metric.data.data_points for k in p.attributes or {})
                found[metric.name] = Exported(
                    metric.name, kind, metric.unit or "", metric.description or "", keys
                )
    for name, description, _ in metrics._HISTOGRAMS:  # appended to each collection as is
        found[name] = Exported(name, "histogram", "s", description, frozenset())
    text = relay_metrics.prometheus_text().decode()
    relay_metrics.shutdown()
    return found, text


def sections() -> dict[str, dict[str, str]]:
    text = PAGE.read_text(encoding="utf-8")
    found = {match["name"]: match.groupdict() for match in SECTION.finditer(text)}
    assert len(found) == text.count("\n### "), "a section is not in the page's format"
    return found


def test_every_metric_is_on_the_page_and_only_those(monkeypatch: pytest.MonkeyPatch) -> None:
    instruments, _ = exported(monkeypatch)
    assert len(instruments) >= 16
    assert sorted(sections()) == sorted(instruments)
    assert {"cdc_relay.sweeper.rows_deleted", "cdc_relay.sweeper.rows_waiting"} <= set(sections())


def test_each_section_says_what_the_code_exports(monkeypatch: pytest.MonkeyPatch) -> None:
    instruments, prometheus = exported(monkeypatch)
    families = dict(re.findall(r"^# TYPE (\w+) (\w+)$", prometheus, re.MULTILINE))
    helps = dict(re.findall(r"^# HELP (\w+) (.+)$", prometheus, re.MULTILINE))
    for name, section in sections().items():
        instrument = instruments[name]
        assert section["description"] == instrument.description, name
        assert section["kind"] == instrument.kind, name
        assert section["unit"] == instrument.unit, name
        assert families.get(section["prometheus"]) == instrument.kind, name
        assert helps[section["prometheus"]] == instrument.description, name
        attributes = set(re.findall(r"`([a-z_.]+)` \(label `([a-z_]+)`\)", section["attributes"]))
        assert {key for key, _ in attributes} == set(instrument.attributes), name
        assert all(label == key.replace(".", "_") for key, label in attributes), name
        if not instrument.attributes:
            assert section["attributes"] == "none", name
        for label in (label for _, label in attributes):
            assert re.search(rf"^{section['prometheus']}\{{[^}}]*{label}=", prometheus, re.M)
        assert section["answers"].strip()
        assert section["alert"].strip()
