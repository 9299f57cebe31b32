"""Gets that do not promote read large disk blocks into reused buffers (kvcache_server/tiers/reuse.py):
a buffer is refilled only once nothing references it, so no view a caller holds ever changes, the
pool stays under its byte cap, and a read lands in memory already faulted in.

Real tiers on real files; the stack's no-promotion path (promote=False) on top of them.
"""

from __future__ import annotations

import asyncio
import os
import random
import resource
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvcache_client import KVCacheClient
from kvcache_server.stack import LowerTierPolicy, TierStack, WriteMode
from kvcache_server.tiers.disk import DiskTier
from kvcache_server.tiers.reuse import ReusePool
from tests.conftest import ServerThread, keyed

pytestmark = pytest.mark.timeout(120)

NS = "reuse"
MiB = 1 << 20
SIZE = MiB - 4096  # a block of at least the pool's 256 KiB (header included by keyed)


def tier(directory: Path, *, read_buffers: int = 8 * MiB) -> DiskTier:
    return DiskTier(
        str(directory),
        capacity_bytes=64 * MiB,
        region_bytes=16 * MiB,
        io_threads=2,
        write_threads=1,
        read_buffers_bytes=read_buffers,
    )


def stored(disk: DiskTier, n: int) -> list[tuple[bytes, bytes]]:
    items = [keyed(os.urandom(SIZE)) for _ in range(n)]
    assert all(asyncio.run(disk.put_many(NS, items)))
    return items


def test_a_held_view_never_changes_while_other_reads_refill_the_pool(tmp_path: Path) -> None:
    disk = tier(tmp_path, read_buffers=4 * MiB)
    try:
        items = stored(disk, 12)
        first = asyncio.run(disk.get_many(NS, [items[0][0]]))[0]
        assert isinstance(first, memoryview) and first.readonly
        keep_slice = first[1000:5000]  # a slice alone keeps the buffer too
        keep_array = np.frombuffer(first, dtype=np.uint8)[-4096:]
        del first
        for _ in range(5):  # every other block, many times: the pool refills what is free
            for key, block in items[1:]:
                got = asyncio.run(disk.get_many(NS, [key]))[0]
                assert got is not None and bytes(got) == block
                del got
        assert bytes(keep_slice) == items[0][1][1000:5000]
        assert keep_array.tobytes() == items[0][1][-4096:]
        pool = disk._buffers
        assert pool.nbytes <= pool.cap_bytes
        # the buffer held by the slices, and the others refilled: all 56 reads pooled. (A reader
        # thread may drop its last reference to a result just after the caller saw it: then one
        # more buffer grows instead of a refill, never a refill of a buffer in use.)
        assert pool.grown + pool.reused == 56 and pool.grown <= 4
        del keep_slice, keep_array
        got = asyncio.run(disk.get_many(NS, [items[0][0]]))[0]
        assert got is not None and bytes(got) == items[0][1]
        assert pool.grown + pool.reused == 57 and pool.grown <= 4
    finally:
        asyncio.run(disk.close())


def test_views_held_past_the_cap_get_fresh_memory_and_every_byte_is_right(tmp_path: Path) -> None:
    disk = tier(tmp_path, read_buffers=3 * MiB)
    try:
        items = stored(disk, 8)
        held = asyncio.run(disk.get_many(NS, [k for k, _ in items]))  # all 8 held at once
        assert [bytes(b) for b in held if b is not None] == [b for _, b in items]
        pool = disk._buffers
        assert pool.grown == 3 and pool.nbytes == 3 * len(items[0][1])  # the cap: 3 buffers, the 5 others fresh bytes
        assert sum(isinstance(b, memoryview) for b in held) == 3
        again = asyncio.run(disk.get_many(NS, [k for k, _ in items]))  # nothing free: all fresh
        assert [bytes(b) for b in again if b is not None] == [b for _, b in items]
        assert pool.reused == 0 and pool.nbytes == 3 * len(items[0][1])
        assert [bytes(b) for b in held if b is not None] == [b for _, b in items]
    finally:
        asyncio.run(disk.close())


def test_a_pool_of_other_lengths_gives_way_to_a_new_length_within_its_cap() -> None:
    pool = ReusePool(3 * MiB)
    a, b = pool.take(MiB), pool.take(MiB)
    assert a is not None and b is not None
    del a  # free; b still held
    c = pool.take(2 * MiB)  # 3 MiB would be over the cap: the free 1 MiB buffer is dropped, not b
    assert c is not None and len(c) == 2 * MiB
    assert pool.nbytes == 3 * MiB
    assert pool.take(2 * MiB) is None  # c is held and b is held: nothing fits, fresh memory
    assert pool.take(100 << 10) is None  # below min_bytes: never pooled
    del b, c


def test_reads_into_the_pool_do_not_fault_in_fresh_pages(tmp_path: Path) -> None:
    """The reason for the pool: a read into a new bytes faulted in ~220 pages per MiB here."""
    disk = tier(tmp_path, read_buffers=80 * MiB)
    try:
        items = stored(disk, 32)  # 32 MiB a get, as a window of a long prompt's blocks
        keys = [k for k, _ in items]
        asyncio.run(disk.get_many(NS, keys))  # the pool grows (and the file is in the page cache)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(20):
            got = asyncio.run(disk.get_many(NS, keys))
            assert all(g == b for g, (_, b) in zip(got, items, strict=True))  # compared in place, no copy
            del got
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        read_mib = 20 * 32 * SIZE / MiB
        assert faults / read_mib < 32, f"{faults} minor faults for {read_mib:.0f} MiB read"
        pool = disk._buffers
        assert pool.grown + pool.reused + pool.fresh == 21 * 32 and pool.grown <= 80 and pool.fresh == 0
    finally:
        asyncio.run(disk.close())


def test_a_get_that_does_not_promote_serves_pooled_blocks_exactly(tmp_path: Path) -> None:
    async def go() -> None:
        disk = tier(tmp_path)
        stack = TierStack(4 * MiB, [(disk, LowerTierPolicy(write_mode=WriteMode.BEHIND))], prefault=False)
        await stack.start()
        try:
            items = [keyed(os.urandom(SIZE)) for _ in range(6)]
            assert all(await disk.put_many(NS, items))
            keys = [k for k, _ in items]
            for _ in range(3):
                found = await stack.get(NS, keys, promote=False)
                assert [bytes(f.data) for f in found if f is not None] == [b for _, b in items]
                stack.release(found)
                del found
            assert disk._buffers.grown + disk._buffers.reused == 18 and disk._buffers.grown <= 8
            assert (await stack.get(NS, keys[:1]))[0] is not None  # promotes: now in RAM
        finally:
            await stack.close()

    asyncio.run(go())


def test_a_pool_made_under_a_trace_function_stays_off_and_never_refills_a_held_buffer() -> None:
    """A tracer that reads frame locals (debuggers, some profilers) adds a reference while the pool
    measures what "free" reads as: a pool that trusted that count would refill a buffer one view holds."""
    import sys

    def tracer(frame, event, arg):  # type: ignore[no-untyped-def]
        frame.f_locals  # noqa: B018 - what such tracers do
        return tracer

    sys.settrace(tracer)
    try:
        pool = ReusePool(4 * MiB)
    finally:
        sys.settrace(None)
    assert pool.cap_bytes == 0
    assert pool.take(MiB) is None  # off: every read takes fresh memory
    normal = ReusePool(4 * MiB)
    a = normal.take(MiB)
    assert a is not None
    view = memoryview(a).toreadonly()
    del a
    b = normal.take(MiB)
    assert b is not None and b is not view.obj  # the held one is never handed out again
    del view, b


@pytest.mark.timeout(180)
def test_concurrent_gets_of_a_server_that_does_not_promote_serve_every_byte_exactly(
    tmp_path: Path, make_server: Callable[..., ServerThread]
) -> None:
    """Four clients (two over the bulk port, two over pure gRPC) get overlapping sets of disk-held
    blocks at once, many times, from a server whose disk hits are not promoted: the pool's buffers are
    refilled under replies still being sent to the others, and every block must come back exact."""
    server = make_server(
        ram={"capacity_bytes": 4 * MiB},
        disk={
            "enabled": True,
            "dir": str(tmp_path),
            "capacity_bytes": 64 * MiB,
            "region_bytes": 16 * MiB,
            "write_mode": "through",
            "promote": False,
            "read_buffers_bytes": 12 * MiB,
        },
        shm={"enabled": False},
    )
    items = [keyed(os.urandom(SIZE)) for _ in range(24)]
    with KVCacheClient(server.target, shm=False) as writer:
        assert writer.put_many(NS, items).stored == len(items)
    disk = server.stack._lower[0].tier
    assert isinstance(disk, DiskTier)
    wrong: list[str] = []

    def reader(seed: int, bulk: bool) -> None:
        try:
            read(seed, bulk)
        except BaseException as exc:  # a thread's failure fails the test
            wrong.append(repr(exc))

    def read(seed: int, bulk: bool) -> None:
        rng = random.Random(seed)
        with KVCacheClient(server.target, shm=False, bulk=bulk, timeout_s=60) as client:
            for _ in range(15):
                picked = rng.sample(items, 8)
                got = client.get_many(NS, [k for k, _ in picked])
                for (key, block), block_got in zip(picked, got, strict=True):
                    if block_got is None or bytes(block_got) != block:
                        wrong.append(f"{key.hex()}: {'miss' if block_got is None else 'other bytes'}")
            if client.corrupt_blocks:
                wrong.append(f"{client.corrupt_blocks} blocks failed their checksum")

    threads = [threading.Thread(target=reader, args=(seed, seed % 2 == 0)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    assert not any(t.is_alive() for t in threads)
    assert wrong == []
    assert disk._buffers.reused > 0  # the pool was refilled while the others' replies were in flight
    assert disk._buffers.nbytes <= 12 * MiB
