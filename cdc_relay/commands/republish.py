"""``cdc-relay republish``: publish retained outbox rows again, for a consumer that lost its topic.

The replay itself is :mod:`cdc_relay.recovery.replay`'s; this module reads the flags, wires
SIGTERM / Ctrl-C (a stop ends it after the record in hand; what was sent stays sent) and prints
what was sent. Exit 0 when every selected row was sent and acknowledged, 1 when some were not
(each named, up to ten).
"""

from __future__ import annotations

import signal
import sys
import threading
from datetime import UTC, datetime
from types import FrameType

from cdc_relay.commands.output import LINE_LIMIT, print_line, printable
from cdc_relay.config import Settings
from cdc_relay.errors import ConfigError, RelayError
from cdc_relay.exit_codes import ExitCode
from cdc_relay.recovery.replay import Selection, republish


def parse_time(text: str | None) -> datetime | None:
    """An ISO 8601 time; one without a zone is UTC."""
    if text is None:
        return None
    try:
        found = datetime.fromisoformat(text)
    except ValueError:
        raise ConfigError(f"{text[:60]!r} is not an ISO 8601 time (2026-11-28T13:00:00Z)") from None
    return found if found.tzinfo is not None else found.replace(tzinfo=UTC)


def main(
    settings: Settings,
    *,
    since: str | None,
    until: str | None,
    aggregate_type: str | None,
    aggregate_id: str | None,
    topic: str | None,
    dry_run: bool,
) -> int:
    stop = threading.Event()

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        selection = Selection(
            parse_time(since), parse_time(until), aggregate_type, aggregate_id, topic
        )
        replayed = republish(settings, selection, dry_run=dry_run, stopping=stop.is_set)
    except RelayError as exc:
        print(printable(f"cdc-relay: {exc}", LINE_LIMIT), file=sys.stderr)
        return exc.exit_code
    if dry_run:
        print_line(f"{replayed.rows} retained row(s) selected; nothing sent (--dry-run)")
        return ExitCode.OK
    where = f"to {topic}" if topic else "to their own topics"
    print_line(
        f"republished {replayed.acknowledged} of {replayed.rows} retained row(s) {where}, each "
        f"with header cdc_relay.replay={replayed.replay}, in {replayed.seconds} s"
    )
    for failure in replayed.failures:
        print_line(f"not sent: {failure}")
    if replayed.failed > len(replayed.failures):
        print_line(f"not sent: {replayed.failed - len(replayed.failures)} more")
    if stop.is_set():
        print_line("stopped before the end: what was sent stays sent")
    complete = replayed.acknowledged == replayed.rows and not stop.is_set()
    return ExitCode.OK if complete else ExitCode.FAILED
