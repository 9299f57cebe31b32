"""The stages block bytes go through in the server, one module per stage (docs/arena.md).

Put: receive (gRPC messages, shm segments, arena reservations) -> assemble (parts into blocks)
-> verify (verify.py: size, format, key-bound checksum) -> commit (TierStack.put, or
TierStack.put_reserved for blocks already in arena slots).
Get: locate (TierStack.get: RAM leases, lower tiers, promotion) -> lease (arena slots pinned until
sent) -> send (gRPC replies, shm segments, or the lease itself for in-place readers: inplace.py).
"""


class Counters:
    """The service's counters that the stages move (the rest of its counters: KVCacheService)."""

    def __init__(self) -> None:
        self.failed_requests = 0
        self.put_checksum_failures = 0
        self.sealed_blocks = 0  # blocks whose checksums the server computed (ShmRange.seal_before_ns)
        self.sealed_too_late = 0  # Puts ended ABORTED: a sealed block read after its client's deadline
        self.shm_bytes_received = 0
        self.shm_bytes_sent = 0
