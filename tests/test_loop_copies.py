"""Issue #22, invariant 8: nothing on the event loop copies block bytes by the block.

A commit, an eviction's copy for demotion and a write-behind copy of a block run in worker threads:
on the event loop a 32 x 2 MiB in-place commit into a full RAM tier held it for 177 ms (median),
and 1-key Lookups behind it waited (bench/bench_lookup_inplace.py has the latencies; this test
checks the structure, not a time).

How it is seen: tracemalloc records the stack that allocated every object, so each block copy that
reaches a lower tier's write-behind queue (an evicted block's demotion copy, a put's copy for the
lower tier) tells which thread made it: the server's event loop (asyncio frames) or a worker
thread (concurrent.futures frames). The server runs in this process (tests/conftest.py's
ServerThread), with a real Redis below it in write-behind mode.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
import tracemalloc
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcache_client import KVCacheClient, KVCacheError
from kvcache_server.arena import Extents, Region, align
from kvcache_server.tiers.ram import RamTier
from kvcache_server.write_queue import PendingWrite, WriteQueue
from tests.backends import RedisProcess, wait_for
from tests.conftest import ServerThread, raw_block

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
NS = "ns"
BLOCK = MiB - 4096  # with its header, one block takes just under 1 MiB of the arena
RAM = 16 * MiB  # 16 such blocks fit (entry overhead included), with 57 KiB to spare


def made_by(obj: object) -> str:
    """Which thread allocated `obj`: "loop" (the server's event loop), "thread" (a worker) or "unknown"."""
    tb = tracemalloc.get_object_traceback(obj)
    if tb is None:
        return "unknown"
    files = [frame.filename.replace(os.sep, "/") for frame in tb]
    if any(f.endswith("concurrent/futures/thread.py") for f in files):
        return "thread"
    if any("/asyncio/" in f for f in files):
        return "loop"
    return "unknown"


@pytest.fixture
def queued(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[tuple[str, str]]]:
    """Counts each write offered to a write-behind queue as (kind, thread that copied its block);
    the test starts tracing (trace())."""
    seen: Counter[tuple[str, str]] = Counter()
    offer = WriteQueue.offer

    def counted(self: WriteQueue, write: PendingWrite) -> bool:
        if len(write.block) >= BLOCK:
            seen[(write.kind.name, made_by(write.block))] += 1
        return offer(self, write)

    monkeypatch.setattr(WriteQueue, "offer", counted)
    try:
        yield seen
    finally:
        tracemalloc.stop()


def trace() -> None:
    """Starts recording allocations (after the server has started: tracing slows everything down)."""
    tracemalloc.start(128)  # deep enough to reach the bottom of a gRPC handler's stack


def server_over_redis(make_server, redis: RedisProcess, tmp_path: Path) -> ServerThread:
    return make_server(
        ram={"capacity_bytes": RAM},
        shm={"dir": str(tmp_path / "shm")},
        redis={"enabled": True, "url": redis.url, "write_mode": "behind", "timeout_s": 10.0},
    )


def blocks(n: int, size: int) -> list[tuple[bytes, bytes]]:
    payload = os.urandom(size)
    out = []
    for _ in range(n):
        key = os.urandom(16)
        out.append((key, raw_block(key, payload)))
    return out


def test_in_place_commits_into_a_full_ram_copy_nothing_on_the_event_loop(
    make_server, redis_server: RedisProcess, tmp_path: Path, queued: Counter[tuple[str, str]]
) -> None:
    """Same-host puts (the client's segment read into arena slots the server reserves) into a full
    RAM tier: every reservation evicts, every victim is copied out for demotion to Redis, and every
    committed block is copied for Redis's write-behind queue. None of those copies is made on the
    event loop. Old code: each reservation copied its victims on the loop (8 of 8 demotions)."""
    server = server_over_redis(make_server, redis_server, tmp_path)
    trace()
    first, second = blocks(16, BLOCK), blocks(8, BLOCK)
    with KVCacheClient(server.target) as client:
        for data in (first, second):  # in messages of 4 blocks (one reservation batch each)
            for i in range(0, len(data), 4):
                assert client.put_many(NS, data[i : i + 4]).stored == len(data[i : i + 4])
        stats = client.stats()
        assert stats.inplace_bytes_received == sum(len(b) for _, b in first + second)  # all in place
        evicted = stats.tier("ram").evictions
        assert evicted == 8  # each block of the second round evicted one of the first
        server.call(server.stack.wait_idle())
        assert dict(queued) == {("PUT", "thread"): 24, ("DEMOTION", "thread"): 8}
        assert client.get_many(NS, [k for k, _ in first[:8]]) == [b for _, b in first[:8]]  # demoted, served
    assert server.stack.ram.arena_stats()["reservations"] == 0


def test_write_behind_blocks_are_freed_off_the_event_loop(
    make_server, redis_server: RedisProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A written-behind batch holds the last references to its blocks' copies; freeing a MiB-sized
    block hands its memory back to the kernel (madvise, munmap), which on the event loop took about 4%
    of its time under same-host puts (bench/bench_lookup_inplace.py). Every block offered to the queue
    is freed, and none on the loop. Old code: 28 of 32 freed on the loop, the last batch not until
    another one came."""
    freed: Counter[str] = Counter()

    class Tracked(bytes):
        def __del__(self) -> None:
            freed[threading.current_thread().name] += 1

    offer = WriteQueue.offer
    monkeypatch.setattr(WriteQueue, "offer", lambda q, w: offer(q, dataclasses.replace(w, block=Tracked(w.block))))
    server = server_over_redis(make_server, redis_server, tmp_path)
    with KVCacheClient(server.target) as client:
        for data in (blocks(16, BLOCK), blocks(8, BLOCK)):
            for i in range(0, len(data), 4):
                assert client.put_many(NS, data[i : i + 4]).stored == 4
        server.call(server.stack.wait_idle())
    deadline = time.monotonic() + 10
    while sum(freed.values()) < 32 and time.monotonic() < deadline:  # 24 puts' copies and 8 demotions
        time.sleep(0.01)
    assert sum(freed.values()) == 32, dict(freed)
    assert freed["kvcache-server"] == 0, dict(freed)


def test_a_small_put_that_evicts_a_large_block_copies_it_off_the_loop(
    make_server, redis_server: RedisProcess, tmp_path: Path, queued: Counter[tuple[str, str]]
) -> None:
    """A put of 60 KiB (copied into its slot on the loop: cheaper than a thread hop) that evicts a
    1 MiB block: the victim's copy for demotion is made in a worker thread all the same.
    Old code: a put below 256 KiB ran wholly on the loop, its victim's copy too."""
    server = server_over_redis(make_server, redis_server, tmp_path)
    trace()
    with KVCacheClient(server.target, shm=False) as client:
        assert client.put_many(NS, blocks(16, BLOCK)).stored == 16
        assert client.stats().tier("ram").evictions == 0
        assert client.put_many(NS, blocks(1, 60 << 10)).stored == 1
        assert client.stats().tier("ram").evictions == 1
        server.call(server.stack.wait_idle())
    assert queued[("DEMOTION", "loop")] == 0
    assert queued[("DEMOTION", "thread")] == 1


def test_a_cancelled_in_place_put_frees_its_slots_only_after_its_copies_end(
    make_server, redis_server: RedisProcess, tmp_path: Path
) -> None:
    """A put cancelled while its reservation's victims are being copied out (the client's deadline)
    leaves no reservation and no held extent behind: every arena byte is free or in a block."""
    server = server_over_redis(make_server, redis_server, tmp_path)
    with KVCacheClient(server.target) as client:
        client.put_many(NS, blocks(16, BLOCK))
        for _ in range(5):
            # Cut off at any point by its deadline: what it left behind is what is checked.
            with KVCacheClient(server.target, timeout_s=0.005) as hasty, contextlib.suppress(KVCacheError):
                hasty.put_many(NS, blocks(4, BLOCK))
        server.call(server.stack.wait_idle())
        ram = server.stack.ram
        # A call its client gave up on still ends on the server: its handler waits for its read threads,
        # then frees its slots (a check right after the client's error raced it: 4 open, 10 ms later 0).
        wait_for(lambda: ram.arena_stats()["reservations"] == 0, timeout_s=10, what="the cut-off puts' slots freed")
        arena = ram.arena_stats()
        slots = sum((s.length + 63) // 64 * 64 for s in ram._blocks.values())
        assert arena["free_bytes"] + slots == arena["arena_bytes"] // 64 * 64


# -- the two phases of making room, on the RAM tier itself -----------------------------------------


def test_extents_take_allocates_only_the_free_parts_of_a_range() -> None:
    ext = Extents(64 * 10)
    a, b = ext.alloc(64 * 2), ext.alloc(64 * 3)  # [0, 128) and [128, 320) allocated
    assert (a, b) == (0, 128)
    assert ext.take(64, 64 * 6) == [(320, 64 * 2)]  # [64, 448): only [320, 448) was free
    assert ext.extents() == [(448, 64 * 3)]
    assert ext.free_bytes == 64 * 3
    ext.free(0, 64 * 2)
    assert ext.take(0, 64 * 10) == [(0, 128), (448, 192)]
    assert (ext.extents(), ext.free_bytes) == ([], 0)


def test_a_victims_bytes_stay_unchanged_until_settled_and_its_extent_goes_to_nobody_else() -> None:
    """Phase one evicts a 1 MiB block for a 512 KiB slot; until settle() the rest of the victim's
    extent is held: a reservation that would fit there is refused (the other block is leased), and
    copy() reads the victim's bytes as they were. Then on_evict gets that copy and the extent is free."""
    demoted: list[tuple[bytes, bytes]] = []
    cost = RamTier.entry_cost_of(MiB)
    tier = RamTier(2 * cost, on_evict=lambda ns, k, b, _until: demoted.append((k, b)), prefault=False)
    old = [(bytes([i]) * 16, os.urandom(MiB)) for i in range(2)]
    assert tier.put_many_sync(NS, old) == [True, True]
    (lease,) = tier.lease_many(NS, [old[1][0]])
    assert lease is not None
    made, evicted = tier.reserve_many(NS, [MiB // 2])
    assert made[0] is not None and [v[1] for v in evicted.victims] == [old[0][0]]  # the least recent
    assert evicted.copy_bytes == MiB and evicted.held == [(made[0].offset + MiB // 2, MiB // 2)]
    refused, nothing = tier.reserve_many(NS, [MiB // 4])
    assert (refused, nothing.victims) == ([None], [])  # no free extent: the held half is nobody's
    assert demoted == []  # on_evict comes with settle()
    evicted.copy()
    tier.settle(evicted)
    assert demoted == [old[0]]
    made[0].buffer[:] = bytes(MiB // 2)
    assert tier.adopt_many(NS, [(b"n" * 16, made[0])]) == [True]
    assert tier.arena_stats()["free_bytes"] == tier._extents.size - align(MiB) - align(MiB // 2)
    assert tier.release([lease.id]) == 1


def test_without_demotion_nothing_is_held_nor_copied() -> None:
    cost = RamTier.entry_cost_of(MiB)
    tier = RamTier(2 * cost, on_evict=lambda ns, k, b, _until: None, copy_evicted=False, prefault=False)
    assert tier.put_many_sync(NS, [(bytes([i]) * 16, os.urandom(MiB)) for i in range(2)]) == [True, True]
    made, evicted = tier.reserve_many(NS, [MiB // 2])
    assert made[0] is not None
    assert (evicted.copy_bytes, evicted.held, len(evicted.victims)) == (0, [], 1)
    tier.settle(evicted)
    tier.abandon([made[0].id])


@pytest.mark.parametrize("shared", [False, True])
def test_region_reads_copy_through_the_kernel(tmp_path: Path, shared: bool) -> None:
    """Region.read copies with pread (of the arena file, or of the memfd an unshared arena lives
    in), so a thread copying blocks out does not hold the GIL meanwhile."""
    region = Region(4 * MiB, str(tmp_path) if shared else None, prefault=False)
    try:
        data = os.urandom(MiB)
        region.view[MiB : 2 * MiB] = data
        assert region._fd >= 0  # there is a descriptor to pread from
        assert region.read(MiB, MiB) == data
        assert region.read(MiB + 7, 100) == data[7:107]
    finally:
        region.close()


def test_bulk_puts_into_a_full_ram_copy_their_victims_off_the_loop(
    make_server, redis_server: RedisProcess, tmp_path: Path, queued: Counter[tuple[str, str]]
) -> None:
    """Remote puts over the bulk port, received straight into arena slots it reserves (ArenaSink):
    making room evicts, and each victim's copy for demotion is made in a worker thread.
    Old code: the sink reserved with RamTier.reserve on the loop, which copied its victims there."""
    server = server_over_redis(make_server, redis_server, tmp_path)
    trace()
    first, second = blocks(16, BLOCK), blocks(8, BLOCK)
    with KVCacheClient(server.target, shm=False) as client:
        for data in (first, second):
            assert client.put_many(NS, data).stored == len(data)
        stats = client.stats()
        assert stats.bulk_bytes_received >= sum(len(b) for _, b in first + second)  # all over the bulk port
        assert stats.tier("ram").evictions == 8
        server.call(server.stack.wait_idle())
    assert queued[("DEMOTION", "loop")] == 0
    assert queued[("DEMOTION", "thread")] == 8
