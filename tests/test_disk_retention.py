"""Retention in the disk tier (docs/tiers.md, "Retention on disk"): retained records are copied
forward out of an evicted region, bounded per tenant, decay at their deadline, and a copy that
finds no room is dropped and counted.

Against the in-process server (ServerThread) with a real disk tier in tmp_path, and against a
DiskTier itself where the test moves its clock or makes its disk full (ENOSPC injected into the
tier's own write of the copied records: fault injection on the real tier, no mock).
"""

from __future__ import annotations

import asyncio
import errno
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvcache_client import KVCacheClient
from kvcache_server.tiers import codec
from kvcache_server.tiers import disk as disk_mod
from kvcache_server.tiers import disk_layout as layout
from kvcache_server.tiers.disk import DiskTier
from kvcache_server.tiers.retention import RetentionLimits
from tests.conftest import ServerThread, keyed
from tests.test_retention import TOKENS, tokens_file

KiB, MiB = 1 << 10, 1 << 20


def blocks(n: int, size: int) -> list[tuple[bytes, bytes]]:
    return [keyed(os.urandom(size)) for _ in range(n)]


# -- a session kept on disk, against a server -----------------------------------------------------

RAM_BYTES, DISK_BYTES = 8 * MiB, 32 * MiB
SESSION_BLOCKS, BLOCK = 64, 64 * KiB  # 4 MiB: more than RAM's retained share (2 MiB), within the disk's (8 MiB)


def flood(client: KVCacheClient, server: ServerThread, nbytes: int, ns: str = "one-off", **put: object) -> int:
    """Puts one-off blocks of BLOCK bytes, `nbytes` of them, every write to the disk done after each batch."""
    flooded = 0
    while flooded < nbytes:
        batch = blocks(32, BLOCK)
        assert client.put_many(ns, batch, **put).stored == 32  # type: ignore[arg-type]
        flooded += sum(len(b) for _, b in batch)
        server.call(server.stack.wait_idle())
    return flooded


@pytest.mark.timeout(240)
@pytest.mark.parametrize("retain", [True, False], ids=["retained", "not-retained"])
def test_a_session_past_rams_share_is_served_from_disk_after_a_flood_larger_than_both(
    make_server: Callable[..., ServerThread], tmp_path: Path, retain: bool
) -> None:
    server = make_server(
        ram={"capacity_bytes": RAM_BYTES},
        disk={"enabled": True, "dir": str(tmp_path / "disk"), "capacity_bytes": DISK_BYTES, "region_bytes": MiB},
        retention={"max_share": 0.25, "max_total_share": 0.5},
    )
    session = blocks(SESSION_BLOCKS, BLOCK)
    keys = [k for k, _ in session]
    with KVCacheClient(server.target, timeout_s=60, shm=False) as client:
        for i in range(0, SESSION_BLOCKS, 8):  # turn by turn
            assert client.put_many("session", session[i : i + 8], retain_ttl_s=600 if retain else None).stored == 8
        server.call(server.stack.wait_idle())
        before = client.stats()
        if retain:  # RAM's share holds about half of it; the disk's all of it
            assert 0 < before.tier("ram").retained_blocks < SESSION_BLOCKS
            assert before.tier("disk").retained_blocks == SESSION_BLOCKS
        assert flood(client, server, 2 * (RAM_BYTES + DISK_BYTES)) > RAM_BYTES + DISK_BYTES
        got = client.get_many("session", keys)
        hits = sum(g is not None for g in got)
        disk = client.stats().tier("disk")
        assert disk.evictions > 0
        assert all(g is None or bytes(g) == b for g, (_, b) in zip(got, session, strict=True))  # byte-identical
        assert client.corrupt_blocks == 0
        if retain:
            assert hits >= 0.99 * SESSION_BLOCKS, hits
            assert disk.hits > 0  # the part RAM could not retain came from disk
            assert disk.retention_copied > 0 and disk.retention_dropped == 0
            assert disk.retention_refused == 0
            assert disk.retained_blocks == SESSION_BLOCKS
        else:
            assert hits < 0.99 * SESSION_BLOCKS, hits
            assert hits <= 4  # nothing keeps them: the flood evicted them from RAM and disk
            assert disk.retained_blocks == disk.retention_copied == 0


@pytest.mark.timeout(240)
def test_a_tenant_past_its_disk_share_stores_unretained_and_cannot_keep_another_out(
    make_server: Callable[..., ServerThread], tmp_path: Path
) -> None:
    disk_bytes = 16 * MiB
    server = make_server(
        ram={"capacity_bytes": 4 * MiB},
        disk={"enabled": True, "dir": str(tmp_path / "disk"), "capacity_bytes": disk_bytes, "region_bytes": MiB},
        retention={"max_share": 0.25, "max_total_share": 0.5},
        auth={"enabled": True, "tokens_file": str(tokens_file(tmp_path))},
    )
    acme = KVCacheClient(server.target, token=TOKENS["acme"], shm=False, timeout_s=60)
    globex = KVCacheClient(server.target, token=TOKENS["globex"], shm=False, timeout_s=60)
    ops = KVCacheClient(server.target, token=TOKENS["ops"], shm=False)
    try:
        greedy = blocks(96, BLOCK)  # 6 MiB: past acme's quarter of the disk
        span = layout.record_span(len(b"acme:s"), len(greedy[0][1]))
        share = int(disk_bytes * 0.25) // span
        for i in range(0, 96, 16):
            assert acme.put_many("s", greedy[i : i + 16], retain_ttl_s=600).stored == 16
        server.call(server.stack.wait_idle())
        disk = ops.stats().tier("disk")
        assert disk.retained_blocks == share and disk.retention_refused == 96 - share
        assert disk.retained_bytes == share * span
        mine = blocks(48, BLOCK)  # 3 MiB: within globex's share, and within the total beside acme's
        assert globex.put_many("s", mine, retain_ttl_s=600).stored == 48
        server.call(server.stack.wait_idle())
        disk = ops.stats().tier("disk")
        assert disk.retained_blocks == share + 48 and disk.retention_refused == 96 - share
        # acme floods plain blocks, more than the disk holds: globex's session stays whole.
        flood(acme, server, 2 * disk_bytes, ns="flood")
        got = globex.get_many("s", [k for k, _ in mine])
        assert [bytes(g) if g is not None else None for g in got] == [b for _, b in mine]
        kept = acme.get_many("s", [k for k, _ in greedy])
        assert sum(g is not None for g in kept[:share]) == share  # acme's retained part too
        assert sum(g is not None for g in kept[share:]) <= 4  # its unretained excess went with the flood
        disk = ops.stats().tier("disk")
        assert disk.retention_copied > 0 and disk.retention_dropped == 0
    finally:
        for client in (acme, globex, ops):
            client.close()


# -- the tier itself -------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.offset_s = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset_s


def disk_tier(directory: Path, clock: Clock) -> DiskTier:
    return DiskTier(
        str(directory),
        capacity_bytes=8 * MiB,
        region_bytes=MiB,
        write_threads=1,
        retention=RetentionLimits(max_share=0.5, max_total_share=0.5),
        verify=codec.check_stored,
        clock=clock,
    )


async def put_flood(tier: DiskTier, nbytes: int) -> None:
    for _ in range(nbytes // (16 * BLOCK)):
        assert all(await tier.put_many("flood", blocks(16, BLOCK)))


@pytest.mark.timeout(60)
def test_an_expired_retention_is_evicted_like_any_block(tmp_path: Path) -> None:
    clock = Clock()

    async def go() -> None:
        tier = disk_tier(tmp_path, clock)
        try:
            session = blocks(16, BLOCK)
            keys = [k for k, _ in session]
            assert all(await tier.put_retained("s", session, [clock() + 60] * 16))
            assert tier.stats().retained_blocks == 16
            await put_flood(tier, 24 * MiB)  # three times the tier
            assert tier.known("s", keys) == [True] * 16
            assert await tier.get_many("s", keys) == [b for _, b in session]
            clock.offset_s += 61 + 60  # past the deadline, and past the renewal of that hit
            stats = tier.stats()
            assert stats.retained_blocks == 0 and stats.retention_expired == 16
            await put_flood(tier, 24 * MiB)
            assert tier.known("s", keys) == [False] * 16  # plain again: evicted with its region
            assert tier.stats().retention_dropped == 0
        finally:
            await tier.close()

    asyncio.run(go())


@pytest.mark.timeout(60)
def test_copying_forward_into_a_full_disk_drops_and_counts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    full = {"on": False}
    real_pwritev_all = disk_mod._pwritev_all

    def pwritev_all(fd: int, buffers: list[bytes | memoryview], offset: int) -> None:
        if full["on"]:
            raise OSError(errno.ENOSPC, "no space left on device")
        real_pwritev_all(fd, buffers, offset)

    async def go() -> None:
        tier = disk_tier(tmp_path, clock)
        real_copy_forward = tier._copy_forward

        def copy_forward(region: object, moved: list) -> None:  # only the copied records' write finds the disk full
            full["on"] = True
            try:
                real_copy_forward(region, moved)  # type: ignore[arg-type]
            finally:
                full["on"] = False

        tier._copy_forward = copy_forward  # type: ignore[method-assign]
        monkeypatch.setattr(disk_mod, "_pwritev_all", pwritev_all)
        try:
            session = blocks(16, BLOCK)
            keys = [k for k, _ in session]
            assert all(await tier.put_retained("s", session, [clock() + 600] * 16))
            await put_flood(tier, 24 * MiB)  # the flood itself is stored: only the copies fail
            stats = tier.stats()
            assert stats.retention_dropped == 16 and stats.retention_copied == 0
            assert stats.retained_blocks == stats.retained_bytes == 0
            assert tier.known("s", keys) == [False] * 16
            assert stats.errors > 0  # the failed writes are counted as the tier's own
        finally:
            await tier.close()

    asyncio.run(go())
