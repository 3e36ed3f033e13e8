"""Which build of the per-event modules runs: compiled (mypyc) or the pure-Python sources.

The compiled build is optional (``setup.py``: ``CDC_RELAY_COMPILE=1``); the sources stay the
reference and the fallback, and pass the same tests. Python imports an extension module in
preference to the source beside it, so the finder installed here, when the package is imported,
imports the source instead:

- of every compiled module, when ``CDC_RELAY_PURE_PYTHON=1``;
- in a source checkout (``pyproject.toml`` beside the package), of every compiled module once one
  source is newer than its extension module: an edit is never shadowed by a stale build (it warns).

The C extensions with a pure-Python fallback (:data:`C_EXTENSIONS`, built by ``setup.py`` wherever
a compiler exists) are blocked the same way, so that their Python reference runs instead: with
``CDC_RELAY_PURE_PYTHON=1``, and in a checkout when the C source is newer than its build.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import warnings
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType

HOT_PATH = (
    "cdc_relay.decode.pgoutput",
    "cdc_relay.outbox",
    "cdc_relay.value_text",  # outbox.py's check of a text payload, its decoding of a bytea one
    "cdc_relay.session",
    "cdc_relay.watermark",
    "cdc_relay.publisher",  # the delivery callback runs once per record
)
# name -> its C source; cdc_relay.c_extension imports it (ImportError: its users' Python runs)
C_EXTENSIONS = {"cdc_relay.decode._tuple_reader": "decode/_tuple_reader.c"}
PURE_PYTHON_VARIABLE = "CDC_RELAY_PURE_PYTHON"
COMPILE_VARIABLE = "CDC_RELAY_COMPILE"  # read by setup.py at build time: not a setting
_PACKAGE = Path(__file__).parent


def source_of(package: Path, name: str) -> Path:
    return package.joinpath(*name.split(".")[1:]).with_suffix(".py")


def extension_of(package: Path, name: str) -> Path | None:
    source = source_of(package, name)
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = source.with_suffix(suffix)
        if candidate.exists():
            return candidate
    return None


def sources_to_prefer(package: Path, pure: bool, checkout: bool) -> dict[str, Path]:
    """The hot-path modules with an extension module that must be imported from source.

    All or none: the compiled modules import one another inside their shared library, past any
    finder, so one stale module makes the whole build stale.
    """
    built = {name: ext for name in HOT_PATH if (ext := extension_of(package, name)) is not None}
    sources = {name: source_of(package, name) for name in built}
    if pure or not sources:
        return sources
    stale = [
        name
        for name, extension in built.items()
        if checkout and sources[name].stat().st_mtime > extension.stat().st_mtime
    ]
    if not stale:
        return {}
    warnings.warn(
        f"the compiled hot path is older than {', '.join(stale)}: importing the sources "
        "(rebuild it, or delete the .so files)",
        RuntimeWarning,
        stacklevel=2,
    )
    return sources


class SourceFinder:
    """Finds the given modules' sources, ahead of the extension modules beside them."""

    def __init__(self, sources: dict[str, Path]) -> None:
        self.sources = sources

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        source = self.sources.get(fullname)
        return importlib.util.spec_from_file_location(fullname, source) if source else None


def c_extensions_to_block(package: Path, pure: bool, checkout: bool) -> list[str]:
    """The built C extensions whose Python fallback must run instead (pure, or a stale build)."""
    blocked = []
    for name, c_source in C_EXTENSIONS.items():
        extension = extension_of(package, name)
        if extension is None:
            continue
        source = package / c_source
        stale = checkout and source.exists() and source.stat().st_mtime > extension.stat().st_mtime
        if stale and not pure:
            warnings.warn(
                f"{extension.name} is older than {c_source}: its Python fallback runs "
                "(rebuild it: pip install -e ., or delete it)",
                RuntimeWarning,
                stacklevel=2,
            )
        if pure or stale:
            blocked.append(name)
    return blocked


def install() -> None:
    pure = os.environ.get(PURE_PYTHON_VARIABLE) == "1"
    checkout = (_PACKAGE.parent / "pyproject.toml").exists()
    sources = sources_to_prefer(_PACKAGE, pure=pure, checkout=checkout)
    if sources:
        sys.meta_path.insert(0, SourceFinder(sources))
    for name in c_extensions_to_block(_PACKAGE, pure=pure, checkout=checkout):
        sys.modules[name] = None  # type: ignore[assignment]  # the import raises ImportError


def c_extensions_loaded() -> list[str]:
    """The C extensions in use (imports the modules that import them)."""
    for name in HOT_PATH:
        importlib.import_module(name)
    return [name for name in C_EXTENSIONS if sys.modules.get(name) is not None]


def compiled_modules() -> list[str]:
    """The hot-path modules running compiled (imports them)."""
    return [
        name for name in HOT_PATH if not str(importlib.import_module(name).__file__).endswith(".py")
    ]
