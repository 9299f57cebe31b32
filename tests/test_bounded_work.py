"""Bounded work per call: no Put or Get, however crafted or however slow its client, makes the server
allocate ahead of the data, freeze its event loop, or hold memory without bound or end.

Memory is measured two ways: exactly, through the server's in-flight budget (Stats.inflight_bytes),
and as the RSS of a real `python -m kvcache_server` process where the old code's failure was RSS.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvcache_client import KVCacheClient, RetryPolicy
from kvcache_core.blockwire import BlockPart, encode_put_request
from kvcache_proto import kvcache_pb2 as pb
from tests.backends import RedisProcess, rss_bytes, wait_for
from tests.conftest import ServerThread, raw_block

pytestmark = pytest.mark.timeout(120)

NS = "bounded"
PUT = "/kvcache.v1.KVCache/Put"
GET = "/kvcache.v1.KVCache/Get"
ONCE = RetryPolicy(max_attempts=1)
REPO = Path(__file__).resolve().parent.parent


class ServerProcess:
    """`python -m kvcache_server` in a child process, for RSS."""

    def __init__(self, *args: str) -> None:
        argv = [sys.executable, "-m", "kvcache_server", "--port", "0", "--log-level", "warning", *args]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=REPO)
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        match = re.search(r" on (\S+:\d+)", line)
        assert match, line
        self.target = match.group(1)

    def rss(self) -> int:
        return rss_bytes(self.proc.pid)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class StalledPut:
    """A Put stream that sends `messages`, then sends nothing until released."""

    def __init__(self, channel: grpc.Channel, messages: list[bytes], timeout_s: float = 60) -> None:
        self._release = threading.Event()
        self.sent = threading.Event()
        self.code: grpc.StatusCode | None = None
        self.details = ""

        def requests() -> Iterator[bytes]:
            yield from messages
            self.sent.set()
            self._release.wait(timeout_s)

        def run() -> None:
            try:
                channel.stream_unary(PUT, lambda b: b, lambda b: b)(requests(), timeout=timeout_s)
                self.code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                self.code, self.details = exc.code(), exc.details() or ""

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        assert self.sent.wait(30)

    def release(self) -> None:
        self._release.set()
        self._thread.join(30)


def first_part(key: bytes, announced: int, data: bytes = b"x" * 96) -> bytes:
    """A Put message holding only the first part of a block that announces `announced` bytes."""
    return encode_put_request(NS, [(key, BlockPart(data, True, announced))])


def test_a_first_part_announcing_64_mib_holds_only_what_arrived() -> None:
    """Old code: each first part zero-filled a buffer of its announced length (12 streams: +768 MiB RSS)."""
    server = ServerProcess("--set", "limits.put_idle_timeout_s=60")
    try:
        with KVCacheClient(server.target, timeout_s=10) as client:
            client.lookup(NS, [bytes(16)])  # warm: the server's first call allocates its own buffers
            before = server.rss()
            with grpc.insecure_channel(server.target) as channel:
                streams = [StalledPut(channel, [first_part(os.urandom(16), 64 << 20)]) for _ in range(12)]
                wait_for(lambda: client.stats().inflight_bytes == 12 * 96, what="the 12 first parts counted")
                grown = server.rss() - before
                for s in streams:
                    s.release()
            assert grown < 32 << 20, f"RSS grew {grown >> 20} MiB for 12 x 96 bytes"
            assert {s.code for s in streams} == {grpc.StatusCode.INVALID_ARGUMENT}  # ended inside a block
            assert all("ended inside block 0" in s.details for s in streams)
            wait_for(lambda: client.stats().inflight_bytes == 0, what="the streams' bytes released")
    finally:
        server.stop()


def test_a_message_of_millions_of_empty_blocks_is_refused_without_freezing_the_server(server: ServerThread) -> None:
    """Old code: 4.2 million empty Blocks were parsed on the event loop first (Lookups stalled 4-16 s)."""
    flood = encode_put_request(NS, []) + b"\x12\x00" * 4_200_000  # 8.4 MB: namespace, then empty Blocks
    failures: list[BaseException] = []
    done = threading.Event()

    def lookups() -> None:
        with KVCacheClient(server.target, retry=ONCE) as other:
            while not done.is_set():
                try:
                    other.lookup("tenant-b", [bytes(16)], timeout_s=0.5)
                except Exception as exc:  # a stalled loop: DeadlineExceeded
                    failures.append(exc)
                time.sleep(0.01)

    prober = threading.Thread(target=lookups)
    prober.start()
    try:
        options = [("grpc.max_send_message_length", 64 << 20)]
        with grpc.insecure_channel(server.target, options=options) as channel:
            for _ in range(3):
                with pytest.raises(grpc.RpcError) as info:
                    channel.stream_unary(PUT, lambda b: b, lambda b: b)(iter([flood]), timeout=30)
                assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "max_put_stream_blocks=262144" in (info.value.details() or "")
    finally:
        done.set()
        prober.join(30)
    assert failures == []
    with KVCacheClient(server.target) as client:
        assert client.stats().inflight_bytes == 0


def test_a_get_from_redis_of_many_large_blocks_holds_one_window(redis_server: RedisProcess) -> None:
    """Old code: one Get of 48 x 8 MiB blocks held in Redis held all 384 MiB at once (peak 467 MiB, 64 MiB cap)."""
    server = ServerProcess(
        "--ram-capacity",
        "64MiB",
        "--max-block-bytes",
        "8MiB",
        "--set",
        "limits.get_window_bytes=32MiB",
        "--set",
        "redis.enabled=true",
        "--set",
        f"redis.url={redis_server.url}",
        "--set",
        "redis.queue_max_bytes=32MiB",
        "--set",
        "redis.timeout_s=10",
    )
    try:
        keys = [os.urandom(16) for _ in range(48)]
        payload = os.urandom(8 << 20)
        with KVCacheClient(server.target, timeout_s=60, shm=False, bulk=False) as client:
            for i in range(0, 48, 4):  # through the server: RAM keeps the newest few, Redis all of them
                batch = [(k, raw_block(k, payload[: (8 << 20) - 64])) for k in keys[i : i + 4]]
                assert client.put_many(NS, batch).tier("redis").stored == 4
            assert client.lookup(NS, keys).prefix_length == 48
            before = server.rss()
            peak = [before]
            stop = threading.Event()

            def sample() -> None:
                while not stop.is_set():
                    peak.append(server.rss())
                    time.sleep(0.005)

            sampler = threading.Thread(target=sample)
            sampler.start()
            try:
                got = client.get_many(NS, keys)
            finally:
                stop.set()
                sampler.join()
            assert all(b is not None for b in got)
            stats = client.stats()
        grown = max(peak) - before
        # One 32 MiB window and the message being sent, RAM churn within its cap, the demotion queue's
        # 32 MiB: far from the 384 MiB the Get asked for.
        assert grown < 192 << 20, f"RSS grew {grown >> 20} MiB during the Get"
        assert stats.inflight_peak_bytes <= (32 << 20) + (8 << 20)
        assert stats.inflight_bytes == 0
    finally:
        server.stop()


def test_a_get_whose_client_stops_reading_is_cut_off_and_releases_its_memory(make_server) -> None:
    server: ServerThread = make_server(limits={"get_stall_timeout_s": 1.0}, shm={"enabled": False})
    keys = [os.urandom(16) for _ in range(8)]
    with KVCacheClient(server.target, shm=False) as client:
        client.put_many(NS, [(k, raw_block(k, os.urandom(4 << 20))) for k in keys])
        # A reader that never reads: no BDP probing, so the HTTP/2 window stays at 64 KiB.
        options = [("grpc.http2.bdp_probe", 0), ("grpc.max_receive_message_length", 64 << 20)]
        with grpc.insecure_channel(server.target, options=options) as channel:
            call = channel.unary_stream(GET, pb.GetRequest.SerializeToString, lambda b: b)(
                pb.GetRequest(namespace=NS, keys=keys), timeout=60
            )
            wait_for(lambda: client.stats().cut_off_calls == 1, what="the stalled Get cut off")
            with pytest.raises(grpc.RpcError) as info:
                list(call)
        assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert "read nothing for 1 s (limits.get_stall_timeout_s)" in (info.value.details() or "")
        stats = client.stats()
        assert (stats.cut_off_calls, stats.inflight_bytes) == (1, 0)
        assert all(b is not None for b in client.get_many(NS, keys))  # the server serves on


def test_a_put_stream_that_goes_quiet_is_cut_off_and_releases_its_memory(make_server) -> None:
    server: ServerThread = make_server(limits={"put_idle_timeout_s": 1.0})
    key = os.urandom(16)
    with KVCacheClient(server.target) as client, grpc.insecure_channel(server.target) as channel:
        block = raw_block(key, os.urandom(300_000))
        quiet = StalledPut(channel, [first_part(key, len(block), block[:100_000])])
        wait_for(lambda: client.stats().cut_off_calls == 1, what="the quiet Put cut off")
        quiet.release()
        assert quiet.code is grpc.StatusCode.DEADLINE_EXCEEDED
        assert "no Put message for 1 s (limits.put_idle_timeout_s): the call is cut off" in quiet.details
        stats = client.stats()
        assert (stats.cut_off_calls, stats.inflight_bytes) == (1, 0)
        assert client.lookup(NS, [key]).prefix_length == 0  # nothing of it was stored


def test_parts_beyond_the_in_flight_budget_are_refused_not_allocated(make_server) -> None:
    """Three streams each assemble a 4 MiB block that never completes, with an 8 MiB budget: two fit,
    the third waits admission_wait_s and is refused; the budget passes its capacity by one message at most."""
    server: ServerThread = make_server(
        limits={
            "max_block_bytes": 4 << 20,
            "stream_message_bytes": 1 << 20,
            "inflight_bytes": 8 << 20,
            "admission_wait_s": 0.2,
            "put_idle_timeout_s": 60,
        }
    )
    part = os.urandom(1 << 20)

    def parts(key: bytes) -> list[bytes]:
        # A first part and two continuations of a block of 4 MiB (3 MiB of it sent).
        return [first_part(key, 4 << 20, part)] + [
            encode_put_request("", [(b"", BlockPart(part, True))]) for _ in range(2)
        ]

    with KVCacheClient(server.target) as client, grpc.insecure_channel(server.target) as channel:
        a = StalledPut(channel, parts(os.urandom(16)))
        b = StalledPut(channel, parts(os.urandom(16)))
        wait_for(lambda: client.stats().inflight_bytes == 6 << 20, what="two streams holding 3 MiB each")
        c = StalledPut(channel, parts(os.urandom(16)))
        wait_for(lambda: c.code is not None, what="the third stream refused")
        assert c.code is grpc.StatusCode.RESOURCE_EXHAUSTED and "limits.inflight_bytes" in c.details
        stats = client.stats()
        assert stats.inflight_refused == 1 and stats.inflight_peak_bytes <= (9 << 20) + (64 << 10)  # + one message
        a.release()
        b.release()
        wait_for(lambda: client.stats().inflight_bytes == 0, what="everything released")
