"""Redis Cluster and a fleet of kvcache servers: the tier against redis-py's cluster client, 3 servers against 1.

Run from the repository root with the project's virtualenv:

    python bench/bench_cluster.py            # ~1 minute
    python bench/bench_cluster.py --quick    # smoke run

Backends, started here on free ports and stopped at the end: a Redis Cluster of six redis-server
processes (three masters, three replicas; tests.backends.RedisClusterProcesses, the tests' fixture),
and kvcache servers (`python -m kvcache_server`) sharing it.

1. The Redis tier on the 3-master cluster (RedisClusterTier, in this process) against redis-py's own
   RedisCluster doing the same reads of the same keys:
       batch get   64 blocks of 256 KiB: the tier's get_many (one pipeline per master, in parallel)
                   against RedisCluster.pipeline() with 64 GETs (redis-py groups by node too).
       lookup      128 keys: the tier's contains_many against a RedisCluster pipeline of 128 EXISTS.
   Interleaved rounds; p50 of all calls; ratio = redis-py time / tier time (>= 1.00x: the tier is as fast).
2. Aggregate throughput of clients spread over 3 kvcache servers against the same clients on one
   server: --clients processes, each a KVCacheClient calling get_many(16 blocks of 256 KiB) in a loop
   for --seconds; the blocks are in Redis (promote=false, so every read crosses the server and the
   cluster). Clients are spread round-robin over the servers. Reported: GB/s summed over clients, and the
   ratio 3 servers / 1 server. On a machine with few cores the servers share them: read the ratio with
   the CPU count printed beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvcache_client import KVCacheClient
from kvcache_core.format import encode_block
from kvcache_server.tiers.redis_cluster import RedisClusterTier
from tests.backends import KVServerProcess, RedisClusterProcesses

NS = "bench-cluster"
GB = 1e9


def blocks(n: int, size: int) -> list[tuple[bytes, bytes]]:
    out = []
    for _ in range(n):
        key = os.urandom(16)
        out.append((key, encode_block(os.urandom(size), key=key, dtype="uint8", shape=(size,))))
    return out


def p50(times: list[float]) -> float:
    return statistics.median(times)


async def tier_vs_redis_py(cluster: RedisClusterProcesses, rounds: int, iters: int) -> None:
    from redis.cluster import RedisCluster

    tier = RedisClusterTier([("127.0.0.1", cluster.nodes[0].port)], timeout_s=10.0)
    rc = RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port, socket_timeout=10.0)
    try:
        batch = blocks(64, 256 << 10)
        small = blocks(128, 16 << 10)
        assert all(await tier.put_many(NS, batch)) and all(await tier.put_many(NS, small))
        keys = [k for k, _ in batch]
        names = [tier._key(NS, k) for k in keys]
        probe = [k for k, _ in small]
        probe_names = [tier._key(NS, k) for k in probe]
        expected = [b for _, b in batch]

        def rc_get() -> list:
            pipe = rc.pipeline()
            for n in names:
                pipe.get(n)
            return pipe.execute()

        def rc_exists() -> list:
            pipe = rc.pipeline()
            for n in probe_names:
                pipe.exists(n)
            return pipe.execute()

        times: dict[str, list[float]] = {k: [] for k in ("tier get", "redis-py get", "tier lookup", "redis-py lookup")}
        loop = asyncio.get_running_loop()
        # Warm-up: connections to every master, both clients.
        await tier.get_many(NS, keys), await tier.contains_many(NS, probe)
        await loop.run_in_executor(None, rc_get), await loop.run_in_executor(None, rc_exists)
        trips = tier.round_trips

        async def tier_get() -> None:
            assert await tier.get_many(NS, keys) == expected

        async def redis_py_get() -> None:
            assert await loop.run_in_executor(None, rc_get) == expected

        async def tier_lookup() -> None:
            assert all(await tier.contains_many(NS, probe))

        async def redis_py_lookup() -> None:
            assert all(await loop.run_in_executor(None, rc_exists))

        systems = [("tier get", tier_get), ("redis-py get", redis_py_get)]
        systems += [("tier lookup", tier_lookup), ("redis-py lookup", redis_py_lookup)]
        for r in range(rounds * iters):  # interleaved, the order rotating (the machine is shared and noisy)
            for name, call in systems[r % 2 :] + systems[: r % 2]:
                t = time.perf_counter()
                await call()
                times[name].append(time.perf_counter() - t)
        nbytes = sum(len(b) for b in expected)
        print("1. Redis tier on a 3-master cluster vs redis-py RedisCluster (same keys, same run)")
        for op in ("get", "lookup"):
            ours, theirs = p50(times[f"tier {op}"]), p50(times[f"redis-py {op}"])
            what = f"{len(keys)} x 256 KiB" if op == "get" else f"{len(probe)} keys"
            extra = f"  ({nbytes / ours / GB:.2f} vs {nbytes / theirs / GB:.2f} GB/s)" if op == "get" else ""
            print(
                f"   {op:6} {what:13} tier p50 {ours * 1e3:7.2f} ms   redis-py p50 {theirs * 1e3:7.2f} ms   "
                f"ratio {theirs / ours:.2f}x{extra}"
            )
        print(
            f"   tier pipelines per batch: {(tier.round_trips - trips) / (len(times['tier get']) * 2):.2f} (3 masters)"
        )
    finally:
        rc.close()
        await tier.close()


def client_loop(target: str, keys: list[bytes], seconds: float, out: multiprocessing.Queue) -> None:
    with KVCacheClient(target, timeout_s=30, shm=False) as client:
        client.get_many(NS, keys)  # warm
        moved, calls, misses = 0, 0, 0
        end = time.monotonic() + seconds
        start = time.monotonic()
        while time.monotonic() < end:
            got = client.get_many(NS, keys)
            misses += sum(g is None for g in got)
            moved += sum(len(g) for g in got if g is not None)
            calls += 1
        out.put((moved, time.monotonic() - start, calls, misses))


def aggregate(targets: list[str], keys: list[bytes], clients: int, seconds: float) -> tuple[float, int, int]:
    ctx = multiprocessing.get_context("spawn")
    out: multiprocessing.Queue = ctx.Queue()
    procs = [
        ctx.Process(target=client_loop, args=(targets[i % len(targets)], keys, seconds, out)) for i in range(clients)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=seconds + 120) for _ in procs]
    for p in procs:
        p.join(30)
    rate = sum(moved / elapsed for moved, elapsed, _, _ in results)
    return rate, sum(r[2] for r in results), sum(r[3] for r in results)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    rounds, iters = (2, 5) if args.quick else (5, 10)
    seconds = 1.5 if args.quick else args.seconds
    print(f"host: {os.cpu_count()} CPUs, python {sys.version.split()[0]}")
    with tempfile.TemporaryDirectory() as tmp:
        cluster = RedisClusterProcesses(Path(tmp))
        servers: list[KVServerProcess] = []
        try:
            asyncio.run(tier_vs_redis_py(cluster, rounds, iters))
            settings = [f"redis.{k}={v}" for k, v in cluster.overrides(promote=False, timeout_s=10).items()]
            servers = [KVServerProcess(*settings) for _ in range(3)]
            data = blocks(16, 256 << 10)
            with KVCacheClient(servers[0].target, timeout_s=30, shm=False) as c:
                # Stored through server 1 only: every server reads them from the cluster.
                assert c.put_many(NS, data).tier("redis").stored == len(data)
            keys = [k for k, _ in data]
            one, calls1, miss1 = aggregate([servers[0].target], keys, args.clients, seconds)
            three, calls3, miss3 = aggregate([s.target for s in servers], keys, args.clients, seconds)
            print(f"2. aggregate get throughput, {args.clients} client processes, 16 x 256 KiB per call, from Redis")
            print(f"   1 server : {one / GB:6.3f} GB/s  ({calls1} calls, {miss1} misses)")
            print(f"   3 servers: {three / GB:6.3f} GB/s  ({calls3} calls, {miss3} misses)")
            print(f"   ratio 3 servers / 1 server: {three / one:.2f}x on {os.cpu_count()} CPUs")
        finally:
            for s in servers:
                s.stop()
            cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
