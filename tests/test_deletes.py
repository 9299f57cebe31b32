"""Deletes stay deleted, and puts say what each tier took: a real server over real redis-server and S3.

A Delete races a write-behind batch the writer has already taken, a demotion in flight, a
write-through put and a Get that read a lower tier before it. The races are made deterministic by
a Gate: the real tier's method, wrapped so that calls naming chosen keys wait inside it until the
test opens the gate, then call the real backend. Afterwards every key must be absent from every
tier, checked in Redis and S3 directly as well as through Lookup and Get.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvcache_client import KVCacheClient
from kvcache_client.results import PutResult, TierPutResult
from kvcache_core.threads import in_pool
from kvcache_server.stack import LowerTierPolicy, TierStack, WriteMode
from kvcache_server.tiers.base import Tier, TierKind, TierStats
from kvcache_server.tiers.ram import RamTier
from kvcache_server.write_queue import DeleteFence
from tests.backends import RedisProcess, S3Process, wait_for
from tests.conftest import ServerThread, raw_block

pytestmark = pytest.mark.timeout(120)

NS = "delete-test"
BUCKET = "kvcache-test"
SLOW_S = 30.0
"""Tier timeout in these tests: far above how long a gate holds a call, so nothing times out."""


def blocks(n: int, size: int = 8 << 10) -> list[tuple[bytes, bytes]]:
    out = []
    for _ in range(n):
        key = os.urandom(16)
        out.append((key, raw_block(key, (hashlib.sha256(key).digest() * (size // 32 + 1))[:size])))
    return out


def redis_cfg(redis: RedisProcess, **kw: object) -> dict[str, object]:
    return {"enabled": True, "url": redis.url, "timeout_s": SLOW_S, "breaker_reset_s": 0.2, **kw}


def s3_cfg(s3: S3Process, **kw: object) -> dict[str, object]:
    return {
        "enabled": True,
        "bucket": BUCKET,
        "endpoint_url": s3.endpoint,
        "path_style": True,
        "create_bucket": True,
        "timeout_s": SLOW_S,
        "breaker_reset_s": 0.2,
        **kw,
    }


class Gate:
    """Holds the calls of `tier.<method>` that name any of `keys` until open().

    A write is held before it calls the real backend (it lands when the gate opens); a read, with
    `after=True`, once the real backend has answered (the bytes are read, the caller waits).
    """

    def __init__(self, tier: Tier, method: str, keys: Sequence[bytes], *, after: bool = False) -> None:
        self.keys = set(keys)
        self.held: set[bytes] = set()  # the gated keys named by the calls held so far
        self._open = threading.Event()
        real: Callable = getattr(tier, method)

        async def gated(namespace: str, arg: Sequence) -> object:
            named = {x[0] if isinstance(x, tuple) else x for x in arg}
            hold = bool(named & self.keys) and not self._open.is_set()
            answer = await real(namespace, arg) if after else None
            if hold:
                self.held |= named & self.keys
                await asyncio.to_thread(self._open.wait, 60)
            return answer if after else await real(namespace, arg)

        setattr(tier, method, gated)  # an instance attribute: the stack calls it instead of the class's

    def wait_held(self) -> None:
        """Waits until calls naming every gated key are held inside the tier."""
        wait_for(lambda: self.held == self.keys, what="gated calls")

    def open(self) -> None:
        self._open.set()


def tier_of(server: ServerThread, name: str) -> Tier:
    return next(t for t in server.stack.tiers if t.name == name)


def start_delete(server: ServerThread, keys: list[bytes]) -> tuple[threading.Thread, list[int]]:
    """Starts a Delete of `keys` from a client of its own; returns once the server runs it (its keys
    fenced off) or it has returned already (nothing made it wait)."""
    answer: list[int] = []

    def run() -> None:
        with KVCacheClient(server.target, timeout_s=90) as client:
            answer.append(client.delete(NS, keys))

    thread = threading.Thread(target=run)
    thread.start()
    fence = getattr(server.stack, "fence", None)
    wait_for(
        lambda: not thread.is_alive() or (fence is not None and fence.running(NS, keys[0])), what="delete under way"
    )
    return thread, answer


def in_ram(server: ServerThread, keys: list[bytes]) -> int:
    return sum(server.stack.ram.contains_many_sync(NS, keys))


def in_redis(redis: RedisProcess, keys: list[bytes]) -> int:
    return int(redis.client().exists(*[f"kvcache/{NS}/{k.hex()}" for k in keys]))


def in_s3(s3: S3Process, keys: list[bytes]) -> int:
    client = s3.client()
    try:
        listed = client.list_objects_v2(Bucket=BUCKET).get("Contents", [])
    except client.exceptions.NoSuchBucket:
        return 0
    return len({o["Key"] for o in listed} & {f"kvcache/{NS}/{k.hex()}" for k in keys})


def served(client: KVCacheClient, keys: list[bytes]) -> tuple[int, int]:
    """(keys Lookup finds, blocks Get returns), asking about each key on its own for Lookup."""
    found = sum(client.lookup(NS, [k]).prefix_length for k in keys)
    return found, sum(b is not None for b in client.get_many(NS, keys))


def drain(server: ServerThread) -> None:
    """Waits until every write-behind queue is empty and no batch is in flight."""
    server.call(server.stack.wait_idle())


# -- deletes racing writes ------------------------------------------------------------------------


def test_delete_wins_over_a_write_behind_batch_in_flight(
    make_server, redis_server: RedisProcess, s3_server: S3Process
) -> None:
    server: ServerThread = make_server(
        ram={"capacity_bytes": 64 << 20}, redis=redis_cfg(redis_server), s3=s3_cfg(s3_server, write_mode="behind")
    )
    data = blocks(20)
    keys = [k for k, _ in data]
    gate = Gate(tier_of(server, "s3"), "put_many", keys)
    with KVCacheClient(server.target) as client:
        put = client.put_many(NS, data)
        assert put.tier("ram").stored == 20 and put.tier("redis").stored == 20 and put.tier("s3").queued == 20
        gate.wait_held()  # the writer took all 20 in one batch and is inside the S3 write
        assert client.stats().tier("s3").queue_depth == 0  # nothing left for the Delete to discard
        delete, answer = start_delete(server, keys)
        gate.open()
        delete.join(60)
        assert answer == [20]
        drain(server)
        assert (in_ram(server, keys), in_redis(redis_server, keys), in_s3(s3_server, keys)) == (0, 0, 0)
        assert served(client, keys) == (0, 0)
        assert client.stats().tier("s3").write_errors == 0
    assert server.stack.fence.tombstones == 0  # nothing older than the Delete is still open


def test_delete_wins_over_a_demotion_in_flight(make_server, redis_server: RedisProcess) -> None:
    data = blocks(8)
    targets, fillers = data[:4], data[4:]
    keys = [k for k, _ in targets]
    # RAM holds exactly four of these blocks (put several per message, each is its own bytes object).
    server: ServerThread = make_server(
        ram={"capacity_bytes": 4 * RamTier.entry_cost(data[0][1])}, redis=redis_cfg(redis_server)
    )
    with KVCacheClient(server.target) as client:
        client.put_many(NS, targets)
        redis_server.client().delete(*[f"kvcache/{NS}/{k.hex()}" for k in keys])  # only RAM holds them now
        gate = Gate(tier_of(server, "redis"), "put_many", keys)
        put = client.put_many(NS, fillers)  # evicts the four targets at once: one demotion batch
        assert put.tier("ram").stored == 4 and put.tier("redis").stored == 4
        gate.wait_held()  # the demotion checked Redis lacks them and is inside the write
        assert in_ram(server, keys) == 0
        delete, answer = start_delete(server, keys)
        gate.open()
        delete.join(60)
        assert answer == [4]  # it waited for the demotion to land, then removed the four from Redis
        drain(server)
        assert (in_ram(server, keys), in_redis(redis_server, keys)) == (0, 0)
        assert served(client, keys) == (0, 0)
        filler_keys = [k for k, _ in fillers]
        assert (in_ram(server, filler_keys), in_redis(redis_server, filler_keys)) == (4, 4)
        assert client.stats().tier("redis").demotions == 4  # they did land, before the Delete removed them
    assert server.stack.fence.tombstones == 0


def test_delete_during_a_write_through_put(make_server, redis_server: RedisProcess, s3_server: S3Process) -> None:
    """The put is inside its Redis write when the Delete comes: the Delete waits for that write, then
    deletes; the put's later S3 write-behind is fenced off and reported as `deleted`."""
    server: ServerThread = make_server(
        ram={"capacity_bytes": 64 << 20}, redis=redis_cfg(redis_server), s3=s3_cfg(s3_server, write_mode="behind")
    )
    data = blocks(10)
    keys = [k for k, _ in data]
    gate = Gate(tier_of(server, "redis"), "put_many", keys)
    results: list[PutResult] = []

    def put() -> None:
        with KVCacheClient(server.target, timeout_s=90) as client:
            results.append(client.put_many(NS, data))

    putter = threading.Thread(target=put)
    putter.start()
    gate.wait_held()
    delete, answer = start_delete(server, keys)
    gate.open()
    delete.join(60)
    putter.join(60)
    assert answer == [10]
    (result,) = results
    assert (result.stored, result.rejected) == (10, 0)  # RAM took them before the Delete came
    assert result.tiers == (
        TierPutResult("ram", stored=10),
        TierPutResult("redis", stored=10),
        TierPutResult("s3", deleted=10),
    )
    drain(server)
    assert (in_ram(server, keys), in_redis(redis_server, keys), in_s3(s3_server, keys)) == (0, 0, 0)
    with KVCacheClient(server.target) as client:
        assert served(client, keys) == (0, 0)
    assert server.stack.fence.tombstones == 0


# -- deletes racing promotions --------------------------------------------------------------------


def test_get_reading_redis_before_a_delete_does_not_promote(make_server, redis_server: RedisProcess) -> None:
    """The Get returns the copies it read before the Delete (it is ordered before it), and promotes none."""
    server: ServerThread = make_server(ram={"capacity_bytes": 64 << 20}, redis=redis_cfg(redis_server))
    data = blocks(10)
    keys = [k for k, _ in data]
    got: list[list] = []

    def get() -> None:
        with KVCacheClient(server.target, timeout_s=90) as client:
            got.append(client.get_many(NS, keys))

    with KVCacheClient(server.target) as client:
        client.put_many(NS, data)
        server.stack.ram.delete_many_sync(NS, keys)  # only Redis holds them now
        gate = Gate(tier_of(server, "redis"), "get_many", keys, after=True)
        reader = threading.Thread(target=get)
        reader.start()
        gate.wait_held()  # the Get missed RAM and has read Redis, but not returned yet
        assert client.delete(NS, keys) == 10  # returns while the Get is still reading
        gate.open()
        reader.join(60)
        assert [bytes(b) if b is not None else None for b in got[0]] == [b for _, b in data]
        assert (in_ram(server, keys), in_redis(redis_server, keys)) == (0, 0)
        assert served(client, keys) == (0, 0)
        assert client.stats().tier("ram").promotions == 0
    assert server.stack.fence.tombstones == 0


def test_get_reading_s3_before_a_delete_promotes_into_no_tier(
    make_server, redis_server: RedisProcess, s3_server: S3Process
) -> None:
    server: ServerThread = make_server(
        ram={"capacity_bytes": 64 << 20}, redis=redis_cfg(redis_server), s3=s3_cfg(s3_server, write_mode="through")
    )
    data = blocks(10)
    keys = [k for k, _ in data]
    got: list[list] = []

    def get() -> None:
        with KVCacheClient(server.target, timeout_s=90) as client:
            got.append(client.get_many(NS, keys))

    with KVCacheClient(server.target) as client:
        assert client.put_many(NS, data).tier("s3").stored == 10
        server.stack.ram.delete_many_sync(NS, keys)
        redis_server.client().delete(*[f"kvcache/{NS}/{k.hex()}" for k in keys])  # only S3 holds them now
        gate = Gate(tier_of(server, "s3"), "get_many", keys, after=True)
        reader = threading.Thread(target=get)
        reader.start()
        gate.wait_held()  # missed RAM and Redis, read S3, not returned yet
        assert client.delete(NS, keys) == 10
        gate.open()
        reader.join(60)
        assert sum(b is not None for b in got[0]) == 10
        drain(server)  # what a promotion would have queued for Redis
        assert (in_ram(server, keys), in_redis(redis_server, keys), in_s3(s3_server, keys)) == (0, 0, 0)
        assert served(client, keys) == (0, 0)
        stats = client.stats()
        assert (stats.tier("ram").promotions, stats.tier("redis").promotions) == (0, 0)
    assert server.stack.fence.tombstones == 0


# -- what a put reports per tier ------------------------------------------------------------------


def test_put_with_redis_down_says_redis_did_not_take_it(make_server, redis_server: RedisProcess) -> None:
    server: ServerThread = make_server(
        ram={"capacity_bytes": 64 << 20}, redis=redis_cfg(redis_server, timeout_s=0.5, breaker_reset_s=30)
    )
    with KVCacheClient(server.target) as client:
        first = blocks(3)
        assert client.put_many(NS, first).tiers == (TierPutResult("ram", stored=3), TierPutResult("redis", stored=3))
        redis_server.kill()
        data = blocks(20)
        results = [client.put_many(NS, [item]) for item in data]  # refused, then skipped by the open breaker
        assert all((r.stored, r.rejected) == (1, 0) for r in results)  # RAM holds every one
        assert all(r.tier("ram") == TierPutResult("ram", stored=1) for r in results)
        assert all(r.tier("redis") == TierPutResult("redis", failed=1) for r in results)
        assert sum(r.tier("redis").stored for r in results) == 0
        assert [bytes(b) for b in client.get_many(NS, [k for k, _ in data])] == [b for _, b in data]
        with pytest.raises(KeyError):
            results[0].tier("s3")


@pytest.mark.parametrize("queue_full", ["drop", "sync"])
def test_put_into_a_full_write_behind_queue_reports_it(make_server, s3_server: S3Process, queue_full: str) -> None:
    first, data = blocks(1), blocks(10)
    size = len(data[0][1])
    server: ServerThread = make_server(
        ram={"capacity_bytes": 64 << 20},
        s3=s3_cfg(s3_server, write_mode="behind", queue_max_bytes=3 * size + size // 2, queue_full=queue_full),
    )
    gate = Gate(tier_of(server, "s3"), "put_many", [first[0][0]])
    with KVCacheClient(server.target) as client:
        assert client.put_many(NS, first).tier("s3") == TierPutResult("s3", queued=1)
        gate.wait_held()  # the writer is stuck in its first batch: the queue drains no further
        result = client.put_many(NS, data)
        assert (result.stored, result.rejected) == (10, 0)
        assert result.tier("ram") == TierPutResult("ram", stored=10)
        if queue_full == "drop":
            assert result.tier("s3") == TierPutResult("s3", queued=3, dropped=7)
            assert client.stats().tier("s3").queue_dropped == 7
        else:
            assert result.tier("s3") == TierPutResult("s3", stored=7, queued=3)  # written by the put itself
            assert in_s3(s3_server, [k for k, _ in data]) == 7
        gate.open()
        drain(server)
        assert in_s3(s3_server, [k for k, _ in first + data]) == (4 if queue_full == "drop" else 11)


# -- the fence on its own -------------------------------------------------------------------------


def test_fence_keeps_tombstones_only_while_older_operations_run() -> None:
    fence = DeleteFence()
    k = bytes(16)
    old = fence.begin()
    fence.deleting("ns", [k])
    assert fence.blocked(old, "ns", k) and fence.running("ns", k)
    during = fence.begin()  # began while the Delete ran
    assert fence.blocked(during, "ns", k)
    fence.deleted("ns", [k])
    assert not fence.running("ns", k) and fence.tombstones == 1
    assert fence.blocked(old, "ns", k) and fence.blocked(during, "ns", k)
    after = fence.begin()
    assert not fence.blocked(after, "ns", k) and not fence.blocked(old, "other", k)
    fence.end(old)
    assert fence.tombstones == 1  # `during` is still open
    fence.end(during)
    assert fence.tombstones == 0
    fence.end(after)
    fence.deleting("ns", [k])
    fence.deleted("ns", [k])  # nothing open: no tombstone at all
    assert fence.tombstones == 0


class _SlowWriteTier(Tier):
    """A tier whose writes take longer than the stack's timeout, in a thread, as Redis's and S3's do when
    their backend is slow; it keeps the tier contract (put_many ends when its write has landed)."""

    name, kind = "redis", TierKind.REDIS

    def __init__(self, write_s: float) -> None:
        self.data: dict[tuple[str, bytes], bytes] = {}
        self._write_s = write_s
        self._pool = ThreadPoolExecutor(2)

    def _put(self, namespace: str, items: list[tuple[bytes, bytes]]) -> None:
        time.sleep(self._write_s)
        for key, block in items:
            self.data[(namespace, key)] = block

    async def put_many(self, namespace: str, items: Sequence[tuple[bytes, bytes]]) -> list[bool]:
        await in_pool(self._pool, self._put, namespace, list(items))
        return [True] * len(items)

    async def get_many(self, namespace: str, keys: Sequence[bytes]) -> list[bytes | None]:
        return [self.data.get((namespace, k)) for k in keys]

    async def delete_many(self, namespace: str, keys: Sequence[bytes]) -> int:
        return sum(self.data.pop((namespace, k), None) is not None for k in keys)

    def stats(self) -> TierStats:
        return TierStats(name=self.name, kind=self.kind)

    def shutdown(self) -> None:
        """Waits for the writes still running in the tier's threads."""
        self._pool.shutdown(wait=True)


def test_a_write_that_outlives_its_timeout_and_lands_after_a_delete_is_deleted_again() -> None:
    """Found in review: a write-through put whose tier write ran past timeout_s kept going in its thread; the
    Delete waited timeout_s for it and went on; the write landed after the Delete returned and a later Get
    served and promoted the deleted block. Now the stack deletes such keys again when the write ends, and
    publishes REMOVED for them (before, nothing: a late write that ended within its own timeout published
    STORED, and that was the last word an event subscriber, a router, heard)."""

    async def main() -> tuple[bool, bool, object, int, int]:
        tier = _SlowWriteTier(write_s=0.5)
        stack = TierStack(1 << 20, [(tier, LowerTierPolicy(write_mode=WriteMode.THROUGH, timeout_s=0.1))])
        await stack.start()
        events = stack.events.subscribe(NS)
        key = os.urandom(16)
        outcome = await stack.put(NS, [(key, raw_block(key, b"deleted" * 10))])
        assert [(t.name, t.stored, t.failed) for t in outcome.tiers] == [("ram", 1, 0), ("redis", 0, 1)]
        await stack.delete(NS, [key])
        held_right_after = (NS, key) in tier.data  # the write is still sleeping in its thread
        await asyncio.to_thread(tier.shutdown)  # until the write has landed in the tier (0.5 s)
        for _ in range(50):  # then the stack's reaction to it, if any: a few loop turns (bounded, 1 s)
            await asyncio.sleep(0.02)
            if (NS, key) not in tier.data:
                break
        assert (NS, key) not in tier.data, "the write landed after the Delete and stayed"
        got = await stack.get(NS, [key])
        redone = stack._lower[0].counters.late_deletes
        seen = [(e.kind.name, e.tier.name) for _, e in await events.next_batch() if e.tier is tier.kind]
        assert seen == [("REMOVED", tier.kind.name)], seen  # the redone delete, and it only
        await stack.close()
        return held_right_after, (NS, key) in tier.data, got[0], redone, stack.fence.tombstones

    held_right_after, held_later, got, redone, tombstones = asyncio.run(main())
    assert (held_right_after, held_later, got, redone, tombstones) == (False, False, None, 1, 0)


def test_a_redis_write_that_outlives_its_timeout_does_not_undo_a_delete(
    make_server, redis_server: RedisProcess
) -> None:
    """The same through the real Redis tier: its SET pipeline (blocking redis-py, in the tier's thread) takes
    0.5 s against a 0.1 s timeout. Old code: the put gave up, the Delete found nothing in flight and returned,
    then the SET landed and the deleted block was served again from Redis."""
    server: ServerThread = make_server(redis=redis_cfg(redis_server, timeout_s=0.1), ram={"capacity_bytes": 1 << 20})
    redis = tier_of(server, "redis")
    real = redis._put_blocking  # type: ignore[attr-defined]
    landed = threading.Event()

    def slow_put(named: list[tuple[str, bytes]]) -> None:
        time.sleep(0.5)
        real(named)
        landed.set()

    redis._put_blocking = slow_put  # type: ignore[attr-defined]
    data = blocks(3)
    keys = [k for k, _ in data]
    with KVCacheClient(server.target) as client:
        assert client.put_many(NS, data).tier("redis").stored == 0  # the put gave up on Redis after 0.1 s
        client.delete(NS, keys)
        assert landed.wait(10)  # the SET landed after the Delete returned
        wait_for(lambda: in_redis(redis_server, keys) == 0, timeout_s=10, what="the late SET deleted again")
        assert served(client, keys) == (0, 0)
    assert server.stack.fence.tombstones == 0
