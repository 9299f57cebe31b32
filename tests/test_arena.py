"""The block arena under the RAM tier: slot bookkeeping, leases, reservations, RSS (docs/arena.md)."""

from __future__ import annotations

import itertools
import logging
import os
import random
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvcache_core.errors import ChecksumMismatch
from kvcache_core.format import verify_block
from kvcache_server import arena as arena_module
from kvcache_server.arena import ARENA_PREFIX, SLOT_ALIGN, Extents, Region, align, remove_dead_arenas
from kvcache_server.tiers.ram import ENTRY_OVERHEAD_BYTES, RamTier
from tests.conftest import raw_block

pytestmark = pytest.mark.timeout(120)

NS = "ns"
REPO = Path(__file__).resolve().parent.parent


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def check_bookkeeping(tier: RamTier) -> None:
    """Every arena byte is free, or in exactly one live slot (indexed, leased or reserved)."""
    slots = {id(s): s for s in tier._blocks.values()}
    slots.update({id(lease._slot): lease._slot for lease in tier._leases.values()})
    slots.update({id(r._slot): r._slot for r in tier._reservations.values()})
    spans = sorted((s.offset, align(s.length)) for s in slots.values())
    spans += tier._extents.extents()
    spans.sort()
    end = 0
    for offset, length in spans:
        assert offset == end, f"gap or overlap at {offset} (expected {end})"
        end = offset + length
    assert end == tier._extents.size
    assert tier._extents.free_bytes == sum(n for _, n in tier._extents.extents())
    for s in slots.values():
        leases = sum(1 for lease in tier._leases.values() if lease._slot is s)
        reserved = sum(1 for r in tier._reservations.values() if r._slot is s)
        assert s.pins == leases + reserved
        assert s.indexed == any(b is s for b in tier._blocks.values())
    reserved_slots = {id(r._slot) for r in tier._reservations.values()}
    orphans = [s for s in slots.values() if not s.indexed and id(s) not in reserved_slots]
    assert all(s.orphan_of is not None for s in orphans)  # out of the index, pinned: still on an account
    assert tier.used_bytes == sum(RamTier.entry_cost_of(s.length) for s in tier._blocks.values()) + sum(
        RamTier.entry_cost_of(r.length) for r in tier._reservations.values()
    ) + sum(RamTier.entry_cost_of(s.length) for s in orphans)
    assert tier.used_bytes == sum(p.held() for p in tier._partitions.values())  # every byte on an account
    assert tier.used_bytes <= tier.capacity_bytes


def test_extents_allocate_best_fit_and_coalesce() -> None:
    ext = Extents(1 << 16)
    rng = random.Random(7)
    live: dict[int, int] = {}
    for _ in range(3000):
        if live and rng.random() < 0.45:
            off = rng.choice(list(live))
            ext.free(off, live.pop(off))
        else:
            n = rng.randint(1, 3000)
            off = ext.alloc(n)
            if off is None:
                assert not ext.fits(n)
                continue
            assert off % SLOT_ALIGN == 0
            live[off] = n
        spans = sorted([(o, align(n)) for o, n in live.items()] + ext.extents())
        pos = 0
        for o, n in spans:
            assert o == pos
            pos = o + n
        assert pos == ext.size
        free = ext.extents()
        assert all(a + n < b for (a, n), (b, _) in itertools.pairwise(free))  # never touching
    for off, n in live.items():
        ext.free(off, n)
    assert ext.extents() == [(0, 1 << 16)] and ext.free_bytes == 1 << 16


@pytest.mark.parametrize("shared", [True, False], ids=["file", "memfd"])
def test_a_copy_running_as_the_region_closes_never_reads_another_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared: bool
) -> None:
    """A demotion copy (Region.read, a pread in a worker thread) still under way when a stopping
    server closes the arena: before, close() closed the descriptor at once, the next open got its
    number, and the copy returned that file's bytes as the block's. Now close() waits for the
    reads under way, and a read after it raises RegionClosed."""
    region = Region(1 << 20, str(tmp_path) if shared else None)
    region.view[: 1 << 16] = b"A" * (1 << 16)
    entered, go = threading.Event(), threading.Event()
    real_pread = os.pread

    def paused_pread(fd: int, n: int, offset: int) -> bytes:  # the thread loses the CPU right here
        entered.set()
        assert go.wait(30)
        return real_pread(fd, n, offset)

    monkeypatch.setattr(arena_module.os, "pread", paused_pread)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(region.read(0, 1 << 16)))
    reader.start()
    assert entered.wait(30)
    closer = threading.Thread(target=region.close)
    closer.start()
    closer.join(0.2)  # close() waits for the read (before: it had closed the descriptor already)
    other = tmp_path / "other"
    other.write_bytes(b"B" * (1 << 16))
    fd = os.open(other, os.O_RDONLY)  # the lowest free number: the arena's, had it been closed
    try:
        go.set()
        reader.join(30)
        closer.join(30)
    finally:
        os.close(fd)
    assert not closer.is_alive() and got == [b"A" * (1 << 16)]
    monkeypatch.setattr(arena_module.os, "pread", real_pread)
    with pytest.raises(arena_module.RegionClosed):
        region.read(0, 16)


def test_region_is_an_owner_only_file_clients_can_map_and_goes_with_close(tmp_path: Path) -> None:
    region = Region(1 << 20, str(tmp_path))
    st = os.stat(region.path)
    assert os.path.basename(region.path).startswith(ARENA_PREFIX)
    assert (st.st_mode & 0o777, st.st_size, st.st_blocks * 512 >= 1 << 20) == (0o400, 1 << 20, True)
    assert region.prefault in {"populate", "touch"}
    region.view[:5] = b"hello"
    with open(region.path, "rb") as f:  # what a client maps is the server's memory
        assert f.read(5) == b"hello"
    assert remove_dead_arenas(str(tmp_path)) == 0  # a live server's arena is locked, never removed
    region.close()
    assert not os.path.exists(region.path)


def test_arenas_of_dead_servers_are_removed(tmp_path: Path) -> None:
    code = "import os, sys; from kvcache_server.arena import Region; Region(1 << 20, sys.argv[1]); os._exit(0)"
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, cwd=REPO, timeout=60)
    assert len(list(tmp_path.iterdir())) == 1  # killed without close(): its file stays
    region = Region(1 << 20, str(tmp_path))  # the next server removes it
    assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(region.path)]
    region.close()


def test_a_leased_slot_is_never_reused_while_a_flood_evicts_everything() -> None:
    """A reader holding a lease while a writer floods the arena gets exactly its bytes."""
    tier = RamTier(capacity_bytes=256 << 10, prefault=False)
    mine = raw_block(key(0), os.urandom(8000))
    tier.put_many_sync(NS, [(key(0), mine)])
    (lease,) = tier.lease_many(NS, [key(0)])
    assert lease is not None

    def flood(seed: int) -> None:
        rng = random.Random(seed)
        for i in range(300):  # ~3 MiB each through a 256 KiB arena: it is evicted over and over
            tier.put_many_sync(NS, [(key(seed * 1000 + i + 1), os.urandom(rng.randint(100, 20_000)))])

    writers = [threading.Thread(target=flood, args=(s,)) for s in range(3)]
    for w in writers:
        w.start()
    checks = 0
    while any(w.is_alive() for w in writers) or checks == 0:  # read under the lease while they write
        assert bytes(lease.view) == mine
        verify_block(lease.view, key(0))
        checks += 1
    for w in writers:
        w.join()
    assert tier.stats().evictions > 100
    assert tier.contains_many_sync(NS, [key(0)]) == [True]  # a pinned block is never an eviction victim
    assert bytes(lease.view) == mine  # and its slot was never handed out again
    check_bookkeeping(tier)
    assert tier.delete_many_sync(NS, [key(0)]) == 1  # out of the index; the lease keeps the slot
    free = tier._extents.free_bytes
    assert tier.release([lease.id]) == 1 and tier.release([lease.id]) == 0
    assert tier._extents.free_bytes == free + align(len(mine))  # freed by the release
    check_bookkeeping(tier)


def test_leases_expire_and_free_what_the_index_let_go() -> None:
    clock = Clock()
    tier = RamTier(capacity_bytes=64 << 10, prefault=False, clock=clock)
    tier.put_many_sync(NS, [(key(i), bytes([i]) * 1000) for i in range(3)])
    leases = tier.lease_many(NS, [key(0), key(1), key(9)], ttl_s=5)
    assert leases[2] is None and all(lease is not None for lease in leases[:2])
    assert tier.delete_many_sync(NS, [key(0)]) == 1  # gone from the index; its slot leased
    before = tier._extents.free_bytes
    clock.now += 4.9
    assert tier.reap() == 0
    clock.now += 0.2
    assert tier.reap() == 2 and tier.leases_expired == 2
    assert tier._extents.free_bytes == before + align(1000)  # key 0's slot; key 1's is still indexed
    assert tier.release([lease.id for lease in leases if lease]) == 0  # already ended
    assert tier.get_many_sync(NS, [key(1)]) == [bytes([1]) * 1000]
    check_bookkeeping(tier)


def test_reservations_commit_in_place_or_are_reclaimed() -> None:
    clock = Clock()
    tier = RamTier(capacity_bytes=64 << 10, prefault=False, clock=clock)
    block = raw_block(key(1), os.urandom(5000))
    res = tier.reserve(NS, len(block), ttl_s=10)
    assert res is not None and len(res.buffer) == len(block) and not res.buffer.readonly
    res.buffer[:] = block  # the client's one copy, straight into the slot
    assert tier.used_bytes == RamTier.entry_cost(block)
    verify_block(res.buffer, key(1))
    with pytest.raises(ChecksumMismatch):
        verify_block(res.buffer, key(2))
    assert tier.adopt_many(NS, [(key(1), res)]) == [True]
    assert tier.adopt_many(NS, [(key(1), res)]) == [False]  # a reservation commits once
    assert tier.get_many_sync(NS, [key(1)]) == [block]
    (lease,) = tier.lease_many(NS, [key(1)])
    assert lease is not None and lease.offset == res.offset  # no copy: the reserved slot is the entry
    tier.release([lease.id])
    # Abandoned: freed at once. Forgotten: reclaimed at its time-out, and a late commit stores nothing.
    abandoned, forgotten = tier.reserve(NS, 3000), tier.reserve(NS, 3000, ttl_s=10)
    assert abandoned is not None and forgotten is not None
    assert tier.abandon([abandoned.id, abandoned.id]) == 1
    check_bookkeeping(tier)
    clock.now += 11
    assert tier.reap() == 1 and tier.reservations_reclaimed == 1
    assert tier.adopt_many(NS, [(key(2), forgotten)]) == [False]
    assert tier.used_bytes == RamTier.entry_cost(block)
    check_bookkeeping(tier)
    assert tier.arena_stats()["reservations"] == 0


def test_a_tenants_reservations_evict_only_its_own_blocks_and_count_against_its_share() -> None:
    """Tenants T and U with shares of 4 blocks each in a tier of 8: T reserving (an in-place or bulk
    put) evicts T's own least recently used block, never U's (before, reservations skipped the
    share and the tier evicted from whoever was furthest over it, U included), and T's open
    reservations count against T's share."""
    size = 4000
    cost = RamTier.entry_cost_of(size)
    tier = RamTier(capacity_bytes=8 * cost, prefault=False, quota_of=lambda tenant: 4 * cost)
    for tenant in ("U", "T"):  # U first: of two partitions equally at their share, it was evicted from
        for i in range(4):
            assert tier.put_many_sync(f"{tenant}:ns", [(key(i), os.urandom(size))]) == [True]
    res = tier.reserve("T:ns", size)
    assert res is not None
    res.buffer[:] = os.urandom(size)
    assert tier.adopt_many("T:ns", [(key(9), res)]) == [True]
    assert tier.contains_many_sync("U:ns", [key(i) for i in range(4)]) == [True] * 4
    assert tier.contains_many_sync("T:ns", [key(i) for i in range(4)]) == [False, True, True, True]
    # Four open reservations of T fill its share: a fifth is refused, U's blocks stay.
    open_ = [tier.reserve("T:ns", size) for _ in range(4)]
    assert None not in open_ and tier.reserve("T:ns", size) is None
    assert tier.contains_many_sync("U:ns", [key(i) for i in range(4)]) == [True] * 4
    assert tier.abandon([r.id for r in open_ if r is not None]) == 4
    check_bookkeeping(tier)


def test_reservations_and_leases_pinning_the_arena_refuse_puts_without_evicting_in_vain() -> None:
    tier = RamTier(capacity_bytes=32 << 10, prefault=False, pin_share=1.0)
    tier.put_many_sync(NS, [(key(i), bytes(7000)) for i in range(4)])
    leases = tier.lease_many(NS, [key(i) for i in range(4)])
    assert tier.put_many_sync(NS, [(key(9), bytes(7000))]) == [False]
    assert tier.reserve(NS, 7000) is None
    assert tier.stats().evictions == 0 and tier.stats().blocks == 4  # nothing evicted for nothing
    tier.release([lease.id for lease in leases if lease])
    assert tier.put_many_sync(NS, [(key(9), bytes(7000))]) == [True]
    check_bookkeeping(tier)


def test_concurrent_puts_gets_deletes_leases_and_reservations_keep_exact_bookkeeping() -> None:
    clock = Clock()
    tier = RamTier(capacity_bytes=1 << 20, prefault=False, clock=clock)
    errors: list[str] = []
    lock = threading.Lock()

    def content(k: bytes, n: int) -> bytes:
        return (k * (n // 16 + 1))[:n]  # content addressing: a key's bytes follow from the key

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        mine: list[int] = []
        for _ in range(600):
            k = key(rng.randrange(300))
            n = 16 * rng.choice([1, 64, 512, 2048])
            op = rng.random()
            if op < 0.35:
                tier.put_many_sync(NS, [(k, content(k, n))])
            elif op < 0.55:
                (got,) = tier.get_many_sync(NS, [k])
                if got is not None and got != content(k, len(got)):
                    errors.append("wrong bytes from get")
            elif op < 0.75:
                (lease,) = tier.lease_many(NS, [k], ttl_s=rng.choice([0.5, 100]))
                if lease is not None:
                    copied = bytes(lease.view)
                    # As a client does (LeasedBlocks.expires_at): a copy is kept only if the lease was
                    # still live once it ended. Other workers may have run the clock past a 0.5 s lease
                    # while this one waited for the GIL; its slot may then be reused, as it may be.
                    if clock.now < lease.expires and copied != content(k, lease.length):
                        errors.append("wrong bytes under a live lease")
                    mine.append(lease.id)
            elif op < 0.85:
                if rng.random() < 0.5:
                    # A writer that went away: its reservation is abandoned or left to expire, never
                    # written (a slot reclaimed at expiry may already hold another key's block).
                    gone = tier.reserve(NS, n, ttl_s=0.5)
                    if gone is not None and rng.random() < 0.5:
                        tier.abandon([gone.id])
                else:
                    # A writer as the server's own (reserve_many): its reservation never expires.
                    res = tier.reserve(NS, n)
                    if res is not None:
                        res.buffer[:] = content(k, n)
                        if rng.random() < 0.25 or tier.adopt_many(NS, [(k, res)]) != [True]:
                            tier.abandon([res.id])  # as its owner does with what it did not commit
            elif op < 0.95:
                tier.delete_many_sync(NS, [k])
            else:
                tier.release(mine[: rng.randrange(len(mine) + 1)])
                del mine[:]
            with lock:
                clock.now += 0.01  # leases and reservations of 0.5 s expire as the workers go
            if tier.used_bytes > tier.capacity_bytes:
                errors.append("over capacity")

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    check_bookkeeping(tier)
    stats = tier.arena_stats()
    assert stats["leases_expired"] > 0 and stats["reservations_reclaimed"] > 0
    clock.now += 1000
    tier.reap()
    check_bookkeeping(tier)
    assert tier.arena_stats()["leases"] == tier.arena_stats()["reservations"] == 0
    indexed = sum(align(s.length) for s in tier._blocks.values())
    assert tier._extents.free_bytes == tier._extents.size - indexed  # nothing leaked
    for (_, k), slot in tier._blocks.items():
        assert bytes(tier.region.view[slot.offset : slot.offset + slot.length]) == content(k, slot.length)


_RSS_FLOOD = """
import os, random, sys
from kvcache_server.tiers.ram import RamTier

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

cap = 64 << 20
base = rss()
tier = RamTier(cap, arena_dir=sys.argv[1])  # pre-faulted: RSS is the arena from here on
arena = rss() - base
rng = random.Random(1)
peak = 0
for i in range(3000):  # ~20x the cap in blocks of 4 KiB .. 1 MiB: churn, evictions, fragmentation
    n = rng.choice([4096, 65536, 262144, 1 << 20]) + rng.randrange(4096)
    tier.put_many_sync("ns", [(os.urandom(16), os.urandom(n))])
    if i % 100 == 0:
        peak = max(peak, rss() - base)
print(arena, peak, len(tier._blocks), tier.stats().evictions)
"""


def test_rss_stays_within_the_arena_plus_its_stated_overhead_under_a_flood(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _RSS_FLOOD, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])},
    )
    assert out.returncode == 0, out.stderr
    arena, peak, blocks, evictions = map(int, out.stdout.split())
    assert arena >= 64 << 20  # pre-faulted at start-up
    assert evictions > 1000
    # The arena, the index's stated overhead, and the flood's own transient 1 MiB buffers.
    assert peak <= arena + blocks * ENTRY_OVERHEAD_BYTES + (8 << 20), (arena, peak, blocks)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("madvise_works", [True, False])
def test_prefault_logs_progress_and_the_time_taken(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, madvise_works: bool
) -> None:
    monkeypatch.setattr(arena_module, "PREFAULT_PROGRESS_INTERVAL_S", 0.0)  # a line at every tenth
    if not madvise_works:  # an unknown advice fails as MADV_POPULATE_WRITE does on kernels before 5.14
        monkeypatch.setattr(arena_module, "_MADV_POPULATE_WRITE", 999)
    caplog.set_level(logging.INFO, logger="kvcache_server.arena")
    region = Region(40 << 20, str(tmp_path))  # 40 MiB: tenths of 4 MiB
    try:
        lines = [r.getMessage() for r in caplog.records if r.name == "kvcache_server.arena"]
        progress = [m for m in lines if m.startswith("arena: faulting in 40 MiB: ")]
        assert [m.split(": ")[2].split("%")[0] for m in progress] == [str(10 * i) for i in range(1, 10)]
        assert lines[-1].startswith("arena: faulted in 40 MiB in ") and lines[-1].endswith(f"({region.prefault})")
        assert region.prefault == ("populate" if madvise_works else "touch")
        assert os.stat(region.path).st_blocks * 512 >= 40 << 20  # every page is there
    finally:
        region.close()


@pytest.mark.parametrize("seed", range(6))
def test_the_one_victim_shortcut_plans_what_the_full_plan_does(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """room._one_victim answers only where the full plan (its three steps) is that one victim: checked
    on every reservation of a random run (sizes mostly alike, some not; leases pinning the oldest
    blocks; retained blocks; a re-put that keeps its entry), against the plan built with it off."""
    from kvcache_server.tiers import room

    rng = random.Random(seed)
    tier = RamTier(capacity_bytes=512 << 10, prefault=False, pin_share=0.9)
    quick = room._one_victim
    answered = compared = 0

    def both(tier_: RamTier, part, nbytes: int, cost: int, keep):  # type: ignore[no-untyped-def]
        nonlocal answered, compared
        got = quick(tier_, part, nbytes, cost, keep)
        monkeypatch.setattr(room, "_one_victim", lambda *a: None)
        try:
            full = room.plan_room(tier_, part, nbytes, cost, keep)
        finally:
            monkeypatch.setattr(room, "_one_victim", both)
        compared += 1
        if got is not None:
            answered += 1
            assert got == full
        return got

    monkeypatch.setattr(room, "_one_victim", both)
    leases = []
    for i in range(1500):
        size = 16 << 10 if rng.random() < 0.9 else rng.randint(1000, 40 << 10)
        k = key(rng.randrange(i + 1) if rng.random() < 0.05 else 100_000 + i)  # now and then a re-put
        tier.put_many_sync(NS, [(k, os.urandom(size))])
        roll = rng.random()
        if roll < 0.05:
            made = tier.lease_many(NS, [key(100_000 + rng.randrange(i + 1))], ttl_s=60)
            leases += [lease.id for lease in made if lease is not None]
        elif roll < 0.08:
            tier.retain_many(NS, [key(100_000 + i)], ttl_s=60)
        if len(leases) > 6:
            tier.release([leases.pop(0)])
    check_bookkeeping(tier)
    assert tier.stats().evictions > 500 and compared > 500
    print(f"{answered} of {compared} plans by the shortcut")
    assert answered > 20  # the shortcut answered, and each time with what the plan says
