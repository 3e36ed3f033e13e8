"""How each setting is shown to a person: one row per field of :class:`~cdc_relay.config.Settings`.

The fields are the one source of wording: a row takes the description, default and
:class:`~cdc_relay.bounds.Bounds` from its field and the part from
:data:`~cdc_relay.config.SETTING_PARTS`, and adds what a reader needs besides: the flag, a typed
placeholder (``SECONDS``, ``{pgoutput,wal2json}``, ``URL``) and the type in words. The CLI's flags
and ``cdc-relay settings`` (:mod:`cdc_relay.cli`) and ``docs/reference/configuration.md``
(:func:`markdown`) are made from these rows, so a new field appears in all three by itself.

Only defaults are shown, never a configured value: nothing here reads the environment.
"""

from __future__ import annotations

import functools
import re
import types
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Union, get_args, get_origin

import orjson
from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo

from cdc_relay import DOCS_URL
from cdc_relay.bounds import Bounds, format_number
from cdc_relay.config import (
    ENV_PREFIX,
    REQUIRED_BY,
    SETTING_PARTS,
    Part,
    Settings,
    env_name,
)

# CDC_RELAY_KAFKA_PRODUCER_CONFIG is a JSON object in the environment, and on the command line a
# repeatable --kafka-property KEY=VALUE (merged over it) rather than a flag of its own.
PROPERTY_SETTING = "kafka_producer_config"
PROPERTY_FLAG = "--kafka-property"

# What a text setting's value looks like, where its type does not say.
_PLACEHOLDERS = {
    "database_url": "URL",
    "kafka_bootstrap_servers": "HOST:PORT[,...]",
    "outbox_table": "SCHEMA.TABLE",
    "outbox_row_filter": "CONDITION",
    "sweep_condition": "CONDITION",
    "message_prefix": "PREFIX",
    "slot_name": "NAME",
    "publication_name": "NAME",
    "topic_template": "TEMPLATE",
    "dead_letter_topic": "TOPIC",
    "state_schema": "SCHEMA",
    "sweep_time_zone": "ZONE",
    "http_host": "HOST",
    "http_port": "PORT",
    "traceparent_column": "COLUMN",
    "log_level": "{DEBUG,INFO,WARNING,ERROR}",
    "topic_allowlist": "REGEX",
    "producer_queue_max_kbytes": "KBYTES",
    PROPERTY_SETTING: "KEY=VALUE",
}
_UNIT_PLACEHOLDERS = {"seconds": "SECONDS", "milliseconds": "MILLISECONDS"}
CONFIGURATION_PAGE = f"{DOCS_URL}reference/configuration/"


@dataclass(frozen=True)
class SettingRow:
    name: str  # the field's
    variable: str  # CDC_RELAY_SLOT_NAME
    flag: str  # --slot-name; --[no-]messages for a boolean
    placeholder: str  # NAME, SECONDS, {a,b}; "" for a boolean
    kind: str  # the type in words: seconds, integer, one of …, JSON object
    default: str  # as a value would be written, or required / unset
    bounds: str  # "between 0.1 and 3600 seconds", or ""
    meaning: str  # the field's description
    part: Part

    @property
    def required(self) -> bool:
        """No default: every command (or those :data:`REQUIRED_BY` names) needs a value."""
        return self.default.startswith(_REQUIRED)

    @property
    def usage(self) -> str:
        """``--slot-name NAME``, ``--[no-]messages``."""
        return f"{self.flag} {self.placeholder}" if self.placeholder else self.flag

    def help(self) -> str:
        """The flag's help: meaning, default, bounds, variable."""
        if self.required:
            default = f"{self.default[:1].upper()}{self.default[1:]}"
        else:
            default = f"Default: {self.default}"
        accepts = f"; accepts {self.bounds}" if self.bounds else ""
        return f"{self.meaning} {default}{accepts}. [{self.variable}]"


@functools.cache
def rows() -> tuple[SettingRow, ...]:
    """Every setting, part by part in :data:`SETTING_PARTS`' order; unplaced ones last (Other).

    Computed once: the parser asks for them per command."""
    placed = {name: part for part, names in SETTING_PARTS.items() for name in names}
    ordered = [name for names in SETTING_PARTS.values() for name in names]
    ordered += [name for name in Settings.model_fields if name not in placed]
    return tuple(
        _row(name, Settings.model_fields[name], placed.get(name, Part.OTHER))
        for name in ordered
        if name in Settings.model_fields
    )


def _row(name: str, field: FieldInfo, part: Part) -> SettingRow:
    kind = _inner(field.annotation)
    bounds = next((item for item in field.metadata if isinstance(item, Bounds)), None)
    flag = "--" + name.replace("_", "-")
    if name == PROPERTY_SETTING:
        flag = PROPERTY_FLAG
    elif kind is bool:
        flag = f"--[no-]{name.replace('_', '-')}"
    return SettingRow(
        name=name,
        variable=env_name(name),
        flag=flag,
        placeholder=_placeholder(name, kind, bounds),
        kind=_kind(name, kind, bounds),
        default=_default(name, field),
        bounds=bounds.describe() if bounds else "",
        meaning=field.description or "",
        part=part,
    )


def _inner(annotation: Any) -> Any:
    """``X | None`` -> X."""
    if get_origin(annotation) in (Union, types.UnionType):
        options = [arg for arg in get_args(annotation) if arg is not type(None)]
        if len(options) == 1:
            return options[0]
    return annotation


def _is_enum(kind: Any) -> bool:
    return isinstance(kind, type) and issubclass(kind, Enum)


def _placeholder(name: str, kind: Any, bounds: Bounds | None) -> str:
    if name in _PLACEHOLDERS:
        return _PLACEHOLDERS[name]
    if _is_enum(kind):
        return "{" + ",".join(_choices(name, kind)) + "}"
    if bounds is not None and bounds.unit in _UNIT_PLACEHOLDERS:
        return _UNIT_PLACEHOLDERS[bounds.unit]
    return _TYPE_PLACEHOLDERS.get(kind, "JSON")


_TYPE_PLACEHOLDERS: dict[Any, str] = {
    bool: "",
    int: "N",
    Path: "FILE",
    str: "TEXT",
    SecretStr: "TEXT",
}
_TYPE_WORDS: dict[Any, str] = {
    bool: "boolean",
    int: "integer",
    Path: "file path",
    str: "text",
    SecretStr: "text, secret",
}


def _choices(name: str, kind: Any) -> list[str]:
    """The values an enumerated setting takes (an enum's, or a text setting's listed ones)."""
    if _is_enum(kind):
        return [str(member.value) for member in kind]
    placeholder = _PLACEHOLDERS.get(name, "")
    return placeholder.strip("{}").split(",") if placeholder.startswith("{") else []


def _kind(name: str, kind: Any, bounds: Bounds | None) -> str:
    choices = _choices(name, kind)
    if choices:
        return "one of " + ", ".join(choices)
    if bounds is not None and bounds.unit:
        return bounds.unit
    if get_origin(kind) is tuple:
        return "JSON list"
    return _TYPE_WORDS.get(kind, "JSON object")


_REQUIRED = "required"
_UNSET = "unset"


def _default(name: str, field: FieldInfo) -> str:
    if field.is_required():
        return _REQUIRED
    if name in REQUIRED_BY:
        return f"{_REQUIRED} by " + ", ".join(REQUIRED_BY[name])
    return _shown(field.get_default(call_default_factory=True))


def _shown(value: Any) -> str:
    """A default as it would be written in the environment."""
    if value is None:
        return _UNSET
    if isinstance(value, BaseModel):  # every key at its default; the meaning names the keys
        value = value.model_dump(mode="json", exclude_defaults=True)
    if isinstance(value, Enum):
        value = value.value
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int | float):
        return format_number(value)
    if isinstance(value, dict | tuple | list):
        return orjson.dumps(value).decode()
    return str(value)


# -- the configuration reference ------------------------------------------------------------------

_VARIABLE = re.compile(rf"\b{ENV_PREFIX}[A-Z0-9_]+\b")


def markdown() -> str:
    """``docs/reference/configuration.md``."""
    table = rows()
    lines = [
        "# Configuration reference",
        "",
        "Every setting is an environment variable, may be a line of a `.env` file in the working",
        "directory, and is a flag of every command that takes settings, before or after the",
        "command: `CDC_RELAY_SLOT_NAME=orders` or `--slot-name orders`. Flags win over the",
        "environment, and the environment over `.env`. A boolean flag has a `--no-` form",
        "(`--no-reconcile`). `CDC_RELAY_KAFKA_PRODUCER_CONFIG` is given on the command line as",
        "repeatable `--kafka-property KEY=VALUE` flags, merged over the variable.",
        "",
        "Invalid configuration stops every command at once with exit code 2 and one line naming",
        "the setting, never its value. A `CDC_RELAY_` variable that is no setting is named with",
        "the setting it is closest to. Secrets belong in the environment or in files",
        "(`CDC_RELAY_DATABASE_URL_FILE`, `CDC_RELAY_KAFKA_PRODUCER_CONFIG_FILE`), not on the",
        "command line, where `ps` shows them.",
        "",
        "`cdc-relay settings` prints this list; this page is generated from the same settings",
        "models (`cdc-relay settings --markdown`), and a test fails when the two disagree.",
        "",
    ]
    for part in Part:
        members = [row for row in table if row.part is part]
        if not members:
            continue
        lines += [
            f"## {part.value}",
            "",
            "| variable | flag | type | default | bounds | meaning |",
            "|---|---|---|---|---|---|",
        ]
        lines += [_markdown_row(row) for row in members]
        lines.append("")
    return "\n".join(lines)


def code_variables(text: str) -> str:
    """Markdown: every ``CDC_RELAY_*`` name in ``text`` as code."""
    return _VARIABLE.sub(lambda match: f"`{match.group(0)}`", text)


def _markdown_row(row: SettingRow) -> str:
    cells = [
        f"`{row.variable}`",
        f"`{row.usage}`",
        row.kind,
        row.default if row.required or row.default == _UNSET else f"`{row.default}`",
        row.bounds or "—",
        code_variables(row.meaning),
    ]
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"
