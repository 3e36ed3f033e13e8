"""Which topics rows may send to, and making sure a topic exists before its first record.

A topic an event goes to is chosen by a row (the template, a topic column), so by any writer: it
must match ``CDC_RELAY_TOPIC_ALLOWLIST`` (in linear time, :mod:`cdc_relay.patterns`; only a legal
name, at most 249 characters, is matched: others are refused as illegal), and creating it
(``CDC_RELAY_MISSING_TOPICS=create``) counts against ``CDC_RELAY_MAX_CREATED_TOPICS`` for the life
of the process. The dead-letter topic is the operator's own and exempt from both. A refused topic
refuses the record (:class:`~cdc_relay.publisher.ProduceRefused`, permanent): the poison policy
takes it from there.

Metadata and creation are network round trips: they run on a helper thread while the caller's
``serve`` keeps the session's duties going (deliveries, confirmations, keepalives, a stop). The
records after the waiting one wait too, so their order holds.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Protocol, TypeVar

from cdc_relay.config import MissingTopics, Settings, legal_topic
from cdc_relay.logs import cut
from cdc_relay.patterns import compile_pattern
from cdc_relay.publisher import ProduceRefused

_T = TypeVar("_T")

WAIT_SLICE = 0.05  # seconds between the caller's duties while a topic is looked up or created


# Publisher.ensure_topic's signature again, deliberately: the rules depend on this, not the adapter.
class TopicAdmin(Protocol):
    """What the rules need of the Kafka adapter."""

    def ensure_topic(
        self,
        topic: str,
        create: bool,
        partitions: int,
        replication_factor: int,
        may_create: Callable[[], None] | None = None,
    ) -> bool: ...


class TopicRules:
    """The allow-list and the creation limit; lives as long as the relay (the limit is per
    process), while each session keeps its own set of topics it has seen exist."""

    def __init__(self, settings: Settings) -> None:
        allowlist = settings.topic_allowlist
        self._allowlist = (
            compile_pattern(allowlist, capture=False) if allowlist is not None else None
        )
        self._limit = settings.max_created_topics
        self._create = settings.missing_topics is MissingTopics.CREATE
        self._partitions = settings.topic_partitions
        self._replication_factor = settings.topic_replication_factor
        self.created: set[str] = set()  # event topics this process created

    def ensure(
        self, admin: TopicAdmin, topic: str, *, event: bool, serve: Callable[[], None]
    ) -> None:
        """``topic`` exists (or was created) and may be used; ProduceRefused when not."""
        if (
            event
            and self._allowlist is not None
            and legal_topic(topic)  # an illegal name is refused as such by admin.ensure_topic
            and not self._allowlist.fullmatch(topic)
        ):
            raise ProduceRefused.policy(
                f"topic {cut(topic)!r} is not allowed by CDC_RELAY_TOPIC_ALLOWLIST"
            )

        def may_create() -> None:
            if event and len(self.created) >= self._limit:
                raise ProduceRefused.policy(
                    f"topic {cut(topic)!r} does not exist, and the relay has created the "
                    f"{self._limit} topics CDC_RELAY_MAX_CREATED_TOPICS allows: create it "
                    "yourself, or raise the limit"
                )

        created = wait_serving(
            in_background(
                admin.ensure_topic,
                topic,
                self._create,
                self._partitions,
                self._replication_factor,
                may_create,
            ),
            serve,
        )
        if created and event:
            self.created.add(topic)


def wait_serving(future: Future[_T], serve: Callable[[], None]) -> _T:
    """The result of work done off the loop, calling ``serve`` between short waits."""
    while True:
        try:
            return future.result(timeout=WAIT_SLICE)
        except FutureTimeout:
            pass
        serve()


def in_background(work: Callable[..., _T], *args: Any, name: str = "topic") -> Future[_T]:
    """Run ``work`` on a daemon thread (one that never delays the process's exit)."""
    future: Future[_T] = Future()

    def run() -> None:
        try:
            future.set_result(work(*args))
        except BaseException as exc:  # handed to the waiting loop, which re-raises it
            future.set_exception(exc)

    threading.Thread(target=run, name=f"cdc-relay-{name}", daemon=True).start()
    return future
