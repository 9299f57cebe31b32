"""What the SDK's calls return: plain, frozen result objects (no gRPC types)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from kvcache_proto import kvcache_pb2 as pb

TIER_NAMES = {pb.TIER_RAM: "ram", pb.TIER_REDIS: "redis", pb.TIER_S3: "s3", pb.TIER_DISK: "disk"}

Fetched = tuple[memoryview | bytes, str]
"""A block as received (a view into the received message) and the name of the tier that served it."""


@dataclass(frozen=True, slots=True)
class LookupResult:
    """The longest stored prefix of a list of keys.

    Attributes:
        prefix_length: keys[:prefix_length] are stored.
        tiers: For each of those keys, the fastest tier holding it ("ram", "redis", "s3").
    """

    prefix_length: int
    tiers: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class PrefetchResult:
    """What a prefetch did with its keys (kvcache.v1.PrefetchResponse): in_ram + queued + unknown +
    dropped = keys asked.

    Attributes:
        in_ram: keys the server's RAM held already.
        queued: keys a lower tier holds, queued for promotion into RAM in the background.
        unknown: keys no tier answered present.
        dropped: keys a lower tier holds that the server's full promotion queue did not take.
    """

    in_ram: int
    queued: int
    unknown: int
    dropped: int = 0


@dataclass(frozen=True, slots=True)
class TierPutResult:
    """What one tier took of a put_many's blocks (kvcache.v1.TierPutResult).

    For every tier, stored + queued + dropped + failed + deleted = the blocks sent.

    Attributes:
        name: "ram", "redis" or "s3".
        stored: Blocks the tier took before the call returned (RAM kept them; a write-through
            tier, or a write-behind tier writing synchronously on a full queue, wrote them).
        queued: Write-behind: blocks queued for the tier's background writer, not yet written.
        dropped: Write-behind: blocks not queued because the queue was full.
        failed: Blocks the tier did not take: RAM: too large for it; a lower tier: down, too
            slow, or skipped by its open circuit breaker.
        deleted: Blocks not written here because a Delete of their key ran during the call.
    """

    name: str
    stored: int = 0
    queued: int = 0
    dropped: int = 0
    failed: int = 0
    deleted: int = 0


@dataclass(frozen=True, slots=True)
class PutResult:
    """What a put_many stored.

    Attributes:
        stored: Blocks that at least one tier of the server stored or queued. A put whose
            write-through tier is down still stores them (in RAM): `tier(name)` tells.
        rejected: Valid blocks no tier stored or queued (larger than the RAM tier and not
            written below it).
        bytes_sent: Block bytes sent, headers included.
        tiers: Per tier, RAM first, what it took (empty from servers that predate it).
    """

    stored: int
    rejected: int
    bytes_sent: int
    tiers: tuple[TierPutResult, ...] = ()

    def tier(self, name: str) -> TierPutResult:
        """The share of the tier called `name` ("ram", "redis", "s3"); KeyError if the server has none."""
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(name)


@dataclass(frozen=True, slots=True)
class TierInfo:
    """One tier's counters, as reported by Stats (field meanings: kvcache.v1.TierStats)."""

    name: str
    used_bytes: int
    capacity_bytes: int
    blocks: int
    hits: int
    misses: int
    puts: int
    evictions: int
    rejected: int
    checksum_failures: int
    errors: int
    healthy: bool
    promotions: int = 0
    demotions: int = 0
    write_errors: int = 0
    queue_depth: int = 0
    queue_bytes: int = 0
    queue_dropped: int = 0
    breaker: str = "closed"
    skipped: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    lookup_late_hits: int = 0
    retained_blocks: int = 0  # RAM, disk: blocks held under retention now (put_many's retain_ttl_s)
    retained_bytes: int = 0
    retention_refused: int = 0  # disk: blocks stored unretained (a full share); RAM's: StatsResult.retention_refused
    retention_expired: int = 0  # disk: retentions that ran out
    retention_copied: int = 0  # disk: retained records copied forward out of an evicted region
    retention_dropped: int = 0  # disk: retained records lost with their region (unreadable, invalid, no room)


_TIER_INFO_FIELDS = [f.name for f in fields(TierInfo)]


@dataclass(frozen=True, slots=True)
class ServerStats:
    """The server's Stats answer."""

    version: str
    uptime_s: float
    put_checksum_failures: int
    failed_requests: int
    max_block_bytes: int
    max_keys_per_request: int
    tiers: tuple[TierInfo, ...] = field(default_factory=tuple)
    shm_bytes_received: int = 0
    shm_bytes_sent: int = 0
    inflight_bytes: int = 0  # bytes the server holds for calls in flight, and the other budget counters
    inflight_peak_bytes: int = 0
    inflight_refused: int = 0
    cut_off_calls: int = 0
    bulk_bytes_received: int = 0  # the bulk path (docs/bulk.md): block bytes in and out, connections open,
    bulk_bytes_sent: int = 0  # requests answered with an ERROR frame, connections cut off for stalling
    bulk_connections: int = 0
    bulk_errors: int = 0
    bulk_cut_off: int = 0
    inplace_bytes_received: int = 0  # in-place transfers through the block arena (docs/arena.md)
    inplace_bytes_leased: int = 0
    arena_leases: int = 0
    arena_reservations: int = 0
    arena_leases_expired: int = 0
    arena_reservations_reclaimed: int = 0
    retention_refused: int = 0  # retained puts stored unretained (a full share); retentions that ran out
    retention_expired: int = 0
    prefetch_queued: int = 0  # prefetch keys queued, promoted into RAM, dropped (queue full), not brought
    prefetch_promoted: int = 0
    prefetch_dropped: int = 0
    prefetch_failed: int = 0

    def tier(self, name: str) -> TierInfo:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(name)
