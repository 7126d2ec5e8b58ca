"""``python -m shardkit`` is the ``shardkit`` command."""

from shardkit._cli.supervise import command_line

raise SystemExit(command_line())
