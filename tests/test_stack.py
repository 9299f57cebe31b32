"""The tier stack through a real kvcache server over a real redis-server and S3 API server.

Promotion, demotion, write-behind and its bound, warm restart, backends dying and coming
back, corrupted copies in lower tiers, compression, graceful drain, concurrent clients.
"""

from __future__ import annotations

import hashlib
import os
import random
import threading
import time

import pytest

from kvcache_client import KVCacheClient
from kvcache_core.format import Compression, decode_block, parse_header
from tests.backends import RedisProcess, S3Process, wait_for
from tests.conftest import ServerThread, raw_block

pytestmark = pytest.mark.timeout(180)

NS = "stack-test"


def payload(key: bytes, size: int) -> bytes:
    seed = hashlib.sha256(key).digest()
    return (seed * (size // 32 + 1))[:size]


def blocks(n: int, size: int = 8 << 10) -> list[tuple[bytes, bytes]]:
    out = []
    for _ in range(n):
        k = os.urandom(16)
        out.append((k, raw_block(k, payload(k, size))))
    return out


def redis_cfg(redis: RedisProcess, **kw: object) -> dict[str, object]:
    return {"enabled": True, "url": redis.url, "timeout_s": 0.5, "breaker_reset_s": 0.2, **kw}


def s3_cfg(s3: S3Process, **kw: object) -> dict[str, object]:
    return {
        "enabled": True,
        "bucket": "kvcache-test",
        "endpoint_url": s3.endpoint,
        "path_style": True,
        "create_bucket": True,
        "timeout_s": 2.0,
        "breaker_reset_s": 0.2,
        **kw,
    }


def assert_intact(client: KVCacheClient, keys: list[bytes]) -> list[bool]:
    """Fetches keys; every block returned carries exactly its key's bytes. Returns presence."""
    got = client.get_many(NS, keys)
    for k, b in zip(keys, got, strict=True):
        if b is not None:
            data = bytes(decode_block(b, verify=False)[1])
            assert data == payload(k, len(data))
    return [b is not None for b in got]


def s3_names(s3: S3Process) -> set[str]:
    client = s3.client()
    try:
        listed = client.list_objects_v2(Bucket="kvcache-test").get("Contents", [])
    except client.exceptions.NoSuchBucket:
        return set()  # the server creates it on its first write
    return {o["Key"] for o in listed}


def tier(client: KVCacheClient, name: str):
    return client.stats().tier(name)


def test_reads_fall_through_and_promote(make_server, redis_server: RedisProcess, s3_server: S3Process) -> None:
    server: ServerThread = make_server(
        ram={"capacity_bytes": 64 << 10, "demote_on_evict": False},
        redis=redis_cfg(redis_server),
        s3=s3_cfg(s3_server, write_mode="through"),
    )
    data = blocks(24)  # 200 KiB: RAM keeps only the newest few
    keys = [k for k, _ in data]
    with KVCacheClient(server.target) as client:
        assert client.put_many(NS, data).stored == 24
        found = client.lookup(NS, keys)
        assert found.prefix_length == 24
        assert set(found.tiers) == {"ram", "redis"}  # every block in Redis, the newest also in RAM
        redis_server.client().flushall()  # now the oldest live only in S3
        found = client.lookup(NS, keys)
        assert found.prefix_length == 24 and "s3" in found.tiers
        # The oldest first: a Get's own RAM hits stay leased (pinned in the arena) until they are
        # sent, so a Get that reads all RAM holds would leave its promotions no room.
        assert all(assert_intact(client, keys[:8]))
        assert all(assert_intact(client, keys))
        stats = client.stats()
        assert stats.tier("s3").hits > 0 and stats.tier("ram").promotions > 0
        # Promoted from S3 into RAM (the newest) and queued up into Redis.
        wait_for(lambda: tier(client, "redis").queue_depth == 0, what="promotion queue")
        assert tier(client, "redis").promotions > 0
        assert redis_server.client().dbsize() > 0


def test_blocks_evicted_from_ram_are_demoted(make_server, redis_server: RedisProcess) -> None:
    server: ServerThread = make_server(ram={"capacity_bytes": 64 << 10}, redis=redis_cfg(redis_server))
    data = blocks(20)
    keys = [k for k, _ in data]
    with KVCacheClient(server.target) as client:
        # Redis is down while the blocks are put: write-through fails (counted), RAM keeps them.
        redis_server.kill()
        client.put_many(NS, data[:6])
        assert tier(client, "redis").errors > 0
        redis_server.start()
        time.sleep(0.3)  # past the breaker's back-off
        # More puts evict the first six from RAM; the demotion writes them to Redis instead of dropping them.
        for start in range(6, 20, 2):
            client.put_many(NS, data[start : start + 2])
        wait_for(lambda: tier(client, "redis").queue_depth == 0, what="demotions")
        assert tier(client, "redis").demotions >= 6
        assert all(assert_intact(client, keys))


def test_write_behind_queue_is_bounded_and_counts_drops(make_server, s3_server: S3Process) -> None:
    server: ServerThread = make_server(
        ram={"capacity_bytes": 64 << 20},
        s3=s3_cfg(s3_server, write_mode="behind", queue_max_bytes=256 << 10, timeout_s=2.0),
    )
    data = blocks(40, size=32 << 10)  # 1.3 MiB against a 256 KiB queue
    with KVCacheClient(server.target) as client:
        client.put_many(NS, data[:1])
        wait_for(lambda: len(s3_names(s3_server)) == 1, what="first write-behind")
        s3_server.pause()  # S3 hangs: the queue fills
        try:
            max_queued = reported_drops = 0
            for start in range(0, 40, 4):
                result = client.put_many(NS, data[start : start + 4])
                assert result.stored == 4  # puts never wait for S3
                took = result.tier("s3")
                assert (took.stored, took.queued + took.dropped) == (0, 4)
                reported_drops += took.dropped
                s = tier(client, "s3")
                max_queued = max(max_queued, s.queue_bytes)
            assert max_queued <= 256 << 10
            assert tier(client, "s3").queue_dropped == reported_drops > 0  # each put said what it dropped
        finally:
            s3_server.resume()
        wait_for(lambda: tier(client, "s3").queue_depth == 0, timeout_s=30, what="queue drain")
        # Everything is still served (from RAM); what was not dropped reached S3.
        assert all(assert_intact(client, [k for k, _ in data]))
        s = tier(client, "s3")
        assert 0 < len(s3_names(s3_server)) <= 40 - s.queue_dropped + 1


def test_warm_restart_finds_blocks_in_redis_then_s3(
    make_server, redis_server: RedisProcess, s3_server: S3Process
) -> None:
    cfg = {"ram": {"capacity_bytes": 8 << 20}, "redis": redis_cfg(redis_server), "s3": s3_cfg(s3_server)}
    data = blocks(16)
    keys = [k for k, _ in data]
    first: ServerThread = make_server(**cfg)
    with KVCacheClient(first.target) as client:
        client.put_many(NS, data)
    assert first.call(first.running.stop(0.5, 10.0)) == 0  # graceful stop drains S3's write-behind queue
    assert len(s3_names(s3_server)) == 16
    second: ServerThread = make_server(**cfg)
    with KVCacheClient(second.target) as client:
        assert tier(client, "ram").blocks == 0
        found = client.lookup(NS, keys)
        assert found.prefix_length == 16 and set(found.tiers) == {"redis"}
        assert all(assert_intact(client, keys))
        redis_server.client().flushall()
        second.stack.ram.delete_many_sync(NS, keys)
        found = client.lookup(NS, keys)
        assert found.prefix_length == 16 and set(found.tiers) == {"s3"}
        assert all(assert_intact(client, keys))


def test_redis_killed_mid_run(make_server, redis_server: RedisProcess) -> None:
    server: ServerThread = make_server(ram={"capacity_bytes": 64 << 20}, redis=redis_cfg(redis_server))
    a, b, c = blocks(5), blocks(5), blocks(5)
    with KVCacheClient(server.target, timeout_s=10) as client:
        client.put_many(NS, a)
        assert redis_server.client().dbsize() == 5
        redis_server.kill()
        for _ in range(6):  # keeps serving from RAM; errors counted, then the breaker stops calling Redis
            result = client.put_many(NS, b)
            assert result.stored == 5 and result.tier("ram").stored == 5
            assert (result.tier("redis").stored, result.tier("redis").failed) == (0, 5)  # and says so
            assert all(assert_intact(client, [k for k, _ in a + b]))
            assert client.lookup(NS, [k for k, _ in a]).prefix_length == 5
        s = tier(client, "redis")
        assert s.errors >= 3 and s.skipped > 0 and not s.healthy
        redis_server.start()  # back, empty
        wait_for(lambda: client.put_many(NS, c).stored == 5 and tier(client, "redis").healthy, what="breaker close")
        assert redis_server.client().dbsize() == 5
        assert all(assert_intact(client, [k for k, _ in a + b + c]))


def test_s3_stopped_mid_run(make_server, s3_server: S3Process) -> None:
    server: ServerThread = make_server(
        ram={"capacity_bytes": 64 << 20}, s3=s3_cfg(s3_server, write_mode="through", timeout_s=1.0)
    )
    a, b, c = blocks(4), blocks(4), blocks(4)
    with KVCacheClient(server.target, timeout_s=20) as client:
        client.put_many(NS, a)
        s3_server.kill()
        for _ in range(5):
            assert client.put_many(NS, b).stored == 4
            assert all(assert_intact(client, [k for k, _ in a + b]))
        s = tier(client, "s3")
        assert s.errors >= 3 and s.skipped > 0 and not s.healthy
        s3_server.start()  # a new, empty S3: the operator recreates the bucket
        s3_server.client().create_bucket(Bucket="kvcache-test")
        wait_for(lambda: client.put_many(NS, c).stored == 4 and tier(client, "s3").healthy, what="breaker close")
        assert {f"kvcache/{NS}/{k.hex()}" for k, _ in c} <= s3_names(s3_server)
        assert all(assert_intact(client, [k for k, _ in a + b + c]))


@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_flipped_byte_in_redis_is_a_miss_and_deleted(make_server, redis_server: RedisProcess, compression: str) -> None:
    server: ServerThread = make_server(redis=redis_cfg(redis_server, compression=compression))
    k = os.urandom(16)
    block = raw_block(k, bytes(20_000) + payload(k, 1000))  # compressible
    with KVCacheClient(server.target) as client:
        client.put_many(NS, [(k, block)])
        server.stack.ram.delete_many_sync(NS, [k])  # only Redis holds it now
        r = redis_server.client()
        name = f"kvcache/{NS}/{k.hex()}"
        stored = bytearray(r.get(name))
        assert (parse_header(bytes(stored)).compression is Compression.NONE) == (compression == "none")
        stored[-10] ^= 0x40
        r.set(name, bytes(stored))
        assert client.get_many(NS, [k]) == [None]
        assert r.exists(name) == 0  # the bad copy is gone
        assert tier(client, "redis").checksum_failures == 1
        assert client.lookup(NS, [k]).prefix_length == 0
        assert client.corrupt_blocks == 0  # the server never sent it


def test_flipped_byte_in_s3_is_a_miss_and_deleted(make_server, s3_server: S3Process) -> None:
    server: ServerThread = make_server(s3=s3_cfg(s3_server, write_mode="through", compression="shuffle-lz4"))
    k = os.urandom(16)
    with KVCacheClient(server.target) as client:
        client.put_many(NS, [(k, raw_block(k, payload(k, 5000)))])
        server.stack.ram.delete_many_sync(NS, [k])
        s3 = s3_server.client()
        name = f"kvcache/{NS}/{k.hex()}"
        stored = bytearray(s3.get_object(Bucket="kvcache-test", Key=name)["Body"].read())
        stored[100] ^= 0x01
        s3.put_object(Bucket="kvcache-test", Key=name, Body=bytes(stored))
        assert client.get_many(NS, [k]) == [None]
        assert name not in s3_names(s3_server)
        assert tier(client, "s3").checksum_failures == 1


def test_compression_in_redis_round_trips_kv(make_server, redis_server: RedisProcess) -> None:
    import torch

    server: ServerThread = make_server(redis=redis_cfg(redis_server, compression="shuffle-lz4"))
    t = (torch.randn(4, 2, 2, 32, 64) * 0.1).to(torch.bfloat16)
    with KVCacheClient(server.target) as client:
        key = os.urandom(16)
        client.put_tensors(NS, [key], [t])
        server.stack.ram.delete_many_sync(NS, [key])
        stored = redis_server.client().get(f"kvcache/{NS}/{key.hex()}")
        header = parse_header(stored)
        assert header.compression is Compression.SHUFFLE_LZ4 and header.payload_len < header.raw_len
        (got,) = client.get_tensors(NS, [key])
        assert got is not None and torch.equal(got.view(torch.uint8), t.view(torch.uint8))
        s = tier(client, "redis")
        assert s.bytes_written == len(stored) and s.bytes_read == len(stored)


def test_shutdown_reports_writes_it_could_not_drain(make_server, s3_server: S3Process) -> None:
    server: ServerThread = make_server(s3=s3_cfg(s3_server, write_mode="behind", timeout_s=5.0))
    with KVCacheClient(server.target) as client:
        client.put_many(NS, blocks(1))
        wait_for(lambda: len(s3_names(s3_server)) == 1, what="first write")
        s3_server.pause()
        try:
            client.put_many(NS, blocks(70))  # more than one batch: some stay queued
            dropped = server.call(server.running.stop(0.5, 0.5))
        finally:
            s3_server.resume()
    assert dropped > 0


def test_concurrent_clients_across_all_tiers(make_server, redis_server: RedisProcess, s3_server: S3Process) -> None:
    server: ServerThread = make_server(
        ram={"capacity_bytes": 256 << 10},
        redis=redis_cfg(redis_server, timeout_s=2.0),
        s3=s3_cfg(s3_server, write_mode="behind"),
    )
    pool = blocks(120, size=16 << 10)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            with KVCacheClient(server.target, timeout_s=30) as client:
                for _ in range(12):
                    batch = rng.sample(pool, 6)
                    client.put_many(NS, batch)
                    present = assert_intact(client, [k for k, _ in rng.sample(pool, 12)])
                    del present
                    client.lookup(NS, [k for k, _ in batch])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    with KVCacheClient(server.target) as client:
        wait_for(lambda: tier(client, "s3").queue_depth == 0, timeout_s=30, what="write-behind")
        assert tier(client, "ram").used_bytes <= 256 << 10
        assert_intact(client, [k for k, _ in pool])
        stats = client.stats()
        assert all(t.checksum_failures == 0 for t in stats.tiers)


def test_queue_full_sync_policy_writes_instead_of_dropping(make_server, s3_server: S3Process) -> None:
    server: ServerThread = make_server(
        s3=s3_cfg(s3_server, write_mode="behind", queue_max_bytes=64 << 10, queue_full="sync")
    )
    data = blocks(30, size=16 << 10)  # 480 KiB through a 64 KiB queue
    with KVCacheClient(server.target) as client:
        for start in range(0, 30, 10):
            assert client.put_many(NS, data[start : start + 10]).stored == 10
        wait_for(lambda: tier(client, "s3").queue_depth == 0, timeout_s=30, what="queue drain")
        assert tier(client, "s3").queue_dropped == 0
    assert {f"kvcache/{NS}/{k.hex()}" for k, _ in data} <= s3_names(s3_server)
