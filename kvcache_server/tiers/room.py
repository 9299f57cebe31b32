"""Planning room in the RAM tier's arena before anything is evicted (docs/arena.md, "Room").

A put (or a reservation) needs three things at once: its tenant within its share, the tier within
its byte cap, and one free *contiguous* extent of the arena that fits the block. Evicting in LRU
order until all three hold can flush the whole tier and still fail: bytes freed here and there do
not make one extent when leased or reserved slots sit between them. So the tier plans first, on
its own state under its lock, and evicts only a plan that yields all three:

1. its own share: its least recently used unpinned blocks, until it is within its quota;
2. contiguity: if no free extent fits once those are gone, a few more LRU victims (up to 4x the
   block) when they free one; else the cheapest *window*: the run of
   adjacent free extents and evictable blocks (unpinned, of the tenant itself or of a tenant over
   its share) that spans the block with the fewest block bytes to evict. A pinned slot (leased,
   reserved, or out of the index but leased) ends a run;
3. the byte cap: the least recently used unpinned block of the tenant furthest over its share,
   again and again (tenants without a quota count as over by all they hold), counting what
   steps 1 and 2 freed.

Retained blocks (tiers/retention.py) come last in every step: each tenant's eviction order lists
them after its unretained blocks, the LRU searches of steps 2 and 3 take every tenant's unretained
blocks before any tenant's retained one, and a window holding a retained block costs more than any
window without one.

   offset 0                                                               capacity
   | free | blk a | LEASED | free | blk b | blk c | RES | free | blk d | free |
                           `------ window: evict b, c ---'
                             (spans free + b + c; a lease and a reservation bound it)

No plan: the put is refused and nothing is evicted. A pinned block is never a victim (evicting
it frees nothing: its slot stays, on its tenant's account, until the last lease ends).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from kvcache_server.arena import align
from kvcache_server.tiers.retention import RetainingPolicy

if TYPE_CHECKING:
    from kvcache_server.tiers.ram import EntryKey, RamTier, _Partition


_RETAINED_LAST = (RetainingPolicy.plain_candidates, RetainingPolicy.kept_candidates)
"""The eviction orders a step walks across tenants, in turn: unretained blocks, then retained ones."""

WINDOW_SCAN_MAX_BLOCKS = 100_000
"""Above this many blocks the cheapest-window scan (O(blocks log blocks) under the RAM tier's lock)
gives way to LRU order without a budget: more evictions, bounded time per step."""


class _Plan:
    """Victims chosen so far and what they free, per partition."""

    def __init__(self, tier: RamTier, keep: EntryKey | None) -> None:
        self.tier = tier
        self.keep = keep
        self.victims: list[EntryKey] = []
        self.chosen: set[EntryKey] = set()
        self.freed: dict[int, int] = {}

    def cost(self, entry: EntryKey) -> int:
        return self.tier.entry_cost_of(self.tier._blocks[entry].length)

    def evictable(self, entry: EntryKey) -> bool:
        return entry != self.keep and entry not in self.chosen and self.tier._blocks[entry].pins == 0

    def take(self, part: _Partition, entry: EntryKey) -> int:
        c = self.cost(entry)
        self.chosen.add(entry)
        self.victims.append(entry)
        self.freed[id(part)] = self.freed.get(id(part), 0) + c
        return c

    def held(self, part: _Partition) -> int:
        return part.held() - self.freed.get(id(part), 0)

    def overage(self, part: _Partition) -> int:
        return self.held(part) - part.quota if part.quota else self.held(part)

    def next_victim(self, part: _Partition, order: Iterator[EntryKey]) -> EntryKey | None:
        for entry in order:
            if self.evictable(entry):
                return entry
        return None


def plan_room(tier: RamTier, part: _Partition, nbytes: int, cost: int, keep: EntryKey | None) -> list[EntryKey] | None:
    """The entries to evict, in order, so that a block of `nbytes` whose entry costs `cost` fits for
    `part`; None when no eviction can make it fit (then nothing may be evicted). Under the tier's lock."""
    quick = _one_victim(tier, part, nbytes, cost, keep)
    if quick is not None:
        return quick
    plan = _Plan(tier, keep)
    # 1. Its own share.
    if part.quota:
        over = plan.held(part) + cost - part.quota
        order: Iterator[EntryKey] = part.policy.candidates()  # type: ignore[assignment]
        while over > 0:
            entry = plan.next_victim(part, order)
            if entry is None:
                return None  # its own pins fill its share
            over -= plan.take(part, entry)
    # 2. One contiguous extent (before the byte cap: the window's victims count towards it, where
    # LRU victims chosen first would lie anywhere and free no run).
    if not _contiguous(plan, part, nbytes):
        return None
    # 3. The byte cap: unretained blocks of every tenant before any retained one (tiers/retention.py).
    over = tier._used + tier._reserved + tier._orphaned + cost - tier._capacity - sum(plan.freed.values())
    parts = list(tier._partitions.values()) if over > 0 else []
    for order_of in _RETAINED_LAST:
        if over <= 0:
            break
        orders = {id(p): order_of(p.policy) for p in parts}
        heads: dict[int, EntryKey | None] = {id(p): plan.next_victim(p, orders[id(p)]) for p in parts}  # type: ignore[arg-type]
        while over > 0:
            ready = [p for p in parts if heads[id(p)] is not None]
            if not ready:
                break
            worst = max(ready, key=plan.overage)
            entry = heads[id(worst)]
            assert entry is not None
            over -= plan.take(worst, entry)
            heads[id(worst)] = plan.next_victim(worst, orders[id(worst)])  # type: ignore[arg-type]
    if over > 0:
        return None  # leases and reservations pin what is left
    return plan.victims


QUICK_SCAN = 8
"""Least recently used entries _one_victim looks at for one it may evict (leased ones are skipped)."""


def _one_victim(
    tier: RamTier, part: _Partition, nbytes: int, cost: int, keep: EntryKey | None
) -> list[EntryKey] | None:
    """The plan of the three steps below when it is one victim, found without building it: the only
    tenant within its share, and its least recently used unpinned, unretained block alone makes room
    (its extent fits the block, or one free already does, and it frees enough for the byte cap).
    That is every eviction of a full RAM of same-size blocks: a put of 16 x 16 KiB into one spent
    about a third of its reservations in the general plan. None: plan it in full."""
    if len(tier._partitions) != 1 or (part.quota and part.held() + cost > part.quota):
        return None
    for _, entry in zip(range(QUICK_SCAN), RetainingPolicy.plain_candidates(part.policy), strict=False):
        slot = tier._blocks[entry]
        if entry != keep and slot.pins == 0:
            break
    else:
        return None
    if align(slot.length) < align(max(nbytes, 1)) and not tier._extents.fits(nbytes):
        return None
    over = tier._used + tier._reserved + tier._orphaned + cost - tier._capacity - tier.entry_cost_of(slot.length)
    return [entry] if over <= 0 else None  # type: ignore[list-item]


def _contiguous(plan: _Plan, part: _Partition, nbytes: int) -> bool:
    """Adds to the plan what frees one extent that fits `nbytes`: nothing when one is free; a few
    more LRU victims (up to 4x the block) when they free one, as same-size KV blocks do; else the
    cheapest window, found by one scan of the arena. False when no eviction can."""
    tier = plan.tier
    need = align(max(nbytes, 1))
    if tier._extents.fits(nbytes):
        return True
    free = _Runs(tier._extents.extents())
    for entry in plan.victims:
        slot = tier._blocks[entry]
        free.add(slot.offset, align(slot.length))
    if free.longest >= need:
        return True
    checkpoint = len(plan.victims)
    allowed = [part] + [p for p in tier._partitions.values() if p is not part and plan.overage(p) > 0]
    budget = 4 * need  # bytes this cheap search may evict beyond the share's victims
    # Every allowed tenant's unretained blocks before any retained one (tiers/retention.py).
    orders = [(p, order_of) for order_of in _RETAINED_LAST for p in allowed]
    for p, order_of in orders:
        order = order_of(p.policy)
        while budget > 0 and (entry := plan.next_victim(p, order)) is not None:  # type: ignore[arg-type]
            slot = tier._blocks[entry]
            budget -= plan.take(p, entry)
            start, end = free.add(slot.offset, align(slot.length))
            if end - start >= need:
                # Only the victims inside the run it freed stay (the byte cap, next, takes what it needs).
                _undo(plan, checkpoint, keep=lambda e, lo=start, hi=end: lo <= tier._blocks[e].offset < hi)
                return True
    if len(tier._blocks) > WINDOW_SCAN_MAX_BLOCKS:
        # Too many blocks to scan under the lock: go on in LRU order, as long as it takes (each
        # step O(1)); the plan still evicts nothing unless it ends in a run that fits.
        for p, order_of in orders:
            order = order_of(p.policy)
            while (entry := plan.next_victim(p, order)) is not None:  # type: ignore[arg-type]
                slot = tier._blocks[entry]
                plan.take(p, entry)
                start, end = free.add(slot.offset, align(slot.length))
                if end - start >= need:
                    _undo(plan, checkpoint, keep=lambda e, lo=start, hi=end: lo <= tier._blocks[e].offset < hi)
                    return True
        _undo(plan, checkpoint, keep=lambda e: False)
        return False
    _undo(plan, checkpoint, keep=lambda e: False)  # not enough nearby
    window = _cheapest_window(plan, part, need)
    if window is None:
        return False
    for entry in window:
        plan.take(tier._partition(entry[0]), entry)
    return True


def _undo(plan: _Plan, checkpoint: int, keep: Callable[[EntryKey], bool]) -> None:
    """Takes the victims chosen after `checkpoint` out of the plan, but those `keep` names."""
    later = plan.victims[checkpoint:]
    del plan.victims[checkpoint:]
    for entry in later:
        if keep(entry):
            plan.victims.append(entry)
        else:
            plan.chosen.discard(entry)
            plan.freed[id(plan.tier._partition(entry[0]))] -= plan.cost(entry)


class _Runs:
    """Free runs of the arena as a plan would leave them: (offset, length) pieces merged as added."""

    def __init__(self, extents: list[tuple[int, int]]) -> None:
        self._by_start: dict[int, int] = {}
        self._by_end: dict[int, int] = {}
        self.longest = 0
        for offset, length in extents:
            self.add(offset, length)

    def add(self, offset: int, length: int) -> tuple[int, int]:
        """Adds a piece; returns the run it is now part of, as (start, end)."""
        end = offset + length
        before = self._by_end.pop(offset, None)  # a run ending where this one starts
        if before is not None:
            del self._by_start[before]
            offset = before
        after = self._by_start.pop(end, None)  # a run starting where this one ends
        if after is not None:
            del self._by_end[after]
            end = after
        self._by_start[offset] = end
        self._by_end[end] = offset
        self.longest = max(self.longest, end - offset)
        return offset, end


def _cheapest_window(plan: _Plan, part: _Partition, need: int) -> list[EntryKey] | None:
    """The evictable entries of the cheapest run that spans `need` bytes ([] when the plan's victims
    and the free extents already leave one), or None when no run does."""
    tier = plan.tier
    # (offset, size, bytes to evict, entry): free extents and the victims so far cost nothing; a
    # retained block costs the whole capacity more, so a window takes one only where none spares it.
    runs: list[list] = [[o, n, 0, None] for o, n in tier._extents.extents()]  # lists: no tuple free-list
    retained = tier._retention
    allowed = {id(part)} | {id(p) for p in tier._partitions.values() if plan.overage(p) > 0}
    barrier = -1
    for entry, slot in tier._blocks.items():
        size = align(slot.length)
        if entry in plan.chosen:
            runs.append([slot.offset, size, 0, None])
        elif plan.evictable(entry) and id(tier._partition(entry[0])) in allowed:
            runs.append([slot.offset, size, size + (tier._capacity if entry in retained else 0), entry])
        else:
            runs.append([slot.offset, size, barrier, None])
    runs.sort(key=lambda r: r[0])
    best: tuple[int, int, int] | None = None  # (evict bytes, first, last)
    first = 0
    evict = 0
    for last, (offset, size, cost, _) in enumerate(runs):  # two pointers over the runs by offset
        contiguous = last > first and runs[last - 1][0] + runs[last - 1][1] == offset
        if cost == barrier or (last > first and not contiguous):
            first, evict = last + (cost == barrier), 0
            if cost == barrier:
                continue
        evict += cost
        span = offset + size - runs[first][0]
        # Shrink from the left while the run still spans the block.
        while first < last and span - runs[first][1] >= need:
            span -= runs[first][1]
            evict -= runs[first][2]
            first += 1
        if span >= need and (best is None or evict < best[0]):
            best = (evict, first, last)
            if evict == 0:
                break
    if best is None:
        return None
    _, lo, hi = best
    return [r[3] for r in runs[lo : hi + 1] if r[3] is not None]
