"""Which row filters the relay relays with — recorded once, so that no sweeper deletes by others.

The sweeper deletes the rows the relay published; a row the relay's filter left out was never
published. So a sweeper must delete only rows of the filter the *relay* used, whatever its own
settings say (a ``sweep`` run without ``CDC_RELAY_OUTBOX_ROW_FILTER`` would otherwise take the
other destination's rows). The relay applies its filter itself to every row it decodes (wal2json
ignores publications; PostgreSQL 14 has no publication row filters), so the one source of truth
is the relay's: at start the leader writes its filters into the position record
(``slot_position.row_filters``, per table its condition or null), and every sweep pass compares
its own settings with them (and, on PostgreSQL 15+, with the publication's, which pgoutput
applies too), refusing a table whose filter differs. Comparison is by meaning
(:meth:`cdc_relay.row_filter.Condition.same_as`): terms in another order are the same filter.

A record written before filters were recorded (null) takes the relay's current filters at its
next start — on PostgreSQL 15+ the publication's, which the relay kept equal to its settings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cdc_relay.config import OutboxTable, env_name
from cdc_relay.row_filter import Condition, ConditionError, parse

MAX_RECORDED = 256  # tables in a record: a bound on what a tampered row makes the sweeper parse


def recorded_form(tables: Sequence[OutboxTable]) -> dict[str, str | None]:
    """The filters to record: per table, its condition as the grammar writes it, or None."""
    return {t.table: None if t.filter is None else str(t.filter) for t in tables}


@dataclass(frozen=True)
class Difference:
    """One table whose filter in the settings is not the relay's."""

    table: OutboxTable
    relayed: str | None  # the relay's filter as recorded (None: none)
    known: bool  # the record names the table at all

    def describe(self, several: bool) -> str:
        wanted = self.table.filter
        mine = str(wanted) if wanted is not None else "none"
        if not self.known:
            return (
                f"{self.table.table} is not among the tables the relay relays (as its record "
                f"says): it is not swept; this sweeper's row filter for it is {mine}"
            )
        theirs = self.relayed if self.relayed is not None else "none"
        setting = (
            f'"row_filter" of {self.table.table} in {env_name("outbox_tables")}'
            if several
            else env_name("outbox_row_filter")
        )
        fix = f"{setting}={self.relayed}" if self.relayed is not None else f"{setting} unset"
        return (
            f"the relay relays {self.table.table} with row filter {theirs}, and this sweeper's "
            f"is {mine}: rows outside the relay's filter were never published. Sweep with the "
            f"relay's settings ({fix})"
        )


def differences(recorded: object, tables: Sequence[OutboxTable]) -> list[Difference] | None:
    """The tables whose filter differs from the relay's recorded ones; None when the record has
    none (written before filters were recorded, or not an object of text or null values)."""
    if not isinstance(recorded, Mapping) or len(recorded) > MAX_RECORDED:
        return None
    found: list[Difference] = []
    for table in tables:
        if table.table not in recorded:
            found.append(Difference(table, None, known=False))
            continue
        text = recorded[table.table]
        if text is not None and not isinstance(text, str):
            return None
        if not same(text, table.filter):
            found.append(Difference(table, text, known=True))
    return found


def same(recorded: str | None, wanted: Condition | None) -> bool:
    """A recorded filter (text of the grammar, or None) means what ``wanted`` means."""
    if recorded is None or wanted is None:
        return recorded is None and wanted is None
    try:
        return parse(recorded).same_as(wanted)
    except ConditionError:
        return False  # not a filter the relay writes: never taken for ours
