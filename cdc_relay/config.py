"""Settings: environment (``CDC_RELAY_*``), a ``.env`` file, then CLI flags, validated at start-up.

Every setting is a field of :class:`Settings`; the CLI builds its flags from these fields, so a new
setting needs no CLI change. Validation errors are reduced to one line per setting that names the
environment variable and never echoes the offending value (it may be a secret).
"""

from __future__ import annotations

import logging
import os
import re
import stat
import string
from collections.abc import Iterable
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import orjson
from psycopg import sql
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError

from cdc_relay import database_url
from cdc_relay.bounds import DAY, HOUR, Bounds, seconds
from cdc_relay.column_transform import ColumnTransform, compile_transform
from cdc_relay.connection_defaults import source_url
from cdc_relay.database_url import redact_url
from cdc_relay.errors import ConfigError
from cdc_relay.patterns import compile_pattern
from cdc_relay.reserved_headers import reserved as reserved_header
from cdc_relay.row_filter import Condition, ConditionError
from cdc_relay.row_filter import parse as parse_condition

# Where the throwaway producer of check_producer_config logs (about having no brokers): nowhere.
_SILENT_LOGGER = logging.getLogger("cdc_relay.config.producer_check")
_SILENT_LOGGER.addHandler(logging.NullHandler())
_SILENT_LOGGER.propagate = False

ENV_PREFIX = "CDC_RELAY_"

TOPIC_TEMPLATE_FIELDS = frozenset({"aggregate_type", "event_type", "table", "schema"})

# librdkafka properties whose values are credentials; any key containing these fragments is masked.
_SECRET_KEY_FRAGMENTS = ("password", "secret", "jaas", "oauthbearer.config", ".pem", "token")

# Used with .match(); \Z rather than $, which also matches before a trailing newline.
_LEGAL_TOPIC = re.compile(r"[a-zA-Z0-9._-]{1,249}\Z")


def legal_topic(name: str) -> bool:
    """Kafka's rule for topic names: 1-249 of ``[a-zA-Z0-9._-]``, and not ``.`` or ``..``."""
    return bool(_LEGAL_TOPIC.match(name)) and name not in (".", "..")


_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_$]{0,62}$")
_LOWER_IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_$]*$")  # needs no quotes in SQL (keywords aside)
_SLOT_NAME = re.compile(r"^[a-z0-9_]{1,63}$")

# Producer properties the relay's guarantees rest on; a user cannot override them.
_ENFORCED_PRODUCER_PROPERTIES = {"enable.idempotence": "true", "acks": "all"}

# The most a settings file (a *_FILE setting's, .env) may hold: a URL or a properties file is a
# few hundred bytes; more is the wrong file (or a device that never ends).
SETTING_FILE_MAX_BYTES = 64 * 1024


SWEEP_WAIT_BOUNDS = seconds(0.0, DAY)  # sweep --once --wait


class PoisonPolicy(StrEnum):
    """What happens to a record Kafka refuses permanently."""

    DEAD_LETTER = "dead_letter"
    STOP = "stop"


class Plugin(StrEnum):
    """The logical decoding output plugin of the slot."""

    PGOUTPUT = "pgoutput"
    WAL2JSON = "wal2json"


class MissingTopics(StrEnum):
    """What to do with a topic that does not exist yet."""

    CREATE = "create"  # with CDC_RELAY_TOPIC_PARTITIONS / _REPLICATION_FACTOR
    FAIL = "fail"  # the record is refused (dead-letter or stop) with an error naming the topic


class OnSlotLoss(StrEnum):
    """What a start does when the slot was dropped or invalidated after the relay used it."""

    REFUSE = "refuse"  # exit 4, naming `cdc-relay recover`
    RECOVER = "recover"  # the leader recovers: a new slot, every unpublished row published


class SlotFailover(StrEnum):
    """Whether the relay's slot is a failover slot (PostgreSQL 17+: synchronised to standbys)."""

    AUTO = "auto"  # where the server supports it
    TRUE = "true"  # required: the relay refuses to start on PostgreSQL < 17
    FALSE = "false"  # never asked for


class LogFormat(StrEnum):
    PLAIN = "plain"
    JSON = "json"


def qualify_table(value: str) -> str:
    """``outbox`` -> ``public.outbox``; both parts must be plain identifiers.

    Names are taken literally, as the catalog spells them (no case folding): ``public.Outbox`` is
    the table created as ``"Outbox"``; ``public.OUTBOX`` is not ``public.outbox``.
    """
    parts = value.split(".")
    if len(parts) == 1:
        parts = ["public", *parts]
    if len(parts) != 2 or not all(_IDENTIFIER.match(p) for p in parts):
        raise ValueError("expected schema.table made of plain identifiers")
    return ".".join(parts)


def sql_name(*parts: str) -> str:
    """A (qualified) name as SQL text for messages that suggest a statement: quoted where needed
    (``public."Outbox"``). Statements the relay runs use :class:`psycopg.sql.Identifier`."""
    return ".".join(
        part if _LOWER_IDENTIFIER.match(part) else sql.Identifier(part).as_string(None)
        for part in parts
    )


class ValueShape(StrEnum):
    """What a record's value is (``CDC_RELAY_OUTBOX_COLUMNS`` ``value``)."""

    PAYLOAD = "payload"  # the payload column, as it is
    ROW = "row"  # the whole row as a JSON object of its columns
    ENVELOPE = "envelope"  # {"payload": ..., plus the columns placed in the envelope}


class Placement(StrEnum):
    HEADER = "header"
    ENVELOPE = "envelope"


class ColumnExpression(BaseModel):
    """A column's value rewritten by a regular expression (see :mod:`cdc_relay.column_transform`):
    ``{"column": "stream_name", "regex": "([^:]+)::([^-]+)-(.*)", "replacement": "$1.$2"}``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    column: str
    regex: str
    replacement: str

    @field_validator("column")
    @classmethod
    def _column(cls, value: str) -> str:
        if not _IDENTIFIER.match(value):
            raise ValueError(f"{value!r} is not a plain column name")
        return value

    @model_validator(mode="after")
    def _compiles(self) -> ColumnExpression:
        self.compile()  # TransformError is a ValueError: pydantic reports it
        return self

    def compile(self) -> ColumnTransform:
        return compile_transform(self.regex, self.replacement)


class OutboxColumns(BaseModel):
    """Column names of an outbox table and how a row becomes a record; the defaults are
    ``sql/001_outbox.sql``'s and the plain mapping (value = payload).

    Debezium's default outbox table works with ``{"aggregate_type": "aggregatetype",
    "aggregate_id": "aggregateid", "event_type": "type"}``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = "id"
    aggregate_type: str | None = "aggregate_type"  # None: none (the topic must not need it)
    aggregate_id: str | None = "aggregate_id"  # None: the key comes from key or key_from
    event_type: str = "event_type"
    payload: str = "payload"
    headers: str | None = "headers"  # a jsonb object whose entries become headers
    topic: str | None = None  # a per-row topic, used instead of the template when not NULL
    key: str | None = None  # a per-row Kafka key, instead of the aggregate id
    header_columns: tuple[str, ...] = ()  # further columns sent as headers named after them
    created_at: str | None = "created_at"  # what sweep retention measures; None: no retention
    # The general mapper's options (cdc_relay.shaped_mapping); unset, the plain mapping runs.
    topic_from: ColumnExpression | None = None  # topic = a transform of a column (not with topic)
    key_from: ColumnExpression | None = None  # key = a transform of a column (not with key)
    value: ValueShape = ValueShape.PAYLOAD
    additional_placement: tuple[str, ...] = ()  # "column:header[:alias]", "column:envelope[:alias]"
    expand_json_payload: bool = False  # a text/bytea payload embedded as JSON in row/envelope
    tombstone_on_empty_payload: bool = False  # NULL or empty payload: a null value, not a refusal
    # The columns the sweeper deletes rows by (a unique key, not the event id): empty, the
    # table's primary key (or, lacking one, the id column when it is unique on its own).
    row_key: tuple[str, ...] = ()

    @field_validator(
        "id",
        "aggregate_type",
        "aggregate_id",
        "event_type",
        "payload",
        "headers",
        "topic",
        "key",
        "created_at",
    )
    @classmethod
    def _column(cls, value: str | None) -> str | None:
        if value is not None and not _IDENTIFIER.match(value):
            raise ValueError(f"{value!r} is not a plain column name")
        return value

    @field_validator("additional_placement")
    @classmethod
    def _placements(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for entry in value:
            parse_placement(entry)
        return value

    @model_validator(mode="after")
    def _consistent(self) -> OutboxColumns:
        if self.topic is not None and self.topic_from is not None:
            raise ValueError("set topic (a column) or topic_from (an expression), not both")
        if self.key is not None and self.key_from is not None:
            raise ValueError("set key (a column) or key_from (an expression), not both")
        if self.aggregate_id is None and self.key is None and self.key_from is None:
            raise ValueError("without aggregate_id, the key needs key or key_from")
        envelope = [p for p in self.placements if p[1] is Placement.ENVELOPE]
        if envelope and self.value is not ValueShape.ENVELOPE:
            raise ValueError('additional_placement to the envelope needs "value": "envelope"')
        names = [alias for _, _, alias in envelope]
        if "payload" in names or len(set(names)) != len(names):
            raise ValueError("envelope fields must be distinct and not named payload")
        headers = [alias for _, place, alias in self.placements if place is Placement.HEADER]
        for name in (*self.header_columns, *headers):
            if reserved_header(name):
                raise ValueError(
                    f"header {name!r} (header_columns, additional_placement) is a name the relay "
                    "sets itself (id, event_type, aggregate_type, cdc_relay.*, in any case): "
                    "place it under an alias"
                )
        return self

    @field_validator("row_key")
    @classmethod
    def _row_key(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for column in value:
            if not _IDENTIFIER.match(column):
                raise ValueError(f"{column!r} is not a plain column name")
        if len(set(value)) != len(value) or len(value) > 32:
            raise ValueError("row_key: at most 32 distinct column names")
        return value

    @property
    def required(self) -> tuple[str, ...]:
        """Columns every row needs (non-NULL); an unset optional one is left out."""
        return tuple(
            c
            for c in (
                self.id,
                self.aggregate_type,
                self.aggregate_id,
                self.event_type,
                self.payload,
            )
            if c is not None
        )

    @property
    def mapped(self) -> tuple[str, ...]:
        """Every column the mapping reads, which the table must have."""
        wanted = [*self.required, *self.header_columns]
        wanted += [c for c in (self.topic, self.key) if c is not None]
        wanted += [e.column for e in (self.topic_from, self.key_from) if e is not None]
        wanted += [column for column, _, _ in self.placements]
        return tuple(dict.fromkeys(wanted))

    @property
    def placements(self) -> tuple[tuple[str, Placement, str], ...]:
        """additional_placement as (column, placement, name in the header or envelope)."""
        return tuple(parse_placement(entry) for entry in self.additional_placement)

    def plain(self) -> bool:
        """Whether the plain (fast) mapping covers these columns."""
        return (
            self.aggregate_type is not None
            and self.aggregate_id is not None
            and self.topic_from is None
            and self.key_from is None
            and self.value is ValueShape.PAYLOAD
            and not self.additional_placement
            and not self.expand_json_payload
            and not self.tombstone_on_empty_payload
        )


def parse_placement(entry: str) -> tuple[str, Placement, str]:
    """Debezium's ``column:header[:alias]`` / ``column:envelope[:alias]``."""
    parts = entry.split(":")
    if len(parts) not in (2, 3) or not _IDENTIFIER.match(parts[0]):
        raise ValueError(f"{entry!r} is not column:header[:alias] or column:envelope[:alias]")
    try:
        place = Placement(parts[1])
    except ValueError:
        raise ValueError(f"{entry!r}: the placement is header or envelope") from None
    alias = parts[2] if len(parts) == 3 else parts[0]
    if not alias or "\x00" in alias:
        raise ValueError(f"{entry!r}: the alias is empty")
    return parts[0], place, alias


def needs_aggregate_type(template: str) -> bool:
    """Whether a topic template uses the aggregate type."""
    return any(name == "aggregate_type" for _, name, _, _ in string.Formatter().parse(template))


class OutboxTable(BaseModel):
    """One outbox table: its name, its columns, and optionally its own topic template."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    table: str
    columns: OutboxColumns = OutboxColumns()
    topic_template: str | None = None
    row_filter: str | None = None  # only rows matching it are relayed (cdc_relay.row_filter)
    sweep_condition: str | None = None  # a published row is deleted only if it also matches

    @field_validator("row_filter", "sweep_condition")
    @classmethod
    def _condition(cls, value: str | None) -> str | None:
        return None if value is None else check_condition(value)

    @property
    def filter(self) -> Condition | None:
        """The parsed row filter (validated when the settings were read)."""
        return None if self.row_filter is None else parse_condition(self.row_filter)

    @property
    def sweep_filter(self) -> Condition | None:
        """The parsed sweeper condition."""
        return None if self.sweep_condition is None else parse_condition(self.sweep_condition)

    @field_validator("table")
    @classmethod
    def _table(cls, value: str) -> str:
        return qualify_table(value)

    @field_validator("topic_template")
    @classmethod
    def _template(cls, value: str | None) -> str | None:
        return None if value is None else check_topic_template(value)

    @property
    def schema_and_name(self) -> tuple[str, str]:
        schema, name = self.table.split(".")
        return schema, name

    @property
    def sql_name(self) -> str:
        """The name as SQL text, for messages that suggest a statement."""
        return sql_name(*self.schema_and_name)


def check_condition(value: str) -> str:
    try:
        parse_condition(value)
    except ConditionError as exc:
        raise ValueError(f"not a condition of the documented grammar: {exc}") from None
    return value


def check_topic_template(value: str) -> str:
    fields = {name for _, name, _, _ in string.Formatter().parse(value) if name is not None}
    unknown = fields - TOPIC_TEMPLATE_FIELDS
    if unknown:
        raise ValueError(
            f"unknown field(s) {sorted(unknown)}; allowed: {sorted(TOPIC_TEMPLATE_FIELDS)}"
        )
    return value


# -- the rules of settings, each registered on Settings below (its validators); a rule over one
# setting takes its value, a rule across settings takes the Settings.


def _optional_condition(value: str | None) -> str | None:
    return None if value is None else check_condition(value)


def _check_time_zone(value: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_+\-/:.]{1,64}", value):
        raise ValueError("a time zone name such as UTC or Europe/Berlin")
    return value


def _check_allowlist(value: str | None) -> str | None:
    if value is not None:
        compile_pattern(value, capture=False)  # PatternError (a ValueError) says why not
    return value


def _read_secret_files(data: Any) -> Any:
    """``*_FILE`` settings: read the files; the database URL comes from one place only."""
    if not isinstance(data, dict):
        return data
    data = dict(data)
    url_file = data.get("database_url_file")
    if url_file:
        if data.get("database_url"):
            raise ConfigError(
                f"invalid configuration: {env_name('database_url_file')}: set either it or "
                f"{env_name('database_url')}, not both"
            )
        data["database_url"] = read_secret_file("database_url_file", url_file).strip()
    props_file = data.get("kafka_producer_config_file")
    if props_file:
        from_file = parse_properties(read_secret_file("kafka_producer_config_file", props_file))
        given = data.get("kafka_producer_config") or {}
        if isinstance(given, str):
            given = _json_object("kafka_producer_config", given)
        if isinstance(given, dict):
            data["kafka_producer_config"] = {**from_file, **given}
    return data


def _check_database_url(value: SecretStr) -> SecretStr:
    database_url.parse(value.get_secret_value())  # InvalidDatabaseUrl never quotes it
    return value


def _check_dead_letter_topic(value: str) -> str:
    if not legal_topic(value):
        raise ValueError("Kafka allows 1-249 of [a-zA-Z0-9._-], not . or ..")
    return value


def _check_host(value: str) -> str:
    if not value or re.search(r"[\s/@]", value):
        raise ValueError("an IP address or host name")
    return value


def _check_prefix(value: str) -> str:
    if not value or re.search(r"[,\s]", value):
        raise ValueError("a non-empty prefix without commas or whitespace")
    return value


def _check_slot(value: str) -> str:
    if not _SLOT_NAME.match(value):
        raise ValueError("lower-case letters, digits and underscores, at most 63")
    return value


def _check_identifier(value: str) -> str:
    if not _IDENTIFIER.match(value):
        raise ValueError("expected a plain identifier")
    return value


def _check_level(value: str) -> str:
    level = value.upper()
    if level not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
        raise ValueError("one of DEBUG, INFO, WARNING, ERROR")
    return level


def _producer_properties(value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    # JSON numbers and booleans are accepted; librdkafka takes every value as a string.
    props = {str(k): str(v).lower() if isinstance(v, bool) else str(v) for k, v in value.items()}
    for key, forced in _ENFORCED_PRODUCER_PROPERTIES.items():
        if key in props and props[key].lower() != forced:
            raise ValueError(f"{key} must stay {forced}: ordering and no-loss depend on it")
    if "transactional.id" in props:
        raise ValueError(
            "transactional.id is the relay's own: with CDC_RELAY_EXACTLY_ONCE it is derived from "
            "the database and the slot, shared by every relay of the slot (README: Exactly once)"
        )
    return props


# librdkafka's default transaction.timeout.ms; the relay's Kafka transactions use it unless set.
DEFAULT_TRANSACTION_TIMEOUT_MS = "60000"


def _record_times_out_in_its_transaction(settings: Settings) -> Settings:
    if not settings.exactly_once:
        return settings
    props = settings.kafka_producer_config
    transaction = props.get("transaction.timeout.ms", DEFAULT_TRANSACTION_TIMEOUT_MS).strip()
    message = props.get("message.timeout.ms", "").strip()
    if message.isdigit() and transaction.isdigit() and not 0 < int(message) <= int(transaction):
        raise ValueError(
            f"with {env_name('exactly_once')}, message.timeout.ms ({message}) must be 1.."
            f"transaction.timeout.ms ({transaction}) in {env_name('kafka_producer_config')}: a "
            "record Kafka does not take must fail inside its transaction, which is then aborted "
            "and sent again"
        )
    return settings


def _lease_outlasts_renewals(settings: Settings) -> Settings:
    if settings.leader_lease_timeout < 2 * settings.leader_renew_interval:
        raise ValueError(
            f"{env_name('leader_lease_timeout')} must be at least twice "
            f"{env_name('leader_renew_interval')}: one late renewal must not lose the lease"
        )
    return settings


def _topics_have_their_columns(settings: Settings) -> Settings:
    for table in settings.tables():
        columns = table.columns
        template = table.topic_template or settings.topic_template
        if (
            columns.aggregate_type is None
            and columns.topic_from is None
            and needs_aggregate_type(template)
        ):
            field = "outbox_tables" if settings.outbox_tables else "outbox_columns"
            raise ValueError(
                f"{env_name(field)}: {table.table} has no aggregate_type column, but its topic "
                "template uses {aggregate_type}: set topic_from or a template without it"
            )
    return settings


def _retention_has_its_column(settings: Settings) -> Settings:
    if settings.sweep_retention_seconds > 0:
        lacking = [t.table for t in settings.tables() if t.columns.created_at is None]
        if lacking:
            raise ValueError(
                f"{env_name('sweep_retention_seconds')}: retention needs a creation-time "
                f"column, and {', '.join(lacking)} has none (set "
                f'"created_at" in {env_name("outbox_columns")} / '
                f"{env_name('outbox_tables')}, or set the retention to 0)"
            )
    return settings


def _conditions_set_per_table(settings: Settings) -> Settings:
    if settings.outbox_tables and (settings.outbox_row_filter or settings.sweep_condition):
        raise ValueError(
            f"{env_name('outbox_row_filter')} and {env_name('sweep_condition')} apply to "
            f'{env_name("outbox_table")}: with {env_name("outbox_tables")} set "row_filter" '
            'and "sweep_condition" per table'
        )
    return settings


class Settings(BaseSettings):
    """All of cdc-relay's settings. A field's description, default and bounds are what
    ``cdc-relay settings`` and the configuration reference say
    (:mod:`cdc_relay.settings_reference`); its part of the relay is in :data:`SETTING_PARTS`."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_file=".env",
        env_file_encoding="utf-8",
        extra="ignore",
        frozen=True,
        allow_inf_nan=False,  # an "inf" interval would mean "never" (e.g. never confirm)
    )

    database_url: SecretStr = Field(
        description="libpq URI or key=value string of the source database."
    )
    database_url_file: Path | None = Field(
        None,
        description=(
            "A file holding the database URL (Docker/Kubernetes secrets), instead of "
            "CDC_RELAY_DATABASE_URL."
        ),
    )
    kafka_bootstrap_servers: str | None = Field(
        None,
        min_length=1,
        description="Kafka bootstrap servers, host:port[,host:port]; run and check need them.",
    )
    outbox_table: str = Field("public.outbox", description="Outbox table, schema-qualified.")
    outbox_columns: OutboxColumns = Field(
        default_factory=OutboxColumns,
        description=(
            'Column names of the outbox table as JSON, e.g. {"aggregate_type": "aggregatetype"}; '
            "also topic, key, header_columns, the mapping options topic_from, key_from, value, "
            "additional_placement, expand_json_payload, tombstone_on_empty_payload (docs: "
            "Adopting an existing outbox), and row_key, the unique columns the sweeper deletes "
            "by (default: the primary key)."
        ),
    )
    outbox_tables: tuple[OutboxTable, ...] = Field(
        (),
        description=(
            'Several outbox tables as a JSON list of {"table", "columns", "topic_template", '
            '"row_filter", "sweep_condition"}; replaces CDC_RELAY_OUTBOX_TABLE/COLUMNS/ROW_FILTER '
            "and CDC_RELAY_SWEEP_CONDITION when set."
        ),
    )
    outbox_row_filter: str | None = Field(
        None,
        description=(
            "Relay only outbox rows matching this condition, e.g. target_broker = 'kafka' "
            "(terms column = 'x', column <> 'x', column [NOT] IN ('x', 'y'), column IS [NOT] "
            "NULL, joined by AND; text/varchar columns). Set as the publication's row filter "
            "(PostgreSQL 15+) and checked by the relay; the sweeper deletes matching rows only."
        ),
    )
    messages: bool = Field(
        False,
        description=(
            "Relay table-less events: transactional logical messages (pg_logical_emit_message) "
            "with CDC_RELAY_MESSAGE_PREFIX. Off: none is asked for, any that arrives is dropped. "
            "On: the relay refuses to start while PUBLIC may emit messages (setup revokes that)."
        ),
    )
    message_prefix: str = Field(
        "outbox",
        description="Prefix of transactional logical messages (pg_logical_emit_message) to relay.",
    )
    slot_name: str = Field("cdc_relay", description="Logical replication slot name.")
    publication_name: str = Field(
        "cdc_relay_outbox",
        description="Publication of the outbox tables (inserts only), created if missing.",
    )
    plugin: Plugin = Field(
        Plugin.PGOUTPUT,
        description="Output plugin: pgoutput (built in, binary) or wal2json (format-version 2).",
    )
    topic_template: str = Field(
        "outbox.event.{aggregate_type}",
        description="Topic per event; fields {aggregate_type} {event_type} {table} {schema}.",
    )
    kafka_producer_config: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Extra librdkafka producer properties as a JSON object, e.g. "
            '{"linger.ms": "5", "security.protocol": "SASL_SSL"}. '
            "CLI: --kafka-property KEY=VALUE, repeatable (not for secrets: ps shows them)."
        ),
    )
    kafka_producer_config_file: Path | None = Field(
        None,
        description=(
            "A file of librdkafka producer properties (key=value lines, or a JSON object), e.g. "
            "SASL credentials from a secret; CDC_RELAY_KAFKA_PRODUCER_CONFIG and flags win."
        ),
    )
    poison_policy: PoisonPolicy = Field(
        PoisonPolicy.DEAD_LETTER,
        description="A record Kafka refuses permanently: dead_letter (to the DLQ topic) or stop.",
    )
    dead_letter_topic: str = Field("cdc_relay.dead_letter", description="Dead-letter topic.")
    state_schema: str = Field(
        "cdc_relay", description="Schema of the relay-owned table that records the position."
    )
    allow_slot_reset: bool = Field(
        False,
        description=(
            "Start even when the slot is missing or ahead of the relay's recorded position "
            "(accepts that events in the gap are not relayed)."
        ),
    )
    on_slot_loss: OnSlotLoss = Field(
        OnSlotLoss.REFUSE,
        description=(
            "The slot was dropped or invalidated (max_slot_wal_keep_size) after the relay used "
            "it: refuse to start (exit 4, naming cdc-relay recover), or recover at the start: a "
            "new slot, and every outbox row the relay has not provably published is published, "
            "in commit order, none twice."
        ),
    )
    adopt_condition: str | None = Field(
        None,
        description=(
            "At the first start (no recorded position): publish the outbox rows already in the "
            "table that match this condition, e.g. published_at IS NULL, before streaming — "
            "adopting a table a polling publisher used (stop it first). The row filter's "
            "grammar; the row filter applies too."
        ),
    )
    slot_failover: SlotFailover = Field(
        SlotFailover.AUTO,
        description=(
            "Make the slot a failover slot, synchronised to standbys (sync_replication_slots) so "
            "that the relay follows a promotion: auto (on PostgreSQL 17+), true (refuse to start "
            "on older servers) or false."
        ),
    )
    confirm_interval: Annotated[float, seconds(0.0, HOUR, above_low=True)] = Field(
        1.0, description="Seconds between confirmations of the acknowledged position."
    )
    idle_confirm_interval: Annotated[float, seconds(0.0, HOUR, above_low=True)] = Field(
        10.0,
        description=(
            "Seconds between confirmations that only follow the WAL (other tables' writes, no "
            "events)."
        ),
    )
    exactly_once: bool = Field(
        False,
        description=(
            "Publish inside Kafka transactions fenced by the slot: consumers reading with "
            "isolation.level=read_committed see each event once, even after a paused leader "
            "wakes. Needs a broker that allows transactions (docs: Exactly once)."
        ),
    )
    transaction_interval: Annotated[float, seconds(0.001, 60.0)] = Field(
        0.05,
        description=(
            "With CDC_RELAY_EXACTLY_ONCE: seconds a Kafka transaction stays open at most; it "
            "commits at the first PostgreSQL transaction boundary after that."
        ),
    )
    transaction_max_events: Annotated[int, Bounds(1, 1_000_000)] = Field(
        10_000,
        description=(
            "With CDC_RELAY_EXACTLY_ONCE: events in one Kafka transaction at most; it commits at "
            "the first PostgreSQL transaction boundary after that."
        ),
    )
    reconcile: bool = Field(
        True,
        description=(
            "At each start, read back from Kafka the records an earlier run delivered after the "
            "recorded position, and do not publish those events again (no duplicates after a "
            "crash or restart). false: re-publish the unconfirmed tail (at-least-once)."
        ),
    )
    reconcile_timeout: Annotated[float, seconds(0.1, HOUR)] = Field(
        10.0,
        description=(
            "Seconds the start-up read-back may take; not finished in time, it skips nothing."
        ),
    )
    read_coalesce_ms: Annotated[float, Bounds(0.0, 1000.0, unit="milliseconds")] = Field(
        2.0,
        description=(
            "After a wake-up that brought data, milliseconds to let more arrive before reading "
            "again: fewer wake-ups (CPU) for at most this much added latency. 0 reads at once."
        ),
    )
    shutdown_timeout: Annotated[float, seconds(0.0, HOUR)] = Field(
        30.0, description="Seconds to wait for in-flight deliveries on shutdown."
    )
    delivery_stall_timeout: Annotated[float, seconds(1.0, DAY)] = Field(
        60.0,
        description="Seconds without any delivery progress before the producer is rebuilt.",
    )
    reconnect_max_backoff: Annotated[float, seconds(0.01, HOUR)] = Field(
        30.0, description="Upper bound of the reconnect backoff, seconds."
    )
    leader_lease_timeout: Annotated[float, seconds(1.0, HOUR)] = Field(
        15.0,
        description=(
            "Seconds a leader's lease lasts without renewal: a standby takes over from a hung "
            "leader (stopped, or cut off with its connections open) this long after its last "
            "renewal. At least twice the renew interval."
        ),
    )
    leader_renew_interval: Annotated[float, seconds(0.01, HOUR / 2)] = Field(
        2.0, description="Seconds between the leader's renewals of its lease."
    )
    producer_queue_max_messages: Annotated[int, Bounds(1)] = Field(
        20_000, description="Records in flight to Kafka before reading pauses."
    )
    producer_queue_max_kbytes: Annotated[int, Bounds(1)] = Field(
        65_536, description="Kilobytes buffered in the producer before reading pauses."
    )
    missing_topics: MissingTopics = Field(
        MissingTopics.CREATE,
        description="A topic that does not exist: create it, or fail (never a broker auto-create).",
    )
    topic_partitions: Annotated[int, Bounds(1)] = Field(
        3, description="Partitions of topics the relay creates."
    )
    topic_replication_factor: Annotated[
        int, Bounds(1, special=-1, special_means="the broker's default")
    ] = Field(-1, description="Replication factor of topics the relay creates; -1: broker default.")
    sweep_interval: Annotated[float, seconds(0.01, DAY, special=0)] = Field(
        5.0,
        description=(
            "Seconds between the starts of sweeps of published outbox rows (a sweep spreads its "
            "statements over 60 % of it); 0 disables."
        ),
    )
    sweep_batch_size: Annotated[int, Bounds(1)] = Field(
        1000, description="Rows deleted per sweep transaction."
    )
    # Ten years and then some.
    sweep_retention_seconds: Annotated[float, seconds(0.0, 3660 * DAY)] = Field(
        0.0, description="Keep published rows at least this long (audit, debugging)."
    )
    sweep_condition: str | None = Field(
        None,
        description=(
            "A published row is swept only if it also matches this condition, e.g. "
            "status = 'published' (the grammar of CDC_RELAY_OUTBOX_ROW_FILTER); unset: every "
            "published row."
        ),
    )
    sweep_time_zone: str = Field(
        "UTC",
        description=(
            "The time zone a created_at column of type timestamp without time zone (or date) "
            "is written in, for sweep retention; timestamptz columns need none."
        ),
    )
    heartbeat_interval: Annotated[float, seconds(0.1, DAY, special=0)] = Field(
        0.0,
        description="Seconds between heartbeat messages that keep the slot moving; 0 disables.",
    )
    http_port: Annotated[int, Bounds(1, 65535, special=0)] = Field(
        8080, description="Port of /healthz /readyz /metrics /status; 0 disables."
    )
    http_host: str = Field(
        "0.0.0.0",  # noqa: S104 - a sidecar is probed from outside its container
        description="Address the HTTP server listens on, e.g. 127.0.0.1 for local probes only.",
    )
    ready_max_lag_seconds: Annotated[float, seconds(0.1, 7 * DAY)] = Field(
        60.0, description="/readyz fails while the relay lags more than this."
    )
    traceparent_column: str = Field(
        "traceparent",
        description="Outbox column of a W3C traceparent (Debezium's tracingspancontext works too).",
    )
    progress_interval: Annotated[float, seconds(0.1, DAY)] = Field(
        5.0, description="Seconds between progress lines while catching up on a backlog."
    )
    log_format: LogFormat = Field(
        LogFormat.PLAIN,
        description="Log lines: plain (key=value) or json, one line per event of note.",
    )
    log_level: str = Field("INFO", description="DEBUG, INFO, WARNING or ERROR.")
    topic_allowlist: str | None = Field(
        None,
        description=(
            "Regular expression (RE2 syntax, matched in linear time) every event's topic must "
            "match in full (topics come from rows through the template or a topic column); others "
            "are refused like an invalid topic (dead-letter or stop). Unset: any legal topic name."
        ),
    )
    max_created_topics: Annotated[int, Bounds(0)] = Field(
        100,
        description=(
            "Topics the relay creates for events (CDC_RELAY_MISSING_TOPICS=create) before it "
            "refuses records for further new topics, per process (afresh at each start: only "
            "CDC_RELAY_TOPIC_ALLOWLIST bounds topics across restarts); 0: it creates none."
        ),
    )

    # The rules (functions above the class), in the order they run. Each setting's own:
    _secrets_from_files = model_validator(mode="before")(_read_secret_files)
    _condition = field_validator("outbox_row_filter", "sweep_condition", "adopt_condition")(
        _optional_condition
    )
    _time_zone = field_validator("sweep_time_zone")(_check_time_zone)
    _allowlist = field_validator("topic_allowlist")(_check_allowlist)
    _database_url = field_validator("database_url")(_check_database_url)
    _qualified_table = field_validator("outbox_table")(qualify_table)
    _dead_letter_topic = field_validator("dead_letter_topic")(_check_dead_letter_topic)
    _host = field_validator("http_host")(_check_host)
    _prefix = field_validator("message_prefix")(_check_prefix)
    _slot = field_validator("slot_name")(_check_slot)
    _identifier = field_validator("publication_name", "state_schema", "traceparent_column")(
        _check_identifier
    )
    _template = field_validator("topic_template")(check_topic_template)
    _level = field_validator("log_level")(_check_level)
    _producer_config = field_validator("kafka_producer_config", mode="before")(_producer_properties)
    # Across settings, once each has passed its own:
    _lease = model_validator(mode="after")(_lease_outlasts_renewals)
    _topics_need = model_validator(mode="after")(_topics_have_their_columns)
    _retention_needs_created_at = model_validator(mode="after")(_retention_has_its_column)
    _conditions_per_table = model_validator(mode="after")(_conditions_set_per_table)
    _record_timeout = model_validator(mode="after")(_record_times_out_in_its_transaction)

    def __repr_args__(self) -> Any:
        # repr()/str() must be as safe to log as describe(): mask credential properties.
        for name, value in super().__repr_args__():
            if name == "kafka_producer_config" and isinstance(value, dict):
                yield name, redact_properties(value)
            else:
                yield name, value

    def tables(self) -> tuple[OutboxTable, ...]:
        """Every outbox table the relay streams, with its mapping."""
        if self.outbox_tables:
            return self.outbox_tables
        return (
            OutboxTable(
                table=self.outbox_table,
                columns=self.outbox_columns,
                row_filter=self.outbox_row_filter,
                sweep_condition=self.sweep_condition,
            ),
        )

    def source_url(self) -> str:
        """The URL every connection to PostgreSQL is opened with: the user's, plus TCP
        keepalives and timeouts it does not set (:mod:`cdc_relay.connection_defaults`).
        A secret: log :meth:`describe`, never this."""
        return source_url(self.database_url.get_secret_value(), self.leader_lease_timeout)

    def producer_config(self) -> dict[str, str]:
        """The librdkafka configuration: safe defaults, then the user's, then what must hold."""
        config = {
            "bootstrap.servers": self.kafka_bootstrap_servers or "",
            "linger.ms": "5",
            "compression.type": "lz4",
            "queue.buffering.max.messages": str(self.producer_queue_max_messages),
            "queue.buffering.max.kbytes": str(self.producer_queue_max_kbytes),
            "message.timeout.ms": "0",  # never give up on a record; stalls are detected instead
            "client.id": "cdc-relay",
        }
        config.update(self.kafka_producer_config)
        config.update(_ENFORCED_PRODUCER_PROPERTIES)
        if self.exactly_once:
            # librdkafka requires message.timeout.ms <= transaction.timeout.ms; a record not
            # delivered by then fails, and its transaction is aborted and sent again (never
            # "forever": the broker would abort the transaction on its own meanwhile).
            timeout = config.setdefault("transaction.timeout.ms", DEFAULT_TRANSACTION_TIMEOUT_MS)
            if config["message.timeout.ms"] == "0":
                config["message.timeout.ms"] = timeout
        return config

    def describe(self) -> dict[str, Any]:
        """The settings as safe to log: the URL without password, credentials masked."""
        data = self.model_dump(mode="json")
        data["database_url"] = redact_url(self.database_url.get_secret_value())
        data["kafka_producer_config"] = redact_properties(self.kafka_producer_config)
        return data


class Part(StrEnum):
    """The part of the relay a setting configures: a section of the configuration reference and
    of ``cdc-relay settings``."""

    SOURCE = "Source: PostgreSQL, the slot and the publication"
    MAPPING = "Mapping: outbox rows to Kafka records"
    DELIVERY = "Delivery: Kafka, topics and refused records"
    DUPLICATES = "Duplicates and exactly once"
    POSITION = "Position: confirmations and stopping"
    LEADERSHIP = "Leadership: standby relays"
    SWEEP = "Sweep: deleting published rows"
    HTTP = "HTTP: health, readiness, metrics"
    LOGGING = "Logging"
    OTHER = "Other"  # a setting not yet placed in a part below (a test says which)


# Every setting in its part, in the order the reference shows them. A new setting belongs here
# too; until it is, the reference shows it under Other and a test names it.
SETTING_PARTS: dict[Part, tuple[str, ...]] = {
    Part.SOURCE: (
        "database_url",
        "database_url_file",
        "plugin",
        "slot_name",
        "publication_name",
        "slot_failover",
        "state_schema",
        "heartbeat_interval",
        "reconnect_max_backoff",
        "read_coalesce_ms",
    ),
    Part.MAPPING: (
        "outbox_table",
        "outbox_columns",
        "outbox_tables",
        "outbox_row_filter",
        "topic_template",
        "messages",
        "message_prefix",
        "traceparent_column",
    ),
    Part.DELIVERY: (
        "kafka_bootstrap_servers",
        "kafka_producer_config",
        "kafka_producer_config_file",
        "producer_queue_max_messages",
        "producer_queue_max_kbytes",
        "delivery_stall_timeout",
        "poison_policy",
        "dead_letter_topic",
        "missing_topics",
        "topic_partitions",
        "topic_replication_factor",
        "topic_allowlist",
        "max_created_topics",
    ),
    Part.DUPLICATES: (
        "reconcile",
        "reconcile_timeout",
        "exactly_once",
        "transaction_interval",
        "transaction_max_events",
    ),
    Part.POSITION: (
        "confirm_interval",
        "idle_confirm_interval",
        "shutdown_timeout",
        "on_slot_loss",
        "adopt_condition",
        "allow_slot_reset",
    ),
    Part.LEADERSHIP: ("leader_lease_timeout", "leader_renew_interval"),
    Part.SWEEP: (
        "sweep_interval",
        "sweep_batch_size",
        "sweep_retention_seconds",
        "sweep_condition",
        "sweep_time_zone",
    ),
    Part.HTTP: ("http_port", "http_host", "ready_max_lag_seconds"),
    Part.LOGGING: ("log_format", "log_level", "progress_interval"),
}

# Settings only some commands need (the rest need what has no default): the commands by name.
REQUIRED_BY: dict[str, tuple[str, ...]] = {"kafka_bootstrap_servers": ("run", "check", "recover")}


def env_name(field: str) -> str:
    return f"{ENV_PREFIX}{field.upper()}"


def setting_bounds() -> dict[str, Bounds]:
    """Every bounded setting's :class:`~cdc_relay.bounds.Bounds`, as declared on its field."""
    return {
        name: bound
        for name, field in Settings.model_fields.items()
        for bound in field.metadata
        if isinstance(bound, Bounds)
    }


# CDC_RELAY_ variables the project reads that are not settings: the build's switches (setup.py,
# _hot_path.py) and the test suite's (CONTRIBUTING.md), which CI exports while relays run.
NOT_SETTINGS = frozenset(
    {
        "CDC_RELAY_COMPILE",
        "CDC_RELAY_PURE_PYTHON",
        "CDC_RELAY_EXPECT_COMPILED",
        "CDC_RELAY_POSTGRES_BINDIR",
        "CDC_RELAY_UPGRADE_BINDIRS",
        "CDC_RELAY_REQUIRE_PROMTOOL",
        "CDC_RELAY_TEST_DATABASE_URL",
        "CDC_RELAY_TEST_KAFKA_BOOTSTRAP_SERVERS",
        "CDC_RELAY_BENCH_PEER_PYTHON",
    }
)


def unknown_variables(names: Iterable[str]) -> list[str]:
    """One line per ``CDC_RELAY_*`` name that no setting reads, naming the closest setting.

    pydantic-settings ignores such a name, so a misspelt setting would silently keep its default
    (``CDC_RELAY_SWEEP_CONDITON`` sweeps without the condition). Names are compared as the
    settings read them, case-insensitively.
    """
    known = sorted(env_name(field) for field in Settings.model_fields)
    lines = []
    for name in sorted(set(names)):
        upper = name.upper()
        if not upper.startswith(ENV_PREFIX) or upper in known or upper in NOT_SETTINGS:
            continue
        import difflib  # noqa: PLC0415 - only for a name that is not a setting

        # Compared without the prefix, which every name shares and would make any two alike.
        suffixes = [name.removeprefix(ENV_PREFIX) for name in known]
        close = difflib.get_close_matches(upper.removeprefix(ENV_PREFIX), suffixes, n=1)
        hint = f"; did you mean {ENV_PREFIX}{close[0]}?" if close else ""
        lines.append(f"{name} is not a setting and is ignored{hint}")
    return lines


def configured_names(path: Path = Path(".env")) -> list[str]:
    """The variable names the settings come from: the environment's and ``.env``'s."""
    names = list(os.environ)
    try:
        if path.is_file():
            from dotenv import dotenv_values  # noqa: PLC0415 - pydantic-settings' own reader

            names.extend(dotenv_values(path))
    except (OSError, ValueError):
        pass  # load_settings has refused an unreadable .env already
    return names


__all__ = ["redact_url"]  # re-exported: callers print the URL through config's redaction


def read_secret_file(field: str, path: object) -> str:
    """The text of a ``*_FILE`` setting's file; a failure names the setting, not the content."""
    try:
        return read_setting_file(Path(str(path))).decode("utf-8")
    except (OSError, ValueError, _NotASettingFile) as exc:  # UnicodeDecodeError is a ValueError
        raise ConfigError(
            f"invalid configuration: {env_name(field)}: cannot read {path}: {_reason(exc)}"
        ) from None


class _NotASettingFile(Exception):
    """What was opened is not a regular file of at most SETTING_FILE_MAX_BYTES."""


_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def read_setting_file(path: Path) -> bytes:
    """The bytes of a regular file of at most :data:`SETTING_FILE_MAX_BYTES` (symlinks followed,
    as Kubernetes mounts secrets).

    Opened without blocking (a FIFO with no writer would otherwise hold the start for ever) and
    judged by ``fstat`` of what was opened, not of the name; read up to one byte past the cap, so
    that a device that never ends (``/dev/zero``) or a file growing meanwhile costs no more.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _FILE_KINDS if test(mode)), "not a file")
            raise _NotASettingFile(f"it is {kind}, not a regular file")
        chunks: list[bytes] = []
        size = 0
        while size <= SETTING_FILE_MAX_BYTES:
            chunk = os.read(fd, SETTING_FILE_MAX_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > SETTING_FILE_MAX_BYTES:
            raise _NotASettingFile(f"larger than {SETTING_FILE_MAX_BYTES // 1024} KiB")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, UnicodeDecodeError):
        return "not UTF-8 text"
    if isinstance(exc, ValueError):  # os.open: a NUL in the name
        return "not a valid file name"
    if isinstance(exc, OSError):
        return exc.strerror or type(exc).__name__
    return str(exc)


def check_dotenv(path: Path = Path(".env")) -> None:
    """``.env`` in the working directory, if there is one, is a regular file within the cap:
    pydantic-settings reads it whole, and would block on a FIFO or read a device for ever."""
    try:
        read_setting_file(path)
    except FileNotFoundError:
        return
    except (OSError, _NotASettingFile) as exc:
        raise ConfigError(
            f"invalid configuration: .env in {Path.cwd()}: {_reason(exc)}; remove it or make "
            "it a file of settings"
        ) from None


def parse_properties(text: str) -> dict[str, str]:
    """Kafka client properties from a file: a JSON object, or ``key=value`` lines.

    Lines are Java-properties style without escapes: blank lines and lines starting with ``#``
    or ``!`` are skipped, the key ends at the first ``=``, and both sides are stripped. Errors
    name the line number, never its content (it may be a password).
    """
    if text.lstrip().startswith("{"):
        return _json_object("kafka_producer_config_file", text)
    props: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped[0] in "#!":
            continue
        pair = split_property(stripped)
        if pair is None:
            raise ConfigError(
                f"invalid configuration: {env_name('kafka_producer_config_file')}: line {number} "
                "is not key=value"
            )
        props[pair[0]] = pair[1].strip()
    return props


def property_flags(items: list[str]) -> dict[str, str]:
    """``--kafka-property KEY=VALUE`` flags as properties; ConfigError for one without ``=``."""
    props = {}
    for item in items:
        pair = split_property(item)
        if pair is None:
            # Not echoed: the argument may well be a credential with a typo.
            raise ConfigError("--kafka-property expects KEY=VALUE (an argument lacks '=')")
        props[pair[0]] = pair[1]
    return props


def check_producer_config(config: dict[str, str]) -> None:
    """librdkafka's own verdict on the producer properties: ConfigError naming the setting.

    A Producer built and dropped at once is the only complete check: librdkafka knows hundreds
    of properties, their types and their ranges. Built without bootstrap servers, it connects
    nowhere; its log lines (about that) go nowhere. Only the commands that produce call it (it
    loads confluent-kafka).
    """
    from confluent_kafka import KafkaException, Producer  # noqa: PLC0415 - only when producing

    probe: dict[str, Any] = {k: v for k, v in config.items() if k != "bootstrap.servers"}
    probe["logger"] = _SILENT_LOGGER
    try:
        Producer(probe)
    except (KafkaException, ValueError, TypeError) as exc:
        message = str(exc.args[0].str() if isinstance(exc, KafkaException) else exc)
        for key, value in config.items():
            if is_secret_property(key) and value:
                message = message.replace(value, "***")
        raise ConfigError(
            f"invalid configuration: {env_name('kafka_producer_config')}: {message}"
        ) from None


def split_property(text: str) -> tuple[str, str] | None:
    """``key=value`` -> (key, value): the key ends at the first ``=`` and is stripped; the value
    is kept as given (it may itself hold ``=``). None without an ``=`` or with an empty key."""
    key, sep, value = text.partition("=")
    key = key.strip()
    return (key, value) if sep and key else None


def _json_object(field: str, text: str) -> dict[str, Any]:
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise ConfigError(f"invalid configuration: {env_name(field)}: not a JSON object")
    return value


def is_secret_property(key: str) -> bool:
    lowered = key.lower()
    return any(fragment in lowered for fragment in _SECRET_KEY_FRAGMENTS)


def redact_properties(props: dict[str, str]) -> dict[str, str]:
    return {k: ("***" if is_secret_property(k) else v) for k, v in props.items()}


def load_settings(**overrides: Any) -> Settings:
    """Build Settings from env/.env plus explicit overrides; invalid input -> one ConfigError."""
    return settings_for("run", overrides)


def settings_for(command: str, overrides: dict[str, Any]) -> Settings:
    """:func:`load_settings` for ``command``, which may need settings others do without
    (:data:`REQUIRED_BY`): a missing one is named with any other problem."""
    check_dotenv()
    given = {k: v for k, v in overrides.items() if v is not None}
    needed = [name for name, commands in REQUIRED_BY.items() if command in commands]
    try:
        settings = Settings(**given)
    except ValidationError as exc:
        problems = _problems(exc)
        configured = {name.upper() for name in configured_names()}
        problems += [
            f"{env_name(name)}: is required by {command}"
            for name in needed
            if name not in given and env_name(name) not in configured
        ]
        raise ConfigError("invalid configuration: " + "; ".join(problems)) from None
    except SettingsError as exc:
        # Raised when a complex value (a JSON object) cannot be parsed at all.
        match = re.search(r'field "(\w+)"', str(exc))
        field = env_name(match.group(1)) if match else "a setting"
        raise ConfigError(f"invalid configuration: {field}: not valid JSON") from None
    missing = [name for name in needed if getattr(settings, name) is None]
    if missing:
        raise ConfigError(
            "invalid configuration: "
            + "; ".join(f"{env_name(name)}: is required by {command}" for name in missing)
        )
    return settings


# pydantic's words for an error type, where ours say it better.
_REASONS = {"missing": "is required", "string_too_short": "must not be empty"}


def _problems(exc: ValidationError) -> list[str]:
    """One line per error pydantic found, naming the setting (and where inside a JSON one)."""
    problems = []
    for error in exc.errors():
        reason = _REASONS.get(error["type"], error["msg"]).removeprefix("Value error, ")
        if error["loc"]:
            # Where inside a JSON setting: "CDC_RELAY_OUTBOX_TABLES: [0].columns.key_from: …"
            inner = "".join(
                f"[{part}]" if isinstance(part, int) else f".{part}" for part in error["loc"][1:]
            ).lstrip(".")
            where = f"{inner}: " if inner else ""
            problems.append(f"{env_name(str(error['loc'][0]))}: {where}{reason}")
        else:  # a rule between settings: its message names them
            problems.append(reason)
    return problems
