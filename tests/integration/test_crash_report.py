"""A relay that crashes in native code (a C extension, librdkafka, libpq) says where it was: every
thread's Python stack on stderr before the process dies, not a bare exit by signal."""

from __future__ import annotations

import os
import signal

import pytest

from tests.conftest import KafkaBroker
from tests.integration.relay_support import RelayProcess, create_outbox, relay_env

pytestmark = pytest.mark.integration


def test_a_segmentation_fault_prints_every_threads_stack(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    create_outbox(database)
    relay = RelayProcess(relay_env(database, broker.bootstrap_servers, unique)).start()
    try:
        relay.wait_streaming()
        assert relay.proc is not None
        os.kill(relay.proc.pid, signal.SIGSEGV)  # as the kernel sends it for a bad access
        code = relay.wait(30)
        logs = relay.logs()
    finally:
        relay.close()
    assert code == -signal.SIGSEGV, logs
    assert "Fatal Python error: Segmentation fault" in logs, logs
    # Every thread's stack: the loop's (the main thread) and the leadership thread's at least.
    assert logs.count("Thread 0x") + logs.count("Current thread 0x") >= 2, logs
    assert "cdc_relay/" in logs, logs
