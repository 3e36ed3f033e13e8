"""The operator commands besides ``run``: ``setup``, ``check``, ``sweep``, ``status``, ``demo``.

One module per command, each with a ``main``-like entry point that :mod:`cdc_relay.cli` imports
only when that command runs (so ``--help`` and the relay itself never load them). What each
command is for, needs and exits with is :mod:`.catalog`'s, which the parser reads.
"""
