"""The PostgreSQL side: the streaming replication protocol, its connection, and slot/publication setup.

``protocol`` is pure framing (bytes in, values out); ``stream`` owns the libpq connection; ``source``
prepares and checks the database. Nothing here knows about Kafka.
"""
