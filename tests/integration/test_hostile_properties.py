"""Property tests through a real PostgreSQL and broker: whatever a writer puts in an outbox row or a
logical message, it ends in exactly one of three ways — published, dead-lettered, or (policy
``stop``) a clean stop that confirms nothing past it — and the next good row is published.

The rows go into tables of every payload and id type ``check`` accepts, with ``json``/``text``
headers columns that keep any text; the messages are sent as text and as bytea (which can hold
invalid UTF-8 and NUL). Values: deep nesting, megabyte values, lone surrogates, NUL, invalid
UTF-8, every column NULL, numbers at the edges, other column types.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from dataclasses import dataclass, field

import psycopg
import pytest
from hypothesis import HealthCheck, event, given, reject, settings
from hypothesis import strategies as st

from cdc_relay.lsn import parse_lsn
from tests.conftest import KafkaBroker
from tests.hostile_values import json_objects, json_texts, sizes, texts
from tests.integration.hostile_support import (
    ODD_TABLE,
    TABLES,
    create_tables,
    insert,
    outbox_tables_setting,
)
from tests.integration.relay_support import RelayProcess, relay_env, scalar, trust_messages
from tests.kafka_helpers import Reader, Record

# Each runs for both output plugins (pgoutput, wal2json): the decoders meet the hostile values too.
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("plugin")]

OUTCOME_TIMEOUT = 30.0


# -- what a hostile writer writes -----------------------------------------------------------------


@dataclass(frozen=True)
class Hostile:
    """One hostile row (``table`` set) or logical message (``content`` set)."""

    table: str | None = None
    values: dict[str, object] = field(default_factory=dict)
    content: str | bytes | None = None

    @property
    def event_id(self) -> str | None:
        value = self.values.get("id")
        return str(value) if value is not None else None


def _big(size: int) -> str:
    return "x" * size


def _big_json(size: int) -> str:
    return f'"{_big(size)}"'


_ID = {
    "uuid": st.one_of(st.none(), st.uuids().map(str)),
    "text": st.one_of(st.none(), texts(), st.uuids().map(str)),
    "character varying": st.one_of(st.none(), texts(), st.uuids().map(str)),
}
_TEXT = st.one_of(st.none(), texts(), sizes().map(_big))
# The values that broke the relay before issue 11, drawn as often as all the others together.
_NASTY_HEADERS = st.sampled_from(
    [
        '{"h": ' + "[" * 5000 + "]" * 5000 + "}",  # RecursionError, exit 70
        '{"\\ud800": "x"}',  # librdkafka segfault
        '{"a\\u0000b": "x"}',  # a header name cut at the NUL
        '{"h": "' + _big(1_100_000) + '"}',  # too large, and so is its dead-letter copy
    ]
)
_NASTY_TEXT_PAYLOADS = st.sampled_from(["{not json", "NaN", "", _big(1_100_000)])
_PAYLOAD = {
    "jsonb": st.one_of(st.none(), json_texts(json_only=False), sizes().map(_big_json)),
    "json": st.one_of(st.none(), json_texts(), sizes().map(_big_json)),
    "text": st.one_of(
        _NASTY_TEXT_PAYLOADS, st.none(), texts(), json_texts(invalid=True), sizes().map(_big)
    ),
    "bytea": st.one_of(st.none(), st.binary(max_size=64), sizes().map(lambda n: b"\xff" * n)),
}
_PAYLOAD["character varying"] = _PAYLOAD["text"]  # checked to be JSON, like text
_HEADERS = {
    "jsonb": st.one_of(st.none(), json_objects(json_only=False)),
    "json": st.one_of(_NASTY_HEADERS, st.none(), json_objects()),
    "text": st.one_of(_NASTY_HEADERS, st.none(), texts(), json_objects()),
}


_GOOD = {
    "aggregate_type": "order",
    "aggregate_id": "a-1",
    "event_type": "created",
    "payload": '{"n": 1}',
    "headers": '{"k": "v"}',
}
_ODD_GOOD = {"aggregate_type": 7, "aggregate_id": "1.50", "event_type": True}


@st.composite
def _row(draw: st.DrawFn) -> Hostile:
    """A good row with some of its columns (none to all) hostile, or every column NULL."""
    table = draw(st.sampled_from([*TABLES, ODD_TABLE]))
    if draw(st.integers(0, 9)) == 0:
        return Hostile(table, {"id": None, "payload": None, "aggregate_id": None})
    good: dict[str, object] = {**_GOOD, "id": str(uuid.uuid4())}
    if table == ODD_TABLE:
        good.update(_ODD_GOOD)
        hostile: dict[str, st.SearchStrategy[object]] = {
            "id": _ID["text"],
            "aggregate_type": st.one_of(st.none(), st.integers(-(2**31), 2**31 - 1)),
            "aggregate_id": st.one_of(
                st.none(), st.sampled_from(["1e400", "-0", "NaN", "1.10", "1234567890" * 3])
            ),
            "event_type": st.one_of(st.none(), st.booleans()),
            "payload": _PAYLOAD["jsonb"],
            "headers": _HEADERS["jsonb"],
        }
    else:
        id_type, payload_type, headers_type = TABLES[table]
        if payload_type == "bytea":
            good["payload"] = b'{"n": 1}'
        hostile = {
            "id": _ID[id_type],
            "aggregate_type": _TEXT,
            "aggregate_id": _TEXT,
            "event_type": _TEXT,
            "payload": _PAYLOAD[payload_type],
            "headers": _HEADERS[headers_type],
        }
    chosen = draw(st.lists(st.sampled_from(sorted(hostile)), max_size=3, unique=True))
    if table != ODD_TABLE and draw(st.booleans()):
        chosen.append("headers" if draw(st.booleans()) else "payload")
    values = {**good, **{name: draw(hostile[name]) for name in chosen}}
    return Hostile(table, values)


@st.composite
def _message(draw: st.DrawFn) -> Hostile:
    """A good message with some fields hostile, or content that is not a message at all."""
    fields: dict[str, str] = {
        "id": orjson_text(str(uuid.uuid4())),
        "aggregate_type": '"order"',
        "aggregate_id": '"a-1"',
        "event_type": '"created"',
        "payload": '{"n": 1}',
    }
    hostile_value = st.one_of(st.none(), texts(), st.integers(), sizes().map(_big)).map(orjson_text)
    hostile = {
        "id": hostile_value,
        "aggregate_type": hostile_value,
        "aggregate_id": hostile_value,
        "event_type": hostile_value,
        "traceparent": hostile_value,
        "payload": json_texts(invalid=True),
        "headers": json_objects(),
    }
    for name in draw(st.lists(st.sampled_from(sorted(hostile)), max_size=3, unique=True)):
        fields[name] = draw(hostile[name])
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=1)):
        del fields[name]
    text = "{" + ", ".join(f"{orjson_text(k)}: {v}" for k, v in fields.items()) + "}"
    kind = draw(st.sampled_from(["text", "text", "bytea", "bytes", "not json"]))
    if kind == "bytea":
        return Hostile(content=text.encode())
    if kind == "bytes":  # invalid UTF-8, NUL: only bytea content can hold them
        return Hostile(content=draw(st.binary(max_size=64)) + b"\xff\x00" + text.encode())
    if kind == "not json":
        return Hostile(content=draw(texts()))
    return Hostile(content=text)


def orjson_text(value: object) -> str:
    import json  # noqa: PLC0415 - json.dumps: integers of any size, unlike orjson

    return json.dumps(value)


HOSTILE = st.one_of(_row(), _row(), _message())


# -- reading the outcome --------------------------------------------------------------------------


def _topics_and_reader(database: str, broker: KafkaBroker, unique: str) -> tuple[str, str, Reader]:
    """The hostile tables; the events and dead-letter topics, and a reader of both."""
    create_tables(database)
    events, dead_letter = f"{unique}.events", f"{unique}.dead_letter"
    broker.create_topic(events)
    broker.create_topic(dead_letter)
    large = {"fetch.message.max.bytes": 8_000_000}  # what a hostile row may make of a record
    reader = Reader(broker.bootstrap_servers, [events, dead_letter], config=large)
    return events, dead_letter, reader


def _write(database: str, hostile: Hostile) -> tuple[int, int]:
    """Commit ``hostile`` in a transaction of its own; the WAL positions around its commit."""
    with psycopg.connect(database, autocommit=True) as conn:
        before = _insert_lsn(conn)
        try:
            with conn.transaction():
                if hostile.table is not None:
                    insert(conn, hostile.table, hostile.values)
                else:
                    conn.execute(
                        "SELECT pg_logical_emit_message(true, 'outbox', %s)", (hostile.content,)
                    )
        except (psycopg.DataError, psycopg.errors.InvalidTextRepresentation, ValueError):
            reject()  # PostgreSQL refuses the value itself: nothing reaches the relay
        return before, _insert_lsn(conn)


def _insert_lsn(conn: psycopg.Connection[tuple[object, ...]]) -> int:
    row = conn.execute("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn").fetchone()
    assert row is not None
    return int(str(row[0]))


def _good(database: str) -> str:
    event_id = str(uuid.uuid4())
    with psycopg.connect(database, autocommit=True) as conn:
        insert(
            conn,
            "t_jsonb",
            {
                "id": event_id,
                "aggregate_type": "order",
                "aggregate_id": "a-1",
                "event_type": "created",
                "payload": '{"good": true}',
            },
        )
    return event_id


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def _assert_json(value: bytes | None) -> None:
    """A published value is JSON (RFC 8259: no NaN/Infinity), checked with the stdlib parser."""
    assert value is not None
    try:
        json.loads(value, parse_constant=_reject_constant)
    except RecursionError:
        pass  # nested deeper than this parser goes (a jsonb column may hold that): not checked
    except ValueError as exc:
        raise AssertionError(f"published a value that is not JSON: {value[:80]!r}") from exc


def _ids(records: list[Record], header: str = "id") -> list[str]:
    return [(r.header(header) or b"").decode("utf-8", "replace") for r in records]


# -- dead_letter policy -------------------------------------------------------------------------


def test_each_hostile_row_or_message_is_published_or_dead_lettered_exactly_once(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    events, dead_letter, reader = _topics_and_reader(database, broker, unique)
    env = relay_env(
        database,
        broker.bootstrap_servers,
        unique,
        topic_template=events,
        outbox_tables=outbox_tables_setting(),
    )
    env.update(trust_messages(database))
    relay = RelayProcess(env).start()
    outcomes: list[str] = []

    @settings(
        max_examples=60,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    @given(hostile=HOSTILE)
    def each(hostile: Hostile) -> None:
        assert relay.proc is not None
        proc = relay.proc
        assert proc.poll() is None, f"the relay exited ({proc.returncode}):\n{relay.logs()}"
        before, after = _write(database, hostile)
        good = _good(database)

        def settled(records: list[Record]) -> bool:
            return (good in _ids(records) and len(records) >= 2) or proc.poll() is not None

        records = reader.read_until(settled, OUTCOME_TIMEOUT)
        # No wait for a duplicate here: each example takes exactly its two records from the one
        # reader, so a late duplicate is a record too many in a later example's read (a second
        # outcome, or one of another transaction) or, after the last example, in the final read.
        assert good in _ids(records), f"the good row after {hostile!r} was not published"
        rest = [r for r in records if r.topic != events or _ids([r]) != [good]]
        assert len(rest) == 1, (
            f"{hostile!r} (or, a late duplicate, the example before it) ended {len(rest)} times: "
            f"{rest!r}"
        )
        (outcome,) = rest
        if outcome.topic == dead_letter:
            commit = parse_lsn((outcome.header("cdc_relay.commit_lsn") or b"").decode())
            assert before <= commit <= after, "the dead letter is of this row's transaction"
            assert outcome.header("cdc_relay.error")
            reason = (outcome.header("cdc_relay.error") or b"").decode("utf-8", "replace")
            outcomes.append(f"dead-lettered: {reason[:50]}")
            event(outcomes[-1])
        else:
            assert outcome.topic == events
            if hostile.event_id is not None:
                assert _ids([outcome]) == [hostile.event_id]
            if hostile.table == "t_bytea":
                assert outcome.value == hostile.values["payload"], "a bytea payload is its bytes"
            else:
                _assert_json(outcome.value)
            outcomes.append("published")
            event("published")

    try:
        relay.wait_streaming()
        each()
        late = reader.read_until(lambda _: False, 1.0)
        assert late == [], f"a duplicate arrived after the last example: {late!r}"
        assert relay.proc is not None
        assert relay.proc.poll() is None, relay.logs()
        assert relay.stop() == 0
        logs = relay.logs()
    finally:
        reader.close()
        relay.close()
    assert "session ended" not in logs, "no row restarts the replication session"
    assert "Traceback" not in logs
    dead_lettered = [o for o in outcomes if o.startswith("dead-lettered")]
    assert logs.count("poison record sent to the dead-letter topic") == len(dead_lettered)
    print("outcomes:", Counter(outcomes).most_common())
    assert "published" in outcomes
    assert dead_lettered


# -- stop policy ----------------------------------------------------------------------------------


def test_under_the_stop_policy_a_hostile_row_is_published_or_stops_cleanly(
    database: str, broker: KafkaBroker, unique: str
) -> None:
    events, dead_letter, reader = _topics_and_reader(database, broker, unique)
    outcomes: list[str] = []
    messages = trust_messages(database)

    @settings(
        max_examples=10, deadline=None, suppress_health_check=list(HealthCheck), database=None
    )
    @given(hostile=HOSTILE)
    def each(hostile: Hostile) -> None:
        run = uuid.uuid4().hex[:8]
        slot = f"slot_{unique}_{run}"
        env = relay_env(
            database,
            broker.bootstrap_servers,
            unique,
            topic_template=events,
            outbox_tables=outbox_tables_setting(),
            slot_name=slot,
            publication_name=f"pub_{unique}",
        )
        env.update(messages)
        relay = RelayProcess({**env, "CDC_RELAY_POISON_POLICY": "stop"}).start()
        try:
            relay.wait_streaming()
            before, after = _write(database, hostile)
            good = _good(database)
            assert relay.proc is not None
            proc = relay.proc
            records = reader.read_until(lambda r: good in _ids(r) or proc.poll() is not None, 30)
            stopped = proc.poll() is not None
            code = relay.wait(30) if stopped else relay.stop()
            logs = relay.logs()
        finally:
            relay.close()
        if stopped:
            # A clean stop: exit 5, nothing of the row or after it published.
            assert code == 5, logs
            assert records == [], records
            # Nothing past the row was confirmed: the next start (dead-letter policy) streams it
            # again and dead-letters it, then publishes the good row.
            relay = RelayProcess(env).start()
            try:
                relay.wait_streaming()
                records += reader.read_until(
                    lambda r: good in _ids(r) and any(x.topic == dead_letter for x in r), 30
                )
                assert relay.stop() == 0
            finally:
                relay.close()
            assert good in _ids(records)
            (letter,) = [r for r in records if r.topic == dead_letter]
            commit = parse_lsn((letter.header("cdc_relay.commit_lsn") or b"").decode())
            assert before <= commit <= after, "the dead letter is of this row's transaction"
            outcomes.append("stopped")
        else:
            assert code == 0, logs
            assert good in _ids(records)
            outcomes.append("published")
        scalar(database, "SELECT pg_drop_replication_slot(%s)", slot)

    try:
        each()
    finally:
        reader.close()
    print("outcomes:", Counter(outcomes).most_common())
    assert outcomes
