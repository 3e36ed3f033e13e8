"""The README and the documentation stay true to the code: every setting documented, the README's
commands the ones CI runs, the whole tier on PostgreSQL 18 as CONTRIBUTING.md describes it, and one
documented command to start the relay."""

from __future__ import annotations

import re
from pathlib import Path

from cdc_relay.config import Settings, env_name

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
CONTRIBUTING = (REPO / "CONTRIBUTING.md").read_text()
CONFIGURATION = (REPO / "docs" / "reference" / "configuration.md").read_text()
COMMANDS = ("run", "setup", "check", "status", "sweep", "demo")


def test_every_setting_is_in_the_configuration_reference() -> None:
    missing = [
        env_name(name)
        for name in Settings.model_fields
        if f"| `{env_name(name)}` |" not in CONFIGURATION
    ]
    assert not missing


def test_ci_runs_the_readme_test_command() -> None:
    command = 'pip install -e ".[dev]" && python -m pytest -n 2\n'
    assert command in README
    assert "\npython -m pytest -n 2\n" in (REPO / ".ci" / "run").read_text()


def test_the_readme_shows_the_demo_from_a_fresh_clone() -> None:
    assert 'pip install -e ".[local]" && cdc-relay demo --events 50\n' in README


def test_the_readme_fits_on_a_few_screens() -> None:
    assert len(README.splitlines()) <= 250


def test_ci_runs_the_whole_tier_on_postgresql_18_as_contributing_describes() -> None:
    ci = (REPO / ".ci" / "run").read_text()
    majors = ci[ci.index("# ---- PostgreSQL majors") : ci.index("# ---- end of PostgreSQL majors")]
    assert "wheel_bindirs()[18]" in majors
    assert "wheel_bindirs()[18]" in CONTRIBUTING
    assert "\npython -m pytest -n 2 -m integration\n" in majors  # the whole tier, no subset
    assert "python -m pytest -n 2 -m integration\n```" in CONTRIBUTING


def test_the_docs_name_the_installed_command() -> None:
    """Users read ``cdc-relay <command>``, the command the package installs, in every document."""
    documents = {
        path.relative_to(REPO): path.read_text()
        for path in [
            REPO / "README.md",
            REPO / "CONTRIBUTING.md",
            *sorted((REPO / "docs").rglob("*.md")),
            *sorted((REPO / "bench").glob("*.md")),
        ]
    }
    other_way = re.compile(rf"python -m cdc_relay (?:{'|'.join(COMMANDS)})\b")
    assert {
        path: other_way.findall(text) for path, text in documents.items() if other_way.search(text)
    } == {}
    for page in ("README.md", "docs/getting-started.md"):
        text = documents[Path(page)]
        for command in ("setup", "check", "run", "status"):
            assert f"cdc-relay {command}" in text, (page, command)


def _anchors(markdown: str) -> set[str]:
    """The heading anchors GitHub (and MkDocs) give a page: lower case, punctuation dropped."""
    headings = re.findall(r"^#{1,6} (.+)$", markdown, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.lower()).strip().replace(" ", "-") for h in headings}


def test_the_readme_and_contributing_link_to_what_exists() -> None:
    """MkDocs checks the site's links (``mkdocs build --strict``); these two live outside it."""
    for document in (REPO / "README.md", REPO / "CONTRIBUTING.md"):
        text = document.read_text()
        links = re.findall(r"\]\(([^)\s]+)\)", text)
        for target in links:
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            file = document.parent / path if path else document
            assert file.exists(), (document.name, target)
            if anchor and file.suffix == ".md":
                assert anchor in _anchors(file.read_text()), (document.name, target)
