"""Sessions that stay (PutRequest.retain_ttl_s) and Prefetch, against real servers (docs/tiers.md).

Retention: a session's prefix put with a TTL outlives a flood of one-off blocks larger than RAM
and disk together, where the same run without retention loses it; a tenant's retained bytes are
bounded by its share (the excess stored unretained, counted) without starving another tenant; a
retention that runs out (the RAM tier's clock moved, not slept for) leaves its blocks evictable.
Prefetch: blocks only in Redis are in RAM after it (the next Get a RAM hit, byte-identical);
corrupt ones are never promoted; unknown keys, too many keys and a token without the read right.
"""

from __future__ import annotations

import asyncio
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from kvcache_client import AsyncKVCacheClient, InvalidRequest, KVCacheClient, PermissionDenied
from kvcache_core.blockwire import decode_put_request, encode_put_request
from kvcache_proto import kvcache_pb2 as pb
from kvcache_proto import kvcache_pb2_grpc as pb_grpc
from kvcache_server.auth import token_digest
from kvcache_server.tiers.ram import RamTier
from kvcache_server.tiers.retention import RetentionLimits
from tests.backends import RedisProcess, S3Process, wait_for
from tests.conftest import ServerThread, keyed

KiB, MiB = 1 << 10, 1 << 20
TOKENS = {"acme": "kvc_ret_acme_rw", "globex": "kvc_ret_globex_rw", "writer": "kvc_ret_writer_w", "ops": "kvc_ret_ops"}
RIGHTS = {"acme": '["read", "write"]', "globex": '["read", "write"]', "writer": '["write"]', "ops": '["admin"]'}


def tokens_file(tmp: Path) -> Path:
    text = ""
    for name, token in TOKENS.items():
        tenant = "acme" if name == "writer" else name
        text += f'[[tokens]]\nname = "{name}"\ntenant = "{tenant}"\nsha256 = "{token_digest(token).hex()}"\n'
        text += f"rights = {RIGHTS[name]}\n\n"
    path = tmp / "tokens.toml"
    path.write_text(text)
    return path


def blocks(n: int, size: int) -> list[tuple[bytes, bytes]]:
    return [keyed(os.urandom(size)) for _ in range(n)]


class Clock:
    """The RAM tier's clock, moved by the test (retention and lease deadlines follow it)."""

    def __init__(self) -> None:
        self.offset_s = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset_s


def controlled_clock(server: ServerThread) -> Clock:
    clock = Clock()
    server.stack.ram._clock = clock  # the tier's clock argument (RamTier(clock=...)), set on a running server
    return clock


@pytest.mark.timeout(30)
def test_retain_ttl_s_travels_in_the_first_put_message() -> None:
    key, block = keyed(b"x" * 100)
    wire = encode_put_request("ns", [(key, block)], 12.5)
    assert pb.PutRequest.FromString(wire).retain_ttl_s == 12.5  # the generated code reads the same field
    assert decode_put_request(wire).retain_ttl_s == 12.5
    assert decode_put_request(encode_put_request("ns", [(key, block)])).retain_ttl_s == 0.0
    truncated = encode_put_request("ns", [(key, block)]) + b"\x19" + struct.pack("<d", 1.0)[:5]
    assert decode_put_request(truncated).error


# -- sessions that stay ----------------------------------------------------------------------------

SESSION_BLOCK, SESSION_TURNS, BLOCKS_PER_TURN = 64 * KiB, 10, 8
FLOOD_BLOCK, FLOOD_REQUESTS = 16 * KiB, 5000
RAM_BYTES, DISK_BYTES = 24 * MiB, 8 * MiB


@pytest.mark.timeout(240)
@pytest.mark.parametrize("retain", [True, False], ids=["retained", "not-retained"])
def test_a_retained_session_outlives_a_flood_larger_than_ram_and_disk(
    make_server: Callable[..., ServerThread], tmp_path: Path, retain: bool
) -> None:
    server = make_server(
        ram={"capacity_bytes": RAM_BYTES},
        disk={"enabled": True, "dir": str(tmp_path / "disk"), "capacity_bytes": DISK_BYTES, "region_bytes": MiB},
    )
    ttl_s = 600.0 if retain else None
    session: list[tuple[bytes, bytes]] = []
    with KVCacheClient(server.target, timeout_s=60) as client:  # same host: puts through its shm segment
        # Ten warm-up turns: each finds the whole prefix so far, reads it, and puts its new blocks.
        for _ in range(SESSION_TURNS):
            keys = [k for k, _ in session]
            if keys:
                assert client.lookup("session", keys).prefix_length == len(keys)
                assert [bytes(b) for b in client.get_many("session", keys)] == [b for _, b in session]  # type: ignore[arg-type]
            new = blocks(BLOCKS_PER_TURN, SESSION_BLOCK)
            assert client.put_many("session", new, retain_ttl_s=ttl_s).stored == BLOCKS_PER_TURN
            session += new
        prefix = [k for k, _ in session]
        # Then a flood of one-off requests, each a Lookup that misses and a Put of its block, more bytes
        # than RAM and disk hold together.
        flooded = 0
        for n in range(FLOOD_REQUESTS):
            request = blocks(1, FLOOD_BLOCK)
            assert client.lookup("one-off", [request[0][0]]).prefix_length == 0
            assert client.put_many("one-off", request).stored == 1
            flooded += len(request[0][1])
            if n % 100 == 99:
                server.call(server.stack.wait_idle())  # every demotion written: the disk tier sees the whole flood
        assert flooded > RAM_BYTES + DISK_BYTES
        stats = client.stats()
        ram, disk = stats.tier("ram"), stats.tier("disk")
        assert disk.evictions > 0  # the flood went through the disk tier too
        hit = client.lookup("session", prefix)
        if retain:
            assert hit.prefix_length == len(prefix)  # all of it (the issue asks >= 99%)
            assert set(hit.tiers) == {"ram"}
            assert [bytes(b) for b in client.get_many("session", prefix)] == [b for _, b in session]  # type: ignore[arg-type]
            assert ram.retained_blocks == len(prefix)
            assert ram.retained_bytes == sum(RamTier.entry_cost(b) for _, b in session)
            assert stats.retention_refused == 0
        else:
            assert hit.prefix_length == 0  # its oldest block went first, from RAM and then from disk
            assert ram.retained_blocks == ram.retained_bytes == 0


@pytest.mark.timeout(120)
def test_a_tenant_retains_at_most_its_share_and_another_is_not_starved(
    make_server: Callable[..., ServerThread], tmp_path: Path
) -> None:
    ram_bytes = 8 * MiB
    server = make_server(
        ram={"capacity_bytes": ram_bytes},
        retention={"max_share": 0.25, "max_total_share": 0.5},
        auth={"enabled": True, "tokens_file": str(tokens_file(tmp_path))},
    )
    acme = KVCacheClient(server.target, token=TOKENS["acme"], shm=False)
    globex = KVCacheClient(server.target, token=TOKENS["globex"], shm=False)
    ops = KVCacheClient(server.target, token=TOKENS["ops"], shm=False)
    try:
        greedy = blocks(40, 64 * KiB)  # 2.6 MiB of entry costs, more than a quarter of RAM
        cost = RamTier.entry_cost(greedy[0][1])
        share = int(ram_bytes * 0.25) // cost  # blocks whose entry costs fit the tenant's share
        assert acme.put_many("s", greedy, retain_ttl_s=60).stored == 40  # all stored; the excess unretained
        stats = ops.stats()
        assert stats.retention_refused == 40 - share
        assert stats.tier("ram").retained_blocks == share
        assert stats.tier("ram").retained_bytes == share * cost
        # The first `share` blocks of the put are retained, in order; the rest are not.
        kept = [server.stack.ram.retained("acme:s", k) for k, _ in greedy]
        assert kept == [True] * share + [False] * (40 - share)
        # Another tenant retains its own full share, and its plain puts are stored.
        mine = blocks(share, 64 * KiB)
        assert globex.put_many("s", mine, retain_ttl_s=60).stored == share
        assert globex.put_many("t", blocks(10, 64 * KiB)).stored == 10
        stats = ops.stats()
        assert stats.retention_refused == 40 - share  # nothing of globex's refused
        assert stats.tier("ram").retained_blocks == 2 * share
        # acme floods its own one-off blocks: globex's retained blocks and acme's stay, acme's
        # unretained ones go (evicted before any retained block).
        for _ in range(8):
            assert acme.put_many("flood", blocks(32, 64 * KiB)).stored == 32
        assert globex.lookup("s", [k for k, _ in mine]).prefix_length == share
        assert acme.lookup("s", [k for k, _ in greedy[:share]]).prefix_length == share
        assert acme.lookup("s", [k for k, _ in greedy[share:]]).prefix_length == 0
        # A re-put renews, never double-counts: the accounts stay where they were.
        assert acme.put_many("s", greedy[:share], retain_ttl_s=60).stored == share
        stats = ops.stats()
        assert stats.tier("ram").retained_blocks == 2 * share
        assert stats.retention_refused == 40 - share
        # A retained block is still deletable, and its bytes leave the retained account.
        assert acme.delete("s", [greedy[0][0]]) == 1
        stats = ops.stats()
        assert stats.tier("ram").retained_blocks == 2 * share - 1
        assert stats.tier("ram").retained_bytes == (2 * share - 1) * cost
    finally:
        for client in (acme, globex, ops):
            client.close()


@pytest.mark.timeout(120)
def test_a_retention_that_runs_out_leaves_its_blocks_evictable(make_server: Callable[..., ServerThread]) -> None:
    server = make_server(ram={"capacity_bytes": 8 * MiB}, retention={"max_ttl_s": 60})
    clock = controlled_clock(server)
    session = blocks(16, 64 * KiB)
    keys = [k for k, _ in session]
    with KVCacheClient(server.target, shm=False) as client:
        # A TTL above max_ttl_s is cut to it: 61 s later the retention has ended.
        assert client.put_many("session", session, retain_ttl_s=3600).stored == 16
        assert client.stats().tier("ram").retained_blocks == 16
        clock.offset_s += 30  # half-way: a flood still spares the session
        for _ in range(6):
            client.put_many("flood", blocks(32, 64 * KiB))
        assert client.lookup("session", keys).prefix_length == 16
        assert client.stats().tier("ram").retained_blocks == 16
        clock.offset_s += 31  # 61 s after the put: past max_ttl_s
        stats = client.stats()
        assert stats.tier("ram").retained_blocks == 0 and stats.retention_expired == 16
        for _ in range(6):
            client.put_many("flood", blocks(32, 64 * KiB))
        assert client.lookup("session", keys).prefix_length == 0  # evicted like any block


@pytest.mark.timeout(120)
def test_a_hit_renews_a_retention(make_server: Callable[..., ServerThread]) -> None:
    server = make_server(ram={"capacity_bytes": 8 * MiB})
    clock = controlled_clock(server)
    session = blocks(8, 64 * KiB)
    keys = [k for k, _ in session]
    with KVCacheClient(server.target, shm=False) as client:
        client.put_many("session", session, retain_ttl_s=100)
        clock.offset_s += 90
        assert all(b is not None for b in client.get_many("session", keys))  # renewed: 100 s from now
        clock.offset_s += 90  # 180 s after the put, 90 s after the hit
        assert client.stats().tier("ram").retained_blocks == 8
        clock.offset_s += 11
        assert client.stats().tier("ram").retained_blocks == 0


@pytest.mark.timeout(60)
def test_bad_retain_ttl_is_refused(make_server: Callable[..., ServerThread]) -> None:
    server = make_server(ram={"capacity_bytes": 8 * MiB})
    item = keyed(b"y" * 100)
    with KVCacheClient(server.target, shm=False) as client:
        for bad in (0, -1.0, float("nan"), float("inf")):
            with pytest.raises(ValueError, match="retain_ttl_s"):
                client.put_many("ns", [item], retain_ttl_s=bad)
    with grpc.insecure_channel(server.target) as channel:
        put = channel.stream_unary("/kvcache.v1.KVCache/Put", lambda b: b, pb.PutResponse.FromString)
        for bad in (-1.0, float("nan"), float("inf")):
            with pytest.raises(grpc.RpcError) as err:
                put(iter([encode_put_request("ns", [item], bad)]), timeout=10)
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "retain_ttl_s" in err.value.details()
        other = keyed(b"z" * 100)
        with pytest.raises(grpc.RpcError) as err:
            put(iter([encode_put_request("ns", [item], 5.0), encode_put_request("", [other], 6.0)]), timeout=10)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "changed" in err.value.details()


@pytest.mark.timeout(120)
def test_retained_puts_of_a_bulk_client_travel_on_grpc(make_server: Callable[..., ServerThread]) -> None:
    server = make_server(ram={"capacity_bytes": 32 * MiB})
    big = blocks(4, MiB)  # over the SDK's bulk threshold
    with KVCacheClient(server.target, shm=False) as client:
        assert client.put_many("plain", blocks(4, MiB)).stored == 4
        assert client.bulk is not None and client.bulk.counters.bulk_bytes_sent > 0  # the bulk path is on
        sent = client.bulk.counters.bulk_bytes_sent
        assert client.put_many("kept", big, retain_ttl_s=60).stored == 4
        assert client.bulk.counters.bulk_bytes_sent == sent  # not on the bulk port, which has no place for it
        assert all(server.stack.ram.retained("kept", k) for k, _ in big)


@pytest.mark.timeout(120)
def test_the_async_client_retains_and_prefetches(make_server: Callable[..., ServerThread]) -> None:
    server = make_server(ram={"capacity_bytes": 8 * MiB})
    session = blocks(4, 64 * KiB)

    async def main() -> None:
        async with AsyncKVCacheClient(server.target) as client:
            assert (await client.put_many("a", session, retain_ttl_s=60)).stored == 4
            result = await client.prefetch("a", [k for k, _ in session] + [os.urandom(16)])
            assert (result.in_ram, result.queued, result.unknown, result.dropped) == (4, 0, 1, 0)

    asyncio.run(main())
    assert all(server.stack.ram.retained("a", k) for k, _ in session)


# -- prefetch ------------------------------------------------------------------------------------


def redis_overrides(redis: RedisProcess, **extra: object) -> dict[str, object]:
    return {"enabled": True, "url": redis.url, "write_mode": "through", **extra}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("below", ["redis", "s3"])
def test_prefetch_promotes_blocks_only_in_redis_or_s3(
    make_server: Callable[..., ServerThread], request: pytest.FixtureRequest, below: str
) -> None:
    def tier(**extra: object) -> dict[str, object]:
        if below == "redis":
            return redis_overrides(request.getfixturevalue("redis_server"), **extra)
        s3: S3Process = request.getfixturevalue("s3_server")
        where = {"bucket": "prefetch", "endpoint_url": s3.endpoint, "path_style": True, "create_bucket": True}
        return {"enabled": True, "write_mode": "through", **where, **extra}

    items = blocks(12, 64 * KiB)
    keys = [k for k, _ in items]
    first = make_server(ram={"capacity_bytes": 8 * MiB}, **{below: tier()})
    with KVCacheClient(first.target, shm=False) as client:
        assert client.put_many("p", items).tier(below).stored == 12
    first.stop()
    # A new server: its RAM is empty, the tier below holds the blocks. Its Gets do not promote
    # (promote = false), so only Prefetch brings them into RAM.
    server = make_server(ram={"capacity_bytes": 8 * MiB}, **{below: tier(promote=False)})
    unknown = [os.urandom(16) for _ in range(3)]
    with KVCacheClient(server.target, shm=False) as client:
        before = client.stats().tier("ram")
        assert before.blocks == 0
        result = client.prefetch("p", keys + unknown)
        assert (result.in_ram, result.queued, result.unknown, result.dropped) == (0, 12, 3, 0)
        wait_for(lambda: client.stats().prefetch_promoted == 12, what="the prefetch's promotions")
        stats = client.stats()
        assert (stats.prefetch_queued, stats.prefetch_failed, stats.prefetch_dropped) == (12, 0, 0)
        ram_hits = stats.tier("ram").hits
        got = client.get_many("p", keys)
        assert [bytes(b) for b in got] == [b for _, b in items]  # type: ignore[arg-type]
        after = client.stats()
        assert after.tier("ram").hits == ram_hits + 12  # every block a RAM hit
        assert after.tier(below).hits == stats.tier(below).hits  # none read from Redis or S3 again
        # A second Prefetch finds them in RAM.
        again = client.prefetch("p", keys)
        assert (again.in_ram, again.queued, again.unknown) == (12, 0, 0)


@pytest.mark.timeout(120)
def test_prefetch_promotes_blocks_the_disk_tier_holds(make_server: Callable[..., ServerThread], tmp_path: Path) -> None:
    server = make_server(
        ram={"capacity_bytes": 4 * MiB},
        disk={"enabled": True, "dir": str(tmp_path / "disk"), "capacity_bytes": 16 * MiB, "region_bytes": MiB},
    )
    session = blocks(8, 64 * KiB)
    keys = [k for k, _ in session]
    with KVCacheClient(server.target, shm=False) as client:
        client.put_many("d", session)
        for _ in range(6):  # 6 MiB of other blocks: the session is demoted to the disk tier
            client.put_many("other", blocks(16, 64 * KiB))
            server.call(server.stack.wait_idle())
        assert client.lookup("d", keys).tiers == ("disk",) * 8
        result = client.prefetch("d", keys)
        assert (result.in_ram, result.queued, result.unknown, result.dropped) == (0, 8, 0, 0)
        wait_for(lambda: client.stats().prefetch_promoted == 8, what="the prefetch's promotions")
        assert client.lookup("d", keys).tiers == ("ram",) * 8
        assert [bytes(b) for b in client.get_many("d", keys)] == [b for _, b in session]  # type: ignore[arg-type]


@pytest.mark.timeout(120)
def test_prefetch_never_promotes_a_corrupt_block(
    make_server: Callable[..., ServerThread], redis_server: RedisProcess
) -> None:
    good, bad = blocks(2, 64 * KiB)
    first = make_server(ram={"capacity_bytes": 8 * MiB}, redis=redis_overrides(redis_server))
    with KVCacheClient(first.target, shm=False) as client:
        assert client.put_many("c", [good, bad]).tier("redis").stored == 2
    first.stop()  # a new server below: the blocks are only in Redis
    # Redis gets, under `bad`'s key, another key's valid block: verification (bound to the key) fails.
    r = redis_server.client()
    by_hex = {n.decode().rsplit("/", 1)[1]: n for n in r.keys("kvcache/c/*")}
    assert set(by_hex) == {good[0].hex(), bad[0].hex()}
    r.set(by_hex[bad[0].hex()], r.get(by_hex[good[0].hex()]))
    server = make_server(ram={"capacity_bytes": 8 * MiB}, redis=redis_overrides(redis_server))
    with KVCacheClient(server.target, shm=False) as client:
        result = client.prefetch("c", [good[0], bad[0]])
        assert (result.in_ram, result.queued, result.unknown) == (0, 2, 0)
        wait_for(lambda: client.stats().prefetch_promoted + client.stats().prefetch_failed == 2, what="promotions")
        stats = client.stats()
        assert (stats.prefetch_promoted, stats.prefetch_failed) == (1, 1)
        assert stats.tier("redis").checksum_failures == 1
        assert server.stack.ram.contains_many_sync("c", [good[0], bad[0]]) == [True, False]
        assert client.get_many("c", [bad[0]]) == [None]  # deleted in Redis as corrupt: a miss, never wrong bytes


@pytest.mark.timeout(60)
def test_prefetch_bounds_and_rights(make_server: Callable[..., ServerThread], tmp_path: Path) -> None:
    server = make_server(
        ram={"capacity_bytes": 8 * MiB},
        prefetch={"max_keys": 16, "queue_max_keys": 32},
        auth={"enabled": True, "tokens_file": str(tokens_file(tmp_path))},
    )
    keys = [os.urandom(16) for _ in range(17)]
    with KVCacheClient(server.target, token=TOKENS["acme"], shm=False) as client:
        with pytest.raises(InvalidRequest, match=r"prefetch\.max_keys=16"):
            client.prefetch("ns", keys)
        result = client.prefetch("ns", keys[:16])
        assert (result.in_ram, result.queued, result.unknown, result.dropped) == (0, 0, 16, 0)
        mine = keyed(b"m" * 100)
        assert client.put_many("ns", [mine]).stored == 1
        assert client.prefetch("ns", [mine[0]]).in_ram == 1
    with KVCacheClient(server.target, token=TOKENS["globex"], shm=False) as other:
        assert other.prefetch("ns", [mine[0]]).unknown == 1  # namespaces are scoped by tenant, as in Get
    with (
        KVCacheClient(server.target, token=TOKENS["writer"], shm=False) as writer,
        pytest.raises(PermissionDenied, match="read"),
    ):
        writer.prefetch("ns", keys[:1])
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.KVCacheStub(channel)
        md = (("authorization", f"Bearer {TOKENS['acme']}"),)
        with pytest.raises(grpc.RpcError) as err:
            stub.Prefetch(pb.PrefetchRequest(namespace="ns", keys=[b"short"]), metadata=md, timeout=10)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as err:
            stub.Prefetch(pb.PrefetchRequest(namespace="", keys=keys[:1]), metadata=md, timeout=10)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.timeout(120)
def test_a_full_prefetch_queue_drops_and_counts(
    make_server: Callable[..., ServerThread], redis_server: RedisProcess
) -> None:
    items = blocks(24, 4 * KiB)
    keys = [k for k, _ in items]
    first = make_server(ram={"capacity_bytes": 8 * MiB}, redis=redis_overrides(redis_server))
    with KVCacheClient(first.target, shm=False) as client:
        client.put_many("q", items)
    first.stop()
    server = make_server(
        ram={"capacity_bytes": 8 * MiB},
        redis=redis_overrides(redis_server),
        prefetch={"max_keys": 16, "queue_max_keys": 16, "workers": 1},
    )
    pf = server.running.service.prefetcher  # type: ignore[union-attr]
    with KVCacheClient(server.target, shm=False) as client:
        # The worker is stopped so that the queue fills, then started again.
        server.call(pf.close())
        first_call = client.prefetch("q", keys[:12])
        second_call = client.prefetch("q", keys[12:])
        assert (first_call.in_ram, first_call.queued, first_call.unknown, first_call.dropped) == (0, 12, 0, 0)
        assert (second_call.in_ram, second_call.queued, second_call.unknown, second_call.dropped) == (0, 4, 0, 8)
        assert pf.waiting_keys == 16
        server.loop.call_soon_threadsafe(pf.start)
        wait_for(lambda: client.stats().prefetch_promoted == 16, what="the queued promotions")
        stats = client.stats()
        assert (stats.prefetch_queued, stats.prefetch_dropped, stats.prefetch_failed) == (16, 8, 0)
        assert pf.waiting_keys == 0
        in_ram = server.stack.ram.contains_many_sync("q", keys)
        assert in_ram == [True] * 16 + [False] * 8


# -- the RAM tier's eviction order, on real RamTier objects ------------------------------------------


def filled_tier(block_payload: int) -> tuple[RamTier, list[bytes], list[bytes]]:
    """A RamTier whose byte cap is full: tenant "big" holds 36 retained blocks, more than tenant
    "small" holds of unretained ones (28), all of one size, allocated in that order."""
    sample = keyed(b"\0" * block_payload)[1]
    cost = RamTier.entry_cost(sample)
    tier = RamTier(64 * cost, prefault=False, retention=RetentionLimits(max_share=0.6, max_total_share=0.6))
    big, small = blocks(36, block_payload), blocks(28, block_payload)
    assert all(tier.put_many_sync("big:s", big))
    assert tier.retain_many("big:s", [k for k, _ in big], 60.0) == 36
    assert all(tier.put_many_sync("small:s", small))
    assert tier.used_bytes == tier.capacity_bytes
    return tier, [k for k, _ in big], [k for k, _ in small]


@pytest.mark.timeout(30)
def test_the_byte_cap_takes_every_tenants_unretained_blocks_before_a_retained_one() -> None:
    # "big" is the tenant furthest over (it holds the most), but only retained blocks: the put of a
    # third tenant evicts "small"'s least recently used block instead.
    tier, big, small = filled_tier(16 * KiB)
    assert tier.put_many_sync("c:s", blocks(1, 16 * KiB)) == [True]
    assert tier.contains_many_sync("big:s", big) == [True] * 36
    assert tier.contains_many_sync("small:s", small) == [False] + [True] * 27
    assert tier.stats().evictions == 1


@pytest.mark.timeout(30)
def test_a_contiguous_slot_is_made_of_unretained_blocks_first() -> None:
    # A block larger than any free extent: the victims that free a run come from "small" (unretained)
    # though "big"'s retained blocks are earlier in the tier's order of tenants.
    tier, big, small = filled_tier(16 * KiB)
    assert tier.put_many_sync("c:s", blocks(1, 40 * KiB)) == [True]
    assert tier.contains_many_sync("big:s", big) == [True] * 36
    gone = tier.contains_many_sync("small:s", small).count(False)
    assert gone == 3 and tier.stats().evictions == 3  # three adjacent 16 KiB slots make the 40 KiB one
