"""The right to stream as managed services grant it, read by the start-up checks on a real server.

Amazon RDS and Aurora grant it by membership in ``rds_replication`` and leave ``rolreplication``
false. Here the server is made to look like one the only way the checks tell: its parameter
``rds.logical_replication`` exists (set as a placeholder for the test database).
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from cdc_relay.config import load_settings
from cdc_relay.prerequisites import Prerequisites
from cdc_relay.prerequisites.probe import Unmet

pytestmark = pytest.mark.integration

PASSWORD = "managed-role-test-password"


@pytest.fixture
def streaming_member(database: str, unique: str) -> Iterator[str]:
    """A LOGIN role without REPLICATION, a member of a role named rds_replication; its URL."""
    member, group = f"member_{unique}", "rds_replication"
    with psycopg.connect(database, autocommit=True) as conn:
        existed = conn.execute("SELECT to_regrole(%s) IS NOT NULL", (group,)).fetchone()
        if existed is not None and existed[0]:
            pytest.skip("the server already has a role rds_replication: not this test's to change")
        conn.execute(sql.SQL("CREATE ROLE {} NOLOGIN").format(sql.Identifier(group)))
        conn.execute(
            sql.SQL("CREATE ROLE {} LOGIN PASSWORD {} IN ROLE {}").format(
                sql.Identifier(member), sql.Literal(PASSWORD), sql.Identifier(group)
            )
        )
    params = conninfo_to_dict(database)
    params.update(user=member, password=PASSWORD)
    try:
        yield make_conninfo("", **params)
    finally:
        with psycopg.connect(database, autocommit=True) as conn:
            name = sql.Identifier(conn.info.dbname)
            conn.execute(sql.SQL("ALTER DATABASE {} RESET ALL").format(name))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(member)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(group)))


def _replication_role(url: str) -> str:
    settings = load_settings(database_url=url, kafka_bootstrap_servers="unused:9092")
    with psycopg.connect(url, autocommit=True) as conn:
        return Prerequisites(conn, settings).server.replication_role()


def test_a_member_of_rds_replication_may_stream_only_where_the_server_is_rds(
    database: str, streaming_member: str
) -> None:
    with pytest.raises(Unmet, match="GRANT rds_replication TO"):
        _replication_role(streaming_member)  # a role of that name alone proves nothing
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(
            sql.SQL("ALTER DATABASE {} SET rds.logical_replication = 'on'").format(
                sql.Identifier(conn.info.dbname)
            )
        )
    assert _replication_role(streaming_member) == "rds_replication"
