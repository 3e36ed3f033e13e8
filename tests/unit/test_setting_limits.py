"""Settings an operator (or whoever writes the environment, ``.env`` or a mounted file) gets wrong
on purpose or by accident: ``*_FILE`` files that are not small regular files, durations too long
to wait for, ``.env`` that is not a file. Each is refused at start with exit 2 and a line naming
the setting — never a hang, a crash of a thread later on, or the file's content printed.

The process-level cases run ``python -m cdc_relay`` as an operator does: what the relay did
before these limits (read ``/dev/zero`` until ``MemoryError``, block on a FIFO, die in the
sweeper's wait) is what they assert against.
"""

from __future__ import annotations

import math
import os
import resource
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cdc_relay.config import (
    SETTING_FILE_MAX_BYTES,
    SWEEP_WAIT_BOUNDS,
    Settings,
    env_name,
    load_settings,
    setting_bounds,
)
from cdc_relay.errors import ConfigError
from tests.unit.test_config import _isolated, config_error  # noqa: F401 - _isolated: autouse

SECRET = "hunter2-in-a-file"
DB_URL = f"postgresql://relay:{SECRET}@db.example:5432/app"
REQUIRED: dict[str, Any] = {"database_url": DB_URL, "kafka_bootstrap_servers": "kafka:9092"}
FILE_SETTINGS = ("database_url_file", "kafka_producer_config_file")
DURATION_BOUNDS = {
    name: b for name, b in setting_bounds().items() if b.unit in ("seconds", "milliseconds")
}
# A database nobody listens on: a command that connects fails at once.
UNREACHABLE = "postgresql://relay@127.0.0.1:9/app?connect_timeout=2"


def file_settings(field: str, path: Path | str) -> dict[str, Any]:
    """The settings that make ``field`` the only source of what it holds."""
    if field == "database_url_file":
        return {"database_url_file": str(path), "kafka_bootstrap_servers": "kafka:9092"}
    return {**REQUIRED, field: str(path)}


def relay_command(
    env: dict[str, str], *args: str, cwd: Path, memory: int | None = None, timeout: float = 20
) -> subprocess.CompletedProcess[str]:
    """``python -m cdc_relay`` with only ``env`` among the CDC_RELAY_* variables; ``memory``:
    an address-space limit, so that a runaway read ends in MemoryError rather than the machine's
    swap."""
    base = {k: v for k, v in os.environ.items() if not k.upper().startswith("CDC_RELAY_")}

    def limit() -> None:
        if memory is not None:
            resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    return subprocess.run(
        [sys.executable, "-m", "cdc_relay", *args],
        env={**base, **env},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=limit,
        check=False,
    )


# -- *_FILE settings -----------------------------------------------------------------------------


@pytest.mark.parametrize("field", FILE_SETTINGS)
def test_a_setting_file_that_is_a_device_exits_2_at_once(field: str, tmp_path: Path) -> None:
    """/dev/zero never ends: the relay read it until MemoryError (here within a 1 GiB limit)."""
    env = {env_name(k): v for k, v in file_settings(field, "/dev/zero").items()}
    result = relay_command(env, "check", cwd=tmp_path, memory=1 << 30)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.startswith(f"cdc-relay: invalid configuration: {env_name(field)}: ")
    assert "cannot read /dev/zero: it is a character device, not a regular file" in result.stderr
    assert len(result.stderr.splitlines()) == 1


@pytest.mark.parametrize("field", FILE_SETTINGS)
def test_a_setting_file_that_is_a_fifo_exits_2_without_waiting(field: str, tmp_path: Path) -> None:
    """A FIFO nobody writes to: opening it for reading blocked the start for ever, silently."""
    fifo = tmp_path / "secret"
    os.mkfifo(fifo)
    env = {env_name(k): v for k, v in file_settings(field, fifo).items()}
    result = relay_command(env, "check", cwd=tmp_path, timeout=20)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"{env_name(field)}: cannot read {fifo}: it is a FIFO, not a regular file" in (
        result.stderr
    )


@pytest.mark.parametrize("field", FILE_SETTINGS)
def test_a_setting_file_that_is_a_directory_is_named(field: str, tmp_path: Path) -> None:
    message = config_error(**file_settings(field, tmp_path))
    assert f"{env_name(field)}: cannot read {tmp_path}: it is a directory" in message


@pytest.mark.parametrize("field", FILE_SETTINGS)
def test_a_setting_file_over_the_cap_is_refused_unread(field: str, tmp_path: Path) -> None:
    big = tmp_path / "big"
    line = f"# {SECRET}\n"
    big.write_text(line * (SETTING_FILE_MAX_BYTES // len(line) + 1), encoding="utf-8")
    assert big.stat().st_size > SETTING_FILE_MAX_BYTES
    message = config_error(**file_settings(field, big))
    assert f"{env_name(field)}: cannot read {big}: larger than 64 KiB" in message
    assert SECRET not in message


def test_a_properties_file_of_exactly_the_cap_is_read(tmp_path: Path) -> None:
    props = tmp_path / "kafka.properties"
    head = f"sasl.password={SECRET}\n"
    props.write_text(head + "#" * (SETTING_FILE_MAX_BYTES - len(head) - 1) + "\n", "utf-8")
    assert props.stat().st_size == SETTING_FILE_MAX_BYTES
    settings = load_settings(**REQUIRED, kafka_producer_config_file=str(props))
    assert settings.kafka_producer_config["sasl.password"] == SECRET


def test_a_symlink_to_a_regular_file_is_followed(tmp_path: Path) -> None:
    """Kubernetes mounts each secret as a symlink into a ``..data`` directory."""
    data = tmp_path / "..data"
    data.mkdir()
    (data / "database_url").write_text(DB_URL + "\n", encoding="utf-8")
    link = tmp_path / "database_url"
    link.symlink_to(data / "database_url")
    settings = load_settings(database_url_file=str(link), kafka_bootstrap_servers="kafka:9092")
    assert settings.database_url.get_secret_value() == DB_URL


@pytest.mark.parametrize("field", FILE_SETTINGS)
def test_a_setting_file_name_with_a_nul_is_named(field: str) -> None:
    message = config_error(**file_settings(field, "secret\x00file"))
    assert f"{env_name(field)}: cannot read " in message
    assert message.endswith(": not a valid file name")


def test_a_setting_file_that_is_not_utf8_is_named_without_content(tmp_path: Path) -> None:
    bad = tmp_path / "db_url"
    bad.write_bytes(SECRET.encode() + b"\xff\xfe")
    message = config_error(**file_settings("database_url_file", bad))
    assert "CDC_RELAY_DATABASE_URL_FILE" in message
    assert "not UTF-8 text" in message
    assert SECRET not in message


@pytest.mark.parametrize("kind", ["fifo", "directory", "device"])
def test_a_dotenv_that_is_not_a_small_regular_file_exits_2(kind: str, tmp_path: Path) -> None:
    dotenv = tmp_path / ".env"
    if kind == "fifo":
        os.mkfifo(dotenv)
    elif kind == "directory":
        dotenv.mkdir()
    else:
        dotenv.symlink_to("/dev/zero")
    result = relay_command(
        {"CDC_RELAY_DATABASE_URL": DB_URL, "CDC_RELAY_KAFKA_BOOTSTRAP_SERVERS": "kafka:9092"},
        "check",
        cwd=tmp_path,
        memory=1 << 30,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.startswith("cdc-relay: invalid configuration: .env in ")
    assert "not a regular file" in result.stderr


def test_a_dotenv_over_the_cap_is_refused(tmp_path: Path) -> None:
    (tmp_path / ".env").write_text("# x\n" * (SETTING_FILE_MAX_BYTES // 4 + 1), "utf-8")
    message = config_error(**REQUIRED)
    assert message.startswith("invalid configuration: .env in ")
    assert "larger than 64 KiB" in message


# -- durations -----------------------------------------------------------------------------------


def test_every_float_setting_is_a_bounded_duration() -> None:
    floats = {name for name, field in Settings.model_fields.items() if field.annotation is float}
    assert floats == set(DURATION_BOUNDS)
    for bounds in (*DURATION_BOUNDS.values(), SWEEP_WAIT_BOUNDS):
        assert 0 <= bounds.low < bounds.high <= threading.TIMEOUT_MAX


def test_every_numeric_setting_is_bounded() -> None:
    numbers = {
        name for name, field in Settings.model_fields.items() if field.annotation in (int, float)
    }
    assert numbers == set(setting_bounds())


def test_a_sweep_interval_of_1e300_exits_2_instead_of_killing_the_sweeper(tmp_path: Path) -> None:
    """The sweeper waited ``interval`` seconds after a failed pass: OverflowError ended it."""
    env = {
        "CDC_RELAY_DATABASE_URL": UNREACHABLE,
        "CDC_RELAY_KAFKA_BOOTSTRAP_SERVERS": "kafka:9092",
        "CDC_RELAY_SWEEP_INTERVAL": "1e300",
    }
    result = relay_command(env, "sweep", cwd=tmp_path)
    assert "OverflowError" not in result.stderr
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr == (
        "cdc-relay: invalid configuration: CDC_RELAY_SWEEP_INTERVAL: 0 (off) or between 0.01 and "
        "86400 seconds\n"
    )


@pytest.mark.parametrize("field", sorted(DURATION_BOUNDS))
def test_each_duration_refuses_1e300_and_accepts_its_bounds(field: str) -> None:
    bounds = DURATION_BOUNDS[field]
    assert env_name(field) in config_error(**REQUIRED, **{field: "1e300"})
    assert env_name(field) in config_error(**REQUIRED, **{field: str(bounds.high * 1.001)})
    high = {field: str(bounds.high)}
    if field == "leader_renew_interval":
        high["leader_lease_timeout"] = str(DURATION_BOUNDS["leader_lease_timeout"].high)
    assert getattr(load_settings(**REQUIRED, **high), field) == bounds.high
    lowest = bounds.low + 1e-9 if bounds.above_low else bounds.low
    low = {field: str(lowest)}
    if field == "leader_lease_timeout":
        low["leader_renew_interval"] = str(bounds.low / 2)
    assert getattr(load_settings(**REQUIRED, **low), field) == lowest
    if bounds.low > 0 or bounds.above_low:
        assert env_name(field) in config_error(**REQUIRED, **{field: str(bounds.low / 2)})


number_text = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.floats(allow_nan=False, allow_infinity=False).map(lambda x: f"{x:.3e}"),
    st.integers(min_value=-(10**400), max_value=10**400).map(str),
    st.sampled_from(["nan", "-nan", "inf", "Infinity", "1e309", "-0", "0x10", "1_0", " 5 ", ""]),
    st.text(max_size=12),
)


@given(field=st.sampled_from(sorted(DURATION_BOUNDS)), text=number_text)
def test_any_duration_text_is_a_bounded_value_or_a_clean_exit_2(field: str, text: str) -> None:
    """Whatever the text: a finite value within the setting's bounds (one a timer can wait for),
    or a ConfigError naming the setting — no other exception, nothing taken as "never"."""
    overrides = {field: text}
    if field == "leader_lease_timeout":
        overrides["leader_renew_interval"] = str(DURATION_BOUNDS["leader_renew_interval"].low)
    refusal: str | None = None
    try:
        settings = load_settings(**REQUIRED, **overrides)
    except ConfigError as exc:
        refusal = str(exc)
    if refusal is not None:
        assert refusal.startswith("invalid configuration: CDC_RELAY_")
        assert env_name(field) in refusal  # its own bound, or a rule between it and another
        return
    value = getattr(settings, field)
    bounds = DURATION_BOUNDS[field]
    assert math.isfinite(value)
    assert bounds.admits(value)
    assert value <= threading.TIMEOUT_MAX


def test_sweep_wait_is_bounded(tmp_path: Path) -> None:
    env = {"CDC_RELAY_DATABASE_URL": UNREACHABLE, "CDC_RELAY_KAFKA_BOOTSTRAP_SERVERS": "k:1"}
    for wait in ("nan", "inf", "1e300", "-1"):
        result = relay_command(env, "sweep", "--once", "--wait", wait, cwd=tmp_path)
        assert result.returncode == 2, (wait, result.stderr[-2000:])
        assert "argument --wait: between 0 and 86400 seconds" in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("sweep_interval", "-1", "0 (off) or between 0.01 and 86400 seconds"),
        ("heartbeat_interval", "-0.5", "0 (off) or between 0.1 and 86400 seconds"),
        ("shutdown_timeout", "-1", "between 0 and 3600 seconds"),
        ("confirm_interval", "0", "more than 0 and at most 3600 seconds"),
        ("read_coalesce_ms", "1001", "between 0 and 1000 milliseconds"),
        ("leader_lease_timeout", "3601", "between 1 and 3600 seconds"),
        ("transaction_max_events", "0", "between 1 and 1000000"),
        ("topic_partitions", "0", "at least 1"),
        ("topic_replication_factor", "0", "-1 (the broker's default) or at least 1"),
        ("http_port", "65536", "0 (off) or between 1 and 65535"),
        ("max_created_topics", "-1", "at least 0"),
    ],
)
def test_a_value_out_of_bounds_is_refused_in_our_words(
    field: str, value: str, message: str
) -> None:
    """The bound's own sentence, not pydantic's ("Input should be greater than or equal to 0")."""
    assert config_error(**REQUIRED, **{field: value}) == (
        f"invalid configuration: {env_name(field)}: {message}"
    )
