"""Retention in the RAM tier: blocks a put asked to keep for a while, evicted only once nothing else
can be (docs/tiers.md, "Sessions that stay").

A retained entry leaves its partition's plain eviction order for a second, retained order, which
eviction walks only after the plain one (RetainingPolicy.candidates). So an agentic session's
prefix, put with a TTL, outlives any flood of one-off blocks, and is still evictable when nothing
else is: retention never makes a put fail, never pins a slot (leases and reservations do that),
and never takes a block off its tenant's account or quota.

Bounded, so that retention cannot fill the cache:

- **share**: a tenant's retained entry costs stay within `max_share` of the tier's capacity, and
  all tenants' together within `max_total_share`; a put past either stores its blocks unretained
  (counted in `refused`);
- **time**: a retention ends `ttl_s` after it was granted or last renewed (a re-put with a TTL, or
  a hit, renews it; a TTL is capped at `max_ttl_s`); the entry then goes back to the plain order as
  its most recently used block and ages out like any other.

Deadlines are kept in a heap with lazy deletion (an entry renewed or dropped leaves a stale item,
skipped when popped), checked by the tier on every lease, reservation, put and Stats call, under its
lock: expiry is exact to the next call into the tier. The heap holds at most one live item per
retained entry plus one stale item per renewal since the last expiry pass; renewals re-push only
when the deadline moved by more than an eighth of the TTL, so a hot block costs O(1) items.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvcache_server.tiers.ram import EvictionPolicy


@dataclass(frozen=True, slots=True)
class RetentionLimits:
    """How much a put may retain, and for how long (the [retention] config section, which validates them)."""

    max_share: float = 0.25  # of the tier's capacity, per tenant (without auth: the one partition)
    max_total_share: float = 0.5  # of the tier's capacity, all tenants together
    max_ttl_s: float = 3600.0  # longer TTLs are cut to this
    default_ttl_s: float = 0.0  # the TTL of a put that asks for none (0: such puts retain nothing)


class RetainingPolicy:
    """An eviction policy in two orders: the plain one (any EvictionPolicy) and the retained
    entries, least recently used first; every plain entry is a candidate before any retained one."""

    __slots__ = ("kept", "plain")

    def __init__(self, plain: EvictionPolicy) -> None:
        self.plain = plain
        self.kept: OrderedDict[Hashable, None] = OrderedDict()

    def inserted(self, key: Hashable) -> None:
        self.plain.inserted(key)

    def accessed(self, key: Hashable) -> None:
        if key in self.kept:
            self.kept.move_to_end(key)
        else:
            self.plain.accessed(key)

    def removed(self, key: Hashable) -> None:
        if key in self.kept:
            del self.kept[key]
        else:
            self.plain.removed(key)

    def victim(self) -> Hashable:
        return next(self.candidates())

    def candidates(self) -> Iterator[Hashable]:
        return itertools.chain(self.plain.candidates(), iter(self.kept))

    def plain_candidates(self) -> Iterator[Hashable]:
        return self.plain.candidates()

    def kept_candidates(self) -> Iterator[Hashable]:
        return iter(self.kept)

    def keep(self, key: Hashable) -> None:
        """Moves a plain entry to the retained order (most recently used there)."""
        self.plain.removed(key)
        self.kept[key] = None

    def unkeep(self, key: Hashable) -> None:
        """Moves a retained entry back to the plain order, as its most recently used entry."""
        del self.kept[key]
        self.plain.inserted(key)


@dataclass(slots=True)
class _Kept:
    tenant: str
    cost: int  # the entry cost on the tenant's retained account
    ttl_s: float
    expires: float
    queued: float  # the deadline of its live heap item


class Retention:
    """Which entries are retained, until when, and the per-tenant accounts; the tier that owns it
    (RAM: (namespace, key) entries; disk: its index keys, tiers/disk_retention.py) calls every
    method under its lock."""

    def __init__(self, limits: RetentionLimits, capacity_bytes: int) -> None:
        self.limits = limits
        self._tenant_cap = int(capacity_bytes * limits.max_share)
        self._total_cap = int(capacity_bytes * limits.max_total_share)
        self._kept: dict[Hashable, _Kept] = {}
        self._by_tenant: dict[str, int] = {}
        self._heap: list[tuple[float, Hashable]] = []
        self.retained_bytes = 0
        self.refused = 0  # grants refused for a full share (the block stored unretained)
        self.expired = 0  # retentions that ran out of time

    def __contains__(self, entry: object) -> bool:
        return entry in self._kept

    def __len__(self) -> int:
        return len(self._kept)

    def ttl_for(self, asked_s: float) -> float:
        """The TTL a put's retain_ttl_s comes to: the default for 0, capped at max_ttl_s."""
        return min(asked_s or self.limits.default_ttl_s, self.limits.max_ttl_s)

    def tenant_bytes(self, tenant: str) -> int:
        return self._by_tenant.get(tenant, 0)

    def grant(self, entry: Hashable, tenant: str, cost: int, ttl_s: float, now: float) -> bool:
        """Retains an indexed entry for ttl_s (or renews its retention, to at least now + ttl_s);
        False, counted, when its tenant's or the tier's share has no room (nothing changes then)."""
        kept = self._kept.get(entry)
        if kept is not None:
            kept.ttl_s = max(kept.ttl_s, ttl_s)
            self._renew(entry, kept, now)
            return True
        held = self._by_tenant.get(tenant, 0)
        if held + cost > self._tenant_cap or self.retained_bytes + cost > self._total_cap:
            self.refused += 1
            return False
        kept = self._kept[entry] = _Kept(tenant, cost, ttl_s, now + ttl_s, now + ttl_s)
        self._by_tenant[tenant] = held + cost
        self.retained_bytes += cost
        heapq.heappush(self._heap, (kept.expires, entry))
        return True

    def expires(self, entry: Hashable) -> float:
        """When the entry's retention ends (the tier's clock), or 0.0 when it has none."""
        kept = self._kept.get(entry)
        return 0.0 if kept is None else kept.expires

    def touched(self, entry: Hashable, now: float) -> None:
        """A hit on the entry: its retention, if any, renewed for its TTL."""
        kept = self._kept.get(entry)
        if kept is not None:
            self._renew(entry, kept, now)

    def _renew(self, entry: Hashable, kept: _Kept, now: float) -> None:
        kept.expires = max(kept.expires, now + kept.ttl_s)
        if kept.expires - kept.queued > kept.ttl_s / 8:  # else the live item's pass re-queues it
            kept.queued = kept.expires
            heapq.heappush(self._heap, (kept.expires, entry))

    def drop(self, entry: Hashable) -> bool:
        """The entry left the index (evicted, deleted, replaced): its retention ends; True if it had one."""
        kept = self._kept.pop(entry, None)
        if kept is None:
            return False
        self._by_tenant[kept.tenant] -= kept.cost
        self.retained_bytes -= kept.cost
        return True

    def due(self, now: float) -> list[Hashable]:
        """The entries whose retention ran out by `now`, removed from the accounts (the tier moves
        them back to their plain order)."""
        out: list[Hashable] = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            at, entry = heapq.heappop(heap)
            kept = self._kept.get(entry)
            if kept is None or at != kept.queued:
                continue  # stale: dropped, or re-queued at a later deadline
            if kept.expires > now:  # renewed by less than the re-queue step: one more item
                kept.queued = kept.expires
                heapq.heappush(heap, (kept.expires, entry))
                continue
            self.drop(entry)
            self.expired += 1
            out.append(entry)
        if len(heap) > 4 * len(self._kept) + 64:  # many stale items: rebuild from the live ones
            self._heap = [(k.queued, e) for e, k in self._kept.items()]
            heapq.heapify(self._heap)
        return out
