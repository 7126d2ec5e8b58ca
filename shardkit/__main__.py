"""``python -m shardkit`` is the ``shardkit`` command."""

from .cli import main

raise SystemExit(main())
