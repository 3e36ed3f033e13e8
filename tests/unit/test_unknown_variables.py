"""A ``CDC_RELAY_*`` variable no setting reads is named, with the closest setting: pydantic-settings
ignores it, so a misspelt setting would silently keep its default."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cdc_relay.config import (
    ENV_PREFIX,
    NOT_SETTINGS,
    Settings,
    configured_names,
    env_name,
    unknown_variables,
)

SETTINGS = [env_name(field) for field in Settings.model_fields]


@pytest.mark.parametrize(
    ("typo", "meant"),
    [
        ("CDC_RELAY_SWEEP_CONDITON", "CDC_RELAY_SWEEP_CONDITION"),
        ("CDC_RELAY_OUTBOX_ROW_FILTR", "CDC_RELAY_OUTBOX_ROW_FILTER"),
        ("cdc_relay_slot_nam", "CDC_RELAY_SLOT_NAME"),
        ("CDC_RELAY_EXACTLY_ONC", "CDC_RELAY_EXACTLY_ONCE"),
    ],
)
def test_a_misspelt_setting_is_named_with_the_closest_one(typo: str, meant: str) -> None:
    assert unknown_variables([typo]) == [
        f"{typo} is not a setting and is ignored; did you mean {meant}?"
    ]


def test_a_name_like_no_setting_gets_no_guess() -> None:
    assert unknown_variables(["CDC_RELAY_WOMBAT"]) == [
        "CDC_RELAY_WOMBAT is not a setting and is ignored"
    ]


def test_settings_in_any_case_the_projects_own_variables_and_others_are_not_named() -> None:
    names = [*SETTINGS, *(name.lower() for name in SETTINGS), *NOT_SETTINGS, "PATH", "CDC_RELAYX"]
    assert unknown_variables(names) == []


@given(st.lists(st.text(max_size=40) | st.sampled_from(SETTINGS), max_size=8))
def test_any_names_give_one_line_per_unknown_prefixed_name(names: list[str]) -> None:
    lines = unknown_variables(names)
    unknown = {
        name
        for name in names
        if name.upper().startswith(ENV_PREFIX)
        and name.upper() not in SETTINGS
        and name.upper() not in NOT_SETTINGS
    }
    assert len(lines) == len(unknown)
    assert all(
        any(line.startswith(f"{name} is not a setting") for line in lines) for name in unknown
    )


def test_the_names_come_from_the_environment_and_dotenv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CDC_RELAY_FROM_THE_ENVIRONMENT", "1")
    dotenv = tmp_path / ".env"
    dotenv.write_text("CDC_RELAY_FROM_DOTENV=1\n# a comment\n", encoding="utf-8")
    names = configured_names(dotenv)
    assert "CDC_RELAY_FROM_THE_ENVIRONMENT" in names
    assert "CDC_RELAY_FROM_DOTENV" in names
    assert "CDC_RELAY_FROM_DOTENV" not in configured_names(tmp_path / "missing")


def test_every_variable_ci_hands_to_the_relays_it_runs_is_a_setting_or_the_projects_own() -> None:
    """CI's own switches reach every relay its tests start (exported, or set for one command):
    one that no setting reads and NOT_SETTINGS lacks makes every relay warn and `check` fail."""
    script = (Path(__file__).parents[2] / ".ci" / "run").read_text()
    exported = set(re.findall(r"^\s*export (CDC_RELAY_\w+)", script, flags=re.MULTILINE))
    # NAME=value followed by a command (or a continued line): set for that command alone.
    assignments = r'^\s*(CDC_RELAY_\w+)=(?:"[^"]*"|\S+)(.*)$'
    for name, rest in re.findall(assignments, script, flags=re.MULTILINE):
        if rest.strip():
            exported.add(name)
    assert "CDC_RELAY_POSTGRES_BINDIR" in exported  # the parse finds what CI does export
    assert unknown_variables(sorted(exported)) == []
