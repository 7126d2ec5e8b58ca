"""The process a verdict is reported from: a supervising parent the engine under test
cannot end, for the command line (``shardkit._cli.supervise``) and for pytest (the plugin)."""
