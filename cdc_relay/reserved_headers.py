"""The header names the relay sets itself, which nothing a row carries may also send.

Every record carries ``id``, ``event_type`` and ``aggregate_type`` from the mapping, and
``cdc_relay.position`` (events and dead letters) and the ``cdc_relay.*`` dead-letter metadata
from the relay. A second header of one of those names, taken from a row's ``headers`` object,
would be read instead of the relay's by a consumer that takes the last one (Java's
``Headers.lastHeader``): a forged event id makes a consumer that deduplicates by ``id`` drop
someone else's event, a forged position could pass for the relay's own at the read-back. So a row
that carries one is refused (dead-lettered, :class:`cdc_relay.outbox.MalformedEvent`), and a
configured header column or alias with such a name is refused at start.

Kafka compares header names case-sensitively, but consumers that fold case exist (HTTP bridges,
maps keyed case-insensitively): names are compared case-folded, so ``ID`` and ``CDC_Relay.x`` are
reserved too.
"""

from __future__ import annotations

from typing import Final

RESERVED_NAMES: Final = frozenset({"id", "event_type", "aggregate_type"})
RESERVED_PREFIX: Final = "cdc_relay."


def reserved(name: str) -> bool:
    """Whether ``name``, in any case, is a header the relay sets itself."""
    folded = name.casefold()
    return folded in RESERVED_NAMES or folded.startswith(RESERVED_PREFIX)
