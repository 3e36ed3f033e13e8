"""What runs before a session streams, in the order it runs (the README's "How it works", step 2).

Once, before the process stands by (:meth:`StartSequence.check_database`): the database's
prerequisites and the state tables, so that a standby with a broken configuration fails now, not
when it is needed. Then, as the leader, for every session (:meth:`StartSequence.session`):

1. the prerequisites again (unless the check above has just run on the same connection), the
   publication and its row filters, the state table;
2. the recorded position, trusted only when this server can have it
   (:mod:`cdc_relay.record_origin`);
3. the position the previous session acknowledged, carried over as far as it holds on this
   server (a promoted standby's history is the old primary's only up to its promotion);
4. the slot: created, or, once the previous leader's walsender has let go of it, checked;
5. where to start (:func:`cdc_relay.checkpoint.resolve_start`), and the row filters recorded;
6. ``START_REPLICATION``, the walsender noted in the lease;
7. while the server decodes its way to the start position: the read-back from Kafka of what an
   earlier incarnation already delivered (:meth:`StartSequence.read_back`, with
   :class:`Keepalive` meanwhile), beside the relay building its producer.

:mod:`cdc_relay.start.sequence` is the order, over Protocols; :mod:`cdc_relay.start.adapters`
the real PostgreSQL and Kafka behind them. A leader whose lease runs out on the way stops with
:class:`~cdc_relay.errors.LeadershipLost` (raised by :mod:`cdc_relay.leadership` or
:mod:`cdc_relay.checkpoint`).
"""

from cdc_relay.start.adapters import PostgresStart, kafka_read_back
from cdc_relay.start.sequence import Keepalive, Started, StartSequence

__all__ = ["Keepalive", "PostgresStart", "StartSequence", "Started", "kafka_read_back"]
