"""The documented commands, run as written: the README's demo, and the getting-started page's shell
commands against a throw-away database and the test broker, with the event it writes read back
from Kafka.

Every ```` ```bash ```` block of ``docs/getting-started.md`` runs, in order, in one shell
(``set -euo pipefail``) from the repository's root; blocks in other languages (``sh``, ``sql``,
``text``) are shown, not run. Only what cannot be the reader's is replaced: the page's example
addresses by the test's database and broker (each must appear, so a page that drifts fails here),
the first block (the install, which this test runs inside of) is compared instead of run, and
``cdc-relay run`` starts in the background until it logs ``streaming``, as the page says to leave
it running in another terminal. The relay gets a free HTTP port, as workers run side by side.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote, urlencode

import orjson
import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from cdc_relay.local.lifetime import free_port
from cdc_relay.local.postgres import LocalPostgres
from tests.conftest import KafkaBroker, PostgresServer, own_services_only
from tests.integration.relay_support import scalar
from tests.integration.test_demo import assert_nothing_left, demo_env, event_lines, scratch
from tests.kafka_helpers import consume_all

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "getting-started.md"
README = REPO / "README.md"
DEMO_INSTALL = 'pip install -e ".[local]" && '
INSTALL = "python3 -m venv .venv && . .venv/bin/activate && pip install -e ."
RUN = "cdc-relay run"
ADMIN_EXAMPLE = "postgresql://postgres@localhost:5432/app"
RELAY_EXAMPLE = "postgresql://relay:change-me@localhost:5432/app"
BOOTSTRAP_EXAMPLE = "localhost:9092"
ROLE = "relay"
TOPIC = "outbox.event.order"
_BASH_BLOCK = re.compile(r"^```bash\n(.*?)^```$", re.DOTALL | re.MULTILINE)


def run_bash(script: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``script`` as a reader's shell runs it, stopping at the first failing command."""
    return subprocess.run(
        ["bash", "-c", f"set -euo pipefail\n{script}"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def bash_blocks(text: str) -> list[str]:
    return [block.strip() for block in _BASH_BLOCK.findall(text)]


def uri(params: dict[str, str]) -> str:
    """A libpq URI of ``params`` (the page exports URIs: one word in the shell)."""
    params = dict(params)
    user = quote(params.pop("user", ""), safe="")
    password = params.pop("password", None)
    auth = f"{user}:{quote(password, safe='')}@" if password else f"{user}@" if user else ""
    host = params.pop("host", "localhost")
    port = params.pop("port", "5432")
    dbname = quote(params.pop("dbname", ""), safe="")
    query = f"?{urlencode(params)}" if params else ""
    return f"postgresql://{auth}{host}:{port}/{dbname}{query}"


def page_script(blocks: list[str], replacements: dict[str, str]) -> tuple[str, str]:
    """The page's blocks up to and including writing the event (``cdc-relay run`` started in the
    background), and the block after it, which reads the relay's status."""
    assert blocks[0] == INSTALL, "the install block changed: update this test's INSTALL"
    joined = "\n".join(blocks[1:])
    for example, value in replacements.items():
        assert joined.count(example) == 1, f"{example!r} is no longer in the page's commands"
        joined = joined.replace(example, value)
    steps = joined.split("\n")
    assert steps.count(RUN) == 1, "the page no longer runs the relay as `cdc-relay run`"
    start = "\n".join(
        [
            "(",
            '    cdc-relay run >"$DOCS_RELAY_LOG" 2>&1 &',
            '    echo $! >"$DOCS_RELAY_PID"',
            '    wait $! && echo 0 >"$DOCS_RELAY_EXIT" || echo $? >"$DOCS_RELAY_EXIT"',
            ") </dev/null >/dev/null 2>&1 &",
            "for _ in $(seq 600); do",
            '    grep -q streaming "$DOCS_RELAY_LOG" 2>/dev/null && break',
            '    [ -e "$DOCS_RELAY_EXIT" ] && exit 97',
            "    sleep 0.1",
            "done",
            'grep -q streaming "$DOCS_RELAY_LOG"',
        ]
    )
    script = "\n".join(start if line == RUN else line for line in steps).rstrip()
    marker = "cdc-relay status"
    assert script.endswith(marker), "the page's last command is no longer `cdc-relay status`"
    return script[: -len(marker)], marker


@pytest.fixture
def role_free(database: str) -> Iterator[None]:
    """The page creates the server-wide role ``relay``: only where no such role exists, and
    dropped afterwards."""
    if scalar(database, "SELECT count(*) FROM pg_roles WHERE rolname = %s", ROLE):
        pytest.skip(f"the server already has a role named {ROLE}; run against one without it")
    try:
        yield
    finally:
        with psycopg.connect(database, autocommit=True) as conn:
            if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (ROLE,)).fetchone():
                conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(ROLE)))
                conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(ROLE)))


def test_the_getting_started_page_runs_as_written(
    postgres: PostgresServer,
    database: str,
    broker: KafkaBroker,
    role_free: None,
    tmp_path: Path,
) -> None:
    admin = conninfo_to_dict(database)
    relay = {**admin, "user": ROLE, "password": "change-me"}
    head, status = page_script(
        bash_blocks(PAGE.read_text()),
        {
            ADMIN_EXAMPLE: shlex.quote(uri({k: str(v) for k, v in admin.items()})),
            RELAY_EXAMPLE: shlex.quote(uri({k: str(v) for k, v in relay.items()})),
            BOOTSTRAP_EXAMPLE: shlex.quote(broker.bootstrap_servers),
        },
    )
    tools = [Path(sys.executable).parent]  # cdc-relay, installed beside this interpreter
    if isinstance(postgres, LocalPostgres):
        tools.append(postgres.bindir)  # psql of the test's server
    elif shutil.which("psql") is None:
        pytest.skip("the page runs psql: put PostgreSQL's client on PATH")
    log, pid_file, exit_file = tmp_path / "relay.log", tmp_path / "relay.pid", tmp_path / "exit"
    env_dump = tmp_path / "env"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("CDC_RELAY_")},
        "PATH": os.pathsep.join([*map(str, tools), os.environ["PATH"]]),
        "CDC_RELAY_HTTP_PORT": str(free_port()),
        "DOCS_RELAY_LOG": str(log),
        "DOCS_RELAY_PID": str(pid_file),
        "DOCS_RELAY_EXIT": str(exit_file),
    }
    try:
        result = run_bash(f"{head}\nenv -0 >{shlex.quote(str(env_dump))}", REPO, env)
        logs = log.read_text() if log.exists() else ""
        assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\nrelay:\n{logs}"
        assert "\nok   " in result.stdout, result.stdout  # check's lines
        assert "FAIL" not in result.stdout, result.stdout

        [record] = consume_all(broker.bootstrap_servers, TOPIC, 1, timeout=30)
        assert record.key == b"o-42"
        assert orjson.loads(record.value or b"") == {"amount": 12.5}
        headers = {name: record.header(name) for name in ("event_type", "aggregate_type", "source")}
        assert headers == {
            "event_type": b"order_paid",
            "aggregate_type": b"order",
            "source": b"getting-started",
        }
        assert record.header("id")

        shell_env = dict(
            item.split("=", 1) for item in env_dump.read_text().split("\0") if "=" in item
        )
        deadline = time.monotonic() + 10
        while True:  # the counter follows Kafka's acknowledgement within a confirm interval
            shown = run_bash(status, REPO, shell_env)
            if "relay.published: 1\n" in shown.stdout or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert shown.returncode == 0, shown.stdout + shown.stderr
        assert "relay.published: 1\n" in shown.stdout, shown.stdout
    finally:
        if pid_file.exists():
            _stop(int(pid_file.read_text()), exit_file, log)
        if os.environ.get("CDC_RELAY_TEST_KAFKA_BOOTSTRAP_SERVERS"):
            broker.delete_topics([TOPIC])  # an external broker keeps what a test leaves


def _stop(pid: int, exit_file: Path, log: Path) -> None:
    """SIGTERM, as a supervisor stops it: the page promises a clean stop, exit status 0."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 40
    while not exit_file.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    if not exit_file.exists():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        pytest.fail(f"the relay did not stop within 40 s of SIGTERM:\n{log.read_text()}")
    assert exit_file.read_text().strip() == "0", log.read_text()


__all__ = ["scratch"]  # the demo's fixture, shared with tests/integration/test_demo.py


@own_services_only("the demo starts a PostgreSQL cluster and a broker of its own")
def test_the_readme_demo_runs_as_written(scratch: Path) -> None:
    """The README's demo line, after its install (this test runs inside that install)."""
    [line] = [line for line in README.read_text().splitlines() if line.startswith(DEMO_INSTALL)]
    command = line.removeprefix(DEMO_INSTALL)
    env = demo_env(scratch)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])
    result = run_bash(command, scratch, env)
    output = f"--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"
    assert result.returncode == 0, output
    events = event_lines(result.stdout)
    assert [int(m["n"]) for m in events] == list(range(1, 51)), output
    assert {m["topic"] for m in events} == {TOPIC}
    assert_nothing_left(scratch)
