"""setuptools' build backend, plus what the compiled hot path needs in its build environment.

``CDC_RELAY_COMPILE=1`` makes ``setup.py`` compile the per-event modules with mypyc, which
type-checks them against the packages they import: the build environment needs mypy and the
project's runtime dependencies, not only setuptools. This backend asks the installer for them, so
``CDC_RELAY_COMPILE=1 pip install .`` (or ``pip wheel .``) works from a fresh environment, in
pip's isolated build environment. Without that variable it is setuptools' backend unchanged.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

from setuptools import build_meta as _setuptools
from setuptools.build_meta import (  # noqa: F401 (the hooks this backend does not change)
    build_editable,
    build_sdist,
    build_wheel,
    get_requires_for_build_editable,
    get_requires_for_build_sdist,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)

MYPY = "mypy>=1.10"  # as the dev extra
COMPILE_VARIABLE = "CDC_RELAY_COMPILE"


def compile_requirements(pyproject: Path = Path("pyproject.toml")) -> list[str]:
    """mypy and the runtime dependencies when the build compiles, else nothing. PEP 517 runs
    the hooks in the source tree, so ``pyproject.toml`` is the project's."""
    if os.environ.get(COMPILE_VARIABLE) != "1":
        return []
    project = tomllib.loads(pyproject.read_text())["project"]
    return [MYPY, *project["dependencies"]]


def get_requires_for_build_wheel(config_settings: dict[str, Any] | None = None) -> list[str]:
    extra = compile_requirements()
    # setuptools runs setup.py to find its own requirements: without compiling, as mypy is not
    # there yet.
    compiling = os.environ.pop(COMPILE_VARIABLE, None)
    try:
        own = _setuptools.get_requires_for_build_wheel(config_settings)
    finally:
        if compiling is not None:
            os.environ[COMPILE_VARIABLE] = compiling
    return [*own, *extra]
