"""A Lookup waits for a slow lower tier as long as its caller's deadline allows, never a fixed time.

A real kvcache server over a real redis-server and moto S3 server. "Slow" is a backend stopped with
SIGSTOP for a set time and resumed with SIGCONT (its connections stay open; it answers once resumed),
always resumed in a `finally`. The only bound on time asserted is the client's own deadline: each
assertion is an exact count or an exact answer.

Before the change a Lookup waited a fixed 0.15 s (lookup_timeout_s) for each lower tier: a tier that
answered at 0.3 s, well within the caller's 2 s, was a miss, and so was the first Lookup of blocks
held only in S3 while S3 was slow to answer.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

import pytest

from kvcache_client import KVCacheClient, LookupResult, RetryPolicy
from tests.backends import RedisProcess, S3Process, sigstop, wait_for
from tests.conftest import ServerThread, raw_block

pytestmark = pytest.mark.timeout(120)

NS = "lookup-deadline"
BUCKET = "kvcache-test"
SLOW_S = 0.4
"""How long a backend is stopped: more than the old fixed 0.15 s, well within a 3 s deadline."""


def block(key: bytes) -> bytes:
    return raw_block(key, key * 256)


@contextlib.contextmanager
def slow(pid: int, for_s: float) -> Iterator[None]:
    """The backend hung now and resumed after `for_s` (or when the block ends, if that is sooner)."""
    sigstop(pid)
    timer = threading.Timer(for_s, os.kill, (pid, signal.SIGCONT))
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        os.kill(pid, signal.SIGCONT)


def tiers(redis: RedisProcess, s3: S3Process | None = None) -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {
        "ram": {"capacity_bytes": 64 << 20},
        "redis": {"enabled": True, "url": redis.url, "timeout_s": 5.0},
    }
    if s3 is not None:
        out["s3"] = {
            "enabled": True,
            "bucket": BUCKET,
            "endpoint_url": s3.endpoint,
            "path_style": True,
            "create_bucket": True,
            "timeout_s": 5.0,
        }
    return out


def client_with(server: ServerThread, deadline_s: float) -> KVCacheClient:
    return KVCacheClient(server.target, timeout_s=deadline_s, retry=RetryPolicy(max_attempts=1))


def test_a_slow_redis_that_answers_within_the_deadline_is_a_hit(make_server, redis_server: RedisProcess) -> None:
    """24 blocks only Redis holds; Redis answers after 0.4 s; the caller's deadline is 3 s: all 24
    are reported stored (before: 0 of 24, after the fixed 0.15 s), and no hit was lost late."""
    server: ServerThread = make_server(**tiers(redis_server))
    keys = [os.urandom(16) for _ in range(24)]
    r = redis_server.client()
    for key in keys:
        r.set(f"kvcache/{NS}/{key.hex()}", block(key))  # only Redis holds them
    assert redis_server.proc is not None
    with client_with(server, 3.0) as client:
        with slow(redis_server.proc.pid, SLOW_S):
            answer = client.lookup(NS, keys)
        assert answer == LookupResult(24, ("redis",) * 24)
        redis = client.stats().tier("redis")
        assert (redis.errors, redis.lookup_late_hits) == (0, 0)


def test_a_fresh_server_finds_s3_only_blocks_on_its_first_lookup(
    make_server, redis_server: RedisProcess, s3_server: S3Process
) -> None:
    """A server that has never seen them; S3 holds 8 blocks and answers after 0.4 s: the first Lookup
    (vLLM's lookup of a prompt, deadline 3 s here) finds all 8 in S3 (before: a miss)."""
    s3 = s3_server.client()
    s3.create_bucket(Bucket=BUCKET)
    keys = [os.urandom(16) for _ in range(8)]
    server: ServerThread = make_server(**tiers(redis_server, s3_server))
    for key in keys:
        s3.put_object(Bucket=BUCKET, Key=f"kvcache/{NS}/{key.hex()}", Body=block(key))
    assert s3_server.proc is not None
    with client_with(server, 3.0) as client:
        with slow(s3_server.proc.pid, SLOW_S):
            answer = client.lookup(NS, keys)
        assert answer == LookupResult(8, ("s3",) * 8)
        assert client.get_many(NS, keys) == [block(k) for k in keys]


def test_a_tier_later_than_the_deadline_is_a_miss_in_time_and_its_late_hits_are_counted(
    make_server, redis_server: RedisProcess
) -> None:
    """Redis stopped for longer than the caller's 0.6 s deadline: the Lookup answers in time (RAM's
    one block), and once Redis answers, the 5 keys it held are counted as hits lost to a deadline."""
    server: ServerThread = make_server(**tiers(redis_server))
    first, *rest = [os.urandom(16) for _ in range(6)]
    with KVCacheClient(server.target, timeout_s=10) as admin:
        admin.put_many(NS, [(first, block(first))])
    r = redis_server.client()
    for key in rest:
        r.set(f"kvcache/{NS}/{key.hex()}", block(key))
    assert redis_server.proc is not None
    with client_with(server, 0.6) as client:
        with slow(redis_server.proc.pid, 1.5):
            answer = client.lookup(NS, [first, *rest])
        assert answer == LookupResult(1, ("ram",))
    with KVCacheClient(server.target, timeout_s=10) as admin:
        wait_for(lambda: admin.stats().tier("redis").lookup_late_hits == 5, timeout_s=10, what="late hits counted")
        redis = admin.stats().tier("redis")
        assert (redis.errors, redis.breaker) == (1, "closed")  # the one late Lookup; one failure opens nothing
        assert admin.lookup(NS, [first, *rest]) == LookupResult(6, ("ram",) + ("redis",) * 5)


def test_an_operator_cap_still_bounds_the_wait(make_server, redis_server: RedisProcess) -> None:
    """redis.lookup_timeout_s set (0.1 s): the operator's cap wins over a long deadline."""
    cfg = tiers(redis_server)
    cfg["redis"]["lookup_timeout_s"] = 0.1
    server: ServerThread = make_server(**cfg)
    key = os.urandom(16)
    redis_server.client().set(f"kvcache/{NS}/{key.hex()}", block(key))
    assert redis_server.proc is not None
    with client_with(server, 5.0) as client:
        with slow(redis_server.proc.pid, 1.0):
            assert client.lookup(NS, [key]) == LookupResult(0, ())
        wait_for(lambda: client.stats().tier("redis").lookup_late_hits == 1, timeout_s=10, what="late hit counted")
