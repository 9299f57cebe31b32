"""Hung backends and busy tiers: Lookups keep their deadline, breakers open, the event loop stays free.

A real kvcache server over a real redis-server and moto S3 server. A backend is hung with SIGSTOP
(its TCP connections stay open, nothing answers), always resumed with SIGCONT in a `finally`.
Clients use vLLM's budget: a 0.5 s deadline and one attempt. That deadline is the only bound on
time the tests assert; every other assertion is an exact count or state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import pytest

from kvcache_client import KVCacheClient, KVCacheError, LookupResult, RetryPolicy
from kvcache_server.stack import LowerTierPolicy, TierStack
from kvcache_server.tiers import codec
from kvcache_server.tiers.base import Tier, TierKind, TierStats
from tests.backends import RedisProcess, S3Process, sigstop, wait_for
from tests.conftest import ServerThread, keyed, raw_block

pytestmark = pytest.mark.timeout(240)

NS = "hung-test"
BUCKET = "kvcache-test"
log = logging.getLogger(__name__)  # a failed Lookup says why in the test's captured log
VLLM_DEADLINE_S = 1.0
"""A vLLM-sized Lookup deadline, twice the connector's 0.5 s: the server answers at
limits.lookup_deadline_share (0.8) of it when a tier hangs, and on this shared VM (up to 60% of its CPU
lost to steal) the 0.1 s left of 0.5 s was once too little for the answer to travel (1 of 50 Lookups
in one CI run). Still half the tiers' timeout_s: an answer that waited for the hung tier fails."""
TIER_TIMEOUT_S = 2.0
"""Each tier's timeout_s here: longer than a client's deadline, as in production (5 s, 10 s)."""


def block(key: bytes) -> bytes:
    return raw_block(key, key * 256)


def lower_cfg(**kw: object) -> dict[str, object]:
    # An open breaker probes again after 1 s (then 2 s, 4 s, ...): long enough to be seen open.
    return {"enabled": True, "timeout_s": TIER_TIMEOUT_S, "breaker_reset_s": 1.0, **kw}


def s3_cfg(s3: S3Process, **kw: object) -> dict[str, object]:
    where = {"bucket": BUCKET, "endpoint_url": s3.endpoint, "path_style": True, "create_bucket": True}
    return lower_cfg(**{**where, "write_mode": "through", **kw})


def s3_only(s3: S3Process, n: int) -> list[bytes]:
    """Keys whose blocks only S3 holds, written there by someone else (this server's presence index
    does not know them: a Lookup must ask S3)."""
    client = s3.client()
    keys = [os.urandom(16) for _ in range(n)]
    for key in keys:
        client.put_object(Bucket=BUCKET, Key=f"kvcache/{NS}/{key.hex()}", Body=block(key))
    return keys


def vllm_client(server: ServerThread) -> KVCacheClient:
    return KVCacheClient(server.target, timeout_s=VLLM_DEADLINE_S, retry=RetryPolicy(max_attempts=1))


def breaker(client: KVCacheClient, tier: str) -> str:
    return client.stats().tier(tier).breaker


def lookups_while_hung(
    client: KVCacheClient, ask: Callable[[int], list[bytes]], tier: str, n: int = 50
) -> tuple[list[LookupResult | None], set[str]]:
    """n Lookups (None where one failed), and the states of `tier`'s breaker seen after each."""
    answers: list[LookupResult | None] = []
    seen: set[str] = set()
    for i in range(n):
        start = time.monotonic()
        try:
            answers.append(client.lookup(NS, ask(i)))
        except KVCacheError as exc:
            answers.append(None)
            log.warning("lookup %d failed after %.3f s: %r", i, time.monotonic() - start, exc)
        with KVCacheClient(client.target, timeout_s=10) as admin:
            seen.add(breaker(admin, tier))
        time.sleep(0.05)
    return answers, seen


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """The process hung (SIGSTOP) inside the block, and resumed (SIGCONT) whatever happens."""
    sigstop(pid)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_hung_s3_is_a_miss_and_opens_its_breaker(make_server, redis_server: RedisProcess, s3_server: S3Process) -> None:
    server: ServerThread = make_server(
        ram={"capacity_bytes": 64 << 20}, redis=lower_cfg(url=redis_server.url), s3=s3_cfg(s3_server)
    )
    in_ram, in_redis = os.urandom(16), os.urandom(16)
    with KVCacheClient(server.target, timeout_s=10) as admin:
        admin.put_many(NS, [(in_ram, block(in_ram)), (in_redis, block(in_redis))])
    server.stack.ram.delete_many_sync(NS, [in_redis])  # in Redis (and S3), not in RAM
    fresh = s3_only(s3_server, 52)
    with vllm_client(server) as client:
        assert client.lookup(NS, [in_ram, in_redis, fresh[0]]) == LookupResult(3, ("ram", "redis", "s3"))
        assert s3_server.proc is not None
        with stopped(s3_server.proc.pid):
            # Each Lookup asks S3 about a key it has not seen, so it cannot answer from its index.
            answers, seen = lookups_while_hung(client, lambda i: [in_ram, in_redis, fresh[1 + i]], "s3")
        failed = answers.count(None)
        assert answers == [LookupResult(2, ("ram", "redis"))] * 50, f"{failed} failed; s3 breaker states {seen}"
        assert "open" in seen  # every one answered in time; S3 was a miss
        wait_for(lambda: breaker(client, "s3") == "closed", timeout_s=60, what="s3 breaker closed again")
        last = fresh[51]
        wait_for(
            lambda: client.lookup(NS, [in_ram, in_redis, last]) == LookupResult(3, ("ram", "redis", "s3")),
            timeout_s=30,
            what="an S3-only key found again",
        )
        assert client.get_many(NS, [last]) == [block(last)]


def test_hung_redis_is_a_miss_and_opens_its_breaker(
    make_server, redis_server: RedisProcess, s3_server: S3Process
) -> None:
    server: ServerThread = make_server(
        ram={"capacity_bytes": 64 << 20}, redis=lower_cfg(url=redis_server.url), s3=s3_cfg(s3_server)
    )
    in_ram, in_redis = os.urandom(16), os.urandom(16)
    with KVCacheClient(server.target, timeout_s=10) as admin:
        admin.put_many(NS, [(in_ram, block(in_ram))])
    redis_server.client().set(f"kvcache/{NS}/{in_redis.hex()}", block(in_redis))  # only Redis holds it
    (in_s3,) = s3_only(s3_server, 1)
    keys = [in_ram, in_s3, in_redis]
    with vllm_client(server) as client:
        assert client.lookup(NS, keys) == LookupResult(3, ("ram", "s3", "redis"))
        assert redis_server.proc is not None
        with stopped(redis_server.proc.pid):
            answers, seen = lookups_while_hung(client, lambda _: keys, "redis")
        failed = answers.count(None)
        assert answers == [LookupResult(2, ("ram", "s3"))] * 50, f"{failed} failed; redis breaker states {seen}"
        assert "open" in seen  # every one answered in time; Redis was a miss
        wait_for(lambda: breaker(client, "redis") == "closed", timeout_s=60, what="redis breaker closed again")
        wait_for(
            lambda: client.lookup(NS, keys) == LookupResult(3, ("ram", "s3", "redis")),
            timeout_s=30,
            what="a Redis-only key found again",
        )
        assert client.get_many(NS, [in_redis]) == [block(in_redis)]


# -- the event loop stays free ---------------------------------------------------------------------

STREAMER = r"""
import os, sys
import numpy as np
import redis
from kvcache_client import KVCacheClient
from kvcache_core.format import encode_block

target, redis_url, per = sys.argv[1], sys.argv[2], int(sys.argv[3])
n = 16 << 20  # bf16 elements: 32 MiB blocks, which shuffle-lz4 shrinks to ~85%
rng = np.random.default_rng()
payload = ((rng.standard_normal(n, dtype=np.float32) * 0.1).view(np.uint32) >> 16).astype(np.uint16)
r = redis.Redis.from_url(redis_url)
with KVCacheClient(target, timeout_s=120) as client:
    while True:
        items = []
        for _ in range(per):
            key = os.urandom(16)
            payload[:8] = rng.integers(0, 1 << 16, 8)
            items.append((key, encode_block(payload.tobytes(), key=key, dtype="bfloat16", shape=(n,))))
        keys = [k for k, _ in items]
        put = client.put_many("stream", items)
        assert put.tier("redis").stored == per, put
        assert all(b is not None for b in client.get_many("stream", keys))  # read back from Redis
        r.delete(*[f"kvcache/stream/{k.hex()}" for k in keys])
        client.get_many("stream", keys)  # from S3 where its write-behind got there first
        client.delete("stream", keys)
        print("round", flush=True)
"""


def test_event_loop_stays_free_while_big_blocks_stream(
    make_server, redis_server: RedisProcess, s3_server: S3Process
) -> None:
    """1-key Lookups, back to back, while another client process streams puts of 6 x 32 MiB that the
    server compresses with shuffle-lz4 for Redis (write-through) and S3 (write-behind), and gets that it
    decompresses and verifies: every Lookup answers within vLLM's 0.5 s. The key is in Redis and S3: a
    Lookup that Redis did not answer within its lookup_timeout_s (a busy machine) is answered by S3."""
    server: ServerThread = make_server(
        ram={"capacity_bytes": 16 << 20},  # smaller than a block: reads come from the lower tiers
        redis=lower_cfg(url=redis_server.url, compression="shuffle-lz4", timeout_s=30),
        s3=s3_cfg(s3_server, compression="shuffle-lz4", write_mode="behind", timeout_s=30),
    )
    key = os.urandom(16)
    with KVCacheClient(server.target, timeout_s=10) as admin:
        admin.put_many(NS, [(key, block(key))])
    server.call(server.stack.wait_idle())  # in Redis and S3
    server.stack.ram.delete_many_sync(NS, [key])  # not in RAM: a Lookup asks Redis, an event-loop round trip

    lag = [0.0]

    async def probe() -> None:
        """The longest the server's event loop left a 10 ms sleep waiting beyond its time."""
        while True:
            start = time.perf_counter()
            await asyncio.sleep(0.01)
            lag[0] = max(lag[0], time.perf_counter() - start - 0.01)

    prober = asyncio.run_coroutine_threadsafe(probe(), server.loop)
    time.sleep(1.0)
    idle_lag = lag[0]
    streamer = subprocess.Popen(
        [sys.executable, "-c", STREAMER, server.target, redis_server.url, "6"], stdout=subprocess.PIPE, text=True
    )
    rounds = threading.Semaphore(0)  # released once per round the streamer finished
    reader = threading.Thread(target=lambda: [rounds.release() for _ in streamer.stdout or ()], daemon=True)
    reader.start()
    answers: list[LookupResult | None] = []
    try:
        assert rounds.acquire(timeout=120)  # the load is on
        lag[0] = 0.0
        done = 0
        with vllm_client(server) as client:
            deadline = time.monotonic() + 150
            while done < 4 and streamer.poll() is None and time.monotonic() < deadline:
                try:
                    answers.append(client.lookup(NS, [key]))
                except KVCacheError:
                    answers.append(None)
                done += rounds.acquire(blocking=False)
    finally:
        streamer.kill()
        streamer.wait(10)
        prober.cancel()
    print(f"\nevent loop: max lag {lag[0] * 1e3:.0f} ms under load ({idle_lag * 1e3:.0f} ms idle)", end=" ")
    print(f"over {len(answers)} Lookups")
    assert done == 4, "the streaming client failed"
    found = [a for a in answers if a in (LookupResult(1, ("redis",)), LookupResult(1, ("s3",)))]
    print(f"{answers.count(None)} failed, {found.count(LookupResult(1, ('s3',)))} answered by S3 (Redis was late)")
    assert len(found) == len(answers), f"{answers.count(None)} of {len(answers)} Lookups failed"


# -- the stack on its own: a tier in memory that can hang ------------------------------------------


class MemoryTier(Tier):
    """A lower tier in a dict; with `hang`, every call waits forever (the stack's timeout ends it)."""

    name = "redis"
    kind = TierKind.REDIS

    def __init__(self, *, hang: bool = False) -> None:
        self.blocks: dict[tuple[str, bytes], bytes] = {}
        self.put_calls = 0
        self.hang = hang

    async def _maybe_hang(self) -> None:
        if self.hang:
            await asyncio.Event().wait()

    async def get_many(self, namespace: str, keys: Sequence[bytes]) -> list[bytes | None]:
        await self._maybe_hang()
        return [self.blocks.get((namespace, k)) for k in keys]

    async def put_many(self, namespace: str, items: Sequence[tuple[bytes, bytes]]) -> list[bool]:
        await self._maybe_hang()
        self.put_calls += 1
        self.blocks.update(((namespace, k), b) for k, b in items)
        return [True] * len(items)

    async def delete_many(self, namespace: str, keys: Sequence[bytes]) -> int:
        await self._maybe_hang()
        return sum(self.blocks.pop((namespace, k), None) is not None for k in keys)

    def stats(self) -> TierStats:
        return TierStats(self.name, self.kind)


def big_block() -> tuple[bytes, bytes]:
    """A compressible block large enough for the codec threads (over _INLINE_WORK_BYTES)."""
    key = os.urandom(16)
    return key, raw_block(key, bytes(1 << 20))


async def until(check: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not check():
            await asyncio.sleep(0.01)


def test_callers_that_give_up_still_count_for_the_breaker() -> None:
    """Lookups that stop waiting, and Gets whose RPC is cancelled before the tier's timeout_s: each
    tier call still ends (at timeout_s) and counts as a failure, so the breaker opens."""

    async def main() -> None:
        tier = MemoryTier(hang=True)
        policy = LowerTierPolicy(timeout_s=0.3, lookup_timeout_s=0.05, breaker_failures=3, breaker_reset_s=30)
        stack = TierStack(1 << 20, [(tier, policy)])
        await stack.start()
        key = os.urandom(16)
        assert [await stack.lookup(NS, [key]) for _ in range(2)] == [[], []]  # misses, in time
        get = asyncio.create_task(stack.get(NS, [key]))
        await asyncio.sleep(0.05)
        get.cancel()  # the client's deadline
        with contextlib.suppress(asyncio.CancelledError):
            await get
        (s,) = stack.stats()[1:]
        assert (s.breaker, s.errors) == ("closed", 2)  # the Lookups were late; no call has ended yet
        await until(lambda: stack.stats()[1].breaker == "open", "breaker open")
        s = stack.stats()[1]
        assert (s.errors, s.skipped) == (3, 0)  # each call counted once: 2 late Lookups, 1 timed-out Get
        assert await stack.get(NS, [key]) == [None]
        assert stack.stats()[1].skipped == 1
        await stack.close(0)

    asyncio.run(main())


def test_a_get_cancelled_while_a_lower_tier_hangs_hands_back_its_ram_leases() -> None:
    """A Get with RAM hits and a key it reads from a hung lower tier, cancelled 100 times (a client's
    deadline, a failover cut): no lease of its RAM hits stays open (they pinned their slots for
    SERVE_LEASE_S, 600 s, before), so the RAM tier can still evict and reuse them."""

    async def main() -> None:
        tier = MemoryTier(hang=True)
        stack = TierStack(4 << 20, [(tier, LowerTierPolicy(timeout_s=1.0, breaker_failures=1000))])
        await stack.start()
        in_ram = [keyed(os.urandom(64 << 10)) for _ in range(8)]
        await stack.put(NS, in_ram)
        keys = [k for k, _ in in_ram] + [os.urandom(16)]  # the last one goes to the hung tier
        for _ in range(100):
            get = asyncio.create_task(stack.get(NS, keys))
            await asyncio.sleep(0.002)
            get.cancel()
            try:
                found = await get
            except asyncio.CancelledError:
                continue
            stack.release(found)  # answered first (the hung tier's orphans are capped, so it was skipped)
        assert stack.ram.arena_stats()["leases"] == 0
        flood = [keyed(os.urandom(64 << 10)) for _ in range(80)]  # 5 MiB into 4: every old slot is needed
        assert all((await stack.put(NS, flood)).kept)
        await stack.close(0)

    asyncio.run(main())


def test_a_put_cancelled_while_compressing_writes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    started, release = threading.Event(), threading.Event()
    real = codec.encode

    def slow_encode(block: bytes, mode: codec.CompressionMode) -> bytes:
        started.set()
        release.wait(30)
        return real(block, mode)

    monkeypatch.setattr(codec, "encode", slow_encode)

    async def main() -> None:
        tier = MemoryTier()
        policy = LowerTierPolicy(compression=codec.CompressionMode.LZ4, codec_threads=1)
        stack = TierStack(64 << 20, [(tier, policy)])
        await stack.start()
        key, data = big_block()
        put = asyncio.create_task(stack.put(NS, [(key, data)]))
        await asyncio.to_thread(started.wait, 30)  # compressing, in the codec thread
        put.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await put
        release.set()
        codec_pool = stack._lower[0].codec  # one thread: a job queued now runs after the compression
        await asyncio.wrap_future(codec_pool.submit(lambda: None))
        await asyncio.sleep(0.05)  # and anything its result could still have triggered on the loop
        assert (tier.put_calls, tier.blocks) == (0, {})
        assert stack.ram.contains_many_sync(NS, [key]) == [True]  # RAM took it before compression began
        await stack.close(0)

    asyncio.run(main())


def test_a_delete_during_compression_fences_the_write_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fence is checked after compression, right before the tier call starts."""
    started, release = threading.Event(), threading.Event()
    real = codec.encode

    def slow_encode(block: bytes, mode: codec.CompressionMode) -> bytes:
        started.set()
        release.wait(30)
        return real(block, mode)

    monkeypatch.setattr(codec, "encode", slow_encode)

    async def main() -> None:
        tier = MemoryTier()
        stack = TierStack(64 << 20, [(tier, LowerTierPolicy(compression=codec.CompressionMode.LZ4))])
        await stack.start()
        key, data = big_block()
        put = asyncio.create_task(stack.put(NS, [(key, data)]))
        await asyncio.to_thread(started.wait, 30)
        assert await stack.delete(NS, [key]) == 1  # removed it from RAM; the tier had nothing yet
        release.set()
        outcome = await put
        assert [(t.name, t.stored, t.deleted) for t in outcome.tiers] == [("ram", 1, 0), ("redis", 0, 1)]
        assert (tier.put_calls, tier.blocks) == (0, {})
        assert stack.ram.contains_many_sync(NS, [key]) == [False]
        await stack.close(0)

    asyncio.run(main())
