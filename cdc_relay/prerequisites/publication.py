"""Checks of the publication: it publishes the inserts of exactly the outbox tables, filtered as
configured (an ALL TABLES one, or one with updates or deletes, streams what the relay drops), and
a partitioned outbox's rows as the outbox's (``publish_via_partition_root``: otherwise each row
is published as its partition's, a table the relay does not relay)."""

from __future__ import annotations

from cdc_relay.ddl import create_publication_statement, set_row_filters_statement
from cdc_relay.prerequisites.probe import Checks, Unmet
from cdc_relay.publication_filter import find_mismatch, row_filters_supported
from cdc_relay.replication.source import relation_oid, scalar


class PublicationChecks(Checks):
    """The publication: inserts of exactly the outbox tables, filtered as configured."""

    def publication(self) -> str:
        name = self.settings.publication_name
        wanted = [t.table for t in self.tables]
        create = create_publication_statement(
            name, self.tables, self.conn, row_filters_supported(self.conn)
        )
        row = self.conn.execute(
            "SELECT puballtables, pubinsert, pubupdate, pubdelete, pubtruncate, "
            "pg_get_userbyid(pubowner) FROM pg_publication WHERE pubname = %s",
            (name,),
        ).fetchone()
        if row is None:
            if self._may_create_publication():
                raise Unmet(
                    f"{name} does not exist: run python -m cdc_relay setup (the relay also "
                    f"creates it when it starts), or as the tables' owner: {create}"
                )
            raise Unmet(
                f"{name} does not exist, and {self.user} may not create it (that needs CREATE "
                f"on the database and ownership of the tables): as the tables' owner run {create}"
            )
        *flags, owner = row
        all_tables, insert, update, delete, truncate = (bool(v) for v in flags)
        if all_tables:
            raise Unmet(
                f"{name} publishes ALL TABLES (Debezium's default), so every write of the "
                "database is decoded and sent to the relay, which drops all but the outbox "
                "inserts: replace it in one transaction (no gap for the slot; a relay streaming "
                "meanwhile stops, exit 3, and resumes where it stopped at its next start): "
                f"BEGIN; DROP PUBLICATION {name}; {create} COMMIT;"
            )
        filtered = ""
        if any(t.row_filter for t in self.tables):
            filtered = (
                ", rows filtered in the publication and by the relay"
                if row_filters_supported(self.conn)
                else ", rows filtered by the relay (this server has no publication row filters)"
            )
        published = self._published_tables(name)
        problems = self._coverage(name, published, insert) + self._column_lists(name)
        partitions = {leaf for leaves in self._partitioned(name)[1].values() for leaf in leaves}
        extra = sorted(published - set(wanted) - partitions)
        if extra:
            problems.append(
                f"it also publishes {', '.join(extra)}: run ALTER PUBLICATION {name} DROP TABLE "
                f"{', '.join(extra)}"
            )
        others = [
            a for a, on in (("update", update), ("delete", delete), ("truncate", truncate)) if on
        ]
        if others:
            problems.append(
                f"it publishes {', '.join(others)}; the relay needs inserts only (the sweeper's "
                f"deletes must not stream): run ALTER PUBLICATION {name} SET (publish = 'insert')"
            )
        mismatch = find_mismatch(self.conn, name, self.tables)
        if mismatch is not None:
            who = "the relay sets them when it starts" if mismatch.owned else "as its owner"
            problems.append(
                f"its row filters differ from the settings ({mismatch.describe()}): {who} run "
                f"{mismatch.fix(self.conn)}"
            )
        if problems:
            raise Unmet(f"{name}: " + "; ".join(problems))
        return f"{name} (owner {owner}) publishes inserts of {', '.join(wanted)} only{filtered}"

    def publication_covers(self) -> str:
        """The publication, if it exists, streams the inserts of every outbox table — what the
        relay's start requires (it creates a missing one; ``check`` asks for more)."""
        name = self.settings.publication_name
        insert = scalar(self.conn, "SELECT pubinsert FROM pg_publication WHERE pubname = %s", name)
        if insert is None:
            return f"{name} does not exist yet"
        problems = self._coverage(name, self._published_tables(name), bool(insert))
        problems += self._column_lists(name)
        if problems:
            raise Unmet(f"{name}: " + "; ".join(problems))
        return f"{name} publishes the inserts of every outbox table"

    def publication_streams(self) -> str:
        """:meth:`publication_covers`, and the publication must exist: what the relay verifies
        once it has made it (:func:`cdc_relay.prerequisites.verified_stamp`)."""
        found = self.publication_covers()
        if found.endswith("does not exist yet"):
            raise Unmet(
                f"{self.settings.publication_name} does not exist (dropped while the relay "
                "started?): start the relay again, which creates it"
            )
        return found

    def _column_lists(self, name: str) -> list[str]:
        """PostgreSQL 15+: a column list that leaves out a column the relay reads (rows would
        arrive without it and be dead-lettered)."""
        if not row_filters_supported(self.conn):
            return []
        rows = self.conn.execute(
            "SELECT schemaname || '.' || tablename, attnames::text[] "
            "FROM pg_catalog.pg_publication_tables WHERE pubname = %s",
            (name,),
        ).fetchall()
        published = {
            str(table): [str(c) for c in columns] if isinstance(columns, list) else []
            for table, columns in rows
        }
        problems = []
        for table in self.tables:
            columns = published.get(table.table)
            if columns is None:
                continue  # not published: _coverage says so
            needed = [*table.columns.mapped, *(table.filter.columns if table.filter else ())]
            lacking = [c for c in dict.fromkeys(needed) if c not in columns]
            if lacking:
                fix = set_row_filters_statement(name, [table]).as_string(self.conn)
                problems.append(
                    f"its column list for {table.table} lacks {', '.join(lacking)}, which the "
                    f"relay reads: publish every column again: run {fix}"
                )
        return problems

    def _published_tables(self, name: str) -> set[str]:
        rows = self.conn.execute(
            "SELECT schemaname || '.' || tablename FROM pg_publication_tables WHERE pubname = %s",
            (name,),
        ).fetchall()
        return {str(r[0]) for r in rows}

    def _partitioned(self, name: str) -> tuple[bool, dict[str, set[str]]]:
        """Whether the publication publishes partitions as their root, and each partitioned
        outbox table's partitions (as ``schema.name``)."""
        schemas, names = zip(*(t.schema_and_name for t in self.tables), strict=True)
        rows = self.conn.execute(
            "SELECT coalesce((SELECT pubviaroot FROM pg_publication WHERE pubname = %s), false), "
            "n.nspname || '.' || c.relname, array(SELECT ln.nspname || '.' || lc.relname "
            "  FROM pg_partition_tree(c.oid) p JOIN pg_class lc ON lc.oid = p.relid "
            "  JOIN pg_namespace ln ON ln.oid = lc.relnamespace WHERE p.relid <> c.oid) "
            "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.relkind = 'p' "
            "AND (n.nspname, c.relname) IN (SELECT * FROM unnest(%s::text[], %s::text[]))",
            (name, list(schemas), list(names)),
        ).fetchall()
        via_root = bool(rows[0][0]) if rows else True
        return via_root, {
            str(r[1]): {str(p) for p in r[2]} if isinstance(r[2], list) else set() for r in rows
        }

    def _coverage(self, name: str, published: set[str], insert: bool) -> list[str]:
        problems: list[str] = []
        via_root, partitioned = self._partitioned(name)
        if not via_root:
            # Each partition is published under its own name: the root is not listed, and adding
            # it again would change nothing.
            roots = sorted(t for t, leaves in partitioned.items() if leaves & published)
            problems.append(
                f"{', '.join(sorted(partitioned))} is partitioned and {name} publishes its rows "
                "as rows of each partition (publish_via_partition_root is off), which the relay "
                f"does not relay: run ALTER PUBLICATION {name} SET "
                "(publish_via_partition_root = true)"
            )
            published = published | set(roots)
        missing = [t.table for t in self.tables if t.table not in published]
        if missing:
            problems.append(
                f"it lacks {', '.join(missing)}: run ALTER PUBLICATION {name} ADD TABLE "
                f"{', '.join(missing)}"
            )
        if not insert:
            problems.append(
                "it does not publish inserts, which the relay streams: run ALTER PUBLICATION "
                f"{name} SET (publish = 'insert')"
            )
        return problems

    def _may_create_publication(self) -> bool:
        if not scalar(self.conn, "SELECT has_database_privilege(current_database(), 'CREATE')"):
            return False
        for table in self.tables:
            oid = relation_oid(self.conn, table)
            owned = oid is not None and scalar(
                self.conn,
                "SELECT pg_has_role(relowner, 'USAGE') FROM pg_class WHERE oid = %s",
                oid,
            )
            if not owned:
                return False
        return True
