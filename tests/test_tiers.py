"""The Redis and S3 tiers on their own, against a real redis-server and a real S3 API server."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from kvcache_server.tiers.base import TierError
from kvcache_server.tiers.redis import RedisTier
from kvcache_server.tiers.s3 import PresenceIndex, S3Tier
from tests.backends import RedisProcess, S3Process, free_port, make_certs
from tests.conftest import keyed

pytestmark = pytest.mark.timeout(120)

NS = "0123456789abcdef0123456789abcdef"


def run(coro):
    return asyncio.run(coro)


def items(n: int, size: int = 1000) -> list[tuple[bytes, bytes]]:
    return [keyed(os.urandom(size)) for _ in range(n)]


async def _exercise(tier, batch: list[tuple[bytes, bytes]]) -> None:
    keys = [k for k, _ in batch]
    missing = os.urandom(16)
    assert await tier.contains_many(NS, [*keys, missing]) == [False] * (len(keys) + 1)
    assert await tier.put_many(NS, batch) == [True] * len(batch)
    assert await tier.contains_many(NS, [keys[0], missing, keys[1]]) == [True, False, True]
    assert await tier.get_many(NS, [*keys, missing]) == [b for _, b in batch] + [None]
    assert await tier.prefix_length(NS, [*keys[:2], missing, *keys[2:]]) == 2
    assert await tier.delete_many(NS, [*keys[:3], missing]) == 3
    assert await tier.get_many(NS, keys[:4]) == [None, None, None, batch[3][1]]
    await tier.close()


def test_redis_tier_one_value_per_block(redis_server: RedisProcess) -> None:
    batch = items(10)
    tier = RedisTier(redis_server.url, key_prefix="kvc-test", ttl_s=600)
    run(_exercise(tier, batch))
    r = redis_server.client()
    k, block = batch[5]
    name = f"kvc-test/{NS}/{k.hex()}"
    # Header and payload are one value, under the documented name, with the TTL.
    assert r.get(name) == block
    assert 0 < r.ttl(name) <= 600
    assert sorted(r.keys("*")) == sorted(f"kvc-test/{NS}/{k.hex()}".encode() for k, _ in batch[3:])


def test_redis_tier_with_password(make_server) -> None:
    proc = RedisProcess("--requirepass", "s3cret")
    try:
        run(_exercise(RedisTier(proc.url, password="s3cret"), items(5)))
        run(_exercise(RedisTier(f"redis://:s3cret@127.0.0.1:{proc.port}/0"), items(5)))
        with pytest.raises(TierError):
            run(RedisTier(proc.url).get_many(NS, [b"k" * 16]))
    finally:
        proc.stop()


def test_redis_tier_over_tls(tmp_path: Path) -> None:
    certs = make_certs(tmp_path)
    tls_port = free_port()
    proc = RedisProcess(
        "--tls-port",
        str(tls_port),
        "--tls-cert-file",
        str(certs["server.crt"]),
        "--tls-key-file",
        str(certs["server.key"]),
        "--tls-ca-cert-file",
        str(certs["ca.crt"]),
        "--tls-auth-clients",
        "no",
    )
    try:
        url = f"rediss://127.0.0.1:{tls_port}/0"
        run(_exercise(RedisTier(url, tls_ca_file=str(certs["ca.crt"])), items(5)))
        # Without the CA the server's certificate is not trusted: a failure, never plaintext.
        with pytest.raises(TierError):
            run(RedisTier(url).get_many(NS, [b"k" * 16]))
    finally:
        proc.stop()


def test_redis_down_is_a_tier_error() -> None:
    tier = RedisTier(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5)
    for call in (
        tier.get_many(NS, [b"k" * 16]),
        tier.contains_many(NS, [b"k" * 16]),
        tier.put_many(NS, items(1)),
        tier.delete_many(NS, [b"k" * 16]),
    ):
        with pytest.raises(TierError):
            run(call)


def test_redis_maxmemory_eviction_is_only_ever_a_miss() -> None:
    proc = RedisProcess("--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru")
    try:
        tier = RedisTier(proc.url)
        batch = items(60, size=64 << 10)  # ~4 MiB into a 2 MiB Redis

        async def main() -> None:
            for start in range(0, len(batch), 5):
                await tier.put_many(NS, batch[start : start + 5])
            got = await tier.get_many(NS, [k for k, _ in batch])
            assert 0 < sum(g is not None for g in got) < len(batch)
            for (_, want), have in zip(batch, got, strict=True):
                assert have is None or have == want
            await tier.close()

        run(main())
    finally:
        proc.stop()


def test_s3_tier_one_object_per_block(s3_server: S3Process) -> None:
    batch = items(12, size=3000)
    tier = S3Tier(
        "kv-bucket",
        prefix="pfx/",
        endpoint_url=s3_server.endpoint,
        path_style=True,
        create_bucket=True,
        max_concurrency=4,
    )
    run(_exercise(tier, batch))
    s3 = s3_server.client()
    k, block = batch[7]
    assert s3.get_object(Bucket="kv-bucket", Key=f"pfx/{NS}/{k.hex()}")["Body"].read() == block
    listed = s3.list_objects_v2(Bucket="kv-bucket")["Contents"]
    assert len(listed) == len(batch) - 3


def test_s3_object_that_vanished_is_a_miss(s3_server: S3Process) -> None:
    tier = S3Tier("kv-bucket", endpoint_url=s3_server.endpoint, path_style=True, create_bucket=True)
    batch = items(3)

    async def main() -> None:
        await tier.put_many(NS, batch)
        s3_server.client().delete_object(Bucket="kv-bucket", Key=f"kvcache/{NS}/{batch[1][0].hex()}")
        assert await tier.get_many(NS, [k for k, _ in batch]) == [batch[0][1], None, batch[2][1]]
        await tier.close()

    run(main())


def test_s3_down_is_a_tier_error() -> None:
    tier = S3Tier("b", endpoint_url=f"http://127.0.0.1:{free_port()}", path_style=True, timeout_s=0.5)
    with pytest.raises(TierError):
        run(tier.get_many(NS, [b"k" * 16]))
    with pytest.raises(TierError):
        run(tier.put_many(NS, items(1)))


def test_s3_missing_bucket_is_a_tier_error(s3_server: S3Process) -> None:
    tier = S3Tier("no-such-bucket", endpoint_url=s3_server.endpoint, path_style=True)
    with pytest.raises(TierError):
        run(tier.put_many(NS, items(1)))


def test_s3_presence_index_answers_lookups_without_heads(s3_server: S3Process) -> None:
    tier = S3Tier("kv-bucket", endpoint_url=s3_server.endpoint, path_style=True, create_bucket=True, max_concurrency=8)
    heads: list[str] = []
    real_head = tier._head

    def counted_head(name: str) -> bool:
        heads.append(name)
        return real_head(name)

    tier._head = counted_head  # type: ignore[method-assign]
    batch = items(4)
    keys = [k for k, _ in batch]
    absent = [os.urandom(16) for _ in range(5)]

    async def main() -> None:
        await tier.put_many(NS, batch)
        assert tier.known(NS, [*keys, absent[0]]) == [True] * 4 + [False]  # written here: no HEAD needed
        # Someone else's copy: unknown until a HEAD sees it.
        other = keyed(b"x" * 100)
        s3_server.client().put_object(Bucket="kv-bucket", Key=f"kvcache/{NS}/{other[0].hex()}", Body=other[1])
        assert tier.known(NS, [other[0]]) == [False]
        assert await tier.contains_prefix(NS, [other[0]]) == [True]
        assert tier.known(NS, [other[0]]) == [True] and len(heads) == 1
        # A prefix check HEADs two keys at a time (max_concurrency // 4) and stops at the first absent one.
        heads.clear()
        assert await tier.contains_prefix(NS, [absent[0], *absent[1:], other[0]]) == [False] * 6
        assert len(heads) == 2
        # A Delete forgets; a Get that misses (the object vanished behind this server's back) does too.
        assert await tier.delete_many(NS, keys[:1]) == 1
        s3_server.client().delete_object(Bucket="kv-bucket", Key=f"kvcache/{NS}/{keys[1].hex()}")
        assert tier.known(NS, keys[:2]) == [False, True]  # the vanished one: a false present...
        assert await tier.get_many(NS, keys[:2]) == [None, None]  # ...which the Get corrects
        assert tier.known(NS, keys) == [False, False, True, True]
        await tier.close()

    run(main())


def test_presence_index_is_bounded_in_keys_and_age() -> None:
    now = [0.0]
    index = PresenceIndex(20 * PresenceIndex.ENTRY_BYTES, ttl_s=100.0, clock=lambda: now[0])  # 10 keys a generation
    keys = [os.urandom(16) for _ in range(25)]
    token = index.begin()
    index.add(token, NS, keys)
    assert len(index) == 15  # generations of 10: the oldest one was dropped when the third began
    assert index.known(NS, keys) == [False] * 10 + [True] * 15
    now[0] = 99.0
    assert index.known(NS, keys[24:]) == [True]  # at most ttl_s old
    now[0] = 100.0
    assert index.known(NS, keys) == [False] * 25
    # A request that began before a Delete of a key cannot add it back; one that began after can.
    index.discard(NS, keys[:1], deleting=True)
    index.add(token, NS, keys[:2])
    assert index.known(NS, keys[:2]) == [False, True]
    index.end(token)
    later = index.begin()
    index.add(later, NS, keys[:1])
    assert index.known(NS, keys[:1]) == [True]
    index.end(later)
    assert len(PresenceIndex(0, ttl_s=100.0)) == 0  # 0 bytes: no index
