"""The output plugin, chosen by configuration: its START_REPLICATION options and its decoder.

Both decoders emit the same message types (those of :mod:`cdc_relay.decode.messages`), so everything
after this point — outbox mapping, publishing, the watermark — is the same for either plugin.
A decoder here takes a whole XLogData payload (header included), because wal2json needs the
message's WAL position and pgoutput does not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeAlias

from psycopg import sql

from cdc_relay.config import Plugin, Settings
from cdc_relay.replication.protocol import XLOG_DATA_START, XLOG_PAYLOAD

if TYPE_CHECKING:
    from cdc_relay.decode.messages import Message

PGOUTPUT_PROTO_VERSION = "1"  # v2 only adds streaming of in-progress transactions: not wanted

# A tuple, not any Sequence: the compiled session then walks it by index, not by an iterator.
XLogDecoder: TypeAlias = "Callable[[memoryview], tuple[Message, ...]]"


def plugin_options_for(settings: Settings) -> dict[str, str]:
    if settings.plugin is Plugin.WAL2JSON:
        from cdc_relay.decode.wal2json import plugin_options  # noqa: PLC0415 - this plugin's only

        # wal2json has no switch for messages: with them off the prefix still narrows what is
        # sent, and the session drops what arrives.
        return plugin_options(
            [t.table for t in settings.tables()], message_prefixes=(settings.message_prefix,)
        )
    return {
        "proto_version": PGOUTPUT_PROTO_VERSION,
        "publication_names": sql.Identifier(settings.publication_name).as_string(None),
        # The table-less outbox (pg_logical_emit_message), only when the operator enabled it.
        "messages": "true" if settings.messages else "false",
    }


def decoder_for(settings: Settings) -> XLogDecoder:
    """A fresh decoder (decoders keep per-connection state) for one replication session."""
    # Each decoder is imported only when configured, and late: the relay sends START_REPLICATION
    # before it loads the code that reads the answer (its import overlaps the wait for the answer).
    if settings.plugin is Plugin.WAL2JSON:
        from cdc_relay.decode.wal2json import Wal2JsonDecoder  # noqa: PLC0415

        wal2json = Wal2JsonDecoder().decode

        def decode_wal2json(data: memoryview) -> tuple[Message, ...]:
            return tuple(wal2json(data[XLOG_PAYLOAD], int.from_bytes(data[XLOG_DATA_START], "big")))

        return decode_wal2json
    from cdc_relay.decode.pgoutput import PgOutputDecoder  # noqa: PLC0415

    return PgOutputDecoder().decode_xlog
