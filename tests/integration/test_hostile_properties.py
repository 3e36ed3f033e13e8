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
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import orjson
import psycopg
import pytest
from hypothesis import HealthCheck, event, given, reject, settings
from hypothesis import strategies as st
from psycopg import sql

from cdc_relay.lsn import parse_lsn
from tests.conftest import KafkaBroker
from tests.hostile_values import (
    NUMBER_OIDS,
    PG_TYPES,
    json_objects,
    json_texts,
    numeric_texts,
    rendered,
    sizes,
    texts,
)
from tests.integration.hostile_support import (
    ODD_TABLE,
    TABLES,
    VALUE_TABLES,
    create_tables,
    create_value_tables,
    insert,
    outbox_tables_setting,
    value_column,
    value_tables_setting,
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


def _topics_and_reader(
    database: str, broker: KafkaBroker, unique: str, create: Callable[[str], None] = create_tables
) -> tuple[str, str, Reader]:
    """The tables (``create``: the hostile ones); the events and dead-letter topics, and a reader
    of both."""
    create(database)
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


# -- values at PostgreSQL's extremes --------------------------------------------------------------

_TYPE_NAMES = sorted(PG_TYPES)
_MAX_RECORD = 1_000_000  # librdkafka's message.max.bytes, the relay's default


# A headers object's entries as the relay must send them: strings decoded, numbers as their text.
_HEADERS_ORACLE = json.JSONDecoder(parse_int=str, parse_float=str)


# jsonb numbers for the headers object: past int()'s 4,300 digits often, NaN never (not JSON).
_HEADER_NUMBERS = st.one_of(
    st.sampled_from(["9" * 4_301, "-" + "9" * 131_072, "1.10", "-0"]),
    numeric_texts().filter(lambda n: n[-1].isdigit()),
)


@st.composite
def _value_row(draw: st.DrawFn) -> Hostile:
    """A row of a value table: some typed columns at their extremes (the rest NULL), sometimes
    every column NULL; in t_numeric a numeric payload and aggregate id at theirs."""
    table = draw(st.sampled_from(VALUE_TABLES))
    good: dict[str, object] = {**_GOOD, "id": str(uuid.uuid4())}
    if table == "t_numeric":
        numeric = st.one_of(st.none(), numeric_texts())
        return Hostile(table, {**good, "payload": draw(numeric), "aggregate_id": draw(numeric)})
    if draw(st.integers(0, 9)) == 0:
        return Hostile(table, dict.fromkeys(["id", *map(value_column, _TYPE_NAMES)]))
    for name in draw(st.lists(st.sampled_from(_TYPE_NAMES), min_size=1, max_size=4, unique=True)):
        good[value_column(name)] = draw(PG_TYPES[name][1])
    numbers = draw(st.lists(_HEADER_NUMBERS, max_size=2))
    good["headers"] = json.dumps({f"n{i}": 0 for i in range(len(numbers))})
    for i, number in enumerate(numbers):  # numbers json.dumps cannot write: spliced in
        good["headers"] = str(good["headers"]).replace(f'"n{i}": 0', f'"n{i}": {number}')
    return Hostile(table, good)


def _texts_of(database: str, table: str, event_id: str) -> dict[str, tuple[int, str | None]]:
    """The row's columns as PostgreSQL's output functions print them (the ground truth; a cast to
    text may differ: boolean's is true, its output t): name -> (type OID, text)."""
    with psycopg.connect(database) as conn:
        query = sql.SQL("SELECT * FROM {} WHERE id = $1").format(sql.Identifier(table))
        result = conn.pgconn.exec_params(query.as_bytes(conn), [event_id.encode()])
        assert result.ntuples == 1, result.get_error_message()
        texts = {}
        for i in range(result.nfields):
            value = result.get_value(0, i)
            name = (result.fname(i) or b"").decode()
            texts[name] = (result.ftype(i), None if value is None else bytes(value).decode())
    return texts


def _lost_by(plugin: str, oid: int, text: str | None) -> str | None:
    """What the plugin delivers for a value: wal2json prints numbers' NaN/±Infinity as null."""
    if plugin == "wal2json" and oid in NUMBER_OIDS and text in ("NaN", "Infinity", "-Infinity"):
        return None
    return text


def test_each_value_postgresql_stores_is_relayed_exactly_or_dead_lettered(
    database: str, broker: KafkaBroker, unique: str, plugin: str
) -> None:
    """Rows with a column of every type at its extremes (numeric of 131,072 + 16,383 digits,
    NaN, ±Infinity, -0, megabytes of text, bytea, nested arrays with NULLs, deep json,
    timestamps at ±infinity, NULL) through the real stream of both plugins: each is published
    exactly as PostgreSQL prints it (``value: row`` says every column in JSON, a plain record
    its payload, key and headers) or dead-lettered for its reason; the relay runs on."""
    events, dead_letter, reader = _topics_and_reader(
        database, broker, unique, partial(create_value_tables, type_names=_TYPE_NAMES)
    )
    env = relay_env(
        database,
        broker.bootstrap_servers,
        unique,
        topic_template=events,
        outbox_tables=value_tables_setting(),
    )
    relay = RelayProcess(env).start()
    outcomes: list[str] = []

    @settings(
        max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None
    )
    @given(hostile=_value_row())
    def each(hostile: Hostile) -> None:
        assert relay.proc is not None
        proc = relay.proc
        assert proc.poll() is None, f"the relay exited ({proc.returncode}):\n{relay.logs()}"
        assert hostile.table is not None
        _write(database, hostile)
        good = _good_value_row(database)

        def settled(records: list[Record]) -> bool:
            return (good in _ids(records) and len(records) >= 2) or proc.poll() is not None

        records = reader.read_until(settled, OUTCOME_TIMEOUT)
        assert good in _ids(records), f"the good row after {hostile!r:.300} was not published"
        (outcome,) = [r for r in records if r.topic != events or _ids([r]) != [good]]
        expected = _expected(database, plugin, hostile)
        if outcome.topic == dead_letter:
            code = (outcome.header("cdc_relay.error_code") or b"").decode()
            reason = (outcome.header("cdc_relay.error") or b"").decode()
            assert expected in (code, "either"), f"{hostile!r:.300}: {code} {reason}"
            outcomes.append(f"dead-lettered: {code}")
        else:
            assert expected in ("published", "either"), f"{hostile!r:.300} was published"
            _assert_exact(database, plugin, hostile, outcome)
            outcomes.append(f"published from {hostile.table}")
        event(outcomes[-1])

    try:
        relay.wait_streaming()
        each()
        assert relay.stop() == 0
        logs = relay.logs()
    finally:
        reader.close()
        relay.close()
    assert "session ended" not in logs, "no value restarts the replication session"
    assert "Traceback" not in logs
    print("outcomes:", Counter(outcomes).most_common())
    assert any(o.startswith("published") for o in outcomes)


def _good_value_row(database: str) -> str:
    event_id = str(uuid.uuid4())
    with psycopg.connect(database, autocommit=True) as conn:
        insert(conn, "t_values", {**_GOOD, "id": event_id, "v_numeric": "1.10"})
    return event_id


def _expected(database: str, plugin: str, hostile: Hostile) -> str:
    """How the row must end: published, MALFORMED_OUTBOX_ROW, MSG_SIZE_TOO_LARGE or either."""
    if hostile.values.get("id") is None:
        return "MALFORMED_OUTBOX_ROW"
    assert hostile.table is not None
    texts = _texts_of(database, hostile.table, str(hostile.values["id"]))
    if hostile.table == "t_numeric":
        payload = _lost_by(plugin, *texts["payload"])
        key = _lost_by(plugin, *texts["aggregate_id"])
        if payload is None or key is None or not payload[-1].isdigit():  # NaN, Infinity: not JSON
            return "MALFORMED_OUTBOX_ROW"
        return "published"
    if hostile.table == "t_values_row":
        size = len(orjson.dumps(_row_json(plugin, texts)))
        if size > _MAX_RECORD:
            return "MSG_SIZE_TOO_LARGE"
        return "published" if size < _MAX_RECORD - 50_000 else "either"
    return "published"


def _row_json(plugin: str, texts: dict[str, tuple[int, str | None]]) -> dict[str, object]:
    return {name: rendered(oid, _lost_by(plugin, oid, text)) for name, (oid, text) in texts.items()}


def _assert_exact(database: str, plugin: str, hostile: Hostile, record: Record) -> None:
    """The record says exactly what PostgreSQL prints for the row."""
    assert hostile.table is not None
    texts = _texts_of(database, hostile.table, str(hostile.values["id"]))
    if hostile.table == "t_values_row":
        assert record.value == orjson.dumps(_row_json(plugin, texts))
        return
    assert record.key == (texts["aggregate_id"][1] or "").encode()
    assert record.value == (texts["payload"][1] or "").encode()
    expected = [
        (name, value.encode())
        for name, value in _HEADERS_ORACLE.decode(texts["headers"][1] or "{}").items()
    ]
    assert [h for h in record.headers[3:] if not h[0].startswith("cdc_relay.")] == expected


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
