"""Static checks of deploy/kubernetes: every manifest validates against Kubernetes' own schemas,
and what the manifests promise matches the relay and its image.

The validator is ``kubernetes-validate`` (PyPI), which ships the API's JSON schemas, so it works
offline; ``strict`` refuses fields the API does not know (a misspelt ``readinessProbe`` would
otherwise be silently ignored by the API server). It is run once on a broken manifest as well, so
a validator that passes everything cannot go unnoticed. No cluster is needed (nor used).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, cast

import pytest

from cdc_relay.config import Settings, env_name, load_settings
from tests.unit.test_packaging import DOCKERFILE, HTTP_PORT, stages

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy" / "kubernetes"
# The oldest Kubernetes minor still supported upstream when these were written, and the newest
# the validator knows.
VERSIONS = ("1.31.0", "latest")
# Custom resources (deploy/kubernetes/monitoring) have no schema in the validator: their structure
# is checked by tests/unit/test_monitoring.py.
CUSTOM_RESOURCE_API = "monitoring.coreos.com/v1"
WORKLOADS = {"Deployment", "StatefulSet"}

yaml = pytest.importorskip("yaml", reason="the manifests are YAML: pip install pyyaml")
kubernetes_validate = pytest.importorskip(
    "kubernetes_validate.utils", reason="pip install kubernetes-validate"
)


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def manifests() -> dict[Path, list[dict[str, Any]]]:
    found = {
        path: documents(path)
        for path in sorted(DEPLOY.rglob("*.yaml"))
        if path.name != "kustomization.yaml"
    }
    assert found, f"no manifests under {DEPLOY}"
    return found


def _version(version: str) -> str:
    return str(kubernetes_validate.latest_version()) if version == "latest" else version


def validate(resource: dict[str, Any], version: str) -> None:
    kubernetes_validate.validate(resource, _version(version), strict=True)


def kind(kind_name: str, directory: Path = DEPLOY) -> dict[str, Any]:
    matches = [
        doc
        for path, docs in manifests().items()
        if path.parent == directory and path.name != "secret.example.yaml"
        for doc in docs
        if doc["kind"] == kind_name
    ]
    assert len(matches) == 1, f"{kind_name} in {directory}: {len(matches)}"
    return matches[0]


def relay_container(pod_spec: dict[str, Any]) -> dict[str, Any]:
    [container] = [c for c in pod_spec["containers"] if c["name"] == "cdc-relay"]
    return cast(dict[str, Any], container)


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_validates_against_the_kubernetes_schema(version: str) -> None:
    for path, docs in manifests().items():
        for doc in docs:
            if doc["apiVersion"] == CUSTOM_RESOURCE_API:
                continue
            try:
                validate(doc, version)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{path.relative_to(REPO)} {doc['kind']}: {exc.message}")


def test_the_validator_rejects_a_broken_manifest() -> None:
    deployment = kind("Deployment")
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    container = relay_container(broken["spec"]["template"]["spec"])
    container["readynessProbe"] = container.pop("readinessProbe")  # misspelt: unknown field
    with pytest.raises(kubernetes_validate.ValidationError, match="readynessProbe"):
        validate(broken, "latest")
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(broken, "latest")


def test_kustomizations_list_every_manifest_but_the_example_secret() -> None:
    for kustomization in DEPLOY.rglob("kustomization.yaml"):
        listed = set(yaml.safe_load(kustomization.read_text())["resources"])
        here = {
            p.name
            for p in kustomization.parent.glob("*.yaml")
            if p.name not in {"kustomization.yaml", "secret.example.yaml"}
        }
        assert listed == here, kustomization
        images = yaml.safe_load(kustomization.read_text()).get("images", [])
        kinds = {doc["kind"] for name in listed for doc in documents(kustomization.parent / name)}
        expected = ["cdc-relay"] if kinds & WORKLOADS else []
        assert [image["name"] for image in images] == expected, kustomization


def test_two_relays_whose_standby_is_ready_while_alive() -> None:
    deployment = kind("Deployment")
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]
    container = relay_container(pod["spec"])
    # A standby answers /readyz 503 by design: as the readiness probe it would never be Ready,
    # and rollouts and drains would stall. Readiness is liveness here.
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["path"] == "/healthz", probe
    assert "/readyz" not in yaml.safe_dump(pod)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == HTTP_PORT
    env = {e["name"]: e["value"] for e in container.get("env", [])}
    assert env.get(env_name("http_port"), str(HTTP_PORT)) == str(HTTP_PORT)
    rollout = deployment["spec"]["strategy"]["rollingUpdate"]
    assert rollout["maxUnavailable"] == 0, "a new relay stands by before an old one stops"
    labels = pod["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    budget = kind("PodDisruptionBudget")
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert budget["spec"]["maxUnavailable"] == 1
    service = kind("Service")
    assert service["spec"]["selector"].items() <= labels.items()


def _pod_specs() -> list[dict[str, Any]]:
    return [
        kind("Deployment")["spec"]["template"]["spec"],
        kind("StatefulSet", DEPLOY / "sidecar")["spec"]["template"]["spec"],
    ]


def test_relays_run_non_root_read_only_with_the_images_user() -> None:
    [image_user] = [rest for k, rest in stages()[-1] if k == "USER"]
    uid = int(image_user.split(":")[0])
    for spec in _pod_specs():
        container = relay_container(spec)
        context = {**spec.get("securityContext", {}), **container["securityContext"]}
        assert context["runAsNonRoot"] is True
        assert context["runAsUser"] == uid, f"the image's user ({DOCKERFILE.name})"
        assert context["readOnlyRootFilesystem"] is True
        assert context["allowPrivilegeEscalation"] is False
        assert context["capabilities"]["drop"] == ["ALL"]
        assert spec["automountServiceAccountToken"] is False
        shutdown = Settings.model_fields["shutdown_timeout"].default
        assert spec["terminationGracePeriodSeconds"] > shutdown
        resources = container["resources"]
        assert resources["requests"]["memory"]
        assert resources["limits"]["memory"]
        assert resources["requests"]["cpu"]


def test_credentials_come_from_secret_files_and_settings_are_real() -> None:
    known = {env_name(name) for name in Settings.model_fields}
    config = kind("ConfigMap")
    assert set(config["data"]) <= known
    secret_keys = set(documents(DEPLOY / "secret.example.yaml")[0]["stringData"])
    for spec in _pod_specs():
        container = relay_container(spec)
        env = {e["name"]: e["value"] for e in container.get("env", [])}
        assert set(env) <= known
        assert env_name("database_url") not in env, "the URL carries a password: a file"
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        secret_mounts = {
            mounts[name]: volumes[name]["secret"]["secretName"]
            for name in mounts
            if "secret" in volumes[name]
        }
        assert list(secret_mounts.values()) == ["cdc-relay"]
        [directory] = secret_mounts
        for setting in ("database_url_file", "kafka_producer_config_file"):
            path = Path(env[env_name(setting)])
            assert str(path.parent) == directory
            assert path.name in secret_keys


def test_the_sidecar_never_takes_the_database_out_of_its_service() -> None:
    spec = kind("StatefulSet", DEPLOY / "sidecar")["spec"]["template"]["spec"]
    names = [c["name"] for c in spec["containers"]]
    assert names == ["postgres", "cdc-relay"]
    container = relay_container(spec)
    assert "readinessProbe" not in container
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"


# A commented setting is one an operator turns on by deleting "# ": a typo in it would silently
# leave the relay at its default (an unknown CDC_RELAY_* variable is only warned about).
_COMMENTED_SETTING = re.compile(r"^\s*#\s*(?:- name:\s*)?(CDC_RELAY_\w+)\b", re.MULTILINE)


def test_settings_left_commented_out_are_real_settings() -> None:
    known = {env_name(name) for name in Settings.model_fields}
    commented = {
        name
        for path in sorted(DEPLOY.rglob("*.yaml"))
        for name in _COMMENTED_SETTING.findall(path.read_text())
    }
    assert env_name("exactly_once") in commented
    assert commented <= known


def test_exactly_once_is_one_uncommented_line_away(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = DEPLOY / "configmap.yaml"
    text = path.read_text()
    line = f'  # {env_name("exactly_once")}: "true"\n'
    assert line in text
    uncommented = yaml.safe_load(text.replace(line, line.replace("# ", "", 1)))["data"]
    off = yaml.safe_load(text)["data"]
    monkeypatch.chdir(tmp_path)  # no stray .env file
    for name in list(os.environ):
        if name.startswith("CDC_RELAY_"):
            monkeypatch.delenv(name)
    required = {"database_url": "postgresql://relay@db/app"}
    for data, wanted in ((off, False), (uncommented, True)):
        with monkeypatch.context() as scoped:
            for name, value in data.items():
                scoped.setenv(name, value)
            assert load_settings(**required).exactly_once is wanted
