"""The asyncio SDK's same-host transfers through the server's block arena (docs/arena.md), mirroring
tests/test_inplace.py: puts go through the client's own segment, which the server reads straight
into arena slots it reserves itself (no client is handed a writable slot); gets are leased read-only
views. And what asyncio adds: cancellations and deadlines of a few ms never leave a lease open, nor
one of the server's reservations for a put, and never hand out wrong bytes."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvcache_client import AsyncKVCacheClient
from kvcache_client.errors import DeadlineExceeded, KVCacheError
from kvcache_proto import kvcache_pb2 as pb
from tests.conftest import ServerThread, raw_block

pytestmark = pytest.mark.timeout(120)

NS = "ns"
MiB = 1 << 20


@pytest.fixture
def arena_server(make_server, tmp_path: Path) -> ServerThread:
    return make_server(ram={"capacity_bytes": 64 * MiB, "lease_timeout_s": 60.0}, shm={"dir": str(tmp_path / "shm")})


def blocks(n: int, size: int) -> list[tuple[bytes, bytes]]:
    out = []
    for _ in range(n):
        k = os.urandom(16)
        out.append((k, raw_block(k, os.urandom(size))))
    return out


def open_pins(server: ServerThread) -> tuple[int, int]:
    stats = server.stack.ram.arena_stats()
    return stats["leases"], stats["reservations"]


async def settled_pins(server: ServerThread, within_s: float = 10.0) -> tuple[int, int]:
    """open_pins once the server's own ends of calls whose clients have gone have ended too (a bulk
    GET's blocks are leased until its send ends or fails), or after `within_s`: a leaked lease lasts
    60 s on arena_server, a leaked reservation for ever, so one is still counted then."""
    end = time.monotonic() + within_s
    while (pins := open_pins(server)) != (0, 0) and time.monotonic() < end:
        await asyncio.sleep(0.01)  # the loop stays free for the client's own cleanups meanwhile
    return pins


def count_grpc_block_traffic(client: AsyncKVCacheClient) -> dict[str, int]:
    """Counts what the client's gRPC transport sends as Put messages (their bytes) and how many Get
    calls it makes: the calls that would carry block bytes over gRPC."""
    inner = client._transport.inner
    counts = {"put_message_bytes": 0, "get_calls": 0}
    put, get = inner._put, inner._get

    async def counted(messages: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        async for message in messages:
            counts["put_message_bytes"] += len(message)
            yield message

    def counted_get(request: pb.GetRequest, **kwargs: object) -> object:
        counts["get_calls"] += 1
        return get(request, **kwargs)

    inner._put = lambda messages, **kwargs: put(counted(messages), **kwargs)
    inner._get = counted_get
    return counts


def test_puts_and_gets_move_no_byte_through_grpc(arena_server: ServerThread) -> None:
    """Puts: the server reads the SDK's segment straight into arena slots (counted in both
    shm_bytes_received and inplace_bytes_received); gets: leased views of those slots."""
    data = blocks(4, 2 * MiB)
    keys = [k for k, _ in data]
    total = sum(len(b) for _, b in data)

    async def run() -> None:
        async with AsyncKVCacheClient(arena_server.target) as client:
            client.bulk.same_host_get_bytes = 0  # this test is about leases: no get as one bulk GET
            client.bulk.read_in_place = False  # nor get_into's copies straight out of the arena
            wire = count_grpc_block_traffic(client)
            result = await client.put_many(NS, data)
            assert (result.stored, result.bytes_sent) == (4, total)
            assert client._transport.arena.state == "on"
            assert [bytes(b) for b in await client.get_many(NS, keys)] == [b for _, b in data]
            async with client.leased(NS, keys) as views:
                assert [bytes(v) for v in views] == [b for _, b in data]
                assert all(v.readonly for v in views)
                assert (await client.stats()).arena_leases == 4  # held while the block runs
            with pytest.raises(ValueError):
                bytes(views[0])  # released with the block
            tensors = [torch.empty(len(b) - 48, dtype=torch.uint8) for _, b in data]
            buffers = [bytearray(len(b) - 48) for _, b in data]
            assert await client.get_into(NS, keys, tensors) == [True] * 4
            assert await client.get_into(NS, keys[:1], buffers[:1]) == [True]  # under the offload size
            assert await client.get_into(NS, keys, buffers) == [True] * 4
            assert [t.numpy().tobytes() for t in tensors] == [b[48:] for _, b in data]
            assert [bytes(b) for b in buffers] == [b[48:] for _, b in data]
            stats = await client.stats()
            assert (client._transport.arena.fallbacks, client._transport.shm.fallbacks) == (0, 0)
            seen = dict(wire)
            assert await client.get_many(NS, [os.urandom(16)]) == [None]  # a key RAM lacks: a Get, counted
            assert wire["get_calls"] == seen["get_calls"] + 1
        # On the wire: Put named only the segment's ranges (a few dozen bytes a block), no Get call.
        assert 0 < seen["put_message_bytes"] < 4 * 128 and seen["get_calls"] == 0
        assert (stats.shm_bytes_received, stats.inplace_bytes_received) == (total, total)  # every put byte
        assert (stats.shm_bytes_sent, stats.bulk_bytes_received, stats.bulk_bytes_sent) == (0, 0, 0)
        assert stats.inplace_bytes_leased == 4 * total + len(data[0][1])  # get_many, leased, three get_into
        assert (stats.arena_leases, stats.arena_reservations, stats.arena_reservations_reclaimed) == (0, 0, 0)

    asyncio.run(run())
    assert open_pins(arena_server) == (0, 0)


def test_keys_ram_lacks_come_the_ordinary_way_and_prefixes_stop_at_the_first_miss(
    arena_server: ServerThread,
) -> None:
    data = blocks(3, 256 << 10)
    keys = [k for k, _ in data]

    async def run() -> None:
        async with AsyncKVCacheClient(arena_server.target) as client:
            client.bulk.same_host_put_bytes = 0  # through a segment, into slots: counted below
            await client.put_many(NS, [data[0], data[2]])
            got = await client.get_many(NS, keys)
            assert [None if g is None else bytes(g) for g in got] == [data[0][1], None, data[2][1]]
            prefix = await client.get_many(NS, keys, prefix_only=True)
            assert [g is not None for g in prefix] == [True, False, False]
            async with client.leased(NS, keys) as views:
                assert [None if v is None else bytes(v) for v in views] == [data[0][1], None, data[2][1]]
            dst = [np.zeros(len(b) - 48, dtype=np.uint8) for _, b in data]
            assert await client.get_into(NS, keys, dst) == [True, False, True]
            assert not dst[1].any() and dst[2].tobytes() == data[2][1][48:]
            assert (await client.stats()).inplace_bytes_received == len(data[0][1]) + len(data[2][1])

    asyncio.run(run())
    assert open_pins(arena_server) == (0, 0)


def test_a_wrong_destination_or_an_exception_in_the_block_releases_the_leases(arena_server: ServerThread) -> None:
    data = blocks(2, 128 << 10)
    keys = [k for k, _ in data]

    async def run() -> None:
        async with AsyncKVCacheClient(arena_server.target) as client:
            client.bulk.same_host_get_bytes = 0  # this test is about leases: no get as one bulk GET
            client.bulk.read_in_place = False  # nor get_into's copies straight out of the arena
            await client.put_many(NS, data)
            with pytest.raises(ValueError, match="destination holds"):
                await client.get_into(NS, keys, [bytearray(10), bytearray(10)])
            with pytest.raises(TypeError, match="read-only"):
                await client.get_into(NS, keys[:1], [bytes(len(data[0][1]) - 48)])
            with pytest.raises(RuntimeError, match="boom"):
                async with client.leased(NS, keys):
                    assert open_pins(arena_server) == (2, 0)
                    raise RuntimeError("boom")
            assert open_pins(arena_server) == (0, 0)

    asyncio.run(run())


def test_without_a_shared_arena_the_async_sdk_uses_segments(make_server, tmp_path: Path) -> None:
    """The arena is the server's private memory: gets come through per-call segments; puts still
    go through the client's segment, which the server reads straight into slots of that arena."""
    server: ServerThread = make_server(shm={"dir": str(tmp_path / "shm"), "share_arena": False})
    data = blocks(2, 512 << 10)
    keys = [k for k, _ in data]
    total = sum(len(b) for _, b in data)

    async def run() -> None:
        async with AsyncKVCacheClient(server.target) as client:
            assert (await client.put_many(NS, data)).stored == 2
            assert client._transport.arena.state == "off"
            assert client._transport.shm.on
            assert [bytes(b) for b in await client.get_many(NS, keys)] == [b for _, b in data]
            async with client.leased(NS, keys) as views:
                assert [bytes(v) for v in views] == [b for _, b in data]
            buffers = [bytearray(len(b) - 48) for _, b in data]
            assert await client.get_into(NS, keys, buffers) == [True, True]
            assert [bytes(b) for b in buffers] == [b[48:] for _, b in data]
            stats = await client.stats()
            assert (client._transport.arena.fallbacks, client._transport.shm.fallbacks) == (0, 0)
        assert (stats.shm_bytes_received, stats.inplace_bytes_received) == (total, total)  # the put, into slots
        assert stats.inplace_bytes_leased == 0  # nothing leased: the arena is not shared
        assert stats.shm_bytes_sent == 3 * total  # get_many, leased, get_into
        assert (stats.arena_leases, stats.arena_reservations) == (0, 0)

    asyncio.run(run())


def test_a_full_arena_sends_the_put_the_ordinary_way(make_server, tmp_path: Path) -> None:
    """With no slot to reserve (a lease pins the arena), the server reads the put's blocks out of the
    segment into its own memory and puts them the ordinary way; RAM refuses them while the pin
    lasts. No call of the SDK goes another way: a put never uses the arena itself."""
    server: ServerThread = make_server(ram={"capacity_bytes": 8 * MiB}, shm={"dir": str(tmp_path / "shm")})
    (pinned,) = blocks(1, 7 * MiB)
    (item,) = blocks(1, 2 * MiB)

    async def run() -> None:
        async with AsyncKVCacheClient(server.target) as client:
            await client.put_many(NS, [pinned])
            async with client.leased(NS, [pinned[0]]):  # the arena is pinned: a 2 MiB put cannot be reserved
                result = await client.put_many(NS, [item])
                assert (result.stored, result.rejected) == (0, 1)
                arena, shm = client._transport.arena, client._transport.shm
                assert (arena.fallbacks, arena.state, shm.fallbacks, shm.state) == (0, "on", 0, "on")
                stats = await client.stats()
                assert stats.shm_bytes_received == len(pinned[1]) + len(item[1])  # both out of the segment
                assert stats.inplace_bytes_received == len(pinned[1])  # only the first into a slot
                assert stats.arena_reservations == 0
            assert (await client.put_many(NS, [item])).stored == 1  # unpinned: into a slot, the old one evicted
            stats = await client.stats()
            assert stats.inplace_bytes_received == len(pinned[1]) + len(item[1])

    asyncio.run(run())
    assert open_pins(server) == (0, 0)


def test_a_client_with_shm_off_uses_no_arena(arena_server: ServerThread) -> None:
    (item,) = blocks(1, MiB)

    async def run() -> None:
        async with AsyncKVCacheClient(arena_server.target, shm=False) as client:
            await client.put_many(NS, [item])
            assert [bytes(b) for b in await client.get_many(NS, [item[0]])] == [item[1]]
            async with client.leased(NS, [item[0]]) as views:
                assert [bytes(v) for v in views] == [item[1]]
            assert client._transport.arena.state == "off"
            stats = await client.stats()
            assert (stats.inplace_bytes_received, stats.inplace_bytes_leased) == (0, 0)
            assert (stats.shm_bytes_received, stats.shm_bytes_sent) == (0, 0)

    asyncio.run(run())


def test_a_restarted_server_has_a_new_arena_and_the_async_client_maps_it(make_server, tmp_path: Path) -> None:
    """The restarted server (here of another capacity) has a new arena file: a put does not touch
    the arena, and the first lease names the new one, which the client maps at its own size."""
    shm = {"dir": str(tmp_path / "shm")}
    first: ServerThread = make_server(ram={"capacity_bytes": 16 * MiB}, shm=shm)
    port = first.running.port
    data = blocks(2, 256 << 10)

    async def run() -> None:
        async with AsyncKVCacheClient(first.target, timeout_s=30) as client:
            await client.put_many(NS, data[:1])
            async with client.leased(NS, [data[0][0]]) as views:
                assert [bytes(v) for v in views] == [data[0][1]]
            link = client._transport.arena
            old = link.path
            assert (link.state, link.size) == ("on", 16 * MiB)
            await asyncio.to_thread(first.stop)
            assert not os.path.exists(old)
            second: ServerThread = await asyncio.to_thread(
                make_server, server={"port": port}, ram={"capacity_bytes": 24 * MiB}, shm=shm
            )
            assert (await client.put_many(NS, data[1:])).stored == 1  # read into a slot of the new arena
            assert link.path == old  # the put named no arena: it went through the client's segment
            assert [bytes(b) for b in await client.get_many(NS, [data[1][0]])] == [data[1][1]]
            new = second.stack.ram.region.path
            assert new != old and (link.path, link.state, link.size) == (new, "on", 24 * MiB)
            assert await client.get_many(NS, [data[0][0]]) == [None]  # the old server's RAM is gone
            stats = await client.stats()
            size = len(data[1][1])
            assert (stats.shm_bytes_received, stats.inplace_bytes_received, stats.inplace_bytes_leased) == (size,) * 3
            assert link.fallbacks == 0
        assert open_pins(second) == (0, 0)

    asyncio.run(run())


def test_cancelled_and_timed_out_calls_leave_no_pin_and_every_read_is_exact(arena_server: ServerThread) -> None:
    """Deadlines of a few ms and task.cancel() at random points of puts, gets, leased blocks and
    get_into, concurrently. Leases last 60 s on this server and the server's reservations for puts
    never expire (their owner abandons them), so one left open would still be counted at the end;
    then every block reads back exactly."""
    logging.getLogger("kvcache_client").setLevel(logging.CRITICAL)
    rng = random.Random(14)
    stored = blocks(12, 256 << 10)
    expected = dict(stored)
    keys = [k for k, _ in stored]
    counts = {"ok": 0, "ended": 0, "wrong": 0, "blocks": 0}

    def check(got_keys: list[bytes], got: list[memoryview | None]) -> None:
        for k, b in zip(got_keys, got, strict=True):
            if b is not None:
                counts["blocks"] += 1
                counts["wrong"] += bytes(b) != expected[k]

    async def one(client: AsyncKVCacheClient, i: int) -> None:
        order = rng.sample(keys, 6)
        t = rng.uniform(0.001, 0.005) if i % 2 else rng.uniform(0.005, 0.060)
        kind = i % 4
        if kind == 0:
            fresh = blocks(3, (128 << 10) if i % 8 else (512 << 10))  # 1.5 MiB: copied in by a thread
            await client.put_many(NS, fresh, timeout_s=t)
        elif kind == 1:
            check(order, await client.get_many(NS, order, timeout_s=t))
        elif kind == 2:
            async with client.leased(NS, order, timeout_s=t) as views:
                await asyncio.sleep(0)
                check(order, views)
        else:
            dst = [bytearray(len(expected[k]) - 48) for k in order]
            found = await client.get_into(NS, order, dst, timeout_s=t)
            for k, f, d in zip(order, found, dst, strict=True):
                if f and bytes(d) != expected[k][48:]:
                    counts["wrong"] += 1

    async def attempt(client: AsyncKVCacheClient, i: int) -> None:
        task = asyncio.ensure_future(one(client, i))
        if i % 3 == 0:  # cancelled from outside at a random point, before or after its deadline
            await asyncio.sleep(rng.uniform(0, 0.010))
            task.cancel()
        try:
            await task
            counts["ok"] += 1
        except (KVCacheError, asyncio.CancelledError):
            counts["ended"] += 1

    async def run() -> None:
        async with AsyncKVCacheClient(arena_server.target, timeout_s=30) as client:
            await client.put_many(NS, stored)
            for start in range(0, 400, 8):
                await asyncio.gather(*(attempt(client, i) for i in range(start, start + 8)))
            # The threads of cancelled callers' bulk calls (a PUT's slots are the server's until its
            # request ends) and the in-place cleanups of the last calls, each with its own deadline.
            await client._transport.drain()
            assert await settled_pins(arena_server) == (0, 0)
            check(keys, await client.get_many(NS, keys))
            async with client.leased(NS, keys) as views:
                check(keys, views)
                assert all(v is not None for v in views)
            dst = [bytearray(len(expected[k]) - 48) for k in keys]
            assert await client.get_into(NS, keys, dst) == [True] * len(keys)
            assert [bytes(d) for d in dst] == [expected[k][48:] for k in keys]
            assert client._transport.arena.state == "on"
        assert open_pins(arena_server) == (0, 0)
        assert counts["wrong"] == 0 and client.corrupt_blocks == 0
        assert counts["ended"] > 0 and counts["ok"] > 0 and counts["blocks"] > 0, counts

    asyncio.run(run())
    stats = arena_server.stack.ram.arena_stats()
    assert (stats["leases"], stats["reservations"]) == (0, 0)


def test_answers_that_come_after_the_caller_stopped_waiting_have_their_pins_handed_back(
    arena_server: ServerThread,
) -> None:
    """The server answers LeaseGet (pinning slots) only after each caller's deadline passed or its
    task was cancelled: every lease is handed back once the answer arrives. A put past its deadline
    leaves nothing pinned either: the client holds no slot, and the server's own reservations for a
    put are abandoned by the server however the call ends."""
    data = blocks(4, 256 << 10)
    keys = [k for k, _ in data]
    total = sum(len(b) for _, b in data)

    async def cancelled(coro) -> None:
        task = asyncio.ensure_future(coro)
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    async def leased_block(client: AsyncKVCacheClient) -> None:
        async with client.leased(NS, keys):
            raise AssertionError("cancelled before its leases came")

    async def run() -> None:
        # bulk=False: LeaseGet over gRPC, which a blocked event loop holds back (the LEASE frames'
        # case, answered without the loop: tests/test_bulk_lease.py, a stopped server process).
        async with AsyncKVCacheClient(arena_server.target, timeout_s=30, bulk=False) as client:
            await client.put_many(NS, data)
            inplace = client._transport.inner._inplace
            arena_server.loop.call_soon_threadsafe(time.sleep, 0.5)  # the server answers nothing for 0.5 s
            await asyncio.sleep(0.05)
            with pytest.raises(DeadlineExceeded, match="LeaseGet"):
                await client.get_many(NS, keys, timeout_s=0.02)
            late = blocks(2, 256 << 10)
            with pytest.raises(DeadlineExceeded):
                await client.put_many(NS, late, timeout_s=0.02)
            await cancelled(client.get_into(NS, keys, [bytearray(len(b) - 48) for _, b in data]))
            await cancelled(leased_block(client))
            await inplace.drain()  # the answers came, and their cleanups ran
            assert inplace.handed_back == 3  # the three LeaseGets; a put pins nothing for the client
            assert open_pins(arena_server) == (0, 0)
            stats = await client.stats()
            assert stats.inplace_bytes_leased == 3 * total  # the server did lease them, three times
            # The late put stored nothing: its segment was retired before the server could read it.
            assert (stats.shm_bytes_received, stats.inplace_bytes_received) == (total, total)
            assert (await client.lookup(NS, [k for k, _ in late])).prefix_length == 0
            assert (stats.arena_reservations, stats.arena_reservations_reclaimed) == (0, 0)
            assert [bytes(b) for b in await client.get_many(NS, keys)] == [b for _, b in data]
        assert open_pins(arena_server) == (0, 0)

    asyncio.run(run())
