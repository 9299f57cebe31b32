"""Same-host in-place transfers through the shared block arena: reserve -> write -> verify -> commit,
lease -> verify -> read in place or copy once -> release (docs/arena.md, docs/shm.md)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from kvcache_client import DataCorrupted, KVCacheClient
from kvcache_core.format import encode_block
from kvcache_proto import kvcache_pb2 as pb
from kvcache_proto import kvcache_pb2_grpc as pb_grpc
from tests.conftest import ServerThread, raw_block

pytestmark = pytest.mark.timeout(120)

NS = "ns"
REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20


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


def test_the_arena_is_advertised_as_an_owner_only_file_of_the_server(arena_server: ServerThread) -> None:
    info = stub(arena_server).Info(pb.InfoRequest(), timeout=5)
    st = os.stat(info.arena_path)
    assert Path(info.arena_path).parent == Path(info.shm_dir)
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_size) == (0o400, os.geteuid(), info.arena_bytes)
    assert info.arena_bytes == 64 * MiB


def test_puts_and_gets_move_no_byte_through_grpc_or_segments(arena_server: ServerThread) -> None:
    data = blocks(4, 2 * MiB)
    keys = [k for k, _ in data]
    total = sum(len(b) for _, b in data)
    with KVCacheClient(arena_server.target) as client:
        result = client.put_many(NS, data)
        assert (result.stored, result.bytes_sent) == (4, total)
        assert client._transport.arena.state == "on"
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
    assert (stats.shm_bytes_received, stats.shm_bytes_sent) == (0, 0)
    assert stats.inplace_bytes_received == total
    assert stats.inplace_bytes_leased == 4 * total  # get_many, leased, two get_into
    assert (stats.arena_leases, stats.arena_reservations) == (0, 0)  # every lease released
    ram = arena_server.stack.ram
    assert ram.arena_stats()["free_bytes"] == ram.region.size - sum(
        (len(b) + 63) // 64 * 64 for _, b in data
    )  # a put's reservations are its slots: nothing else was allocated


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
            assert int(flood.stdout) > 100  # the flood evicted everything many times over
            assert [bytes(v) for v in views] == [b for _, b in mine]  # its slots were never reused
        assert client.lookup(NS, keys).prefix_length == 0  # evicted from the index meanwhile
        assert client.stats().arena_leases == 0
        ram = server.stack.ram
        held = sum((s.length + 63) // 64 * 64 for s in ram._blocks.values())
        assert ram.arena_stats()["free_bytes"] == ram.region.size - held  # the leased slots came back


def test_bytes_changed_under_a_lease_become_a_miss_never_wrong_kv(arena_server: ServerThread) -> None:
    """Even a lease bug (here: a process of the same user scribbling over the arena) is only a miss."""
    (item,) = blocks(1, 256 << 10)
    with KVCacheClient(arena_server.target) as client:
        client.put_many(NS, [item])
        (lease,) = arena_server.stack.ram.lease_many("ns", [item[0]])
        assert lease is not None
        arena_server.stack.ram.release([lease.id])
        with open(client._transport.arena.path, "r+b") as f:
            f.seek(lease.offset + 1000)
            f.write(b"\xff" * 8)
        with client.leased(NS, [item[0]]) as views:
            assert views == [None]
        assert client.get_into(NS, [item[0]], [bytearray(len(item[1]) - 48)]) == [False]
        assert client.corrupt_blocks == 2
        assert client.stats().arena_leases == 0


def test_a_block_that_fails_its_checksum_in_its_slot_is_refused_and_its_slot_freed(arena_server: ServerThread) -> None:
    s = stub(arena_server)
    k, other = os.urandom(16), os.urandom(16)
    block = raw_block(other, os.urandom(100_000))  # made for another key
    reply = s.ArenaReserve(pb.ArenaReserveRequest(namespace=NS, lengths=[len(block)]), timeout=5)
    with open(reply.arena_path, "r+b") as f:
        f.seek(reply.slots[0].offset)
        f.write(block)
    with pytest.raises(grpc.RpcError) as info:
        s.ArenaCommit(
            pb.ArenaCommitRequest(namespace=NS, items=[pb.ArenaCommitItem(key=k, reservation=reply.slots[0].id)]),
            timeout=5,
        )
    assert info.value.code() is grpc.StatusCode.DATA_LOSS
    stats = s.Stats(pb.StatsRequest(), timeout=5)
    assert (stats.put_checksum_failures, stats.arena_reservations) == (1, 0)
    assert arena_server.stack.ram.used_bytes == 0
    # The SDK maps DATA_LOSS of its own block to DataCorrupted, as for Put.
    with KVCacheClient(arena_server.target) as client, pytest.raises(DataCorrupted):
        client.put_many(NS, [(k, block)])


def test_abandoned_and_forgotten_reservations_are_reclaimed(arena_server: ServerThread) -> None:
    s = stub(arena_server)
    ram = arena_server.stack.ram
    free = ram.arena_stats()["free_bytes"]
    a = s.ArenaReserve(pb.ArenaReserveRequest(namespace=NS, lengths=[MiB, MiB]), timeout=5)
    assert ram.arena_stats()["free_bytes"] == free - 2 * MiB
    s.ArenaCommit(pb.ArenaCommitRequest(namespace=NS, abandon=[a.slots[0].id]), timeout=5)
    assert ram.arena_stats()["reservations"] == 1
    # The other one is forgotten (a client that died): reclaimed after ram.lease_timeout_s (2 s).
    deadline = time.monotonic() + 10
    while ram.reap() == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ram.arena_stats()["free_bytes"] == free
    stats = s.Stats(pb.StatsRequest(), timeout=5)
    assert (stats.arena_reservations, stats.arena_reservations_reclaimed) == (0, 1)
    with pytest.raises(grpc.RpcError) as info:  # a late commit stores nothing
        s.ArenaCommit(
            pb.ArenaCommitRequest(
                namespace=NS, items=[pb.ArenaCommitItem(key=os.urandom(16), reservation=a.slots[1].id)]
            ),
            timeout=5,
        )
    assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION and "not open" in info.value.details()


def test_a_reservation_commits_only_into_its_namespace_and_requests_are_checked(arena_server: ServerThread) -> None:
    s = stub(arena_server)
    k = os.urandom(16)
    block = raw_block(k, os.urandom(1000))
    res = s.ArenaReserve(pb.ArenaReserveRequest(namespace="a", lengths=[len(block)]), timeout=5)
    with pytest.raises(grpc.RpcError) as info:
        s.ArenaCommit(
            pb.ArenaCommitRequest(namespace="b", items=[pb.ArenaCommitItem(key=k, reservation=res.slots[0].id)]),
            timeout=5,
        )
    assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    for lengths, code in [
        ([], grpc.StatusCode.INVALID_ARGUMENT),
        ([0], grpc.StatusCode.INVALID_ARGUMENT),
        ([arena_server.config.limits.max_block_bytes + 1], grpc.StatusCode.RESOURCE_EXHAUSTED),
        ([32 * MiB, 32 * MiB, 32 * MiB], grpc.StatusCode.RESOURCE_EXHAUSTED),  # more than the arena
    ]:
        with pytest.raises(grpc.RpcError) as info:
            s.ArenaReserve(pb.ArenaReserveRequest(namespace="a", lengths=lengths), timeout=5)
        assert info.value.code() is code, lengths
    assert arena_server.stack.ram.arena_stats()["reservations"] == 1  # the refused ones left nothing
    with pytest.raises(grpc.RpcError) as info:
        s.LeaseGet(pb.LeaseGetRequest(namespace="a", keys=[b"short"]), timeout=5)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT


def test_a_full_arena_sends_the_put_the_ordinary_way(make_server, tmp_path: Path) -> None:
    server: ServerThread = make_server(ram={"capacity_bytes": 8 * MiB}, shm={"dir": str(tmp_path / "shm")})
    (pinned,) = blocks(1, 7 * MiB)
    with KVCacheClient(server.target) as client:
        client.put_many(NS, [pinned])
        with client.leased(NS, [pinned[0]]):  # the arena is pinned: a 2 MiB put cannot be reserved
            (item,) = blocks(1, 2 * MiB)
            result = client.put_many(NS, [item])
            assert result.stored + result.rejected == 1
            assert client._transport.arena.fallbacks == 1 and client._transport.arena.state == "on"
            assert client.stats().shm_bytes_received == len(item[1])  # through a per-call segment


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
        assert client.stats().inplace_bytes_received == 0


def test_tensors_round_trip_in_place(arena_server: ServerThread) -> None:
    keys = [os.urandom(16) for _ in range(2)]
    tensors = [torch.randn(2, 2, 4, 256, 64, dtype=torch.bfloat16) for _ in keys]
    with KVCacheClient(arena_server.target) as client:
        client.put_tensors(NS, keys, tensors)
        out = [torch.empty_like(t) for t in tensors]
        assert client.get_into(NS, keys, out) == [True, True]
        assert all(torch.equal(a, b) for a, b in zip(out, tensors, strict=True))
        assert client.stats().inplace_bytes_received > 0


def test_uint8_blocks_encoded_by_hand_round_trip(arena_server: ServerThread) -> None:
    k = os.urandom(16)
    block = encode_block(os.urandom(300_000), key=k, dtype="uint8", shape=(300_000,))
    with KVCacheClient(arena_server.target) as client:
        client.put_many(NS, [(k, block)])
        assert bytes(client.get_many(NS, [k])[0]) == block


def test_a_restarted_server_has_a_new_arena_and_the_client_maps_it(make_server, tmp_path: Path) -> None:
    cfg = {"ram": {"capacity_bytes": 16 * MiB}, "shm": {"dir": str(tmp_path / "shm")}}
    first: ServerThread = make_server(**cfg)
    port = first.running.port
    data = blocks(2, 256 << 10)
    with KVCacheClient(first.target, timeout_s=30) as client:
        client.put_many(NS, data[:1])
        old = client._transport.arena.path
        first.stop()
        assert not os.path.exists(old)
        second: ServerThread = make_server(server={"port": port}, **cfg)
        assert client.put_many(NS, data[1:]).stored == 1  # reserved in the new arena, written there
        assert client._transport.arena.path != old and client._transport.arena.state == "on"
        assert [bytes(b) for b in client.get_many(NS, [data[1][0]])] == [data[1][1]]
        assert client.get_many(NS, [data[0][0]]) == [None]  # the old server's RAM is gone
        assert second.stack.ram.arena_stats()["leases"] == 0

