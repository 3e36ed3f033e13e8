"""Build hook for the optional compiled hot path; everything else is in pyproject.toml.

``CDC_RELAY_COMPILE=1`` compiles the per-event modules (decoder, mappings, session loop,
watermark, delivery callbacks) with mypyc, from the very sources that run as pure Python. It
needs a C compiler, and mypy and the runtime dependencies in the build environment, which the
build backend (``build_backend/cdc_relay_build.py``) asks pip for:

    CDC_RELAY_COMPILE=1 pip install .       # or: pip wheel .

Without it (the default, and ``pip install -e .``) the package is Python, but for one small C
extension built wherever a compiler exists, editable installs included (``optional``: without a
compiler the build goes on without it): ``cdc_relay/decode/_tuple_reader.c``, the decoder's tuple
reader, whose reference and fallback is the pure one in ``pgoutput.py``. An editable
install is never compiled: its extension modules would sit beside the sources. (A build in
place, ``python setup.py build_ext --inplace``, runs a checkout's tests on the compiled build;
``cdc_relay/_hot_path.py`` makes an edited source win over an older extension module.)
"""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path
from typing import Any

from setuptools import Extension, setup

TUPLE_READER = Extension(
    "cdc_relay.decode._tuple_reader",
    ["cdc_relay/decode/_tuple_reader.c"],
    optional=True,  # no compiler: the pure reader runs
    extra_compile_args=["-O2"],
)


def hot_path_sources() -> list[str]:
    """The compiled modules' sources. ``cdc_relay/_hot_path.py`` owns the list (it also decides,
    at import, whether their build or the sources run); it is read, not imported: importing the
    package needs its dependencies, which a build environment may lack."""
    tree = ast.parse(Path(__file__).parent.joinpath("cdc_relay", "_hot_path.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "HOT_PATH" for target in node.targets
        ):
            return [f"{name.replace('.', '/')}.py" for name in ast.literal_eval(node.value)]
    raise SystemExit("cdc_relay/_hot_path.py has no HOT_PATH")


def compiled_modules() -> list[Any]:
    if os.environ.get("CDC_RELAY_COMPILE") != "1":
        return []
    if "editable_wheel" in sys.argv or "develop" in sys.argv:
        raise SystemExit(
            "CDC_RELAY_COMPILE=1 is for a regular install or a wheel, not an editable one"
        )
    from mypyc.build import mypycify  # noqa: PLC0415 (only a compiling build needs mypy)

    # The runtime library they share inside the package (cdc_relay/hot_path__mypyc...), not at
    # the top level, where a relay started from an editable checkout would not find it.
    return list(mypycify(hot_path_sources(), opt_level="3", group_name="cdc_relay.hot_path"))


setup(ext_modules=[TUPLE_READER, *compiled_modules()])
