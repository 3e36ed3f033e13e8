"""The reference pages say what the code holds: configuration, CLI, exit codes.

The three pages are generated (``python -m cdc_relay.reference_pages``) and committed; a change to
a setting, a command, a flag or an exit code without the page rewritten fails here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Annotated

import pytest
from pydantic import Field

from cdc_relay import errors, settings_reference
from cdc_relay.bounds import seconds
from cdc_relay.cli_parser import build_parser, own_flags
from cdc_relay.commands.catalog import COMMANDS, Command
from cdc_relay.config import REQUIRED_BY, SETTING_PARTS, Part, Settings, env_name, setting_bounds
from cdc_relay.errors import RelayError
from cdc_relay.exit_codes import EXIT_CODES, ExitCode
from cdc_relay.reference_pages import PAGES, REFERENCE, main, stale
from cdc_relay.settings_reference import rows

REPO = Path(__file__).resolve().parents[2]


def page(name: str) -> str:
    return (REPO / REFERENCE / name).read_text(encoding="utf-8")


def test_the_committed_pages_are_what_the_code_makes() -> None:
    assert stale(REPO) == [], "run: python -m cdc_relay.reference_pages"


def test_a_page_that_drifts_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main([]) == 0
    assert stale(tmp_path) == []
    cli = tmp_path / REFERENCE / "cli.md"
    cli.write_text(cli.read_text().replace("--create-outbox", "--create"), encoding="utf-8")
    assert stale(tmp_path) == [cli]
    assert main(["--check"]) == 1


# -- configuration ---------------------------------------------------------------------------------


def test_every_setting_is_in_exactly_one_part() -> None:
    placed = [name for names in SETTING_PARTS.values() for name in names]
    assert sorted(placed) == sorted(Settings.model_fields), (
        "place each setting in config.SETTING_PARTS (unplaced ones show under Other)"
    )
    assert Part.OTHER not in SETTING_PARTS
    assert set(REQUIRED_BY) <= set(Settings.model_fields)


def test_the_configuration_page_has_a_row_per_setting_under_its_part() -> None:
    text = page("configuration.md")
    sections = dict(re.findall(r"^## (.+)\n\n((?:.+\n)+)", text, re.MULTILINE))
    for row in rows():
        section = sections[row.part.value]
        line = next(
            line for line in section.splitlines() if line.startswith(f"| `{row.variable}` |")
        )
        assert f"`{row.usage}`" in line
        assert row.kind in line
        assert row.default in line
        bounds = setting_bounds().get(row.name)
        if bounds is not None:
            assert f"| {bounds.describe()} |" in line, row.name  # the bound the field enforces
    assert text.count("\n| `CDC_RELAY_") == len(Settings.model_fields)


def test_a_new_setting_appears_on_the_page_by_itself(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """What later settings rely on: no generator edit, only the page rewritten (and the setting
    placed in its part; until then it shows under Other)."""

    class Wider(Settings):
        brand_new_wait: Annotated[float, seconds(1.0, 60.0)] = Field(
            7.0, description="A new setting, see CDC_RELAY_SLOT_NAME."
        )

    monkeypatch.setattr(settings_reference, "Settings", Wider)
    settings_reference.rows.cache_clear()
    request.addfinalizer(settings_reference.rows.cache_clear)
    new = next(row for row in settings_reference.rows() if row.name == "brand_new_wait")
    assert new.part is Part.OTHER
    assert (new.variable, new.usage, new.default) == (
        "CDC_RELAY_BRAND_NEW_WAIT",
        "--brand-new-wait SECONDS",
        "7",
    )
    assert (
        "\n## Other\n\n| variable | flag | type | default | bounds | meaning |\n"
        "|---|---|---|---|---|---|\n"
        "| `CDC_RELAY_BRAND_NEW_WAIT` | `--brand-new-wait SECONDS` | seconds | `7` | between 1 "
        "and 60 seconds | A new setting, see `CDC_RELAY_SLOT_NAME`. |\n"
    ) in settings_reference.markdown()


# -- CLI -------------------------------------------------------------------------------------------


def test_the_catalog_is_every_command_the_parser_takes() -> None:
    parser = build_parser()
    found = [
        name
        for action in parser._actions
        if action.dest == "command"
        for name in getattr(action, "choices", {}) or {}
    ]
    assert found == [entry.name for entry in COMMANDS]


@pytest.mark.parametrize("entry", COMMANDS, ids=lambda entry: entry.name)
def test_the_cli_page_has_every_command_and_flag(entry: Command) -> None:
    text = page("cli.md")
    section = text.split(f"\n## {entry.name}\n", 1)[1].split("\n## ", 1)[0]
    for usage, _ in own_flags(entry.name):
        assert f"| `{usage}` |" in section
    assert f"```bash\n{entry.example}\n```" in section
    for code in entry.exit_codes:
        assert f"[{int(code)}](exit-codes.md#" in section


# -- exit codes ------------------------------------------------------------------------------------


def test_every_error_exits_with_a_documented_code() -> None:
    classes = [
        item
        for item in vars(errors).values()
        if isinstance(item, type) and issubclass(item, RelayError)
    ]
    assert len(classes) > 5
    for kind in classes:
        assert isinstance(kind.exit_code, ExitCode), kind
        assert kind.exit_code in EXIT_CODES


def test_no_command_returns_a_literal_exit_code() -> None:
    """The codes come from cdc_relay.exit_codes: ``return 2`` in a command would be a code no
    page or help names."""
    package = REPO / "cdc_relay"
    for path in [package / "cli.py", *sorted((package / "commands").glob("*.py"))]:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Return) and isinstance(node.value, ast.Constant):
                assert not isinstance(node.value.value, int) or isinstance(
                    node.value.value, bool
                ), f"{path.name}:{node.lineno}"


def test_the_exit_codes_page_lists_every_code_and_its_commands() -> None:
    text = page("exit-codes.md")
    for code, meaning in EXIT_CODES.items():
        assert f"\n## {int(code)} {meaning.short}\n\n{meaning.means}\n" in text
        commands = [entry.name for entry in COMMANDS if code in entry.exit_codes]
        row = next(line for line in text.splitlines() if line.startswith(f"| [{int(code)}]("))
        assert row.endswith("| " + ", ".join(f"`{name}`" for name in commands) + " |")


def test_every_page_is_generated() -> None:
    assert sorted(PAGES) == ["cli.md", "configuration.md", "exit-codes.md"]
    for name in PAGES:
        assert page(name).startswith("# ")
    assert env_name("slot_name") in page("configuration.md")
