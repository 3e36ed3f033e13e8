"""The command line's parser and its help texts: commands first, then each command's own flags.

Every setting is a flag of every command that takes settings (:mod:`cdc_relay.commands.catalog`),
given before or after the command (``--slot-name x run`` and ``run --slot-name x``). The flags are
there for parsing but left out of each help, which would otherwise repeat ~200 lines of settings
per command: ``cdc-relay settings`` lists them, grouped by part, with typed placeholders,
defaults and bounds (:mod:`cdc_relay.settings_reference`). Every help ends with the exit codes and
where the documentation is.

Built on argparse rather than pydantic-settings' own CLI (``CliApp``, ``CliSubCommand``), which
(as of pydantic-settings 2.16) would change what operators rely on: its setting flags
work only before the command (``run --slot-name x`` is refused) unless every command repeats the
settings model, which then costs ~50 ms of start-up instead of ~2 ms and still needs the
before/after merge written here; its dict flag splits ``KEY=VALUE`` lists at commas
(``debug=broker,topic`` fails) and is not ``--kafka-property``; nested models become dozens of
``--outbox-columns.id``-style flags; ``demo`` would need the database settings.
"""

from __future__ import annotations

import argparse
import textwrap

from cdc_relay import DOCS_URL, ISSUES_URL, __version__
from cdc_relay.commands.catalog import COMMANDS, Command
from cdc_relay.config import SWEEP_WAIT_BOUNDS, Part, Settings, env_name
from cdc_relay.exit_codes import EXIT_CODES, ExitCode
from cdc_relay.settings_reference import PROPERTY_SETTING, SettingRow, rows

PROG = "cdc-relay"
CLI_PAGE = f"{DOCS_URL}reference/cli/"
WIDTH = 80  # the epilogs' own wrapping (argparse wraps the rest to the terminal)


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The parser of ``prog`` (``cdc-relay``, or ``python -m cdc_relay`` as invoked)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        usage=(
            f"{prog} [COMMAND] [--SETTING VALUE ...]\n"
            f"       {prog} [--help | --version | COMMAND --help]"
        ),
        description=_overview(prog),
        epilog=_epilog(tuple(ExitCode), f"{prog} COMMAND --help", CLI_PAGE),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,
    )
    options = parser.add_argument_group("options")
    options.add_argument("-h", "--help", action="help", help="show this help and exit")
    options.add_argument(
        "--version",
        action="version",
        version=f"cdc-relay {__version__}",
        help="show the version and exit",
    )
    add_setting_flags(parser, command=None)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", help=argparse.SUPPRESS)
    for entry in COMMANDS:
        _add_command(commands, entry, prog)
    return parser


def _overview(prog: str) -> str:
    width = max(len(entry.name) for entry in COMMANDS) + 2
    listing = "\n".join(f"  {entry.name:<{width}}{entry.summary}" for entry in COMMANDS)
    required = [row for row in rows() if row.required]
    flags = "\n".join(f"  {row.usage}  [{row.variable}]" for row in required)
    return (
        "Relay transactional-outbox rows from PostgreSQL to Kafka by tailing the WAL.\n\n"
        f"commands:\n{listing}\n\n"
        "settings:\n"
        + _wrap(
            "Every setting is an environment variable (also read from .env) and a flag, "
            "before or after the command; flags win. The ones without a default:",
            indent="  ",
        )
        + f"\n{flags}\n"
        + _wrap(
            f"{prog} settings lists all {len(Settings.model_fields)}, grouped, with their "
            "types, defaults and bounds.",
            indent="  ",
        )
    )


def _epilog(codes: tuple[ExitCode, ...], more: str, page: str) -> str:
    listed = [code for code in ExitCode if code in codes]
    summary = ", ".join(f"{int(code)} {EXIT_CODES[code].short}" for code in listed)
    return (
        _wrap(f"exit codes: {summary}. Report a bug at {ISSUES_URL}", hanging="  ")
        + "\n"
        + _wrap(f"more: {more}; {page}", hanging="  ")
    )


def _wrap(text: str, indent: str = "", hanging: str = "") -> str:
    """``text`` filled to :data:`WIDTH`, URLs and flags unbroken."""
    return textwrap.fill(
        text,
        WIDTH,
        initial_indent=indent,
        subsequent_indent=indent + hanging,
        break_long_words=False,
        break_on_hyphens=False,
    )


def _add_command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], entry: Command, prog: str
) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        entry.name,
        prog=f"{prog} {entry.name}",
        description=f"{entry.summary[:1].upper()}{entry.summary[1:]}.",
        epilog=_wrap(entry.description)
        + "\n\n"
        + _wrap(f"needs: {entry.needs}", hanging="  ")
        + f"\n\nexample:\n  {entry.example.replace(PROG, prog, 1)}\n\n"
        + _epilog(
            entry.exit_codes,
            f"{prog} settings" if entry.takes_settings else f"{prog} --help",
            f"{CLI_PAGE}#{entry.name}",
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,
    )
    own = parser.add_argument_group("options")
    _OWN_FLAGS.get(entry.name, _no_flags)(own)
    own.add_argument("-h", "--help", action="help", help="show this help and exit")
    if entry.takes_settings:
        add_setting_flags(parser, command=entry.name)
    parser.usage = _usage(parser, entry)
    return parser


def _usage(parser: argparse.ArgumentParser, entry: Command) -> str:
    """argparse's usage of the command's own flags, then the settings' (which it leaves out)."""
    own = parser.format_usage().removeprefix("usage: ").strip()
    if not entry.takes_settings:
        return own
    settings = "[--SETTING VALUE ...]"
    last = own.rsplit("\n", 1)[-1]
    if len("usage: ") + len(last) + 1 + len(settings) <= WIDTH:
        return f"{own} {settings}"
    return f"{own}\n{' ' * (len('usage: ') + len(parser.prog) + 1)}{settings}"


def _no_flags(_group: argparse._ArgumentGroup) -> None:
    pass


def _demo_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--events", type=int, metavar="N", help="stop after N delivered events")
    group.add_argument("--rate", type=float, metavar="R", help="events written per second (20)")


def _status_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--relay-host",
        default="127.0.0.1",
        metavar="HOST",
        help="host of the running relay's HTTP server (127.0.0.1); its port is "
        f"{env_name('http_port')}'s",
    )


def _sweep_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--once",
        action="store_true",
        help="select once, wait until the relay's position covers the rows, delete, exit",
    )
    group.add_argument(
        "--wait",
        type=_wait_seconds,
        default=30.0,
        metavar="SECONDS",
        help="with --once: how long to wait for the relay to confirm past the rows (30; "
        f"{SWEEP_WAIT_BOUNDS.describe()})",
    )


def _recover_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--wait",
        type=_wait_seconds,
        default=60.0,
        metavar="SECONDS",
        help="how long to wait for the leadership while a relay leads (60; "
        f"{SWEEP_WAIT_BOUNDS.describe()})",
    )


def _republish_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--from", dest="since", metavar="ISO", help="rows created at or after this ISO 8601 time"
    )
    group.add_argument("--until", metavar="ISO", help="rows created before this ISO 8601 time")
    group.add_argument("--aggregate-type", metavar="TYPE", help="rows of this aggregate type")
    group.add_argument("--aggregate-id", metavar="ID", help="rows of this aggregate id")
    group.add_argument(
        "--to-topic", dest="topic", metavar="NAME", help="send to this topic, not their own"
    )
    group.add_argument("--dry-run", action="store_true", help="count the rows, send nothing")


def _setup_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--create-outbox",
        action="store_true",
        help="also create the outbox table of sql/001_outbox.sql (default configuration only)",
    )


def _settings_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--markdown",
        action="store_true",
        help="print the configuration reference page (Markdown) instead",
    )


_OWN_FLAGS = {
    "demo": _demo_flags,
    "status": _status_flags,
    "sweep": _sweep_flags,
    "recover": _recover_flags,
    "republish": _republish_flags,
    "setup": _setup_flags,
    "settings": _settings_flags,
}


def _wait_seconds(text: str) -> float:
    """``sweep --wait``: a number of seconds within its bounds (argparse exits 2 otherwise)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not SWEEP_WAIT_BOUNDS.admits(value):  # nan admits nothing
        raise argparse.ArgumentTypeError(SWEEP_WAIT_BOUNDS.describe())
    return value


# -- the setting flags ----------------------------------------------------------------------------


def property_dest(command: str | None) -> str:
    """Where the ``--kafka-property`` list given before (None) or after ``command`` is kept.

    The setting flags work before and after the command, but each parser needs its own list: a
    subparser's list would replace, not extend, the top-level one.
    """
    return f"{command}_kafka_property" if command else "kafka_property"


def add_setting_flags(
    parser: argparse.ArgumentParser, command: str | None, shown: bool = False
) -> None:
    """Every setting as a flag of ``parser``, in a group per part; left out of its help unless
    ``shown`` (the listing of ``cdc-relay settings``)."""
    groups: dict[Part, argparse._ArgumentGroup] = {}
    for row in rows():
        if row.part not in groups:
            groups[row.part] = parser.add_argument_group(row.part.value)
        _add_setting_flag(groups[row.part], row, command, shown)


def _add_setting_flag(
    group: argparse._ArgumentGroup, row: SettingRow, command: str | None, shown: bool
) -> None:
    # argparse formats help with %: a description's own "60 %" must reach it as "60 %%".
    help_text = row.help().replace("%", "%%") if shown else argparse.SUPPRESS
    if row.name == PROPERTY_SETTING:
        group.add_argument(
            row.flag,
            dest=property_dest(command),
            action="append",
            default=argparse.SUPPRESS,
            metavar=row.placeholder,
            help=help_text,
        )
    elif not row.placeholder:  # a boolean: --x / --no-x
        group.add_argument(
            "--" + row.name.replace("_", "-"),
            dest=row.name,
            action=argparse.BooleanOptionalAction,
            default=argparse.SUPPRESS,
            help=help_text,
        )
    else:
        group.add_argument(
            row.flag,
            dest=row.name,
            default=argparse.SUPPRESS,
            metavar=row.placeholder,
            help=help_text,
        )


def settings_listing(prog: str = PROG) -> str:
    """What ``cdc-relay settings`` prints: every setting flag, grouped by part, with its help."""
    listing = argparse.ArgumentParser(
        prog=prog,
        usage=f"{prog} [COMMAND] [--SETTING VALUE ...]",
        description=_wrap(
            "Every setting is an environment variable (CDC_RELAY_..., in brackets), may be a "
            "line of .env in the working directory, and is a flag of "
            + ", ".join(entry.name for entry in COMMANDS if entry.takes_settings)
            + ", before or after the command; flags win over the environment, the environment "
            "over .env. Only defaults are shown here, never a configured value."
        ),
        epilog=_wrap(f"more: {DOCS_URL}reference/configuration/"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,
    )
    add_setting_flags(listing, command=None, shown=True)
    return listing.format_help()


def own_flags(command: str) -> list[tuple[str, str]]:
    """A command's own flags (not the settings'), as (usage, help), in its help's order."""
    parser = argparse.ArgumentParser(add_help=False)
    _OWN_FLAGS.get(command, _no_flags)(parser.add_argument_group())
    flags = []
    for action in parser._actions:
        usage = ", ".join(action.option_strings)
        if action.metavar:
            usage += f" {action.metavar}"
        flags.append((usage, str(action.help)))
    return flags
