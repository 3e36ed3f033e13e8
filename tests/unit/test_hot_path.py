"""The optional compiled hot path: which build of the per-event modules runs.

The fast tier runs twice in CI, on the pure-Python sources and on the mypyc build
(``CDC_RELAY_EXPECT_COMPILED=1``): these tests make sure each tier tests the build it claims to,
and that neither a stale extension module nor ``CDC_RELAY_PURE_PYTHON=1`` is ignored.
"""

from __future__ import annotations

import importlib.machinery
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cdc_relay import _hot_path
from cdc_relay._hot_path import (
    HOT_PATH,
    PURE_PYTHON_VARIABLE,
    extension_of,
    source_of,
    sources_to_prefer,
)

REPO = Path(__file__).resolve().parents[2]
EXTENSION = importlib.machinery.EXTENSION_SUFFIXES[0]


def _package(tmp_path: Path, *, extension_age: float) -> Path:
    """A package with every hot-path source, and extensions ``extension_age`` s older."""
    for name in HOT_PATH:
        source = source_of(tmp_path, name)
        source.parent.mkdir(parents=True, exist_ok=True)
        source.write_text("")
        extension = source.with_suffix(EXTENSION)
        extension.write_bytes(b"")
        mtime = source.stat().st_mtime
        os.utime(extension, (mtime - extension_age, mtime - extension_age))
    return tmp_path


def test_a_source_edited_after_its_build_is_imported_instead_in_a_checkout(
    tmp_path: Path,
) -> None:
    package = _package(tmp_path, extension_age=60)
    with pytest.warns(RuntimeWarning, match="is older than"):
        chosen = sources_to_prefer(package, pure=False, checkout=True)
    assert chosen == {name: source_of(package, name) for name in HOT_PATH}
    # One edited module is enough: the compiled ones import each other past any finder.
    first = source_of(package, HOT_PATH[0])
    for name in HOT_PATH:
        os.utime(source_of(package, name).with_suffix(EXTENSION))
    os.utime(first, (first.stat().st_mtime + 120, first.stat().st_mtime + 120))
    with pytest.warns(RuntimeWarning, match=HOT_PATH[0]):
        assert set(sources_to_prefer(package, pure=False, checkout=True)) == set(HOT_PATH)


def test_a_fresh_build_is_used_and_an_installed_one_is_never_second_guessed(
    tmp_path: Path,
) -> None:
    assert sources_to_prefer(_package(tmp_path, extension_age=-60), False, checkout=True) == {}
    # Installed (no checkout): file times say nothing about which is newer.
    assert sources_to_prefer(_package(tmp_path, extension_age=60), False, checkout=False) == {}


def test_pure_python_is_chosen_for_every_compiled_module(tmp_path: Path) -> None:
    package = _package(tmp_path, extension_age=-60)
    assert set(sources_to_prefer(package, pure=True, checkout=False)) == set(HOT_PATH)
    assert sources_to_prefer(tmp_path / "nothing-built", pure=True, checkout=True) == {}


def _compiled_in_a_fresh_interpreter(**env: str) -> list[str]:
    code = "from cdc_relay._hot_path import compiled_modules; print(','.join(compiled_modules()))"
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        env={**os.environ, **env},
        timeout=60,
    )
    return [name for name in result.stdout.strip().split(",") if name]


def test_this_tier_tests_the_build_it_claims_to() -> None:
    """CDC_RELAY_EXPECT_COMPILED=1 (CI's compiled tier): every module compiled. Otherwise all
    compiled when the build is current, all from source when it is missing or stale."""
    if os.environ.get("CDC_RELAY_EXPECT_COMPILED") == "1":
        expected = list(HOT_PATH)
    elif os.environ.get(PURE_PYTHON_VARIABLE) == "1":
        expected = []
    else:
        package = Path(_hot_path.__file__).parent
        current = [
            (extension := extension_of(package, name)) is not None
            and extension.stat().st_mtime >= source_of(package, name).stat().st_mtime
            for name in HOT_PATH
        ]
        expected = list(HOT_PATH) if all(current) else []
    assert _compiled_in_a_fresh_interpreter() == expected


def test_cdc_relay_pure_python_imports_every_source() -> None:
    assert _compiled_in_a_fresh_interpreter(CDC_RELAY_PURE_PYTHON="1") == []


def _c_extension(tmp_path: Path, *, extension_age: float) -> Path:
    """A package with each C extension's source, and its build ``extension_age`` s older."""
    for name, c_source in _hot_path.C_EXTENSIONS.items():
        source = tmp_path / c_source
        source.parent.mkdir(parents=True, exist_ok=True)
        source.write_text("")
        extension = source_of(tmp_path, name).with_suffix(EXTENSION)
        extension.write_bytes(b"")
        mtime = source.stat().st_mtime
        os.utime(extension, (mtime - extension_age, mtime - extension_age))
    return tmp_path


def test_a_c_extension_is_used_when_fresh_and_blocked_when_pure_or_stale(tmp_path: Path) -> None:
    """Its Python fallback runs under CDC_RELAY_PURE_PYTHON=1, and in a checkout whose C source
    was edited after the build (with a warning); an installed build is never second-guessed."""
    names = list(_hot_path.C_EXTENSIONS)
    fresh = _c_extension(tmp_path / "fresh", extension_age=-60)
    assert _hot_path.c_extensions_to_block(fresh, pure=False, checkout=True) == []
    assert _hot_path.c_extensions_to_block(fresh, pure=True, checkout=False) == names
    stale = _c_extension(tmp_path / "stale", extension_age=60)
    assert _hot_path.c_extensions_to_block(stale, pure=False, checkout=False) == []
    with pytest.warns(RuntimeWarning, match="Python fallback runs"):
        assert _hot_path.c_extensions_to_block(stale, pure=False, checkout=True) == names
    assert _hot_path.c_extensions_to_block(tmp_path / "none", pure=True, checkout=True) == []


def test_pure_python_blocks_the_c_extensions_in_a_fresh_interpreter() -> None:
    code = (
        "import sys, cdc_relay.decode.pgoutput as p; "
        "print(p._read_row is None, sys.modules.get('cdc_relay.decode._tuple_reader') is None)"
    )
    env = {**os.environ, PURE_PYTHON_VARIABLE: "1"}
    completed = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True
    )
    assert completed.stdout.split() == ["True", "True"]
