"""The ``shardkit`` command: a thin adapter over the library (the bench is ``shardkit._bench``)."""
