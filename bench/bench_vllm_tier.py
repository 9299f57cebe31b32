"""Store and load GB/s of one prompt's offload chunks: the kvcache tier vs vLLM's own `fs` tier.

    .venv/bin/python bench/bench_vllm_tier.py [--chunks 32] [--chunk-mib 2] [--repeat 3]

Each tier is built by vLLM 0.33's SecondaryTierFactory over one primary buffer of real bytes
(what vLLM's CPU tier hands a secondary tier) and driven through the SecondaryTierManager
interface: one submit_store of every chunk, then one submit_load into other rows, timed until
get_finished_jobs reports the job. Rows are compared after each load. Tiers:

    kvcache (same host)   a `python -m kvcache_server` subprocess; shm / arena in place
    kvcache (bulk port)   the same server with shm off (what a remote instance uses)
    fs                    vLLM's FileSystemTierManager on a temporary directory (page cache warm)
    memcpy                copying the rows inside the primary buffer: the ceiling of any tier

Lookup latency is one request's batched lookup of every chunk (the lookup thread's time).
"""

from __future__ import annotations

import argparse
import mmap
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

from kvcache_connectors.vllm_tier import KVCacheTier
from kvcache_server.launcher import LocalKVCacheServer
from tests.vllm.harness import write_model_dir
from tests.vllm.tier_harness import offload_keys, offloading_config, tier_entry

POLL_S = 50e-6
"""How often the bench asks a tier for its finished job (vLLM asks once per engine step)."""


def finished(tier: SecondaryTierManager, timeout_s: float) -> JobResult:
    """The one job result, polled every POLL_S: the time to it is the tier's, not the poll's (the tests'
    tier_harness.finished sleeps 50 ms between polls and after the last, which once made every row here
    read about 0.7 GB/s whatever the tier did)."""
    deadline = time.perf_counter() + timeout_s
    while True:
        results = list(tier.get_finished_jobs())
        if results:
            assert len(results) == 1, results
            return results[0]
        if time.perf_counter() > deadline:
            raise TimeoutError(f"no job result within {timeout_s} s")
        time.sleep(POLL_S)


def run(tier: SecondaryTierManager, buffer: torch.Tensor, n: int, repeat: int, prompt: int) -> dict[str, float]:
    nbytes = n * buffer.shape[1]
    best_store = best_load = float("inf")
    job = 0
    for r in range(repeat):
        keys = offload_keys(n, prompt=prompt * 100 + r)
        buffer[:n].random_(0, 256)
        job += 1
        t0 = time.perf_counter()
        tier.submit_store(TransferJob(job, keys, torch.arange(n, dtype=torch.int32).numpy(), False, ReqContext("s")))
        result = finished(tier, 60)
        assert result.success, (type(tier).__name__, result)
        best_store = min(best_store, time.perf_counter() - t0)
        buffer[n:].zero_()
        job += 1
        rows = torch.arange(n, 2 * n, dtype=torch.int32).numpy()
        t0 = time.perf_counter()
        tier.submit_load(TransferJob(job, keys, rows, True, ReqContext("l")))
        result = finished(tier, 60)
        assert result.success, (type(tier).__name__, result)
        best_load = min(best_load, time.perf_counter() - t0)
        assert torch.equal(buffer[:n], buffer[n:])
    out = {"store_GBps": nbytes / best_store / 1e9, "load_GBps": nbytes / best_load / 1e9}
    if isinstance(tier, KVCacheTier):
        t0 = time.perf_counter()
        hits = tier.lookup_batch(keys, ReqContext("q"))
        out["lookup_ms"] = (time.perf_counter() - t0) * 1e3
        assert all(hits)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--chunk-mib", type=float, default=2.0)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    init_none_hash(sha256)
    n, chunk = args.chunks, int(args.chunk_mib * (1 << 20))
    # Page-aligned, as vLLM's own primary region is (the fs tier's O_DIRECT needs it).
    region = mmap.mmap(-1, 2 * n * chunk)
    buffer = torch.frombuffer(region, dtype=torch.uint8).view(2 * n, chunk)
    view = memoryview(buffer.numpy())
    tmp = Path(tempfile.mkdtemp())
    model_dir = write_model_dir(tmp / "model")
    server = LocalKVCacheServer("--ram-capacity", f"{max(1, 4 * n * chunk >> 30) + 1}GiB")
    target = server.start()
    results: dict[str, dict[str, float]] = {}
    try:
        entries: dict[str, dict[str, Any]] = {
            "kvcache (same host)": tier_entry(target, timeout_s=30.0),
            "kvcache (bulk port)": tier_entry(target, timeout_s=30.0, shm=False),
            "fs": {"type": "fs", "root_dir": str(tmp / "fs")},
        }
        for i, (name, entry) in enumerate(entries.items()):
            spec = OffloadingSpecFactory.create_spec(offloading_config(model_dir, entry))
            tier = SecondaryTierFactory.create_secondary_tier(dict(entry), view, spec)
            try:
                results[name] = run(tier, buffer, n, args.repeat, prompt=i)
            finally:
                tier.shutdown()
        t0 = time.perf_counter()
        for _ in range(args.repeat):
            buffer[n:].copy_(buffer[:n])
        results["memcpy"] = {"store_GBps": args.repeat * n * chunk / (time.perf_counter() - t0) / 1e9}
        results["memcpy"]["load_GBps"] = results["memcpy"]["store_GBps"]
    finally:
        server.stop()
    print(f"{n} chunks of {chunk / (1 << 20):.1f} MiB ({n * chunk / (1 << 20):.0f} MiB), best of {args.repeat}")
    print(f"{'tier':22} {'store GB/s':>11} {'load GB/s':>10} {'lookup ms':>10}")
    for name, r in results.items():
        lookup = f"{r['lookup_ms']:.2f}" if "lookup_ms" in r else "-"
        print(f"{name:22} {r['store_GBps']:11.2f} {r['load_GBps']:10.2f} {lookup:>10}")


if __name__ == "__main__":
    main()
