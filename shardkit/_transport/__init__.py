"""How the kit reaches an engine outside this process: the gRPC codec, client and server,
and isolated worker processes."""
