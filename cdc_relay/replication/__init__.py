"""The PostgreSQL side: replication protocol, its connection, slot and publication setup.

``protocol`` is pure framing (bytes in, values out); ``stream`` owns the libpq connection;
``source`` prepares and checks the database. Nothing here knows about Kafka.
"""
