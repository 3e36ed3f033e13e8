"""Command line: ``python -m cdc_relay [run] [--setting value ...]``.

Every setting of :class:`cdc_relay.config.Settings` is also a flag (``--slot-name`` for
``CDC_RELAY_SLOT_NAME``); flags win over the environment and the ``.env`` file.

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
import contextlib
import faulthandler
import gc
import logging
import signal
import sys
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any

from cdc_relay import __version__, collector
from cdc_relay.config import (
    SWEEP_WAIT_BOUNDS,
    Settings,
    check_producer_config,
    configured_names,
    env_name,
    is_secret_property,
    load_settings,
    property_flags,
    unknown_variables,
)
from cdc_relay.database_url import has_password
from cdc_relay.errors import ConfigError, RelayError
from cdc_relay.logs import configure

log = logging.getLogger("cdc_relay.cli")
# At exit, how long to wait for closed Kafka producers to be destroyed (an unresponsive broker
# can hold one up), and never past a stop's shutdown timeout; then the process exits anyway.
PRODUCER_CLOSE_WAIT = 5.0

_SPECIAL_FLAGS = {"kafka_producer_config"}  # given as repeatable --kafka-property KEY=VALUE


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m cdc_relay",
        description=(
            "Relay transactional-outbox rows from PostgreSQL to Kafka by tailing the WAL. "
            "Every flag can also be set as an environment variable (shown in brackets) or in .env."
        ),
    )
    parser.add_argument("--version", action="version", version=f"cdc-relay {__version__}")
    _add_setting_flags(parser, command=None)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    _command(commands, "run", "run the relay (the default command)")
    demo = commands.add_parser("demo", help="try it: throw-away PostgreSQL, broker and relay")
    demo.add_argument("--events", type=int, metavar="N", help="stop after N delivered events")
    demo.add_argument("--rate", type=float, metavar="R", help="events written per second (20)")
    status = _command(
        commands, "status", "where the relay stands: slot, recorded position, live counters"
    )
    status.add_argument(
        "--relay-host", default="127.0.0.1", help="host of the running relay's HTTP server"
    )
    sweep = _command(
        commands, "sweep", "delete outbox rows the relay has published (the relay also does this)"
    )
    sweep.add_argument(
        "--once",
        action="store_true",
        help="select once, wait until the relay's position covers the rows, delete, exit",
    )
    sweep.add_argument(
        "--wait",
        type=_wait_seconds,
        default=30.0,
        metavar="SECONDS",
        help="with --once: how long to wait for the relay to confirm past the rows (30)",
    )
    setup = _command(
        commands, "setup", "create what is missing: state table, outbox_emit(), publication, slot"
    )
    setup.add_argument(
        "--create-outbox",
        action="store_true",
        help="also create the outbox table of sql/001_outbox.sql (default configuration only)",
    )
    _command(commands, "check", "preflight: one line per prerequisite, non-zero exit if any fails")
    return parser


def _wait_seconds(text: str) -> float:
    """``sweep --wait``: a number of seconds within its bounds (argparse exits 2 otherwise)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not SWEEP_WAIT_BOUNDS.admits(value):  # nan admits nothing
        raise argparse.ArgumentTypeError(SWEEP_WAIT_BOUNDS.describe())
    return value


def _command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], name: str, help_text: str
) -> argparse.ArgumentParser:
    """A command that takes the setting flags (all but ``demo``, which configures itself)."""
    parser = commands.add_parser(name, help=help_text)
    _add_setting_flags(parser, command=name)
    return parser


def _property_dest(command: str | None) -> str:
    """Where the ``--kafka-property`` list given before (None) or after ``command`` is kept.

    The setting flags work before and after the command, but each parser needs its own list: a
    subparser's list would replace, not extend, the top-level one.
    """
    return f"{command}_kafka_property" if command else "kafka_property"


def _add_setting_flags(parser: argparse.ArgumentParser, command: str | None) -> None:
    group = parser.add_argument_group("settings")
    for name, field in Settings.model_fields.items():
        if name in _SPECIAL_FLAGS:
            continue
        flag = "--" + name.replace("_", "-")
        # argparse formats help with %: a description's own "60 %" must reach it as "60 %%".
        help_text = f"{field.description} [{env_name(name)}]".replace("%", "%%")
        if field.annotation is bool:
            group.add_argument(
                flag,
                dest=name,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=help_text,
            )
        else:
            group.add_argument(
                flag, dest=name, default=argparse.SUPPRESS, metavar="VALUE", help=help_text
            )
    group.add_argument(
        "--kafka-property",
        dest=_property_dest(command),
        action="append",
        default=argparse.SUPPRESS,
        metavar="KEY=VALUE",
        help="any librdkafka producer property, repeatable [CDC_RELAY_KAFKA_PRODUCER_CONFIG, JSON]",
    )


def settings_from_args(args: argparse.Namespace) -> Settings:
    overrides: dict[str, Any] = {
        name: getattr(args, name, None)
        for name in Settings.model_fields
        if name not in _SPECIAL_FLAGS
    }
    if overrides.get("database_url") and has_password(overrides["database_url"]):
        _warn_secret_on_command_line(
            "--database-url with a password",
            f"{env_name('database_url_file')} or {env_name('database_url')}",
        )
    dests = dict.fromkeys((_property_dest(None), _property_dest(args.command)))  # later win
    properties = [item for dest in dests for item in getattr(args, dest, [])]
    if properties:
        props = property_flags(properties)
        secrets = sorted(key for key in props if is_secret_property(key))
        if secrets:
            _warn_secret_on_command_line(
                f"--kafka-property {', '.join(secrets)}",
                f"{env_name('kafka_producer_config_file')} or {env_name('kafka_producer_config')}",
            )
        # Flags extend what the environment configured rather than replacing it.
        base = load_settings(**overrides).kafka_producer_config
        overrides["kafka_producer_config"] = {**base, **props}
    return load_settings(**overrides)


def _warn_secret_on_command_line(what: str, instead: str) -> None:
    print(
        f"cdc-relay: warning: {what} puts a secret on the command line, where other users of "
        f"this machine can read it (ps, /proc); use {instead} instead",
        file=sys.stderr,
    )


def install_stack_dumps() -> None:
    """``kill -USR1 <pid>`` prints every thread's stack to stderr and the process carries on; a
    crash (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT: a fault in a C extension or a library)
    prints them before the process dies.

    For a relay that looks stuck, or that died without a log line: every long-running command
    installs it (SIGUSR1's default action would end the process).
    """
    # Suppressed: stderr without a file descriptor (embedded, captured) has nowhere to print to.
    with contextlib.suppress(OSError, ValueError, AttributeError):
        faulthandler.enable(all_threads=True)
        faulthandler.register(signal.SIGUSR1, all_threads=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command not in (None, "run"):
        gc.enable()  # paused while the modules loaded (__main__); run() tunes it
    if args.command in (None, "run", "sweep", "demo"):
        install_stack_dumps()
    if args.command == "demo":
        from cdc_relay.commands.demo import main as demo_main  # noqa: PLC0415 - servers, Kafka: late

        return demo_main(args)
    try:
        settings = settings_from_args(args)
    except ConfigError as exc:
        print(f"cdc-relay: {exc}", file=sys.stderr)
        return exc.exit_code
    configure(settings.log_level, settings.log_format.value)
    if args.command != "check":  # check reports them as a failed check of its own
        for line in unknown_variables(configured_names()):
            log.warning(line)
    if args.command == "status":
        from cdc_relay.commands.status import main as status_main  # noqa: PLC0415 - only for this command

        return status_main(settings, args.relay_host)
    if args.command in ("setup", "check", "sweep"):
        return maintenance(args, settings)
    return run(settings)


def maintenance(args: argparse.Namespace, settings: Settings) -> int:
    """The ``setup``, ``check`` and ``sweep`` commands (:mod:`cdc_relay.commands`)."""
    # Imported late, as run() imports the relay: --help and --version stay fast.
    if args.command == "sweep":
        from cdc_relay.commands.sweep import sweep  # noqa: PLC0415

        return sweep(settings, once=args.once, wait=args.wait)
    if args.command == "setup":
        from cdc_relay.commands.setup import setup  # noqa: PLC0415

        return setup(settings, create_outbox=args.create_outbox)
    from cdc_relay.commands.check import check  # noqa: PLC0415

    return check(settings)


def run(settings: Settings) -> int:
    from cdc_relay.relay import Relay  # noqa: PLC0415 - late: --help and --version stay fast

    try:
        check_producer_config(settings.producer_config())
    except ConfigError as exc:
        log.error(str(exc), extra={"fields": {"error": type(exc).__name__}})
        return exc.exit_code
    relay = Relay(settings)
    # A stop is due within the shutdown timeout of its signal: the exit's wait for the producer
    # (_await_producers) takes only what is left of it.
    stop_due: list[float] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("stop requested", extra={"fields": {"signal": signal.Signals(signum).name}})
        stop_due.append(time.monotonic() + settings.shutdown_timeout)
        relay.request_stop()
        # A second signal stops at once.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log.info("starting", extra={"fields": {"version": __version__, **_flat(settings.describe())}})
    collector.tune()
    try:
        relay.run()
    except RelayError as exc:
        log.error(str(exc), extra={"fields": {"error": type(exc).__name__}})
        return exc.exit_code
    except Exception:
        # A bug, not an operating condition: say so loudly; the supervisor restarts us and we
        # resume from the confirmed position.
        log.exception("unexpected error, exiting")
        return 70
    finally:
        wait = PRODUCER_CLOSE_WAIT
        if stop_due:
            wait = max(0.0, min(wait, stop_due[0] - time.monotonic()))
        _await_producers(wait)
    return 0


def _await_producers(wait: float) -> None:
    """librdkafka's clients end before the interpreter does: a client's threads must not run
    through its finalization and the C library's exit handlers (cdc_relay.publisher). At most
    ``wait`` seconds: an unresponsive broker can hold a client's destruction up."""
    publisher = sys.modules.get("cdc_relay.publisher")  # not imported: no producer was made
    if publisher is not None and not publisher.await_closed(wait):
        log.warning(
            "exiting while a Kafka producer is still being destroyed",
            extra={"fields": {"waited_s": round(wait, 3)}},
        )


def _flat(data: dict[str, Any]) -> dict[str, Any]:
    keep = ("outbox_table", "slot_name", "publication_name", "topic_template", "database_url")
    return {k: data[k] for k in keep}
