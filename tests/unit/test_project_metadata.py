"""The project's metadata agrees with itself: addresses, version, changelog, image tags, docs.

The addresses live in ``cdc_relay/__init__.py`` (the help and the bug report print them) and in
``pyproject.toml`` (the package index shows them); the version in ``cdc_relay.__version__``, the
changelog's newest section and the Kubernetes image tags. A behaviour change in the changelog
carries an upgrade note, and the documentation names versions, not "this version".
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from cdc_relay import CHANGELOG_URL, DOCS_URL, HOMEPAGE_URL, ISSUES_URL, __version__

REPO = Path(__file__).resolve().parents[2]
CHANGELOG = (REPO / "CHANGELOG.md").read_text(encoding="utf-8")
# Keep a Changelog's kinds of change, plus our upgrade steps.
KINDS = {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}


def versions() -> dict[str, str]:
    """Each ``## [X.Y.Z] - date`` section of the changelog, by version."""
    parts = re.split(r"^## \[(\d+\.\d+\.\d+)\] - .+$", CHANGELOG, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_the_project_urls_are_the_ones_the_program_prints() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    assert pyproject["project"]["urls"] == {
        "Homepage": HOMEPAGE_URL,
        "Documentation": DOCS_URL,
        "Issues": ISSUES_URL,
        "Changelog": CHANGELOG_URL,
    }
    assert CHANGELOG_URL.endswith("/CHANGELOG.md")


def test_the_changelog_has_the_current_version_first() -> None:
    found = list(versions())
    assert found[0] == __version__
    assert found == sorted(found, key=lambda v: tuple(map(int, v.split("."))), reverse=True)
    assert f"\n[{__version__}]: {HOMEPAGE_URL}/" in CHANGELOG


def test_every_section_uses_keep_a_changelog_kinds() -> None:
    for version, body in versions().items():
        kinds = set(re.findall(r"^### (.+)$", body, re.MULTILINE)) - {
            f"Upgrading from {v}" for v in versions()
        }
        assert kinds <= KINDS, version
        assert kinds, version


def test_every_behaviour_change_has_an_upgrade_note() -> None:
    body = versions()[__version__]
    changed = body.split("\n### Changed\n", 1)[1].split("\n### ", 1)[0]
    entries = re.split(r"^- ", changed, flags=re.MULTILINE)[1:]
    assert len(entries) >= 10
    missing = [entry.split("\n", 1)[0] for entry in entries if "**Upgrade:**" not in entry]
    assert missing == []


def test_the_kubernetes_image_tags_are_the_version() -> None:
    """Every kustomization that deploys the relay's image pins it to this version (the
    monitoring one deploys no image)."""
    deploying = [
        path
        for path in sorted((REPO / "deploy" / "kubernetes").rglob("kustomization.yaml"))
        if "images:" in path.read_text(encoding="utf-8")
    ]
    assert len(deploying) >= 2
    for path in deploying:
        tags = re.findall(
            r"- name: cdc-relay\n\s+newTag: \"([^\"]+)\"", path.read_text(encoding="utf-8")
        )
        assert tags == [__version__], path


def test_the_documentation_names_versions() -> None:
    """ "This version adds three columns" is true of one release only: name it."""
    pages = [REPO / "README.md", *(REPO / "docs").rglob("*.md")]
    found = [
        f"{path.relative_to(REPO)}: {match.group(0)}"
        for path in pages
        for match in re.finditer(r"\b[Tt]his version\b.{0,40}", path.read_text(encoding="utf-8"))
    ]
    assert found == []
