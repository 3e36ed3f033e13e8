"""Unit tests for cdc_relay.decode's public API: the plugin's options and its XLogData decoder.

The frames are built here by hand from the documented layout (not from
:mod:`cdc_relay.replication.protocol`), so a wrong header offset in the decoders cannot agree with
itself.
"""

from __future__ import annotations

import json
import struct

from cdc_relay.config import Settings
from cdc_relay.decode import decoder_for, plugin_options_for
from cdc_relay.decode.messages import Begin, Insert, LogicalMessage, Relation

DATA_START = 0x16_B374_D848


def settings(plugin: str, messages: bool = False) -> Settings:
    return Settings.model_validate(
        {
            "database_url": "postgresql://relay@db.example/app",
            "kafka_bootstrap_servers": "kafka:9092",
            "publication_name": "outbox_pub",
            "outbox_table": "public.outbox",
            "plugin": plugin,
            "messages": messages,
        }
    )


def frame(payload: bytes, data_start: int = DATA_START) -> memoryview:
    """XLogData: 'w', Int64 data start, Int64 WAL end, Int64 send time, then the message."""
    return memoryview(b"w" + struct.pack(">QQq", data_start, data_start + 99, -1) + payload)


def test_pgoutput_options() -> None:
    assert plugin_options_for(settings("pgoutput", messages=True)) == {
        "proto_version": "1",
        "publication_names": '"outbox_pub"',  # always quoted: the walsender splits identifiers
        "messages": "true",
    }


def test_pgoutput_is_asked_for_no_message_unless_they_are_on() -> None:
    assert plugin_options_for(settings("pgoutput"))["messages"] == "false"


def test_wal2json_options_name_the_tables_and_the_message_prefix() -> None:
    options = plugin_options_for(settings("wal2json"))
    assert options["format-version"] == "2"
    assert options["add-tables"] == "public.outbox"
    assert options["add-msg-prefixes"] == "outbox"


def test_pgoutput_decoder_reads_the_message_after_the_header() -> None:
    begin = b"B" + struct.pack(">QqI", 0x1_0000_0100, 774_000_000_123, 4242)
    assert decoder_for(settings("pgoutput"))(frame(begin)) == (
        Begin(0x1_0000_0100, 774_000_000_123, 4242),
    )


def test_wal2json_decoder_takes_the_wal_position_from_the_header() -> None:
    # A logical message without "lsn" is placed at the XLogData's data start.
    message = {"action": "M", "transactional": True, "prefix": "outbox", "content": "hi"}
    decoded = decoder_for(settings("wal2json"))(frame(json.dumps(message).encode()))
    assert decoded == (LogicalMessage(True, DATA_START, "outbox", b"hi", None),)


def test_wal2json_decoder_keeps_its_relations_across_calls() -> None:
    decode = decoder_for(settings("wal2json"))
    column = {"name": "id", "type": "integer", "typeoid": 23, "value": 1}
    insert = {"action": "I", "schema": "public", "table": "outbox", "columns": [column]}
    relation, first = decode(frame(json.dumps(insert).encode()))
    assert isinstance(relation, Relation)
    assert isinstance(first, Insert)
    (second,) = decode(frame(json.dumps(insert).encode()))  # known column list: no new Relation
    assert second == Insert(relation.relation_id, (b"1",), None)
