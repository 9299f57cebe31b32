"""Store, lookup-and-lock and load GB/s of LMCache chunks through L2 adapters: kvcache vs LMCache's own.

    .venv/bin/python bench/bench_lmcache_l2.py [--chunks 32] [--chunk-mib 2] [--repeat 3] [--redis-server PATH]

Each adapter is driven through LMCache 0.5.6's L2AdapterInterface as its controllers drive it: one
submit_store_task of every chunk, one submit_lookup_and_lock_task, one submit_load_task into other
buffers (LMCache's MemoryObjs from its host allocator), then submit_unlock; each phase timed until
its eventfd reports the task. Buffers are compared after each load. Adapters:

    kvcache (same host)   KVCacheL2Adapter, a `python -m kvcache_server` subprocess; locks are
                          arena read leases, the load copies from them
    kvcache (leases wait) the same with "early_lookups": false: the lookup's answer waits for its
                          leases (the default answers from the server's presence index and takes
                          the leases right behind it, the load waiting for them: docs/lmcache.md)
    kvcache (bulk port)   the same server with shm off (what a remote LMCache uses): the lookup
                          moves the bytes, the load copies them
    kvcache (key locks)   same host with "locks": "keys": the lookup is answered from the
                          server's presence index and locks the keys in this process, as
                          LMCache's own adapters lock; the load reads the blocks (docs/lmcache.md)
    lmcache redis         LMCache's "resp" adapter (its C++ RESP connector under
                          NativeConnectorL2Adapter, 8 I/O workers, its default) against a
                          `redis-server` this bench starts on a free 127.0.0.1 port (no
                          persistence, deleted at the end); LMCache's Valkey adapter needs
                          valkey-glide, which is not installed
    lmcache fs_native     LMCache's "fs_native" adapter (C++ file I/O, 4 workers, its default) on a
                          directory in /dev/shm: LMCache's fastest non-RDMA store on one host
    lmcache mock          LMCache's MockL2Adapter (its CI's L2, a dict in this process) at an
                          unthrottled bandwidth: no I/O at all
    lmcache L1 alone      LMCache's own L1Manager (its host pool): store = reserve_write, copy in,
                          finish_write; lookup = reserve_read; load = copy out; unlock =
                          finish_read. What a chunk costs when it never leaves LMCache's process
    memcpy                copying the buffers (one memoryview copy each): the ceiling of any adapter

"lookup ms" is the best of the lookups timed right after each round's store (the caller's caches
cold from the store's copies); "warm lookup" the median of 50 lookups back to back over the same
keys, each unlocked before the next; "lookup+load" the best of each round's lookup and load together
(what the lookup's answer does not wait for, its load may). "store GB/s" is the best of the stores
timed right after each round's buffers were filled (~100 ms of torch's random_: the store behind the
adapter idle meanwhile); "warm store" the median of 10 stores back to back (new keys, the same
buffers), as stores come when an engine is busy. The last lines give kvcache's figures over each
other's in the same run (store and load: ratio of GB/s; lookups: the other's ms over kvcache's; in
every column above 1 means kvcache is faster).
"""

from __future__ import annotations

import argparse
import os
import select
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import torch
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.config import L1ManagerConfig, L1MemoryManagerConfig
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l1_manager import L1Error, L1Manager
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.fs_native_l2_adapter import FSNativeL2AdapterConfig
from lmcache.v1.distributed.l2_adapters.mock_l2_adapter import MockL2Adapter, MockL2AdapterConfig
from lmcache.v1.distributed.l2_adapters.resp_l2_adapter import RESPL2AdapterConfig
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


def copy(src: Any, dst: Any) -> None:
    """One MemoryObj's bytes into another's: one memoryview copy, as memcpy() below does."""
    memoryview(dst.byte_array).cast("B")[:] = memoryview(src.byte_array).cast("B")


class L1Alone:
    """LMCache's L1Manager behind the four calls run() makes, each done inline: the copies are the
    engine's (into L1 on a store, out of L1 on a retrieve), the locks are L1's read locks. Its pool
    is written once through before the timing (as a running server's pool has been), so a store
    does not pay the first touch of its pages."""

    def __init__(self, size_bytes: int, chunk_bytes: int) -> None:
        memory = L1MemoryManagerConfig(size_in_bytes=size_bytes, use_lazy=False)
        self._l1 = L1Manager(L1ManagerConfig(memory_config=memory))
        self._fd = os.eventfd(0)
        self._stores: dict[int, Any] = {}  # popped by pop_completed_store_tasks
        self._done: dict[int, Any] = {}  # lookup and load results, each queried once
        self._next = 0
        keys = [ObjectKey(i.to_bytes(8, "big") * 4, "bench/warm", 0) for i in range(size_bytes // chunk_bytes)]
        layout = MemoryLayoutDesc([torch.Size([chunk_bytes // 2])], [torch.bfloat16])
        staged = {k: obj for k, (_, obj) in self._l1.reserve_write(keys, [False] * len(keys), layout).items() if obj}
        for obj in staged.values():
            obj.tensor.view(torch.uint8).zero_()
        self._l1.finish_write(list(staged))
        self._l1.delete(list(staged))

    def _complete(self, result: Any, into: dict[int, Any]) -> int:
        self._next += 1
        into[self._next] = result
        os.eventfd_write(self._fd, 1)
        return self._next

    def get_store_event_fd(self) -> int:
        return self._fd

    get_lookup_and_lock_event_fd = get_load_event_fd = get_store_event_fd

    def submit_store_task(self, keys: list[ObjectKey], objs: list[Any]) -> int:
        layout = MemoryLayoutDesc([objs[0].get_shape()], [objs[0].get_dtype()])
        reserved = self._l1.reserve_write(keys, [False] * len(keys), layout)
        for key, obj in zip(keys, objs, strict=True):
            err, dst = reserved[key]
            assert err == L1Error.SUCCESS and dst is not None, err
            copy(obj, dst)
        assert all(e == L1Error.SUCCESS for e in self._l1.finish_write(keys).values())
        return self._complete(L2StoreResult(True, sum(obj.get_size() for obj in objs)), self._stores)

    def pop_completed_store_tasks(self) -> dict[int, Any]:
        done, self._stores = self._stores, {}
        return done

    def submit_lookup_and_lock_task(self, keys: list[ObjectKey], _: Any) -> int:
        found = self._l1.reserve_read(keys)
        bitmap = Bitmap(len(keys))
        for i, key in enumerate(keys):
            if found[key][0] == L1Error.SUCCESS:
                bitmap.set(i)
        return self._complete(bitmap, self._done)

    def submit_load_task(self, keys: list[ObjectKey], objs: list[Any]) -> int:
        held = self._l1.unsafe_read(keys)
        bitmap = Bitmap(len(keys))
        for i, (key, obj) in enumerate(zip(keys, objs, strict=True)):
            err, src = held[key]
            if err == L1Error.SUCCESS and src is not None:
                copy(src, obj)
                bitmap.set(i)
        return self._complete(bitmap, self._done)

    def query_lookup_and_lock_result(self, task: int) -> Any:
        return self._done.pop(task, None)

    query_load_result = query_lookup_and_lock_result

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        self._l1.finish_read(keys)

    def close(self) -> None:
        self._l1.close()
        os.close(self._fd)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def redis_server(binary: str) -> Iterator[int]:
    """A throwaway `redis-server` on 127.0.0.1 (no persistence, no eviction); yields its port."""
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="bench-redis-")
    argv = [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen([*argv, "--dir", workdir], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, "redis-server exited"
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "redis-server not ready in 30 s"
            time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


WARM_LOOKUPS = 50
WARM_STORES = 10


def run(adapter: Any, alloc: HostMemoryAllocator, n: int, chunk: int, repeat: int, tag: int) -> dict[str, float]:
    shape = torch.Size([chunk // 2])
    src = [alloc.allocate(shape, torch.bfloat16) for _ in range(n)]
    dst = [alloc.allocate(shape, torch.bfloat16) for _ in range(n)]
    best = {"store": float("inf"), "lookup": float("inf"), "load": float("inf"), "lookup_load": float("inf")}
    stores: dict[int, Any] = {}

    def popped(t: int) -> Any:
        stores.update(adapter.pop_completed_store_tasks())
        return stores.pop(t, None)

    for r in range(repeat):
        keys = _keys(tag, r, n)
        for obj in src:
            obj.tensor.view(torch.uint8).random_(0, 256)
        for obj in dst:
            obj.tensor.view(torch.uint8).zero_()
        t0 = time.perf_counter()
        task = adapter.submit_store_task(keys, src)
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
            "lookup_load": min(best["lookup_load"], t3 - t1),
        }
    # Lookups back to back over the last round's keys (each then unlocked): what a lookup costs when
    # the caller's caches are warm, beside the one right after a store above.
    warm = []
    for _ in range(WARM_LOOKUPS):
        t = time.perf_counter()
        task = adapter.submit_lookup_and_lock_task(keys, {})
        assert wait(adapter.get_lookup_and_lock_event_fd(), adapter.query_lookup_and_lock_result, task).popcount() == n
        warm.append(time.perf_counter() - t)
        adapter.submit_unlock(keys)
    best["warm_lookup"] = statistics.median(warm)
    # Stores back to back (new keys, the same buffers): what a store costs when the adapter, its
    # threads and the store behind it were busy a moment before, as between an engine's steps under
    # load, beside the one above, right after ~100 ms of filling the buffers.
    warm = []
    for w in range(WARM_STORES):
        t = time.perf_counter()
        task = adapter.submit_store_task(_keys(tag, repeat + w, n), src)
        assert wait(adapter.get_store_event_fd(), popped, task).is_successful()
        warm.append(time.perf_counter() - t)
    best["warm_store"] = statistics.median(warm)
    for obj in src + dst:
        obj.ref_count_down()
    return best


def _keys(tag: int, r: int, n: int) -> list[ObjectKey]:
    return [ObjectKey((tag * 100_000 + r * n + i).to_bytes(8, "big") * 4, "bench/model", 0) for i in range(n)]


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
            copy(a, b)
        best = min(best, time.perf_counter() - t0)
    for obj in src + dst:
        obj.ref_count_down()
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--chunk-mib", type=float, default=2.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--redis-server", default=shutil.which("redis-server") or "redis-server")
    args = parser.parse_args()
    chunk = int(args.chunk_mib * (1 << 20)) // 2 * 2
    n = args.chunks
    total = n * chunk
    alloc = HostMemoryAllocator(2 * total + (64 << 20))
    print(f"{n} chunks x {chunk / (1 << 20):.2f} MiB = {total / (1 << 20):.0f} MiB per phase, best of {args.repeat}")
    print(
        f"{'adapter':<22}{'store GB/s':>12}{'lookup ms':>12}{'load GB/s':>12}{'warm lookup':>13}{'warm store':>12}"
        f"{'lookup+load ms':>16}"
    )

    results: dict[str, dict[str, float]] = {}

    def line(name: str, adapter: Any, tag: int) -> None:
        try:
            t = results[name] = run(adapter, alloc, n, chunk, args.repeat, tag)
        finally:
            adapter.close()
        print(
            f"{name:<22}{total / t['store'] / 1e9:>12.2f}{t['lookup'] * 1e3:>12.2f}{total / t['load'] / 1e9:>12.2f}"
            f"{t['warm_lookup'] * 1e3:>13.3f}{total / t['warm_store'] / 1e9:>12.2f}{t['lookup_load'] * 1e3:>16.2f}"
        )

    held = 4 * total * (args.repeat + WARM_STORES)
    ram = f"{max(1, held >> 30) + 1}GiB"
    with LocalKVCacheServer("--ram-capacity", ram) as server:
        kinds = (("kvcache (same host)", True, "leases", True), ("kvcache (leases wait)", True, "leases", False))
        kinds += (("kvcache (bulk port)", False, "leases", True), ("kvcache (key locks)", True, "keys", True))
        for tag, (name, shm, locks, early) in enumerate(kinds):
            params = {"target": server.target, "shm": shm, "locks": locks, "timeout_s": 60.0, "lookup_timeout_s": 60.0}
            line(name, KVCacheL2Adapter({**params, "early_lookups": early}), 20 + tag)
    with redis_server(args.redis_server) as port:
        line("lmcache redis", create_l2_adapter(RESPL2AdapterConfig(host="127.0.0.1", port=port)), 3)
    base = tempfile.mkdtemp(prefix="bench-lmcache-fs-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        line("lmcache fs_native", create_l2_adapter(FSNativeL2AdapterConfig(base_path=base)), 4)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    line("lmcache mock", MockL2Adapter(MockL2AdapterConfig(max_size_gb=held / (1 << 30) + 1, mock_bandwidth_gb=1e6)), 9)
    line("lmcache L1 alone", L1Alone(total * (args.repeat + WARM_STORES) + (64 << 20), chunk), 10)
    t = memcpy(alloc, n, chunk, args.repeat)
    print(f"{'memcpy':<22}{total / t / 1e9:>12.2f}{'':>12}{total / t / 1e9:>12.2f}")

    for mine in ("kvcache (same host)", "kvcache (key locks)"):
        print(
            f"\n{mine} over each (x: store GB/s, lookup ms inverted, load GB/s, warm lookup inverted, warm store"
            " GB/s; > 1 = kvcache faster)"
        )
        ours = results[mine]
        for name, t in results.items():
            if name.startswith("kvcache"):
                continue
            ratios = (t["store"] / ours["store"], t["lookup"] / ours["lookup"], t["load"] / ours["load"])
            ratios += (t["warm_lookup"] / ours["warm_lookup"], t["warm_store"] / ours["warm_store"])
            print(f"{'vs ' + name:<22}" + "".join(f"{r:>11.2f}x" for r in ratios))


if __name__ == "__main__":
    main()
