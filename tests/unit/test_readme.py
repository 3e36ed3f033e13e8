"""The README stays true to the code: every setting documented, the test command the one CI runs."""

from __future__ import annotations

from pathlib import Path

from cdc_relay.config import Settings, env_name

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def test_every_setting_is_in_the_readme_table() -> None:
    missing = [
        env_name(name) for name in Settings.model_fields if f"| `{env_name(name)}` |" not in README
    ]
    assert not missing


def test_ci_runs_the_readme_test_command() -> None:
    command = 'pip install -e ".[dev]" && python -m pytest -n 2\n'
    assert command in README
    assert "\npython -m pytest -n 2\n" in (REPO / ".ci" / "run").read_text()


def test_ci_runs_the_postgresql_18_tier_the_readme_describes() -> None:
    ci = (REPO / ".ci" / "run").read_text()
    assert "wheel_bindirs()[18]" in ci
    assert "wheel_bindirs()[18]" in README
    for tier in (
        "test_relay.py",
        "test_relay_faults.py",
        "test_sweeper.py",
        "test_admin.py",
        "test_high_availability.py",
    ):
        assert f"tests/integration/{tier}" in ci, tier
