"""Past one machine: the Redis tier on a real Redis Cluster, and several kvcache servers sharing it and S3.

The cluster is six real `redis-server --cluster-enabled yes` processes (three masters, three replicas)
joined by `redis-cli --cluster create`; the servers are real `python -m kvcache_server` processes and
in-process servers; S3 is moto's standalone server over HTTP. Tests that kill nodes get a cluster of
their own; the rest share one per module.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvcache_client import KVCacheClient
from kvcache_proto import kvcache_pb2 as pb
from kvcache_proto import kvcache_pb2_grpc as pb_grpc
from kvcache_server.config import ConfigError, load_config
from kvcache_server.tiers.base import TierError
from kvcache_server.tiers.redis_cluster import RedisClusterTier
from tests.backends import KVServerProcess, RedisClusterProcesses, S3Process, make_certs, wait_for
from tests.conftest import ServerThread, keyed
from tests.test_observability import metric, scrape

pytestmark = pytest.mark.timeout(180)

NS = "fleet"
BUCKET = "kvcache-fleet"


def slot_of(name: str) -> int:
    from redis.crc import key_slot

    return key_slot(name.encode())


def tier_for(cluster: RedisClusterProcesses, **kwargs: object) -> RedisClusterTier:
    nodes = [("127.0.0.1", n.port) for n in cluster.nodes[:1]]  # one start-up node: the rest is discovered
    return RedisClusterTier(nodes, timeout_s=2.0, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcesses]:
    c = RedisClusterProcesses(tmp_path_factory.mktemp("cluster"))
    yield c
    c.stop()


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Process]:
    proc = S3Process()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def fleet(cluster: RedisClusterProcesses, s3: S3Process) -> Iterator[list[KVServerProcess]]:
    """Three kvcache-server processes sharing the cluster (write-through) and S3 (write-through)."""
    common = [f"{k}={v}" for k, v in cluster.overrides().items()]
    common = [f"redis.{s}" for s in common] + [
        "s3.enabled=true",
        f"s3.bucket={BUCKET}",
        f"s3.endpoint_url={s3.endpoint}",
        "s3.path_style=true",
        "s3.create_bucket=true",
        "s3.write_mode=through",
        "s3.presence_index_bytes=0",
    ]
    servers: list[KVServerProcess] = []
    try:
        for i in range(3):
            servers.append(KVServerProcess(*common, f"events.server_id=node-{i + 1}"))
        yield servers
    finally:
        for s in servers:
            s.stop()


def clients(servers: list[KVServerProcess]) -> list[KVCacheClient]:
    return [KVCacheClient(s.target, timeout_s=20, shm=False) for s in servers]


def tier(client: KVCacheClient, name: str):
    return next(t for t in client.stats().tiers if t.name == name)


# -- configuration -------------------------------------------------------------------------------------


def test_cluster_config_names_its_start_up_nodes_and_rejects_what_a_cluster_cannot_do() -> None:
    c = load_config(
        env={},
        overrides={
            "redis": {"cluster": "true", "url": "rediss://u:p@10.0.0.1:7000", "cluster_nodes": "b:7001, c:7002"}
        },
    )
    assert c.redis.startup_nodes() == [("10.0.0.1", 7000), ("b", 7001), ("c", 7002)]
    bad = [
        ({"cluster": "true", "url": "redis://a:7000/3"}, "only database 0"),
        ({"cluster": "true", "url": "unix:///tmp/r.sock"}, "redis:// or rediss://"),
        ({"cluster": "true", "cluster_nodes": "b:seven"}, "'b:seven' is not host:port"),
        ({"cluster_nodes": "b:7001"}, "redis.cluster is false"),
    ]
    for values, message in bad:
        with pytest.raises(ConfigError, match=message):
            load_config(env={}, overrides={"redis": values})


def test_a_cluster_down_at_start_up_is_a_tier_that_misses_until_it_comes_up(tmp_path: Path) -> None:
    """The server starts with no start-up node answering: puts report the tier failed, lookups miss;
    once the cluster is up (on those ports), the same server uses it without a restart."""
    from tests.backends import cluster_port

    ports = [cluster_port() for _ in range(2)]
    redis = {"enabled": True, "cluster": True, "url": f"redis://127.0.0.1:{ports[0]}", "breaker_reset_s": 0.2}
    redis["cluster_nodes"] = f"127.0.0.1:{ports[1]}"
    server = ServerThread({"redis": redis})
    try:
        item = keyed(os.urandom(512))
        with KVCacheClient(server.target, timeout_s=20, shm=False) as client:
            put = client.put_many(NS, [item])
            assert (put.stored, put.tier("redis").failed) == (1, 1)  # in RAM; the tier is down
            stats = next(t for t in server.stack.stats() if t.name == "redis")
            assert stats.errors >= 1
            c = RedisClusterProcesses(tmp_path, ports=ports)
            try:
                wait_for(lambda: client.put_many(NS, [item]).tier("redis").stored == 1, what="the cluster found")
                slot = slot_of(f"kvcache/{NS}/{item[0].hex()}")
                owner = next(m for m in c.masters_now() if slot in _slots(m))
                assert owner.client().get(f"kvcache/{NS}/{item[0].hex()}") == item[1]
            finally:
                c.stop()
    finally:
        server.stop()


# -- the tier on the cluster -----------------------------------------------------------------------------


def test_a_batch_spanning_many_slots_is_one_pipeline_per_master(cluster: RedisClusterProcesses) -> None:
    """Every batch call (put, get, presence, delete) of 300 keys over ~300 slots: exactly 3 pipelines,
    and the masters between them executed exactly 300 GETs (counted by Redis itself)."""
    items = [keyed(os.urandom(512)) for _ in range(300)]
    keys = [k for k, _ in items]

    async def run() -> None:
        t = tier_for(cluster)
        try:
            names = [t._key(NS, k) for k in keys]
            assert len({slot_of(n) for n in names}) > 250
            for node in cluster.masters_now():
                node.client().config_resetstat()
            before = t.round_trips
            assert await t.put_many(NS, items) == [True] * 300
            assert t.round_trips - before == 3
            before = t.round_trips
            assert await t.get_many(NS, keys) == [b for _, b in items]
            assert t.round_trips - before == 3
            gets = [
                int(n.client().info("commandstats").get("cmdstat_get", {}).get("calls", 0))
                for n in cluster.masters_now()
            ]
            assert sum(gets) == 300 and all(g > 0 for g in gets), gets
            before = t.round_trips
            assert await t.contains_many(NS, [*keys, bytes(16)]) == [True] * 300 + [False]
            assert t.round_trips - before == 3
            before = t.round_trips
            assert await t.delete_many(NS, keys[:150]) == 150
            assert t.round_trips - before == 3
            assert await t.get_many(NS, keys) == [None] * 150 + [b for _, b in items[150:]]
            # The layout is the single-Redis tier's: redis-py's own cluster client reads the same values.
            from redis.cluster import RedisCluster

            rc = RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
            assert rc.get(names[200]) == items[200][1]
            rc.close()
            assert t.stats().errors == 0
        finally:
            await t.close()

    asyncio.run(run())


def test_a_moved_slot_is_followed_and_the_map_refreshed(cluster: RedisClusterProcesses) -> None:
    """A slot migrated to another master after the tier read the map: the stale pipeline gets MOVED,
    the key is re-sent through RedisCluster, served right, and the next batch goes to the new owner."""
    key, block = keyed(os.urandom(256))

    async def run() -> None:
        t = tier_for(cluster)
        try:
            assert await t.put_many(NS, [(key, block)]) == [True]
            slot = slot_of(t._key(NS, key))
            masters = cluster.masters_now()
            ids = {m.port: m.client().execute_command("CLUSTER MYID").decode() for m in masters}
            source = next(m for m in masters if slot in _slots(m))
            target = next(m for m in masters if m is not source)
            src, dst = source.client(), target.client()
            dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", ids[source.port])
            src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", ids[target.port])
            for name in src.execute_command("CLUSTER GETKEYSINSLOT", slot, 1000):
                src.execute_command("MIGRATE", "127.0.0.1", target.port, name, 0, 5000)
            for m in masters:
                m.client().execute_command("CLUSTER SETSLOT", slot, "NODE", ids[target.port])
            refreshes = t.refreshes
            for _ in range(50):  # MOVED, followed; the map is read again in the background
                assert await t.get_many(NS, [key]) == [block]
                if t.refreshes > refreshes:
                    break
                await asyncio.sleep(0.1)
            assert t.refreshes == refreshes + 1
            assert t._route([t._key(NS, key)])[1].popitem()[1].port == target.port
            assert t.stats().errors == 0
        finally:
            await t.close()

    asyncio.run(run())


def _slots(node) -> set[int]:
    """Slots `node` owns, from its own CLUSTER SLOTS view."""
    own = set()
    for start, end, master, *_ in node.client().execute_command("CLUSTER SLOTS"):
        if int(master[1]) == node.port:
            own.update(range(int(start), int(end) + 1))
    return own


# -- several servers sharing the tiers ------------------------------------------------------------------


def test_a_block_stored_through_one_server_is_served_by_the_others(
    fleet: list[KVServerProcess], cluster: RedisClusterProcesses, s3: S3Process
) -> None:
    """Stored through server 1: served byte-identical by server 2 from the cluster, and by server 3 from
    S3 once the cluster was flushed; Lookups through all three agree at every step."""
    one, two, three = clients(fleet)
    try:
        items = [keyed(os.urandom(32 << 10)) for _ in range(24)]
        keys = [k for k, _ in items]
        put = one.put_many(NS, items)
        assert put.tier("redis").stored == 24 and put.tier("s3").stored == 24
        assert [c.lookup(NS, keys).prefix_length for c in (one, two, three)] == [24, 24, 24]
        assert two.lookup(NS, keys).tiers == ("redis",) * 24  # two holds none of them in RAM
        hits = tier(two, "redis").hits
        assert [bytes(b) for b in two.get_many(NS, keys)] == [b for _, b in items]
        assert tier(two, "redis").hits - hits == 24
        cluster.flushall()
        assert three.lookup(NS, keys).tiers == ("s3",) * 24
        hits = tier(three, "s3").hits
        assert [bytes(b) for b in three.get_many(NS, keys)] == [b for _, b in items]
        assert tier(three, "s3").hits - hits == 24
    finally:
        for c in (one, two, three):
            c.close()


def test_write_behind_blocks_reach_the_other_servers_once_drained(
    cluster: RedisClusterProcesses, s3: S3Process
) -> None:
    """Both lower tiers write-behind on the server that stores: once its queues have drained, another
    server finds every block in the cluster, and in S3 after the cluster is flushed."""
    s3_settings = {"enabled": True, "bucket": BUCKET, "endpoint_url": s3.endpoint, "path_style": True}
    s3_settings |= {"create_bucket": True, "presence_index_bytes": 0}
    writer = ServerThread(
        {"redis": cluster.overrides(write_mode="behind"), "s3": {**s3_settings, "write_mode": "behind"}}
    )
    reader = ServerThread({"redis": cluster.overrides(promote=False), "s3": {**s3_settings, "promote": False}})
    try:
        items = [keyed(os.urandom(16 << 10)) for _ in range(16)]
        keys = [k for k, _ in items]
        with (
            KVCacheClient(writer.target, timeout_s=20, shm=False) as w,
            KVCacheClient(reader.target, timeout_s=20, shm=False) as r,
        ):
            put = w.put_many(NS, items)
            assert (put.tier("redis").queued, put.tier("s3").queued) == (16, 16)
            writer.call(writer.stack.wait_idle())
            assert r.lookup(NS, keys).tiers == ("redis",) * 16
            assert [bytes(b) for b in r.get_many(NS, keys)] == [b for _, b in items]
            cluster.flushall()
            assert r.lookup(NS, keys).tiers == ("s3",) * 16
            assert [bytes(b) for b in r.get_many(NS, keys)] == [b for _, b in items]
    finally:
        writer.stop()
        reader.stop()


def test_a_delete_through_one_server_removes_the_block_from_the_shared_tiers(
    fleet: list[KVServerProcess], cluster: RedisClusterProcesses, s3: S3Process
) -> None:
    """Deleted through server 3: gone from the cluster and S3, so a server that never held it misses;
    server 2's RAM copy (read before the Delete) still serves it, as docs/deployment.md says."""
    one, two, three = clients(fleet)
    try:
        items = [keyed(os.urandom(4096)) for _ in range(8)]
        keys = [k for k, _ in items]
        one.put_many(NS, items)
        assert [bytes(b) for b in two.get_many(NS, keys)] == [b for _, b in items]  # now in two's RAM
        assert three.delete(NS, keys) == 8
        names = [f"kvcache/{NS}/{k.hex()}" for k in keys]
        from redis.cluster import RedisCluster

        rc = RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
        try:
            assert sum(rc.exists(n) for n in names) == 0
        finally:
            rc.close()
        listed = s3.client().list_objects_v2(Bucket=BUCKET).get("Contents", [])
        assert not {k.hex() for k in keys} & {o["Key"].rsplit("/", 1)[-1] for o in listed}
        assert three.lookup(NS, keys).prefix_length == 0
        assert three.get_many(NS, keys) == [None] * 8
        assert two.lookup(NS, keys).tiers == ("ram",) * 8  # its own copy: correct KV until evicted
    finally:
        for c in (one, two, three):
            c.close()


def test_kv_events_name_the_server_that_published_them(fleet: list[KVServerProcess]) -> None:
    seen: dict[str, set[str]] = {}
    done = threading.Event()
    streams = []

    def watch(target: str) -> None:
        channel = grpc.insecure_channel(target)
        call = pb_grpc.KVCacheStub(channel).WatchEvents(pb.WatchEventsRequest(namespace=NS), timeout=30)
        streams.append(call)
        try:
            for event in call:
                seen.setdefault(target, set()).add(event.server_id)
                if done.is_set():
                    return
        except grpc.RpcError:
            return
        finally:
            channel.close()

    threads = [threading.Thread(target=watch, args=(s.target,), daemon=True) for s in fleet]
    for t in threads:
        t.start()
    cs = clients(fleet)
    try:

        def every_server_seen() -> bool:
            for c in cs:
                c.put_many(NS, [keyed(b"e" * 64)])
            return len(seen) == 3

        wait_for(every_server_seen, timeout_s=20, what="an event from every server")
    finally:
        done.set()
        for call in streams:
            call.cancel()
        for c in cs:
            c.close()
    assert {target: ids for target, ids in seen.items()} == {s.target: {f"node-{i + 1}"} for i, s in enumerate(fleet)}


# -- failures: a master killed under load, a node that never comes back ------------------------------------


def test_a_master_killed_under_load_serves_no_wrong_bytes_then_the_promoted_replica(tmp_path: Path) -> None:
    """Clients on three servers read and verify while a master is SIGKILLed: 0 wrong blocks, every miss
    counted by a server; once its replica is promoted, every block is served again; when that node is
    killed too (its slots have no copy left) the rest of the cluster goes on serving its keys."""
    c = RedisClusterProcesses(tmp_path, node_timeout_ms=1000)
    servers: list[ServerThread] = []
    try:
        items = [keyed(os.urandom(8192)) for _ in range(240)]
        blocks = dict(items)
        keys = [k for k, _ in items]

        async def seed() -> None:
            t = tier_for(c)
            assert await t.put_many(NS, items) == [True] * 240
            await t.close()

        asyncio.run(seed())
        c.wait_replicas_known()
        masters = c.masters_now()
        for m in masters:  # every replica has every block before the load begins
            wait_for(lambda m=m: c.replica_of(m).client().dbsize() == m.client().dbsize(), what="replication")
        redis = {**c.overrides(), "promote": False, "timeout_s": 3.0, "breaker_failures": 1000}
        servers = [
            ServerThread({"ram": {"capacity_bytes": 64 << 20}, "redis": redis, "metrics": {"enabled": True, "port": 0}})
            for _ in range(3)
        ]
        cs = [KVCacheClient(s.target, timeout_s=20, shm=False) for s in servers]
        wrong, missed, served = [0], [0], [0]
        stop = threading.Event()

        def load(client: KVCacheClient, seed: int) -> None:
            rng = random.Random(seed)
            while not stop.is_set():
                batch = rng.sample(keys, 24)
                for k, got in zip(batch, client.get_many(NS, batch), strict=True):
                    if got is None:
                        missed[0] += 1
                    elif bytes(got) != blocks[k]:
                        wrong[0] += 1
                    else:
                        served[0] += 1

        def misses_counted() -> int:
            return sum(next(t for t in s.stack.stats() if t.name == "redis").misses for s in servers)

        threads = [threading.Thread(target=load, args=(cl, i), daemon=True) for i, cl in enumerate(cs * 2)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        victim = masters[0]
        replica = c.replica_of(victim)
        victim.kill()
        wait_for(lambda: c.role(replica) == "master", timeout_s=30, what="the replica promoted")
        time.sleep(1.0)  # load on the promoted replica
        stop.set()
        for t in threads:
            t.join(30)
        tiers = [next(t for t in s.stack.tiers if t.name == "redis") for s in servers]
        print(
            f"load: {served[0]} served, {missed[0]} missed, {wrong[0]} wrong; "
            f"node failures {[t.node_failures for t in tiers]}, replica reads {[t.replica_reads for t in tiers]}"
        )
        assert wrong[0] == 0
        assert served[0] > 0
        assert missed[0] == misses_counted()
        assert sum(t.node_failures for t in tiers) > 0  # the load did meet the dead master
        for s, t in zip(servers, tiers, strict=True):  # and /metrics says so, per server
            samples = scrape(s.running.metrics_port)
            assert metric(samples, "kvcache_redis_cluster_node_failures_total", tier="redis") == t.node_failures
            assert metric(samples, "kvcache_redis_cluster_replica_reads_total", tier="redis") == t.replica_reads
        for cl in cs:  # after the failover, from the promoted replica: every block, byte-identical
            wait_for(lambda cl=cl: None not in cl.get_many(NS, keys), timeout_s=15, what="every block served")
            assert [bytes(b) for b in cl.get_many(NS, keys)] == [b for _, b in items]

        # The promoted node dies too and never comes back: its slots have no copy; the rest serve.
        lost_slots = _slots(replica)
        replica.kill()
        lost = [k for k in keys if slot_of(f"kvcache/{NS}/{k.hex()}") in lost_slots]
        assert 0 < len(lost) < len(keys)
        for s, cl in zip(servers, cs, strict=True):
            before = next(t for t in s.stack.stats() if t.name == "redis")
            got = cl.get_many(NS, keys)
            after = next(t for t in s.stack.stats() if t.name == "redis")
            assert [k for k, g in zip(keys, got, strict=True) if g is None] == lost
            assert all(bytes(g) == blocks[k] for k, g in zip(keys, got, strict=True) if g is not None)
            assert after.misses - before.misses == len(lost)
            assert after.breaker == "closed"
            fresh = keyed(os.urandom(1024))
            assert cl.put_many(NS, [fresh]).stored == 1
        for cl in cs:
            cl.close()
    finally:
        for s in servers:
            s.stop()
        c.stop()


def test_tls_and_password_as_for_a_single_redis(tmp_path: Path) -> None:
    """A cluster that speaks only TLS (clients, bus, replication) and requires a password: the tier with
    rediss://, the CA and the password works, one pipeline per master; without the password, or without
    TLS, every call fails as a tier error (a miss for the stack), never a crash."""
    c = RedisClusterProcesses(tmp_path / "nodes", certs=make_certs(tmp_path), password="s3cret-pw")
    try:
        config = load_config(env={}, overrides={"redis": c.overrides()})
        nodes = config.redis.startup_nodes()
        items = [keyed(os.urandom(1024)) for _ in range(60)]

        async def run() -> None:
            good = RedisClusterTier(nodes, tls=True, tls_ca_file=str(c.tls_ca), password="s3cret-pw", timeout_s=2.0)
            try:
                assert await good.put_many(NS, items) == [True] * 60
                before = good.round_trips
                assert await good.get_many(NS, [k for k, _ in items]) == [b for _, b in items]
                assert good.round_trips - before == 3
            finally:
                await good.close()
            for bad in (
                RedisClusterTier(nodes, tls=True, tls_ca_file=str(c.tls_ca), timeout_s=2.0),  # no password
                RedisClusterTier(nodes, password="s3cret-pw", timeout_s=2.0),  # no TLS
            ):
                try:
                    with pytest.raises(TierError):
                        await bad.get_many(NS, [items[0][0]])
                finally:
                    await bad.close()

        asyncio.run(run())
        # The server's own config path; the first call reads the slot map over TLS, within the deadline.
        server = ServerThread({"redis": c.overrides(promote=False)})
        try:
            with KVCacheClient(server.target, timeout_s=20, shm=False) as client:
                assert client.lookup(NS, [k for k, _ in items]).tiers == ("redis",) * 60
                assert [bytes(b) for b in client.get_many(NS, [k for k, _ in items])] == [b for _, b in items]
        finally:
            server.stop()
    finally:
        c.stop()


def test_a_hung_master_is_read_from_its_replica_within_the_call(tmp_path: Path) -> None:
    """A master SIGSTOPped (it accepts connections and never answers): within the tier's timeout its keys
    come from its replica, byte-identical, and the breaker stays closed."""
    c = RedisClusterProcesses(tmp_path, node_timeout_ms=5000)
    server = None
    try:
        items = [keyed(os.urandom(2048)) for _ in range(90)]
        keys = [k for k, _ in items]

        async def seed() -> None:
            t = tier_for(c)
            assert await t.put_many(NS, items) == [True] * 90
            await t.close()

        asyncio.run(seed())
        c.wait_replicas_known()
        victim = c.masters_now()[1]
        wait_for(lambda: c.replica_of(victim).client().dbsize() == victim.client().dbsize(), what="replication")
        server = ServerThread({"redis": c.overrides(promote=False, timeout_s=2.0)})
        with KVCacheClient(server.target, timeout_s=20, shm=False) as client:
            assert [bytes(b) for b in client.get_many(NS, keys)] == [b for _, b in items]
            victim.pause()
            try:
                for _ in range(3):  # the first waits for the master; the next go straight to the replica
                    assert [bytes(b) for b in client.get_many(NS, keys)] == [b for _, b in items]
            finally:
                victim.resume()
        tier = next(t for t in server.stack.tiers if t.name == "redis")
        stats = next(t for t in server.stack.stats() if t.name == "redis")
        assert tier.node_failures >= 1 and tier.replica_reads >= 3
        assert (stats.breaker, stats.errors, stats.misses) == ("closed", 0, 0)
    finally:
        if server is not None:
            server.stop()
        c.stop()
