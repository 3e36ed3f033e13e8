"""The C extension's entry points, each None where the extension is absent.

``cdc_relay/decode/_tuple_reader.c`` is built by ``setup.py`` wherever a compiler exists, and
blocked by ``CDC_RELAY_PURE_PYTHON=1`` or by a stale build in a checkout
(:mod:`cdc_relay._hot_path`). It is imported here, once. Each entry point's pure-Python reference
and fallback stays with the module that uses it, which chooses the fallback when the name here is
None: ``read_tuple`` and ``read_message`` in :mod:`cdc_relay.decode.pgoutput`, ``record_fields``
in :mod:`cdc_relay.outbox`, ``bind`` (:class:`types.MethodType`) and ``Publisher``
(``Session.publish`` of an ordinary row) in :mod:`cdc_relay.session`, ``Deliveries``
(``DeliveryTracker``'s Python callback) in :mod:`cdc_relay.publisher`.
They copy it into a module-level ``Final`` name, a C static in the compiled build, so this module
runs once, at import, and is not compiled itself.
"""

from __future__ import annotations

from typing import TypeVar

_F = TypeVar("_F")


def _optional(entry_point: _F) -> _F | None:
    """Its type as ``_tuple_reader.pyi`` gives it, or None."""
    return entry_point


try:
    from cdc_relay.decode import _tuple_reader

    read_tuple = _optional(_tuple_reader.read_tuple)
    read_message = _optional(_tuple_reader.read_message)
    record_fields = _optional(_tuple_reader.record_fields)
    bind = _optional(_tuple_reader.bind)
    Deliveries = _optional(_tuple_reader.Deliveries)
    Publisher = _optional(_tuple_reader.Publisher)
except ImportError:
    read_tuple = read_message = record_fields = bind = Deliveries = Publisher = None
