"""Same-host in-place reads lease over the bulk port (LEASE / RELEASE frames, docs/bulk.md).

Real servers (in this process, and one child process SIGSTOPped mid-call), the SDK and raw sockets.
Every assertion is an exact count or exact bytes; the only time bound is a call's own deadline.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from kvcache_client import AsyncKVCacheClient, DeadlineExceeded, KVCacheClient
from kvcache_core import bulkwire as bw
from kvcache_core.format import payload_view
from kvcache_server.auth import token_digest
from kvcache_server.launcher import ChildServer
from tests.backends import free_port, sigstop, wait_for
from tests.conftest import ServerThread, keyed

pytestmark = pytest.mark.timeout(120)

TOKENS = {"a": "kvc_bulk_lease_tenant_a", "b": "kvc_bulk_lease_tenant_b"}


def _blocks(n: int, size: int) -> list[tuple[bytes, bytes]]:
    return [keyed(os.urandom(size)) for _ in range(n)]


class Raw:
    """A bulk connection made of a plain socket."""

    def __init__(self, port: int, token: str = "") -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.send(bw.FrameType.HELLO, bw.hello(token))
        kind, _ = self.read()
        assert kind is bw.FrameType.READY

    def send(self, kind: bw.FrameType, payload: bytes) -> None:
        self.sock.sendall(bw.header(kind, len(payload)) + payload)

    def read(self) -> tuple[bw.FrameType, bytes]:
        head = bytearray(bw.HEADER_BYTES)
        bw.recv_exact(self.sock, memoryview(head), "header")
        kind, length = bw.parse_header(head, 1 << 30)
        payload = bytearray(length)
        bw.recv_exact(self.sock, memoryview(payload), "payload")
        return kind, bytes(payload)

    def lease(self, keys: list[bytes], prefix_only: bool = False, ends: list[int] | None = None) -> list[tuple]:
        self.send(bw.FrameType.LEASE, bw.lease("n", keys, prefix_only, ends or []))
        kind, payload = self.read()
        assert kind is bw.FrameType.LEASED, (kind, payload)
        return bw.parse_leased(payload)[2]

    def release(self, ids: list[int]) -> int:
        self.send(bw.FrameType.RELEASE, bw.release(ids))
        kind, payload = self.read()
        assert kind is bw.FrameType.RELEASED, (kind, payload)
        return bw.parse_released(payload)

    def error(self) -> tuple[grpc.StatusCode, str]:
        kind, payload = self.read()
        assert kind is bw.FrameType.ERROR, kind
        code, message = bw.parse_error(payload)
        return next(s for s in grpc.StatusCode if s.value[0] == code), message

    def close(self) -> None:
        self.sock.close()


def _open_leases(server: ServerThread) -> int:
    return server.stack.ram.arena_stats()["leases"]


def _leases_after_gets(server: ServerThread, timeout_s: float = 5.0) -> int:
    """_open_leases once the server's bulk GETs have ended on its side: a GET leases its blocks until
    its send returns, and the client may hold every byte before the server's thread hands them back.
    Bounded: a leaked lease (600 s: SERVE_LEASE_S) or one the client holds is still counted."""
    end = time.monotonic() + timeout_s
    while (n := _open_leases(server)) and time.monotonic() < end:
        time.sleep(0.01)
    return n


def _child_server(tmp_path: Path) -> tuple[ChildServer, int]:
    """A server process (one a test can SIGSTOP), its shm directory under tmp_path, leases that do not
    expire within a test; and its gRPC port."""
    port, bulk_port = free_port(), free_port()
    argv = [sys.executable, "-m", "kvcache_server", "--port", str(port), "--log-level", "warning"]
    env = {
        **os.environ,
        "KVCACHE_BULK_PORT": str(bulk_port),
        "KVCACHE_SHM_DIR": str(tmp_path / "shm"),
        "KVCACHE_RAM_CAPACITY_BYTES": str(64 << 20),
        "KVCACHE_RAM_PREFAULT": "0",
        "KVCACHE_RAM_LEASE_TIMEOUT_S": "120",
    }
    child = ChildServer("kvcache-server", argv, env=env, cwd=str(Path(__file__).resolve().parent.parent))
    assert child.launch(rf"bulk 127\.0\.0\.1:{bulk_port}\b") is not None
    return child, port


def test_same_host_reads_lease_over_the_bulk_port_not_grpc(make_server, tmp_path: Path) -> None:
    """get_many, get_into and leased() each take one LEASE frame and one RELEASE frame on the bulk
    port (get_into with its reads straight out of the arena off: test_local_reads.py has those); the
    bytes are the stored ones; nothing stays leased once each call returned."""
    server = make_server(ram={"capacity_bytes": 64 << 20}, shm={"dir": str(tmp_path / "shm")})
    items = _blocks(16, 64 << 10)
    keys = [k for k, _ in items]
    total = sum(len(b) for _, b in items)
    with KVCacheClient(server.target, timeout_s=10) as client:
        client.bulk.same_host_get_bytes = 0  # this test is about leases: no get as one bulk GET
        client.bulk.read_in_place = False  # nor get_into's copies straight out of the arena
        assert client.put_many("n", items).stored == 16
        assert [bytes(b) for b in client.get_many("n", keys)] == [b for _, b in items]
        assert _open_leases(server) == 0
        buffers = [bytearray(64 << 10) for _ in keys]
        assert client.get_into("n", keys, buffers) == [True] * 16
        assert [bytes(b) for b in buffers] == [bytes(payload_view(b)) for _, b in items]
        assert _open_leases(server) == 0
        with client.leased("n", keys) as views:
            assert [bytes(v) for v in views] == [b for _, b in items]
            assert _open_leases(server) == 16
        assert _open_leases(server) == 0
        assert server.running.bulk.counters.get("leases") == 3  # one LEASE a call, no LeaseGet
        assert client.bulk.counters.fallbacks == 0
        assert client.stats().inplace_bytes_leased == 3 * total


def test_a_lease_answer_nobody_waits_for_is_released_not_left_to_expire(tmp_path: Path) -> None:
    """A server process stopped (SIGSTOP) while a get_into waits for its LEASE answer: the call
    fails with its deadline; once the server resumes, the answer's leases are released by the
    SDK (handed_back 1), none is left to expire, and the next get is served in place again."""
    child, port = _child_server(tmp_path)
    try:
        items = _blocks(8, 32 << 10)
        keys = [k for k, _ in items]
        with KVCacheClient(f"127.0.0.1:{port}", timeout_s=10) as client:
            client.bulk.same_host_get_bytes = 0  # this test is about leases: no get as one bulk GET
            client.bulk.read_in_place = False  # nor get_into's copies straight out of the arena
            assert client.put_many("n", items).stored == 8
            buffers = [bytearray(32 << 10) for _ in keys]
            assert client.get_into("n", keys, buffers) == [True] * 8  # warm: Info asked, arena mapped
            inplace = client._transport.inner._inplace
            assert inplace.handed_back == 0
            sigstop(child.proc.pid)
            timer = threading.Timer(0.6, os.kill, (child.proc.pid, signal.SIGCONT))
            timer.start()
            try:
                with pytest.raises(DeadlineExceeded):
                    client.get_into("n", keys, buffers, timeout_s=0.2)
            finally:
                timer.join()
                os.kill(child.proc.pid, signal.SIGCONT)
            wait_for(lambda: inplace.handed_back == 1 and not inplace.book.pending, 10, "the late LEASE settled")
            stats = client.stats()
            assert (stats.arena_leases, stats.arena_leases_expired) == (0, 0)
            buffers = [bytearray(32 << 10) for _ in keys]
            assert client.get_into("n", keys, buffers) == [True] * 8
            assert [bytes(b) for b in buffers] == [bytes(payload_view(b)) for _, b in items]
    finally:
        child.stop()


def test_lease_frames_keep_tenants_apart_and_refuse_bad_input(make_server, tmp_path: Path) -> None:
    """Raw frames, two tenants on one shared arena: B's RELEASE (or a LEASE's ids to end) naming
    A's leases ends none of them; prefix_only stops at the first miss and keeps no lease past it;
    a malformed LEASE is INVALID_ARGUMENT and the connection closed; the server goes on."""
    path = tmp_path / "tokens.toml"
    path.write_text(
        "".join(
            f'[[tokens]]\nname = "{t}"\ntenant = "{t}"\nsha256 = "{token_digest(tok).hex()}"\n'
            'rights = ["read", "write"]\n'
            for t, tok in TOKENS.items()
        )
    )
    server = make_server(
        ram={"capacity_bytes": 64 << 20},
        shm={"dir": str(tmp_path / "shm"), "share_arena_across_tenants": True},
        auth={"enabled": True, "tokens_file": str(path)},
    )
    items = _blocks(4, 16 << 10)
    keys = [k for k, _ in items]
    with KVCacheClient(server.target, token=TOKENS["a"], timeout_s=10) as client:
        assert client.put_many("n", items).stored == 4
    bulk_port = server.running.bulk.port
    a, b = Raw(bulk_port, TOKENS["a"]), Raw(bulk_port, TOKENS["b"])
    try:
        slots = a.lease(keys)
        ids = [i for i, _, _ in slots]
        assert all(n for _, _, n in slots) and _open_leases(server) == 4
        assert [n for _, _, n in b.lease(keys)] == [0, 0, 0, 0]  # B's namespace "n" is B's own: misses
        assert b.release(ids) == 0 and _open_leases(server) == 4
        assert [n for _, _, n in b.lease(keys, ends=ids)] == [0, 0, 0, 0] and _open_leases(server) == 4
        missing = os.urandom(16)
        prefix = a.lease([keys[0], keys[1], missing, keys[2]], prefix_only=True)
        assert [n > 0 for _, _, n in prefix] == [True, True, False]  # through the first miss, no further
        assert _open_leases(server) == 6
        assert a.release(ids + [i for i, _, n in prefix if n]) == 6 and _open_leases(server) == 0
        a.send(bw.FrameType.LEASE, bw.lease("n", keys, False)[:-3])  # the ids' count cut short
        code, message = a.error()
        assert code is grpc.StatusCode.INVALID_ARGUMENT and "LEASE" in message, message
    finally:
        a.close()
        b.close()
    c = Raw(bulk_port, TOKENS["a"])
    try:
        assert [n > 0 for _, _, n in c.lease(keys)] == [True] * 4
        assert c.release([i for i, _, _ in c.lease(keys)]) == 4
    finally:
        c.close()
    # c's first LEASE was never ended: a lost lease lasts until ram.lease_timeout_s, the connection's close ends none
    assert _open_leases(server) == 4


def test_lease_without_a_shared_arena_is_failed_precondition(make_server, tmp_path: Path) -> None:
    server = make_server(ram={"capacity_bytes": 16 << 20}, shm={"enabled": False})
    raw = Raw(server.running.bulk.port)
    try:
        raw.send(bw.FrameType.LEASE, bw.lease("n", [os.urandom(16)], False))
        code, message = raw.error()
        assert code is grpc.StatusCode.FAILED_PRECONDITION and "not shared" in message
    finally:
        raw.close()


def test_lease_wire_round_trips_and_refuses_garbage() -> None:
    keys = [os.urandom(16) for _ in range(3)]
    assert bw.parse_lease(bw.lease("ns", keys, True, [7, 2**64 - 1])) == ("ns", True, keys, [7, 2**64 - 1])
    slots = [(1, 0, 10), (0, 0, 0), (3, 4096, 5)]
    assert bw.parse_leased(bw.leased(30.0, "/dev/shm/x", slots)) == (30.0, "/dev/shm/x", slots)
    assert bw.parse_release(bw.release([5, 6])) == [5, 6]
    assert bw.parse_released(bw.released(9)) == 9
    with pytest.raises(bw.FrameError, match="more than"):
        bw.parse_release((bw.MAX_IDS + 1).to_bytes(4, "little"))
    with pytest.raises(bw.FrameError):
        bw.parse_leased(bw.leased(1.0, "p", slots)[:-1])
    with pytest.raises(bw.FrameError):
        bw.parse_lease(bw.lease("ns", keys, False)[:-20])


def test_small_same_host_puts_go_over_the_bulk_port_large_ones_out_of_the_clients_memory(
    make_server, tmp_path: Path
) -> None:
    """Below bulk.SAME_HOST_BULK_PUT_BYTES a same-host put is one bulk PUT (cheaper than a segment
    and a gRPC Put for small blocks); a larger one the server reads out of the client's memory, named
    in a PUT_MEM frame on the same port (tests/test_bulk_put_mem.py), its bytes never on the socket."""
    server = make_server(ram={"capacity_bytes": 64 << 20}, shm={"dir": str(tmp_path / "shm")})
    small, large = _blocks(20, 16 << 10), _blocks(4, 512 << 10)
    with KVCacheClient(server.target, timeout_s=10) as client:
        assert client.put_many("n", small).stored == 20
        assert server.running.bulk.counters.get("puts") == 1
        assert client.bulk.counters.bulk_bytes_sent == sum(len(b) for _, b in small)
        assert client.put_many("n", large).stored == 4
        assert server.running.bulk.counters.get("puts") == 2
        assert client.bulk.counters.bulk_bytes_sent == sum(len(b) for _, b in small)
        assert client.bulk.counters.put_mem_bytes == sum(len(b) for _, b in large)
        assert client.stats().shm_bytes_received == sum(len(b) for _, b in large)
        got = client.get_many("n", [k for k, _ in small + large])
        assert [bytes(g) for g in got] == [b for _, b in small + large]
        assert _open_leases(server) == 0


def test_the_asyncio_face_leases_and_puts_small_over_the_bulk_port(make_server, tmp_path: Path) -> None:
    """AsyncKVCacheClient on the server's host, as the blocking client: a put of 20 x 16 KiB is one
    bulk PUT, a large one goes through its segment; get_many, get_into and leased() are one LEASE
    and one RELEASE frame each (no LeaseGet over gRPC); then 200 get_many calls ended by deadlines
    of 0.2-5 ms or cancelled leave no lease open once the client drained, none left to expire."""
    server = make_server(ram={"capacity_bytes": 64 << 20, "lease_timeout_s": 120.0}, shm={"dir": str(tmp_path / "shm")})
    small, large = _blocks(20, 16 << 10), _blocks(4, 512 << 10)
    keys = [k for k, _ in small]
    counters = server.running.bulk.counters
    rng = random.Random(7)

    async def run() -> dict[str, int]:
        ended = {"ok": 0, "deadline": 0, "cancelled": 0}
        async with AsyncKVCacheClient(server.target, timeout_s=10) as client:
            client.bulk.same_host_get_bytes = 0  # this test is about leases: no get as one bulk GET
            client.bulk.read_in_place = False  # nor get_into's copies straight out of the arena
            assert (await client.put_many("n", small)).stored == 20
            assert counters.get("puts") == 1
            assert client.bulk.counters.bulk_bytes_sent == sum(len(b) for _, b in small)
            assert (await client.put_many("n", large)).stored == 4
            assert counters.get("puts") == 1 and (await client.stats()).shm_bytes_received == sum(
                len(b) for _, b in large
            )
            assert [bytes(g) for g in await client.get_many("n", keys)] == [b for _, b in small]
            buffers = [bytearray(16 << 10) for _ in keys]
            assert await client.get_into("n", keys, buffers) == [True] * 20
            assert [bytes(b) for b in buffers] == [bytes(payload_view(b)) for _, b in small]
            async with client.leased("n", keys) as views:
                assert [bytes(v) for v in views] == [b for _, b in small]
                assert _open_leases(server) == 20
            assert _open_leases(server) == 0
            assert (counters.get("leases"), counters.get("releases")) == (3, 3)
            for _ in range(200):
                task = asyncio.ensure_future(client.get_many("n", keys, timeout_s=rng.uniform(0.0002, 0.005)))
                if rng.random() < 0.3:
                    await asyncio.sleep(rng.uniform(0, 0.002))
                    task.cancel()
                try:
                    got = await task
                    assert [bytes(g) for g in got] == [b for _, b in small]
                    ended["ok"] += 1
                except DeadlineExceeded:
                    ended["deadline"] += 1
                except asyncio.CancelledError:
                    ended["cancelled"] += 1
            await client._transport.inner._inplace.drain()
            assert _open_leases(server) == 0
            stats = await client.stats()
            assert (stats.arena_leases, stats.arena_leases_expired) == (0, 0)
            assert client.bulk.counters.fallbacks == 0
        return ended

    ended = asyncio.run(run())
    assert sum(ended.values()) == 200 and ended["deadline"] + ended["cancelled"] > 0, ended
    assert server.stack.ram.arena_stats()["leases"] == 0


def test_the_asyncio_face_releases_a_lease_answer_nobody_waits_for(tmp_path: Path) -> None:
    """A server process stopped (SIGSTOP) while an asyncio get_into waits for its LEASE answer: the
    call fails with its deadline; once the server resumes, the worker thread reads the answer and the
    client releases its leases (handed_back 1), none left to expire."""
    child, port = _child_server(tmp_path)
    items = _blocks(8, 32 << 10)
    keys = [k for k, _ in items]

    async def run() -> None:
        async with AsyncKVCacheClient(f"127.0.0.1:{port}", timeout_s=10) as client:
            client.bulk.same_host_get_bytes = 0  # this test is about leases: no get as one bulk GET
            client.bulk.read_in_place = False  # nor get_into's copies straight out of the arena
            assert (await client.put_many("n", items)).stored == 8
            buffers = [bytearray(32 << 10) for _ in keys]
            assert await client.get_into("n", keys, buffers) == [True] * 8  # warm: Info asked, arena mapped
            inplace = client._transport.inner._inplace
            sigstop(child.proc.pid)
            timer = threading.Timer(0.6, os.kill, (child.proc.pid, signal.SIGCONT))
            timer.start()
            try:
                with pytest.raises(DeadlineExceeded, match="LEASE"):
                    await client.get_into("n", keys, buffers, timeout_s=0.2)
            finally:
                timer.join()
                os.kill(child.proc.pid, signal.SIGCONT)
            await inplace.drain()
            assert inplace.handed_back == 1
            stats = await client.stats()
            assert (stats.arena_leases, stats.arena_leases_expired) == (0, 0)
            buffers = [bytearray(32 << 10) for _ in keys]
            assert await client.get_into("n", keys, buffers) == [True] * 8
            assert [bytes(b) for b in buffers] == [bytes(payload_view(b)) for _, b in items]
            assert client.bulk.counters.fallbacks == 0

    try:
        asyncio.run(run())
    finally:
        child.stop()


def test_asyncio_leases_nobody_waits_for_leave_the_default_executor_free(tmp_path: Path) -> None:
    """Against a stopped server, asyncio get_into calls that gave up on their LEASE leave its thread
    waiting for the answer (to the caller's deadline plus 5 s): more of them than the event loop's
    default executor has threads. Those threads are the client's own, so the process's other
    to_thread work (bulk gets to other servers, copies) still runs at once; once the server resumes,
    every late answer's leases are released."""
    child, port = _child_server(tmp_path)
    items = _blocks(2, 32 << 10)
    keys = [k for k, _ in items]
    abandoned = min(32, (os.cpu_count() or 1) + 4) + 4  # more than the default executor's threads

    async def run() -> None:
        async with AsyncKVCacheClient(f"127.0.0.1:{port}", timeout_s=10) as client:
            client.bulk.same_host_get_bytes = 0  # this test is about leases: no get as one bulk GET
            client.bulk.read_in_place = False  # nor get_into's copies straight out of the arena
            assert (await client.put_many("n", items)).stored == 2
            buffers = [bytearray(32 << 10) for _ in keys]
            assert await client.get_into("n", keys, buffers) == [True] * 2  # warm
            inplace = client._transport.inner._inplace
            sigstop(child.proc.pid)
            try:
                for _ in range(abandoned):
                    with pytest.raises(DeadlineExceeded, match="LEASE"):
                        await client.get_into("n", keys, buffers, timeout_s=0.02)
                assert await asyncio.wait_for(asyncio.to_thread(int), 2.0) == 0  # the default executor is free
            finally:
                os.kill(child.proc.pid, signal.SIGCONT)
            await inplace.drain()
            assert inplace.handed_back == abandoned
            stats = await client.stats()
            assert (stats.arena_leases, stats.arena_leases_expired) == (0, 0)

    try:
        asyncio.run(run())
    finally:
        child.stop()


def test_small_same_host_gets_are_one_bulk_get_and_large_ones_lease(make_server, tmp_path: Path) -> None:
    """A same-host get expected (its keys times the last get's mean block) to move less than
    bulk.SAME_HOST_BULK_GET_BYTES is one GET frame, its payloads received into the caller's memory
    and verified there: no LEASE, no RELEASE, no lease left. Larger ones, and every get with
    same_host_get_bytes = 0, lease in place. Both faces; the bytes exact every time. (get_into's
    copies straight out of the arena are off here: tests/test_local_reads.py has those.)"""
    server = make_server(ram={"capacity_bytes": 64 << 20}, shm={"dir": str(tmp_path / "shm")})
    counters = server.running.bulk.counters
    small, large = _blocks(8, 16 << 10), _blocks(4, 2 << 20)
    sk, lk = [k for k, _ in small], [k for k, _ in large]
    small_total = sum(len(b) for _, b in small)

    def frames() -> tuple[int, int, int]:
        return counters.get("gets"), counters.get("leases"), counters.get("releases")

    def payloads(items: list[tuple[bytes, bytes]]) -> list[bytes]:
        return [bytes(payload_view(b)) for _, b in items]

    with KVCacheClient(server.target, timeout_s=10) as client:
        client.bulk.read_in_place = False
        assert client.put_many("n", small + large).stored == 12
        dst = [bytearray(16 << 10) for _ in sk]
        before = frames()
        assert client.get_into("n", sk, dst) == [True] * 8  # no block size seen yet: it leases
        assert frames() == (before[0], before[1] + 1, before[2] + 1)
        assert client.get_into("n", sk, [bytearray(16 << 10) for _ in sk]) == [True] * 8
        dst = [bytearray(16 << 10) for _ in sk]
        assert client.get_into("n", sk, dst) == [True] * 8  # 8 x 16 KiB expected: one GET
        assert [bytes(d) for d in dst] == payloads(small)
        assert [bytes(b) for b in client.get_many("n", sk)] == [b for _, b in small]
        with client.leased("n", sk) as views:
            assert [bytes(v) for v in views] == [b for _, b in small]
            assert _leases_after_gets(server) == 0  # this leased() was a GET: no lease in place
        assert frames() == (before[0] + 4, before[1] + 1, before[2] + 1)
        assert client.bulk.counters.bulk_bytes_landed == 2 * small_total
        assert [bytes(b) for b in client.get_many("n", lk)] == [b for _, b in large]  # judged small: a GET
        gets = frames()
        dst = [bytearray(2 << 20) for _ in lk]
        assert client.get_into("n", lk, dst) == [True] * 4  # 4 x 2 MiB expected: leased in place
        assert [bytes(d) for d in dst] == payloads(large)
        assert frames() == (gets[0], gets[1] + 1, gets[2] + 1)
        client.bulk.same_host_get_bytes = 0
        assert [bytes(b) for b in client.get_many("n", sk)] == [b for _, b in small]
        assert frames() == (gets[0], gets[1] + 2, gets[2] + 2)
        assert _leases_after_gets(server) == 0 and client.corrupt_blocks == 0

    async def run() -> None:
        async with AsyncKVCacheClient(server.target, timeout_s=10) as aclient:
            aclient.bulk.read_in_place = False
            assert await aclient.get_into("n", sk, [bytearray(16 << 10) for _ in sk]) == [True] * 8
            start = frames()
            dst = [bytearray(16 << 10) for _ in sk]
            assert await aclient.get_into("n", sk, dst) == [True] * 8
            assert [bytes(d) for d in dst] == payloads(small)
            assert [bytes(b) for b in await aclient.get_many("n", sk)] == [b for _, b in small]
            assert frames() == (start[0] + 2, start[1], start[2])
            assert aclient.bulk.counters.bulk_bytes_landed == small_total

    asyncio.run(run())
    assert _leases_after_gets(server) == 0
