"""Unit tests for cdc_relay.cli: flags, precedence over the environment, exit codes.

``run()`` is never called for real (it would start the relay): where ``main`` gets that far it
is replaced by a stub.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from cdc_relay import DOCS_URL, __version__, cli
from cdc_relay.cli import build_parser, main, settings_from_args
from cdc_relay.commands.catalog import COMMANDS
from cdc_relay.config import Settings, env_name
from cdc_relay.errors import ConfigError
from cdc_relay.exit_codes import EXIT_CODES, ExitCode

DB_PASSWORD = "hunter2-db-Pw"
SASL_PASSWORD = "s3cret-sasl-Pw"
DB_URL = f"postgresql://relay:{DB_PASSWORD}@db.example/app"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """Only the variables a test sets, no .env, and cdc_relay's logger restored afterwards."""
    for name in list(os.environ):
        if name.upper().startswith("CDC_RELAY_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CDC_RELAY_DATABASE_URL", DB_URL)
    monkeypatch.setenv("CDC_RELAY_KAFKA_BOOTSTRAP_SERVERS", "kafka:9092")
    logger = logging.getLogger("cdc_relay")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = saved


@pytest.fixture
def no_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test instead of starting the relay."""

    def forbidden(settings: Settings) -> int:
        raise AssertionError(f"run() must not be reached: {settings.describe()}")

    monkeypatch.setattr(cli, "run", forbidden)


def settings_for(*argv: str) -> Settings:
    return settings_from_args(build_parser().parse_args(list(argv)))


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"cdc-relay {__version__}"


def test_version_through_main(capsys: pytest.CaptureFixture[str], no_run: None) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert __version__ in capsys.readouterr().out


def test_the_settings_command_lists_every_setting_with_its_variable(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["settings"]) == 0
    out = capsys.readouterr().out
    for flag, env in [
        ("--slot-name NAME", "CDC_RELAY_SLOT_NAME"),
        ("--database-url URL", "CDC_RELAY_DATABASE_URL"),
        ("--allow-slot-reset, --no-allow-slot-reset", "CDC_RELAY_ALLOW_SLOT_RESET"),
        ("--kafka-property KEY=VALUE", "CDC_RELAY_KAFKA_PRODUCER_CONFIG"),
        ("--plugin {pgoutput,wal2json}", "CDC_RELAY_PLUGIN"),
        ("--sweep-interval SECONDS", "CDC_RELAY_SWEEP_INTERVAL"),
        ("--producer-queue-max-kbytes KBYTES", "CDC_RELAY_PRODUCER_QUEUE_MAX_KBYTES"),
    ]:
        assert flag in out
        assert f"[{env}]" in out
    assert "--kafka-producer-config " not in out
    assert "--kafka-producer-config-file FILE" in out
    assert "VALUE " not in out.replace("KEY=VALUE", "").replace("[--SETTING VALUE ...]", "")
    for name in Settings.model_fields:
        assert f"[{env_name(name)}]" in " ".join(out.split()), name


def test_no_flags_uses_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CDC_RELAY_SLOT_NAME", "env_slot")
    settings = settings_for()
    assert settings.slot_name == "env_slot"
    assert settings.database_url.get_secret_value() == DB_URL
    assert build_parser().parse_args([]).command is None
    assert build_parser().parse_args(["run"]).command == "run"


@pytest.mark.parametrize(
    "argv",
    [
        ["--slot-name", "flag_slot", "run"],
        ["run", "--slot-name", "flag_slot"],
        ["--slot-name", "flag_slot"],
        ["run", "--slot-name=flag_slot"],
    ],
)
def test_flag_beats_env_before_and_after_run(
    monkeypatch: pytest.MonkeyPatch, argv: list[str]
) -> None:
    monkeypatch.setenv("CDC_RELAY_SLOT_NAME", "env_slot")
    assert settings_for(*argv).slot_name == "flag_slot"


def test_flag_beats_dotenv(tmp_path: Path) -> None:
    (tmp_path / ".env").write_text("CDC_RELAY_PUBLICATION_NAME=dotenv_pub\n", encoding="utf-8")
    assert settings_for().publication_name == "dotenv_pub"
    assert settings_for("run", "--publication-name", "flag_pub").publication_name == "flag_pub"


def test_flag_after_run_wins_over_flag_before_run() -> None:
    assert (
        settings_for("--slot-name", "first", "run", "--slot-name", "second").slot_name == "second"
    )


def test_flags_before_and_after_run_combine() -> None:
    settings = settings_for("--slot-name", "flag_slot", "run", "--outbox-table", "sales.events")
    assert settings.slot_name == "flag_slot"
    assert settings.outbox_table == "sales.events"


def test_typed_flags_are_converted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CDC_RELAY_CONFIRM_INTERVAL", "9")
    settings = settings_for(
        "run",
        "--confirm-interval",
        "2.5",
        "--producer-queue-max-messages",
        "100",
        "--poison-policy",
        "stop",
        "--log-format",
        "json",
        "--log-level",
        "warning",
    )
    assert settings.confirm_interval == 2.5
    assert settings.producer_queue_max_messages == 100
    assert settings.poison_policy.value == "stop"
    assert settings.log_format.value == "json"
    assert settings.log_level == "WARNING"


def test_boolean_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    assert settings_for().allow_slot_reset is False
    assert settings_for("--allow-slot-reset", "run").allow_slot_reset is True
    assert settings_for("run", "--allow-slot-reset").allow_slot_reset is True
    monkeypatch.setenv("CDC_RELAY_ALLOW_SLOT_RESET", "true")
    assert settings_for().allow_slot_reset is True
    assert settings_for("run", "--no-allow-slot-reset").allow_slot_reset is False


def test_database_url_flag_beats_env() -> None:
    settings = settings_for("run", "--database-url", "postgresql://other/db")
    assert settings.database_url.get_secret_value() == "postgresql://other/db"


# -- --kafka-property -----------------------------------------------------------------------------


def test_kafka_property_merges_with_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(
        "CDC_RELAY_KAFKA_PRODUCER_CONFIG",
        json.dumps({"compression.type": "zstd", "linger.ms": "1"}),
    )
    settings = settings_for("run", "--kafka-property", "linger.ms=7")
    assert settings.kafka_producer_config == {"compression.type": "zstd", "linger.ms": "7"}
    config = settings.producer_config()
    assert config["linger.ms"] == "7"
    assert config["compression.type"] == "zstd"
    assert config["enable.idempotence"] == "true"
    assert config["acks"] == "all"


def test_kafka_property_is_repeatable_and_keeps_equals_in_values() -> None:
    settings = settings_for(
        "--kafka-property",
        "linger.ms=7",
        "--kafka-property",
        "sasl.jaas.config=a=b;c=d",
        "--kafka-property",
        "client.id=",
        "--kafka-property",
        "linger.ms=8",
    )
    assert settings.kafka_producer_config == {
        "linger.ms": "8",
        "sasl.jaas.config": "a=b;c=d",
        "client.id": "",
    }


def test_kafka_property_values_keep_commas() -> None:
    """librdkafka lists are comma-separated (debug, ssl.cipher.suites): one flag, one property."""
    settings = settings_for("run", "--kafka-property", "debug=broker,topic,msg")
    assert settings.kafka_producer_config == {"debug": "broker,topic,msg"}


def test_kafka_property_before_and_after_run_are_both_kept() -> None:
    settings = settings_for(
        "--kafka-property", "linger.ms=7", "run", "--kafka-property", "batch.size=1000"
    )
    assert settings.kafka_producer_config == {"linger.ms": "7", "batch.size": "1000"}


def test_kafka_property_cannot_disable_idempotence() -> None:
    with pytest.raises(ConfigError, match="CDC_RELAY_KAFKA_PRODUCER_CONFIG"):
        settings_for("run", "--kafka-property", "enable.idempotence=false")


@pytest.mark.parametrize("item", ["linger.ms", "=7", ""])
def test_malformed_kafka_property(item: str) -> None:
    with pytest.raises(ConfigError, match="--kafka-property"):
        settings_for("run", "--kafka-property", item)


def test_malformed_kafka_property_does_not_echo_a_secret() -> None:
    with pytest.raises(ConfigError) as info:
        settings_for("run", "--kafka-property", f"sasl.password:{SASL_PASSWORD}")
    assert "--kafka-property" in str(info.value)
    assert SASL_PASSWORD not in str(info.value)


# -- main -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "setting"),
    [
        (["--slot-name", "Bad-Slot"], "CDC_RELAY_SLOT_NAME"),
        (["run", "--slot-name", "Bad-Slot"], "CDC_RELAY_SLOT_NAME"),
        (["run", "--outbox-table", "a.b.c"], "CDC_RELAY_OUTBOX_TABLE"),
        (["run", "--topic-template", "{nope}"], "CDC_RELAY_TOPIC_TEMPLATE"),
        (["run", "--confirm-interval", "soon"], "CDC_RELAY_CONFIRM_INTERVAL"),
        (["run", "--kafka-property", "acks=1"], "CDC_RELAY_KAFKA_PRODUCER_CONFIG"),
    ],
)
def test_main_invalid_setting_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str], no_run: None, argv: list[str], setting: str
) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("cdc-relay: ")
    assert setting in lines[0]
    assert DB_PASSWORD not in captured.err


def test_main_invalid_env_setting_with_secrets(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, no_run: None
) -> None:
    monkeypatch.setenv(
        "CDC_RELAY_KAFKA_PRODUCER_CONFIG", json.dumps({"sasl.password": SASL_PASSWORD})
    )
    monkeypatch.setenv("CDC_RELAY_LOG_LEVEL", "loud")
    assert main(["run"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert "CDC_RELAY_LOG_LEVEL" in err
    assert DB_PASSWORD not in err
    assert SASL_PASSWORD not in err


def test_main_missing_required_settings(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, no_run: None
) -> None:
    monkeypatch.delenv("CDC_RELAY_DATABASE_URL")
    monkeypatch.delenv("CDC_RELAY_KAFKA_BOOTSTRAP_SERVERS")
    assert main([]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert "CDC_RELAY_DATABASE_URL" in err
    assert "CDC_RELAY_KAFKA_BOOTSTRAP_SERVERS" in err


def test_main_malformed_kafka_property_exits_2(
    capsys: pytest.CaptureFixture[str], no_run: None
) -> None:
    assert main(["run", "--kafka-property", "linger.ms"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert "--kafka-property" in err


def test_main_valid_settings_reach_run_and_return_its_code(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[Settings] = []

    def fake_run(settings: Settings) -> int:
        seen.append(settings)
        return 42

    monkeypatch.setattr(cli, "run", fake_run)
    assert main(["--slot-name", "flag_slot", "run", "--log-level", "debug"]) == 42
    assert len(seen) == 1
    assert seen[0].slot_name == "flag_slot"
    logger = logging.getLogger("cdc_relay")
    assert logger.level == logging.DEBUG
    assert len(logger.handlers) == 1


# -- secrets on the command line, SIGUSR1, librdkafka's verdict -----------------------------------


def test_a_secret_kafka_property_flag_is_warned_about(capsys: pytest.CaptureFixture[str]) -> None:
    settings = settings_for(
        "run", "--kafka-property", f"sasl.password={SASL_PASSWORD}", "--kafka-property", "x.y=1"
    )
    assert settings.kafka_producer_config["sasl.password"] == SASL_PASSWORD
    err = capsys.readouterr().err
    assert "warning: --kafka-property sasl.password puts a secret on the command line" in err
    assert "CDC_RELAY_KAFKA_PRODUCER_CONFIG_FILE" in err
    assert "x.y" not in err
    assert SASL_PASSWORD not in err


def test_a_database_url_flag_with_a_password_is_warned_about(
    capsys: pytest.CaptureFixture[str],
) -> None:
    settings_for("run", "--database-url", "postgresql://other/db")
    assert capsys.readouterr().err == ""
    settings_for("run", "--database-url", DB_URL)
    err = capsys.readouterr().err
    assert "warning: --database-url with a password" in err
    assert "CDC_RELAY_DATABASE_URL_FILE" in err
    assert DB_PASSWORD not in err


@pytest.mark.parametrize(
    ("argv", "target"),
    [([], "run"), (["run"], "run"), (["sweep"], "sweep"), (["demo"], "demo")],
)
def test_long_running_commands_install_stack_dumps(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], target: str
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(cli, "install_stack_dumps", lambda: calls.append("registered"))
    monkeypatch.setattr(cli, "run", lambda _settings: 0)
    import cdc_relay.commands.demo  # noqa: PLC0415 - only to replace its entry points
    import cdc_relay.commands.sweep  # noqa: PLC0415

    monkeypatch.setattr(cdc_relay.commands.sweep, "sweep", lambda _settings, once, wait: 0)
    monkeypatch.setattr(cdc_relay.commands.demo, "main", lambda _args: 0)
    assert main(argv) == 0
    assert calls == ["registered"], target


@pytest.mark.parametrize("argv", [["check"], ["setup"], ["status"]])
def test_short_commands_leave_sigusr1_alone(
    monkeypatch: pytest.MonkeyPatch, argv: list[str]
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(cli, "install_stack_dumps", lambda: calls.append("registered"))
    monkeypatch.setattr(cli, "maintenance", lambda _args, _settings: 0)
    import cdc_relay.commands.status  # noqa: PLC0415 - only to replace its entry point

    monkeypatch.setattr(cdc_relay.commands.status, "main", lambda _settings, _host: 0)
    assert main(argv) == 0
    assert calls == []


def test_run_refuses_a_property_librdkafka_refuses(caplog: pytest.LogCaptureFixture) -> None:
    settings = settings_for("run", "--kafka-property", "no.such.thing=1")
    assert cli.run(settings) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1
    assert errors[0].startswith("invalid configuration: CDC_RELAY_KAFKA_PRODUCER_CONFIG: ")
    assert "no.such.thing" in errors[0]


# -- errors a user can act on ---------------------------------------------------------------------

ISSUES_URL = "https://github.com/cdc-relay/cdc-relay/issues"


def test_a_misspelt_variable_is_named_when_the_configuration_fails(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, no_run: None
) -> None:
    monkeypatch.delenv("CDC_RELAY_DATABASE_URL")
    monkeypatch.setenv("CDC_RELAY_DATABSE_URL", DB_URL)
    assert main(["run"]) == 2
    err = capsys.readouterr().err
    assert "cdc-relay: invalid configuration: CDC_RELAY_DATABASE_URL: is required" in err
    assert (
        "CDC_RELAY_DATABSE_URL is not a setting and is ignored; did you mean "
        "CDC_RELAY_DATABASE_URL?" in err
    )
    assert DB_PASSWORD not in err


def test_an_unexpected_error_exits_70_naming_where_to_report_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import cdc_relay.relay  # noqa: PLC0415 - only to replace the relay

    class Broken:
        def __init__(self, _settings: Settings) -> None:
            pass

        def run(self) -> None:
            raise RuntimeError("a bug")

        def request_stop(self) -> None:
            pass

    monkeypatch.setattr(cdc_relay.relay, "Relay", Broken)
    assert cli.run(settings_for()) == 70
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1
    assert ISSUES_URL in errors[0]


# -- the help fits a screen -----------------------------------------------------------------------

COMMAND_NAMES = [entry.name for entry in COMMANDS]
OWN_FLAGS = {
    "run": [],
    "setup": ["--create-outbox"],
    "check": [],
    "status": ["--relay-host HOST"],
    "sweep": ["--once", "--wait SECONDS"],
    "recover": ["--wait SECONDS"],
    "republish": [
        "--from ISO",
        "--until ISO",
        "--aggregate-type TYPE",
        "--aggregate-id ID",
        "--to-topic NAME",
        "--dry-run",
    ],
    "settings": ["--markdown"],
    "demo": ["--events N", "--rate R"],
}


def help_of(capsys: pytest.CaptureFixture[str], *argv: str, prog: str = "cdc-relay") -> str:
    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"], prog=prog)
    assert info.value.code == 0
    return capsys.readouterr().out


def usage_lines(text: str) -> list[str]:
    return text.split("\n\n", 1)[0].splitlines()


@pytest.fixture
def screen(monkeypatch: pytest.MonkeyPatch) -> None:
    """An 80-column terminal (argparse wraps to COLUMNS)."""
    monkeypatch.setenv("COLUMNS", "80")


def test_the_help_fits_a_screen_with_the_commands_first(
    capsys: pytest.CaptureFixture[str], screen: None
) -> None:
    text = help_of(capsys)
    lines = text.splitlines()
    assert len(lines) <= 60
    assert len(usage_lines(text)) <= 3
    assert lines[0].startswith("usage: cdc-relay [COMMAND]")
    assert all(len(line) <= 80 for line in lines), [line for line in lines if len(line) > 80]
    sections = [line for line in lines if line.endswith(":") and not line.startswith(" ")]
    assert sections[0] == "commands:"
    listed = [
        line.split()[0] for line in text.split("commands:\n", 1)[1].split("\n\n")[0].split("\n")
    ]
    assert listed == COMMAND_NAMES
    # The settings a command cannot do without, and where the rest are.
    assert "--database-url URL  [CDC_RELAY_DATABASE_URL]" in text
    assert "cdc-relay settings lists all" in text


@pytest.mark.parametrize("command", COMMAND_NAMES)
def test_a_commands_help_fits_a_screen_and_leads_with_its_own_flags(
    capsys: pytest.CaptureFixture[str], screen: None, command: str
) -> None:
    text = help_of(capsys, command)
    lines = text.splitlines()
    assert len(lines) <= 60
    assert len(usage_lines(text)) <= 3
    assert lines[0].startswith(f"usage: cdc-relay {command}")
    assert all(len(line) <= 80 for line in lines), [line for line in lines if len(line) > 80]
    assert text.split("\n\n")[2].startswith("options:\n")  # right after usage and summary
    flag_lines = [line.strip() for line in lines if line.startswith("  -")]
    own = OWN_FLAGS[command]
    assert [line.split("  ")[0] for line in flag_lines[: len(own)]] == own
    assert flag_lines[len(own)].startswith("-h, --help")
    assert len(flag_lines) == len(own) + 1  # no setting repeated here
    assert f"example:\n  cdc-relay {command}" in text
    assert "CDC_RELAY_SLOT_NAME" not in text


@pytest.mark.parametrize("argv", [[], *([name] for name in COMMAND_NAMES)])
def test_every_help_ends_with_the_exit_codes_and_the_docs(
    capsys: pytest.CaptureFixture[str], screen: None, argv: list[str]
) -> None:
    text = help_of(capsys, *argv)
    ending = " ".join(text.rsplit("\n\n", 1)[1].split())
    assert ending.startswith("exit codes: 0 done, ")
    assert "70 a bug" in ending
    assert f". Report a bug at {ISSUES_URL} " in ending
    assert DOCS_URL in ending
    entry = next((e for e in COMMANDS if e.name in argv), None)
    listed = re.findall(r"(\d+) ([a-z ]+)[,.]", ending.split(". Report", 1)[0] + ".")
    expected = [code for code in ExitCode if entry is None or code in entry.exit_codes]
    assert listed == [(str(int(code)), EXIT_CODES[code].short) for code in expected]


@pytest.mark.parametrize("prog", ["cdc-relay", "python -m cdc_relay"])
def test_the_help_names_the_program_as_invoked(
    capsys: pytest.CaptureFixture[str], screen: None, prog: str
) -> None:
    assert help_of(capsys, prog=prog).startswith(f"usage: {prog} [COMMAND]")
    assert help_of(capsys, "sweep", prog=prog).startswith(f"usage: {prog} sweep ")
    assert f"example:\n  {prog} sweep --once" in help_of(capsys, "sweep", prog=prog)


def test_the_installed_command_is_cdc_relay() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    assert pyproject["project"]["scripts"] == {"cdc-relay": "cdc_relay.cli:main"}
    assert inspect.signature(main).parameters["prog"].default == "cdc-relay"
    assert 'main(prog="python -m cdc_relay")' in (REPO / "cdc_relay" / "__main__.py").read_text()


@pytest.mark.parametrize("command", [e.name for e in COMMANDS if e.takes_settings])
@pytest.mark.parametrize("before", [True, False])
def test_the_setting_flags_work_on_every_command_before_and_after_it(
    command: str, before: bool
) -> None:
    flags = ["--slot-name", "flag_slot", "--kafka-property", "linger.ms=9", "--no-reconcile"]
    argv = [*flags, command] if before else [command, *flags]
    settings = settings_for(*argv)
    assert settings.slot_name == "flag_slot"
    assert settings.kafka_producer_config == {"linger.ms": "9"}
    assert settings.reconcile is False


def test_a_command_that_takes_no_settings_refuses_a_setting_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["settings", "--slot-name", "x"])
    assert info.value.code == 2
    assert "unrecognized arguments: --slot-name x" in capsys.readouterr().err


def test_the_settings_command_prints_no_secret_and_needs_no_configuration(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    secret_file = tmp_path / "kafka.properties"
    secret_file.write_text(f"sasl.password={SASL_PASSWORD}\n", encoding="utf-8")
    monkeypatch.setenv("CDC_RELAY_KAFKA_PRODUCER_CONFIG_FILE", str(secret_file))
    monkeypatch.setenv("CDC_RELAY_KAFKA_PRODUCER_CONFIG", json.dumps({"sasl.password": "x-Pw1"}))
    monkeypatch.setenv("CDC_RELAY_LOG_LEVEL", "nonsense")  # invalid: it is not read at all
    (tmp_path / ".env").write_text(f"CDC_RELAY_TOPIC_ALLOWLIST={SASL_PASSWORD}\n", "utf-8")
    for argv in (["settings"], ["settings", "--markdown"]):
        assert main(argv) == 0
        captured = capsys.readouterr()
        assert captured.err == ""
        for secret in (DB_PASSWORD, SASL_PASSWORD, "x-Pw1", str(secret_file), "nonsense"):
            assert secret not in captured.out


def test_version_is_the_packages(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--version"], prog="python -m cdc_relay")
    assert capsys.readouterr().out == f"cdc-relay {__version__}\n"


@pytest.mark.parametrize("command", ["status", "setup", "sweep"])
def test_commands_that_never_use_kafka_need_no_kafka_setting(
    monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    monkeypatch.delenv("CDC_RELAY_KAFKA_BOOTSTRAP_SERVERS")
    settings = settings_for(command)
    assert settings.kafka_bootstrap_servers is None
    assert settings.slot_name == "cdc_relay"


@pytest.mark.parametrize("argv", [[], ["run"], ["check"]])
def test_run_and_check_name_the_kafka_setting_they_need(
    monkeypatch: pytest.MonkeyPatch, argv: list[str]
) -> None:
    monkeypatch.delenv("CDC_RELAY_KAFKA_BOOTSTRAP_SERVERS")
    with pytest.raises(ConfigError) as info:
        settings_for(*argv)
    command = argv[0] if argv else "run"
    assert str(info.value) == (
        f"invalid configuration: CDC_RELAY_KAFKA_BOOTSTRAP_SERVERS: is required by {command}"
    )
    monkeypatch.setenv("CDC_RELAY_KAFKA_BOOTSTRAP_SERVERS", "")
    with pytest.raises(ConfigError, match="KAFKA_BOOTSTRAP_SERVERS: must not be empty"):
        settings_for(*argv)
