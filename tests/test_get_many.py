"""get_many and get_tensors: one copy (same host, out of the server's arena) or one receive (remote,
the bulk port) into a buffer of the client's pool, verified where it lands (docs/arena.md's trust
model), handed to the caller, and reused only once no caller reaches it (kvcache_client.bufpool).
A remote get_into: each payload received straight into the caller's destination, verified there.

Against real servers: the blocks' bytes, the pool's exact counts (`reused`, `allocated`), the leases
the server saw released, and what a change in the arena between the lease and the copy becomes.
"""

from __future__ import annotations

import asyncio
import gc
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvcache_client import AsyncKVCacheClient, KVCacheClient
from kvcache_client.arena import InPlaceCalls
from kvcache_client.arena_aio import AsyncInPlaceCalls
from kvcache_client.bufpool import BufferPool
from kvcache_client.inplace_core import Leased
from tests.conftest import ServerThread, raw_block

pytestmark = pytest.mark.timeout(120)

NS = "ns"
MiB = 1 << 20
SIZE = 2 * MiB  # pooled (MIN_POOLED_BYTES is 1 MiB)


def blocks(n: int, size: int = SIZE) -> list[tuple[bytes, bytes]]:
    out = []
    for _ in range(n):
        k = os.urandom(16)
        out.append((k, raw_block(k, os.urandom(size))))
    return out


@pytest.fixture
def arena_server(make_server, tmp_path: Path) -> ServerThread:
    return make_server(ram={"capacity_bytes": 64 * MiB, "lease_timeout_s": 60.0}, shm={"dir": str(tmp_path / "shm")})


@pytest.fixture
def bulk_server(make_server) -> ServerThread:
    return make_server(ram={"capacity_bytes": 64 * MiB}, shm={"enabled": False})


@pytest.fixture
def releases(arena_server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The live leases each LeaseRelease the server answers ends, in order."""
    ram = arena_server.stack.ram
    real = ram.release
    seen: list[int] = []

    def counted(ids: Any, tenant: str | None = None) -> int:
        n = real(ids, tenant)
        seen.append(n)
        return n

    monkeypatch.setattr(ram, "release", counted)
    return seen


def counts(pool: BufferPool) -> tuple[int, int]:
    return pool.reused, pool.allocated


class Face:
    """One client, blocking or asyncio, called the same way (the asyncio one on a loop of its own)."""

    def __init__(self, name: str, target: str, **kwargs: Any) -> None:
        self.name = name
        self._loop = asyncio.new_event_loop() if name == "asyncio" else None
        cls = AsyncKVCacheClient if name == "asyncio" else KVCacheClient
        self.client: Any = cls(target, timeout_s=30, **kwargs)

    def __call__(self, method: str, *args: Any, **kwargs: Any) -> Any:
        result = getattr(self.client, method)(*args, **kwargs)
        return self._loop.run_until_complete(result) if self._loop is not None else result

    def close(self) -> None:
        self("close")
        if self._loop is not None:
            self._loop.close()


@pytest.fixture(params=["blocking", "asyncio"])
def face(request: pytest.FixtureRequest) -> Iterator[Callable[..., Face]]:
    made: list[Face] = []

    def make(target: str, **kwargs: Any) -> Face:
        made.append(Face(request.param, target, **kwargs))
        return made[-1]

    yield make
    for f in made:
        f.close()


@pytest.mark.parametrize("in_place", [True, False], ids=["in_place", "leased"])
def test_same_host_blocks_land_in_warm_buffers_once_the_last_ones_were_dropped(
    arena_server: ServerThread, releases: list[int], face: Callable[..., Face], in_place: bool
) -> None:
    """Where the presence index locates every key, the blocks are copied straight out of the arena
    (no lease: docs/presence.md); with reads in place off, leased and copied out. Either way into
    the pool's warm buffers once the caller let the last ones go."""
    data = blocks(4)
    keys = [k for k, _ in data]
    c = face(arena_server.target)
    c.client.bulk.read_in_place = in_place
    c("put_many", NS, data)
    pool = c.client.buffers
    got = c("get_many", NS, keys)
    assert c.client._transport.arena.state == "on"
    assert [bytes(b) for b in got] == [b for _, b in data]
    assert all(b.readonly for b in got)
    assert counts(pool) == (0, 4) and pool.kept_bytes == 4 * len(data[0][1])
    del got  # the caller lets them go: the next call copies into the same, warm, memory
    got = c("get_many", NS, keys)
    assert [bytes(b) for b in got] == [b for _, b in data]
    assert counts(pool) == (4, 4)
    del got
    tensors = c("get_tensors", NS, keys)
    assert [t.numpy().tobytes() for t in tensors] == [b[48:] for _, b in data]
    assert counts(pool) == (8, 4) and pool.kept_bytes == 4 * len(data[0][1])
    # Every call leased each block once and handed every lease back, or leased none.
    assert releases == ([] if in_place else [4, 4, 4])
    assert c.client.presence.counters.read_in_place == (12 if in_place else 0)
    assert arena_server.stack.ram.arena_stats()["leases"] == 0
    assert c("stats").inplace_bytes_leased == 3 * sum(len(b) for _, b in data)


def test_a_block_the_caller_still_reaches_is_never_overwritten(arena_server: ServerThread) -> None:
    """Whatever the caller keeps of a block (the memoryview, a slice of it, a numpy array made from
    it, a tensor of get_tensors or a view of that tensor), its buffer is not lent again."""
    first, second = blocks(5), blocks(5)
    with KVCacheClient(arena_server.target) as client:
        client.put_many(NS, first + second)
        pool = client.buffers
        views = client.get_many(NS, [k for k, _ in first])
        tensors = client.get_tensors(NS, [k for k, _ in first])
        kept: list[Any] = [
            views[0],
            views[1][100:200],
            np.frombuffer(views[2], np.uint8)[48:],
            tensors[3],
            tensors[4].view(torch.int16)[8:],
        ]
        expect = [bytes(first[0][1]), first[1][1][100:200], first[2][1][48:], first[3][1][48:], first[4][1][64:]]
        del views, tensors
        gc.collect()
        assert counts(pool) == (0, 10)  # get_tensors ran while the views were held: memory of its own
        for _ in range(3):  # other blocks of the same size, three times: into the five buffers let go
            got = client.get_many(NS, [k for k, _ in second])
            assert [bytes(b) for b in got] == [b for _, b in second]
            del got
        assert counts(pool) == (15, 10)
        as_bytes = [
            bytes(kept[0]),
            bytes(kept[1]),
            kept[2].tobytes(),
            kept[3].numpy().tobytes(),
            kept[4].contiguous().view(torch.uint8).numpy().tobytes(),
        ]
        assert as_bytes == expect
        del kept, as_bytes
        client.get_many(NS, [k for k, _ in first])
        assert counts(pool) == (20, 10)  # let go: lent again


def test_bytes_changed_in_the_arena_between_the_lease_and_the_copy_are_a_miss(
    arena_server: ServerThread, releases: list[int], monkeypatch: pytest.MonkeyPatch, face: Callable[..., Face]
) -> None:
    """The check is where the bytes lie after the last copy: a block changed in its slot after the
    server leased it, before the SDK copies it out, is never returned as valid (a design that
    verified in the arena and copied after would hand it out)."""
    data = blocks(3)
    keys = [k for k, _ in data]
    c = face(arena_server.target)
    c.client.bulk.read_in_place = False  # the lease path (the copy straight out of the arena: below)
    c("put_many", NS, data)
    region = arena_server.stack.ram.region
    changed: list[int] = []

    def change_then_copy(real: Callable[..., Any]) -> Callable[..., Any]:
        def copy_out(self: Any, leased: Leased) -> Any:
            view = leased.blocks[1][0]  # the middle block, as leased: find its slot by its bytes
            offset = bytes(region.view).find(bytes(view[:4096]))
            region.view[offset + 5000 : offset + 5008] = b"\xa5" * 8
            changed.append(offset)
            return real(self, leased)

        return copy_out

    for cls in (InPlaceCalls, AsyncInPlaceCalls):
        monkeypatch.setattr(cls, "copy_out", change_then_copy(cls.copy_out))
    got = c("get_many", NS, keys)
    assert [None if b is None else bytes(b) for b in got] == [data[0][1], None, data[2][1]]
    assert c.client.corrupt_blocks == 1 and len(changed) == 1
    tensors = c("get_tensors", NS, keys)
    assert tensors[1] is None and c.client.corrupt_blocks == 2
    assert tensors[2].numpy().tobytes() == data[2][1][48:]
    assert releases == [3, 3]  # every lease of both calls handed back, the changed block's too
    assert arena_server.stack.ram.arena_stats()["leases"] == 0


def _third_take_fails(pool: BufferPool) -> list[int]:
    """pool.take patched (on the instance; `del pool.take` undoes it): the third take raises
    MemoryError. Returns the sizes asked for, in order."""
    real, taken = pool.take, []

    def fails_third(nbytes: int) -> np.ndarray:
        taken.append(nbytes)
        if len(taken) == 3:
            raise MemoryError("no room for the third block")
        return real(nbytes)

    pool.take = fails_third  # type: ignore[method-assign]
    return taken


def test_bytes_changed_in_a_located_slot_are_a_miss_read_in_place_or_not(
    arena_server: ServerThread, releases: list[int], face: Callable[..., Face]
) -> None:
    """A block changed in its slot while indexed there (the index unchanged: only a writer of the
    server's own user could do it) fails its checksum where it lands in the pool's buffer: the copies
    straight out of the arena are dropped (read_again), and the lease path the get then takes finds it
    damaged too: a miss, counted as corruption once, the other blocks exact."""
    data = blocks(3)
    keys = [k for k, _ in data]
    c = face(arena_server.target)
    c("put_many", NS, data)
    region = arena_server.stack.ram.region
    offset = bytes(region.view).find(data[1][1][:4096])
    region.view[offset + 5000 : offset + 5008] = b"\xa5" * 8
    got = c("get_many", NS, keys)
    assert [None if b is None else bytes(b) for b in got] == [data[0][1], None, data[2][1]]
    counters = c.client.presence.counters
    assert c.client.corrupt_blocks == 1 and counters.read_again == 1 and counters.read_in_place == 0
    assert releases == [3] and arena_server.stack.ram.arena_stats()["leases"] == 0


def test_a_copy_out_of_the_arena_that_fails_sends_nothing_and_holds_nothing(arena_server: ServerThread) -> None:
    """A buffer the pool cannot give (MemoryError) while get_many plans its copies straight out of
    the arena: raised, with no TOUCH sent and nothing leased; the buffers taken before it are the
    pool's again for the next call."""
    data = blocks(4)
    with KVCacheClient(arena_server.target) as client:
        client.put_many(NS, data)
        pool = client.buffers
        _third_take_fails(pool)
        with pytest.raises(MemoryError):
            client.get_many(NS, [k for k, _ in data])
        gc.collect()  # the traceback's frames
        assert arena_server.running.bulk.counters.get("touches") == 0
        assert arena_server.stack.ram.arena_stats()["leases"] == 0
        del pool.take
        assert [bytes(b) for b in client.get_many(NS, [k for k, _ in data])] == [b for _, b in data]
        assert counts(pool) == (2, 4) and client.presence.counters.read_in_place == 4


def test_a_copy_that_fails_hands_back_every_lease(arena_server: ServerThread, releases: list[int]) -> None:
    data = blocks(4)
    with KVCacheClient(arena_server.target) as client:
        client.bulk.read_in_place = False  # the lease path
        client.put_many(NS, data)
        pool = client.buffers
        taken = _third_take_fails(pool)
        with pytest.raises(MemoryError):
            client.get_many(NS, [k for k, _ in data])
        made = len(taken) - 1  # 2, or 3 when the copies ran on two threads (the other one went on)
        gc.collect()  # the traceback's frames
        assert releases == [4] and arena_server.stack.ram.arena_stats()["leases"] == 0
        del pool.take
        assert [bytes(b) for b in client.get_many(NS, [k for k, _ in data])] == [b for _, b in data]
        assert releases == [4, 4] and counts(pool) == (made, 4)  # the copies the failed call made, reused


def test_writes_through_a_tensor_change_only_the_callers_memory(arena_server: ServerThread) -> None:
    """get_tensors' tensors are the caller's: a write (torch does not refuse it) changes neither the
    server's block nor what a later call returns, even in the same, reused, buffer."""
    data = blocks(2)
    keys = [k for k, _ in data]
    with KVCacheClient(arena_server.target) as client:
        client.put_many(NS, data)
        tensors = client.get_tensors(NS, keys)
        for t in tensors:
            t.fill_(7)
        again = client.get_many(NS, keys)
        assert [bytes(b) for b in again] == [b for _, b in data]  # fresh buffers: the written ones are held
        with client.leased(NS, keys) as views:
            assert [bytes(v) for v in views] == [b for _, b in data]
        del tensors, again
        reused = client.buffers.reused
        assert [t.numpy().tobytes() for t in client.get_tensors(NS, keys)] == [b[48:] for _, b in data]
        assert client.buffers.reused == reused + 2  # the buffers the writes went into: overwritten whole


def test_remote_blocks_are_received_into_warm_buffers(bulk_server: ServerThread, face: Callable[..., Face]) -> None:
    data = blocks(4, 3 * MiB)
    keys = [k for k, _ in data]
    c = face(bulk_server.target, shm=False)
    c("put_many", NS, data)
    pool = c.client.buffers
    got = c("get_many", NS, keys)
    assert c.client.bulk.state == "on"
    assert [bytes(b) for b in got] == [b for _, b in data]
    assert counts(pool) == (0, 4)
    kept = got[0]
    del got
    tensors = c("get_tensors", NS, keys)
    assert [t.numpy().tobytes() for t in tensors] == [b[48:] for _, b in data]
    assert counts(pool) == (3, 5) and bytes(kept) == data[0][1]  # the one kept was not received into
    del tensors
    dst = [bytearray(len(b) - 48) for _, b in data]
    assert c("get_into", NS, keys, dst) == [True] * 4  # payloads received straight into dst: no pool buffer
    assert [bytes(d) for d in dst] == [b[48:] for _, b in data]
    assert counts(pool) == (3, 5)
    total = sum(len(b) for _, b in data)
    assert c.client.bulk.counters.bulk_bytes_received == 3 * total
    assert c.client.bulk.counters.bulk_bytes_landed == total
    assert c.client.corrupt_blocks == 0


def test_remote_get_into_receives_each_payload_into_its_destination(
    bulk_server: ServerThread, face: Callable[..., Face]
) -> None:
    """A remote get_into over the bulk port: each payload received straight into its destination
    (numpy, bytearray, a memoryview, a bf16 CPU tensor) and verified there, no pool buffer taken; a
    key not stored leaves its destination untouched."""
    data = blocks(4, 3 * MiB)
    keys = [k for k, _ in data] + [os.urandom(16)]
    c = face(bulk_server.target, shm=False)
    c("put_many", NS, data)
    before = counts(c.client.buffers)
    payload = 3 * MiB
    dst: list[Any] = [
        np.empty(payload, np.uint8),
        bytearray(payload),
        memoryview(bytearray(payload)),
        torch.empty(payload // 2, dtype=torch.bfloat16),
        bytearray(b"\xab" * payload),
    ]
    assert c("get_into", NS, keys, dst) == [True, True, True, True, False]
    landed = [bytes(dst[0]), bytes(dst[1]), bytes(dst[2]), dst[3].view(torch.uint8).numpy().tobytes()]
    assert landed == [b[48:] for _, b in data]
    assert dst[4] == b"\xab" * payload
    assert counts(c.client.buffers) == before
    assert c.client.bulk.counters.bulk_bytes_landed == sum(len(b) for _, b in data)
    assert c.client.bulk.counters.fallbacks == 0 and c.client.corrupt_blocks == 0


def test_remote_get_into_refuses_what_lands_damaged_and_what_does_not_fit(
    bulk_server: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A payload changed as it lands (a bit flipped on the way) is a miss, counted; a block whose
    header is damaged is a miss whose destination is untouched; a destination of another size, or a
    non-contiguous tensor, is refused as before (ValueError); the next get lands every block."""
    from kvcache_client.bulkconn import BulkConnection

    data = blocks(3, 3 * MiB)
    keys = [k for k, _ in data]
    real = BulkConnection.recv
    damage: dict[str, int] = {}

    def flips(self: BulkConnection, view: memoryview, what: str, deadline: float) -> None:
        real(self, view, what, deadline)
        if damage.pop(what, None) is not None:
            np.frombuffer(view, np.uint8)[len(view) // 2] ^= 1

    def fresh() -> list[bytearray]:
        return [bytearray(b"\xcd" * (3 * MiB)) for _ in keys]

    with KVCacheClient(bulk_server.target, shm=False, bulk_connections=1) as client:  # indices as in `keys`
        client.put_many(NS, data)
        monkeypatch.setattr(BulkConnection, "recv", flips)
        damage.update({"block 1": 1, "block 2's header": 1})
        dst = fresh()
        assert client.get_into(NS, keys, dst) == [True, False, False]
        assert bytes(dst[0]) == data[0][1][48:] and client.corrupt_blocks == 2
        assert dst[2] == b"\xcd" * (3 * MiB)  # its header failed: its payload was read elsewhere
        assert not damage
        monkeypatch.setattr(BulkConnection, "recv", real)
        dst = fresh()
        assert client.get_into(NS, keys, dst) == [True] * 3
        assert [bytes(d) for d in dst] == [b[48:] for _, b in data]
        with pytest.raises(ValueError, match="destination holds"):
            client.get_into(NS, keys, [*fresh()[:2], bytearray(3 * MiB - 1)])
        with pytest.raises(ValueError, match="contiguous"):
            client.get_into(NS, keys[:1], [torch.empty(2, 3 * MiB // 2, dtype=torch.uint8).t()])
        assert client.corrupt_blocks == 2 and client.bulk.counters.fallbacks == 0


def test_remote_get_into_of_small_blocks_refuses_what_lands_damaged(
    bulk_server: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks small enough to come out of the connection's read-ahead whole (BulkConnection._land_whole)
    keep _land's outcomes: a payload damaged on the way is a miss whose destination holds what
    arrived, a damaged header a miss whose destination is untouched, and the stream stays in step:
    the block after each lands, and so does every block of the next get."""
    from kvcache_client.bulkconn import BulkConnection

    size = 16 << 10
    data = blocks(4, size)
    keys = [k for k, _ in data]
    real = BulkConnection._buffered
    damage: dict[str, int] = {}  # what -> byte offset in the frame to flip
    seen: list[str] = []

    def flips(self: BulkConnection, n: int, what: str, deadline: float) -> memoryview | None:
        view = real(self, n, what, deadline)
        if view is not None and what.startswith("block"):
            seen.append(what)
            at = damage.pop(what, None)
            if at is not None:
                view[at if at >= 0 else len(view) + at] ^= 1
        return view

    def fresh() -> list[bytearray]:
        return [bytearray(b"\xcd" * size) for _ in keys]

    with KVCacheClient(bulk_server.target, shm=False, bulk_connections=1) as client:
        client.put_many(NS, data)
        monkeypatch.setattr(BulkConnection, "_buffered", flips)
        damage.update({"block 1": -100, "block 2": 0})  # a payload byte; the header's magic
        dst = fresh()
        assert client.get_into(NS, keys, dst) == [True, False, False, True]
        assert seen == [f"block {i}" for i in range(4)] and not damage  # all four came whole
        assert bytes(dst[0]) == data[0][1][-size:] and bytes(dst[3]) == data[3][1][-size:]
        changed = bytearray(data[1][1][-size:])
        changed[-100] ^= 1
        assert dst[1] == changed  # what arrived, refused
        assert dst[2] == b"\xcd" * size  # its header failed: untouched
        assert client.corrupt_blocks == 2
        dst = fresh()
        assert client.get_into(NS, keys, dst) == [True] * 4
        assert [bytes(d) for d in dst] == [b[-size:] for _, b in data]
        assert client.corrupt_blocks == 2 and client.bulk.counters.fallbacks == 0


def test_pure_grpc_get_into_copies_each_part_into_its_destination(
    bulk_server: ServerThread, face: Callable[..., Face]
) -> None:
    """Without the bulk port (bulk=False: a client in another language starts there) get_into copies
    each GetResponse part straight into its destination and verifies it there: blocks sent in parts
    (over 4 MiB) and whole, exact bytes, no pool buffer, a missing key's destination untouched."""
    data = blocks(2, 6 * MiB) + blocks(3, 64 << 10)
    keys = [k for k, _ in data] + [os.urandom(16)]
    c = face(bulk_server.target, shm=False, bulk=False)
    c("put_many", NS, data)
    before = counts(c.client.buffers)
    dst: list[Any] = [np.empty(len(b) - 48, np.uint8) for _, b in data[:4]]
    dst += [torch.empty((len(data[4][1]) - 48) // 2, dtype=torch.bfloat16), bytearray(b"\xab" * 100)]
    assert c("get_into", NS, keys, dst) == [True] * 5 + [False]
    landed = [bytes(d) for d in dst[:4]] + [dst[4].view(torch.uint8).numpy().tobytes()]
    assert landed == [b[48:] for _, b in data]
    assert dst[5] == b"\xab" * 100 and counts(c.client.buffers) == before
    assert c.client.bulk.counters.grpc_bytes_received == sum(len(b) for _, b in data)
    assert c.client.bulk.counters.bulk_bytes_received == 0 and c.client.corrupt_blocks == 0


def test_pure_grpc_get_into_refuses_a_part_damaged_on_the_way(bulk_server: ServerThread) -> None:
    """A part of a 6 MiB block changed in transit: that block is a miss (counted), the others land
    exact; a whole small block changed: a miss; the next get lands all of them."""
    from dataclasses import replace

    data = blocks(2, 6 * MiB) + blocks(1, 64 << 10)
    keys = [k for k, _ in data]
    with KVCacheClient(bulk_server.target, shm=False, bulk=False) as client:
        client.put_many(NS, data)
        inner = client._transport.inner
        real = inner._get
        seen = {"parts": 0}

        def damaging(request: Any, **kwargs: Any) -> Any:
            for items in real(request, **kwargs):
                out = []
                for item in items:
                    seen["parts"] += item.index == 0
                    if (item.index == 0 and seen["parts"] == 3) or item.index == 2:
                        raw = bytearray(item.data)
                        raw[len(raw) // 2] ^= 1
                        item = replace(item, data=memoryview(bytes(raw)))
                    out.append(item)
                yield out

        inner._get = damaging
        dst = [bytearray(len(b) - 48) for _, b in data]
        assert client.get_into(NS, keys, dst) == [False, True, False]
        assert bytes(dst[1]) == data[1][1][48:] and client.corrupt_blocks == 2
        assert seen["parts"] == 7  # 6 MiB and its header, in parts of 1 MiB
        inner._get = real
        assert client.get_into(NS, keys, dst) == [True] * 3
        assert [bytes(d) for d in dst] == [b[48:] for _, b in data]


def test_a_cancelled_asyncio_get_into_writes_nothing_after_it_returned(
    bulk_server: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The asyncio face's remote get_into receives in a worker thread straight into the caller's
    destinations: a task cancelled meanwhile returns only once that thread stopped writing (with a
    thread left running, the caller would reuse buffers still being written)."""
    import time

    from kvcache_client.bulkconn import BulkConnection

    data = blocks(2, 3 * MiB)
    keys = [k for k, _ in data]
    real = BulkConnection.recv
    writes: list[float] = []

    def slow(self: BulkConnection, view: memoryview, what: str, deadline: float) -> None:
        if what.startswith("block"):
            time.sleep(0.05)
        real(self, view, what, deadline)
        writes.append(time.monotonic())

    async def main() -> None:
        async with AsyncKVCacheClient(bulk_server.target, shm=False, bulk_connections=1, timeout_s=30) as client:
            await client.put_many(NS, data)
            dst = [bytearray(3 * MiB) for _ in keys]
            assert await client.get_into(NS, keys, dst) == [True, True]
            monkeypatch.setattr(BulkConnection, "recv", slow)
            writes.clear()
            task = asyncio.create_task(client.get_into(NS, keys, dst))
            while not writes:
                await asyncio.sleep(0.005)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            returned = time.monotonic()
            seen = len(writes)
            await asyncio.sleep(0.3)
            assert len(writes) == seen and max(writes) <= returned
            monkeypatch.setattr(BulkConnection, "recv", real)
            assert await client.get_into(NS, keys, dst) == [True, True]

    asyncio.run(main())


def test_a_block_damaged_on_the_wire_is_a_miss_and_its_buffer_is_reused(
    bulk_server: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A remote block is verified in the buffer it was received into: one changed after the receive
    (as a bit flipped on the way would be) is a miss, never returned as valid."""
    from kvcache_client.bulkconn import BulkConnection

    data = blocks(2, 3 * MiB)
    keys = [k for k, _ in data]
    real = BulkConnection.recv

    def flips(self: BulkConnection, view: memoryview, what: str, deadline: float) -> None:
        real(self, view, what, deadline)
        if what == "block 1":
            np.frombuffer(view, np.uint8)[4000] ^= 1

    with KVCacheClient(bulk_server.target, shm=False, bulk_connections=1) as client:  # indices as in `keys`
        client.put_many(NS, data)
        monkeypatch.setattr(BulkConnection, "recv", flips)
        got = client.get_many(NS, keys)
        assert bytes(got[0]) == data[0][1] and got[1] is None and client.corrupt_blocks == 1
        del got
        monkeypatch.setattr(BulkConnection, "recv", real)
        assert [bytes(b) for b in client.get_many(NS, keys)] == [b for _, b in data]
        assert counts(client.buffers) == (2, 2)


def test_without_a_pool_every_block_gets_fresh_memory(arena_server: ServerThread) -> None:
    data = blocks(2)
    with KVCacheClient(arena_server.target, buffer_pool_bytes=0) as client:
        client.put_many(NS, data)
        for _ in range(2):
            assert [bytes(b) for b in client.get_many(NS, [k for k, _ in data])] == [b for _, b in data]
        assert counts(client.buffers) == (0, 4) and client.buffers.kept_bytes == 0
    with pytest.raises(ValueError):
        KVCacheClient(arena_server.target, buffer_pool_bytes=-1)


# -- the pool on its own -----------------------------------------------------------------------------


def test_the_pool_keeps_at_most_its_capacity_and_lets_free_buffers_of_other_sizes_go() -> None:
    pool = BufferPool(3 * MiB)
    held = [pool.take(MiB) for _ in range(4)]
    assert pool.kept_bytes == 3 * MiB and counts(pool) == (0, 4)  # the fourth is the caller's alone
    del held
    two = pool.take(2 * MiB)  # two free 1 MiB buffers go to make room
    assert pool.kept_bytes == 3 * MiB and counts(pool) == (0, 5)
    one = pool.take(MiB)
    assert counts(pool) == (1, 5)
    assert pool.take(MiB) is not one and counts(pool) == (1, 6)  # the kept one is lent: fresh, not kept
    assert pool.kept_bytes == 3 * MiB
    assert pool.take(4 * MiB).nbytes == 4 * MiB and pool.kept_bytes == 3 * MiB  # over the cap: never kept
    assert pool.take(100).nbytes == 100 and pool.kept_bytes == 3 * MiB  # under the minimum: never kept
    pool.clear()
    assert pool.kept_bytes == 0
    two[:] = 1  # still the caller's
    assert one.flags.writeable


def test_the_pool_scans_a_bounded_number_of_lent_buffers() -> None:
    """A caller that holds every block costs each take a scan of at most SCAN buffers, and the free
    ones among many lent ones are found within a few takes."""
    from kvcache_client.bufpool import SCAN

    pool = BufferPool(256 * MiB)
    held = [pool.take(MiB) for _ in range(4 * SCAN)]
    free = held.pop(3 * SCAN)  # one free buffer behind 3 * SCAN lent ones
    free_id = id(free)
    del free
    found = [id(pool.take(MiB)) for _ in range(4)]
    assert free_id in found and counts(pool) == (1, 4 * SCAN + 3)
    assert all(pool.take(MiB) is not h for h in held)


def test_a_large_block_refused_before_its_payload_is_read_keeps_the_bulk_stream_in_step(
    bulk_server: ServerThread,
) -> None:
    """A block whose header reads but is refused before its payload lands (here: it says compressed,
    which a GET never sends) is a miss whose destination is untouched, and the stream stays in step:
    the block after it lands and the call never leaves the bulk port (on the old code its payload was
    left unread, the next frame header was read out of it, and the call fell back to gRPC)."""
    data = blocks(3, MiB)
    keys = [k for k, _ in data]
    with KVCacheClient(bulk_server.target, shm=False, bulk_connections=1) as client:
        client.put_many(NS, data)
        ram = bulk_server.stack.ram
        (lease,) = ram.lease_many("ns", [keys[1]])
        assert lease is not None
        ram.release([lease.id])
        ram.region.view[lease.offset + 10] = 1  # Compression.LZ4
        dst = [bytearray(b"\xcd" * MiB) for _ in keys]
        assert client.get_into(NS, keys, dst) == [True, False, True]
        assert bytes(dst[0]) == data[0][1][-MiB:] and bytes(dst[2]) == data[2][1][-MiB:]
        assert dst[1] == b"\xcd" * MiB
        assert client.corrupt_blocks == 1 and client.bulk.counters.fallbacks == 0
