"""The values a numeric setting accepts, declared once on its field and said in our own words.

A setting's :class:`Bounds` sit in its annotation (``Annotated[float, seconds(0.1, HOUR)]``): the
one place that both checks a value (a refusal says ``between 0.1 and 3600 seconds``, never
pydantic's "Input should be greater than or equal to 0") and describes it to ``--help``,
``cdc-relay settings`` and the configuration reference.

Durations are finite, so that no value means "never" and every timer can wait that long
(threading's waits raise OverflowError beyond ``threading.TIMEOUT_MAX``, about 292 years), and at
least a few milliseconds where less would spin a loop (a renewal, a sweep, a log line) thousands
of times a second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pydantic import GetCoreSchemaHandler
from pydantic_core import CoreSchema, core_schema

HOUR = 3600.0
DAY = 24 * HOUR


@dataclass(frozen=True)
class Bounds:
    """``low`` to ``high`` (inclusive) in ``unit``; ``special``, if set, is accepted too and
    means ``special_means`` (0: off; -1: the broker's default)."""

    low: float
    high: float = math.inf
    unit: str = ""
    above_low: bool = False  # low itself is refused (any value above it is fine)
    special: float | None = None
    special_means: str = "off"

    def admits(self, value: float) -> bool:
        if self.special is not None and value == self.special:
            return True
        above = self.low < value if self.above_low else self.low <= value
        return above and value <= self.high

    def describe(self) -> str:
        """``0 (off) or between 0.01 and 86400 seconds``, ``at least 1``, …"""
        low, unit = format_number(self.low), f" {self.unit}" if self.unit else ""
        if math.isinf(self.high):
            span = f"more than {low}{unit}" if self.above_low else f"at least {low}{unit}"
        elif self.above_low:
            span = f"more than {low} and at most {format_number(self.high)}{unit}"
        else:
            span = f"between {low} and {format_number(self.high)}{unit}"
        if self.special is None:
            return span
        return f"{format_number(self.special)} ({self.special_means}) or {span}"

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> CoreSchema:
        """After the type's own validation: refuse a value out of bounds with :meth:`describe`."""
        return core_schema.no_info_after_validator_function(self._check, handler(source))

    def _check(self, value: float) -> float:
        if not self.admits(value):  # nan admits nothing
            raise ValueError(self.describe())
        return value


def seconds(low: float, high: float, **options: Any) -> Bounds:
    return Bounds(low, high, unit="seconds", **options)


def format_number(value: float) -> str:
    """1.0 -> ``1``, 316224000.0 -> ``316224000`` (not ``3.16224e+08``), 0.01 -> ``0.01``."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"
