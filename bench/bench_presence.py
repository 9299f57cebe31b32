"""Same-host Lookup latency: the presence index (docs/presence.md) against the Lookup RPC, one run.

    python bench/bench_presence.py [--rounds 5] [--calls 2000]

A `python -m kvcache_server` subprocess (1 GiB RAM, no lower tier) holds 128 blocks of 4 KiB; one
blocking KVCacheClient with the index (the default) and one with `presence_index=False` (every
lookup a gRPC round trip) ask Lookups of 1 and 128 keys, all present, and of 1 absent key, in
interleaved rounds of `--calls` calls each (so the machine's load falls on both alike). Wall time
per call; p50 and p99 are medians over the rounds. Figures only, no threshold.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcache_client import KVCacheClient
from kvcache_server.launcher import LocalKVCacheServer
from tests.conftest import raw_block


def percentiles(fn: Callable[[], object], calls: int) -> tuple[float, float]:
    """p50 and p99 of `calls` calls of fn, in ms."""
    took: list[float] = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        took.append(time.perf_counter() - start)
    took.sort()
    return took[len(took) // 2] * 1e3, took[min(len(took) - 1, int(len(took) * 0.99))] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    keys = [os.urandom(16) for _ in range(128)]
    absent = [os.urandom(16)]
    with LocalKVCacheServer("--ram-capacity", "1GiB") as server:
        local = KVCacheClient(server.target, timeout_s=10)
        rpc = KVCacheClient(server.target, timeout_s=10, presence_index=False)
        local.put_many("bench-presence", [(k, raw_block(k, b"x" * 4096)) for k in keys])
        shapes = {"1 key": keys[:1], "128 keys": keys, "1 absent key": absent}
        results: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for r in range(args.rounds + 1):
            for shape, ks in shapes.items():
                for name, client in (("index", local), ("RPC", rpc)):
                    figures = percentiles(lambda c=client, k=ks: c.lookup("bench-presence", k), args.calls)
                    if r:  # round 0 warms up (Info, the mapping, connections)
                        results.setdefault((shape, name), []).append(figures)
        assert local.lookup("bench-presence", keys).prefix_length == 128
        print(f"presence: {local.presence.state}, counters {local.presence.counters}")
        print(f"{'lookup':<14}{'path':<8}{'p50 ms':>10}{'p99 ms':>10}")
        for (shape, name), figs in results.items():
            p50 = statistics.median(f[0] for f in figs)
            p99 = statistics.median(f[1] for f in figs)
            print(f"{shape:<14}{name:<8}{p50:>10.4f}{p99:>10.4f}")
        local.close()
        rpc.close()
    print(f"load at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
