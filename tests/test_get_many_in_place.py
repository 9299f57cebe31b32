"""get_many and get_tensors on the same host copy each block whole out of the arena into a buffer of
the client's pool where the presence index locates every key, its payload verified as it lands, and
name the keys in one TOUCH (kvcache_client.local_reads.plan_blocks / land_blocks), against real
servers (the in-process ServerThread with its bulk port).

What the code before did: every same-host get_many leased its blocks (a LEASE and a RELEASE frame, or
one bulk GET for a small get), copied them out of the arena, released them, then verified each in a
second pass over the copy: 1.3-1.5x the time of get_into for 16 x 2 MiB (bench/bench_peers.py).
"""

from __future__ import annotations

import asyncio
import os

import pytest

from kvcache_client import AsyncKVCacheClient, KVCacheClient
from kvcache_core.format import payload_view
from tests.conftest import ServerThread, raw_block
from tests.test_local_reads import KiB, MiB, _frames, _items

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("size", [16 * KiB, 2 * MiB], ids=["small", "large"])
def test_get_many_copies_located_blocks_whole_out_of_the_arena_and_touches_them(make_server, size: int) -> None:
    """No GET and no LEASE frame, one TOUCH; every block exact, header included; each a RAM hit; the
    pool's buffers reused once the caller dropped the blocks; get_tensors the same; both faces. On
    the code before: a LEASE (or a GET for the small ones) per call, no TOUCH."""
    server: ServerThread = make_server(ram={"capacity_bytes": 128 * MiB})
    items = _items(8, size)
    keys = [k for k, _ in items]
    with KVCacheClient(server.target, timeout_s=10) as client:
        assert client.put_many("ns", items).stored == 8
        client.lookup("ns", keys)  # Info asked, the index mapped
        before = _frames(server)
        ram = next(t for t in client.stats().tiers if t.name == "ram")
        blocks = client.get_many("ns", keys)
        assert [bytes(b) for b in blocks] == [b for _, b in items]  # type: ignore[arg-type]
        assert all(b is not None and b.readonly for b in blocks)
        del blocks
        assert _frames(server) == (before[0], before[1], before[2] + 1)
        assert next(t for t in client.stats().tiers if t.name == "ram").hits == ram.hits + 8
        assert client.presence.counters.read_in_place == 8 and client.presence.counters.read_again == 0
        reused = client.buffers.reused
        tensors = client.get_tensors("ns", keys, prefix_only=True)
        assert [bytes(t.numpy().tobytes()) for t in tensors] == [bytes(payload_view(b)) for _, b in items]  # type: ignore[union-attr]
        if size >= MiB:  # pooled sizes: the first call's buffers, free again, hold the second's blocks
            assert client.buffers.reused == reused + 8
        assert client.presence.counters.read_in_place == 16 and client.corrupt_blocks == 0

    async def run() -> None:
        async with AsyncKVCacheClient(server.target, timeout_s=10) as aclient:
            await aclient.lookup("ns", keys)
            before = _frames(server)
            got = await aclient.get_many("ns", keys)
            assert [bytes(b) for b in got] == [b for _, b in items]  # type: ignore[arg-type]
            assert _frames(server) == (before[0], before[1], before[2] + 1)
            assert aclient.presence.counters.read_in_place == 8

    asyncio.run(run())


def test_a_key_not_located_takes_the_usual_path_for_the_whole_get(make_server) -> None:
    """One key RAM lacks: nothing read in place, no TOUCH; the usual path answers (a prefix stops at
    the miss, without it the miss is None)."""
    server: ServerThread = make_server(ram={"capacity_bytes": 64 * MiB})
    items = _items(3)
    keys = [k for k, _ in items]
    with KVCacheClient(server.target, timeout_s=10) as client:
        assert client.put_many("ns", [items[0], items[2]]).stored == 2
        got = client.get_many("ns", keys)
        assert got[0] == items[0][1] and got[1] is None and got[2] == items[2][1]
        assert client.get_many("ns", keys, prefix_only=True)[:2] == [items[0][1], None]
        assert client.presence.counters.read_in_place == 0 and client.presence.counters.read_again == 0
        assert server.running.bulk.counters.get("touches") == 0


def test_a_stale_location_is_never_another_blocks_bytes(make_server) -> None:
    """Key K of namespace "a" located, then deleted, and K of "b" (other bytes, same size: it verifies
    under K) put into the same slot; get_many("a", K) copying from the stale location: the bucket's
    version changed, so the copy is dropped, counted as read_again, and the usual path answers (a
    miss), never b's block as a's. The same with another key's block in the slot (it fails its
    checksum under K as it lands)."""
    server: ServerThread = make_server(ram={"capacity_bytes": 64 * MiB})
    key, other = os.urandom(16), os.urandom(16)
    block_a, block_b = raw_block(key, os.urandom(16 * KiB)), raw_block(key, os.urandom(16 * KiB))
    with KVCacheClient(server.target, timeout_s=10) as client:
        for ns, taker in (("b", (key, block_b)), ("a", (other, raw_block(other, os.urandom(16 * KiB))))):
            assert client.put_many("a", [(key, block_a)]).stored == 1
            stale = client.presence.locate("a", [key])
            client.delete("a", [key])
            assert client.put_many(ns, [taker]).stored == 1
            assert client.presence.locate(ns, [taker[0]]).words == stale.words  # it took a's slot
            real = client.presence.locate
            client.presence.locate = lambda namespace, keys, stale=stale: stale  # type: ignore[method-assign]
            try:
                again = client.presence.counters.read_again
                assert client.get_many("a", [key]) == [None]
                assert client.presence.counters.read_again == again + 1
            finally:
                client.presence.locate = real  # type: ignore[method-assign]
            client.delete(ns, [taker[0]])
        assert client.presence.counters.read_in_place == 0 and client.corrupt_blocks == 0
