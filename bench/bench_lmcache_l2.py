"""Store, lookup-and-lock and load GB/s of LMCache chunks through L2 adapters: kvcache vs LMCache's own.

    .venv/bin/python bench/bench_lmcache_l2.py [--chunks 32] [--chunk-mib 2] [--repeat 3]

Each adapter is driven through LMCache 0.5.6's L2AdapterInterface as its controllers drive it: one
submit_store_task of every chunk, one submit_lookup_and_lock_task, one submit_load_task into other
buffers (LMCache's MemoryObjs from its host allocator), then submit_unlock; each phase timed until
its eventfd reports the task. Buffers are compared after each load. Adapters:

    kvcache (same host)   KVCacheL2Adapter, a `python -m kvcache_server` subprocess; locks are
                          arena read leases, the load copies from them
    kvcache (bulk port)   the same server with shm off (what a remote LMCache uses): the lookup
                          moves the bytes, the load copies them
    lmcache mock          LMCache's MockL2Adapter (its CI's L2, a dict in this process) at an
                          unthrottled bandwidth: no I/O at all
    memcpy                copying the buffers (one memoryview copy each): the ceiling of any adapter
"""

from __future__ import annotations

import argparse
import os
import select
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import torch
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.l2_adapters.mock_l2_adapter import MockL2Adapter, MockL2AdapterConfig
from lmcache.v1.memory_allocators.host_memory_allocator import HostMemoryAllocator

from kvcache_connectors.lmcache_l2 import KVCacheL2Adapter
from kvcache_server.launcher import LocalKVCacheServer


def wait(fd: int, query: Any, task: int, timeout_s: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        result = query(task)
        if result is not None:
            return result
        assert time.monotonic() < deadline, "task did not complete"
        if select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
            os.eventfd_read(fd)


def run(adapter: Any, alloc: HostMemoryAllocator, n: int, chunk: int, repeat: int, tag: int) -> dict[str, float]:
    shape = torch.Size([chunk // 2])
    src = [alloc.allocate(shape, torch.bfloat16) for _ in range(n)]
    dst = [alloc.allocate(shape, torch.bfloat16) for _ in range(n)]
    best = {"store": float("inf"), "lookup": float("inf"), "load": float("inf")}
    stores: dict[int, Any] = {}
    for r in range(repeat):
        keys = [ObjectKey((tag * 1000 + r * n + i).to_bytes(8, "big") * 4, "bench/model", 0) for i in range(n)]
        for obj in src:
            obj.tensor.view(torch.uint8).random_(0, 256)
        for obj in dst:
            obj.tensor.view(torch.uint8).zero_()
        t0 = time.perf_counter()
        task = adapter.submit_store_task(keys, src)

        def popped(t: int) -> Any:
            stores.update(adapter.pop_completed_store_tasks())
            return stores.pop(t, None)

        assert wait(adapter.get_store_event_fd(), popped, task).is_successful()
        t1 = time.perf_counter()
        task = adapter.submit_lookup_and_lock_task(keys, {})
        bitmap = wait(adapter.get_lookup_and_lock_event_fd(), adapter.query_lookup_and_lock_result, task)
        assert bitmap.popcount() == n
        t2 = time.perf_counter()
        task = adapter.submit_load_task(keys, dst)
        assert wait(adapter.get_load_event_fd(), adapter.query_load_result, task).popcount() == n
        t3 = time.perf_counter()
        adapter.submit_unlock(keys)
        assert all(bytes(a.byte_array) == bytes(b.byte_array) for a, b in zip(src, dst, strict=True))
        best = {
            "store": min(best["store"], t1 - t0),
            "lookup": min(best["lookup"], t2 - t1),
            "load": min(best["load"], t3 - t2),
        }
    for obj in src + dst:
        obj.ref_count_down()
    return best


def memcpy(alloc: HostMemoryAllocator, n: int, chunk: int, repeat: int) -> float:
    shape = torch.Size([chunk // 2])
    src = [alloc.allocate(shape, torch.bfloat16) for _ in range(n)]
    dst = [alloc.allocate(shape, torch.bfloat16) for _ in range(n)]
    best = float("inf")
    for obj in src + dst:  # faulted in first, as the adapters' buffers are by their first round
        obj.tensor.view(torch.uint8).random_(0, 256)
    for _ in range(repeat):
        t0 = time.perf_counter()
        for a, b in zip(src, dst, strict=True):
            memoryview(b.byte_array).cast("B")[:] = memoryview(a.byte_array).cast("B")
        best = min(best, time.perf_counter() - t0)
    for obj in src + dst:
        obj.ref_count_down()
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--chunk-mib", type=float, default=2.0)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    chunk = int(args.chunk_mib * (1 << 20)) // 2 * 2
    n = args.chunks
    total = n * chunk
    alloc = HostMemoryAllocator(2 * total + (64 << 20))
    print(f"{n} chunks x {chunk / (1 << 20):.2f} MiB = {total / (1 << 20):.0f} MiB per phase, best of {args.repeat}")
    print(f"{'adapter':<22}{'store GB/s':>12}{'lookup ms':>12}{'load GB/s':>12}")

    def line(name: str, t: dict[str, float]) -> None:
        print(f"{name:<22}{total / t['store'] / 1e9:>12.2f}{t['lookup'] * 1e3:>12.1f}{total / t['load'] / 1e9:>12.2f}")

    ram = f"{max(1, 4 * total * args.repeat >> 30) + 1}GiB"
    with LocalKVCacheServer("--ram-capacity", ram) as server:
        for tag, (name, shm) in enumerate((("kvcache (same host)", True), ("kvcache (bulk port)", False))):
            adapter = KVCacheL2Adapter(
                {"target": server.target, "shm": shm, "timeout_s": 60.0, "lookup_timeout_s": 60.0}
            )
            try:
                line(name, run(adapter, alloc, n, chunk, args.repeat, tag))
            finally:
                adapter.close()
    mock = MockL2Adapter(
        MockL2AdapterConfig(max_size_gb=4 * total * args.repeat / (1 << 30) + 1, mock_bandwidth_gb=1e6)
    )
    try:
        line("lmcache mock", run(mock, alloc, n, chunk, args.repeat, 9))
    finally:
        mock.close()
    t = memcpy(alloc, n, chunk, args.repeat)
    print(f"{'memcpy':<22}{total / t / 1e9:>12.2f}{'':>12}{total / t / 1e9:>12.2f}")


if __name__ == "__main__":
    main()
