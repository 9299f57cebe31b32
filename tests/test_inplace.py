"""Same-host in-place transfers through the server's block arena (docs/arena.md, docs/shm.md).

put: the SDK writes its blocks into a segment of its own and Put names their ranges; the server
preads each block straight into an arena slot it reserved itself, verifies the key-bound checksum
in the slot and commits the slot without a copy. No client is ever handed a writable slot
(ArenaReserve and ArenaCommit answer FAILED_PRECONDITION); the arena file is 0400 and the SDK maps
it read-only.
get: lease -> verify -> read in place or copy once -> release."""

from __future__ import annotations

import math
import os
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from kvcache_client import DataCorrupted, KVCacheClient
from kvcache_client.arena import ArenaLink
from kvcache_client.shm import Segment
from kvcache_core.errors import ChecksumMismatch
from kvcache_core.format import encode_block, payload_view, verify_copy
from kvcache_proto import kvcache_pb2 as pb
from kvcache_proto import kvcache_pb2_grpc as pb_grpc
from tests.backends import wait_for
from tests.conftest import ServerThread, raw_block

pytestmark = pytest.mark.timeout(120)

NS = "ns"
REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20
WITHDRAWN = "in-place writes into the block arena are withdrawn"


@pytest.fixture
def arena_server(make_server, tmp_path: Path) -> ServerThread:
    return make_server(ram={"capacity_bytes": 64 * MiB, "lease_timeout_s": 2.0}, shm={"dir": str(tmp_path / "shm")})


def blocks(n: int, size: int) -> list[tuple[bytes, bytes]]:
    out = []
    for _ in range(n):
        k = os.urandom(16)
        out.append((k, raw_block(k, os.urandom(size))))
    return out


def stub(server: ServerThread) -> pb_grpc.KVCacheStub:
    return pb_grpc.KVCacheStub(grpc.insecure_channel(server.target))


def slots(data: list[tuple[bytes, bytes]]) -> int:
    """Arena bytes the blocks' slots take (64-byte aligned)."""
    return sum((len(b) + 63) // 64 * 64 for _, b in data)


def count_grpc_block_traffic(client: KVCacheClient) -> dict[str, int]:
    """Counts what the client's gRPC transport sends as Put messages (their bytes) and how many Get
    calls it makes: the calls that would carry block bytes over gRPC."""
    inner = client._transport.inner
    counts = {"put_message_bytes": 0, "get_calls": 0}
    put, get = inner._put, inner._get

    def counted(messages: Iterator[bytes]) -> Iterator[bytes]:
        for message in messages:
            counts["put_message_bytes"] += len(message)
            yield message

    def counted_get(request: pb.GetRequest, **kwargs: object) -> object:
        counts["get_calls"] += 1
        return get(request, **kwargs)

    inner._put = lambda messages, **kwargs: put(counted(messages), **kwargs)
    inner._get = counted_get
    return counts


def test_the_arena_is_advertised_as_an_owner_only_file_of_the_server(arena_server: ServerThread) -> None:
    info = stub(arena_server).Info(pb.InfoRequest(), timeout=5)
    st = os.stat(info.arena_path)
    assert Path(info.arena_path).parent == Path(info.shm_dir)
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_size) == (0o400, os.geteuid(), info.arena_bytes)
    assert info.arena_bytes == 64 * MiB


def test_puts_and_gets_move_no_byte_through_grpc(arena_server: ServerThread) -> None:
    """Puts: the server reads the SDK's segment straight into arena slots (counted in both
    shm_bytes_received and inplace_bytes_received); gets: leased views of those slots."""
    data = blocks(4, 2 * MiB)
    keys = [k for k, _ in data]
    total = sum(len(b) for _, b in data)
    with KVCacheClient(arena_server.target) as client:
        client.bulk.same_host_get_bytes = 0  # this test is about leases: no get as one bulk GET
        client.bulk.read_in_place = False  # nor get_into's copies straight out of the arena
        wire = count_grpc_block_traffic(client)
        result = client.put_many(NS, data)
        assert (result.stored, result.bytes_sent) == (4, total)
        assert client._transport.arena.state == "on"
        assert arena_server.stack.ram.arena_stats()["reservations"] == 0  # each slot committed
        assert [bytes(b) for b in client.get_many(NS, keys)] == [b for _, b in data]
        with client.leased(NS, keys) as views:
            assert [bytes(v) for v in views] == [b for _, b in data]
            assert all(v.readonly for v in views)
            assert client.stats().arena_leases == 4  # held while the block runs
        with pytest.raises(ValueError):
            bytes(views[0])  # released with the block
        tensors = [torch.empty(len(b) - 48, dtype=torch.uint8) for _, b in data]
        buffers = [bytearray(len(b) - 48) for _, b in data]
        assert client.get_into(NS, keys, tensors) == [True] * 4
        assert client.get_into(NS, keys, buffers) == [True] * 4
        assert [t.numpy().tobytes() for t in tensors] == [b[48:] for _, b in data]
        assert [bytes(b) for b in buffers] == [b[48:] for _, b in data]
        stats = client.stats()
        arena, shm = client._transport.arena, client._transport.shm
        assert (arena.fallbacks, shm.fallbacks) == (0, 0)  # no call went another way
        seen = dict(wire)
        assert client.get_many(NS, [os.urandom(16)]) == [None]  # a key RAM lacks: a Get, counted
        assert wire["get_calls"] == seen["get_calls"] + 1
    # On the wire: no gRPC Put (the put's ranges went as a PUT_MEM frame on the bulk port: a few dozen
    # bytes a block, read out of this process by the server), no Get call.
    assert seen["put_message_bytes"] == 0 and seen["get_calls"] == 0
    assert (stats.shm_bytes_received, stats.inplace_bytes_received) == (total, total)  # every put byte
    assert (stats.shm_bytes_sent, stats.bulk_bytes_received, stats.bulk_bytes_sent) == (0, 0, 0)
    assert stats.inplace_bytes_leased == 4 * total  # get_many, leased, two get_into
    assert (stats.arena_leases, stats.arena_reservations) == (0, 0)  # every lease released
    assert stats.arena_reservations_reclaimed == 0
    ram = arena_server.stack.ram
    # The server's reservations became the blocks' slots: nothing else was allocated.
    assert ram.arena_stats()["free_bytes"] == ram.region.size - slots(data)


def test_keys_ram_lacks_come_the_ordinary_way_and_prefixes_stop_at_the_first_miss(
    arena_server: ServerThread,
) -> None:
    data = blocks(3, 256 << 10)
    keys = [k for k, _ in data]
    with KVCacheClient(arena_server.target) as client:
        client.put_many(NS, [data[0], data[2]])
        got = client.get_many(NS, keys)
        assert [None if g is None else bytes(g) for g in got] == [data[0][1], None, data[2][1]]
        assert [g is not None for g in client.get_many(NS, keys, prefix_only=True)] == [True, False, False]
        dst = [np.zeros(len(b) - 48, dtype=np.uint8) for _, b in data]
        assert client.get_into(NS, keys, dst) == [True, False, True]
        assert not dst[1].any()
        assert client.stats().arena_leases == 0


def test_a_wrong_destination_fails_the_call_and_releases_its_leases(arena_server: ServerThread) -> None:
    data = blocks(2, 128 << 10)
    with KVCacheClient(arena_server.target) as client:
        client.put_many(NS, data)
        with pytest.raises(ValueError, match="destination holds"):
            client.get_into(NS, [k for k, _ in data], [bytearray(10), bytearray(10)])
        with pytest.raises(TypeError, match="read-only"):
            client.get_into(NS, [data[0][0]], [bytes(len(data[0][1]) - 48)])
        assert client.stats().arena_leases == 0


_FLOOD = """
import os, sys
from kvcache_client import KVCacheClient
from tests.conftest import raw_block
c = KVCacheClient(sys.argv[1])
for i in range(int(sys.argv[2])):
    items = []
    for _ in range(4):
        k = os.urandom(16)
        items.append((k, raw_block(k, os.urandom(1 << 20))))
    c.put_many("ns", items)
print(c.stats().tier("ram").evictions)
"""


def test_a_reader_holding_leases_while_another_process_floods_the_arena_gets_exactly_its_bytes(
    make_server, tmp_path: Path
) -> None:
    server: ServerThread = make_server(
        ram={"capacity_bytes": 16 * MiB, "lease_timeout_s": 60.0}, shm={"dir": str(tmp_path / "shm")}
    )
    mine = blocks(3, 1 * MiB)
    keys = [k for k, _ in mine]
    with KVCacheClient(server.target) as client:
        client.put_many(NS, mine)
        with client.leased(NS, keys) as views:
            flood = subprocess.run(
                [sys.executable, "-c", _FLOOD, server.target, "40"],  # 160 MiB through a 16 MiB arena
                capture_output=True,
                text=True,
                timeout=100,
                cwd=REPO,
            )
            assert flood.returncode == 0, flood.stderr
            assert int(flood.stdout) > 100  # the flood evicted everything else many times over
            assert [bytes(v) for v in views] == [b for _, b in mine]  # its slots were never reused
            # A pinned block is never an eviction victim: still indexed, still served.
            assert client.lookup(NS, keys).prefix_length == 3
        assert client.stats().arena_leases == 0
        stats = client.stats()
        assert (stats.arena_reservations, stats.arena_reservations_reclaimed) == (0, 0)
        # Every put, the flood's included, was read from its segment straight into a slot.
        flooded = 40 * 4 * len(raw_block(os.urandom(16), bytes(MiB)))
        assert stats.shm_bytes_received == stats.inplace_bytes_received == sum(len(b) for _, b in mine) + flooded
        ram = server.stack.ram
        held = sum((s.length + 63) // 64 * 64 for s in ram._blocks.values())
        assert ram.arena_stats()["free_bytes"] == ram.region.size - held  # the leased slots are only the index's now
        assert [bytes(b) for b in client.get_many(NS, keys)] == [b for _, b in mine]


def test_bytes_changed_under_a_lease_become_a_miss_never_wrong_kv(arena_server: ServerThread) -> None:
    """Even a bug that changes a block in its slot (here: the test, through the server's own writable
    view; no client can write the arena) is only a miss."""
    (item,) = blocks(1, 256 << 10)
    with KVCacheClient(arena_server.target) as client:
        client.put_many(NS, [item])
        ram = arena_server.stack.ram
        (lease,) = ram.lease_many("ns", [item[0]])
        assert lease is not None
        ram.release([lease.id])
        ram.region.view[lease.offset + 1000 : lease.offset + 1008] = b"\xff" * 8
        with client.leased(NS, [item[0]]) as views:
            assert views == [None]
        assert client.get_into(NS, [item[0]], [bytearray(len(item[1]) - 48)]) == [False]
        assert client.corrupt_blocks == 2
        assert client.stats().arena_leases == 0


@pytest.mark.parametrize("face", ["blocking", "asyncio"])
def test_get_into_lands_leased_blocks_on_threads_and_a_block_changed_in_its_slot_is_a_miss(
    arena_server: ServerThread, face: str
) -> None:
    """A same-host get_into of large blocks copies them out of the arena on a few threads, each
    payload verified where it landed (kvcache_core.landing): a block changed in its slot (a server
    bug; no client can write the arena) is a miss, counted, and every other block lands exactly,
    into numpy arrays, bytearrays and CPU tensors alike; the leases are released either way."""
    import asyncio

    from kvcache_client import AsyncKVCacheClient
    from kvcache_core import landing

    data = blocks(4, 4 * MiB)  # 16 MiB: the lease path (over the same-host GET's 4 MiB), on threads
    keys = [k for k, _ in data]
    size = 4 * MiB
    threads: set[str] = set()
    real = landing._land_one

    def seen(job, header):  # type: ignore[no-untyped-def]
        threads.add(threading.current_thread().name)
        return real(job, header)

    with KVCacheClient(arena_server.target) as client:
        client.put_many(NS, data)
        ram = arena_server.stack.ram
        (lease,) = ram.lease_many("ns", [keys[2]])
        assert lease is not None
        ram.release([lease.id])
        ram.region.view[lease.offset + lease.length - 8 : lease.offset + lease.length] = b"\x00" * 8
    dst: list = [torch.zeros(size // 2, dtype=torch.bfloat16), bytearray(size), np.zeros(size, np.uint8)]
    dst.append(bytearray(size))
    landing._land_one = seen  # type: ignore[assignment]
    try:
        if face == "blocking":
            with KVCacheClient(arena_server.target) as client:
                got = client.get_into(NS, keys, dst)
                corrupt, leases = client.corrupt_blocks, client.stats().arena_leases
        else:

            async def main() -> tuple[list[bool], int, int]:
                async with AsyncKVCacheClient(arena_server.target) as aclient:
                    found = await aclient.get_into(NS, keys, dst)
                    return found, aclient.corrupt_blocks, (await aclient.stats()).arena_leases

            got, corrupt, leases = asyncio.run(main())
    finally:
        landing._land_one = real  # type: ignore[assignment]
    assert got == [True, True, False, True] and corrupt == 1 and leases == 0
    payloads = [b[-size:] for _, b in data]
    assert dst[0].view(torch.uint8).numpy().tobytes() == payloads[0]  # type: ignore[attr-defined]
    assert bytes(dst[1]) == payloads[1] and bytes(dst[3]) == payloads[3]  # type: ignore[arg-type]
    assert bytes(dst[2]) == payloads[2][:-8] + bytes(8)  # type: ignore[arg-type]  # what landed, refused
    assert len(threads) >= min(2, landing.THREADS)  # shared among threads where there are cores for them


def test_leased_without_verify_leaves_the_views_to_the_caller_and_checks_copies(arena_server: ServerThread) -> None:
    """leased(verify=False): a block changed in its slot comes back as a view (not read), and the
    caller's check of its copy (verify_copy) catches it; an intact block's copy passes. A block a
    client received as a copy (not in place) is verified as it arrives either way."""
    items = blocks(2, 256 << 10)
    with KVCacheClient(arena_server.target) as client:
        client.put_many(NS, items)
        ram = arena_server.stack.ram
        (lease,) = ram.lease_many("ns", [items[1][0]])
        assert lease is not None
        ram.release([lease.id])
        ram.region.view[lease.offset + 1000 : lease.offset + 1008] = b"\xff" * 8
        with client.leased(NS, [k for k, _ in items], verify=False) as views:
            assert all(v is not None for v in views) and views.expires_at < math.inf  # in place
            copies = [bytearray(payload_view(v)) for v in views]
            verify_copy(views[0], items[0][0], copies[0])
            with pytest.raises(ChecksumMismatch):
                verify_copy(views[1], items[1][0], copies[1])
        assert client.corrupt_blocks == 0  # nothing was read
        with client.leased(NS, [k for k, _ in items]) as views:  # verify=True, the default
            assert views[0] is not None and views[1] is None
        assert client.corrupt_blocks == 1
    with KVCacheClient(arena_server.target, shm=False) as remote:  # copies: verified on arrival
        with remote.leased(NS, [k for k, _ in items], verify=False) as views:
            assert views[0] is not None and views[1] is None
        assert remote.corrupt_blocks == 1
        assert remote.stats().arena_leases == 0


@pytest.mark.usefixtures("segment_puts")
def test_a_block_that_fails_its_checksum_in_its_slot_is_refused_and_its_slot_freed(
    arena_server: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server verifies each block in the arena slot it read it into: a block that fails there
    is DATA_LOSS, its slot goes back to the arena and nothing is stored. Tried with a raw Put naming
    a segment range that holds a block made for another key, and with an SDK put whose segment
    bytes change after the SDK wrote them (DataCorrupted, as for an inline Put)."""
    s = stub(arena_server)
    ram = arena_server.stack.ram
    info = s.Info(pb.InfoRequest(), timeout=5)
    k, other = os.urandom(16), os.urandom(16)
    block = raw_block(other, os.urandom(100_000))  # made for another key
    segment = Segment(info.shm_dir)
    try:
        ((_, where),) = segment.write_blocks([(k, block)])
        request = pb.PutRequest(
            namespace=NS, blocks=[pb.Block(key=k, shm=pb.ShmRange(segment=where.segment, offset=0, length=len(block)))]
        )
        with pytest.raises(grpc.RpcError) as refused:
            s.Put(iter([request]), timeout=5)
    finally:
        segment.close()
    assert refused.value.code() is grpc.StatusCode.DATA_LOSS and "checksum" in refused.value.details()
    stats = s.Stats(pb.StatsRequest(), timeout=5)
    assert (stats.put_checksum_failures, stats.arena_reservations, stats.shm_bytes_received) == (1, 0, len(block))
    assert (ram.used_bytes, ram.arena_stats()["free_bytes"]) == (0, ram.region.size)  # the slot is free

    # The SDK: its segment's bytes are changed between its write and the server's read.
    good = raw_block(k, os.urandom(100_000))
    copy_in = Segment._copy_in

    def then_corrupted(self: Segment, layout, items, group_bytes, stop):  # type: ignore[no-untyped-def]
        for group in copy_in(self, layout, items, group_bytes, stop):  # each group as it is sent
            at = group[0][1].offset + 1000
            os.pwrite(self.fd, bytes(b ^ 0xFF for b in os.pread(self.fd, 8, at)), at)
            yield group

    with KVCacheClient(arena_server.target) as client:
        client.bulk.same_host_put_bytes = 0  # through a segment: what this test is about
        monkeypatch.setattr(Segment, "_copy_in", then_corrupted)
        with pytest.raises(DataCorrupted):
            client.put_many(NS, [(k, good)])
        monkeypatch.undo()
        assert client.lookup(NS, [k]).prefix_length == 0
        stats = client.stats()
        assert (stats.put_checksum_failures, stats.arena_reservations) == (2, 0)
        assert stats.shm_bytes_received == len(block) + len(good)  # both were read out of their segments
        assert (ram.used_bytes, ram.arena_stats()["free_bytes"]) == (0, ram.region.size)
        assert client.put_many(NS, [(k, good)]).stored == 1  # the same block, unchanged, is stored
        assert [bytes(b) for b in client.get_many(NS, [k])] == [good]
        stats = client.stats()
    assert (stats.put_checksum_failures, stats.arena_reservations) == (2, 0)
    assert stats.shm_bytes_received == len(block) + 2 * len(good)
    # Received in place: the block committed from its slot, not the two refused ones (docs/metrics.md:
    # "committed from reservations").
    assert stats.inplace_bytes_received == len(good)


def test_arena_reserve_and_arena_commit_are_withdrawn_and_change_nothing(arena_server: ServerThread) -> None:
    """No client is handed a writable slot: ArenaReserve and ArenaCommit answer FAILED_PRECONDITION
    whatever they ask (a reservation, a commit or an abandon of one of the server's own, even named
    by its id), and change nothing. The arena file is 0400 (an open for writing fails for a non-root
    owner; these tests run as root, so the mode is checked) and the SDK maps it read-only."""
    s = stub(arena_server)
    ram = arena_server.stack.ram
    data = blocks(2, 256 << 10)
    with KVCacheClient(arena_server.target) as client:
        assert client.put_many(NS, data).stored == 2
    # The put's bulk connection ends on the server's side a moment after the client closed it (its
    # session thread sees the close): the stats below are compared only once it has.
    bulk = arena_server.running.bulk
    wait_for(lambda: bulk.counters.get("connections") == 0, 10, "the put's bulk connection to end")
    k = os.urandom(16)
    block = raw_block(k, os.urandom(1000))
    own = ram.reserve("a", len(block))  # one of the server's own reservations (a segment put's)
    assert own is not None
    own.buffer[:] = block
    before = s.Stats(pb.StatsRequest(), timeout=5)
    arena_before = ram.arena_stats()
    calls = [
        (s.ArenaReserve, pb.ArenaReserveRequest(namespace=NS, lengths=[MiB])),
        (s.ArenaReserve, pb.ArenaReserveRequest(namespace=NS, lengths=[])),
        (s.ArenaReserve, pb.ArenaReserveRequest(namespace=NS, lengths=[0])),
        (
            s.ArenaReserve,
            pb.ArenaReserveRequest(namespace=NS, lengths=[arena_server.config.limits.max_block_bytes + 1]),
        ),
        (s.ArenaReserve, pb.ArenaReserveRequest(namespace=NS, lengths=[32 * MiB] * 3)),  # more than the arena
        (s.ArenaCommit, pb.ArenaCommitRequest(namespace="a", items=[pb.ArenaCommitItem(key=k, reservation=own.id)])),
        (s.ArenaCommit, pb.ArenaCommitRequest(namespace="b", items=[pb.ArenaCommitItem(key=k, reservation=own.id)])),
        (s.ArenaCommit, pb.ArenaCommitRequest(namespace="a", abandon=[own.id])),
    ]
    for call, request in calls:
        with pytest.raises(grpc.RpcError) as info:
            call(request, timeout=5)
        assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION, request
        assert WITHDRAWN in info.value.details() and "segment" in info.value.details()
    after = s.Stats(pb.StatsRequest(), timeout=5)
    assert after.failed_requests == before.failed_requests + len(calls)
    for stats in (before, after):
        stats.ClearField("uptime_s")
        stats.ClearField("failed_requests")
    assert after == before  # no reservation, no block, no byte counted
    assert ram.arena_stats() == arena_before and arena_before["reservations"] == 1
    assert ram.reservation(own.id) is own  # neither committed nor abandoned by a client
    assert ram.contains_many_sync("a", [k]) == [False]
    assert ram.abandon([own.id]) == 1  # only its owner ends it
    assert ram.arena_stats()["free_bytes"] == ram.region.size - slots(data)
    with pytest.raises(grpc.RpcError) as info:
        s.LeaseGet(pb.LeaseGetRequest(namespace=NS, keys=[b"short"]), timeout=5)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT

    path = s.Info(pb.InfoRequest(), timeout=5).arena_path
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o400
    with KVCacheClient(arena_server.target) as client:
        with client.leased(NS, [k for k, _ in data]) as views:
            assert [bytes(v) for v in views] == [b for _, b in data]
            for view in views:
                with pytest.raises(TypeError):
                    view[0:1] = b"x"  # type: ignore[index]
        link = client._transport.arena
        assert link.state == "on" and link._readonly is not None and link._readonly.readonly
        for withdrawn in ("write", "write_slots", "takes", "put_group", "put_groups", "merge_put"):
            assert not hasattr(ArenaLink, withdrawn), withdrawn
        assert (link.fallbacks, client.stats().arena_reservations) == (0, 0)


def test_the_servers_own_reservations_never_expire_and_only_their_owner_ends_them(
    arena_server: ServerThread,
) -> None:
    """Reservations are the server's own (a segment put's, a bulk session's) and never expire by
    default: one reclaimed while its writer still ran would let the writer's late bytes land in a
    slot reused for another key. Far past ram.lease_timeout_s (2 s here) it is still open, puts go
    on around it, no RPC ends it, and its owner's abandon frees it."""
    s = stub(arena_server)
    ram = arena_server.stack.ram
    free = ram.arena_stats()["free_bytes"]
    res = ram.reserve(NS, MiB)
    assert res is not None and res.expires == math.inf
    assert ram.arena_stats()["free_bytes"] == free - MiB
    data = blocks(2, 256 << 10)
    clock = ram._clock
    ram._clock = lambda: clock() + 3600.0  # an hour later
    try:
        assert ram.reap() == 0 and ram.reservation(res.id) is res
        with KVCacheClient(arena_server.target) as client:
            client.bulk.same_host_put_bytes = 0  # through a segment: the server's reservations, what this test is about
            assert client.put_many(NS, data).stored == 2  # its own reservations committed, none left
        assert ram.arena_stats()["reservations"] == 1 and ram.reservation(res.id) is res
    finally:
        ram._clock = clock
    with pytest.raises(grpc.RpcError) as info:  # a client cannot end it either
        s.ArenaCommit(pb.ArenaCommitRequest(namespace=NS, abandon=[res.id]), timeout=5)
    assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION and WITHDRAWN in info.value.details()
    assert ram.reservation(res.id) is res
    assert ram.abandon([res.id]) == 1 and ram.abandon([res.id]) == 0
    assert ram.arena_stats()["free_bytes"] == free - slots(data)
    stats = s.Stats(pb.StatsRequest(), timeout=5)
    assert (stats.arena_reservations, stats.arena_reservations_reclaimed) == (0, 0)
    assert stats.inplace_bytes_received == sum(len(b) for _, b in data)


def test_a_full_arena_sends_the_put_the_ordinary_way(make_server, tmp_path: Path) -> None:
    """With no slot to reserve (a lease pins the arena), the server reads the put's blocks out of the
    segment into its own memory and puts them the ordinary way; RAM refuses them while the pin
    lasts. No call of the SDK goes another way: a put never uses the arena itself."""
    server: ServerThread = make_server(ram={"capacity_bytes": 8 * MiB}, shm={"dir": str(tmp_path / "shm")})
    (pinned,) = blocks(1, 7 * MiB)
    (item,) = blocks(1, 2 * MiB)
    with KVCacheClient(server.target) as client:
        client.put_many(NS, [pinned])
        with client.leased(NS, [pinned[0]]):  # the arena is pinned: a 2 MiB put cannot be reserved
            result = client.put_many(NS, [item])
            assert (result.stored, result.rejected) == (0, 1)
            arena, shm = client._transport.arena, client._transport.shm
            assert (arena.fallbacks, arena.state, shm.fallbacks, shm.state) == (0, "on", 0, "on")
            stats = client.stats()
            assert stats.shm_bytes_received == len(pinned[1]) + len(item[1])  # both out of the segment
            assert stats.inplace_bytes_received == len(pinned[1])  # only the first into a slot
            assert stats.arena_reservations == 0
        assert client.put_many(NS, [item]).stored == 1  # unpinned: into a slot, the old block evicted
        stats = client.stats()
        assert stats.inplace_bytes_received == len(pinned[1]) + len(item[1])
        assert (stats.arena_leases, stats.arena_reservations) == (0, 0)


def test_without_a_shared_arena_the_sdk_uses_segments(make_server, tmp_path: Path) -> None:
    server: ServerThread = make_server(shm={"enabled": False})
    data = blocks(2, 128 << 10)
    with KVCacheClient(server.target) as client:
        client.put_many(NS, data)
        with client.leased(NS, [k for k, _ in data]) as views:
            assert [bytes(v) for v in views] == [b for _, b in data]
        assert client._transport.arena.state == "off"
        assert client.get_into(NS, [data[0][0]], [bytearray(len(data[0][1]) - 48)]) == [True]
    with pytest.raises(grpc.RpcError) as info:
        stub(server).LeaseGet(pb.LeaseGetRequest(namespace=NS, keys=[data[0][0]]), timeout=5)
    assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION


def test_a_client_with_shm_off_uses_no_arena(arena_server: ServerThread) -> None:
    (item,) = blocks(1, MiB)
    with KVCacheClient(arena_server.target, shm=False) as client:
        client.put_many(NS, [item])
        assert [bytes(b) for b in client.get_many(NS, [item[0]])] == [item[1]]
        assert client._transport.arena.state == "off"
        stats = client.stats()
        assert (stats.inplace_bytes_received, stats.shm_bytes_received, stats.inplace_bytes_leased) == (0, 0, 0)


def test_tensors_round_trip_in_place(arena_server: ServerThread) -> None:
    keys = [os.urandom(16) for _ in range(2)]
    tensors = [torch.randn(2, 2, 4, 256, 64, dtype=torch.bfloat16) for _ in keys]
    with KVCacheClient(arena_server.target) as client:
        client.put_tensors(NS, keys, tensors)
        out = [torch.empty_like(t) for t in tensors]
        assert client.get_into(NS, keys, out) == [True, True]
        assert all(torch.equal(a, b) for a, b in zip(out, tensors, strict=True))
        stats = client.stats()
        assert stats.inplace_bytes_received == stats.shm_bytes_received > 2 * 2 * 2 * 4 * 256 * 64 * 2


def test_uint8_blocks_encoded_by_hand_round_trip(arena_server: ServerThread) -> None:
    k = os.urandom(16)
    block = encode_block(os.urandom(300_000), key=k, dtype="uint8", shape=(300_000,))
    with KVCacheClient(arena_server.target) as client:
        client.put_many(NS, [(k, block)])
        assert bytes(client.get_many(NS, [k])[0]) == block


def test_a_restarted_server_has_a_new_arena_and_the_client_maps_it(make_server, tmp_path: Path) -> None:
    """The restarted server (here of another capacity) has a new arena file: a put does not touch
    the arena, and the first lease names the new one, which the client maps at its own size."""
    shm = {"dir": str(tmp_path / "shm")}
    first: ServerThread = make_server(ram={"capacity_bytes": 16 * MiB}, shm=shm)
    port = first.running.port
    data = blocks(2, 256 << 10)
    with KVCacheClient(first.target, timeout_s=30) as client:
        client.put_many(NS, data[:1])
        with client.leased(NS, [data[0][0]]) as views:
            assert [bytes(v) for v in views] == [data[0][1]]
        link = client._transport.arena
        old = link.path
        assert (link.state, link.size) == ("on", 16 * MiB)
        first.stop()
        assert not os.path.exists(old)
        second: ServerThread = make_server(server={"port": port}, ram={"capacity_bytes": 24 * MiB}, shm=shm)
        assert client.put_many(NS, data[1:]).stored == 1  # read into a slot of the new arena
        assert link.path == old  # the put named no arena: it went through the client's segment
        assert [bytes(b) for b in client.get_many(NS, [data[1][0]])] == [data[1][1]]
        new = stub(second).Info(pb.InfoRequest(), timeout=5).arena_path
        assert new != old and (link.path, link.state, link.size) == (new, "on", 24 * MiB)
        assert client.get_many(NS, [data[0][0]]) == [None]  # the old server's RAM is gone
        stats = client.stats()
        size = len(data[1][1])
        assert (stats.shm_bytes_received, stats.inplace_bytes_received, stats.inplace_bytes_leased) == (size,) * 3
        assert (stats.arena_leases, stats.arena_reservations) == (0, 0)
        assert link.fallbacks == 0
