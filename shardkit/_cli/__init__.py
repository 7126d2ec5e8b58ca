"""The ``shardkit`` command: a thin adapter over the library, and the bench."""
