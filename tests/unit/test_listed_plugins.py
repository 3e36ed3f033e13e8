"""Reading a list setting as PostgreSQL shows it (``output_plugin_libraries``): every name back,
whatever it holds, each quoted one as one name."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from cdc_relay.prerequisites.server import listed_plugins

_PLAIN = re.compile(r"[a-z_][a-z0-9_$]*")
_NAMES = st.text(alphabet=st.sampled_from("abcXYZ019_$-. ,\"'é"), min_size=1, max_size=12).filter(
    lambda name: name == name.strip()
)


def _shown(names: list[str]) -> str:
    """As PostgreSQL shows a list setting: plain names bare, the others double-quoted."""
    return ", ".join(
        name if _PLAIN.fullmatch(name) else '"' + name.replace('"', '""') + '"' for name in names
    )


@given(st.lists(_NAMES, max_size=6))
def test_every_name_comes_back_as_itself(names: list[str]) -> None:
    assert listed_plugins(_shown(names)) == names


def test_the_default_and_an_empty_list() -> None:
    assert listed_plugins("pgoutput, test_decoding") == ["pgoutput", "test_decoding"]
    assert listed_plugins("") == []
    assert listed_plugins('"pgoutput, wal2json"') == ["pgoutput, wal2json"]
