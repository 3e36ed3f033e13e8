"""The build backend (``build_backend/cdc_relay_build.py``): a compiled build asks for mypy and
the runtime dependencies, so ``CDC_RELAY_COMPILE=1 pip install .`` works from a fresh environment
(CI runs that install itself, ``.ci/run``); any other build asks for what setuptools asks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPENDENCIES = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]

# The hook as pip's isolated build environment calls it: in the source tree, before mypy is
# there (importing mypyc fails).
HOOK = """
import json, sys
sys.modules["mypyc"] = sys.modules["mypyc.build"] = None
import cdc_relay_build
print(json.dumps(cdc_relay_build.get_requires_for_build_wheel()))
"""


def _requires(compile_variable: str | None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "CDC_RELAY_COMPILE"}
    if compile_variable is not None:
        env["CDC_RELAY_COMPILE"] = compile_variable
    env["PYTHONPATH"] = str(REPO / "build_backend")
    completed = subprocess.run(
        [sys.executable, "-c", HOOK], cwd=REPO, env=env, capture_output=True, text=True,
        check=False,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    requires: list[str] = json.loads(completed.stdout.splitlines()[-1])  # after setup.py's output
    return requires


def test_a_compiled_build_asks_for_mypy_and_the_runtime_dependencies() -> None:
    requires = _requires("1")
    assert any(r.startswith("mypy>=") for r in requires)
    assert set(DEPENDENCIES) <= set(requires)


@pytest.mark.parametrize("value", [None, "0", ""])
def test_any_other_build_asks_for_no_more_than_setuptools(value: str | None) -> None:
    requires = _requires(value)
    assert not any(r.startswith("mypy") for r in requires)
    assert not set(DEPENDENCIES) & set(requires)
