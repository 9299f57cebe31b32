"""The host-RAM tier: a hard byte cap, pluggable eviction (LRU by default), no copies on reads.

Accounting: every entry costs len(block) + ENTRY_OVERHEAD_BYTES, where the
overhead covers the key objects, the index slots and the eviction policy's
bookkeeping (measured with tracemalloc in tests/test_ram_tier.py). The sum
never exceeds capacity_bytes: room is made by evicting *before* an entry is
inserted, and an entry that could never fit is refused.

Reads hand back the very bytes object that was stored; gRPC's serialisation
is the only copy on the read path.

All methods take one lock for a few dictionary operations, so the tier is safe
from the event loop and from threads alike; nothing slow happens under it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Protocol

from kvcache_core.blockwire import block_cost
from kvcache_server.tiers.base import Tier, TierKind, TierStats

ENTRY_OVERHEAD_BYTES = 384
"""Bytes charged per entry on top of the block (index, key objects, policy node)."""

EntryKey = tuple[str, bytes]
EvictCallback = Callable[[str, bytes, bytes], None]
"""Called as on_evict(namespace, key, block) for each block evicted to make room (not for deletes)."""


class EvictionPolicy(Protocol):
    """Chooses victims. The tier calls it under its lock; it holds only keys."""

    def inserted(self, key: Hashable) -> None: ...

    def accessed(self, key: Hashable) -> None: ...

    def removed(self, key: Hashable) -> None: ...

    def victim(self) -> Hashable:
        """The key to evict next. Only called while at least one key is present."""
        ...


class LRUPolicy:
    """Least recently used first (an access is a get hit or a put)."""

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def inserted(self, key: Hashable) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def accessed(self, key: Hashable) -> None:
        self._order.move_to_end(key)

    def removed(self, key: Hashable) -> None:
        del self._order[key]

    def victim(self) -> Hashable:
        return next(iter(self._order))


def tenant_of(namespace: str) -> str:
    """The partition of a namespace: the tenant the server scoped it with ("tenant:ns"), or "" without auth."""
    tenant, sep, _ = namespace.partition(":")
    return tenant if sep else ""


class _Partition:
    """One tenant's share of the tier: its own eviction order and byte count."""

    __slots__ = ("policy", "quota", "used")

    def __init__(self, policy: EvictionPolicy, quota: int) -> None:
        self.policy = policy
        self.quota = quota  # 0: no share of its own
        self.used = 0

    def overage(self) -> int:
        """How far the partition is over its share; a partition without one is over by all it holds."""
        return self.used - self.quota if self.quota else self.used


class RamTier(Tier):
    """Blocks in this process's memory, under a hard byte cap, partitioned by tenant.

    Eviction, when an entry of tenant T needs room:
      1. while T is over its own quota (if it has one), evict T's least recently used;
      2. while the tier is over capacity, evict the least recently used entry of the
         tenant furthest over its quota (tenants without a quota count as over by all
         they hold).
    So with quotas that sum to at most the capacity, one tenant's flood only ever
    evicts its own blocks. Without auth there is one partition and this is plain LRU.
    """

    name = "ram"
    kind = TierKind.RAM

    def __init__(
        self,
        capacity_bytes: int,
        *,
        policy_factory: Callable[[], EvictionPolicy] = LRUPolicy,
        on_evict: EvictCallback | None = None,
        quota_of: Callable[[str], int] | None = None,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self._capacity = capacity_bytes
        self._policy_factory = policy_factory
        self._quota_of = quota_of or (lambda tenant: 0)
        self._partitions: dict[str, _Partition] = {}
        self._on_evict = on_evict
        self._blocks: dict[EntryKey, bytes] = {}
        self._used = 0
        self._lock = threading.Lock()
        self._stats = TierStats(name=self.name, kind=self.kind, capacity_bytes=capacity_bytes)

    @staticmethod
    def entry_cost(block: bytes | memoryview) -> int:
        # A memoryview block (a large block kept in its received message) keeps that message alive.
        return block_cost(block) + ENTRY_OVERHEAD_BYTES

    @property
    def used_bytes(self) -> int:
        return self._used

    def tenant_used_bytes(self, tenant: str) -> int:
        part = self._partitions.get(tenant)
        return part.used if part else 0

    def _partition(self, namespace: str) -> _Partition:
        tenant = tenant_of(namespace)
        part = self._partitions.get(tenant)
        if part is None:
            part = self._partitions[tenant] = _Partition(self._policy_factory(), self._quota_of(tenant))
        return part

    def get_many_sync(self, namespace: str, keys: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        with self._lock:
            part = self._partition(namespace)
            for key in keys:
                entry = (namespace, key)
                block = self._blocks.get(entry)
                if block is None:
                    self._stats.misses += 1
                else:
                    self._stats.hits += 1
                    part.policy.accessed(entry)
                out.append(block)
        return out

    def contains_many_sync(self, namespace: str, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [(namespace, key) in self._blocks for key in keys]

    def put_many_sync(self, namespace: str, items: Sequence[tuple[bytes, bytes]]) -> list[bool]:
        stored: list[bool] = []
        evicted: list[tuple[str, bytes, bytes]] = []
        with self._lock:
            part = self._partition(namespace)
            for key, block in items:
                stored.append(self._put_locked(part, (namespace, key), block, evicted))
        if self._on_evict is not None:
            # Outside the lock: the callback may be slow or re-enter the tier.
            for ns, key, block in evicted:
                self._on_evict(ns, key, block)
        return stored

    def _evict_from(self, part: _Partition, evicted: list[tuple[str, bytes, bytes]]) -> None:
        victim = part.policy.victim()
        block = self._blocks.pop(victim)  # type: ignore[call-overload]
        part.policy.removed(victim)
        cost = self.entry_cost(block)
        part.used -= cost
        self._used -= cost
        self._stats.evictions += 1
        evicted.append((victim[0], victim[1], block))  # type: ignore[index]

    def _put_locked(
        self, part: _Partition, entry: EntryKey, block: bytes, evicted: list[tuple[str, bytes, bytes]]
    ) -> bool:
        cost = self.entry_cost(block)
        if cost > self._capacity or (part.quota and cost > part.quota):
            self._stats.rejected += 1
            return False
        old = self._blocks.pop(entry, None)
        if old is not None:
            part.used -= self.entry_cost(old)
            self._used -= self.entry_cost(old)
            part.policy.removed(entry)
        while part.quota and part.used + cost > part.quota:
            self._evict_from(part, evicted)
        while self._used + cost > self._capacity:
            worst = max((p for p in self._partitions.values() if p.used), key=_Partition.overage)
            self._evict_from(worst, evicted)
        self._blocks[entry] = block
        part.policy.inserted(entry)
        part.used += cost
        self._used += cost
        self._stats.puts += 1
        return True

    def delete_many_sync(self, namespace: str, keys: Sequence[bytes]) -> int:
        deleted = 0
        with self._lock:
            part = self._partition(namespace)
            for key in keys:
                entry = (namespace, key)
                block = self._blocks.pop(entry, None)
                if block is not None:
                    part.policy.removed(entry)
                    part.used -= self.entry_cost(block)
                    self._used -= self.entry_cost(block)
                    deleted += 1
        return deleted

    async def get_many(self, namespace: str, keys: Sequence[bytes]) -> list[bytes | None]:
        return self.get_many_sync(namespace, keys)

    async def contains_many(self, namespace: str, keys: Sequence[bytes]) -> list[bool]:
        return self.contains_many_sync(namespace, keys)

    async def put_many(self, namespace: str, items: Sequence[tuple[bytes, bytes]]) -> list[bool]:
        return self.put_many_sync(namespace, items)

    async def delete_many(self, namespace: str, keys: Sequence[bytes]) -> int:
        return self.delete_many_sync(namespace, keys)

    def stats(self) -> TierStats:
        with self._lock:
            s = self._stats
            return TierStats(
                name=s.name,
                kind=s.kind,
                used_bytes=self._used,
                capacity_bytes=self._capacity,
                blocks=len(self._blocks),
                hits=s.hits,
                misses=s.misses,
                puts=s.puts,
                evictions=s.evictions,
                rejected=s.rejected,
                checksum_failures=s.checksum_failures,
                errors=s.errors,
                healthy=True,
            )
