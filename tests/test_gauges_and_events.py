"""What a server reports about itself is true when it is read: gauges of leases that ran out are fresh on
Stats and on a scrape, and a Delete's REMOVED events name only keys some tier held. Real servers, a real
redis-server and a real S3 server (moto)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator

import pytest

from kvcache_client import KVCacheClient
from tests.backends import RedisProcess, S3Process
from tests.conftest import ServerThread, keyed
from tests.test_observability import Watcher, metric, scrape

NS = "fresh"
LEASE_S = 0.5


@contextlib.contextmanager
def expired_leases(client: KVCacheClient, watcher: KVCacheClient, keys: list[bytes]) -> Iterator[None]:
    """Leases the keys in place and deletes them (the leases alone pin their slots), then waits past the
    lease timeout without calling into the arena; the leases are handed back only when this ends."""
    with client.leased(NS, keys) as got:
        assert len([g for g in got if g is not None]) == len(keys)
        assert watcher.stats().arena_leases == len(keys)
        assert client.delete(NS, keys) == len(keys)
        assert watcher.stats().tier("ram").used_bytes > 0  # the deleted blocks' slots, pinned by the leases
        time.sleep(2 * LEASE_S)
        yield


@pytest.mark.timeout(60)
def test_expired_leases_leave_stats_and_the_scrape_without_another_call(
    make_server: Callable[..., ServerThread],
) -> None:
    """Found in issue 23: `arena_leases` (and the RAM bytes expired leases pinned) kept counting leases
    that had run out until the next lease, reservation or put reaped them."""
    server = make_server(
        ram={"capacity_bytes": 64 << 20, "lease_timeout_s": LEASE_S}, metrics={"enabled": True, "port": 0}
    )
    items = [keyed(os.urandom(64 << 10)) for _ in range(6)]
    keys = [k for k, _ in items]
    with KVCacheClient(server.target) as client, KVCacheClient(server.target, shm=False) as watcher:
        client.bulk.same_host_get_bytes = 0  # this test is about leases: no get as one bulk GET
        client.bulk.read_in_place = False  # nor get_into's copies straight out of the arena
        assert client.put_many(NS, items).stored == 6

        with expired_leases(client, watcher, keys[:3]):
            stats = watcher.stats()  # Stats on its own sees them ended
            assert (stats.arena_leases, stats.arena_leases_expired) == (0, 3)
            assert stats.tier("ram").used_bytes == 3 * server.stack.ram.entry_cost_of(len(items[3][1]))  # the rest

        with expired_leases(client, watcher, keys[3:]):
            samples = scrape(server.running.metrics_port)  # and so does a scrape, before any other call
            assert metric(samples, "kvcache_arena_leases") == 0
            assert metric(samples, "kvcache_arena_leases_expired_total") == 6
            assert metric(samples, "kvcache_tier_used_bytes", tier="ram") == 0
            assert metric(samples, "kvcache_arena_free_bytes") == server.stack.ram.region.size  # every slot freed


@pytest.mark.timeout(120)
def test_a_delete_reports_removed_only_for_keys_a_tier_held(
    make_server: Callable[..., ServerThread], redis_server: RedisProcess, s3_server: S3Process
) -> None:
    """Found in issue 23: a Delete published REMOVED for Redis and S3 naming every key it was given,
    held or not, so a Delete that removed nothing still told routers that blocks were gone."""
    s3 = {"enabled": True, "bucket": "fresh", "endpoint_url": s3_server.endpoint, "path_style": True}
    server = make_server(
        redis={"enabled": True, "url": redis_server.url, "write_mode": "through"},
        s3={**s3, "create_bucket": True, "write_mode": "through"},
    )
    events = Watcher(server.target, namespace=NS).start()
    try:
        deadline = time.monotonic() + 10
        while server.stack.events.subscribers != 1:
            assert time.monotonic() < deadline, "the watcher did not subscribe"
            time.sleep(0.02)
        (k0, b0), (k1, b1), (marker, bm) = (keyed(os.urandom(4096)) for _ in range(3))
        never, never2 = os.urandom(16), os.urandom(16)
        with KVCacheClient(server.target) as client:
            assert client.put_many(NS, [(k0, b0), (k1, b1)]).stored == 2  # RAM, Redis and S3 (write-through)
            assert client.delete(NS, [k1, never]) == 1
            assert client.delete(NS, [never2]) == 0  # nothing held it anywhere: no event at all
            assert client.put_many(NS, [(marker, bm)]).stored == 1  # the events end here
        got = events.take(9)
        tiers = ("TIER_RAM", "TIER_REDIS", "TIER_S3")
        assert sorted(got[:3]) == [("STORED", t, NS, [k0, k1]) for t in tiers]
        assert sorted(got[3:6]) == [("REMOVED", t, NS, [k1]) for t in tiers]
        assert sorted(got[6:]) == [("STORED", t, NS, [marker]) for t in tiers]
        time.sleep(0.2)
        assert events.events.empty()
    finally:
        events.close()
