"""The Kafka ``transactional.id`` of a stream, when publishing exactly once.

It names what identifies the stream — the database cluster's system identifier and the slot — and
nothing of the host or the process: every relay of one slot shares it, so a new leader's
``init_transactions`` fences every older producer of that slot, whatever state it is in. ACLs
grant ``TransactionalId`` rights on the prefix (README: Exactly once).
"""

from __future__ import annotations

TRANSACTIONAL_ID_PREFIX = "cdc-relay."


def transactional_id(system_identifier: str, slot_name: str) -> str:
    """``cdc-relay.<system identifier>.<slot>``: one per stream, the same for all its relays."""
    return f"{TRANSACTIONAL_ID_PREFIX}{system_identifier}.{slot_name}"
