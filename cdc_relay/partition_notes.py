"""Where a topic's partitions end before a session's first record to them.

A start after a crash reads back from Kafka what an earlier incarnation delivered
(:mod:`cdc_relay.reconcile`), from each partition's acknowledged offset in the position record.
A partition the relay has written but no acknowledged offset was recorded for yet has no such
offset: so before the first record to a topic, the session notes where its partitions without one
end, and the position record keeps the note. Failing to note costs duplicates after a crash
only, so it is said and not fatal.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Protocol

from cdc_relay.confirmation import Confirmer, PositionStore
from cdc_relay.errors import SinkUnavailable, SourceUnavailable
from cdc_relay.topics import in_background, wait_serving

# Said as the session that notes: the logger name is what operators filter on.
log = logging.getLogger("cdc_relay.session")


class PartitionEnds(Protocol):
    def partition_ends(self, topic: str) -> dict[int, int]: ...


class PartitionNotes:
    """One session's notes: each topic's partitions noted once, before its first record."""

    def __init__(
        self,
        noted: Mapping[tuple[str, int], int] | None,
        store: PositionStore,
        sink: PartitionEnds,
        confirmer: Confirmer,
    ) -> None:
        self.noted: dict[tuple[str, int], int] = dict(noted or {})
        self.store = store
        self.sink = sink
        self.confirmer = confirmer  # which partitions have an offset in the position record
        self.noted_topics: set[str] = set()  # topics whose partitions this session noted

    def note(self, topic: str, serve: Callable[[], None]) -> None:
        """Note where ``topic``'s partitions without a recorded offset end; ``serve`` runs the
        session's duties while Kafka answers."""
        # Only an offset in the position record replaces a note: one acknowledged since (in
        # memory) is lost with a crash, and without its note the partition would not be read.
        recorded = self.confirmer.recorded_partitions
        if topic in self.noted_topics:
            return
        try:
            ends = wait_serving(in_background(self.sink.partition_ends, topic), serve)
            noted = {key: value for key, value in self.noted.items() if key not in recorded}
            # An existing note stays: the records of an earlier incarnation may follow it.
            noted.update(
                ((topic, p), end)
                for p, end in ends.items()
                if (topic, p) not in recorded and (topic, p) not in noted
            )
            if noted != self.noted:
                self.store.note_written_from(noted)
                self.noted = noted
        except (SinkUnavailable, SourceUnavailable) as exc:
            log.warning(
                "cannot note where the topic's partitions end: after a crash, its records "
                "may be published twice",
                extra={"fields": {"topic": topic, "error": str(exc)}},
            )
        self.noted_topics.add(topic)
