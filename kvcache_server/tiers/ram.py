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


class RamTier(Tier):
    """Blocks in this process's memory, under a hard byte cap."""

    name = "ram"
    kind = TierKind.RAM

    def __init__(
        self,
        capacity_bytes: int,
        *,
        policy: EvictionPolicy | None = None,
        on_evict: EvictCallback | None = None,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self._capacity = capacity_bytes
        self._policy: EvictionPolicy = policy or LRUPolicy()
        self._on_evict = on_evict
        self._blocks: dict[EntryKey, bytes] = {}
        self._used = 0
        self._lock = threading.Lock()
        self._stats = TierStats(name=self.name, kind=self.kind, capacity_bytes=capacity_bytes)

    @staticmethod
    def entry_cost(block: bytes) -> int:
        return len(block) + ENTRY_OVERHEAD_BYTES

    @property
    def used_bytes(self) -> int:
        return self._used

    def get_many_sync(self, namespace: str, keys: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        with self._lock:
            for key in keys:
                entry = (namespace, key)
                block = self._blocks.get(entry)
                if block is None:
                    self._stats.misses += 1
                else:
                    self._stats.hits += 1
                    self._policy.accessed(entry)
                out.append(block)
        return out

    def contains_many_sync(self, namespace: str, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [(namespace, key) in self._blocks for key in keys]

    def put_many_sync(self, namespace: str, items: Sequence[tuple[bytes, bytes]]) -> list[bool]:
        stored: list[bool] = []
        evicted: list[tuple[str, bytes, bytes]] = []
        with self._lock:
            for key, block in items:
                stored.append(self._put_locked((namespace, key), block, evicted))
        if self._on_evict is not None:
            # Outside the lock: the callback may be slow or re-enter the tier.
            for ns, key, block in evicted:
                self._on_evict(ns, key, block)
        return stored

    def _put_locked(self, entry: EntryKey, block: bytes, evicted: list[tuple[str, bytes, bytes]]) -> bool:
        cost = self.entry_cost(block)
        if cost > self._capacity:
            self._stats.rejected += 1
            return False
        old = self._blocks.pop(entry, None)
        if old is not None:
            self._used -= self.entry_cost(old)
            self._policy.removed(entry)
        while self._used + cost > self._capacity:
            victim = self._policy.victim()
            victim_block = self._blocks.pop(victim)  # type: ignore[call-overload]
            self._policy.removed(victim)
            self._used -= self.entry_cost(victim_block)
            self._stats.evictions += 1
            evicted.append((victim[0], victim[1], victim_block))  # type: ignore[index]
        self._blocks[entry] = block
        self._policy.inserted(entry)
        self._used += cost
        self._stats.puts += 1
        return True

    def delete_many_sync(self, namespace: str, keys: Sequence[bytes]) -> int:
        deleted = 0
        with self._lock:
            for key in keys:
                entry = (namespace, key)
                block = self._blocks.pop(entry, None)
                if block is not None:
                    self._policy.removed(entry)
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
