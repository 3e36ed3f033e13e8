"""Which outbox table a relation of the stream is (:mod:`cdc_relay.relations`): by the oid its
name had at the start, and by its configured name — for pgoutput, whose relation id is the oid;
by name alone for wal2json, whose relation ids are made up."""

from __future__ import annotations

import logging

import pytest

from cdc_relay.config import Settings, load_settings
from cdc_relay.decode.messages import Relation, RelationColumn
from cdc_relay.relations import Relations

COLUMNS = tuple(
    RelationColumn(0, name, 25, -1)
    for name in ("id", "aggregate_type", "aggregate_id", "event_type", "payload", "headers")
)
OUTBOX_OID = 16400


def _settings(plugin: str = "pgoutput") -> Settings:
    return load_settings(
        database_url="postgresql://relay@db/app", kafka_bootstrap_servers="k:9092", plugin=plugin
    )


def _relation(relation_id: int, name: str, schema: str = "public") -> Relation:
    return Relation(relation_id, schema, name, "d", COLUMNS, None)


def test_a_renamed_outbox_is_followed_by_its_oid_and_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    relations = Relations(_settings(), {OUTBOX_OID: "public.outbox"})
    with caplog.at_level(logging.INFO, logger="cdc_relay.session"):
        relations.on_relation(_relation(OUTBOX_OID, "outbox_old"))
        relations.on_relation(_relation(OUTBOX_OID, "outbox_old"))
    assert OUTBOX_OID in relations.mappings
    said = [r for r in caplog.records if "another name in this part of the WAL" in r.getMessage()]
    assert len(said) == 1


def test_a_recreated_outbox_maps_by_its_name_and_other_tables_not_at_all() -> None:
    """A table dropped and created again under the configured name has another oid: its rows
    were written to the outbox by that name. A table of another name and oid is not the outbox."""
    relations = Relations(_settings(), {OUTBOX_OID: "public.outbox"})
    relations.on_relation(_relation(17001, "outbox"))
    relations.on_relation(_relation(17002, "orders"))
    assert 17001 in relations.mappings
    assert 17002 not in relations.mappings


def test_wal2json_ids_are_never_taken_for_oids() -> None:
    """wal2json's relation ids hash the name and columns: one equal to the outbox's oid by
    chance must not make another table's rows outbox rows."""
    relations = Relations(_settings("wal2json"), {OUTBOX_OID: "public.outbox"})
    relations.on_relation(_relation(OUTBOX_OID, "orders"))
    assert OUTBOX_OID not in relations.mappings
    relations.on_relation(_relation(99, "outbox"))
    assert 99 in relations.mappings
