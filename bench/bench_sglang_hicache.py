"""Store, exists and load of one prompt's pages through SGLang HiCache storage backends: kvcache vs SGLang's own.

    .venv/bin/python bench/bench_sglang_hicache.py [--pages 64] [--page-size 64] [--repeat 5]

One prompt (`--pages` pages of `--page-size` tokens) in a real SGLang 0.5.23 host KV pool,
page-first, built as SGLang's assembler builds it (tests/sglang/harness.py) for a small model of
each attention kind:

    mha   Qwen2.5-0.5B's geometry: 24 layers, 2 KV heads of 64, bf16 (12 KiB per token)
    mla   DeepSeek-V2-Lite's: 27 layers, kv_lora_rank 512 + rope 64, bf16 (30.4 KiB per token)

Each round stores the pages from the pool's first half, asks how many are stored, and loads them
into the second half (other host indices), each phase timed as one call of the controller's; the
loaded pages are compared byte for byte with the stored ones after every load. Every round uses
fresh keys and fresh random bytes; rounds go through the backends in turn (so a change in the
machine's load falls on all of them), one untimed round first, then medians of `--repeat` rounds.
Backends, each driven the way HiCacheController drives it:

    kvcache (same host)  KVCacheHiCacheStorage on a `python -m kvcache_server` subprocess, the
                         zero-copy v1 path ("interface_v1": 1): batch_set_v1 / batch_exists /
                         batch_get_v1; bytes through the server's block arena (docs/arena.md)
    kvcache (same host, RPC)  the same with "presence_index": false: batch_exists as a Lookup RPC
                         (the row above reads the server's presence index: docs/presence.md)
    kvcache (bulk port)  the same with "shm": false: the bytes over the bulk port (a remote server)
    sglang file          SGLang's HiCacheFile (`--hicache-storage-backend file`) on a temp dir
                         (ext4 here, page cache warm: nothing is synced). It has no v1 methods,
                         so the controller takes its generic path (cache_controller.py,
                         _generic_page_set / _generic_page_get): get_data_page per page +
                         batch_set; batch_exists; batch_get into get_dummy_flat_data_page() +
                         set_from_flat_data_page per page
    sglang file (tmpfs)  the same on a temp dir in /dev/shm (`--tmpfs`): no disk file system
                         below the page cache
    memcpy               one copy of the same bytes from the first half to the second: the
                         ceiling of any backend (shown as both store and load)

SGLang's other in-tree backends need a service or a library this machine does not have: mooncake
(the mooncake package, its master and metadata services; not installed), nixl, hf3fs (3FS itself;
its `use_mock_hf3fs_client` is a CI stand-in, pread/pwrite of one local file, and refuses MLA
without its metadata server), aibrix, eic, simm, mori, tensorcast, seaweedfs, npu_memcache; `shm`
and `sim` store no bytes (`sim` sleeps a modelled time instead).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from tests.sglang import harness
from tests.sglang.cpu_shim import import_modules

import_modules(harness.SGLANG_MODULES)

from kvcache_server.launcher import LocalKVCacheServer  # noqa: E402

GEOMETRY = {
    "mha": {"heads": 2, "head_dim": 64, "layers": 24},
    "mla": {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "layers": 27},
}
POOL_BUILDERS = {"mha": harness.mha_host_pool, "mla": harness.mla_host_pool}


def region(pool: Any, kind: str, first_token: int, tokens: int) -> torch.Tensor:
    """The pool's bytes of tokens [first_token, first_token + tokens), every layer (page-first layout)."""
    span = slice(first_token, first_token + tokens)
    buffer = pool.kv_buffer[:, span] if kind == "mha" else pool.kv_buffer[span]
    return buffer.view(torch.uint8)


class Driver:
    """One backend as the controller calls it: store(keys, indices), exists(keys), load(keys, indices)."""

    def __init__(self, name: str, backend: Any, v1: bool) -> None:
        self.name = name
        self.backend = backend
        self.v1 = v1

    def store(self, keys: list[str], indices: torch.Tensor) -> bool:
        if self.v1:
            return all(self.backend.batch_set_v1(keys, indices))
        pool, size = self.backend.mem_pool_host, self.backend.mem_pool_host.page_size
        return self.backend.batch_set(keys, [pool.get_data_page(indices[i * size]) for i in range(len(keys))])

    def exists(self, keys: list[str]) -> int:
        return self.backend.batch_exists(keys)

    def load(self, keys: list[str], indices: torch.Tensor) -> int:
        if self.v1:
            return sum(self.backend.batch_get_v1(keys, indices))
        pool, size = self.backend.mem_pool_host, self.backend.mem_pool_host.page_size
        pages = self.backend.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
        for i, page in enumerate(pages):
            if page is None:
                return i
            pool.set_from_flat_data_page(indices[i * size], page)
        return len(keys)


WARM_EXISTS = 50
"""batch_exists calls back to back after each round's load: what a prefix check costs with the
caller's caches warm, beside the one right after the store (the "exists" column)."""


def one_round(driver: Driver, kind: str, pages: int, tag: str) -> tuple[float, float, float, float]:
    """Seconds of the store, the exists and the load of one prompt's pages, under fresh keys and bytes,
    and the median of WARM_EXISTS exists of them back to back after the load."""
    pool = driver.backend.mem_pool_host
    tokens = pages * pool.page_size
    src = torch.arange(0, tokens, dtype=torch.int64)
    dst = torch.arange(tokens, 2 * tokens, dtype=torch.int64)
    keys = harness.page_keys(f"{driver.name}/{kind}/{tag}", pages)
    region(pool, kind, 0, tokens).random_(0, 256)
    region(pool, kind, tokens, tokens).zero_()
    t0 = time.perf_counter()
    assert driver.store(keys, src), f"{driver.name}: store failed"
    t1 = time.perf_counter()
    assert driver.exists(keys) == pages, f"{driver.name}: not every page stored"
    t2 = time.perf_counter()
    assert driver.load(keys, dst) == pages, f"{driver.name}: not every page loaded"
    t3 = time.perf_counter()
    assert harness.page_bytes(pool, src) == harness.page_bytes(pool, dst), f"{driver.name}: bytes differ"
    warm = []
    for _ in range(WARM_EXISTS):
        t = time.perf_counter()
        assert driver.exists(keys) == pages
        warm.append(time.perf_counter() - t)
    return t1 - t0, t2 - t1, t3 - t2, statistics.median(warm)


def memcpy_round(pool: Any, kind: str, pages: int) -> float:
    """Seconds of one copy of the prompt's bytes from the pool's first half to its second."""
    tokens = pages * pool.page_size
    src, dst = region(pool, kind, 0, tokens), region(pool, kind, tokens, tokens)
    src.random_(0, 256)
    t0 = time.perf_counter()
    dst.copy_(src)
    elapsed = time.perf_counter() - t0
    assert torch.equal(src, dst)
    return elapsed


def backend_for(kind: str, pages: int, page_size: int, extra_config: dict[str, Any], builtin: str | None) -> Any:
    """A backend on a fresh host pool, built and registered as HiCacheController.attach_storage_backend does."""
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    pool = POOL_BUILDERS[kind](page_size=page_size, tokens=pages * page_size, **GEOMETRY[kind])
    config = harness.storage_config(json.dumps(extra_config), is_mla=kind == "mla", model_name="bench-model")
    if builtin is None:
        return harness.load_backend(config, pool)
    backend = StorageBackendFactory.create_backend(builtin, config, pool)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    return backend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=64, help="tokens per page (--page-size of SGLang)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--kinds", default="mha,mla")
    parser.add_argument("--tmpfs", default="/dev/shm", help="tmpfs directory for the second file backend")
    args = parser.parse_args()
    os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)  # the file backend's dir is ours
    # The host pools are booked against this, not against the machine's free memory less 10 GiB.
    harness.HOST_BUDGET_BYTES = 4 << 30
    pages, size = args.pages, args.page_size
    print(f"{datetime.now(UTC):%Y-%m-%d %H:%M UTC}, {os.cpu_count()} CPUs, load {os.getloadavg()}")
    print(f"one prompt: {pages} pages x {size} tokens, medians of {args.repeat} rounds")
    with (
        LocalKVCacheServer("--ram-capacity", "4GiB") as server,
        tempfile.TemporaryDirectory() as tmp,
        tempfile.TemporaryDirectory(dir=args.tmpfs) as tmpfs,
    ):
        for kind in args.kinds.split(","):
            copy_pool = POOL_BUILDERS[kind](page_size=size, tokens=pages * size, **GEOMETRY[kind])
            nbytes = region(copy_pool, kind, 0, pages * size).numel()
            print(f"\n{kind}: {nbytes / (1 << 20):.1f} MiB ({nbytes // pages // 1024} KiB per page)")
            print(f"{'backend':<26}{'store GB/s':>12}{'exists ms':>12}{'load GB/s':>12}{'warm exists ms':>16}")
            kv_config = {**json.loads(harness.extra_config_json(server.target)), "timeout_s": 60.0}
            specs: list[tuple[str, dict[str, Any], str | None, bool]] = [
                ("kvcache (same host)", kv_config, None, True),
                ("kvcache (same host, RPC)", {**kv_config, "presence_index": False}, None, True),
                ("kvcache (bulk port)", {**kv_config, "shm": False}, None, True),
                ("sglang file", {"file_storage_path": f"{tmp}/{kind}"}, "file", False),
                ("sglang file (tmpfs)", {"file_storage_path": f"{tmpfs}/{kind}"}, "file", False),
            ]
            drivers = [
                Driver(name, backend_for(kind, pages, size, extra, builtin), v1) for name, extra, builtin, v1 in specs
            ]
            times: dict[str, list[tuple[float, float, float, float]]] = {d.name: [] for d in drivers}
            copies: list[float] = []
            try:
                # Rounds interleave the backends, so a change in the machine's load falls on all of
                # them alike; round 0 (connections, first page faults) is not timed.
                for r in range(args.repeat + 1):
                    for driver in drivers:
                        t = one_round(driver, kind, pages, str(r))
                        if r:
                            times[driver.name].append(t)
                    copy_s = memcpy_round(copy_pool, kind, pages)
                    if r:
                        copies.append(copy_s)
            finally:
                for driver in drivers:
                    close: Callable[[], object] | None = getattr(driver.backend, "close", None)
                    if close is not None:
                        close()
            results = {
                name: [statistics.median(phase) for phase in zip(*ts, strict=True)] for name, ts in times.items()
            }
            for name, (store_s, exists_s, load_s, warm_s) in results.items():
                print(
                    f"{name:<26}{nbytes / store_s / 1e9:>12.2f}{exists_s * 1e3:>12.2f}"
                    f"{nbytes / load_s / 1e9:>12.2f}{warm_s * 1e3:>16.3f}"
                )
            copy_s = statistics.median(copies)
            print(f"{'memcpy':<26}{nbytes / copy_s / 1e9:>12.2f}{'':>12}{nbytes / copy_s / 1e9:>12.2f}")
            for name in ("kvcache (same host)", "kvcache (same host, RPC)", "kvcache (bulk port)"):
                for other in ("sglang file", "sglang file (tmpfs)"):
                    # Each ratio is the file backend's median time over kvcache's: above 1, kvcache is faster.
                    store, exists, load, warm = (f / k for f, k in zip(results[other], results[name], strict=True))
                    print(
                        f"{name} vs {other}: store x{store:.2f}, exists x{exists:.2f}, load x{load:.2f}, "
                        f"warm exists x{warm:.2f}"
                    )
    print(f"\nload at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
