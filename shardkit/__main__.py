"""``python -m shardkit`` is the ``shardkit`` command."""

from shardkit._cli.main import main

raise SystemExit(main())
