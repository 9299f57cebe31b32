"""The kvcache contract, shared by the server, the SDK and the connectors.

What both sides of the wire must agree on lives here and only here:

- `kvcache_core.keys`: the chunk-key scheme (docs/keys.md);
- `kvcache_core.format`: the block format, its checksum bound to the key (docs/format.md);
- `kvcache_core.blockwire`: the zero-copy protobuf codec of the messages that carry block bytes;
- `kvcache_core.errors`: what bytes that break these raise;
- `kvcache_core.breaker`: the circuit breaker both the server's tiers and the connectors use.

Nothing here imports gRPC, torch or the server; the generated protobuf code is `kvcache_proto`.
"""
