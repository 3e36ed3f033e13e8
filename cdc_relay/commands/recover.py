"""``cdc-relay recover``: recover a lost replication slot once (or adopt a table), then exit.

The relay's own start with ``CDC_RELAY_ON_SLOT_LOSS=recover`` (:mod:`cdc_relay.start.sequence`),
run by itself: the command competes for the leadership like a relay (a relay that leads keeps
it; this command waits up to ``--wait`` seconds), then runs the start's checks and the recovery
(:mod:`cdc_relay.recovery`), and releases the leadership: relays started afterwards stream from
the new slot. Stopped (SIGTERM, Ctrl-C), it ends cleanly; run again, it resumes without sending
anything twice. On a terminal it shows a progress bar; elsewhere, the log lines.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from types import FrameType

from cdc_relay.checkpoint import PostgresCheckpointStore
from cdc_relay.commands.output import LINE_LIMIT, print_line, printable
from cdc_relay.config import OnSlotLoss, Settings
from cdc_relay.errors import RelayError
from cdc_relay.exit_codes import ExitCode
from cdc_relay.leadership import Leadership
from cdc_relay.lsn import format_lsn
from cdc_relay.observability.stats import RelayStats
from cdc_relay.recovery.loss import in_progress, slot_loss
from cdc_relay.recovery.run import RecoveryStopped
from cdc_relay.replication.source import connect, slot_state
from cdc_relay.start.adapters import PostgresStart
from cdc_relay.start.sequence import StartSequence
from cdc_relay.waits import WaitWatch

BAR_WIDTH = 30
BAR_INTERVAL = 0.5


def recover(settings: Settings, wait: float) -> int:
    """Recover the slot if it is lost (or a recovery is unfinished); the exit code."""
    settings = settings.model_copy(update={"on_slot_loss": OnSlotLoss.RECOVER})
    try:
        needed = _needed(settings)
    except RelayError as exc:
        print(printable(f"cdc-relay: {exc}", LINE_LIMIT), file=sys.stderr)
        return exc.exit_code
    if needed is not None:
        print_line(needed)
        return ExitCode.OK
    stop = threading.Event()

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    stats = RelayStats()
    waits = WaitWatch(settings.source_url(), stop.is_set)
    leadership = Leadership(settings, waits)
    leadership.start()
    bar = _Bar(stats) if sys.stderr.isatty() else None
    try:
        if not _lead(leadership, wait, stop):
            print_line(
                f"another relay leads slot {settings.slot_name} (lease holder "
                f"{leadership.leader_seen}): it recovers by itself with "
                "CDC_RELAY_ON_SLOT_LOSS=recover; else stop it and run this again"
            )
            return ExitCode.FAILED
        start = StartSequence(
            settings,
            stats,
            leadership,
            connect=lambda: PostgresStart(settings, leadership, waits, stats),
            read_back=lambda *_: None,
            stopping=stop.is_set,
            sleep=stop.wait,
        )
        if bar is not None:
            bar.start()
        position = start.prepared()
    except RecoveryStopped:
        _done(bar)
        print_line("stopped before the end: run cdc-relay recover again to finish (nothing is "
                   "sent twice)")  # fmt: skip
        return ExitCode.FAILED
    except RelayError as exc:
        _done(bar)
        print(printable(f"cdc-relay: {exc}", LINE_LIMIT), file=sys.stderr)
        return exc.exit_code
    finally:
        leadership.release()
        waits.close()
    _done(bar)
    summary = stats.recovery or {}
    print_line(
        f"recovered slot {settings.slot_name}: {summary.get('published', 0)} row(s) published, "
        f"{summary.get('dead_lettered', 0)} dead-lettered, {summary.get('in_kafka', 0)} found in "
        f"Kafka already, of {summary.get('rows', 0)} not provably published, in "
        f"{summary.get('seconds', 0)} s; relays stream from {format_lsn(position)}"
    )
    return ExitCode.OK


def _needed(settings: Settings) -> str | None:
    """Why there is nothing to recover (None: there is)."""
    with connect(settings.source_url()) as conn:
        store = PostgresCheckpointStore(conn, settings.state_schema, settings.slot_name)
        store.ensure_table()
        record = store.load_record()
        slot = slot_state(conn, settings.slot_name)
    recorded = record.stamp.position if record.stamp is not None else None
    if slot_loss(slot, recorded) is not None or in_progress(record.recovery) is not None:
        return None
    if recorded is None and slot is None and settings.adopt_condition is not None:
        return None  # a first start that adopts the table
    name = settings.slot_name
    if recorded is None or slot is None:
        return f"nothing to recover: the relay has not recorded a position for slot {name}"
    return f"nothing to recover: slot {name} is usable (wal_status {slot.wal_status})"


def _lead(leadership: Leadership, wait: float, stop: threading.Event) -> bool:
    deadline = time.monotonic() + wait
    while not stop.is_set():
        if leadership.became_leader.wait(0.2) and leadership.leading:
            return True
        if time.monotonic() >= deadline:
            return False
    return False


class _Bar:
    """A progress line on stderr (a terminal), redrawn every :data:`BAR_INTERVAL` seconds."""

    def __init__(self, stats: RelayStats) -> None:
        self._stats = stats
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cdc-relay-progress", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(BAR_INTERVAL):
            self._draw()

    def _draw(self) -> None:
        shown = self._stats.recovery
        if not shown:
            return
        rows = int(str(shown.get("rows", 0)))
        done = int(str(shown.get("done", 0)))
        seconds = float(str(shown.get("seconds", 0.0)))
        share = done / rows if rows else 1.0
        filled = round(BAR_WIDTH * share)
        rate = done / seconds if seconds > 0 else 0.0
        sys.stderr.write(
            f"\rrecovering [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {done:,}/{rows:,} rows "
            f"({share:.0%}), {rate:,.0f} rows/s, {seconds:.0f} s "
        )
        sys.stderr.flush()

    def finish(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._draw()
        sys.stderr.write("\n")


def _done(bar: _Bar | None) -> None:
    if bar is not None:
        bar.finish()
