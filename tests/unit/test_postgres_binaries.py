"""Where the throw-away clusters' server binaries come from: explicit, system, then the wheel."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from cdc_relay.local import postgres_binaries
from cdc_relay.local.postgres_binaries import (
    BINDIR_ENV,
    find_bindir,
    major_version,
    service_user,
    usable_bindir,
    wheel_bindirs,
)


@pytest.fixture(autouse=True)
def _fresh_caches(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(BINDIR_ENV, raising=False)
    usable_bindir.cache_clear()
    yield
    usable_bindir.cache_clear()


def _fake_install(root: Path) -> Path:
    bindir = root / "bin"
    bindir.mkdir(parents=True)
    for name in ("initdb", "pg_ctl", "postgres"):
        (bindir / name).write_text("#!/bin/sh\n")
    return bindir


def test_the_wheel_ships_two_majors() -> None:
    """The ``local`` extra's wheel: PostgreSQL 18 and 16, each a complete server installation."""
    found = wheel_bindirs()
    assert set(found) == {16, 18}
    for major, bindir in found.items():
        assert major_version(bindir) == major
        assert (bindir / "pg_recvlogical").is_file()


def test_explicit_directory_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bindir = _fake_install(tmp_path)
    monkeypatch.setenv(BINDIR_ENV, str(bindir))
    assert find_bindir() == bindir


def test_explicit_directory_must_be_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(BINDIR_ENV, str(tmp_path))
    with pytest.raises(RuntimeError, match=BINDIR_ENV):
        find_bindir()


def test_system_installation_before_the_wheel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    system = _fake_install(tmp_path / "system")
    monkeypatch.setattr(postgres_binaries, "_system_bindirs", lambda: [tmp_path / "gone", system])
    assert find_bindir() == system


def test_the_wheel_when_the_system_has_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(postgres_binaries, "_system_bindirs", list)
    assert find_bindir() == wheel_bindirs()[18]


def test_nothing_found_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(postgres_binaries, "_system_bindirs", list)
    monkeypatch.setattr(postgres_binaries, "wheel_bindirs", dict)
    with pytest.raises(RuntimeError) as raised:
        find_bindir()
    assert "pip install -e '.[local]'" in str(raised.value)
    assert "apt-get install postgresql" in str(raised.value)


@pytest.mark.skipif(
    os.geteuid() != 0, reason="only root hands the server binaries to another account"
)
def test_root_copies_an_installation_the_service_user_cannot_reach(tmp_path: Path) -> None:
    """A wheel under a directory only root may enter (a venv in /root) is run from a copy."""
    hidden = tmp_path / "private"
    hidden.mkdir(mode=0o700)
    unreachable = _copy_wheel(hidden)
    assert not postgres_binaries._runs_as(service_user(), unreachable / "postgres")

    usable = usable_bindir(unreachable)
    assert usable != unreachable
    assert postgres_binaries._runs_as(service_user(), usable / "postgres")
    assert major_version(usable) == 18


def _copy_wheel(into: Path) -> Path:
    """A copy of the wheel's PostgreSQL 18 laid out as in site-packages; its ``bin`` directory."""
    wheel = wheel_bindirs()[18]
    package = wheel.parent.parent
    shutil.copytree(wheel.parent, into / package.name / wheel.parent.name, symlinks=True)
    shutil.copytree(package.parent / f"{package.name}.libs", into / f"{package.name}.libs")
    return into / package.name / wheel.parent.name / "bin"


def test_a_reachable_installation_is_used_in_place() -> None:
    reachable = Path(tempfile.mkdtemp(prefix="cdc-relay-test-"))
    try:
        reachable.chmod(0o755)
        bindir = _copy_wheel(reachable)
        assert usable_bindir(bindir) == bindir
        assert major_version(bindir) == 18
    finally:
        shutil.rmtree(reachable)
