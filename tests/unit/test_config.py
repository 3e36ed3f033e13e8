"""Unit tests for cdc_relay.config: sources and precedence, validation, secrets, producer config."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg.conninfo import conninfo_to_dict

from cdc_relay.config import (
    LogFormat,
    PoisonPolicy,
    Settings,
    check_producer_config,
    env_name,
    is_secret_property,
    load_settings,
    parse_properties,
    redact_properties,
    redact_url,
    split_property,
)
from cdc_relay.database_url import has_password
from cdc_relay.errors import ConfigError, RelayError
from cdc_relay.postgres_errors import connect_failure_kind

DB_PASSWORD = "hunter2-db-Pw"
SASL_PASSWORD = "s3cret-sasl-Pw"
DB_URL = f"postgresql://relay:{DB_PASSWORD}@db.example:5432/app"
REQUIRED: dict[str, Any] = {"database_url": DB_URL, "kafka_bootstrap_servers": "kafka:9092"}


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No CDC_RELAY_* variable from the outer environment, and no stray .env file."""
    for name in list(os.environ):
        if name.upper().startswith("CDC_RELAY_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)


def config_error(**overrides: Any) -> str:
    with pytest.raises(ConfigError) as info:
        load_settings(**overrides)
    return str(info.value)


def assert_no_secret(text: str) -> None:
    assert DB_PASSWORD not in text
    assert SASL_PASSWORD not in text


# -- defaults and sources -------------------------------------------------------------------------


def test_defaults() -> None:
    settings = load_settings(**REQUIRED)
    assert settings.outbox_table == "public.outbox"
    assert settings.tables()[0].schema_and_name == ("public", "outbox")
    assert settings.slot_name == "cdc_relay"
    assert settings.publication_name == "cdc_relay_outbox"
    assert settings.topic_template == "outbox.event.{aggregate_type}"
    assert settings.kafka_producer_config == {}
    assert settings.poison_policy is PoisonPolicy.DEAD_LETTER
    assert settings.dead_letter_topic == "cdc_relay.dead_letter"
    assert settings.state_schema == "cdc_relay"
    assert settings.allow_slot_reset is False
    assert settings.log_format is LogFormat.PLAIN
    assert settings.log_level == "INFO"
    assert settings.database_url.get_secret_value() == DB_URL
    assert settings.kafka_bootstrap_servers == "kafka:9092"


def test_env_name() -> None:
    assert env_name("slot_name") == "CDC_RELAY_SLOT_NAME"


def test_environment_with_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CDC_RELAY_DATABASE_URL", DB_URL)
    monkeypatch.setenv("CDC_RELAY_KAFKA_BOOTSTRAP_SERVERS", "k1:9092,k2:9092")
    monkeypatch.setenv("CDC_RELAY_SLOT_NAME", "orders_slot")
    monkeypatch.setenv("CDC_RELAY_OUTBOX_TABLE", "sales.events")
    monkeypatch.setenv("CDC_RELAY_ALLOW_SLOT_RESET", "true")
    monkeypatch.setenv("CDC_RELAY_CONFIRM_INTERVAL", "0.25")
    monkeypatch.setenv("CDC_RELAY_POISON_POLICY", "stop")
    monkeypatch.setenv("CDC_RELAY_LOG_FORMAT", "json")
    monkeypatch.setenv("CDC_RELAY_LOG_LEVEL", "debug")
    monkeypatch.setenv("SLOT_NAME", "unprefixed_is_ignored")
    settings = load_settings()
    assert settings.database_url.get_secret_value() == DB_URL
    assert settings.kafka_bootstrap_servers == "k1:9092,k2:9092"
    assert settings.slot_name == "orders_slot"
    assert settings.tables()[0].schema_and_name == ("sales", "events")
    assert settings.allow_slot_reset is True
    assert settings.confirm_interval == 0.25
    assert settings.poison_policy is PoisonPolicy.STOP
    assert settings.log_format is LogFormat.JSON
    assert settings.log_level == "DEBUG"


def test_unknown_prefixed_variables_are_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CDC_RELAY_TEST_DATABASE_URL", "postgresql://elsewhere/db")
    assert load_settings(**REQUIRED).slot_name == "cdc_relay"


def test_dotenv_file_in_working_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / ".env").write_text(
        f"CDC_RELAY_DATABASE_URL={DB_URL}\n"
        "CDC_RELAY_KAFKA_BOOTSTRAP_SERVERS=from-dotenv:9092\n"
        "CDC_RELAY_PUBLICATION_NAME=pub_from_dotenv\n"
        'CDC_RELAY_KAFKA_PRODUCER_CONFIG={"linger.ms": 9}\n',
        encoding="utf-8",
    )
    monkeypatch.chdir(tmp_path)
    settings = load_settings()
    assert settings.database_url.get_secret_value() == DB_URL
    assert settings.kafka_bootstrap_servers == "from-dotenv:9092"
    assert settings.publication_name == "pub_from_dotenv"
    assert settings.kafka_producer_config == {"linger.ms": "9"}


def test_environment_beats_dotenv(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / ".env").write_text(
        f"CDC_RELAY_DATABASE_URL={DB_URL}\n"
        "CDC_RELAY_KAFKA_BOOTSTRAP_SERVERS=from-dotenv:9092\n"
        "CDC_RELAY_SLOT_NAME=dotenv_slot\n",
        encoding="utf-8",
    )
    monkeypatch.setenv("CDC_RELAY_SLOT_NAME", "env_slot")
    assert load_settings().slot_name == "env_slot"


def test_explicit_overrides_beat_env_and_dotenv(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / ".env").write_text(
        "CDC_RELAY_SLOT_NAME=dotenv_slot\nCDC_RELAY_TOPIC_TEMPLATE=dotenv.{table}\n",
        encoding="utf-8",
    )
    monkeypatch.setenv("CDC_RELAY_DATABASE_URL", "postgresql://env/db")
    monkeypatch.setenv("CDC_RELAY_KAFKA_BOOTSTRAP_SERVERS", "env:9092")
    monkeypatch.setenv("CDC_RELAY_SLOT_NAME", "env_slot")
    settings = load_settings(slot_name="flag_slot", kafka_bootstrap_servers="flag:9092")
    assert settings.slot_name == "flag_slot"
    assert settings.kafka_bootstrap_servers == "flag:9092"
    assert settings.database_url.get_secret_value() == "postgresql://env/db"
    assert settings.topic_template == "dotenv.{table}"


def test_none_override_means_not_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CDC_RELAY_SLOT_NAME", "env_slot")
    assert load_settings(**REQUIRED, slot_name=None).slot_name == "env_slot"


def test_settings_are_frozen() -> None:
    settings = load_settings(**REQUIRED)
    with pytest.raises(ValueError, match="frozen"):
        settings.slot_name = "other"


def test_outbox_table_without_schema_defaults_to_public() -> None:
    assert load_settings(**REQUIRED, outbox_table="events").outbox_table == "public.events"


# -- validation -----------------------------------------------------------------------------------


def test_missing_required_settings_are_named() -> None:
    message = config_error()
    assert "CDC_RELAY_DATABASE_URL" in message
    assert "CDC_RELAY_KAFKA_BOOTSTRAP_SERVERS" in message
    assert "required" in message


def test_only_the_missing_setting_is_named() -> None:
    message = config_error(database_url=DB_URL)
    assert "CDC_RELAY_KAFKA_BOOTSTRAP_SERVERS" in message
    assert "CDC_RELAY_DATABASE_URL" not in message
    assert_no_secret(message)


def test_config_error_is_a_relay_error_with_exit_code_2() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert isinstance(info.value, RelayError)
    assert info.value.exit_code == 2


@pytest.mark.parametrize(
    ("field", "value", "env"),
    [
        ("slot_name", "Upper_Case", "CDC_RELAY_SLOT_NAME"),
        ("slot_name", "with-dash", "CDC_RELAY_SLOT_NAME"),
        ("slot_name", "", "CDC_RELAY_SLOT_NAME"),
        ("slot_name", "a" * 64, "CDC_RELAY_SLOT_NAME"),
        ("topic_template", "outbox.{aggregate}", "CDC_RELAY_TOPIC_TEMPLATE"),
        ("topic_template", "outbox.{0}", "CDC_RELAY_TOPIC_TEMPLATE"),
        ("topic_template", "outbox.{}", "CDC_RELAY_TOPIC_TEMPLATE"),
        ("topic_template", "outbox.{aggregate_type", "CDC_RELAY_TOPIC_TEMPLATE"),
        ("outbox_table", "a.b.c", "CDC_RELAY_OUTBOX_TABLE"),
        ("outbox_table", "public.out-box", "CDC_RELAY_OUTBOX_TABLE"),
        ("outbox_table", "public.", "CDC_RELAY_OUTBOX_TABLE"),
        ("outbox_table", "1public.outbox", "CDC_RELAY_OUTBOX_TABLE"),
        ("outbox_table", 'public."Outbox"', "CDC_RELAY_OUTBOX_TABLE"),
        ("publication_name", "bad name", "CDC_RELAY_PUBLICATION_NAME"),
        ("state_schema", "x;drop", "CDC_RELAY_STATE_SCHEMA"),
        ("log_level", "verbose", "CDC_RELAY_LOG_LEVEL"),
        ("log_format", "xml", "CDC_RELAY_LOG_FORMAT"),
        ("poison_policy", "ignore", "CDC_RELAY_POISON_POLICY"),
        ("slot_failover", "maybe", "CDC_RELAY_SLOT_FAILOVER"),
        ("confirm_interval", "0", "CDC_RELAY_CONFIRM_INTERVAL"),
        ("shutdown_timeout", "-1", "CDC_RELAY_SHUTDOWN_TIMEOUT"),
        ("producer_queue_max_messages", "0", "CDC_RELAY_PRODUCER_QUEUE_MAX_MESSAGES"),
        ("kafka_bootstrap_servers", "", "CDC_RELAY_KAFKA_BOOTSTRAP_SERVERS"),
    ],
)
def test_invalid_setting_names_the_variable(field: str, value: str, env: str) -> None:
    message = config_error(**{**REQUIRED, field: value})
    assert message.startswith("invalid configuration: ")
    assert env in message
    assert_no_secret(message)


def test_unknown_template_field_is_listed() -> None:
    message = config_error(**REQUIRED, topic_template="{aggregate_type}.{tenant}")
    assert "CDC_RELAY_TOPIC_TEMPLATE" in message
    assert "tenant" in message


@pytest.mark.parametrize(
    "template",
    [
        "outbox.event.{aggregate_type}",
        "{schema}.{table}.{event_type}",
        "static-topic",
        "x.{{literal}}.{aggregate_type}",
    ],
)
def test_valid_templates(template: str) -> None:
    assert load_settings(**REQUIRED, topic_template=template).topic_template == template


def test_slot_name_limits() -> None:
    assert load_settings(**REQUIRED, slot_name="a" * 63).slot_name == "a" * 63
    assert load_settings(**REQUIRED, slot_name="slot_2").slot_name == "slot_2"


def test_several_problems_are_all_reported() -> None:
    message = config_error(**REQUIRED, slot_name="BAD", outbox_table="a.b.c")
    assert "CDC_RELAY_SLOT_NAME" in message
    assert "CDC_RELAY_OUTBOX_TABLE" in message


def test_bad_json_in_producer_config_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CDC_RELAY_KAFKA_PRODUCER_CONFIG", f'{{"sasl.password": "{SASL_PASSWORD}"')
    message = config_error(**REQUIRED)
    assert "CDC_RELAY_KAFKA_PRODUCER_CONFIG" in message
    assert "JSON" in message
    assert_no_secret(message)


def test_producer_config_env_that_is_not_an_object(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CDC_RELAY_KAFKA_PRODUCER_CONFIG", f'["{SASL_PASSWORD}"]')
    message = config_error(**REQUIRED)
    assert "CDC_RELAY_KAFKA_PRODUCER_CONFIG" in message
    assert_no_secret(message)


def test_producer_config_env_json_numbers_and_bools_become_strings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(
        "CDC_RELAY_KAFKA_PRODUCER_CONFIG",
        json.dumps(
            {
                "linger.ms": 7,
                "batch.num.messages": 1000,
                "socket.keepalive.enable": True,
                "enable.ssl.certificate.verification": False,
                "retry.backoff.ms": 2.5,
                "security.protocol": "SASL_SSL",
            }
        ),
    )
    assert load_settings(**REQUIRED).kafka_producer_config == {
        "linger.ms": "7",
        "batch.num.messages": "1000",
        "socket.keepalive.enable": "true",
        "enable.ssl.certificate.verification": "false",
        "retry.backoff.ms": "2.5",
        "security.protocol": "SASL_SSL",
    }


# -- secrets --------------------------------------------------------------------------------------


def secret_settings() -> Settings:
    return load_settings(
        **REQUIRED,
        kafka_producer_config={
            "security.protocol": "SASL_SSL",
            "sasl.username": "relay",
            "sasl.password": SASL_PASSWORD,
        },
    )


def test_describe_hides_passwords() -> None:
    described = secret_settings().describe()
    assert (
        described["database_url"] == "host=db.example port=5432 dbname=app user=relay password=***"
    )
    assert described["kafka_producer_config"] == {
        "security.protocol": "SASL_SSL",
        "sasl.username": "relay",
        "sasl.password": "***",
    }
    assert described["slot_name"] == "cdc_relay"
    assert described["poison_policy"] == "dead_letter"
    text = json.dumps(described)  # JSON-serialisable, ready for a log line
    assert_no_secret(text)


def test_describe_hides_password_of_a_key_value_conninfo() -> None:
    settings = load_settings(
        database_url=f"host=db user=relay password={DB_PASSWORD} dbname=app",
        kafka_bootstrap_servers="k:1",
    )
    assert settings.describe()["database_url"] == "host=db dbname=app user=relay password=***"


def test_repr_and_str_of_settings_hide_passwords() -> None:
    settings = secret_settings()
    assert_no_secret(repr(settings))
    assert_no_secret(str(settings))


def test_config_errors_never_contain_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CDC_RELAY_DATABASE_URL", DB_URL)
    monkeypatch.setenv("CDC_RELAY_KAFKA_BOOTSTRAP_SERVERS", "k:1")
    monkeypatch.setenv(
        "CDC_RELAY_KAFKA_PRODUCER_CONFIG",
        json.dumps({"sasl.password": SASL_PASSWORD, "enable.idempotence": "false"}),
    )
    monkeypatch.setenv("CDC_RELAY_SLOT_NAME", f"slot-{SASL_PASSWORD}")
    message = config_error()
    assert "CDC_RELAY_KAFKA_PRODUCER_CONFIG" in message
    assert "CDC_RELAY_SLOT_NAME" in message
    assert_no_secret(message)


@pytest.mark.parametrize(
    ("key", "secret"),
    [
        ("sasl.password", True),
        ("ssl.key.password", True),
        ("sasl.oauthbearer.client.secret", True),
        ("sasl.jaas.config", True),
        ("sasl.oauthbearer.config", True),
        ("ssl.key.pem", True),
        ("ssl.certificate.pem", True),
        ("SASL.PASSWORD", True),
        ("sasl.username", False),
        ("linger.ms", False),
        ("bootstrap.servers", False),
    ],
)
def test_is_secret_property(key: str, secret: bool) -> None:
    assert is_secret_property(key) is secret


def test_redact_properties_keeps_order_and_other_values() -> None:
    assert redact_properties({"a": "1", "ssl.key.password": "x", "b": "2"}) == {
        "a": "1",
        "ssl.key.password": "***",
        "b": "2",
    }


# -- producer configuration -----------------------------------------------------------------------


def test_producer_config_defaults() -> None:
    config = load_settings(**REQUIRED).producer_config()
    assert config["bootstrap.servers"] == "kafka:9092"
    assert config["enable.idempotence"] == "true"
    assert config["acks"] == "all"
    assert config["linger.ms"] == "5"
    assert config["message.timeout.ms"] == "0"
    assert config["queue.buffering.max.messages"] == "20000"
    assert config["queue.buffering.max.kbytes"] == "65536"
    assert all(isinstance(v, str) for v in config.values())


def test_producer_config_passes_user_properties() -> None:
    settings = load_settings(
        **REQUIRED,
        producer_queue_max_messages=10,
        kafka_producer_config={"linger.ms": 50, "compression.type": "zstd", "x.flag": True},
    )
    config = settings.producer_config()
    assert config["linger.ms"] == "50"
    assert config["compression.type"] == "zstd"
    assert config["x.flag"] == "true"
    assert config["queue.buffering.max.messages"] == "10"
    assert config["enable.idempotence"] == "true"
    assert config["acks"] == "all"


@pytest.mark.parametrize(
    "props",
    [
        {"enable.idempotence": "true", "acks": "all"},
        {"enable.idempotence": True, "acks": "ALL"},
        {"enable.idempotence": "TRUE"},
    ],
)
def test_enforced_properties_may_be_restated(props: dict[str, Any]) -> None:
    config = load_settings(**REQUIRED, kafka_producer_config=props).producer_config()
    assert config["enable.idempotence"] == "true"
    assert config["acks"] == "all"


@pytest.mark.parametrize(
    ("props", "named"),
    [
        ({"enable.idempotence": "false"}, "enable.idempotence"),
        ({"enable.idempotence": False}, "enable.idempotence"),
        ({"acks": "1"}, "acks"),
        ({"acks": 0}, "acks"),
    ],
)
def test_weakening_the_producer_is_refused(props: dict[str, Any], named: str) -> None:
    message = config_error(**REQUIRED, kafka_producer_config=props)
    assert "CDC_RELAY_KAFKA_PRODUCER_CONFIG" in message
    assert named in message


def test_idempotence_false_from_env_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CDC_RELAY_KAFKA_PRODUCER_CONFIG", '{"enable.idempotence": false}')
    message = config_error(**REQUIRED)
    assert "CDC_RELAY_KAFKA_PRODUCER_CONFIG" in message
    assert "enable.idempotence" in message


# -- redact_url: libpq's reading of the URL, never a pattern over it ----------------------------


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (
            "postgresql://relay:hunter2@db.example:5432/app",
            "host=db.example port=5432 dbname=app user=relay password=***",
        ),
        ("postgres://relay:hunter2@db/app", "host=db dbname=app user=relay password=***"),
        ("postgresql://relay@db.example/app", "host=db.example dbname=app user=relay"),
        ("postgresql://db.example/app", "host=db.example dbname=app"),
        ("postgresql://:hunter2@db/app", "host=db dbname=app password=***"),
        ("postgresql://relay:hun%40ter2@db/app", "host=db dbname=app user=relay password=***"),
        ("postgresql://relay:hun:ter2@db/app", "host=db dbname=app user=relay password=***"),
        # libpq reads ?, # and : inside the user info as part of the password.
        ("postgresql://relay:hun?ter2@db/app", "host=db dbname=app user=relay password=***"),
        ("postgresql://relay:hun#ter2@db/app", "host=db dbname=app user=relay password=***"),
        (
            "postgresql://relay:h?sslmode=disable#x@db/app",
            "host=db dbname=app user=relay password=***",
        ),
        (
            "postgresql://relay:hunter2@h1:5432,h2:5433/app",
            "host=h1,h2 port=5432,5433 dbname=app user=relay password=***",
        ),
        (
            "postgresql://relay:hunter2@[::1]:5432/app",
            "host=::1 port=5432 dbname=app user=relay password=***",
        ),
        (
            "postgresql://db/app?password=hunter2&sslmode=require",
            "host=db dbname=app password=*** sslmode=require",
        ),
        (
            "postgresql://db/app?sslpassword=hunter2",
            "host=db dbname=app sslpassword=***",
        ),
        (
            "postgresql:///app?host=/var/run/postgresql&password=hunter2",
            "host=/var/run/postgresql dbname=app password=***",
        ),
        (
            "host=db user=relay password=hunter2 dbname=app",
            "host=db dbname=app user=relay password=***",
        ),
        ("host=db password='hunter 2' dbname=app", "host=db dbname=app password=***"),
        (r"host=db password='it\'s hunter2' user=relay", "host=db user=relay password=***"),
        ("host=db password = hunter2", "host=db password=***"),
        ("password=hunter2", "password=***"),
        ("host=db user=relay dbname=app", "host=db dbname=app user=relay"),
        ("host=db password=ab://hunter2 user=relay", "host=db user=relay password=***"),
        ("postgresql://relay:hun%zzter2@db/app", "<not a valid connection string>"),
        ("not a url hunter2", "<not a valid connection string>"),
    ],
)
def test_redact_url(url: str, expected: str) -> None:
    assert redact_url(url) == expected


NASTY_PASSWORDS = [
    "pa?ss-hunter2",
    "pa#ss-hunter2",
    "pa:ss-hunter2",
    "pa%ss-hunter2",
    "pa@ss-hunter2",
    "pa/ss-hunter2",
    "pässwörd-hünter2",
    "?#/@%:é-hunter2",
]


def shown_or_refused(url: str) -> str:
    """What an operator could see of ``url``: the start-up line's URL, or the config error."""
    try:
        settings = load_settings(database_url=url, kafka_bootstrap_servers="k:1")
    except ConfigError as exc:
        return str(exc)
    return f"{settings.describe()['database_url']} {settings!r} {settings}"


def test_redact_url_conninfo_with_scheme_like_password() -> None:
    redacted = redact_url("host=db password=ab://hunter2 user=relay")
    assert "hunter2" not in redacted


# -- names taken literally; topics chosen by rows ---------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "env"),
    [
        ("topic_allowlist", "outbox.(order", "CDC_RELAY_TOPIC_ALLOWLIST"),
        ("max_created_topics", "-1", "CDC_RELAY_MAX_CREATED_TOPICS"),
    ],
)
def test_invalid_topic_limits_name_the_variable(field: str, value: str, env: str) -> None:
    message = config_error(**{**REQUIRED, field: value})
    assert message.startswith(f"invalid configuration: {env}: ")


def test_topic_limits_defaults() -> None:
    settings = load_settings(**REQUIRED)
    assert settings.topic_allowlist is None
    assert settings.max_created_topics == 100


@pytest.mark.parametrize(
    ("table", "sql_text"),
    [
        ("public.outbox", "public.outbox"),
        ("Sales.Outbox", '"Sales"."Outbox"'),
        ("public.LOWER_OB", 'public."LOWER_OB"'),
        ("app.out$box", "app.out$box"),
    ],
)
def test_table_names_are_taken_literally(table: str, sql_text: str) -> None:
    settings = load_settings(**REQUIRED, outbox_table=table)
    (only,) = settings.tables()
    assert only.table == table, "no case folding"
    assert only.sql_name == sql_text


@pytest.mark.parametrize("password", NASTY_PASSWORDS)
def test_an_unencoded_password_is_refused_or_masked(password: str) -> None:
    text = shown_or_refused(f"postgresql://relay:{password}@db.example:5432/app")
    assert "hunter2" not in text
    assert "ss-" not in text
    if any(c in password for c in "@/%"):
        # libpq would read part of it as the host, the port or the database, or cannot decode
        # it: refused, unquoted.
        assert text.startswith("invalid configuration: CDC_RELAY_DATABASE_URL: ")
    else:
        assert text.startswith("host=db.example port=5432 dbname=app user=relay password=*** ")


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://relay:hun%zzter2@db/app",
        "postgresql://relay:hun ter2@db/app",
        "postgresql://relay:hun%00ter2@db/app",
        "postgresql://relay:hun@ter2@db/app",
        "postgresql://relay:hun/ter2@db/app",
        "postgresql://relay:hunter2@db/app?bogus_hunter2=1",
        "hunter2",
        "host=db password='hunter2",
        "host=db password=hunter2 sslmode=bogus",
        "host=db password=hunter2 port=hunter2",
    ],
)
def test_an_invalid_url_is_refused_without_echo(url: str) -> None:
    message = config_error(database_url=url, kafka_bootstrap_servers="k:1")
    assert message.startswith("invalid configuration: CDC_RELAY_DATABASE_URL: ")
    assert "hunter2" not in message
    assert "ter2" not in message
    assert "\n" not in message


def test_bogus_sslmode_is_named() -> None:
    message = config_error(
        database_url="postgresql://db/app?sslmode=bogus", kafka_bootstrap_servers="k:1"
    )
    assert "CDC_RELAY_DATABASE_URL: sslmode must be one of" in message


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(secret=st.text(min_size=1, max_size=24).filter(lambda t: "\x00" not in t))
def test_any_percent_encoded_password_round_trips_and_is_masked(secret: str) -> None:
    password = "Zq9" + secret
    url = f"postgresql://relay:{quote(password, safe='')}@db.example:5432/app"
    settings_ = load_settings(database_url=url, kafka_bootstrap_servers="k:1")
    assert conninfo_to_dict(settings_.database_url.get_secret_value())["password"] == password
    assert password not in settings_.describe()["database_url"]
    assert password not in repr(settings_)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(secret=st.text(alphabet=st.sampled_from("?#/@%:é aZ09=&'\\\""), min_size=1, max_size=16))
def test_any_unencoded_password_is_refused_or_masked(secret: str) -> None:
    password = "Zq9" + secret
    for url in (
        f"postgresql://relay:{password}@db.example:5432/app",
        f"postgresql://db.example/app?password={password}",
    ):
        assert "Zq9" not in shown_or_refused(url)


def test_has_password() -> None:
    assert has_password("postgresql://relay:x@db/app")
    assert has_password("host=db password=x")
    assert not has_password("postgresql://relay@db/app")
    assert not has_password("postgresql://relay:hun%zz@db/app")


# -- secrets from files ---------------------------------------------------------------------------


def test_database_url_from_a_file(tmp_path: Path) -> None:
    secret = tmp_path / "db_url"
    secret.write_text(DB_URL + "\n", encoding="utf-8")
    settings = load_settings(database_url_file=str(secret), kafka_bootstrap_servers="k:1")
    assert settings.database_url.get_secret_value() == DB_URL
    assert_no_secret(str(settings.describe()))


def test_database_url_file_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    secret = tmp_path / "db_url"
    secret.write_text(DB_URL, encoding="utf-8")
    monkeypatch.setenv("CDC_RELAY_DATABASE_URL_FILE", str(secret))
    monkeypatch.setenv("CDC_RELAY_KAFKA_BOOTSTRAP_SERVERS", "k:1")
    assert load_settings().database_url.get_secret_value() == DB_URL


def test_database_url_and_its_file_together_are_refused(tmp_path: Path) -> None:
    secret = tmp_path / "db_url"
    secret.write_text(DB_URL, encoding="utf-8")
    message = config_error(
        database_url=DB_URL, database_url_file=str(secret), kafka_bootstrap_servers="k:1"
    )
    assert "CDC_RELAY_DATABASE_URL_FILE" in message
    assert_no_secret(message)


def test_unreadable_secret_file_is_named(tmp_path: Path) -> None:
    message = config_error(
        database_url_file=str(tmp_path / "missing"), kafka_bootstrap_servers="k:1"
    )
    assert message.startswith("invalid configuration: CDC_RELAY_DATABASE_URL_FILE: cannot read")


def test_invalid_url_in_a_file_is_refused_without_echo(tmp_path: Path) -> None:
    secret = tmp_path / "db_url"
    secret.write_text("postgresql://relay:hun%zzter2@db/app", encoding="utf-8")
    message = config_error(database_url_file=str(secret), kafka_bootstrap_servers="k:1")
    assert "CDC_RELAY_DATABASE_URL" in message
    assert "hunter2" not in message
    assert "zzter2" not in message


def test_kafka_properties_from_a_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    props = tmp_path / "kafka.properties"
    props.write_text(
        "# SASL\n"
        "security.protocol=SASL_SSL\n"
        f"sasl.password = {SASL_PASSWORD}\n"
        "\n"
        "! another comment\n"
        "linger.ms=1\n"
        "sasl.jaas.config=a=b c=d\n",
        encoding="utf-8",
    )
    monkeypatch.setenv("CDC_RELAY_KAFKA_PRODUCER_CONFIG_FILE", str(props))
    monkeypatch.setenv("CDC_RELAY_KAFKA_PRODUCER_CONFIG", '{"linger.ms": 20}')
    settings = load_settings(**REQUIRED)
    assert settings.kafka_producer_config == {
        "security.protocol": "SASL_SSL",
        "sasl.password": SASL_PASSWORD,
        "linger.ms": "20",  # the variable wins over the file
        "sasl.jaas.config": "a=b c=d",
    }
    assert_no_secret(str(settings.describe()))
    assert_no_secret(repr(settings))


def test_kafka_properties_file_as_json(tmp_path: Path) -> None:
    props = tmp_path / "kafka.json"
    props.write_text(json.dumps({"sasl.password": SASL_PASSWORD, "linger.ms": 3}), "utf-8")
    settings = load_settings(**REQUIRED, kafka_producer_config_file=str(props))
    assert settings.kafka_producer_config == {"sasl.password": SASL_PASSWORD, "linger.ms": "3"}


def test_kafka_properties_file_errors_name_the_line_not_its_content(tmp_path: Path) -> None:
    props = tmp_path / "kafka.properties"
    props.write_text(f"linger.ms=1\n{SASL_PASSWORD}\n", encoding="utf-8")
    message = config_error(**REQUIRED, kafka_producer_config_file=str(props))
    assert "CDC_RELAY_KAFKA_PRODUCER_CONFIG_FILE: line 2" in message
    assert_no_secret(message)
    props.write_text(f'{{"sasl.password": "{SASL_PASSWORD}"', encoding="utf-8")
    message = config_error(**REQUIRED, kafka_producer_config_file=str(props))
    assert "CDC_RELAY_KAFKA_PRODUCER_CONFIG_FILE: not a JSON object" in message
    assert_no_secret(message)


def test_kafka_properties_file_cannot_weaken_the_producer(tmp_path: Path) -> None:
    props = tmp_path / "kafka.properties"
    props.write_text("enable.idempotence=false\n", encoding="utf-8")
    message = config_error(**REQUIRED, kafka_producer_config_file=str(props))
    assert "enable.idempotence" in message


@given(
    props=st.dictionaries(
        st.from_regex(r"[a-z][a-z0-9._]{0,20}", fullmatch=True),
        st.text(
            alphabet=st.characters(blacklist_categories=["Cc", "Cs", "Zl", "Zp"]), max_size=30
        ).map(str.strip),
        max_size=8,
    )
)
def test_properties_lines_round_trip(props: dict[str, str]) -> None:
    text = "".join(f"{key} = {value}\n" for key, value in props.items())
    assert parse_properties(text) == props


@given(text=st.text(max_size=200))
def test_properties_parser_takes_any_text(text: str) -> None:
    try:
        parsed = parse_properties(text)
    except ConfigError as exc:
        parsed = {"error": str(exc)}
        assert parsed["error"].startswith(
            "invalid configuration: CDC_RELAY_KAFKA_PRODUCER_CONFIG_FILE"
        )
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in parsed.items())


@given(
    key=st.from_regex(r"[a-z][a-z0-9._]{0,20}", fullmatch=True),
    value=st.text(max_size=30),
    pad=st.sampled_from(["", " ", "\t"]),
)
def test_split_property_keeps_the_value_as_given(key: str, value: str, pad: str) -> None:
    """One rule for the properties file and --kafka-property: the key ends at the first '='."""
    assert split_property(f"{pad}{key}{pad}={value}") == (key, value)


@given(text=st.text(max_size=50))
def test_split_property_refuses_only_a_missing_key_or_equals(text: str) -> None:
    key, sep, value = text.partition("=")
    expected = (key.strip(), value) if sep and key.strip() else None
    assert split_property(text) == expected


# -- numbers, topics, hosts, librdkafka's verdict ------------------------------------------------

FLOAT_FIELDS = [name for name, field in Settings.model_fields.items() if field.annotation is float]


def test_there_are_float_settings() -> None:
    assert "confirm_interval" in FLOAT_FIELDS
    assert len(FLOAT_FIELDS) >= 10


@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "Infinity", float("inf"), float("nan")])
def test_non_finite_numbers_are_refused(field: str, value: object) -> None:
    message = config_error(**REQUIRED, **{field: value})
    assert env_name(field) in message


@pytest.mark.parametrize("topic", ["bad topic", "", ".", "..", "a" * 250, "dlq/x", "dlq\n"])
def test_dead_letter_topic_is_checked_at_start(topic: str) -> None:
    message = config_error(**REQUIRED, dead_letter_topic=topic)
    assert "CDC_RELAY_DEAD_LETTER_TOPIC" in message


def test_http_host() -> None:
    assert load_settings(**REQUIRED).http_host == "0.0.0.0"
    assert load_settings(**REQUIRED, http_host="127.0.0.1").http_host == "127.0.0.1"
    assert "CDC_RELAY_HTTP_HOST" in config_error(**REQUIRED, http_host="a b")


@pytest.mark.parametrize(
    ("props", "named"),
    [
        ({"no.such.property": "1"}, "no.such.property"),
        ({"linger.ms": "soon"}, "Invalid value"),
        ({"compression.type": "zip"}, "compression"),
        ({"security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN"}, "sasl.username"),
    ],
)
def test_librdkafka_refuses_bad_properties_as_a_config_error(
    props: dict[str, str], named: str
) -> None:
    settings = load_settings(**REQUIRED, kafka_producer_config=props)
    with pytest.raises(ConfigError) as info:
        check_producer_config(settings.producer_config())
    message = str(info.value)
    assert message.startswith("invalid configuration: CDC_RELAY_KAFKA_PRODUCER_CONFIG: ")
    assert named in message
    assert "\n" not in message


def test_librdkafka_errors_never_echo_secret_values() -> None:
    settings = load_settings(
        **REQUIRED,
        kafka_producer_config={"security.protocol": "SSL", "ssl.key.pem": SASL_PASSWORD},
    )
    with pytest.raises(ConfigError) as info:
        check_producer_config(settings.producer_config())
    assert_no_secret(str(info.value))


def test_good_properties_pass_librdkafka() -> None:
    check_producer_config(
        load_settings(
            **REQUIRED, kafka_producer_config={"linger.ms": "10", "acks": "all"}
        ).producer_config()
    )


# -- connection failures: permanent or transient --------------------------------------------------


@pytest.mark.parametrize(
    ("message", "sqlstate", "kind"),
    [
        ('invalid sslmode value: "bogus"', None, "config"),
        ('invalid port number: "x"', None, "config"),
        ('FATAL:  password authentication failed for user "relay"', "28P01", "permanent"),
        ('FATAL:  database "nope" does not exist', "3D000", "permanent"),
        ('FATAL:  role "nope" does not exist', "28000", "permanent"),
        ('FATAL:  no pg_hba.conf entry for host "1.2.3.4"', None, "permanent"),
        ("server does not support SSL, but SSL was required", None, "permanent"),
        ('could not translate host name "db.invalid" to address', None, "transient"),
        ("Connection refused", None, "transient"),
        ("timeout expired", None, "transient"),
        ("FATAL:  sorry, too many clients already", "53300", "transient"),
        ("FATAL:  the database system is starting up", "57P03", "transient"),
    ],
)
def test_connect_failure_kind(message: str, sqlstate: str | None, kind: str) -> None:
    assert connect_failure_kind(message, sqlstate) == kind


def test_the_lease_outlasts_two_renewals() -> None:
    settings = load_settings(**REQUIRED)
    assert (settings.leader_lease_timeout, settings.leader_renew_interval) == (15.0, 2.0)
    error = config_error(**REQUIRED, leader_lease_timeout="3", leader_renew_interval="2")
    assert error == (
        "invalid configuration: CDC_RELAY_LEADER_LEASE_TIMEOUT must be at least twice "
        "CDC_RELAY_LEADER_RENEW_INTERVAL: one late renewal must not lose the lease"
    )
    for name, value in [("leader_lease_timeout", "inf"), ("leader_lease_timeout", "0"),
                        ("leader_renew_interval", "nan")]:  # fmt: skip
        assert f"CDC_RELAY_{name.upper()}: " in config_error(**REQUIRED, **{name: value})


def test_row_filter_and_sweep_condition_are_conditions_of_the_grammar() -> None:
    settings = load_settings(
        **REQUIRED,
        outbox_row_filter="target_broker = 'kafka'",
        sweep_condition="status IN ('published')",
    )
    (table,) = settings.tables()
    assert str(table.filter) == "target_broker = 'kafka'"
    assert str(table.sweep_filter) == "status IN ('published')"
    message = config_error(
        **REQUIRED, outbox_row_filter="target_broker = 'kafka'; DROP TABLE outbox"
    )
    assert message.startswith("invalid configuration: CDC_RELAY_OUTBOX_ROW_FILTER: ")
    assert "DROP" not in message
    assert "CDC_RELAY_SWEEP_CONDITION: " in config_error(
        **REQUIRED, sweep_condition="status = published"
    )


def test_conditions_of_several_tables_are_set_per_table() -> None:
    tables = [{"table": "a.outbox", "row_filter": "x = 'y'", "sweep_condition": "s IS NULL"}]
    (table,) = load_settings(**REQUIRED, outbox_tables=tables).tables()
    assert str(table.filter) == "x = 'y'"
    assert str(table.sweep_filter) == "s IS NULL"
    message = config_error(**REQUIRED, outbox_tables=tables, outbox_row_filter="x = 'y'")
    assert 'with CDC_RELAY_OUTBOX_TABLES set "row_filter"' in message
    assert "CDC_RELAY_OUTBOX_TABLES" in config_error(
        **REQUIRED, outbox_tables=[{"table": "a.outbox", "row_filter": "x = y"}]
    )


def test_row_key_and_time_zone() -> None:
    columns = {"id": "message_id", "row_key": ["message_id", "target_broker"]}
    settings = load_settings(**REQUIRED, outbox_columns=columns, sweep_time_zone="Asia/Tokyo")
    assert settings.tables()[0].columns.row_key == ("message_id", "target_broker")
    assert settings.sweep_time_zone == "Asia/Tokyo"
    assert "CDC_RELAY_OUTBOX_COLUMNS" in config_error(
        **REQUIRED, outbox_columns={"row_key": ["a", "a"]}
    )
    assert "CDC_RELAY_OUTBOX_COLUMNS" in config_error(
        **REQUIRED, outbox_columns={"row_key": ["a;b"]}
    )
    assert "CDC_RELAY_SWEEP_TIME_ZONE" in config_error(**REQUIRED, sweep_time_zone="UTC'; --")


@pytest.mark.parametrize(
    "columns",
    [
        {"header_columns": ["id"]},
        {"header_columns": ["tenant", "Event_Type"]},
        {"additional_placement": ["tenant:header:cdc_relay.position"]},
        {"additional_placement": ["aggregate_type:header"]},
    ],
)
def test_a_configured_header_cannot_take_a_name_the_relay_sets(columns: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(**REQUIRED, outbox_columns=columns)
    assert "sets itself" in str(info.value)
    load_settings(**REQUIRED, outbox_columns={"additional_placement": ["type:header:eventType"]})


# -- exactly once ---------------------------------------------------------------------------------


@pytest.mark.parametrize("exactly_once", [False, True])
def test_a_transactional_id_of_ones_own_is_refused(exactly_once: bool) -> None:
    message = config_error(
        **REQUIRED,
        exactly_once=exactly_once,
        kafka_producer_config={"transactional.id": "mine"},
    )
    assert "CDC_RELAY_KAFKA_PRODUCER_CONFIG" in message
    assert "transactional.id" in message
    assert "Exactly once" in message


def test_exactly_once_bounds_a_records_delivery_by_its_transaction() -> None:
    config = load_settings(**REQUIRED, exactly_once=True).producer_config()
    assert config["transaction.timeout.ms"] == "60000"
    assert config["message.timeout.ms"] == "60000"
    own = load_settings(
        **REQUIRED,
        exactly_once=True,
        kafka_producer_config={"transaction.timeout.ms": "30000", "message.timeout.ms": "20000"},
    ).producer_config()
    assert (own["transaction.timeout.ms"], own["message.timeout.ms"]) == ("30000", "20000")
    assert "transaction.timeout.ms" not in load_settings(**REQUIRED).producer_config()


@pytest.mark.parametrize(
    "props",
    [
        {"message.timeout.ms": "0"},
        {"message.timeout.ms": "120000"},
        {"message.timeout.ms": "40000", "transaction.timeout.ms": "30000"},
    ],
)
def test_exactly_once_refuses_a_record_timeout_beyond_its_transaction(
    props: dict[str, str],
) -> None:
    message = config_error(**REQUIRED, exactly_once=True, kafka_producer_config=props)
    assert "message.timeout.ms" in message
    assert "CDC_RELAY_EXACTLY_ONCE" in message
    load_settings(**REQUIRED, kafka_producer_config=props)  # only with the setting on
