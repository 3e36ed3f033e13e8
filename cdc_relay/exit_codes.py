"""Every exit code of every command, in one place: what it means and what to do about it.

The error classes (:mod:`cdc_relay.errors`) carry these codes, the commands return them, and
``--help``, ``docs/reference/exit-codes.md`` and the runbook are written from :data:`EXIT_CODES`.
A supervisor restarts the relay on any non-zero code; only 2, 3 and 4 need a person before a
restart can succeed.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from cdc_relay import ISSUES_URL


class ExitCode(IntEnum):
    OK = 0
    FAILED = 1
    CONFIGURATION = 2
    PREREQUISITE = 3
    POSITION = 4
    POISON = 5
    PROTOCOL = 6
    BUG = 70  # EX_SOFTWARE of sysexits.h
    INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process ended by Ctrl-C


@dataclass(frozen=True)
class Meaning:
    short: str  # a few words, for --help
    means: str
    action: str


EXIT_CODES: dict[ExitCode, Meaning] = {
    ExitCode.OK: Meaning(
        "done",
        "The command did what it was asked; the relay stopped cleanly (SIGTERM or SIGINT) after "
        "confirming what Kafka acknowledged.",
        "Nothing.",
    ),
    ExitCode.FAILED: Meaning(
        "failed",
        "A check failed (`check`), the slot does not exist (`status`), the database could not "
        "be reached (`setup`, `status`, `sweep`), the demo could not finish, or the relay met "
        "an error it does not retry.",
        "Read the lines it printed: each failed check says what to do.",
    ),
    ExitCode.CONFIGURATION: Meaning(
        "configuration",
        "A setting is missing or invalid, a flag is not one the command takes, or the database "
        "URL asks libpq for the impossible. One line names the setting, never its value.",
        "Fix the setting it names (`cdc-relay settings` lists them with their bounds); a "
        "restart without a fix fails the same way.",
    ),
    ExitCode.PREREQUISITE: Meaning(
        "database prerequisite",
        "PostgreSQL lacks something the relay needs: `wal_level`, a privilege, the outbox "
        "table or a column, a free replication slot, a role or database; or another process "
        "holds the slot; or the publication or the outbox table changed under the running "
        "relay (docs/operations/dba-changes.md).",
        "Run the statement the message gives, or `cdc-relay setup`; `cdc-relay check` lists "
        "every prerequisite at once.",
    ),
    ExitCode.POSITION: Meaning(
        "slot or position mismatch",
        "The replication slot and the relay's recorded position disagree in a way that can "
        "lose events: the slot was dropped, invalidated by the server (`max_slot_wal_keep_size`) "
        "or recreated, moved past the relay's record, or the record was written on another "
        "server; or a recovery of a lost slot has not ended.",
        "Read the message: it names the gap. A dropped or invalidated slot: `cdc-relay recover` "
        "publishes what never reached Kafka (or start with `CDC_RELAY_ON_SLOT_LOSS=recover`). "
        "Otherwise re-publish the events in the gap yourself, or accept it with "
        "`CDC_RELAY_ALLOW_SLOT_RESET=true` for one start.",
    ),
    ExitCode.POISON: Meaning(
        "poison record",
        "Kafka refused a record permanently (too large, an invalid topic, a denied topic) "
        "under `CDC_RELAY_POISON_POLICY=stop`.",
        "Fix the record or the topic the log line names, or let such records go to the "
        "dead-letter topic (`CDC_RELAY_POISON_POLICY=dead_letter`).",
    ),
    ExitCode.PROTOCOL: Meaning(
        "undecodable replication stream",
        "The server sent something the relay cannot interpret; stopping is the only safe choice.",
        f"Report it at {ISSUES_URL} with the log line and the PostgreSQL version and plugin.",
    ),
    ExitCode.BUG: Meaning(
        "a bug",
        "An unexpected error: a bug in cdc-relay, not an operating condition. The log has its "
        "traceback; a restart resumes from the confirmed position.",
        f"Report it at {ISSUES_URL} with the traceback.",
    ),
    ExitCode.INTERRUPTED: Meaning(
        "interrupted",
        "A second Ctrl-C cut the demo's shutdown short (the first one stops it cleanly); its "
        "throw-away services are stopped and deleted all the same.",
        "Nothing.",
    ),
}


def summary() -> str:
    """``0 done, 1 failed, 2 configuration, …`` for a help text."""
    return ", ".join(f"{int(code)} {meaning.short}" for code, meaning in EXIT_CODES.items())
