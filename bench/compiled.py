"""The relay as the Docker image builds it, for the catch-up's programs (``--compiled``).

docker/Dockerfile builds the wheel with the per-event modules compiled by mypyc
(``CDC_RELAY_COMPILE=1``, the build backend bringing mypy and the runtime dependencies into pip's
isolated build environment, mypy and setuptools pinned by ``PIP_CONSTRAINT``). This builds the
same wheel the same way from a copy of the files the image's build stage copies, installs it
(``pip install --target``) into a throw-away directory under ``bench/.compiled/``, and checks that
every hot-path module imports compiled from there, outside any checkout. The catch-up runs it like
a ``--baseline`` checkout (the directory on ``PYTHONPATH``, the bench's interpreter and packages
for the dependencies). The build is kept, keyed by the last commit that changed the build's inputs
and, when the tree's inputs differ from it, a hash of the difference, so a rerun of the same tree
does not rebuild (~1.5 min of CPU).

    python -m bench.compiled          # build it now (the bench does it too); prints its directory
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / "bench" / ".compiled"
DOCKERFILE = REPO / "docker" / "Dockerfile"
LABEL = "cdc-relay, compiled (the Docker image's build)"
MARKER = "bench-compiled-build.json"  # in the install directory: what was built, from what
# What the Dockerfile's build stage copies into its context (tests/unit check the two agree).
INPUTS = ("pyproject.toml", "setup.py", "README.md", "build_backend", "cdc_relay")
# As .dockerignore keeps them out of the build context: caches and builds in place.
IGNORED = shutil.ignore_patterns("__pycache__", "*.py[cod]", "*.so", ".hypothesis", ".env")
_PINS = re.compile(r"printf '([^']*)' > /tmp/build-pins\.txt")


def build_pins(dockerfile: str) -> str:
    """The build stage's constraints (``/tmp/build-pins.txt``), one requirement a line."""
    match = _PINS.search(dockerfile)
    if match is None:
        raise ValueError("docker/Dockerfile writes no /tmp/build-pins.txt")
    return match.group(1).replace("\\n", "\n")


def build_inputs(dockerfile: str) -> list[str]:
    """The paths the build stage copies (``COPY a b ./``), up to its first ``FROM`` after it."""
    build_stage = dockerfile.split("\nFROM ", 2)[1]
    copies = [line.split() for line in build_stage.splitlines() if line.startswith("COPY ")]
    return [path for words in copies if not words[1].startswith("--") for path in words[1:-1]]


def cache_key(commit: str, difference: bytes) -> str:
    """The commit, and a hash of how the build's inputs differ from it (nothing: clean)."""
    if not difference:
        return commit
    return f"{commit}+{hashlib.sha256(difference).hexdigest()[:12]}"


def _git(*args: str) -> bytes:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, check=True).stdout


def tree_key() -> str:
    """:func:`cache_key` of this checkout: the last commit that changed the build's inputs (a
    commit to ``bench/`` alone builds nothing new), and the tree's changes to them (tracked and
    untracked, by content)."""
    last = _git("rev-list", "-1", "HEAD", "--", *INPUTS).decode().strip()
    commit = last[:12] or _git("rev-parse", "--short=12", "HEAD").decode().strip()
    difference = _git("diff", "HEAD", "--binary", "--", *INPUTS)
    untracked = _git("ls-files", "--others", "--exclude-standard", "-z", "--", *INPUTS)
    for name in sorted(filter(None, untracked.split(b"\0"))):
        difference += b"\0" + name + b"\0" + (REPO / name.decode()).read_bytes()
    return cache_key(commit, difference)


def _check_compiled(site: Path) -> None:
    """Every hot-path module imports compiled from ``site``, outside any checkout."""
    code = (
        "from cdc_relay._hot_path import HOT_PATH, compiled_modules\n"
        "assert compiled_modules() == list(HOT_PATH), compiled_modules()"
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("CDC_RELAY_", "OTEL_"))}
    env = {**clean, "PYTHONPATH": str(site)}
    subprocess.run([sys.executable, "-c", code], env=env, cwd="/", check=True)


def prepare(progress: bool = True) -> Path:
    """The install directory of the compiled build of this tree, built unless it is cached."""
    key = tree_key()
    site = CACHE / key
    if (site / MARKER).is_file():
        return site
    dockerfile = DOCKERFILE.read_text()
    pins, inputs = build_pins(dockerfile), build_inputs(dockerfile)
    if sorted(inputs) != sorted(INPUTS):
        raise RuntimeError(f"docker/Dockerfile's build stage copies {inputs}, not {INPUTS}")
    if progress:
        print(f"building the compiled relay as docker/Dockerfile does ({key}) ...", file=sys.stderr)
    started = time.perf_counter()
    shutil.rmtree(CACHE, ignore_errors=True)  # older builds: one at a time is enough
    with tempfile.TemporaryDirectory(prefix="cdc-relay-compiled-") as scratch:
        source, wheels = Path(scratch) / "src", Path(scratch) / "wheels"
        source.mkdir()
        for name in INPUTS:
            path = REPO / name
            if path.is_dir():
                shutil.copytree(path, source / name, ignore=IGNORED)
            else:
                shutil.copy2(path, source / name)
        constraints = Path(scratch) / "build-pins.txt"
        constraints.write_text(pins)
        env = {**os.environ, "CDC_RELAY_COMPILE": "1", "PIP_CONSTRAINT": str(constraints)}
        pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
        # The project's wheel only (--no-deps): the relay runs on the bench's packages.
        subprocess.run(
            [*pip, "wheel", "--no-cache-dir", "--no-deps", "--wheel-dir", str(wheels), str(source)],
            env=env,
            check=True,
        )
        (wheel,) = wheels.glob("cdc_relay-*.whl")
        building = site.with_name(f"{key}.partial")
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [*pip, "install", "--no-deps", "--no-index", "--target", str(building), str(wheel)],
            check=True,
        )
    _check_compiled(building)
    record = {"key": key, "build_pins": pins, "build_seconds": round(time.perf_counter() - started)}
    (building / MARKER).write_text(json.dumps(record, indent=2) + "\n")
    building.rename(site)
    return site


def main() -> None:
    print(prepare())


if __name__ == "__main__":
    main()
