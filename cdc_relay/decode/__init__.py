"""Turning a logical replication slot's output into messages: one family, two plugins.

``messages`` is the model both decoders emit; ``pgoutput`` and ``wal2json`` are the decoders;
``plugin`` picks one by configuration. The relay needs only what is re-exported here.
"""

from cdc_relay.decode.plugin import XLogDecoder, decoder_for, plugin_options_for

__all__ = ["XLogDecoder", "decoder_for", "plugin_options_for"]
