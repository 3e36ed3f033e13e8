"""The framework-shaped outbox's mapping (issue 14), as the README's configuration example writes
it: topic per category and the bare aggregate id as key, both from ``stream_name``
(``shop::order-<id>``), the event id (``message_id``) as the ``id`` header, an envelope value."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

STREAM = r"([^:]+)::([^-]+)-(.*)"  # bounded context :: category - aggregate id


def framework_columns(prefix: str, placements: Sequence[str]) -> dict[str, Any]:
    """CDC_RELAY_OUTBOX_COLUMNS for the framework's table; topics are ``<prefix>.<category>``."""
    return {
        "id": "message_id",  # the event id for the `id` header, not the row id
        "aggregate_type": None,
        "aggregate_id": None,
        "event_type": "type",
        "payload": "data",
        "headers": None,
        "topic_from": {
            "column": "stream_name",
            "regex": STREAM,
            "replacement": f"{prefix}.$2",
        },
        "key_from": {"column": "stream_name", "regex": STREAM, "replacement": "$3"},
        "value": "envelope",
        "additional_placement": list(placements),
    }
