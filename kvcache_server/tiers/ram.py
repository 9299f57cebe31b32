"""The host-RAM tier: blocks in slots of the block arena, a hard byte cap, pluggable eviction (LRU by
default), read leases and reservations for in-place transfers.

Memory: every block lives in one slot of one preallocated, pre-faulted region of capacity_bytes
(kvcache_server.arena, docs/arena.md), so RSS is that region plus the index, whatever the traffic:
no block is ever a fresh allocation. Accounting: every entry costs align(len(block)) +
ENTRY_OVERHEAD_BYTES, where the overhead covers the key objects, the index slot and the eviction
policy's bookkeeping, held outside the region (measured with tracemalloc in
tests/test_ram_tier.py). The sum, with the reservations in flight, never exceeds capacity_bytes:
room is made by evicting *before* an entry is inserted (until the sum fits and a contiguous slot
is free), and an entry that could never fit is refused.

Reads: get_many_sync copies a block out of its slot once (the caller owns the bytes); lease_many
hands out read-only views under a **lease**: a leased slot is never reused nor overwritten until
the lease is released or expires (a leased entry is never evicted; one deleted while leased leaves
the index at once, and its slot, still on its tenant's account, is freed when the last lease
ends). Writes: put_many_sync copies a block into a slot (reserved under the lock, copied outside
it); reserve() hands out a writable slot for a block a server thread writes in place (a segment
put, the bulk path), which adopt_many() indexes under a key without a copy and abandon() frees;
server reservations never expire (their owner abandons them once its writer has ended).

All methods take one lock for a few dictionary operations, so the tier is safe from the event loop
and from threads alike. Under the lock a method copies only what get_many_sync returns; a put's copy
into its slot and the copies of what making room evicted (for on_evict, to demote) are made outside
it. Making room is in two phases so that the second can run in a worker thread: under the lock the
victims leave the index and the new slot is allocated, while the victims' extents stay allocated to
no one else (Evicted); then, outside it, their bytes are copied out (Evicted.copy) and the extents
given back (settle). A slot that may lie where a victim's bytes were is handed out, written or freed
only after that copy has ended (reserve_many, reserve_slots; TierStack does the copying off the loop).

Longer than the project's ~500-line module guideline: the index, the eviction order, the byte cap,
leases and reservations share one lock and one set of invariants (every arena byte is free or in
exactly one slot that the index, a lease or a reservation holds); split apart, each piece would
need the others' internals. The region and the extent allocator are in kvcache_server.arena.
"""

from __future__ import annotations

import heapq
import logging
import math
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from kvcache_core.presence import PRESENCE_PREFIX, pack_location
from kvcache_server.arena import Extents, Lease, Region, Reservation, Slot, align, new_id, remove_dead_arenas
from kvcache_server.presence import PresenceTable
from kvcache_server.tiers.base import Tier, TierKind, TierStats
from kvcache_server.tiers.retention import RetainingPolicy, Retention, RetentionLimits
from kvcache_server.tiers.room import plan_room

log = logging.getLogger(__name__)

ENTRY_OVERHEAD_BYTES = 384
"""Bytes charged per entry on top of its slot (index, key objects, policy node; outside the arena)."""

EntryKey = tuple[str, bytes]
EvictCallback = Callable[[str, bytes, bytes, float], None]
"""Called as on_evict(namespace, key, block, retained_until) for each block evicted to make room
(not for deletes), outside the lock, by settle(); `block` is b"" unless the tier was made with
copy_evicted (and b"" too where the copy was never made: the caller failed before Evicted.copy ran,
or held_below said the tier below holds the block already); `retained_until` is when the victim's
retention would have ended (the tier's clock), 0.0 for a plain one: its demotion keeps the rest."""


@dataclass(slots=True, eq=False)
class Evicted:
    """What making room evicted in one call: blocks out of the index whose bytes may still have to be
    copied out for on_evict, and the extents that keep them until then.

    Until RamTier.settle(evicted), no victim's bytes are overwritten: the part of a victim's extent
    that a new slot of the same call took lies in a slot its caller neither hands out, writes nor
    frees before copy() has ended; the rest of it is allocated to nobody (`held`):

        before    | victim a (1 MiB)                    | victim b (1 MiB)  |
        planned   | new slot (1.5 MiB)                        | held         |
                   `-- not handed out before copy() ends --'  `-- settle() frees it

    copy() reads only those bytes, so it runs in any thread, without the lock.
    """

    victims: list[tuple[str, bytes, int, int]] = field(default_factory=list)  # (namespace, key, offset, length)
    uncopied: list[tuple[str, bytes]] = field(default_factory=list)  # victims the tier below holds: no copy
    kept: dict[tuple[str, bytes], float] = field(default_factory=dict)  # retained victims: when retention ends
    held: list[tuple[int, int]] = field(default_factory=list)  # extents allocated to nobody until settle()
    region: Region | None = None  # where the bytes are copied from (None: nobody wants them)
    blocks: list[bytes] | None = None  # the victims' bytes, once copy() has run

    @property
    def copy_bytes(self) -> int:
        """Bytes copy() still has to copy."""
        return sum(v[3] for v in self.victims) if self.region is not None and self.blocks is None else 0

    def copy(self) -> None:
        """Copies the victims' bytes out of the arena (Region.read: pread, the GIL free meanwhile)."""
        if self.region is not None and self.blocks is None:
            read = self.region.read
            self.blocks = [read(offset, length) for _, _, offset, length in self.victims]


class EvictionPolicy(Protocol):
    """Chooses victims. The tier calls it under its lock; it holds only keys."""

    def inserted(self, key: Hashable) -> None: ...

    def accessed(self, key: Hashable) -> None: ...

    def removed(self, key: Hashable) -> None: ...

    def victim(self) -> Hashable:
        """The key to evict next. Only called while at least one key is present."""
        ...

    def candidates(self) -> Iterator[Hashable]:
        """Every key, next victim first (the tier plans an eviction before it evicts anything)."""
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

    def candidates(self) -> Iterator[Hashable]:
        return iter(self._order)


def tenant_of(namespace: str) -> str:
    """The partition of a namespace: the tenant the server scoped it with ("tenant:ns"), or "" without auth."""
    tenant, sep, _ = namespace.partition(":")
    return tenant if sep else ""


class _Partition:
    """One tenant's share of the tier: its own eviction order, byte count and what it pins.

    Every arena byte the tenant makes the server hold is on its account until it is freed: indexed
    blocks (`used`), open reservations (`reserved`), and slots its leases still pin after their
    entry was deleted or evicted (`orphaned`). `leased` and `leases` bound what its readers pin.
    """

    __slots__ = ("leased", "leases", "orphaned", "pin_cap", "policy", "presence", "quota", "reserved", "used")

    def __init__(self, policy: RetainingPolicy, quota: int, pin_cap: int) -> None:
        self.policy = policy  # the plain eviction order, then the retained entries (tiers/retention.py)
        self.quota = quota  # 0: no share of its own
        self.pin_cap = pin_cap  # bytes its leases and reservations may pin at once
        self.used = 0
        self.reserved = 0  # entry costs of its open reservations (they count against its share)
        self.orphaned = 0  # entry costs of its slots out of the index that leases still pin
        self.leased = 0  # entry costs of the blocks its open leases pin (each lease counted)
        self.leases = 0  # its open leases
        self.presence: PresenceTable | None = None  # its presence index (docs/presence.md), if shared

    def held(self) -> int:
        """Every byte on its account: indexed, reserved, and pinned out of the index."""
        return self.used + self.reserved + self.orphaned

    def pinned(self) -> int:
        return self.leased + self.reserved

    def overage(self) -> int:
        """How far the partition is over its share; a partition without one is over by all it holds."""
        return self.held() - self.quota if self.quota else self.held()


DEFAULT_LEASE_S = 30.0
"""How long a lease lives unless released first."""

_GIL_FREE_COPY_BYTES = 64 << 10
"""Copies into slots at least this large go through numpy, which releases the GIL while it copies."""

DEFAULT_PIN_SHARE = 0.5
"""The share of the capacity a tenant without a quota may pin with leases and reservations."""

DEFAULT_MAX_LEASES = 16384
"""Open leases one tenant may hold."""

DEFAULT_MAX_LEASE_KEYS = 16384
"""Keys one lease_many call leases; the others are answered unleased (fetched another way)."""


class RamTier(Tier):
    """Blocks in the arena, under a hard byte cap, partitioned by tenant.

    Eviction, when an entry of tenant T needs room:
      1. while T is over its own quota (if it has one), evict T's least recently used;
      2. while the tier is over capacity, or no free extent of the arena fits the block, evict the
         least recently used entry of the tenant furthest over its quota (tenants without a quota
         count as over by all they hold).
    So with quotas that sum to at most the capacity, one tenant's flood only ever evicts its own
    blocks. In every step, blocks retained by retain_many (a put's retain_ttl_s; tiers/retention.py)
    come after every unretained block. Without auth there is one partition and this is plain LRU. An
    entry whose slot is leased can be evicted from the index, but its slot stays put until the lease
    ends: when leases pin so much of the arena that no slot fits, the put is refused (a miss later,
    never wrong bytes).
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
        arena_dir: str | None = None,
        prefault: bool = True,
        clock: Callable[[], float] = time.monotonic,
        copy_evicted: bool = True,
        held_below: Callable[[str, bytes], bool] | None = None,
        pin_share: float = DEFAULT_PIN_SHARE,
        max_leases_per_tenant: int = DEFAULT_MAX_LEASES,
        max_keys_per_lease: int = DEFAULT_MAX_LEASE_KEYS,
        retention: RetentionLimits | None = None,
    ) -> None:
        """Maps the arena (see kvcache_server.arena.Region; `arena_dir` shares it through a file there).

        Args:
            copy_evicted: hand on_evict a copy of each evicted block (for demotion); False: b"".
            held_below: with copy_evicted, called under the lock as held_below(namespace, key) for
                each victim (it must not block or take this tier's lock): True when the tier it
                would be demoted to holds it already; that victim is not copied (on_evict gets b"",
                as with copy_evicted False) and its bytes are free at once. Counted in
                evictions_uncopied.
            pin_share: the share of the capacity that one tenant's open leases and reservations may
                pin at once when it has no quota (with a quota: its quota).
            max_leases_per_tenant: open leases one tenant may hold.
            max_keys_per_lease: keys one lease_many call leases; the rest are answered unleased.
            retention: what retain_many may retain, and for how long (tiers/retention.py).

        Raises:
            ValueError: capacity_bytes is not positive.
            OSError: the arena cannot be created (its file, or its space on the tmpfs).
        """
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self._capacity = capacity_bytes
        self._policy_factory = policy_factory
        self._quota_of = quota_of or (lambda tenant: 0)
        self._partitions: dict[str, _Partition] = {}
        self._on_evict = on_evict
        self._blocks: dict[EntryKey, Slot] = {}
        self._used = 0  # entry costs of indexed blocks
        self._reserved = 0  # entry costs of open reservations
        self._lock = threading.Lock()
        self._clock = clock
        self._pin_share = pin_share
        self._copy_evicted = copy_evicted
        self._held_below = held_below
        self.evictions_uncopied = 0  # victims not copied out: held_below said the tier below has them
        self._max_leases = max_leases_per_tenant
        self._max_lease_keys = max_keys_per_lease
        self._orphaned = 0  # entry costs of slots out of the index that leases still pin
        self.leases_refused = 0  # keys answered unleased: a tenant's lease caps, or the per-call cap
        self._stats = TierStats(name=self.name, kind=self.kind, capacity_bytes=capacity_bytes)
        self.region = Region(capacity_bytes, arena_dir, prefault=prefault)
        self._readonly = self.region.view.toreadonly()
        self._extents = Extents(self.region.size)
        self._leases: dict[int, Lease] = {}
        self._reservations: dict[int, Reservation] = {}
        self._expiries: list[tuple[float, int]] = []  # (expires, lease or reservation id), a heap
        self.leases_expired = 0
        self.reservations_reclaimed = 0
        self._retention = Retention(retention or RetentionLimits(), capacity_bytes)
        self.instance_id = secrets.randbits(63) or 1  # names this server's presence tables (a restart: another)
        self._presence_block_bytes = 0  # 0: no presence tables (enable_presence)
        self._presence_lower = False
        self._presence_locations = False

    @staticmethod
    def entry_cost(block: bytes | memoryview) -> int:
        return align(len(block)) + ENTRY_OVERHEAD_BYTES

    @property
    def used_bytes(self) -> int:
        return self._used + self._reserved + self._orphaned

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    def tenant_used_bytes(self, tenant: str) -> int:
        """Bytes on the tenant's account: its indexed blocks, open reservations and orphaned pinned slots."""
        part = self._partitions.get(tenant)
        return part.held() if part else 0

    def _partition(self, namespace: str) -> _Partition:
        tenant = tenant_of(namespace)
        part = self._partitions.get(tenant)
        if part is None:
            quota = self._quota_of(tenant)
            # Without auth there is one partition: its pins are bounded by the arena itself.
            cap = quota or (int(self._capacity * self._pin_share) if tenant else self._capacity)
            part = self._partitions[tenant] = _Partition(RetainingPolicy(self._policy_factory()), quota, cap)
            if self._presence_block_bytes:
                self._open_presence(tenant, part)
        return part

    # -- the presence index (docs/presence.md) ------------------------------------------------------

    def enable_presence(self, block_bytes: int, *, lower_tiers: bool, locations: bool = False) -> None:
        """Keeps a presence table per tenant partition beside the shared arena, sized for blocks of
        `block_bytes` filling the tenant's quota (or the capacity), so same-host clients that map the
        arena answer Lookups of blocks RAM holds without an RPC. A no-op where the arena is not
        shared (kvcache_server.stack_config decides that, with the trust rules of docs/arena.md).

        Args:
            block_bytes: the block size a table is sized for (ram.presence_block_bytes).
            lower_tiers: tiers below RAM exist (a RAM miss is then not a definite miss).
            locations: say where each block lies, so clients copy small gets straight out of the arena
                (kvcache_client.local_reads); off where tenants share the arena (a slot reused by
                another tenant's block of the same key would verify under it).
        """
        if not self.region.path or block_bytes <= 0:
            return
        remove_dead_arenas(os.path.dirname(self.region.path), PRESENCE_PREFIX)
        with self._lock:
            self._presence_block_bytes, self._presence_lower = block_bytes, lower_tiers
            self._presence_locations = locations
            for tenant, part in self._partitions.items():
                if part.presence is None and self._open_presence(tenant, part):
                    for entry, slot in self._blocks.items():
                        if tenant_of(entry[0]) == tenant:
                            part.presence.add(*entry, pack_location(slot.offset, slot.length))  # type: ignore[union-attr]

    def _open_presence(self, tenant: str, part: _Partition) -> bool:
        """Creates the partition's table (under the lock); False (logged) when the tmpfs has no room."""
        blocks = (part.quota or self._capacity) // self._presence_block_bytes
        try:
            where = os.path.dirname(self.region.path)
            part.presence = PresenceTable(
                where,
                blocks,
                instance_id=self.instance_id,
                lower_tiers=self._presence_lower,
                locations=self._presence_locations,
            )
        except OSError as exc:
            log.warning("presence index of tenant %r not created (Lookups stay RPCs): %s", tenant, exc)
            return False
        return True

    def presence_path(self, tenant: str) -> str:
        """The file of `tenant`'s presence table ("" tenant: auth off), created on first use; "" when
        there is none (the arena is not shared, presence is off, or the table could not be made)."""
        if not self._presence_block_bytes:
            return ""
        with self._lock:
            part = self._partition(f"{tenant}:" if tenant else "")
            return part.presence.path if part.presence is not None else ""

    def _bytes(self, slot: Slot) -> memoryview:
        return self.region.view[slot.offset : slot.offset + slot.length]

    # -- reads ---------------------------------------------------------------------------------

    def get_many_sync(self, namespace: str, keys: Sequence[bytes]) -> list[bytes | None]:
        """Each key's block, copied out of its slot (the caller owns it), or None."""
        out: list[bytes | None] = []
        with self._lock:
            part = self._partition(namespace)
            now = self._clock()
            for key in keys:
                entry = (namespace, key)
                slot = self._blocks.get(entry)
                if slot is None:
                    self._stats.misses += 1
                    out.append(None)
                else:
                    self._stats.hits += 1
                    part.policy.accessed(entry)
                    self._retention.touched(entry, now)
                    out.append(bytes(self._bytes(slot)))
        return out

    def lease_many(
        self,
        namespace: str,
        keys: Sequence[bytes],
        ttl_s: float = DEFAULT_LEASE_S,
        *,
        count_misses: bool = True,
        capped: bool = True,
    ) -> list[Lease | None]:
        """A read lease on each key's block, or None (a miss, or with `capped` a key past the
        tenant's lease caps or the per-call cap: counted in leases_refused, for the caller to fetch
        another way). With `capped` (leases handed to clients) a key named twice shares one lease;
        without (the server's own, for sending a Get's reply, bounded by the Get's window and
        released as each reply is sent) every position gets its own. Release each with release()."""
        out: list[Lease | None] = []
        with self._lock:
            now = self._clock()
            self._reap_locked(now)
            part = self._partition(namespace)
            given: dict[bytes, Lease] = {}
            for n, key in enumerate(keys):
                again = given.get(key) if capped else None
                if again is not None:
                    out.append(again)
                    continue
                entry = (namespace, key)
                slot = self._blocks.get(entry)
                if slot is None:
                    self._stats.misses += count_misses
                    out.append(None)
                    continue
                cost = self.entry_cost_of(slot.length)
                if capped and (
                    n >= self._max_lease_keys or part.leases >= self._max_leases or part.pinned() + cost > part.pin_cap
                ):
                    self.leases_refused += 1
                    out.append(None)
                    continue
                self._stats.hits += 1
                part.policy.accessed(entry)
                self._retention.touched(entry, now)
                lease = self._lease_locked(part, namespace, slot, now + ttl_s)
                given[key] = lease
                out.append(lease)
        return out

    def lease_all(self, namespace: str, keys: Sequence[bytes], ttl_s: float) -> list[Lease] | None:
        """One lease per position on every key's block when RAM holds all of them, else None and
        nothing changed (no lease, no hit or miss counted: the caller reads the lower tiers the
        usual way, which counts). Uncapped, as lease_many(capped=False): the server's own leases
        for sending a reply (kvcache_server.bulk.session), released as soon as it is sent.
        Thread-safe: everything happens under the lock, so no eviction runs between the check
        and the leases."""
        with self._lock:
            now = self._clock()
            self._reap_locked(now)
            slots = [self._blocks.get((namespace, key)) for key in keys]
            if any(slot is None for slot in slots):
                return None
            part = self._partition(namespace)
            out: list[Lease] = []
            for key, slot in zip(keys, slots, strict=True):
                assert slot is not None
                self._stats.hits += 1
                entry = (namespace, key)
                part.policy.accessed(entry)
                self._retention.touched(entry, now)
                out.append(self._lease_locked(part, namespace, slot, now + ttl_s))
        return out

    def touch_many(self, namespace: str, keys: Sequence[bytes]) -> int:
        """Counts the blocks RAM holds of `keys` as read (a hit each, most recently used, their
        retention renewed) without handing anything out: a same-host client read them straight out
        of the arena (kvcache_client.local_reads); returns their bytes. Keys it does not hold are
        not counted (the client copied them before they left, or failed and asked again)."""
        read = 0
        with self._lock:
            now = self._clock()
            part = self._partition(namespace)
            for key in keys:
                entry = (namespace, key)
                slot = self._blocks.get(entry)
                if slot is None:
                    continue
                self._stats.hits += 1
                part.policy.accessed(entry)
                self._retention.touched(entry, now)
                read += slot.length
        return read

    def _lease_locked(self, part: _Partition, namespace: str, slot: Slot, expires: float) -> Lease:
        """A new read lease on `slot` (under the lock): pinned until released or expired."""
        self._pin(slot)
        part.leases += 1
        part.leased += self.entry_cost_of(slot.length)
        lease = Lease(
            new_id(self._leases, self._reservations),
            namespace,
            slot.offset,
            slot.length,
            self._readonly[slot.offset : slot.offset + slot.length],
            expires,
            slot,
        )
        self._leases[lease.id] = lease
        heapq.heappush(self._expiries, (lease.expires, lease.id))
        return lease

    def release(self, lease_ids: Sequence[int], tenant: str | None = None) -> int:
        """Ends the leases (unknown or expired ids are ignored; with `tenant`, so are other
        tenants' leases); returns how many were live."""
        released = 0
        with self._lock:
            for lease_id in lease_ids:
                lease = self._leases.get(lease_id)
                if lease is not None and (tenant is None or tenant_of(lease.namespace) == tenant):
                    self._end_lease(lease)
                    released += 1
        return released

    def _end_lease(self, lease: Lease) -> None:
        del self._leases[lease.id]
        part = self._partition(lease.namespace)
        part.leases -= 1
        part.leased -= self.entry_cost_of(lease.length)
        self._unpin(lease._slot)

    def contains_many_sync(self, namespace: str, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [(namespace, key) in self._blocks for key in keys]

    # -- writes --------------------------------------------------------------------------------

    def put_many_sync(self, namespace: str, items: Sequence[tuple[bytes, bytes | memoryview]]) -> list[bool]:
        """Copies each block into a slot of its own and indexes it under its key (stage_many, then
        adopt_many): readers and writers of other keys never wait for a copy."""
        out: list[bool] = []
        for key, block in items:  # one by one: a later block may evict an earlier one of the same put
            (res,) = self.stage_many(namespace, [(key, block)])
            out.extend(self.adopt_many(namespace, [(key, res)]) if res is not None else [False])
        return out

    def stage_many(self, namespace: str, items: Sequence[tuple[bytes, bytes | memoryview]]) -> list[Reservation | None]:
        """Each block copied into a slot reserved for it, not yet indexed, or None where there is no
        room: adopt_many indexes them, abandon frees them. Everything is copied here, in the calling
        thread (reserve_slots, then the copies, then settle): call it from a worker thread for large
        blocks. A block that replaces one stored under its key never evicts that one, and a refused
        block keeps it. Thread-safe; on an exception nothing stays reserved."""
        staged, evicted = self.reserve_slots(namespace, [(key, len(block)) for key, block in items])
        self._copy_then_settle(staged, evicted, lambda: self.fill(staged, items))
        return staged

    def reserve_slots(
        self, namespace: str, items: Sequence[tuple[bytes, int]]
    ) -> tuple[list[Reservation | None], Evicted]:
        """Phase one of stage_many: a slot reserved for each (key, nbytes), or None where there is no
        room (as stage_many; without the tenant's pin cap), and what making room evicted. Copies
        nothing. The caller then runs evicted.copy() (in a worker thread when large), writes the
        blocks into their slots (fill), and calls settle(evicted); no reservation may be written or
        abandoned before evicted.copy() has ended (a slot may lie where a victim's bytes are)."""
        return self._reserve_batch(namespace, [(n, (namespace, key)) for key, n in items], capped=False)

    @staticmethod
    def fill(staged: Sequence[Reservation | None], items: Sequence[tuple[bytes, bytes | memoryview]]) -> None:
        """Copies each block into its reserved slot (None: not reserved, skipped)."""
        for res, (_, block) in zip(staged, items, strict=True):
            if res is None:
                continue
            if len(block) >= _GIL_FREE_COPY_BYTES:  # numpy drops the GIL for the copy
                np.copyto(np.frombuffer(res.buffer, np.uint8), np.frombuffer(block, np.uint8))
            else:
                res.buffer[:] = block

    def adopt_many(
        self,
        namespace: str,
        items: Sequence[tuple[bytes, Reservation]],
        *,
        fenced: Callable[[str, bytes], bool] | None = None,
        retain_ttl_s: float = 0.0,
    ) -> list[bool]:
        """Indexes reserved slots under their keys, without a copy (the caller verified the blocks).

        A reservation that expired, was abandoned, is already committed or was made for another
        namespace is not stored (False); nor, with `fenced`, one whose key fenced(namespace, key) says
        must not land (a Delete of it is running), asked under the same hold of the lock as the
        indexing: a thread other than the event loop's commits so (TierStack.commit_in_thread). Its
        reservation stays open, for the caller to abandon. With `retain_ttl_s`, what was indexed is
        retained (retain_many) in that same hold: no reservation in another thread evicts it between."""
        with self._lock:
            now = self._clock()
            self._reap_locked(now)
            stored = self._adopt_locked(namespace, items, fenced)
            if retain_ttl_s > 0:
                kept = [key for (key, _), ok in zip(items, stored, strict=True) if ok]
                self._retain_locked(namespace, kept, retain_ttl_s, now)
            return stored

    def _adopt_locked(
        self,
        namespace: str,
        items: Sequence[tuple[bytes, Reservation]],
        fenced: Callable[[str, bytes], bool] | None = None,
    ) -> list[bool]:
        stored: list[bool] = []
        part = self._partition(namespace)
        for key, given in items:
            entry = (namespace, key)
            res = self._reservations.get(given.id)
            if res is None or res.namespace != namespace:
                self._stats.rejected += 1
                stored.append(False)
                continue
            if fenced is not None and fenced(namespace, key):
                stored.append(False)
                continue
            # The reservation already counts against the share and the cap: it becomes the
            # entry (nothing is evicted), and the entry it replaces (if any) leaves the index.
            cost = self.entry_cost_of(res.length)
            del self._reservations[res.id]
            self._reserved -= cost
            part.reserved -= cost
            res._slot.pins -= 1
            self._drop_entry(part, entry)
            self._index(part, entry, res._slot)
            stored.append(True)
        return stored

    def adopt_leased(
        self, namespace: str, items: Sequence[tuple[bytes, Reservation]], ttl_s: float
    ) -> list[Lease | None]:
        """adopt_many, and a read lease on each slot it indexed, under one hold of the lock (so no
        eviction in another thread comes between): a promotion's blocks, read straight into their
        slots, are indexed and served from them. None where adopt_many would give False (the
        reservation is not open: the caller still owns its bytes until it abandons it). The leases are
        the server's own (not capped), released with release()."""
        out: list[Lease | None] = []
        with self._lock:
            now = self._clock()
            self._reap_locked(now)
            part = self._partition(namespace)
            for (key, _), ok in zip(items, self._adopt_locked(namespace, items), strict=True):
                slot = self._blocks.get((namespace, key)) if ok else None
                out.append(None if slot is None else self._lease_locked(part, namespace, slot, now + ttl_s))
        return out

    def retain_many(self, namespace: str, keys: Sequence[bytes], ttl_s: float) -> int:
        """Retains the indexed blocks of `keys` for ttl_s seconds (or renews their retention): they
        are evicted only after every unretained block (tiers/retention.py). Returns how many are
        retained; a key not indexed is skipped, and one past its tenant's (or the tier's) share stays
        unretained, counted in retention_stats()["refused"]."""
        if ttl_s <= 0:
            return 0
        with self._lock:
            now = self._clock()
            self._reap_locked(now)
            return self._retain_locked(namespace, keys, ttl_s, now)

    def _retain_locked(self, namespace: str, keys: Sequence[bytes], ttl_s: float, now: float) -> int:
        retained = 0
        part = self._partition(namespace)
        tenant = tenant_of(namespace)
        for key in keys:
            entry = (namespace, key)
            slot = self._blocks.get(entry)
            if slot is None:
                continue
            fresh = entry not in self._retention
            if self._retention.grant(entry, tenant, self.entry_cost_of(slot.length), ttl_s, now):
                retained += 1
                if fresh:
                    part.policy.keep(entry)
        return retained

    def retention_ttl(self, asked_s: float) -> float:
        """The TTL a put's retain_ttl_s comes to (the configured default for 0, capped at max_ttl_s)."""
        return self._retention.ttl_for(asked_s)

    def retained(self, namespace: str, key: bytes) -> bool:
        with self._lock:
            return (namespace, key) in self._retention

    def retention_stats(self) -> dict[str, int]:
        """Retained blocks and bytes now; grants refused for a full share; retentions that ran out."""
        with self._lock:
            self._reap_locked(self._clock())
            r = self._retention
            return {"blocks": len(r), "bytes": r.retained_bytes, "refused": r.refused, "expired": r.expired}

    def settle(self, evicted: Evicted) -> None:
        """Phase two of making room, once evicted.copy() has ended (or will never run): gives the
        extents held for the victims' bytes back and hands each victim to on_evict (outside the lock:
        the callback may be slow or re-enter the tier). Call once per Evicted."""
        if evicted.held:
            with self._lock:
                for offset, length in evicted.held:
                    self._extents.free(offset, length)
            evicted.held = []
        victims, evicted.victims = evicted.victims, []
        uncopied, evicted.uncopied = evicted.uncopied, []
        if self._on_evict is None or not (victims or uncopied):
            return
        blocks = evicted.blocks if evicted.blocks is not None else [b""] * len(victims)
        kept, evicted.kept = evicted.kept, {}
        for (ns, key, _, _), block in zip(victims, blocks, strict=True):
            self._on_evict(ns, key, block, kept.get((ns, key), 0.0))
        for ns, key in uncopied:
            self._on_evict(ns, key, b"", kept.get((ns, key), 0.0))

    def _copy_then_settle(
        self, made: Sequence[Reservation | None], evicted: Evicted, then: Callable[[], None] | None = None
    ) -> None:
        """Both phases here and now: copies the victims out, runs `then` (writes into the slots), and
        settles; on an exception the reservations are abandoned (after the copy: none is lost to a
        failing callback, and none is freed while a victim's bytes in it are still being read)."""
        try:
            evicted.copy()
            if then is not None:
                then()
        except BaseException:
            self.abandon([r.id for r in made if r is not None])
            self.settle(evicted)
            raise
        try:
            self.settle(evicted)
        except BaseException:  # reservations do not expire: none may be lost to a failing callback
            self.abandon([r.id for r in made if r is not None])
            raise

    @staticmethod
    def entry_cost_of(length: int) -> int:
        return align(length) + ENTRY_OVERHEAD_BYTES

    def reserve(self, namespace: str, nbytes: int, ttl_s: float = math.inf) -> Reservation | None:
        """A writable slot for a block of `nbytes` (see reserve_many), within the tenant's pin cap;
        what making room evicted is copied out here, in the calling thread."""
        (res,), evicted = self._reserve_batch(namespace, [(nbytes, None)], ttl_s=ttl_s, capped=True)
        self._copy_then_settle([res], evicted)
        return res

    def reserve_many(
        self, namespace: str, sizes: Sequence[int], *, count_refusal: bool = True
    ) -> tuple[list[Reservation | None], Evicted]:
        """Phase one of reserving writable slots for blocks of `sizes`, one after the other, evicting
        to make room; within the tenant's pin cap. The list stops at the first size that cannot fit
        (its None last) and every slot is reserved only if none is None.

        Copies nothing: the caller runs evicted.copy() (in a worker thread when large), then either
        hands the slots to their writer or abandons them, then calls settle(evicted); no slot may be
        written or abandoned before evicted.copy() has ended (it may lie where a victim's bytes are).

        Reservations are the server's own (a segment put, a bulk session): only server threads write
        into them, and their owner abandons whatever it did not commit, after its writer has ended.
        They never expire: a reservation reclaimed while its writer still ran would let that
        writer's late bytes land in a slot reused for another key.

        count_refusal=False: a refusal is not counted in the tier's `rejected` (a caller that then asks
        again another way, which counts it: TierStack.reserve_in_thread)."""
        return self._reserve_batch(
            namespace, [(n, None) for n in sizes], capped=True, stop=True, count_refusal=count_refusal
        )

    def _reserve_batch(
        self,
        namespace: str,
        wants: Sequence[tuple[int, EntryKey | None]],
        *,
        capped: bool,
        ttl_s: float = math.inf,
        stop: bool = False,
        count_refusal: bool = True,
    ) -> tuple[list[Reservation | None], Evicted]:
        """A slot for each (nbytes, entry it replaces), under one hold of the lock; None where it
        cannot fit or (with `capped`) the tenant pins its share already; with `stop`, none after the
        first None."""
        evicted = Evicted(region=self.region if self._on_evict is not None and self._copy_evicted else None)
        out: list[Reservation | None] = []
        with self._lock:
            rejected = self._stats.rejected
            now = self._clock()
            self._reap_locked(now)
            part = self._partition(namespace)
            for nbytes, keep in wants:
                res = self._reserve_locked(part, namespace, nbytes, ttl_s, now, evicted, capped=capped, keep=keep)
                out.append(res)
                if res is None and stop:
                    break
            if not count_refusal:
                self._stats.rejected = rejected
        return out, evicted

    def _reserve_locked(
        self,
        part: _Partition,
        namespace: str,
        nbytes: int,
        ttl_s: float,
        now: float,
        evicted: Evicted,
        *,
        capped: bool,
        keep: EntryKey | None,
    ) -> Reservation | None:
        cost = self.entry_cost_of(nbytes)
        if capped and part.pinned() + cost > part.pin_cap:
            self._stats.rejected += 1
            return None
        slot = self._allocate_locked(part, nbytes, evicted, extra=cost, keep=keep if keep in self._blocks else None)
        if slot is None:
            return None
        self._pin(slot)
        self._reserved += cost
        part.reserved += cost
        res = Reservation(
            new_id(self._leases, self._reservations),
            namespace,
            slot.offset,
            nbytes,
            self.region.view[slot.offset : slot.offset + nbytes],
            now + ttl_s,
            slot,
        )
        self._reservations[res.id] = res
        if ttl_s != math.inf:
            heapq.heappush(self._expiries, (res.expires, res.id))
        return res

    def reservation(self, reservation_id: int) -> Reservation | None:
        """The open reservation of that id, or None (never made, committed, abandoned or reclaimed)."""
        with self._lock:
            return self._reservations.get(reservation_id)

    def abandon(self, reservation_ids: Sequence[int], namespace: str | None = None) -> int:
        """Frees the reservations' slots (with `namespace`, only those made for it); returns how many
        were open."""
        freed = 0
        with self._lock:
            for rid in reservation_ids:
                res = self._reservations.get(rid)
                if res is not None and (namespace is None or res.namespace == namespace):
                    self._end_reservation(res)
                    freed += 1
        return freed

    def _end_reservation(self, res: Reservation) -> None:
        del self._reservations[res.id]
        cost = self.entry_cost_of(res.length)
        self._reserved -= cost
        self._partition(res.namespace).reserved -= cost
        self._unpin(res._slot)

    def reap(self) -> int:
        """Ends the leases and reclaims the reservations whose time is up; returns how many."""
        with self._lock:
            return self._reap_locked(self._clock())

    def _reap_locked(self, now: float) -> int:
        for entry in self._retention.due(now):  # back to the plain order, evictable as any other
            self._partition(entry[0]).policy.unkeep(entry)
        reaped = 0
        while self._expiries and self._expiries[0][0] <= now:
            _, item_id = heapq.heappop(self._expiries)
            lease = self._leases.get(item_id)
            if lease is not None:
                self.leases_expired += 1
                self._end_lease(lease)
                reaped += 1
                continue
            res = self._reservations.get(item_id)
            if res is not None:
                self.reservations_reclaimed += 1
                self._end_reservation(res)
                reaped += 1
        return reaped

    @staticmethod
    def _pin(slot: Slot) -> None:
        slot.pins += 1

    def _unpin(self, slot: Slot) -> None:
        slot.pins -= 1
        if slot.pins == 0 and not slot.indexed:
            self._free_slot(slot)

    def _free_slot(self, slot: Slot) -> None:
        """The slot's extent goes back to the allocator; an orphan's cost leaves its tenant's account."""
        self._extents.free(slot.offset, slot.length)
        owner = slot.orphan_of
        if owner is not None:
            cost = self.entry_cost_of(slot.length)
            owner.orphaned -= cost  # type: ignore[attr-defined]
            self._orphaned -= cost
            slot.orphan_of = None

    def _index(self, part: _Partition, entry: EntryKey, slot: Slot) -> None:
        slot.indexed = True
        self._blocks[entry] = slot
        if part.presence is not None:
            part.presence.add(*entry, pack_location(slot.offset, slot.length))
        part.policy.inserted(entry)
        cost = self.entry_cost_of(slot.length)
        part.used += cost
        self._used += cost
        self._stats.puts += 1

    def _drop_entry(self, part: _Partition, entry: EntryKey) -> Slot | None:
        """Removes an entry from the index; its slot is freed unless a lease or reservation pins it,
        in which case its cost stays on the tenant's account (orphaned) until the last pin ends."""
        slot = self._blocks.pop(entry, None)
        if slot is None:
            return None
        part.policy.removed(entry)
        self._retention.drop(entry)
        if part.presence is not None:
            part.presence.remove(*entry)
        cost = self.entry_cost_of(slot.length)
        part.used -= cost
        self._used -= cost
        slot.indexed = False
        if slot.pins == 0:
            self._extents.free(slot.offset, slot.length)
        else:  # the lease keeps the slot, on its tenant's account; the index lets go
            slot.orphan_of = part
            part.orphaned += cost
            self._orphaned += cost
        return slot

    def _evict(self, entry: EntryKey, evicted: Evicted) -> None:
        if self._on_evict is not None:
            if evicted.region is not None and self._held_below is not None and self._held_below(*entry):
                # The tier below holds these bytes already (a block promoted from disk is still on
                # disk): the demotion would be skipped, so they are neither copied nor held.
                evicted.uncopied.append(entry)
                self.evictions_uncopied += 1
            else:  # its bytes are copied out later, outside the lock (Evicted)
                slot = self._blocks[entry]
                evicted.victims.append((entry[0], entry[1], slot.offset, slot.length))
        if self._on_evict is not None and entry in self._retention:  # its demotion keeps what is left
            evicted.kept[entry] = self._retention.expires(entry)
        self._drop_entry(self._partition(entry[0]), entry)
        self._stats.evictions += 1

    def _allocate_locked(
        self,
        part: _Partition,
        nbytes: int,
        evicted: Evicted,
        *,
        extra: int,
        keep: EntryKey | None = None,
    ) -> Slot | None:
        """A free slot for `nbytes` whose entry costs `extra`, evicting as the class docstring says;
        None (counted) if none can be made. The evictions are planned first (kvcache_server.tiers.
        room.plan_room): nothing is evicted unless the plan yields both the byte room and one
        contiguous extent that fits; `keep` (the entry a re-put replaces) is never a victim. The
        victims leave the index and their extents the allocator's free list: what the new slot does
        not take of them is held in `evicted` until settle(), when their bytes are to be copied."""
        if extra > self._capacity or (part.quota and extra > part.quota):
            self._stats.rejected += 1
            return None
        if self._extents.fits(nbytes) and self._room_for(part, extra):
            offset = self._extents.alloc(nbytes)
            assert offset is not None
            return Slot(offset, nbytes)
        victims = plan_room(self, part, nbytes, extra, keep)
        if victims is None:
            self._stats.rejected += 1
            return None
        first = len(evicted.victims)
        for entry in victims:
            self._evict(entry, evicted)
        offset = self._extents.alloc(nbytes)
        if offset is not None and not self._room_for(part, extra):  # the plan is exact; a bug must not overfill
            self._extents.free(offset, nbytes)
            offset = None
        if evicted.region is not None:  # nobody may reuse the victims' bytes before they are copied out
            for _, _, at, length in evicted.victims[first:]:
                evicted.held += self._extents.take(at, length)
        if offset is None:
            self._stats.rejected += 1
            return None
        return Slot(offset, nbytes)

    def _room_for(self, part: _Partition, cost: int) -> bool:
        within_share = not part.quota or part.held() + cost <= part.quota
        return within_share and self._used + self._reserved + self._orphaned + cost <= self._capacity

    def delete_many_sync(self, namespace: str, keys: Sequence[bytes]) -> int:
        deleted = 0
        with self._lock:
            part = self._partition(namespace)
            for key in keys:
                if self._drop_entry(part, (namespace, key)) is not None:
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

    def arena_stats(self) -> dict[str, int]:
        """Slot bookkeeping: free bytes and extents of the arena, leases and reservations open.

        Leases and reservations whose time is up are ended first: nothing else reaps them until the
        next lease, reservation or put, so an idle server's Stats and scrapes would count them open."""
        with self._lock:
            self._reap_locked(self._clock())
            return {
                "arena_bytes": self.region.size,
                "free_bytes": self._extents.free_bytes,
                "free_extents": len(self._extents.extents()),
                "leases": len(self._leases),
                "reservations": len(self._reservations),
                "leases_expired": self.leases_expired,
                "reservations_reclaimed": self.reservations_reclaimed,
                "leases_refused": self.leases_refused,
            }

    async def close(self) -> None:
        """Unmaps the arena (and removes its file). Leases and reservations end with it."""
        with self._lock:
            self._leases.clear()
            self._reservations.clear()
            self._readonly.release()
            self.region.close()
            for part in self._partitions.values():
                if part.presence is not None:
                    part.presence.close()
                    part.presence = None

    def stats(self) -> TierStats:
        with self._lock:
            self._reap_locked(self._clock())  # as arena_stats: used_bytes counts what expired leases pinned
            s = self._stats
            return TierStats(
                name=s.name,
                kind=s.kind,
                used_bytes=self._used + self._reserved + self._orphaned,
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
                retained_blocks=len(self._retention),
                retained_bytes=self._retention.retained_bytes,
            )
