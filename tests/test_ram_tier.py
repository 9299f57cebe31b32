"""The RAM tier on its own: the byte cap, LRU order, accounting against real memory, threads."""

from __future__ import annotations

import asyncio
import os
import random
import threading
import tracemalloc

import pytest

from kvcache_server.tiers.ram import ENTRY_OVERHEAD_BYTES, RamTier

pytestmark = pytest.mark.timeout(120)

NS = "ns"


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def test_lru_eviction_order_and_cap() -> None:
    block = bytes(1000)
    cost = RamTier.entry_cost(block)
    evicted: list[bytes] = []
    tier = RamTier(capacity_bytes=3 * cost, on_evict=lambda ns, k, b, _until: evicted.append(k))
    assert tier.put_many_sync(NS, [(key(i), block) for i in range(3)]) == [True] * 3
    assert tier.get_many_sync(NS, [key(0)]) == [block]  # 0 is now most recent
    tier.put_many_sync(NS, [(key(3), block)])
    assert evicted == [key(1)]
    assert tier.contains_many_sync(NS, [key(i) for i in range(4)]) == [True, False, True, True]
    assert tier.used_bytes == 3 * cost
    stats = tier.stats()
    assert (stats.blocks, stats.evictions, stats.hits, stats.puts) == (3, 1, 1, 4)


def test_replacing_a_key_does_not_double_count() -> None:
    tier = RamTier(capacity_bytes=1 << 20)
    tier.put_many_sync(NS, [(key(1), bytes(100))])
    tier.put_many_sync(NS, [(key(1), bytes(300))])
    assert tier.used_bytes == RamTier.entry_cost(bytes(300))
    assert tier.delete_many_sync(NS, [key(1), key(2)]) == 1
    assert tier.used_bytes == 0


def test_block_larger_than_capacity_is_refused_without_evicting() -> None:
    tier = RamTier(capacity_bytes=10_000)
    tier.put_many_sync(NS, [(key(1), bytes(100))])
    assert tier.put_many_sync(NS, [(key(2), bytes(10_000))]) == [False]
    assert tier.contains_many_sync(NS, [key(1), key(2)]) == [True, False]
    assert tier.stats().rejected == 1


def test_blocks_live_in_the_arena_and_reads_copy_them_out_once() -> None:
    """The arena holds the block (the caller's object is not kept); a read owns its copy, a lease views the slot."""
    tier = RamTier(capacity_bytes=1 << 20)
    block = bytearray(os.urandom(1000))
    tier.put_many_sync(NS, [(key(1), block)])
    block[:] = bytes(1000)  # the caller reuses its buffer: the stored block does not change
    (got,) = asyncio.run(tier.get_many(NS, [key(1)]))
    assert type(got) is bytes and got != bytes(block)
    (lease,) = tier.lease_many(NS, [key(1)])
    assert lease is not None and lease.view.readonly and bytes(lease.view) == got
    assert bytes(tier.region.view[lease.offset : lease.offset + lease.length]) == got
    assert tier.release([lease.id]) == 1


def test_namespaces_do_not_share_keys() -> None:
    tier = RamTier(capacity_bytes=1 << 20)
    tier.put_many_sync("a", [(key(1), b"x")])
    assert tier.contains_many_sync("b", [key(1)]) == [False]


def test_accounting_covers_real_memory() -> None:
    """tracemalloc: what the tier really holds stays within what it charges against the cap."""
    capacity = 8 << 20
    blocks = [os.urandom(random.Random(i).randint(16, 4096)) for i in range(200)]
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tier = RamTier(capacity_bytes=capacity)
        for round_ in range(20):  # 20 passes over fresh copies: far more than the cap, many evictions
            items = [(os.urandom(16), bytes(b)) for b in blocks]
            tier.put_many_sync(f"ns-{round_ % 3}", items)
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert tier.stats().evictions > 0
    assert tier.used_bytes <= capacity
    # The blocks are in the arena (mapped before tracing began); what the index holds on the heap
    # (keys, slots, policy) stays within the overhead charged per entry.
    assert held <= len(tier._blocks) * ENTRY_OVERHEAD_BYTES, (held, len(tier._blocks), ENTRY_OVERHEAD_BYTES)


def test_threads_hammering_keep_the_cap_and_the_bytes() -> None:
    capacity = 2 << 20
    tier = RamTier(capacity_bytes=capacity)
    errors: list[str] = []
    max_used = 0

    def worker(seed: int) -> None:
        nonlocal max_used
        rng = random.Random(seed)
        for _ in range(400):
            k = key(rng.randrange(2000))
            # Content addressing: a key's bytes are a function of the key.
            block = k * rng.choice([1, 64, 512])
            op = rng.random()
            if op < 0.5:
                tier.put_many_sync(NS, [(k, block)])
            elif op < 0.9:
                (got,) = tier.get_many_sync(NS, [k])
                if got is not None and got != k * (len(got) // 16):
                    errors.append("wrong bytes")
            else:
                tier.delete_many_sync(NS, [k])
            max_used = max(max_used, tier.used_bytes)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert max_used <= capacity
    stats = tier.stats()
    assert stats.used_bytes == sum(RamTier.entry_cost_of(s.length) for s in tier._blocks.values())
    assert stats.blocks == len(tier._blocks)
