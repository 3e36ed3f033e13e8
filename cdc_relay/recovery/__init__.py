"""Recovering a lost replication slot from the outbox table itself: every event that never reached
Kafka is published, and none twice.

A slot dropped, or invalidated by the server (``max_slot_wal_keep_size``), can never stream again:
the WAL it had not decoded is gone. But the events are not: **the sweeper never deletes an
unpublished row** (:mod:`cdc_relay.sweeper`), so every outbox row whose event Kafka did not
acknowledge is still in the table. The recovery publishes exactly those rows, then streams from a
new slot. Why that is exact — each step is one claim:

1. *Rows the new slot will never stream are exactly those its exported snapshot sees.* The slot
   is created with ``CREATE_REPLICATION_SLOT ... (SNAPSHOT 'export')``
   (:mod:`cdc_relay.replication.exported_slot`): a transaction committed before the slot's
   consistent point ``C`` is visible in that snapshot ``S`` and never decoded; one committed after
   is decoded by the slot and invisible in ``S``. The rows are read in ``S`` (imported with ``SET
   TRANSACTION SNAPSHOT``), and after an interruption in any later snapshot through ``S``'s
   listing (``pg_visible_in_snapshot``: the exported snapshot names every transaction it does not
   see, subtransactions included).
2. *Of those, the relay owes the rows of transactions at or after the sweep boundary* ``B``
   (``slot_position.sweep_from_xid``) matching the row filter: the old slot decoded every such
   transaction that committed after its own start, and older rows were never the relay's to
   publish (the sweeper keeps them for the same reason). Rows are judged by their 64-bit
   transaction id, derived from ``xmin`` (exact for rows younger than 2^32 transactions).
3. *Of those, the rows of transactions below the horizon's* ``xmin`` *are published.* The
   horizon (:mod:`cdc_relay.recovery.horizon`) is recorded with the position as the relay
   confirms: a snapshot ``S_k`` taken by an earlier write of the position, whose transactions all
   committed below that write's WAL insert position ``L_k``, recorded only with a position
   ``P >= L_k`` — below which Kafka acknowledged every event (or its dead letter). A transaction
   below ``xmin(S_k)`` (a subtransaction's id included: its parent's is lower) had ended before
   ``S_k``.
4. *Every other owed row is in doubt, and its record — if the relay published it — lies after the
   horizon's read-back offsets.* Its transaction id is at least ``xmin(S_k)``, hence above the
   id of the write whose acknowledged offsets (and partition notes) the horizon keeps, so it
   committed after that write's position was decided, and the relay produces in commit order. The
   read-back (:mod:`cdc_relay.recovery.kafka_check`) reads those partitions to their end and
   counts this slot's records by event id (its dead letters' too); a row in doubt whose id is
   counted takes one count, in commit order. A read that fails or runs out of budget takes none:
   those rows are published again, said in a WARNING (a duplicate, never a loss).
5. *The recovery's own records are told apart and found again.* Each carries a position header
   with the plan's LSN (just below ``C``, not 8-byte aligned, so never a commit's position) and
   the row's ordinal in the recovery's order, which a rerun recomputes identically from the same
   rows (:mod:`cdc_relay.recovery.plan`). A rerun reads them back from where the plan noted each
   partition's end before its first record there, and skips an ordinal whose record carries the
   row's id.
6. *Nothing is swept meanwhile that is not published.* Until its end the recovery leaves the
   recorded position as it was before the loss: any sweeper deletes only rows that position
   covers. The end is one statement (:mod:`cdc_relay.recovery.record`): the position becomes
   ``C``, and the horizon ``S`` (every owed row is published now).

Order: rows go out in commit order as far as PostgreSQL can tell it
(:mod:`cdc_relay.recovery.rows`): by commit timestamp with ``track_commit_timestamp`` on, else by
transaction id (a transaction that got its id first, but committed later, goes first); within a
transaction by ``cmin``. The new slot's events follow the recovery's, which all committed before.

What no recovery can bring back: rows deleted by hand before it, rows of transactions older than
the sweep boundary (never the relay's), and table-less events (``pg_logical_emit_message``): they
lived only in the lost WAL. Only the leader recovers (:mod:`cdc_relay.leadership`: the writes are
fenced by its lease); standbys wait. ``cdc-relay recover`` (:mod:`cdc_relay.commands.recover`)
or, with ``CDC_RELAY_ON_SLOT_LOSS=recover``, the relay's start (:mod:`cdc_relay.start.sequence`)
runs it (:mod:`cdc_relay.recovery.run`).
"""
