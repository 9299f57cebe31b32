"""The in-flight budget is charged for what a call really holds, and stalled callers hold only a share.

A real kvcache server over a real redis-server; the adversaries are raw gRPC clients that open Gets
and never read them, and Put streams that stop after one part. Assertions are exact counts (calls
refused, calls cut off, bytes held); latencies are printed, never asserted.

Before the change a Get reserved a whole get_window_bytes (64 MiB) for its lower-tier window whatever
it carried: one 17 KiB block read from Redis showed inflight_peak_bytes 67,108,864, four such Gets
filled the default 256 MiB budget, and a polite client beside six unread Gets and eight stalled Put
streams completed 0 rounds (every call RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from kvcache_client import KVCacheClient, KVCacheError, ResourceExhausted, RetryPolicy
from kvcache_core.blockwire import BlockPart, encode_put_request
from kvcache_proto import kvcache_pb2 as pb
from tests.backends import RedisProcess, wait_for
from tests.conftest import ServerThread, raw_block
from tests.test_bounded_work import StalledPut

pytestmark = pytest.mark.timeout(180)

GET = "/kvcache.v1.KVCache/Get"
ONCE = RetryPolicy(max_attempts=1)


def redis_below(redis: RedisProcess, **limits: object) -> dict[str, dict[str, object]]:
    """A RAM tier too small for the large blocks, Redis below it, no promotion (reads stay in Redis)."""
    return {
        "ram": {"capacity_bytes": 32 << 20},
        "redis": {"enabled": True, "url": redis.url, "promote": False, "timeout_s": 10.0},
        "shm": {"enabled": False},
        "limits": dict(limits),
    }


def in_redis_only(server: ServerThread, ns: str, items: list[tuple[bytes, bytes]]) -> None:
    with KVCacheClient(server.target, timeout_s=60, shm=False, bulk=False) as admin:
        for i in range(0, len(items), 8):
            assert admin.put_many(ns, items[i : i + 8]).tier("redis").stored == len(items[i : i + 8])
    server.stack.ram.delete_many_sync(ns, [k for k, _ in items])


def test_small_gets_from_redis_reserve_what_they_carry(make_server, redis_server: RedisProcess) -> None:
    """Four concurrent Gets of one 17 KiB block each, from Redis, in a namespace the server has not
    read before: the budget's peak is what they carried and gRPC's copies of the replies carrying it
    (before: 67,108,864 bytes for one of them)."""
    server: ServerThread = make_server(**redis_below(redis_server))
    items = [(k := os.urandom(16), raw_block(k, os.urandom(17_600))) for _ in range(4)]
    in_redis_only(server, "small", items)
    with KVCacheClient(server.target, timeout_s=10, shm=False, bulk=False) as client:
        assert client.stats().inflight_peak_bytes < 1 << 20  # the puts' messages
        server.running.service.budget.peak = 0
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda kv: client.get_many("small", [kv[0]]), items))
        assert [g[0] for g in got] == [b for _, b in items]
        stats = client.stats()
        # Each block counts twice at most: as read from Redis, and as gRPC's copy of the reply carrying it.
        assert stats.inflight_peak_bytes <= 2 * sum(len(b) for _, b in items)
        assert (stats.inflight_refused, stats.inflight_bytes) == (0, 0)


def test_a_get_of_ram_hits_counts_only_the_reply_it_writes(make_server, redis_server: RedisProcess) -> None:
    """RAM hits reserve no window (before: 67,107,936 bytes); what counts is gRPC's copy of the reply
    while it is written."""
    server: ServerThread = make_server(**redis_below(redis_server))
    items = [(k := os.urandom(16), raw_block(k, os.urandom(4096))) for _ in range(16)]
    with KVCacheClient(server.target, timeout_s=10, shm=False, bulk=False) as client:
        client.put_many("ram", items)
        server.running.service.budget.peak = 0
        assert client.get_many("ram", [k for k, _ in items]) == [b for _, b in items]
        assert client.stats().inflight_peak_bytes == sum(len(b) for _, b in items)  # one reply


def unread_get(target: str, ns: str, keys: list[bytes]) -> tuple[grpc.Channel, object]:
    """A Get its client never reads (no BDP probing: the HTTP/2 window stays at 64 KiB)."""
    options = [("grpc.http2.bdp_probe", 0), ("grpc.max_receive_message_length", 64 << 20)]
    channel = grpc.insecure_channel(target, options=options)
    call = channel.unary_stream(GET, pb.GetRequest.SerializeToString, lambda b: b)(
        pb.GetRequest(namespace=ns, keys=keys), timeout=120
    )
    return channel, call


def test_a_polite_client_keeps_working_beside_unread_gets_and_stalled_puts(
    make_server, redis_server: RedisProcess
) -> None:
    """Six Gets of 24 x 4 MiB (from Redis) that nobody reads and eight Put streams that stop after a
    4 MiB part, against the default 256 MiB budget; a polite client reads 4 small blocks from Redis
    and writes one, round after round, for 8 s: none of its calls is refused (before: 0 rounds done,
    every one RESOURCE_EXHAUSTED). Every stalled call is cut off at its timeout and the budget empties."""
    stall_s = 6.0
    server: ServerThread = make_server(
        **redis_below(redis_server, get_stall_timeout_s=stall_s, put_idle_timeout_s=stall_s)
    )
    big = [(k := os.urandom(16), raw_block(k, os.urandom((4 << 20) - 64))) for _ in range(24)]
    in_redis_only(server, "big", big)
    small = [(k := os.urandom(16), raw_block(k, os.urandom(16_384))) for _ in range(4)]
    in_redis_only(server, "polite", small)
    part = os.urandom(4 << 20)

    with KVCacheClient(server.target, timeout_s=5, retry=ONCE, shm=False, bulk=False) as polite:

        def round_trip() -> float:
            start = time.perf_counter()
            assert polite.get_many("polite", [k for k, _ in small]) == [b for _, b in small]
            key = os.urandom(16)
            polite.put_many("polite-w", [(key, raw_block(key, os.urandom(16_384)))])
            return time.perf_counter() - start

        idle = [round_trip() for _ in range(20)]
        channels, calls, puts = [], [], []
        cut_before = polite.stats().cut_off_calls
        try:
            for _ in range(6):
                channel, call = unread_get(server.target, "big", [k for k, _ in big])
                channels.append(channel)
                calls.append(call)
            for _ in range(8):
                channel = grpc.insecure_channel(server.target)
                channels.append(channel)
                key = os.urandom(16)
                first = encode_put_request("stalled", [(key, BlockPart(part, True, 64 << 20))])
                puts.append(StalledPut(channel, [first], timeout_s=60))
            time.sleep(0.5)  # the Gets have filled what gRPC buffers and wait on their client
            held = polite.stats().inflight_bytes
            busy: list[float] = []
            refused = failed = 0
            until = time.monotonic() + 8.0
            while time.monotonic() < until:
                try:
                    busy.append(round_trip())
                except ResourceExhausted:
                    refused += 1
                except KVCacheError:
                    failed += 1
            p99 = lambda xs: statistics.quantiles(xs, n=100)[98]  # noqa: E731
            print(
                f"\nheld by the stalled calls: {held >> 20} MiB; polite rounds {len(busy)}, refused {refused}, "
                f"failed {failed}; p99 {p99(busy) * 1e3:.1f} ms busy vs {p99(idle) * 1e3:.1f} ms idle "
                f"({p99(busy) / p99(idle):.1f}x)",
                end=" ",
            )
            assert (refused, failed) == (0, 0)
            assert len(busy) > 0
            wait_for(
                lambda: (s := polite.stats()).cut_off_calls - cut_before + s.inflight_refused == 14,
                timeout_s=stall_s * 3,
                what="every stalled call cut off or refused",
            )
            wait_for(lambda: polite.stats().inflight_bytes == 0, timeout_s=10, what="the budget emptied")
        finally:
            for put in puts:
                put.release()
            for channel in channels:
                channel.close()
    # Each stalled stream was cut off, or refused when it asked for more than the budget had left.
    assert {p.code for p in puts} <= {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}


def test_one_call_holds_at_most_its_share(make_server, redis_server: RedisProcess) -> None:
    """limits.inflight_call_share = 0.25 of a 64 MiB budget: a Get of 24 x 4 MiB from Redis, read
    slowly, never holds more than 16 MiB at once, and serves every block."""
    server: ServerThread = make_server(
        **redis_below(redis_server, inflight_bytes=64 << 20, get_window_bytes=64 << 20, max_block_bytes=8 << 20)
    )
    big = [(k := os.urandom(16), raw_block(k, os.urandom((4 << 20) - 64))) for _ in range(24)]
    in_redis_only(server, "big", big)
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], server.running.service.budget.used)
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with KVCacheClient(server.target, timeout_s=60, shm=False, bulk=False) as client:
            assert client.get_many("big", [k for k, _ in big]) == [b for _, b in big]
            stats = client.stats()
    finally:
        stop.set()
        sampler.join()
    # One share and the message being sent past it at most (a block read counts when it arrives).
    assert stats.inflight_peak_bytes <= (16 << 20) + (4 << 20)
    assert stats.inflight_bytes == 0


def test_a_get_that_pauses_sheds_its_window_and_then_serves_every_block_exactly(
    make_server, redis_server: RedisProcess
) -> None:
    """A client that reads one reply of a Get of 24 x 4 MiB from Redis, pauses 2 s, then reads the
    rest: while it pauses the Get holds the reply it writes (and gRPC's copy of it) and the one
    being filled, not its 64 MiB window; afterwards
    every block arrives byte-identical, in order (the shed ones read from Redis again)."""
    server: ServerThread = make_server(**redis_below(redis_server, get_stall_timeout_s=30))
    big = [(k := os.urandom(16), raw_block(k, os.urandom((4 << 20) - 64))) for _ in range(24)]
    in_redis_only(server, "big", big)
    channel, call = unread_get(server.target, "big", [k for k, _ in big])
    try:
        replies = iter(call)  # type: ignore[call-overload]
        first = next(replies)
        time.sleep(2.0)
        with KVCacheClient(server.target, timeout_s=10, shm=False, bulk=False) as admin:
            paused = admin.stats().inflight_bytes
            rest = list(replies)
            after = admin.stats()
    finally:
        channel.close()
    got: dict[int, bytes] = {}
    for raw in [first, *rest]:
        for item in pb.GetResponse.FromString(raw).items:
            got[item.index] = got.get(item.index, b"") + item.data
    assert [got.get(i) for i in range(24)] == [b for _, b in big]
    assert paused <= 3 * (4 << 20), f"{paused} bytes held while the client paused"
    assert (after.inflight_bytes, after.cut_off_calls) == (0, 0)


def test_one_tenant_s_stalled_gets_leave_the_other_tenant_its_share(
    make_server, redis_server: RedisProcess, tmp_path
) -> None:
    """With auth, tenant a opens 6 unread Gets of 24 x 4 MiB; tenant b's Get of the same shape, right
    after, is served in full: a's calls hold at most inflight_tenant_share (before: b waited
    admission_wait_s and was refused: the budget was a's)."""
    from tests.test_security import TOKENS, tokens_file

    cfg = redis_below(redis_server, get_stall_timeout_s=30, admission_wait_s=1.0)
    server: ServerThread = make_server(**cfg, auth={"enabled": True, "tokens_file": str(tokens_file(tmp_path))})
    big = [(k := os.urandom(16), raw_block(k, os.urandom((4 << 20) - 64))) for _ in range(24)]
    for tenant in ("a", "b"):
        with KVCacheClient(server.target, timeout_s=60, shm=False, bulk=False, token=TOKENS[tenant]) as c:
            for i in range(0, 24, 8):
                assert c.put_many("big", big[i : i + 8]).tier("redis").stored == 8
        server.stack.ram.delete_many_sync(f"{tenant}:big", [k for k, _ in big])
    options = [("grpc.http2.bdp_probe", 0), ("grpc.max_receive_message_length", 64 << 20)]
    channels, calls = [], []
    try:
        for _ in range(6):
            channel = grpc.insecure_channel(server.target, options=options)
            channels.append(channel)
            calls.append(
                channel.unary_stream(GET, pb.GetRequest.SerializeToString, lambda b: b)(
                    pb.GetRequest(namespace="big", keys=[k for k, _ in big]),
                    timeout=60,
                    metadata=(("authorization", f"Bearer {TOKENS['a']}"),),
                )
            )
        time.sleep(0.3)  # a's Gets have taken what its share allows
        with KVCacheClient(server.target, timeout_s=30, retry=ONCE, shm=False, bulk=False, token=TOKENS["b"]) as b:
            assert b.get_many("big", [k for k, _ in big]) == [blk for _, blk in big]
        budget = server.running.service.budget
        assert budget.by_tenant.get("a", 0) <= budget.tenant_cap + 6 * (4 << 20)  # plus one block each on arrival
    finally:
        for channel in channels:
            channel.close()


def test_peak_rss_stays_within_the_documented_bound_under_stalled_callers(redis_server: RedisProcess) -> None:
    """A real `python -m kvcache_server` (RAM 64 MiB, in-flight 128 MiB, Redis queue 32 MiB) under six
    unread Gets of 24 x 4 MiB from Redis and eight Put streams stopped after a 4 MiB part, beside a
    polite client, until every stalled call is cut off or refused: its peak RSS stays within
    docs/limits.md's bound, ram + inflight + queues + gRPC's buffers (one message per open stream) +
    the baseline of a server that stores nothing yet."""
    from tests.test_bounded_work import ServerProcess

    ram, inflight, queue = 64 << 20, 128 << 20, 32 << 20
    server = ServerProcess(
        "--ram-capacity",
        str(ram),
        *("--set", "shm.enabled=false"),
        *("--set", f"limits.inflight_bytes={inflight}"),
        *("--set", "limits.get_stall_timeout_s=4", "--set", "limits.put_idle_timeout_s=4"),
        *("--set", "redis.enabled=true", "--set", f"redis.url={redis_server.url}", "--set", "redis.promote=false"),
        *("--set", f"redis.queue_max_bytes={queue}"),
    )
    try:
        baseline = server.rss()  # the interpreter, gRPC, the libraries: nothing stored yet
        big = [(k := os.urandom(16), raw_block(k, os.urandom((4 << 20) - 64))) for _ in range(24)]
        with KVCacheClient(server.target, timeout_s=60, shm=False, bulk=False) as admin:
            for i in range(0, 24, 4):
                assert admin.put_many("big", big[i : i + 4]).tier("redis").stored == 4
            admin.delete("big", [k for k, _ in big])  # from every tier: write them to Redis only
        r = redis_server.client()
        for k, b in big:
            r.set(f"kvcache/big/{k.hex()}", b)
        peak = [server.rss()]
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], server.rss())
                time.sleep(0.01)

        sampler = threading.Thread(target=sample)
        sampler.start()
        part = os.urandom(4 << 20)
        channels, puts = [], []
        try:
            for _ in range(6):
                channel, _call = unread_get(server.target, "big", [k for k, _ in big])
                channels.append((channel, _call))
            for _ in range(8):
                channel = grpc.insecure_channel(server.target)
                channels.append((channel, None))
                key = os.urandom(16)
                first = encode_put_request("stalled", [(key, BlockPart(part, True, 64 << 20))])
                puts.append(StalledPut(channel, [first], timeout_s=60))
            with KVCacheClient(server.target, timeout_s=5, retry=ONCE, shm=False, bulk=False) as polite:
                small = [(k := os.urandom(16), raw_block(k, os.urandom(16_384))) for _ in range(4)]
                polite.put_many("polite", small)
                wait_for(
                    lambda: (s := polite.stats()).cut_off_calls + s.inflight_refused == 14 and s.inflight_bytes == 0,
                    timeout_s=30,
                    what="every stalled call cut off or refused",
                )
                assert polite.get_many("polite", [k for k, _ in small]) == [b for _, b in small]
        finally:
            stop.set()
            sampler.join()
            for put in puts:
                put.release()
            for channel, _ in channels:
                channel.close()
        bound = ram + inflight + queue + 14 * (4 << 20) + baseline  # 14 streams, 4 MiB messages
        print(f"\npeak RSS {peak[0] >> 20} MiB; bound {bound >> 20} MiB (baseline {baseline >> 20} MiB)", end=" ")
        assert peak[0] <= bound
    finally:
        server.stop()
