"""The reference pages written from the code: configuration, CLI and exit codes.

``docs/reference/configuration.md``, ``cli.md`` and ``exit-codes.md`` are committed, and made
here from what the code holds (the settings' fields, the command catalog and parser, the exit
codes), so that the pages cannot say something the code does not::

    python -m cdc_relay.reference_pages            # rewrite them
    python -m cdc_relay.reference_pages --check    # exit 1 naming each page that differs

``tests/unit/test_reference_pages.py`` fails when a committed page and the code disagree.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from cdc_relay import CHANGELOG_URL, DOCS_URL, ISSUES_URL
from cdc_relay.cli_parser import own_flags
from cdc_relay.commands.catalog import COMMANDS, Command
from cdc_relay.exit_codes import EXIT_CODES, ExitCode
from cdc_relay.settings_reference import code_variables
from cdc_relay.settings_reference import markdown as configuration_page

REFERENCE = Path("docs") / "reference"


def cli_page() -> str:
    """``docs/reference/cli.md``: every command, what it needs, its flags, an example, its exits."""
    lines = [
        "# CLI reference",
        "",
        "```text",
        "cdc-relay [COMMAND] [--SETTING VALUE ...]",
        "cdc-relay [--help | --version | COMMAND --help]",
        "```",
        "",
        "`cdc-relay` is installed with the package; `python -m cdc_relay` is the same program.",
        "Without a command it runs the relay (`run`). Every command but `settings` and `demo`",
        "is configured by the settings: environment variables (`CDC_RELAY_…`), a `.env` file in",
        "the working directory, and a flag per setting, given before or after the command",
        "(`--slot-name x run` and `run --slot-name x` are the same; flags win). `cdc-relay",
        "settings` lists them; the [configuration reference](configuration.md) explains each.",
        "",
        "| command | what it does |",
        "|---|---|",
    ]
    lines += [f"| [`{entry.name}`](#{entry.name}) | {entry.summary} |" for entry in COMMANDS]
    lines.append("")
    for entry in COMMANDS:
        lines += _command_section(entry)
    lines += [
        "## Global flags",
        "",
        "| flag | what it does |",
        "|---|---|",
        "| `-h`, `--help` | the help of the program, or of the command it follows |",
        "| `--version` | the version, `cdc-relay X.Y.Z` |",
        "",
    ]
    return "\n".join(lines)


def _command_section(entry: Command) -> list[str]:
    lines = [f"## {entry.name}", "", f"{entry.summary[:1].upper()}{entry.summary[1:]}.", ""]
    lines += [code_variables(entry.description), "", f"Needs: {code_variables(entry.needs)}", ""]
    flags = own_flags(entry.name)
    if flags:
        lines += ["| flag | what it does |", "|---|---|"]
        lines += [f"| `{usage}` | {_cell(text)} |" for usage, text in flags]
        lines.append("")
    if entry.takes_settings:
        lines += [
            "It takes every setting flag ([configuration reference](configuration.md)).",
            "",
        ]
    else:
        lines += ["It takes no setting flags and reads no settings.", ""]
    lines += ["Example:", "", "```bash", entry.example, "```", ""]
    codes = ", ".join(
        f"[{int(code)}](exit-codes.md#{int(code)}-{_slug(EXIT_CODES[code].short)}) "
        f"{EXIT_CODES[code].short}"
        for code in ExitCode
        if code in entry.exit_codes
    )
    lines += [f"Exit codes: {codes}.", ""]
    return lines


def exit_codes_page() -> str:
    """``docs/reference/exit-codes.md``, from :data:`cdc_relay.exit_codes.EXIT_CODES`."""
    lines = [
        "# Exit codes",
        "",
        "Every command exits with one of these codes; `cdc-relay --help` lists them too. A",
        "supervisor (systemd, Kubernetes) may restart the relay on any non-zero code: it resumes",
        "from the confirmed position. Codes 2, 3 and 4 need a person first: a restart fails the",
        "same way until the cause is fixed.",
        "",
        "| code | meaning | commands |",
        "|---|---|---|",
    ]
    for code, meaning in EXIT_CODES.items():
        commands = ", ".join(f"`{entry.name}`" for entry in COMMANDS if code in entry.exit_codes)
        lines.append(
            f"| [{int(code)}](#{int(code)}-{_slug(meaning.short)}) | {meaning.short} | {commands} |"
        )
    lines.append("")
    for code, meaning in EXIT_CODES.items():
        lines += [
            f"## {int(code)} {meaning.short}",
            "",
            meaning.means,
            "",
            f"What to do: {meaning.action}",
            "",
        ]
    lines += [
        "## Ended by a signal",
        "",
        "A first SIGTERM or SIGINT stops the relay cleanly (exit 0). A second one ends it at",
        "once, by the signal: a shell or Kubernetes reports 128 plus the signal's number (143",
        "for SIGTERM, 130 for SIGINT). A crash in a C extension or library (SIGSEGV, SIGABRT, …)",
        "ends it the same way (139 for SIGSEGV), after every thread's stack is printed to",
        f"stderr: report it at {ISSUES_URL}.",
        "",
        f"Changes to these codes are listed in the [changelog]({CHANGELOG_URL}).",
        "",
    ]
    return "\n".join(lines)


def _slug(text: str) -> str:
    """The anchor MkDocs gives a heading's words (lower case, hyphens for spaces)."""
    return "-".join(text.lower().split())


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


PAGES: dict[str, Callable[[], str]] = {
    "configuration.md": configuration_page,
    "cli.md": cli_page,
    "exit-codes.md": exit_codes_page,
}


def stale(root: Path) -> list[Path]:
    """The pages under ``root`` that differ from what the code makes."""
    found = []
    for name, page in PAGES.items():
        path = root / REFERENCE / name
        if not path.is_file() or path.read_text(encoding="utf-8") != page():
            found.append(path)
    return found


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    root = Path.cwd()
    if args == ["--check"]:
        differ = stale(root)
        for path in differ:
            print(f"{path} differs from the code: python -m cdc_relay.reference_pages")
        return 1 if differ else 0
    if args:
        print("usage: python -m cdc_relay.reference_pages [--check]", file=sys.stderr)
        return 2
    (root / REFERENCE).mkdir(parents=True, exist_ok=True)
    for name, page in PAGES.items():
        (root / REFERENCE / name).write_text(page(), encoding="utf-8")
    print(f"wrote {', '.join(PAGES)} in {REFERENCE} (see {DOCS_URL}reference/)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
