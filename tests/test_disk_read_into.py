"""The disk tier's read into place: a disk hit read straight into its RAM arena slot (promotion), and
DiskTier.read_into_many, which it is built on (docs/tiers.md, "Disk tier", "Reads into place").

Real tiers on real files; the races are made deterministic by holding a reader thread inside its
preadv (a wrapper around os.preadv that waits for the test, then does the real read).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcache_server.arena import align
from kvcache_server.stack import LowerTierPolicy, TierStack, WriteMode
from kvcache_server.tiers import disk as disk_module
from kvcache_server.tiers.base import TierKind
from kvcache_server.tiers.disk import DiskTier
from tests.conftest import keyed

pytestmark = pytest.mark.timeout(120)

NS = "read-into"
MiB = 1 << 20


def blocks(n: int, size: int = 60_000) -> list[tuple[bytes, bytes]]:
    return [keyed(os.urandom(size)) for _ in range(n)]


def tier(directory: Path, capacity: int = 8 * MiB) -> DiskTier:
    return DiskTier(str(directory), capacity_bytes=capacity, region_bytes=MiB, io_threads=2, write_threads=1)


def stack_over(disk: DiskTier, ram: int = 4 * MiB) -> TierStack:
    return TierStack(ram, [(disk, LowerTierPolicy(write_mode=WriteMode.BEHIND))], prefault=False)


def region_of(disk: DiskTier, key: bytes) -> tuple[str, int, int]:
    """(file, offset of the block, length) of a key's record, from the tier's index."""
    where = disk._index[disk._entry(NS, key)]
    region = disk._regions[where >> 64]
    offset = (where >> 32) & 0xFFFFFFFF
    return region.path, offset + disk_module.layout.header_len(len(NS)), where & 0xFFFFFFFF


class HeldPreadv:
    """os.preadv in the disk tier, held at its first call until release(); `then` runs there first."""

    def __init__(self, then=None) -> None:
        self.entered = threading.Event()
        self.go = threading.Event()
        self.then = then
        self.calls = 0
        self._real = os.preadv

    def __call__(self, fd: int, buffers, offset: int) -> int:
        self.calls += 1
        if self.calls == 1:
            self.entered.set()
            assert self.go.wait(30)
            if self.then is not None:
                self.then()
        return self._real(fd, buffers, offset)


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Iterator[HeldPreadv]:
    hold = HeldPreadv()
    monkeypatch.setattr(disk_module.os, "preadv", hold)
    yield hold
    hold.go.set()


def test_a_disk_hit_is_read_into_its_ram_slot_verified_and_byte_identical(tmp_path: Path) -> None:
    async def go() -> None:
        disk = tier(tmp_path)
        stack = stack_over(disk)
        await stack.start()
        batch = blocks(20)
        assert all(await disk.put_many(NS, batch))  # on disk only
        found = await stack.get(NS, [k for k, _ in batch])
        assert [bytes(f.data) for f in found if f is not None] == [b for _, b in batch]
        assert all(f is not None and f.tier is TierKind.DISK for f in found)
        # Served from the arena slot it was read into (a lease on it), not from a copy of its own.
        assert all(f is not None and f.lease is not None and isinstance(f.data, memoryview) for f in found)
        stack.release(found)
        assert stack.ram.contains_many_sync(NS, [k for k, _ in batch]) == [True] * 20
        ram, d = stack.stats()
        assert ram.promotions == 20 and d.hits == 20 and d.misses == 0 and d.checksum_failures == 0
        assert d.bytes_read == sum(len(b) for _, b in batch)
        arena = stack.ram.arena_stats()
        assert arena["reservations"] == 0 and arena["leases"] == 0
        again = await stack.get(NS, [k for k, _ in batch])  # now RAM hits
        assert {f.tier for f in again if f is not None} == {TierKind.RAM}
        stack.release(again)
        await stack.close()

    asyncio.run(go())


def test_read_into_many_fills_the_given_buffers_and_refuses_a_wrong_size(tmp_path: Path) -> None:
    async def go() -> None:
        disk = tier(tmp_path)
        batch = blocks(5)
        await disk.put_many(NS, batch)
        assert disk.lengths(NS, [k for k, _ in batch] + [os.urandom(16)]) == [len(b) for _, b in batch] + [None]
        dests = [bytearray(len(b)) for _, b in batch]
        dests[4] = bytearray(len(batch[4][1]) - 1)  # sized for another block: refused, not overrun
        got = await disk.read_into_many(NS, [(k, memoryview(d)) for (k, _), d in zip(batch, dests, strict=True)])
        assert got == [True, True, True, True, False]
        assert [bytes(d) for d in dests[:4]] == [b for _, b in batch[:4]]
        assert disk.stats().hits == 4 and disk.stats().misses == 1
        await disk.close()

    asyncio.run(go())


def test_a_block_corrupted_on_disk_after_it_was_written_is_a_miss_not_served_nor_promoted(tmp_path: Path) -> None:
    async def go() -> None:
        disk = tier(tmp_path)
        stack = stack_over(disk)
        await stack.start()
        (k_payload, _), (k_header, _), (k_good, b_good) = batch = blocks(3)
        assert all(await disk.put_many(NS, batch))
        path, at, length = region_of(disk, k_payload)
        fd = os.open(path, os.O_RDWR)  # the tier's file, while it runs: the page cache it reads
        try:
            byte = os.pread(fd, 1, at + length - 100)
            os.pwrite(fd, bytes([byte[0] ^ 0x01]), at + length - 100)  # one payload bit: the record header holds
            path, at, _ = region_of(disk, k_header)
            os.pwrite(fd, b"\xff", at - 20)  # a byte of the record header's key: its crc fails
        finally:
            os.close(fd)
        found = await stack.get(NS, [k_payload, k_header, k_good])
        assert found[0] is None and found[1] is None
        assert found[2] is not None and bytes(found[2].data) == b_good and found[2].lease is not None
        stack.release(found)
        assert stack.ram.contains_many_sync(NS, [k_payload, k_header, k_good]) == [False, False, True]
        ram, d = stack.stats()
        assert d.checksum_failures == 1  # the payload: verified in its slot, then deleted from the disk
        assert d.errors >= 1  # the torn header: a miss the tier counts, and drops from its index
        assert disk.known(NS, [k_payload, k_header, k_good]) == [False, False, True]
        assert ram.promotions == 1
        arena = stack.ram.arena_stats()
        assert arena["reservations"] == 0 and arena["arena_bytes"] - arena["free_bytes"] == align(
            len(b_good)
        )  # one slot held
        await stack.close()

    asyncio.run(go())


def test_a_region_evicted_while_it_is_read_into_a_slot_never_yields_its_new_bytes(
    tmp_path: Path, held: HeldPreadv
) -> None:
    async def go() -> None:
        disk = tier(tmp_path, capacity=3 * MiB)  # 3 regions: writing 3 MiB more reuses every one
        stack = stack_over(disk)
        await stack.start()
        victim = blocks(1)
        await disk.put_many(NS, victim)
        flood = blocks(60)  # 3.6 MB: evicts the victim's region and writes new records over it
        held.then = lambda: disk._writers.submit(disk._put_blocking, NS, flood).result()
        task = asyncio.create_task(stack.get(NS, [victim[0][0]]))
        assert await asyncio.to_thread(held.entered.wait, 10)
        held.go.set()  # the flood runs, then the held read reads what is there now
        (found,) = await task
        assert found is None
        assert disk.stats().evictions >= 1 and not disk.known(NS, [victim[0][0]])[0]  # its region was reused
        assert not stack.ram.contains_many_sync(NS, [victim[0][0]])[0]
        assert held.calls == 1  # read once, into the slot: a miss there is not read again
        assert stack.stats()[1].checksum_failures == 0  # caught by the region's epoch, before any checksum
        assert stack.ram.arena_stats()["reservations"] == 0
        await stack.close()

    asyncio.run(go())


def test_a_get_cancelled_while_a_thread_reads_into_its_slots_frees_them_only_after(
    tmp_path: Path, held: HeldPreadv
) -> None:
    async def go() -> None:
        disk = tier(tmp_path)
        stack = stack_over(disk)
        await stack.start()
        batch = blocks(1)
        await disk.put_many(NS, batch)
        task = asyncio.create_task(stack.get(NS, [batch[0][0]]))
        assert await asyncio.to_thread(held.entered.wait, 10)
        task.cancel()
        await asyncio.sleep(0.2)
        # The reader thread is still inside its preadv into the slot: the slot stays reserved.
        assert stack.ram.arena_stats()["reservations"] == 1
        held.go.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            if stack.ram.arena_stats()["reservations"] == 0:
                break
            await asyncio.sleep(0.02)
        arena = stack.ram.arena_stats()
        assert arena["reservations"] == 0 and arena["free_bytes"] == arena["arena_bytes"]
        await stack.close()

    asyncio.run(go())


def test_concurrent_promotions_keep_ram_within_its_byte_cap(tmp_path: Path) -> None:
    async def go() -> None:
        disk = tier(tmp_path, capacity=32 * MiB)
        ram_bytes = 2 * MiB
        stack = stack_over(disk, ram=ram_bytes)
        await stack.start()
        batch = blocks(200, size=100_000)  # 20 MB on disk, ten times RAM
        for i in range(0, 200, 20):
            assert all(await disk.put_many(NS, batch[i : i + 20]))
        expected = dict(batch)
        peak = 0
        in_place = [0]  # disk hits served from the slot they were read into (the rest: no room, plain path)
        stop = asyncio.Event()

        async def watch() -> None:
            nonlocal peak
            while not stop.is_set():
                a = stack.ram.arena_stats()
                peak = max(peak, a["arena_bytes"] - a["free_bytes"])
                await asyncio.sleep(0)

        async def reader(seed: int) -> int:
            served = 0
            for r in range(10):
                keys = [batch[(seed * 37 + r * 11 + j) % 200][0] for j in range(8)]
                found = await stack.get(NS, keys)
                for key, f in zip(keys, found, strict=True):
                    if f is not None:
                        assert bytes(f.data) == expected[key]
                        served += 1
                        in_place[0] += f.tier is TierKind.DISK and f.lease is not None
                stack.release(found)
            return served

        watcher = asyncio.create_task(watch())
        served = await asyncio.gather(*(reader(s) for s in range(8)))
        stop.set()
        await watcher
        assert sum(served) == 8 * 10 * 8  # every key is on disk: each get is served
        assert in_place[0] >= 100, in_place[0]
        assert peak <= ram_bytes
        assert stack.ram.stats().used_bytes <= ram_bytes
        arena = stack.ram.arena_stats()
        assert arena["reservations"] == 0 and arena["leases"] == 0
        await stack.close()

    asyncio.run(go())


def test_promotions_into_a_full_ram_copy_out_no_victim_the_disk_holds(tmp_path: Path) -> None:
    """A block promoted from disk and then evicted from RAM is still on disk: its demotion copy is not
    made (RamTier held_below), nothing is written to the disk again, and what is served is right."""

    async def go() -> None:
        disk = tier(tmp_path, capacity=16 * MiB)
        stack = stack_over(disk, ram=2 * MiB)
        await stack.start()
        batch = blocks(60)  # 3.6 MB: more than RAM holds, so later promotions evict earlier ones
        assert all(await disk.put_many(NS, batch))
        puts = disk.stats().puts
        demoted: list[bytes] = []
        real = stack._on_ram_evict
        stack.ram._on_evict = lambda ns, key, block, until: (demoted.append(block), real(ns, key, block, until))
        for i in range(0, 60, 10):
            found = await stack.get(NS, [k for k, _ in batch[i : i + 10]])
            assert [bytes(f.data) for f in found if f is not None] == [b for _, b in batch[i : i + 10]]
            stack.release(found)
        await stack.wait_idle()
        assert stack.ram.stats().evictions > 0 and len(demoted) == stack.ram.stats().evictions
        assert demoted == [b""] * len(demoted)  # none copied out of the arena
        assert stack.ram.evictions_uncopied == len(demoted)
        assert disk.stats().puts == puts  # and none written again
        arena = stack.ram.arena_stats()
        assert arena["reservations"] == 0 and arena["leases"] == 0
        await stack.close()

    asyncio.run(go())


def test_a_victim_the_disk_does_not_hold_is_still_copied_and_demoted(tmp_path: Path) -> None:
    async def go() -> None:
        disk = tier(tmp_path, capacity=16 * MiB)
        stack = stack_over(disk, ram=2 * MiB)
        await stack.start()
        on_disk = blocks(20)
        assert all(await disk.put_many(NS, on_disk))
        ram_only = blocks(20)
        stack.ram.put_many_sync(NS, ram_only)  # in RAM alone (no write to the disk)
        assert disk.known(NS, [k for k, _ in ram_only]) == [False] * 20
        found = await stack.get(NS, [k for k, _ in on_disk])  # promotions evict the RAM-only blocks
        stack.release(found)
        await stack.wait_idle()
        evicted = [k for k, _ in ram_only if not stack.ram.contains_many_sync(NS, [k])[0]]
        assert evicted and stack.ram.evictions_uncopied == 0
        assert disk.known(NS, evicted) == [True] * len(evicted)  # demoted: copied out, then written
        got = await disk.get_many(NS, evicted)
        assert got == [b for k, b in ram_only if k in set(evicted)]
        await stack.close()

    asyncio.run(go())


def test_read_into_many_locates_a_part_under_one_hold_of_the_lock(tmp_path: Path) -> None:
    """A reader thread's part of a batch is looked up in the index under one hold of the tier's lock
    (not one per block), and a header buffer is reused across its reads."""

    async def go() -> None:
        disk = tier(tmp_path)
        batch = blocks(16)
        await disk.put_many(NS, batch)
        holds = 0
        real = disk._lock

        class Counting:
            def __enter__(self) -> None:
                nonlocal holds
                if threading.current_thread().name.startswith("kvcache-disk-read"):
                    holds += 1
                real.__enter__()

            def __exit__(self, *exc: object) -> None:
                real.__exit__(*exc)

        disk._lock = Counting()  # type: ignore[assignment]
        dests = [bytearray(len(b)) for _, b in batch]
        got = await disk.read_into_many(NS, [(k, memoryview(d)) for (k, _), d in zip(batch, dests, strict=True)])
        disk._lock = real
        assert got == [True] * 16 and [bytes(d) for d in dests] == [b for _, b in batch]
        assert holds <= 2  # one per reader thread's part (io_threads=2); was one per block
        await disk.close()

    asyncio.run(go())
