"""The stages block bytes go through in the server, one module per stage (docs/arena.md).

Put: receive (gRPC messages, shm segments, arena reservations) -> assemble (parts into blocks)
-> verify (verify.py: size, format, key-bound checksum) -> commit (TierStack.put, or
TierStack.put_reserved for blocks already in arena slots).
Get: locate (TierStack.get: RAM leases, lower tiers, promotion) -> lease (arena slots pinned until
sent) -> send (gRPC replies, shm segments, or the lease itself for in-place readers: inplace.py).
"""
