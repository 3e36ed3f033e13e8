"""Unit tests for cdc_relay.dead_letter: a dead-letter copy shrinks step by step, saying what it
dropped and how large it was, until only metadata is left."""

from __future__ import annotations

from cdc_relay.dead_letter import ERROR_HEADER, DeadLetter, header_name_ok, text_bytes

METADATA = [(ERROR_HEADER, b"too large"), ("cdc_relay.event_id", b"e-1")]


def _meta(letter: DeadLetter) -> dict[str, bytes]:
    return dict(letter.metadata)


def test_shrinks_value_then_headers_then_to_metadata_only() -> None:
    letter = DeadLetter.of(b"k" * 10, b"v" * 2000, [("h1", b"x" * 30), ("h2", b"")], METADATA)
    assert letter.all_headers == [("h1", b"x" * 30), ("h2", b""), *METADATA]

    no_value = letter.smaller()
    assert no_value is not None
    assert no_value.value is None
    assert no_value.key == b"k" * 10
    assert no_value.headers == letter.headers
    assert _meta(no_value)["cdc_relay.value_size"] == b"2000"
    assert _meta(no_value)["cdc_relay.dropped"] == b"value"

    no_headers = no_value.smaller()
    assert no_headers is not None
    assert no_headers.headers == []
    assert _meta(no_headers)["cdc_relay.headers_size"] == b"34"  # names and values
    assert _meta(no_headers)["cdc_relay.headers_count"] == b"2"
    assert _meta(no_headers)["cdc_relay.value_size"] == b"2000"
    assert _meta(no_headers)["cdc_relay.dropped"] == b"value,headers"

    metadata = no_headers.smaller()
    assert metadata is not None
    assert metadata.metadata_only
    assert (metadata.key, metadata.value, metadata.headers) == (None, None, [])
    assert _meta(metadata)["cdc_relay.key_size"] == b"10"
    assert _meta(metadata)["cdc_relay.value_size"] == b"2000"
    assert _meta(metadata)["cdc_relay.dropped"] == b"metadata"
    assert metadata.smaller() is None


def test_metadata_only_cuts_long_metadata_values() -> None:
    letter = DeadLetter.of(None, None, [], [(ERROR_HEADER, b"e" * 5000)])
    smallest = letter.smaller()
    assert smallest is not None
    assert len(_meta(smallest)[ERROR_HEADER]) == 512


def test_a_letter_without_value_starts_with_the_headers() -> None:
    letter = DeadLetter.of(b"k", None, [("h", b"x")], METADATA)
    smaller = letter.smaller()
    assert smaller is not None
    assert smaller.headers == []
    assert _meta(smaller)["cdc_relay.dropped"] == b"headers"


def test_headers_librdkafka_cannot_take_are_left_out_and_counted() -> None:
    letter = DeadLetter.of(None, b"v", [("\ud800", b"x"), ("a\x00b", b"y"), ("ok", b"z")], METADATA)
    assert letter.headers == [("ok", b"z")]
    assert _meta(letter)["cdc_relay.invalid_headers"] == b"2"


def test_split_finds_the_metadata_after_a_forged_error_header() -> None:
    own = [("cdc_relay.error", b"forged by the row"), ("h", b"x")]
    letter = DeadLetter.of(b"k", b"v", own, METADATA)
    produced = letter.all_headers
    again = DeadLetter.split(b"k", b"v", produced)
    assert again == letter
    once_smaller = letter.smaller()
    assert once_smaller is not None
    assert DeadLetter.split(b"k", None, once_smaller.all_headers) == once_smaller


def test_header_name_ok() -> None:
    assert header_name_ok("id")
    assert header_name_ok("")
    assert header_name_ok("café 🚀")
    assert not header_name_ok("\udc80")
    assert not header_name_ok("a\x00")
    assert not header_name_ok(b"id")


def test_text_bytes_never_fails() -> None:
    assert text_bytes("caf\u00e9") == "café".encode()
    assert text_bytes("x\ud800") == b"x\\ud800"
