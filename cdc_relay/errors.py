"""The project's error tree.

Library exceptions are mapped to these where the library is called, so the relay loop reasons
about *what to do* (retry, restart the session, stop) rather than about which library raised:

- psycopg/libpq: by :data:`cdc_relay.postgres_errors.PG_ERROR_MAP`, in the modules that hold a
  PostgreSQL connection (listed there); no other module catches a psycopg error;
- confluent-kafka/librdkafka: in :mod:`cdc_relay.publisher` (:func:`~cdc_relay.publisher.refusal`,
  ``PERMANENT_ERRORS``);
- pydantic: in :func:`cdc_relay.config.load_settings`, as one ConfigError naming the settings.

Messages are written for operators and never contain secrets.
"""

from __future__ import annotations

from cdc_relay.exit_codes import ExitCode


class RelayError(Exception):
    """Base class of every error cdc-relay raises on purpose."""

    exit_code: int = ExitCode.FAILED


class ConfigError(RelayError):
    """The configuration is invalid; the message names the setting."""

    exit_code = ExitCode.CONFIGURATION


class SourceError(RelayError):
    """Something about the PostgreSQL side."""


class SourceUnavailable(SourceError):
    """The connection was lost or refused: retry with backoff from the confirmed position."""


class SourceSetupError(SourceError):
    """A prerequisite is missing (wal_level, privilege, table, ...): an operator must act."""

    exit_code = ExitCode.PREREQUISITE


class SlotInUse(SourceSetupError):
    """Another process streams from the replication slot."""


class PublicationChanged(SourceSetupError):
    """The publication or an outbox table is no longer what the relay verified at its start
    (:mod:`cdc_relay.publication_stamp`): noticed by a write of the position, which then records
    nothing. The relay stops, confirming nothing decoded since; an operator must look."""


class LeadershipLost(SourceError):
    """Another relay leads now (this one's lease was taken over): stop streaming at once, drop
    what is in flight, confirm nothing, and become a standby. Never ends the process.

    Raised for two causes, each in one place: the lease ran out by this process's clock
    (:func:`cdc_relay.leadership.require_lease`), a write fenced by the lease found another holder
    (:func:`cdc_relay.checkpoint.fenced`); handled by :meth:`cdc_relay.relay.Relay._lead`."""


class PositionMismatch(SourceError):
    """The slot and the relay's record of its position disagree in a way that can lose events."""

    exit_code = ExitCode.POSITION


class SinkError(RelayError):
    """Something about the Kafka side."""


class SinkUnavailable(SinkError):
    """Deliveries fail transiently or make no progress: rebuild the producer and resume."""


class PoisonRecordError(SinkError):
    """A record Kafka refuses permanently, under the ``stop`` policy."""

    exit_code = ExitCode.POISON


class ProtocolError(SourceError):
    """The server sent something the relay cannot interpret; stopping is the only safe choice."""

    exit_code = ExitCode.PROTOCOL


class StopSession(Exception):
    """Not an error: a stop was requested (or a failure recorded) inside a session.

    Raised where the session notices it and caught by the relay, which then runs the session's
    clean shutdown (drain, confirm). What to report afterwards, if anything, the relay decides.
    """
