"""Command line: ``cdc-relay [COMMAND] [--SETTING VALUE ...]`` (also ``python -m cdc_relay``).

Every setting of :class:`cdc_relay.config.Settings` is also a flag (``--slot-name`` for
``CDC_RELAY_SLOT_NAME``); flags win over the environment and the ``.env`` file. The parser and its
help texts are :mod:`cdc_relay.cli_parser`'s; this module reads the settings and runs the command.
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
import traceback
from collections.abc import Sequence
from types import FrameType
from typing import Any

from cdc_relay import ISSUES_URL, __version__, collector
from cdc_relay.cli_parser import PROG, build_parser, property_dest, settings_listing
from cdc_relay.config import (
    Settings,
    check_producer_config,
    configured_names,
    env_name,
    is_secret_property,
    property_flags,
    settings_for,
    unknown_variables,
)
from cdc_relay.database_url import has_password
from cdc_relay.errors import ConfigError, RelayError
from cdc_relay.exit_codes import ExitCode
from cdc_relay.logs import configure
from cdc_relay.settings_reference import PROPERTY_SETTING, markdown

__all__ = ["build_parser", "main", "run", "settings_from_args"]

log = logging.getLogger("cdc_relay.cli")
# At exit, how long to wait for closed Kafka producers to be destroyed (an unresponsive broker
# can hold one up), and never past a stop's shutdown timeout; then the process exits anyway.
PRODUCER_CLOSE_WAIT = 5.0
BUG_REPORT = f"a bug, not an operating condition: please report it at {ISSUES_URL}"


def settings_from_args(args: argparse.Namespace) -> Settings:
    overrides: dict[str, Any] = {
        name: getattr(args, name, None)
        for name in Settings.model_fields
        if name != PROPERTY_SETTING
    }
    if overrides.get("database_url") and has_password(overrides["database_url"]):
        _warn_secret_on_command_line(
            "--database-url with a password",
            f"{env_name('database_url_file')} or {env_name('database_url')}",
        )
    command = args.command or "run"
    dests = dict.fromkeys((property_dest(None), property_dest(args.command)))  # later win
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
        base = settings_for(command, overrides).kafka_producer_config
        overrides["kafka_producer_config"] = {**base, **props}
    return settings_for(command, overrides)


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


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    """The command line's entry point: ``cdc-relay`` (pyproject's script) and ``python -m
    cdc_relay`` (``prog`` says which, for the help)."""
    args = build_parser(prog).parse_args(argv)
    if args.command not in (None, "run"):
        gc.enable()  # paused while the modules loaded (__main__); run() tunes it
    if args.command in (None, "run", "sweep", "demo", "recover"):
        install_stack_dumps()
    try:
        return _command(args, prog)
    except Exception:
        # run() reports its own (in the log); this is any other command's bug.
        traceback.print_exc()
        print(f"cdc-relay: unexpected error, exiting: {BUG_REPORT}", file=sys.stderr)
        return ExitCode.BUG


def _command(args: argparse.Namespace, prog: str) -> int:
    if args.command == "settings":
        print(markdown() if args.markdown else settings_listing(prog), end="")
        return ExitCode.OK
    if args.command == "demo":
        from cdc_relay.commands.demo import main as demo_main  # noqa: PLC0415 - servers, Kafka: late

        return demo_main(args)
    try:
        settings = settings_from_args(args)
    except ConfigError as exc:
        print(f"cdc-relay: {exc}", file=sys.stderr)
        # A misspelt variable is often why a setting is missing or wrong: name it here too.
        for line in unknown_variables(configured_names()):
            print(f"cdc-relay: {line}", file=sys.stderr)
        return exc.exit_code
    configure(settings.log_level, settings.log_format.value)
    if args.command != "check":  # check reports them as a failed check of its own
        for line in unknown_variables(configured_names()):
            log.warning(line)
    if args.command == "status":
        from cdc_relay.commands.status import main as status_main  # noqa: PLC0415 - only for this command

        return status_main(settings, args.relay_host)
    if args.command in ("setup", "check", "sweep", "recover", "republish"):
        return maintenance(args, settings)
    return run(settings)


def maintenance(args: argparse.Namespace, settings: Settings) -> int:
    """The operator commands (:mod:`cdc_relay.commands`): setup, check, sweep, recover,
    republish."""
    # Imported late, as run() imports the relay: --help and --version stay fast.
    if args.command == "recover":
        from cdc_relay.commands.recover import recover  # noqa: PLC0415

        return recover(settings, args.wait)
    if args.command == "republish":
        from cdc_relay.commands.republish import main as republish  # noqa: PLC0415

        return republish(
            settings,
            since=args.since,
            until=args.until,
            aggregate_type=args.aggregate_type,
            aggregate_id=args.aggregate_id,
            topic=args.topic,
            dry_run=args.dry_run,
        )
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
        log.exception(f"unexpected error, exiting: {BUG_REPORT}")
        return ExitCode.BUG
    finally:
        wait = PRODUCER_CLOSE_WAIT
        if stop_due:
            wait = max(0.0, min(wait, stop_due[0] - time.monotonic()))
        _await_producers(wait)
    return ExitCode.OK


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
