"""Lookups over the bulk port (LOOKUP / LOOKED_UP frames, docs/bulk.md).

Real servers (in this process, with a real redis-server below for the lower-tier case, and one child
process SIGSTOPped mid-call), the SDK's two faces and raw sockets. Every assertion is an exact count
or an exact answer; the only time bound is a call's own deadline.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import threading
from pathlib import Path

import grpc
import pytest

from kvcache_client import (
    AsyncKVCacheClient,
    DeadlineExceeded,
    InvalidRequest,
    KVCacheClient,
    PermissionDenied,
    RetryPolicy,
)
from kvcache_core import bulkwire as bw
from kvcache_server.auth import token_digest
from kvcache_server.launcher import ChildServer
from tests.backends import RedisProcess, free_port, sigstop
from tests.conftest import ServerThread, keyed

pytestmark = pytest.mark.timeout(120)

TOKENS = {"a": "kvc_bulk_lookup_tenant_a", "b": "kvc_bulk_lookup_tenant_b", "w": "kvc_bulk_lookup_write_only"}


def _blocks(n: int, size: int = 4096) -> list[tuple[bytes, bytes]]:
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

    def lookup(self, keys: list[bytes], namespace: str = "n") -> list[int]:
        self.send(bw.FrameType.LOOKUP, bw.lookup(namespace, keys, 5000))
        kind, payload = self.read()
        assert kind is bw.FrameType.LOOKED_UP, (kind, payload)
        return bw.parse_looked_up(payload)

    def error(self) -> tuple[grpc.StatusCode, str]:
        kind, payload = self.read()
        assert kind is bw.FrameType.ERROR, kind
        code, message = bw.parse_error(payload)
        return next(s for s in grpc.StatusCode if s.value[0] == code), message

    def close(self) -> None:
        self.sock.close()


def _looked_up(server: ServerThread) -> tuple[int, int]:
    c = server.running.bulk.counters
    return c.get("lookups"), c.get("lookups_on_loop")


def test_lookups_take_the_bulk_port_and_answer_as_the_grpc_lookup(make_server) -> None:
    """RAM only: every Lookup of a remote client (shm off) is one LOOKUP frame answered in the
    connection's thread (none on the loop), with exactly the gRPC Lookup's answers."""
    server = make_server(ram={"capacity_bytes": 32 << 20})
    items = _blocks(6)
    keys = [k for k, _ in items]
    other = os.urandom(16)
    asks = [keys, [*keys[:3], other, *keys[3:]], [other, *keys], [keys[0]], keys[::-1]]
    with (
        KVCacheClient(server.target, shm=False, timeout_s=10) as bulk,
        KVCacheClient(server.target, shm=False, bulk=False, timeout_s=10) as plain,
    ):
        assert plain.put_many("n", items).stored == 6
        over_grpc = [plain.lookup("n", ask) for ask in asks]
        assert _looked_up(server) == (0, 0)
        over_bulk = [bulk.lookup("n", ask) for ask in asks]
        assert over_bulk == over_grpc
        assert [r.prefix_length for r in over_bulk] == [6, 3, 0, 1, 6]
        assert over_bulk[0].tiers == ("ram",) * 6
        assert _looked_up(server) == (5, 0)
        assert bulk.bulk.counters.bulk_lookups == 5 and bulk.bulk.counters.fallbacks == 0
        assert plain.bulk.counters.bulk_lookups == 0


def test_a_lookup_that_needs_redis_is_answered_on_the_loop(make_server, redis_server: RedisProcess) -> None:
    """With Redis below RAM: a Lookup whose keys RAM all holds stays in the connection's thread; one
    that runs past RAM asks Redis on the loop (lookups_on_loop) and names each key's tier, as gRPC."""
    server = make_server(
        ram={"capacity_bytes": 32 << 20}, redis={"enabled": True, "url": redis_server.url, "write_mode": "through"}
    )
    items = _blocks(6)
    keys = [k for k, _ in items]
    with (
        KVCacheClient(server.target, shm=False, timeout_s=10) as bulk,
        KVCacheClient(server.target, shm=False, bulk=False, timeout_s=10) as plain,
    ):
        assert plain.put_many("n", items).stored == 6
        assert bulk.lookup("n", keys[:3]).tiers == ("ram",) * 3
        assert _looked_up(server) == (1, 0)
        assert server.stack.ram.delete_many_sync("n", keys[3:]) == 3  # now in Redis only
        expected = ("ram",) * 3 + ("redis",) * 3
        assert plain.lookup("n", keys).tiers == expected
        assert bulk.lookup("n", keys).tiers == expected
        assert bulk.lookup("n", [*keys, os.urandom(16)]).tiers == expected
        assert _looked_up(server) == (3, 2)
        assert bulk.bulk.counters.fallbacks == 0


def test_lookup_frames_keep_tenants_apart_and_refuse_bad_input(make_server, tmp_path: Path) -> None:
    """Raw frames and the SDK, auth on: tenant B's LOOKUP of A's keys finds none (its namespace "n"
    is its own); a token without the read right is PERMISSION_DENIED (the SDK's PermissionDenied,
    not asked again over gRPC); too many keys and a malformed frame are INVALID_ARGUMENT, the
    connection closed; the server goes on answering."""
    path = tmp_path / "tokens.toml"
    rights = {"a": '["read", "write"]', "b": '["read", "write"]', "w": '["write"]'}
    path.write_text(
        "".join(
            f'[[tokens]]\nname = "{t}"\ntenant = "{t}"\nsha256 = "{token_digest(tok).hex()}"\nrights = {rights[t]}\n'
            for t, tok in TOKENS.items()
        )
    )
    server = make_server(
        ram={"capacity_bytes": 32 << 20},
        auth={"enabled": True, "tokens_file": str(path)},
        limits={"max_keys_per_request": 8},
    )
    items = _blocks(4)
    keys = [k for k, _ in items]
    with KVCacheClient(server.target, token=TOKENS["a"], shm=False, timeout_s=10) as client:
        assert client.put_many("n", items).stored == 4
        assert client.lookup("n", keys).prefix_length == 4
        with pytest.raises(InvalidRequest, match="max_keys_per_request"):
            client.lookup("n", [os.urandom(16) for _ in range(9)])
        assert client.bulk.counters.bulk_lookups == 1 and client.bulk.counters.fallbacks == 0
    with KVCacheClient(
        server.target, token=TOKENS["w"], shm=False, timeout_s=10, retry=RetryPolicy(max_attempts=1)
    ) as writer:
        with pytest.raises(PermissionDenied):
            writer.lookup("n", keys)
        assert writer.bulk.counters.fallbacks == 0
    bulk_port = server.running.bulk.port
    a, b = Raw(bulk_port, TOKENS["a"]), Raw(bulk_port, TOKENS["b"])
    try:
        assert a.lookup(keys) == [1] * 4  # kvcache.v1.Tier RAM
        assert b.lookup(keys) == []
        assert a.lookup(keys, namespace="other") == []
        a.send(bw.FrameType.LOOKUP, bw.lookup("n", keys, 1000)[:-3])  # the last key cut short
        code, message = a.error()
        assert code is grpc.StatusCode.INVALID_ARGUMENT and "LOOKUP" in message, message
        b.send(bw.FrameType.LOOKUP, bw.lookup("bad namespace", keys, 1000))
        code, message = b.error()
        assert code is grpc.StatusCode.INVALID_ARGUMENT and "namespace" in message, message
    finally:
        a.close()
        b.close()
    w = Raw(bulk_port, TOKENS["w"])
    try:
        w.send(bw.FrameType.LOOKUP, bw.lookup("n", keys, 1000))
        code, _ = w.error()
        assert code is grpc.StatusCode.PERMISSION_DENIED
    finally:
        w.close()
    c = Raw(bulk_port, TOKENS["a"])
    try:
        assert c.lookup(keys) == [1] * 4
    finally:
        c.close()
    assert server.running.bulk.counters.get("lookups") == 5  # the answered ones; refusals are errors


def test_pipelined_and_trickled_requests_are_answered_in_order(make_server) -> None:
    """The session reads ahead (64 KiB per connection): 200 LOOKUPs sent in one write, the read-ahead
    cutting frames at every boundary, are answered in order, each with its own keys; a request sent
    one byte per write is answered as well."""
    server = make_server(ram={"capacity_bytes": 32 << 20})
    items = _blocks(8)
    keys = [k for k, _ in items]
    with KVCacheClient(server.target, shm=False, timeout_s=10) as client:
        assert client.put_many("n", items).stored == 8
    raw = Raw(server.running.bulk.port)
    try:
        wanted = [keys[: i % 8] + [os.urandom(16)] * (1 + i % 3) for i in range(200)]  # a prefix of i % 8
        raw.sock.sendall(
            b"".join(bw.header(bw.FrameType.LOOKUP, len(p)) + p for p in (bw.lookup("n", w, 5000) for w in wanted))
        )
        for w in wanted:
            kind, payload = raw.read()
            assert kind is bw.FrameType.LOOKED_UP
            assert bw.parse_looked_up(payload) == [1] * (len(w) - sum(1 for k in w if k not in keys)), w
        frame = bw.header(bw.FrameType.LOOKUP, len(p := bw.lookup("n", keys, 5000))) + p
        for i in range(len(frame)):
            raw.sock.sendall(frame[i : i + 1])
        kind, payload = raw.read()
        assert kind is bw.FrameType.LOOKED_UP and bw.parse_looked_up(payload) == [1] * 8
    finally:
        raw.close()
    assert _looked_up(server) == (201, 0)


def test_a_lookup_against_a_stopped_server_ends_at_its_deadline(tmp_path: Path) -> None:
    """A server process stopped (SIGSTOP) while a Lookup waits for its LOOKED_UP: the call fails with
    DeadlineExceeded at its deadline (its connection closed, not pooled); after SIGCONT the next
    Lookup is answered over the bulk port again, with no fallback to gRPC."""
    port, bulk_port = free_port(), free_port()
    argv = [sys.executable, "-m", "kvcache_server", "--port", str(port), "--log-level", "warning"]
    env = {
        **os.environ,
        "KVCACHE_BULK_PORT": str(bulk_port),
        "KVCACHE_SHM_ENABLED": "false",
        "KVCACHE_RAM_CAPACITY_BYTES": str(16 << 20),
        "KVCACHE_RAM_PREFAULT": "0",
    }
    child = ChildServer("kvcache-server", argv, env=env, cwd=str(Path(__file__).resolve().parent.parent))
    assert child.launch(rf"bulk 127\.0\.0\.1:{bulk_port}\b") is not None
    try:
        items = _blocks(4)
        keys = [k for k, _ in items]
        with KVCacheClient(f"127.0.0.1:{port}", timeout_s=10, retry=RetryPolicy(max_attempts=1)) as client:
            assert client.put_many("n", items).stored == 4
            assert client.lookup("n", keys).prefix_length == 4
            sigstop(child.proc.pid)
            timer = threading.Timer(1.0, os.kill, (child.proc.pid, signal.SIGCONT))
            timer.start()
            try:
                with pytest.raises(DeadlineExceeded):
                    client.lookup("n", keys, timeout_s=0.2)
            finally:
                timer.join()
                os.kill(child.proc.pid, signal.SIGCONT)
            assert client.lookup("n", keys).prefix_length == 4
            assert client.bulk.counters.bulk_lookups == 2
            assert client.bulk.counters.fallbacks == 0
    finally:
        child.stop()


def test_the_asyncio_client_looks_up_over_the_bulk_port(make_server) -> None:
    server = make_server(ram={"capacity_bytes": 32 << 20})
    items = _blocks(3)
    keys = [k for k, _ in items]

    async def main() -> None:
        async with AsyncKVCacheClient(server.target, shm=False, timeout_s=10) as client:
            assert (await client.put_many("n", items)).stored == 3
            results = await asyncio.gather(*(client.lookup("n", keys[: i + 1]) for i in range(3)))
            assert [r.prefix_length for r in results] == [1, 2, 3]
            assert client.bulk.counters.bulk_lookups == 3 and client.bulk.counters.fallbacks == 0

    asyncio.run(main())
    assert _looked_up(server) == (3, 0)


def test_lookup_wire_round_trips_and_refuses_garbage() -> None:
    keys = [os.urandom(16) for _ in range(3)]
    assert bw.parse_lookup(bw.lookup("ns", keys, 250)) == ("ns", 250, keys)
    assert bw.parse_lookup(bw.lookup("ns", [], 0)) == ("ns", 0, [])
    assert bw.parse_looked_up(bw.looked_up([1, 2, 3])) == [1, 2, 3]
    assert bw.parse_looked_up(bw.looked_up([])) == []
    for bad in (bw.lookup("ns", keys, 1)[:-1], bw.lookup("ns", keys, 1) + b"x", b"\x05\x00ns"):
        with pytest.raises(bw.FrameError):
            bw.parse_lookup(bad)
    for bad in (b"", bw.looked_up([1, 2])[:-1], bw.looked_up([1]) + b"\x01"):
        with pytest.raises(bw.FrameError):
            bw.parse_looked_up(bad)
