"""Shared memory under cancellation and a full tmpfs (docs/shm.md, "Safety").

A Get cancelled by its deadline must never write into another call's segment, a segment whose call
did not end normally is never reused, and a full tmpfs is a fallback to gRPC for that call, never a
SIGBUS and never the end of the shared-memory path.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import logging
import multiprocessing
import os
import queue
import random
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvcache_client import AsyncKVCacheClient, KVCacheClient
from kvcache_client.errors import DeadlineExceeded, InvalidRequest, KVCacheError
from kvcache_client.messages import shm_fallback
from kvcache_client.shm import FULL_METADATA, Segment
from kvcache_core.blockwire import ShmRange
from kvcache_proto import kvcache_pb2 as pb
from kvcache_proto import kvcache_pb2_grpc as pb_grpc
from kvcache_server import shm as server_shm
from kvcache_server.arena import ARENA_PREFIX
from tests.conftest import ServerThread, raw_block

# Segments: puts go through them here, not out of the client's memory (tests/test_process_puts.py).
pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("segment_puts")]

BLOCK_BYTES = 4 << 20
CANCELLED_KEYS = 16  # per Get of a canceller: 64 MiB written by one worker thread on the server
COMPARED_KEYS = 16  # per Get of the comparing client
ROUNDS = 300  # the comparing client's Gets
CANCELLERS = 3


def _key(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()[:16]


def _block(key: bytes) -> bytes:
    """The block stored under `key`: any process can rebuild it to check what it got."""
    return raw_block(key, random.Random(key).randbytes(BLOCK_BYTES))


def _quiet() -> None:
    """Misdirected blocks are logged by the SDK one by one: the counts say enough."""
    logging.getLogger("kvcache_client").setLevel(logging.CRITICAL)


def _canceller(target: str, keys: list[bytes], seed: int, stop: Any, out: Any) -> None:
    """Gets `keys` with deadlines of a few ms until `stop` is set; checks every block it does get."""
    _quiet()
    rng = random.Random(seed)
    expected = {k: _block(k) for k in keys}
    calls = cancelled = wrong = 0
    with KVCacheClient(target, timeout_s=30) as client:
        client.get_many("race", keys[:1])  # Info, with time for it: the path is on from here
        while not stop.is_set() and calls < 5000:
            calls += 1
            order = rng.sample(keys, len(keys))  # each call's blocks lie at other offsets than the last's
            try:
                got = client.get_many("race", order, timeout_s=rng.uniform(0.003, 0.030))
            except KVCacheError:
                cancelled += 1
                continue
            wrong += sum(b is not None and bytes(b) != expected[k] for k, b in zip(order, got, strict=True))
            del got
        link = client._transport.shm
        out.put(("canceller", calls, cancelled, wrong, client.corrupt_blocks, link.state, link.fallbacks))


def _comparer(target: str, keys: list[bytes], rounds: int, out: Any) -> None:
    """Gets `keys` with a long deadline `rounds` times and compares every block with what is stored."""
    _quiet()
    expected = {k: _block(k) for k in keys}
    compared = wrong = misses = 0
    with KVCacheClient(target, timeout_s=60) as client:
        for _ in range(rounds):
            got = client.get_many("race", keys)
            for k, b in zip(keys, got, strict=True):
                if b is None:
                    misses += 1
                else:
                    compared += 1
                    wrong += bytes(b) != expected[k]
            del got
        link = client._transport.shm
        out.put(("comparer", compared, wrong, misses, client.corrupt_blocks, link.state, link.fallbacks))


def _collect(out: Any, procs: list[Any], stop: Any) -> list[tuple]:
    """Every process's report; `stop` is set once the comparer's is in. A process that dies without
    reporting fails the test at once, with its exit status."""
    results: list[tuple] = []
    while len(results) < len(procs):
        try:
            results.append(out.get(timeout=1))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not dead, f"a client process died without reporting: exit statuses {dead}"
            continue
        if results[-1][0] == "comparer":
            stop.set()
    return results


@pytest.mark.timeout(120)
def test_cancelled_gets_never_write_into_another_calls_segment(make_server, tmp_path: Path) -> None:
    server: ServerThread = make_server(
        ram={"capacity_bytes": 512 << 20}, shm={"dir": str(tmp_path / "shm"), "share_arena": False}
    )
    cancelled_keys = [_key(f"cancelled-{i}") for i in range(CANCELLED_KEYS)]
    compared_keys = [_key(f"compared-{i}") for i in range(COMPARED_KEYS)]
    with KVCacheClient(server.target, shm=False) as client:
        for k in cancelled_keys + compared_keys:
            assert client.put_many("race", [(k, _block(k))]).stored == 1

    ctx = multiprocessing.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    cancellers = [
        ctx.Process(target=_canceller, args=(server.target, cancelled_keys, i, stop, out)) for i in range(CANCELLERS)
    ]
    comparer = ctx.Process(target=_comparer, args=(server.target, compared_keys, ROUNDS, out))
    for p in cancellers:
        p.start()
    comparer.start()
    try:
        results = _collect(out, [comparer, *cancellers], stop)
    finally:
        stop.set()
        for p in [*cancellers, comparer]:
            p.join(30)
            if p.is_alive():
                p.kill()
    (compared,) = [r for r in results if r[0] == "comparer"]
    others = [r for r in results if r[0] == "canceller"]
    print("comparer (compared, wrong, misses, corrupt, shm, fallbacks):", compared[1:])
    print("cancellers (calls, cancelled, wrong, corrupt, shm, fallbacks):", [r[1:] for r in others])
    assert compared[1:] == (ROUNDS * COMPARED_KEYS, 0, 0, 0, "on", 0)
    assert [r[3:] for r in others] == [(0, 0, "on", 0)] * CANCELLERS
    assert all(r[2] > 0 for r in others)  # calls were cancelled: the race was exercised


# -- a full tmpfs ------------------------------------------------------------------------------------

_CLONE_NEWNS = 0x00020000
_MS_REC, _MS_PRIVATE = 0x4000, 0x40000

# Run as root in a child: a private mount namespace with a 32 MiB tmpfs at argv[1], a server whose
# shm.dir is on it, and a client in its own process (a SIGBUS would show as its exit status -7).
_DRIVER = f"""
import ctypes, json, os, subprocess, sys
libc = ctypes.CDLL(None, use_errno=True)
mnt = sys.argv[1].encode()
if (libc.unshare({_CLONE_NEWNS}) != 0
        or libc.mount(b"none", b"/", None, {_MS_REC | _MS_PRIVATE}, None) != 0
        or libc.mount(b"tmpfs", mnt, b"tmpfs", 0, b"size=32m") != 0):
    print("NO-NAMESPACE " + os.strerror(ctypes.get_errno()))
    sys.exit(3)
from tests.conftest import ServerThread
server = ServerThread({{"shm": {{"dir": sys.argv[1] + "/shm"}}}})
try:
    client = subprocess.run([sys.executable, "-c", sys.argv[2], server.target], capture_output=True, text=True,
                            timeout=90)
finally:
    server.stop()
print(json.dumps({{"rc": client.returncode, "out": client.stdout, "err": client.stderr[-3000:],
                  "left": sorted(os.listdir(sys.argv[1] + "/shm"))}}))
"""

_FULL_CLIENT = """
import asyncio, json, os, sys
from kvcache_client import AsyncKVCacheClient, KVCacheClient
from tests.conftest import raw_block

def blocks(n, size):
    keys = [os.urandom(16) for _ in range(n)]
    return [(k, raw_block(k, os.urandom(size))) for k in keys]

target = sys.argv[1]
out = {}
big, small = blocks(4, 16 << 20), blocks(2, 1 << 20)
with KVCacheClient(target) as client:
    link = client._transport.shm
    assert client.put_many("full", big).stored == 4
    got = client.get_many("full", [k for k, _ in big])
    out["big_ok"] = [g is not None and bytes(g) == b for g, (_, b) in zip(got, big)]
    del got
    out["big"] = [link.state, link.fallbacks]
    before = client.stats()
    assert client.put_many("full", small).stored == 2
    got = client.get_many("full", [k for k, _ in small])
    out["small_ok"] = [g is not None and bytes(g) == b for g, (_, b) in zip(got, small)]
    del got
    after = client.stats()
    out["small"] = [link.state, link.fallbacks, after.shm_bytes_received - before.shm_bytes_received,
                    after.shm_bytes_sent - before.shm_bytes_sent, sum(len(b) for _, b in small)]
    out["totals_before_small"] = [before.shm_bytes_received, before.shm_bytes_sent]

async def run_async():
    items = blocks(4, 16 << 20)
    async with AsyncKVCacheClient(target) as client:
        link = client._transport.shm
        assert (await client.put_many("full-async", items)).stored == 4
        got = await client.get_many("full-async", [k for k, _ in items])
        ok = [g is not None and bytes(g) == b for g, (_, b) in zip(got, items)]
        return [ok, link.state, link.fallbacks]

out["async"] = asyncio.run(run_async())
print(json.dumps(out))
"""


@pytest.mark.timeout(150)
def test_a_full_tmpfs_sends_that_call_inline_and_keeps_the_path(tmp_path: Path) -> None:
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    repo = Path(__file__).resolve().parent.parent
    run = subprocess.run(
        [sys.executable, "-c", _DRIVER, str(mnt), _FULL_CLIENT],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=repo,
    )
    if run.returncode == 3 and run.stdout.startswith("NO-NAMESPACE"):
        reason = f"the kernel refuses a private mount namespace with a tmpfs here: {run.stdout.strip()}"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["rc"] == 0, report  # not -7 (SIGBUS)
    out = json.loads(report["out"])
    # 4 x 16 MiB fit in no 32 MiB tmpfs: the put (no room to reserve) and the get (no room for the
    # server's writes) each went inline, once, and the path stayed on.
    assert out["big_ok"] == [True] * 4
    assert out["big"] == ["on", 2]
    assert out["totals_before_small"] == [0, 0]  # nothing of them went through a segment
    # A later small put and get used shared memory, every byte of them.
    total = out["small"][4]
    assert out["small_ok"] == [True, True]
    assert out["small"] == ["on", 2, total, total, total]
    assert out["async"] == [[True] * 4, "on", 2]
    assert report["left"] == []  # retired segments were removed, the rest by close()


# -- the SDK's side: a segment whose call did not complete is never reused -----------------------------


@pytest.fixture
def shm_server(make_server, tmp_path: Path) -> ServerThread:
    # Segments, not the block arena (tests/test_inplace.py): these tests are about segments.
    return make_server(ram={"capacity_bytes": 256 << 20}, shm={"dir": str(tmp_path / "shm"), "share_arena": False})


def _segments(server: ServerThread) -> list[str]:
    """The client segments in the server's directory (not its block arena, docs/arena.md)."""
    return sorted(n for n in os.listdir(server.config.shm.dir) if not n.startswith(ARENA_PREFIX))


def _stats(server: ServerThread) -> pb.StatsResponse:
    with grpc.insecure_channel(server.target) as channel:
        return pb_grpc.KVCacheStub(channel).Stats(pb.StatsRequest(), timeout=10)


def _items(n: int, size: int) -> list[tuple[bytes, bytes]]:
    keys = [os.urandom(16) for _ in range(n)]
    return [(k, raw_block(k, os.urandom(size))) for k in keys]


class _Status(grpc.RpcError):
    """What a gRPC call raises, without a server: a status, its details and trailing metadata."""

    def __init__(self, code: grpc.StatusCode, details: str = "", trailing: tuple = ()) -> None:
        self._code, self._details, self._trailing = code, details, trailing

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple:
        return self._trailing


def test_a_failed_call_retires_its_segment_and_a_completed_one_returns_it(shm_server: ServerThread) -> None:
    items = _items(2, 256 << 10)
    with KVCacheClient(shm_server.target) as client:
        client.bulk.same_host_put_bytes = 0  # through a segment: what this test is about
        link = client._transport.shm
        assert client.put_many("ns", items).stored == 2
        got = client.get_many("ns", [k for k, _ in items])
        del got
        pool = link.pool
        assert pool is not None and len(pool._idle) == 1  # the completed calls gave their segment back
        (kept,) = pool._idle
        # A put the server refuses (bad namespace) takes that segment and fails: it is retired.
        with pytest.raises(InvalidRequest):
            client.put_many("a b", items)
        assert kept.fd < 0 and kept.name not in _segments(shm_server) and pool._idle == []
        # A get whose deadline passes (simulated: the stream fails with DEADLINE_EXCEEDED).
        assert client.get_many("ns", [items[0][0]])[0] is not None
        (kept,) = pool._idle
        real_get = client._transport.inner._get

        def deadline(request: object, **kwargs: object) -> object:
            raise _Status(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

        client._transport.inner._get = deadline
        with pytest.raises(DeadlineExceeded):
            client.get_many("ns", [items[0][0]])
        client._transport.inner._get = real_get
        assert kept.fd < 0 and kept.name not in _segments(shm_server) and pool._idle == []
        # The next call gets a fresh segment, and the path is still on; nothing was a fallback.
        assert [bytes(b) for b in client.get_many("ns", [k for k, _ in items])] == [b for _, b in items]
        assert link.state == "on" and link.fallbacks == 0
        (fresh,) = pool._idle
        assert fresh.name != kept.name
    assert _segments(shm_server) == []


def test_fallbacks_are_counted_and_only_a_server_without_segments_turns_the_path_off(
    shm_server: ServerThread,
) -> None:
    full = _Status(grpc.StatusCode.RESOURCE_EXHAUSTED, "no room", (FULL_METADATA,))
    other_limit = _Status(grpc.StatusCode.RESOURCE_EXHAUSTED, "max_block_bytes")
    gone = _Status(grpc.StatusCode.FAILED_PRECONDITION, "not found")
    with KVCacheClient(shm_server.target) as client:
        client.stats()
        client.get_many("ns", [os.urandom(16)])  # Info: the path is on
        link = client._transport.shm
        assert link.on
        assert shm_fallback(OSError(errno.ENOSPC, "No space left on device"), link) is True
        assert shm_fallback(full, link) is True
        assert shm_fallback(other_limit, link) is False  # a limit of the server: inline would not help
        assert (link.state, link.fallbacks, link.last_fallback) == ("on", 2, "no room")
        assert shm_fallback(gone, link) is True
        assert (link.state, link.fallbacks, link.reason) == ("off", 3, "not found")


def test_cancelling_an_async_put_waits_for_its_copy_and_retires_the_segment(
    shm_server: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    entered, proceed = threading.Event(), threading.Event()
    copying: list[Segment] = []
    stopped: list[bool] = []
    copy = Segment.write_blocks

    def slow_copy(self: Segment, items: Any, stop: threading.Event | None = None) -> Any:
        copying.append(self)
        entered.set()
        proceed.wait(30)  # the copy is "still running" until the test lets it go on
        stopped.append(stop is not None and stop.is_set())
        return copy(self, items, stop)

    async def run() -> int:
        async with AsyncKVCacheClient(shm_server.target) as client:
            await client.get_many("ns", [os.urandom(16)])  # Info: the path is on
            link = client._transport.shm
            monkeypatch.setattr(Segment, "write_blocks", slow_copy)
            task = asyncio.create_task(client.put_many("ns", _items(2, 1 << 20)))  # >= 1 MiB: in a thread
            while not entered.is_set():
                await asyncio.sleep(0.01)
            task.cancel()
            for _ in range(20):
                await asyncio.sleep(0)
            # The copy still runs: the call has not ended, and its segment is neither pooled nor closed.
            (segment,) = copying
            assert not task.done() and segment.fd >= 0
            assert link.pool is not None and segment not in link.pool._idle
            proceed.set()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert stopped == [True]  # the thread was told to stop (and raised before copying a block)
            assert segment.fd < 0 and segment.name not in _segments(shm_server)  # retired, not pooled
            assert link.pool._idle == [] and link.state == "on" and link.fallbacks == 0
            monkeypatch.undo()
            items = _items(2, 1 << 20)
            assert (await client.put_many("ns", items)).stored == 2
            assert [bytes(b) for b in await client.get_many("ns", [k for k, _ in items])] == [b for _, b in items]
            return sum(len(b) for _, b in items)

    sent = asyncio.run(run())
    assert _stats(shm_server).shm_bytes_received == sent  # the cancelled put never reached the server


def test_cancelling_an_async_get_while_its_segment_is_mapped_retires_it(
    shm_server: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    items = _items(2, 1 << 20)
    entered, proceed = threading.Event(), threading.Event()
    mapping: list[Segment] = []
    real_map = Segment.map

    def slow_map(self: Segment, length: int) -> memoryview:
        mapping.append(self)
        entered.set()
        proceed.wait(30)
        return real_map(self, length)

    async def run() -> None:
        async with AsyncKVCacheClient(shm_server.target) as client:
            assert (await client.put_many("ns", items)).stored == 2
            link = client._transport.shm
            pool = link.pool
            assert pool is not None and len(pool._idle) == 1
            monkeypatch.setattr(Segment, "map", slow_map)
            keys = [k for k, _ in items]
            task = asyncio.create_task(client.get_many("ns", keys))  # 2 MiB: mapped in a thread
            while not entered.is_set():
                await asyncio.sleep(0.01)
            task.cancel()
            for _ in range(20):
                await asyncio.sleep(0)
            (segment,) = mapping
            assert not task.done() and segment.fd >= 0 and pool._idle == []  # still mapped by the thread
            proceed.set()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert segment.fd < 0 and segment.name not in _segments(shm_server) and pool._idle == []
            monkeypatch.undo()
            got = await client.get_many("ns", keys)
            assert [bytes(b) for b in got] == [b for _, b in items]
            assert link.state == "on" and link.fallbacks == 0

    asyncio.run(run())


# -- the server's side: a cancelled call's thread stops, and the call waits for it --------------------


@pytest.mark.parametrize("op", ["write", "read"])
def test_a_cancelled_segment_thread_stops_between_blocks_and_is_waited_for(
    op: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Get's writes and Put's reads: the thread works on its own descriptor, stops after the block it
    is in, and the awaiting call does not end before the thread has."""
    fd = os.open(tmp_path / "segment", os.O_RDWR | os.O_CREAT, 0o600)
    os.pwrite(fd, b"x" * 3072, 0)
    entered, proceed = threading.Event(), threading.Event()
    used: list[int] = []  # the descriptor each block went through
    real = server_shm.write_range if op == "write" else server_shm.read_range

    def slow(own_fd: int, *args: Any) -> Any:
        entered.set()
        proceed.wait(30)
        used.append(own_fd)
        return real(own_fd, *args)

    monkeypatch.setattr(server_shm, f"{op}_range", slow)
    if op == "write":
        work = server_shm.write_ranges_in_thread(fd, [(b"a" * 1000, 0), (b"b" * 1000, 1024), (b"c" * 1000, 2048)])
    else:
        reads = [(i, fd, 3072, ShmRange("kvcache-" + "0" * 32, 1024 * i, 1000)) for i in range(3)]
        work = server_shm.read_ranges_in_thread(reads)

    async def run() -> None:
        task = asyncio.ensure_future(work)
        while not entered.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        for _ in range(20):
            await asyncio.sleep(0)
        assert not task.done()  # the call cannot end while its thread uses the segment
        proceed.set()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        before = sorted(os.listdir("/proc/self/fd"))
        asyncio.run(run())
        assert len(used) == 1 and used[0] != fd  # one block, through the thread's own duplicate; then it stopped
        assert sorted(os.listdir("/proc/self/fd")) == before  # which it closed
        assert os.pread(fd, 3072, 0) == (b"a" * 1000 if op == "write" else b"x" * 1000) + b"x" * 2072
    finally:
        os.close(fd)
