"""Build hook for the optional compiled hot path; everything else is in pyproject.toml.

``CDC_RELAY_COMPILE=1`` compiles the per-event modules (decoder, mapping, session loop,
watermark) with mypyc, from the very sources that run as pure Python. It needs mypy and a C
compiler, so build without isolation from an environment that has mypy (the ``dev`` extra):

    CDC_RELAY_COMPILE=1 pip install --no-build-isolation .       # or: pip wheel ...

Without it (the default, and ``pip install -e .``) the package is pure Python. An editable
install is never compiled: its extension modules would sit beside the sources. (A build in
place, ``python setup.py build_ext --inplace``, is for CI; ``cdc_relay/_hot_path.py`` makes an
edited source win over an older extension module.)
"""

from __future__ import annotations

import os
import sys
from typing import Any

from setuptools import setup

HOT_PATH = [
    "cdc_relay/decode/pgoutput.py",
    "cdc_relay/outbox.py",
    "cdc_relay/session.py",
    "cdc_relay/watermark.py",
]


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
    return list(mypycify(HOT_PATH, opt_level="3", group_name="cdc_relay.hot_path"))


setup(ext_modules=compiled_modules())
