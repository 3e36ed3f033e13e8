"""What the CLI prints and reads from others: any text becomes one line of visible, bounded text
(cdc_relay.commands.output.printable); ``status`` reads the relay's port within bounds."""

from __future__ import annotations

import contextlib
import re
import socketserver
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cdc_relay.commands.output import LINE_LIMIT, VALUE_LIMIT, print_line, printable
from cdc_relay.commands.status import STATUS_TIMEOUT, relay_status

MARKER = re.compile(r"… \((\d+) more characters\)\Z")
# Terminal-relevant characters: C0/C1 controls, DEL, separators, bidirectional controls.
hostile = st.text(
    alphabet=st.one_of(
        st.characters(),
        st.sampled_from("\x1b\x07\x9b\r\n\t\\\u2028\u2029\u202e\u2066\x00\x7f\ufeff"),
    )
)


@given(text=hostile, limit=st.integers(min_value=10, max_value=2000))
def test_any_text_becomes_one_line_without_control_characters(text: str, limit: int) -> None:
    out = printable(text, limit)
    body = MARKER.sub("", out)
    assert all(char.isprintable() for char in out)  # no control, format or separator but " "
    assert not {"\n", "\r", "\x1b"} & set(out)
    assert len(out.splitlines()) <= 1
    assert len(body) <= limit


def _unescape(out: str) -> str:
    return re.sub(
        r"\\(n|r|t|\\|x[0-9a-f]{2}|u[0-9a-f]{4}|U[0-9a-f]{8})",
        lambda m: (
            {"n": "\n", "r": "\r", "t": "\t", "\\": "\\"}.get(m.group(1))
            or chr(int(m.group(1)[1:], 16))
        ),
        out,
    )


@given(text=hostile)
def test_below_the_limit_nothing_is_lost_and_the_escapes_read_back(text: str) -> None:
    out = printable(text, limit=10 * len(text) + 10)
    assert MARKER.search(out) is None
    assert _unescape(out) == text  # unambiguous: a backslash in the text is doubled


@given(text=st.text(st.characters(categories=["L", "N", "P", "S"]), max_size=VALUE_LIMIT // 2))
def test_visible_text_is_printed_as_it_is(text: str) -> None:
    assert printable(text) == text.replace("\\", "\\\\")


def test_a_long_value_is_cut_with_a_count() -> None:
    out = printable("x" * 5000)
    assert out == "x" * VALUE_LIMIT + "… (4000 more characters)"


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("relay-7\nok   fake: all good", r"relay-7\nok   fake: all good"),
        ("\x1b[2J\x1b]0;title\x07", r"\x1b[2J\x1b]0;title\x07"),
        ("abc\u202etxt.exe", r"abc\u202etxt.exe"),
        ("a\\nb", r"a\\nb"),
        (42, "42"),
        (None, "None"),
    ],
)
def test_examples(text: object, shown: str) -> None:
    assert printable(text) == shown


def test_print_line_bounds_a_line(capsys: pytest.CaptureFixture[str]) -> None:
    print_line("FAIL x: " + "y" * (2 * LINE_LIMIT) + "\n\x1b[31mforged")
    printed = capsys.readouterr().out
    assert printed.count("\n") == 1
    assert len(printed) < LINE_LIMIT + 100


def _serve(body: bytes, endless: bool) -> tuple[socketserver.TCPServer, int]:
    class Handler(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            self.rfile.readline()
            self.wfile.write(b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n")
            with contextlib.suppress(OSError):
                self.wfile.write(body)
                while endless:
                    self.wfile.write(b" " * 65536)

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


def test_status_reads_whatever_answers_on_the_port_within_a_time_and_size_bound() -> None:
    server, port = _serve(b'{"events_published": 3}', endless=False)
    try:
        assert relay_status(port) == {"events_published": 3}
    finally:
        server.shutdown()
    server, port = _serve(b'{"events_published": 3', endless=True)
    try:
        started = time.monotonic()
        assert relay_status(port) is None
        assert time.monotonic() - started < STATUS_TIMEOUT + 1
    finally:
        server.shutdown()
