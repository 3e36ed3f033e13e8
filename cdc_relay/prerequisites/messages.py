"""Checks of table-less messages: off, or on with only the roles the operator chose able to
emit one (PostgreSQL lets PUBLIC execute ``pg_logical_emit_message``)."""

from __future__ import annotations

from psycopg import sql

from cdc_relay.ddl import EMIT_SQL
from cdc_relay.prerequisites.probe import Checks, Unmet

# The functions (p: pg_proc) whose callers can write a table-less event: every overload of
# pg_logical_emit_message, and an outbox_emit running as its owner (sql/004_outbox_emit.sql).
_EMITTERS = sql.SQL(
    "(p.proname = 'pg_logical_emit_message' AND p.pronamespace = 'pg_catalog'::regnamespace) "
    "OR (p.proname = 'outbox_emit' AND p.prosecdef)"
)
MAX_ROLES_SHOWN = 10


class MessageChecks(Checks):
    """Table-less messages: off, or on with only chosen roles able to emit them."""

    def messages(self) -> str:
        """Table-less messages: off, or on with only roles the operator chose able to write one.
        Any role that may execute ``pg_logical_emit_message`` can publish an event, and PostgreSQL
        lets PUBLIC; so may anyone allowed to call a SECURITY DEFINER ``outbox_emit``."""
        if not self.settings.messages:
            emit = self.emit_functions()
            if emit:
                return (
                    f"off; function {', '.join(emit)} exists, but what it writes is not relayed: "
                    "set CDC_RELAY_MESSAGES=true if writers use it (or drop it)"
                )
            return "off (CDC_RELAY_MESSAGES): table-less messages are not relayed"
        rows = self.conn.execute(
            sql.SQL(
                "SELECT p.oid::regprocedure::text FROM pg_proc p WHERE ({}) "
                "AND has_function_privilege('public', p.oid, 'EXECUTE') ORDER BY 1"
            ).format(_EMITTERS)
        ).fetchall()
        if rows:
            public = [str(r[0]) for r in rows]
            revokes = " ".join(f"REVOKE EXECUTE ON FUNCTION {f} FROM PUBLIC;" for f in public)
            raise Unmet(
                f"CDC_RELAY_MESSAGES is on and PUBLIC may execute {', '.join(public)}: any role "
                "could publish an event. Run python -m cdc_relay setup as a superuser "
                f"(sql/{EMIT_SQL}), or as a superuser: {revokes} Then grant writers "
                f"EXECUTE on outbox_emit only"
            )
        roles = [
            str(r[0])
            for r in self.conn.execute(
                sql.SQL(
                    "SELECT DISTINCT r.rolname FROM pg_roles r, pg_proc p WHERE NOT r.rolsuper "
                    "AND r.rolname !~ '^pg_' AND ({}) "
                    "AND has_function_privilege(r.oid, p.oid, 'EXECUTE') ORDER BY 1"
                ).format(_EMITTERS)
            ).fetchall()
        ]
        shown = ", ".join(roles[:MAX_ROLES_SHOWN]) or "none"
        if len(roles) > MAX_ROLES_SHOWN:
            shown += f" and {len(roles) - MAX_ROLES_SHOWN} more"
        prefix = self.settings.message_prefix
        return f"on, prefix {prefix!r}; roles that may emit besides superusers: {shown}"

    def emit_functions(self) -> list[str]:
        rows = self.conn.execute(
            "SELECT oid::regprocedure::text FROM pg_proc WHERE proname = 'outbox_emit' ORDER BY 1"
        ).fetchall()
        return [str(r[0]) for r in rows]
