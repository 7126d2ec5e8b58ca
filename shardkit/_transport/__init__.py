"""How the kit reaches an engine outside this process: the gRPC codec, client and server,
and isolated worker processes.

Imports flow one way (``tests/test_import_graph.py`` checks it): ``codec`` (the wire, and
what both ends agree on) ← ``client`` ← ``resolve`` (a target by name) ← ``server``; the
``worker`` builds on the client, and ``isolation`` (``isolated_target``,
``target_with_options``) is the top. Everything rests on ``shardkit._core.targets``,
which imports nothing from here."""
