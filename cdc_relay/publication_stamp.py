"""What the relay verified its publication and outbox tables to be — and the one test, in SQL,
that they still are.

The slot decodes each transaction under the catalog as it was when the transaction committed
(its *historic* snapshot): pgoutput sends an insert only if the publication then published the
table's inserts, through its row filter and column list; wal2json sends it only if the table
then had the name in ``add-tables``. A row a change left out is never decoded again from that
WAL — a restart cannot bring it back. So the relay must never confirm a position past WAL decoded
under another publication, or another table, than the one it verified at its start. A check at
some moment cannot see a change undone before it (``DROP TABLE`` then ``ADD TABLE``); the catalog
rows' identities can: every ``ALTER PUBLICATION`` that touches them writes a new row version (a
new ``xmin``) or a new row (a new ``oid``). The *stamp* is those identities, one JSON value:

- pgoutput: the ``pg_publication`` row (any ``SET``, ``RENAME`` or ``OWNER TO``), its
  ``pg_publication_namespace`` rows (PostgreSQL 15+), and per outbox table its
  ``pg_publication_rel`` row (dropped and added again, a row filter or column list set);
- both plugins, per outbox table as configured: the oid its name resolves to (a rename or
  ``DROP`` + ``CREATE`` changes it), its kind (a view keeping the old name), and the ``xmin`` of
  its row type's ``pg_type`` row, which only a rename (or an owner change) rewrites — so a rename
  undone before the next look is seen too.

Outbox tables are thereby identified by oid, resolved by name at the start: pgoutput's relation
id is the oid, so :mod:`cdc_relay.relations` maps a renamed table's rows, and older Relation
messages under its former name, to it.

The relay verifies the publication at its start, reads the stamp, and records it with its
position (``slot_position.publication_stamp``); every later write of the position requires the
stamp found in the same statement to be the verified one (:meth:`~cdc_relay.checkpoint.
PostgresCheckpointStore.save`), and stops the relay with :class:`~cdc_relay.errors.
PublicationChanged` when it is not — no extra round trip, and "confirmed" implies "decoded under
the verified publication" by construction. Each such write also records the oldest transaction
then running (``stamp_checked_xid``): if the stamp a start finds differs from the recorded one in
a way that can have kept rows from the slot (:func:`unrelayed_changes`), the rows of transactions
from there on may never have been streamed. That start takes the sweep boundary afresh (no sweep
deletes them), names them, and plans their recovery (:mod:`cdc_relay.recovery`: ``cdc-relay
recover`` publishes those not in Kafka). The sweeper deletes nothing
while the stamp it finds is not the recorded one (:func:`sweep_refusal`).

Every catalog read here is allowed to any role (the catalogs are PUBLIC's): the least-privilege
role of ``sql/005_relay_role.sql`` needs no grant.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import psycopg
from psycopg import sql

from cdc_relay.config import OutboxTable, Plugin, env_name
from cdc_relay.errors import PublicationChanged

Connection = psycopg.Connection[tuple[object, ...]]

SCHEMA_PUBLICATIONS_VERSION = 150000  # pg_publication_namespace: FOR TABLES IN SCHEMA
MAX_TABLES = 256  # in a recorded stamp: a bound on what a tampered row makes the relay read
_KINDS = {"r": "table", "p": "partitioned table", "v": "view", "m": "materialized view"}


@dataclass(frozen=True)
class PublicationStamp:
    """A stamp as read (see the module documentation): its JSON value, parsed and as text."""

    data: Mapping[str, Any]

    @property
    def text(self) -> str:
        return orjson.dumps(self.data, option=orjson.OPT_SORT_KEYS).decode()

    @property
    def plugin(self) -> str:
        return str(self.data.get("plugin"))

    @property
    def publication(self) -> str:
        return str(self.data.get("publication"))

    def tables(self) -> list[Mapping[str, Any]]:
        found = self.data.get("tables")
        return [t for t in found if isinstance(t, Mapping)] if isinstance(found, list) else []

    def table_oids(self) -> dict[int, str]:
        """The outbox tables' oids as their names resolved at the start: oid -> table."""
        oids: dict[int, str] = {}
        for table in self.tables():
            oid = table.get("oid")
            if isinstance(oid, str) and oid.isdigit() and table.get("kind") in ("r", "p"):
                oids[int(oid)] = str(table.get("table"))
        return oids


def parse(value: object) -> PublicationStamp | None:
    """A stamp as recorded (JSON), or None when there is none or it is not one of ours."""
    if not isinstance(value, Mapping) or not isinstance(value.get("tables"), list):
        return None
    if len(value["tables"]) > MAX_TABLES or value.get("plugin") not in {p.value for p in Plugin}:
        return None
    if not isinstance(value.get("publication"), str):
        return None
    stamp = PublicationStamp(value)
    for table in stamp.tables():
        if not all(isinstance(table.get(key), str) for key in ("table", "schema", "name")):
            return None
    return stamp


# -- the stamp in SQL ----------------------------------------------------------------------------


@dataclass(frozen=True)
class StampQuery:
    """What a stamp is read for: the plugin, the publication and the outbox tables (schema, name
    and the name as configured), on a server of ``server_version``."""

    plugin: str
    publication: str
    tables: tuple[tuple[str, str, str], ...]
    server_version: int

    @classmethod
    def of(
        cls, plugin: Plugin, publication: str, tables: Sequence[OutboxTable], server_version: int
    ) -> StampQuery:
        return cls(
            plugin.value,
            publication,
            tuple((*t.schema_and_name, t.table) for t in tables),
            server_version,
        )

    @classmethod
    def like(cls, stamp: PublicationStamp, server_version: int) -> StampQuery:
        """The query that reads ``stamp`` again (the sweeper: what the relay recorded)."""
        tables = tuple((str(t["schema"]), str(t["name"]), str(t["table"])) for t in stamp.tables())
        return cls(stamp.plugin, stamp.publication, tables, server_version)

    def expression(self) -> sql.Composed:
        """A ``jsonb`` expression of the stamp, the names in it as literals: it can stand in any
        statement (the position's write checks it in its own)."""
        publication = sql.Literal(self.publication)
        pgoutput = self.plugin == Plugin.PGOUTPUT.value
        tables = sql.SQL(
            "(SELECT coalesce(jsonb_agg(jsonb_build_object('table', t.shown, 'schema', t.schema, "
            "'name', t.name, 'oid', c.oid::text, 'kind', c.relkind::text, 'type', ty.xmin::text"
            "{rel}) ORDER BY t.ord), '[]'::jsonb) "
            "FROM unnest({schemas}::text[], {names}::text[], {shown}::text[]) WITH ORDINALITY "
            "AS t(schema, name, shown, ord) "
            "LEFT JOIN pg_catalog.pg_namespace ns ON ns.nspname = t.schema "
            "LEFT JOIN pg_catalog.pg_class c ON c.relnamespace = ns.oid AND c.relname = t.name "
            "LEFT JOIN pg_catalog.pg_type ty ON ty.oid = c.reltype)"
        ).format(
            rel=sql.SQL(
                ", 'rel', (SELECT jsonb_build_array(r.oid::text, r.xmin::text) "
                "FROM pg_catalog.pg_publication_rel r JOIN pg_catalog.pg_publication p "
                "ON p.oid = r.prpubid WHERE p.pubname = {} AND r.prrelid = c.oid)"
            ).format(publication)
            if pgoutput
            else sql.SQL(""),
            schemas=sql.Literal([t[0] for t in self.tables]),
            names=sql.Literal([t[1] for t in self.tables]),
            shown=sql.Literal([t[2] for t in self.tables]),
        )
        parts: list[sql.Composable] = [
            sql.SQL("'plugin', {}, 'publication', {}, 'tables', {}").format(
                sql.Literal(self.plugin), publication, tables
            )
        ]
        if pgoutput:
            parts.append(
                sql.SQL(
                    "'pub', (SELECT jsonb_build_array(p.oid::text, p.xmin::text) "
                    "FROM pg_catalog.pg_publication p WHERE p.pubname = {})"
                ).format(publication)
            )
            if self.server_version >= SCHEMA_PUBLICATIONS_VERSION:
                parts.append(
                    sql.SQL(
                        "'schemas', (SELECT coalesce(jsonb_agg(jsonb_build_array(n.oid::text, "
                        "n.xmin::text) ORDER BY n.oid), '[]'::jsonb) "
                        "FROM pg_catalog.pg_publication_namespace n "
                        "JOIN pg_catalog.pg_publication p ON p.oid = n.pnpubid "
                        "WHERE p.pubname = {})"
                    ).format(publication)
                )
        return sql.SQL("jsonb_build_object({})").format(sql.SQL(", ").join(parts))


def read_stamp(conn: Connection, query: StampQuery) -> PublicationStamp:
    row = conn.execute(sql.SQL("SELECT {}::text").format(query.expression())).fetchone()
    assert row is not None
    return PublicationStamp(orjson.loads(str(row[0])))


# -- what changed --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Change:
    """One difference between two stamps, for an operator: what, and what to do about it."""

    what: str
    fix: str
    renamed_only: bool = False  # a rename (or an owner change): nothing pgoutput sends changed


def changes(
    conn: Connection | None, before: PublicationStamp, now: PublicationStamp
) -> list[Change]:
    """Every difference between ``before`` and ``now``, described (with ``conn``: what the
    catalogs say now of the oids ``before`` names, e.g. a renamed table's new name)."""
    publication = before.publication
    found: list[Change] = []
    restore = (
        f"make publication {publication} publish the inserts of every outbox table again, with "
        "the configured row filter and every column (cdc-relay check names the "
        "statement), then start the relay"
    )
    pub_before, pub_now = before.data.get("pub"), now.data.get("pub")
    if pub_before != pub_now:
        if pub_now is None:
            what = f"publication {publication} no longer exists (dropped, or renamed)"
        elif not isinstance(pub_before, list) or pub_before[:1] != pub_now[:1]:
            what = f"publication {publication} was dropped and created again"
        else:
            what = f"publication {publication} was altered ({_publication_now(conn, publication)})"
        found.append(Change(what, restore))
    if before.data.get("schemas") != now.data.get("schemas"):
        found.append(
            Change(
                f"the schemas publication {publication} publishes changed (ALTER PUBLICATION "
                "... TABLES IN SCHEMA)",
                restore,
            )
        )
    now_tables = {str(t.get("table")): t for t in now.tables()}
    for was in before.tables():
        name = str(was.get("table"))
        table = now_tables.get(name)
        if table is None:
            continue  # no longer configured: the operator's choice, not a change under it
        found += _table_changes(conn, publication, name, was, table, restore=restore)
    return found


def _table_changes(
    conn: Connection | None,
    publication: str,
    name: str,
    was: Mapping[str, Any],
    now: Mapping[str, Any],
    *,
    restore: str,
) -> list[Change]:
    oid = was.get("oid")
    if now.get("oid") != oid:
        renamed = _name_of(conn, oid)
        kind = _KINDS.get(str(now.get("kind")), "relation")
        if renamed is not None:
            what = f"{name} was renamed to {renamed} (oid {oid})"
            if now.get("oid") is not None:
                what += f"; {name} is now a {kind} (oid {now.get('oid')})"
            return [
                Change(
                    what,
                    f"set {env_name('outbox_table')} (or {env_name('outbox_tables')}) to "
                    f"{renamed}, or rename it back, then start the relay",
                )
            ]
        if now.get("oid") is None:
            return [Change(f"{name} was dropped (oid {oid})", restore)]
        what = f"{name} was dropped and re-created (oid {oid}, now {now.get('oid')}, a {kind})"
        fix = "start the relay: it names the rows the slot may not have streamed"
        if now.get("rel") is None and "rel" in now:
            what += f", and the new one is not in publication {publication}"
            fix = f"run ALTER PUBLICATION {publication} ADD TABLE {name}, then {fix}"
        return [Change(what, fix)]
    found: list[Change] = []
    if now.get("type") != was.get("type"):
        found.append(
            Change(
                f"{name} was renamed (and back), or its owner changed",
                "start the relay: it names the rows it may not have streamed meanwhile",
                renamed_only=True,
            )
        )
    if now.get("rel") != was.get("rel"):
        if now.get("rel") is None:
            what = f"{name} is no longer in publication {publication}"
        else:
            what = (
                f"{name} was dropped from publication {publication} and added again, or its row "
                f"filter or column list was set ({_published_as(conn, publication, name)})"
            )
        found.append(Change(what, restore))
    return found


def _name_of(conn: Connection | None, oid: object) -> str | None:
    """The qualified name a table of ``oid`` has now (None: none, or not asked)."""
    if conn is None or not isinstance(oid, str) or not oid.isdigit() or int(oid) >= 1 << 32:
        return None  # not asked, or not an oid (a recorded stamp is a row anyone may edit)
    row = conn.execute(
        "SELECT n.nspname || '.' || c.relname FROM pg_catalog.pg_class c "
        "JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
        "WHERE c.oid = %s::oid AND c.relkind IN ('r', 'p')",
        (oid,),
    ).fetchone()
    return None if row is None else str(row[0])


def _publication_now(conn: Connection | None, publication: str) -> str:
    if conn is None:
        return "ALTER PUBLICATION ... SET, RENAME or OWNER TO"
    row = conn.execute(
        "SELECT pubinsert, pubupdate, pubdelete, pubtruncate, pubviaroot "
        "FROM pg_catalog.pg_publication WHERE pubname = %s",
        (publication,),
    ).fetchone()
    if row is None:
        return "it no longer exists"
    flags = zip(("insert", "update", "delete", "truncate"), row, strict=False)
    actions = [action for action, on in flags if on]
    via_root = "on" if row[4] else "off"
    return f"it publishes {', '.join(actions) or 'nothing'} now; via partition root {via_root}"


def _published_as(conn: Connection | None, publication: str, table: str) -> str:
    if conn is None or conn.info.server_version < SCHEMA_PUBLICATIONS_VERSION:
        return "ALTER PUBLICATION ... SET TABLE"
    row = conn.execute(
        "SELECT rowfilter, array_to_string(attnames, ', ') FROM pg_catalog.pg_publication_tables "
        "WHERE pubname = %s AND schemaname || '.' || tablename = %s",
        (publication, table),
    ).fetchone()
    if row is None:
        return "it is not published now"
    rowfilter, columns = row
    return f"row filter {rowfilter or 'none'}, column list {columns}"


def unrelayed_changes(
    conn: Connection | None, recorded: PublicationStamp | None, found: PublicationStamp
) -> list[Change]:
    """The differences between the stamp a start finds and the one recorded with the position
    that can have kept rows from the slot (empty: none, or nothing recorded to compare with).

    pgoutput publishes by oid: a rename loses nothing (the relay maps the table by its oid, and
    a table configured under its new name is compared by it). wal2json selects by name: a rename
    may have, and so may a recorded table configured under another name now."""
    if recorded is None or recorded.plugin != found.plugin:
        return []
    if recorded.publication != found.publication:
        return []  # another publication configured: an operator's choice, verified at start
    every = changes(conn, recorded, found)
    if found.plugin == Plugin.PGOUTPUT.value:
        return [c for c in every if not c.renamed_only]
    names = {str(t.get("oid")): str(t.get("table")) for t in found.tables()}
    for table in recorded.tables():
        now = names.get(str(table.get("oid")))
        if now is not None and now != table.get("table"):
            every.append(
                Change(
                    f"{table.get('table')} (oid {table.get('oid')}) is configured as {now} now: "
                    "wal2json selects rows by name, and did not send those written under the "
                    "other one",
                    "re-publish the rows named yourself",
                )
            )
    return every


def sweep_refusal(conn: Connection, recorded: object) -> str | None:
    """Why no outbox row may be deleted now: the relay recorded no stamp, or the one found now
    is not the one it recorded (a change the relay has not yet restarted under). None: sweep."""
    stamp = parse(recorded)
    if stamp is None:
        return (
            "the relay has not recorded the publication it verified: a relay of this version "
            "records it when it starts; nothing is swept until then"
        )
    now = read_stamp(conn, StampQuery.like(stamp, conn.info.server_version))
    if now.data == stamp.data:
        return None
    found = changes(conn, stamp, now) or [Change("the publication or an outbox table changed", "")]
    return (
        f"{'; '.join(c.what for c in found)}, since the relay recorded its position: nothing is "
        "swept until the relay has started again under it (rows committed meanwhile may never "
        "have been streamed)"
    )


def change_error(
    conn: Connection | None,
    verified: PublicationStamp,
    found: PublicationStamp,
    resume_at: str | None,
) -> PublicationChanged:
    """The error a write of the position raises on finding ``found`` instead of ``verified``."""
    found_changes = changes(conn, verified, found) or [
        Change("the catalogs it reads differ", "start the relay again")
    ]
    fixes = list(dict.fromkeys(c.fix for c in found_changes))
    resume = f" (it resumes at {resume_at})" if resume_at is not None else ""
    return PublicationChanged(
        f"the publication or an outbox table changed under the relay: "
        f"{'; '.join(c.what for c in found_changes)}. Fix: {'; '.join(fixes)}. Nothing "
        f"decoded since was confirmed{resume}; rows committed after the change that the slot "
        "did not stream are named at that start, and no sweep deletes them"
    )


def unrelayed_message(
    found: Sequence[Change],
    tables: Sequence[OutboxTable],
    *,
    from_xid: int | None,
    to_xid: int | None,
    since: str | None,
) -> tuple[str, dict[str, object]]:
    """A start's ERROR naming the rows the slot may never have streamed: those of transactions
    from ``from_xid`` (the oldest running at the last check that found the stamp unchanged) to
    ``to_xid`` (the sweep boundary just taken), and the query that lists them."""
    conditions = []
    if from_xid is not None:
        conditions.append(sql.SQL("age(xmin) <= age({}::xid)").format(_xid(from_xid)))
    if to_xid is not None:
        conditions.append(sql.SQL("age(xmin) > age({}::xid)").format(_xid(to_xid)))
    where = sql.SQL(" AND ").join(conditions) if conditions else sql.SQL("true")
    find = "; ".join(
        sql.SQL("SELECT {} FROM {} WHERE {}")
        .format(sql.Identifier(t.columns.id), sql.Identifier(*t.schema_and_name), where)
        .as_string(None)
        for t in tables
    )
    message = (
        "the publication or an outbox table changed since the relay last recorded its "
        "position, so rows committed from then on may not have been relayed: the slot decodes "
        "each transaction under the publication as it was when it committed, and never again. "
        "They stay in the outbox (no sweep deletes them): `cdc-relay recover` (with the relays "
        "stopped), or a start with CDC_RELAY_ON_SLOT_LOSS=recover, publishes those that are not "
        "in Kafka, none twice; the query below lists them"
    )
    fields: dict[str, object] = {
        "changes": "; ".join(c.what for c in found),
        "since": since,
        "from_xid": from_xid,
        "to_xid": to_xid,
        "find": find,
    }
    return message, fields


def _xid(full: int) -> sql.Composable:
    """A 64-bit transaction id as the 32-bit ``xid`` that ``age()`` compares (within 2^31 of
    now: what a start names is recent)."""
    return sql.Literal(str(full & 0xFFFFFFFF))
