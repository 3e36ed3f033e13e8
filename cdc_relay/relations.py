"""Which outbox mapping each relation of the replication stream uses, and what is not relayed.

The stream announces a relation (a table) before its first row in a session, and again after its
shape changes or its name. This module answers, from the settings' outbox tables, what its
inserts become:
a mapping the session's hot loop looks up by relation id (:attr:`Relations.mappings`), or, for a
table with a row filter, a mapping with the filter's test that the session applies to each row
first (:attr:`Relations.filtered`). Inserts of any other relation, and table-less messages with
the relayed prefix while messages are off, are not relayed: said once per session each.

An outbox table is known by its oid, as its name resolved at the start
(:mod:`cdc_relay.publication_stamp`), and by its configured name: pgoutput's relation id is the
oid, so a Relation under another name — one the table had before a rename the relay resumes
across, or took since (the relay then stops at its next position write) — still maps to it; and
a Relation under the configured name with another oid (a table dropped and re-created) maps too,
for its rows were written to the outbox by that name. wal2json's relation ids are made up from
the name and columns: only names count there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from cdc_relay.config import Plugin, Settings
from cdc_relay.decode.messages import LogicalMessage, Relation, TupleData
from cdc_relay.outbox import OutboxMapping
from cdc_relay.shaped_mapping import outbox_mapping

# Said as the session that meets them: the logger name is what operators filter on.
log = logging.getLogger("cdc_relay.session")


class Relations:
    """One session's relations: their mappings (the session reads the dicts, this fills them)."""

    def __init__(self, settings: Settings, table_oids: Mapping[int, str] | None = None) -> None:
        self.settings = settings
        self.tables = {table.schema_and_name: table for table in settings.tables()}
        by_name = {table.table: table for table in settings.tables()}
        # pgoutput's relation ids are oids; wal2json's are not (see the module documentation).
        self.by_oid = {
            oid: by_name[name]
            for oid, name in (table_oids or {}).items()
            if name in by_name and settings.plugin is Plugin.PGOUTPUT
        }
        self.renames_logged: set[tuple[int, str, str]] = set()
        self.mappings: dict[int, OutboxMapping] = {}
        # Each mapping's fast_state where it has one, by relation id: the C extension's
        # Publisher publishes those relations' ordinary rows (cdc_relay.session).
        self.fast_states: dict[int, tuple[object, ...]] = {}
        # Tables with a row filter: off the hot path, each row tested first (None: the relation
        # lacks a filter column, so its rows cannot be told apart and are refused).
        self.filtered: dict[int, tuple[OutboxMapping, Callable[[TupleData], bool] | None]] = {}
        self.ignored: set[int] = set()
        self.messages_off = not settings.messages
        self.dropped_message_logged = False

    def on_relation(self, relation: Relation) -> None:
        table = self.by_oid.get(relation.relation_id)
        if table is None:
            table = self.tables.get((relation.namespace, relation.name))
        elif table.schema_and_name != (relation.namespace, relation.name):
            self.named_otherwise(relation, table.table)
        self.filtered.pop(relation.relation_id, None)
        self.fast_states.pop(relation.relation_id, None)
        if table is None:
            self.mappings.pop(relation.relation_id, None)
            return
        mapping = outbox_mapping(
            relation,
            table.topic_template or self.settings.topic_template,
            self.settings.traceparent_column,
            table.columns,
        )
        if mapping.missing:
            log.error(
                "outbox table lacks required columns; its rows will be dead-lettered",
                extra={"fields": {"table": mapping.table, "missing": ",".join(mapping.missing)}},
            )
        condition = table.filter
        if condition is None:
            self.mappings[relation.relation_id] = mapping
            if mapping.fast_state is not None:
                self.fast_states[relation.relation_id] = mapping.fast_state
            return
        self.mappings.pop(relation.relation_id, None)
        positions = {column.name: i for i, column in enumerate(relation.columns)}
        try:
            accepts: Callable[[TupleData], bool] | None = condition.matcher(positions)
        except KeyError:
            accepts = None
            log.error(
                "outbox table lacks a column of its row filter; its rows will be dead-lettered",
                extra={"fields": {"table": mapping.table, "filter": str(condition)}},
            )
        self.filtered[relation.relation_id] = (mapping, accepts)

    def named_otherwise(self, relation: Relation, table: str) -> None:
        """An outbox table's oid under another name in this part of the WAL: said once."""
        key = (relation.relation_id, relation.namespace, relation.name)
        if key not in self.renames_logged:
            self.renames_logged.add(key)
            log.info(
                "an outbox table has another name in this part of the WAL: relayed by its oid",
                extra={
                    "fields": {
                        "table": table,
                        "relation_id": relation.relation_id,
                        "name": f"{relation.namespace}.{relation.name}",
                    }
                },
            )

    def ignore(self, relation_id: int) -> None:
        if relation_id not in self.ignored:
            self.ignored.add(relation_id)
            log.warning(
                "ignoring inserts of a relation that is not the outbox table",
                extra={"fields": {"relation_id": relation_id}},
            )

    def dropped_message(self, message: LogicalMessage) -> None:
        """A message with the relayed prefix while messages are off (wal2json cannot be asked
        for none): dropped, and said once per session — any role may emit one."""
        if self.messages_off and message.transactional and not self.dropped_message_logged:
            self.dropped_message_logged = True
            log.warning(
                "dropped a table-less message: CDC_RELAY_MESSAGES is off",
                extra={
                    "fields": {
                        "prefix": message.prefix,
                        "fix": "set CDC_RELAY_MESSAGES=true to relay them (see the README's "
                        "'No table at all')",
                    }
                },
            )
