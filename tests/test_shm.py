"""The same-host shared-memory data path: real server, real tmpfs-style segment files, both SDKs."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from kvcache_client import AsyncKVCacheClient, KVCacheClient
from kvcache_client.shm import MIN_PUT_BYTES, Segment, SegmentPool
from kvcache_core.blockwire import ShmRange, encode_put_request
from kvcache_proto import kvcache_pb2 as pb
from kvcache_proto import kvcache_pb2_grpc as pb_grpc
from kvcache_server.arena import ARENA_PREFIX
from kvcache_server.shm import ShmDirectory, ShmError, read_range
from tests.conftest import ServerThread, keyed, raw_block

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def shm_dir(tmp_path: Path) -> Path:
    return tmp_path / "shm"  # the server creates it, mode 0700


@pytest.fixture
def shm_server(make_server, shm_dir: Path) -> ServerThread:
    # Per-call segments are what same-host clients use where the block arena is not shared
    # (tests/test_inplace.py covers the arena).
    return make_server(ram={"capacity_bytes": 256 << 20}, shm={"dir": str(shm_dir), "share_arena": False})


def blocks(n: int, size: int) -> list[tuple[bytes, bytes]]:
    return [keyed(os.urandom(size)) for _ in range(n)]


def stats(server: ServerThread) -> pb.StatsResponse:
    with grpc.insecure_channel(server.target) as channel:
        return pb_grpc.KVCacheStub(channel).Stats(pb.StatsRequest(), timeout=10)


def segments(directory: Path) -> list[str]:
    """The client segments in the directory (not the server's block arena, docs/arena.md)."""
    if not directory.exists():
        return []
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith(ARENA_PREFIX))


def test_server_creates_an_owner_only_directory_and_advertises_it(shm_server: ServerThread, shm_dir: Path) -> None:
    st = os.lstat(shm_dir)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    with grpc.insecure_channel(shm_server.target) as channel:
        info = pb_grpc.KVCacheStub(channel).Info(pb.InfoRequest(), timeout=10)
    assert info.shm_dir == str(shm_dir) and info.max_block_bytes == shm_server.config.limits.max_block_bytes


def test_blocks_move_through_shared_memory_both_ways(shm_server: ServerThread, shm_dir: Path) -> None:
    items = blocks(4, 1 << 20) + blocks(3, 1000)
    with KVCacheClient(shm_server.target) as client:
        assert client.put_many("ns", items).stored == len(items)
        got = client.get_many("ns", [k for k, _ in items] + [os.urandom(16)])
        assert client._transport.shm.state == "on"
    assert [bytes(g) for g in got[:-1]] == [b for _, b in items] and got[-1] is None
    s = stats(shm_server)
    total = sum(len(b) for _, b in items)
    assert s.shm_bytes_received == total  # the whole put went through the segment (it is over MIN_PUT_BYTES)
    assert s.shm_bytes_sent == total  # and every found block came back through one
    del got
    assert segments(shm_dir) == []  # close() removed the client's segments


def test_async_client_uses_shared_memory(shm_server: ServerThread) -> None:
    items = blocks(3, 512 << 10)

    async def run() -> list:
        async with AsyncKVCacheClient(shm_server.target) as client:
            assert (await client.put_many("ns", items)).stored == 3
            got = await client.get_many("ns", [k for k, _ in items])
            assert client._transport.shm.state == "on"
            return [bytes(g) for g in got]

    assert asyncio.run(run()) == [b for _, b in items]
    s = stats(shm_server)
    assert s.shm_bytes_received == s.shm_bytes_sent == sum(len(b) for _, b in items)


def test_small_puts_stay_inline(shm_server: ServerThread) -> None:
    items = blocks(2, 1000)
    assert sum(len(b) for _, b in items) < MIN_PUT_BYTES
    with KVCacheClient(shm_server.target) as client:
        client.put_many("ns", items)
    assert stats(shm_server).shm_bytes_received == 0


def test_held_blocks_stay_valid_while_later_gets_reuse_segments(shm_server: ServerThread, shm_dir: Path) -> None:
    a, b = blocks(1, 256 << 10), blocks(1, 256 << 10)
    with KVCacheClient(shm_server.target) as client:
        client.put_many("ns", a + b)
        held = client.get_many("ns", [a[0][0]])[0]
        for _ in range(5):  # each get needs a segment; the held one must not be overwritten
            other = client.get_many("ns", [b[0][0]])[0]
            assert bytes(other) == b[0][1]
            del other
        assert bytes(held) == a[0][1]
        # Gets whose blocks are dropped reuse segments: the directory does not grow with calls.
        for _ in range(20):
            assert client.get_many("ns", [b[0][0]])[0] is not None
        assert len(segments(shm_dir)) <= 3
    assert bytes(held) == a[0][1]  # still valid after close() removed the files


def test_tensors_from_shared_memory_can_be_written_without_harm(shm_server: ServerThread) -> None:
    torch = pytest.importorskip("torch")
    from kvcache_client.tensors import tensor_to_block

    original = torch.arange(64 * 1024, dtype=torch.float32).reshape(2, 2, 4, 64, 64)
    key = os.urandom(16)
    with KVCacheClient(shm_server.target) as client:
        client.put_many("ns", [(key, tensor_to_block(original, key))])
        (t,) = client.get_tensors("ns", [key])
        assert client._transport.shm.state == "on" and torch.equal(t, original)
        t.add_(1)  # documented as read-only; must still not crash or reach the server's copy
        assert torch.equal(t, original + 1)
        (again,) = client.get_tensors("ns", [key])  # a different segment: t still holds the first
        assert torch.equal(again, original)
        del t, again
        (third,) = client.get_tensors("ns", [key])
        assert torch.equal(third, original)


def test_server_without_shared_memory_serves_inline(make_server) -> None:
    server = make_server(shm={"enabled": False})
    items = blocks(2, 1 << 20)
    with KVCacheClient(server.target) as client:
        client.put_many("ns", items)
        assert [bytes(g) for g in client.get_many("ns", [k for k, _ in items])] == [b for _, b in items]
        assert client._transport.shm.state == "off"
    s = stats(server)
    assert s.shm_bytes_received == s.shm_bytes_sent == 0


def test_client_disabled_by_argument_or_environment(shm_server: ServerThread, monkeypatch) -> None:
    items = blocks(2, 1 << 20)
    with KVCacheClient(shm_server.target, shm=False) as client:
        client.put_many("ns", items)
    monkeypatch.setenv("KVCACHE_SHM", "0")
    with KVCacheClient(shm_server.target) as client:
        client.get_many("ns", [k for k, _ in items])
        assert client._transport.shm.state == "off"
    s = stats(shm_server)
    assert s.shm_bytes_received == s.shm_bytes_sent == 0


@pytest.mark.usefixtures("segment_puts")
def test_client_that_does_not_share_the_directory_falls_back_inline(shm_server: ServerThread, tmp_path: Path) -> None:
    """As for a client on another host that happens to have a directory of the same name."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    items = blocks(2, 1 << 20)
    with KVCacheClient(shm_server.target) as client:
        client._transport.shm.configure(str(elsewhere), 64 << 20)
        assert client.put_many("ns", items).stored == 2
        assert client._transport.shm.state == "off" and "not found" in client._transport.shm.reason
        client._transport.shm.configure(str(elsewhere), 64 << 20)
        assert [bytes(g) for g in client.get_many("ns", [k for k, _ in items])] == [b for _, b in items]
        assert client._transport.shm.state == "off"
    assert stats(shm_server).shm_bytes_received == 0


# -- what a client can send wrong --------------------------------------------------------------------


def _segment_with(shm_dir: Path, data: bytes) -> Segment:
    seg = Segment(str(shm_dir))
    seg.write_blocks([(b"", data)])
    return seg


def _put(server: ServerThread, *blocks: tuple[bytes, ShmRange | bytes]) -> tuple[grpc.StatusCode, str]:
    with grpc.insecure_channel(server.target) as channel:
        call = channel.stream_unary("/kvcache.v1.KVCache/Put", lambda b: b, pb.PutResponse.FromString)
        try:
            call(iter([encode_put_request("ns", list(blocks))]), timeout=10)
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def _lookup(server: ServerThread, key: bytes) -> int:
    with grpc.insecure_channel(server.target) as channel:
        return pb_grpc.KVCacheStub(channel).Lookup(pb.LookupRequest(namespace="ns", keys=[key])).prefix_length


@pytest.mark.parametrize(
    "name", ["../../etc/passwd", "kvcache-", "kvcache-" + "A" * 32, "kvcache-" + "0" * 31, "x/kvcache-" + "0" * 32]
)
def test_bad_segment_names_are_invalid_argument(shm_server: ServerThread, name: str) -> None:
    key = os.urandom(16)
    code, details = _put(shm_server, (key, ShmRange(name, 0, 100)))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "32 hex digits" in details
    assert _lookup(shm_server, key) == 0


def test_missing_segment_is_failed_precondition(shm_server: ServerThread) -> None:
    code, details = _put(shm_server, (os.urandom(16), ShmRange("kvcache-" + "0" * 32, 0, 100)))
    assert code is grpc.StatusCode.FAILED_PRECONDITION and "not found" in details


def test_range_past_the_end_and_oversized_blocks_are_refused(shm_server: ServerThread, shm_dir: Path) -> None:
    key = os.urandom(16)
    data = raw_block(key, os.urandom(4096))
    seg = _segment_with(shm_dir, data)
    try:
        code, details = _put(shm_server, (key, ShmRange(seg.name, 64, len(data) + 1000)))
        assert code is grpc.StatusCode.INVALID_ARGUMENT and "past the end" in details
        too_big = shm_server.config.limits.max_block_bytes + 1
        code, details = _put(shm_server, (key, ShmRange(seg.name, 0, too_big)))
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and "max_block_bytes" in details
        assert _lookup(shm_server, key) == 0
        # The same segment, read correctly, is accepted.
        assert _put(shm_server, (key, ShmRange(seg.name, 0, len(data))))[0] is grpc.StatusCode.OK
        assert _lookup(shm_server, key) == 1
    finally:
        seg.close()


def test_corrupt_bytes_in_a_segment_are_data_loss_and_not_stored(shm_server: ServerThread, shm_dir: Path) -> None:
    key, good = os.urandom(16), os.urandom(16)
    data = bytearray(raw_block(key, os.urandom(100_000)))
    data[-1] ^= 0xFF
    seg = _segment_with(shm_dir, bytes(data))
    try:
        fine = raw_block(good, b"fine")
        good_seg = _segment_with(shm_dir, fine)
        # A good block first in the same message: nothing of the message is stored.
        code, details = _put(
            shm_server, (good, ShmRange(good_seg.name, 0, len(fine))), (key, ShmRange(seg.name, 0, len(data)))
        )
        good_seg.close()
        assert code is grpc.StatusCode.DATA_LOSS and "block 1" in details
        assert _lookup(shm_server, key) == 0 and _lookup(shm_server, good) == 0
    finally:
        seg.close()


def test_symlinks_and_foreign_files_are_refused(shm_server: ServerThread, shm_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "secret"
    target.write_bytes(raw_block(bytes(16), b"not yours"))
    name = "kvcache-" + "1" * 32
    (shm_dir / name).symlink_to(target)
    code, _ = _put(shm_server, (os.urandom(16), ShmRange(name, 0, 10)))
    assert code is grpc.StatusCode.FAILED_PRECONDITION
    (shm_dir / name).unlink()
    (shm_dir / name).mkdir()
    code, _ = _put(shm_server, (os.urandom(16), ShmRange(name, 0, 10)))
    assert code is grpc.StatusCode.FAILED_PRECONDITION


def test_segment_named_to_a_server_without_shared_memory(make_server) -> None:
    server = make_server(shm={"enabled": False})
    code, details = _put(server, (os.urandom(16), ShmRange("kvcache-" + "0" * 32, 0, 10)))
    assert code is grpc.StatusCode.FAILED_PRECONDITION and "no shared-memory path" in details


def test_get_with_bad_segments(shm_server: ServerThread) -> None:
    key = os.urandom(16)
    with grpc.insecure_channel(shm_server.target) as channel:
        stub = pb_grpc.KVCacheStub(channel)
        for name, code in (
            ("../x", grpc.StatusCode.INVALID_ARGUMENT),
            ("kvcache-" + "2" * 32, grpc.StatusCode.FAILED_PRECONDITION),
        ):
            request = pb.GetRequest(namespace="ns", keys=[key], shm=pb.ShmTarget(segment=name, capacity=1 << 20))
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Get(request, timeout=10))
            assert info.value.code() is code


def test_get_sends_what_does_not_fit_inline(shm_server: ServerThread, shm_dir: Path) -> None:
    items = blocks(3, 10_000)
    with KVCacheClient(shm_server.target, shm=False) as client:
        client.put_many("ns", items)
    seg = Segment(str(shm_dir))
    try:
        capacity = len(items[0][1]) + 100  # room for the first block only
        with grpc.insecure_channel(shm_server.target) as channel:
            request = pb.GetRequest(
                namespace="ns", keys=[k for k, _ in items], shm=pb.ShmTarget(segment=seg.name, capacity=capacity)
            )
            got = [item for r in pb_grpc.KVCacheStub(channel).Get(request, timeout=10) for item in r.items]
        assert [i.HasField("shm") for i in got] == [True, False, False]
        assert got[0].shm.offset == 0 and got[0].shm.length == len(items[0][1])
        assert bytes(seg.map(got[0].shm.length)) == items[0][1]
        assert [i.data for i in got[1:]] == [b for _, b in items[1:]]
    finally:
        seg.close()


# -- lifetimes and bounds ----------------------------------------------------------------------------


def test_pool_keeps_idle_segments_under_its_byte_cap(tmp_path: Path) -> None:
    directory = tmp_path / "d"
    directory.mkdir(mode=0o700)
    pool = SegmentPool(str(directory), max_bytes=3 << 20)
    for size in [1 << 20, 2 << 20, 512 << 10, 3 << 20, 1 << 20] * 4:
        segs = [pool.acquire() for _ in range(3)]  # three calls at once
        for seg in segs:
            seg.write_blocks([(b"", os.urandom(size))])
        for seg in segs:
            pool.release(seg)
        assert pool.idle_bytes <= 3 << 20
        assert sum(p.stat().st_size for p in directory.iterdir()) <= 3 << 20
    pool.close()
    assert segments(directory) == []


def test_pool_replaces_segments_the_server_swept(tmp_path: Path) -> None:
    directory = tmp_path / "d"
    directory.mkdir(mode=0o700)
    pool = SegmentPool(str(directory))
    seg = pool.acquire()
    seg.write_blocks([(b"", b"x" * 100)])
    pool.release(seg)
    (directory / seg.name).unlink()  # as the server's sweep does to a segment idle for too long
    fresh = pool.acquire()
    assert fresh.name != seg.name and (directory / fresh.name).exists() and seg.fd < 0
    pool.release(fresh)
    pool.close()


def test_a_client_that_exits_without_close_leaves_no_segments(shm_server: ServerThread, shm_dir: Path) -> None:
    script = (
        "import os, sys\n"
        "from kvcache_client import KVCacheClient\n"
        "from kvcache_core.format import encode_block\n"
        "c = KVCacheClient(sys.argv[1])\n"
        "k = os.urandom(16)\n"
        "c.put_many('ns', [(k, encode_block(os.urandom(1 << 20), key=k, dtype='uint8', shape=(1 << 20,)))])\n"
        "assert c.get_many('ns', [k])[0] is not None\n"
        "print(len([n for n in os.listdir(sys.argv[2]) if not n.startswith('kvcache-arena-')]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, shm_server.target, str(shm_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        check=True,
    )
    assert int(out.stdout.strip()) >= 1  # it did use segments
    assert segments(shm_dir) == []


def test_a_forked_child_never_uses_or_removes_the_parents_segments(shm_server: ServerThread, shm_dir: Path) -> None:
    items = blocks(2, 256 << 10)
    with KVCacheClient(shm_server.target) as client:
        client.put_many("ns", items)
        assert client.get_many("ns", [items[0][0]])[0] is not None
        pool = client._transport.shm.pool
        parent = set(segments(shm_dir))
        assert parent  # the parent has idle segments to inherit
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: only the pool, no gRPC (a channel does not survive fork)
            try:
                seg = pool.acquire()
                ok = seg.name not in parent and seg.pid == os.getpid()
                pool.release(seg)
                pool.close()
                os.write(write, b"1" if ok else b"0")
            finally:
                os._exit(0)
        os.close(write)
        assert os.read(read, 1) == b"1"
        os.close(read)
        os.waitpid(pid, 0)
        assert parent <= set(segments(shm_dir))  # the child's close() left the parent's files
        assert [bytes(b) for b in client.get_many("ns", [k for k, _ in items])] == [b for _, b in items]


def test_sweep_removes_only_stale_segments(tmp_path: Path) -> None:
    directory = ShmDirectory.open(str(tmp_path / "s"))
    old, fresh = "kvcache-" + "a" * 32, "kvcache-" + "b" * 32
    for name in (old, fresh, "unrelated"):
        (directory.path / name).write_bytes(b"x")
    past = time.time() - 3600
    os.utime(directory.path / old, (past, past))
    os.utime(directory.path / "unrelated", (past, past))
    assert directory.sweep(600) == 1
    assert sorted(p.name for p in directory.path.iterdir()) == [fresh, "unrelated"]
    directory.close()


def test_directory_open_to_others_turns_the_path_off(make_server, tmp_path: Path) -> None:
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o755)
    with pytest.raises(OSError, match="0700"):
        ShmDirectory.open(str(loose))
    server = make_server(shm={"dir": str(loose)})  # starts, without the shared-memory path
    with grpc.insecure_channel(server.target) as channel:
        assert pb_grpc.KVCacheStub(channel).Info(pb.InfoRequest(), timeout=10).shm_dir == ""


def test_a_segment_that_shrinks_while_read_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "seg"
    path.write_bytes(b"x" * 1000)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(ShmError, match="past the end"):
            read_range(fd, 1000, "seg", 900, 200)
        os.truncate(path, 500)  # the client truncated it after the server checked its size
        with pytest.raises(ShmError, match="shrank"):
            read_range(fd, 1000, "seg", 0, 1000)
    finally:
        os.close(fd)
