"""Retention on its way down the stack (docs/tiers.md, "Sessions that stay"): a retained block that RAM
evicts is demoted retained, for what was left of its retention; a write-through disk retains a put's
blocks before the put answers.

Against the in-process server (ServerThread) with a real disk tier in tmp_path; every assertion is an
exact count or exact bytes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from kvcache_client import KVCacheClient
from tests.conftest import ServerThread, keyed

pytestmark = pytest.mark.timeout(120)

KiB, MiB = 1 << 10, 1 << 20
BLOCK = 64 * KiB


def blocks(n: int) -> list[tuple[bytes, bytes]]:
    return [keyed(os.urandom(BLOCK)) for _ in range(n)]


def test_a_retained_block_ram_evicts_is_demoted_retained_for_what_was_left(
    make_server: Callable[..., ServerThread], tmp_path: Path
) -> None:
    """RAM full of retained blocks that only RAM holds (put into the RAM tier itself, so no put wrote
    them to the disk): the next puts must evict retained ones, and each victim reaches the disk
    retained, its deadline the one it had in RAM; the blocks the puts brought are on disk unretained.
    Then a flood larger than the disk keeps exactly the demoted, retained ones there."""
    server = make_server(
        ram={"capacity_bytes": 4 * MiB},
        disk={"enabled": True, "dir": str(tmp_path / "disk"), "capacity_bytes": 16 * MiB, "region_bytes": MiB},
        retention={"max_share": 1.0, "max_total_share": 1.0},
    )
    ram = server.stack.ram
    session = blocks(40)  # about 2.6 MiB of RAM's 4 MiB
    assert ram.put_many_sync("s", session) == [True] * 40
    assert ram.retain_many("s", [k for k, _ in session], 600) == 40
    with KVCacheClient(server.target, timeout_s=60, shm=False) as client:
        assert client.stats().tier("disk").retained_blocks == 0
        filler = blocks(32)  # what RAM cannot hold beside the session: the session's oldest are evicted
        assert client.put_many("f", filler).stored == 32
        server.call(server.stack.wait_idle())
        in_ram = [ram.retained("s", k) for k, _ in session]
        demoted = in_ram.count(False)
        assert demoted > 0
        disk = client.stats().tier("disk")
        assert disk.retained_blocks == demoted  # every victim retained there, the filler not
        disk_tier = next(t.tier for t in server.stack._lower if t.tier.name == "disk")
        assert all(disk_tier.holds("s", k) for (k, _), r in zip(session, in_ram, strict=True) if not r)
        # A flood of one-off blocks four times the disk: only retained records survive it there.
        for _ in range(16):
            assert client.put_many("one-off", blocks(64)).stored == 64
            server.call(server.stack.wait_idle())
        got = client.get_many("s", [k for k, _ in session])
        assert [bytes(g) if g is not None else None for g in got] == [b for _, b in session]
        assert client.corrupt_blocks == 0
        assert client.stats().tier("disk").retention_dropped == 0


def test_a_write_through_disk_retains_a_put_before_it_answers(
    make_server: Callable[..., ServerThread], tmp_path: Path
) -> None:
    """write_mode through: a retained put's blocks are retained on the disk when the put returns (no
    queue to wait for); an unretained put's are stored there unretained."""
    server = make_server(
        ram={"capacity_bytes": 8 * MiB},
        disk={
            "enabled": True,
            "dir": str(tmp_path / "disk"),
            "capacity_bytes": 16 * MiB,
            "region_bytes": MiB,
            "write_mode": "through",
        },
        retention={"max_share": 0.5, "max_total_share": 0.5},
    )
    with KVCacheClient(server.target, timeout_s=60, shm=False) as client:
        session = blocks(16)
        result = client.put_many("s", session, retain_ttl_s=600)
        assert result.stored == 16
        disk_put = next(t for t in result.tiers if t.name == "disk")
        assert (disk_put.stored, disk_put.queued) == (16, 0)
        assert client.stats().tier("disk").retained_blocks == 16  # no wait_idle: written before the answer
        assert client.put_many("plain", blocks(8)).stored == 8
        assert client.stats().tier("disk").retained_blocks == 16
        assert client.stats().tier("ram").retained_blocks == 16
