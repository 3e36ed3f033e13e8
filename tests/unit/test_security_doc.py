"""The threat model names the tests that guard each surface: those tests must exist.

A renamed or deleted test would otherwise leave ``docs/security.md`` citing a guard that no longer
runs. An entry cites ``tests/…/file.py::name`` and may go on with ``::other`` in the same file.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_REFERENCE = re.compile(r"(tests/[\w/]+\.py)(?:::(\w+))?|`::(\w+)`")


def _cited_tests() -> list[tuple[str, str | None]]:
    text = (ROOT / "docs" / "security.md").read_text(encoding="utf-8")
    cited: list[tuple[str, str | None]] = []
    current: str | None = None
    for match in _REFERENCE.finditer(text):
        if match.group(1):
            current = match.group(1)
            cited.append((current, match.group(2)))
        elif current is not None:
            cited.append((current, match.group(3)))
    return cited


def test_every_test_the_threat_model_names_exists() -> None:
    cited = _cited_tests()
    assert len(cited) > 50  # the parser found the references, not nothing
    missing = []
    for path, name in cited:
        file = ROOT / path
        if not file.is_file():
            missing.append(path)
            continue
        if name is not None and not re.search(
            rf"^(?:async )?def {name}\(|^{name} = ", file.read_text(encoding="utf-8"), re.MULTILINE
        ):
            missing.append(f"{path}::{name}")
    assert missing == []
