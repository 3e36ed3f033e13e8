"""The built C extension, loaded from its file for the tests that compare it with its reference.

Loaded even where ``CDC_RELAY_PURE_PYTHON=1`` keeps the relay from importing it (the finder of
:mod:`cdc_relay._hot_path` blocks the import, not the file). A missing build is a failure, not a
skip: every install the README gives builds it where a C compiler exists.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import cdc_relay
from cdc_relay._hot_path import extension_of

NAME = "cdc_relay.decode._tuple_reader"
PACKAGE = Path(cdc_relay.__file__).resolve().parent


def load_tuple_reader() -> ModuleType:
    path = extension_of(PACKAGE, NAME)
    assert path is not None, f"{NAME} is not built: pip install -e . (needs a C compiler)"
    spec = importlib.util.spec_from_file_location(NAME, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
