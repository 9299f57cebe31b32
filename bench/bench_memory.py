"""Peak RSS of a kvcache server against its RAM cap under a 10x flood of puts, with each of the
allocator settings it can apply to itself (server.malloc_trim_interval_s, server.malloc_mmap_threshold_bytes,
server.malloc_trim_threshold_bytes; kvcache_server/allocator.py) and with malloc left alone, in one run.

Run from the repository root with the project's virtualenv:

    python bench/bench_memory.py                 # ~1-2 minutes
    python bench/bench_memory.py --flood-x 5     # a smaller flood

Each configuration is its own `python -m kvcache_server` process (RAM cap --ram-mib, max block 8 MiB,
RAM only), flooded by one SDK client with --flood-x times the cap of random 1, 2 and 4 MiB blocks in
batches of 8, once over shared memory (the default on one host) and once over gRPC (shm=False), then
a Get of the last batch (verified). All but the last configuration run malloc_trim every 1 s (the
default of server.malloc_trim_interval_s). RSS is sampled from /proc every 10 ms. Reported per run: RSS at
the start (after a warm-up put), peak RSS, the growth over the start, and the growth / RAM cap. The
documented bound (docs/limits.md) is growth <= RAM cap + limits.inflight_bytes + gRPC's buffers.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from pathlib import Path

from _common import MiB, ServerProcess, exit_on_sigterm, python_cmd

from kvcache_client import KVCacheClient
from kvcache_core.format import encode_block_parts

REPO = Path(__file__).resolve().parent.parent


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


class Sampler:
    """The peak RSS of a process, sampled every 10 ms in a thread."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes(self.pid))
            time.sleep(0.01)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, rss_bytes(self.pid))


def flood(target: str, pid: int, cap: int, flood_x: int, shm: bool) -> dict[str, float]:
    payload = os.urandom(4 * MiB)
    sizes = (1 * MiB, 2 * MiB, 4 * MiB)
    rng = random.Random(0)

    def batch() -> list[tuple[bytes, object]]:
        out = []
        for _ in range(8):
            key, n = os.urandom(16), rng.choice(sizes)
            out.append((key, encode_block_parts(memoryview(payload)[:n], key=key, dtype="uint8", shape=(n,))))
        return out

    with KVCacheClient(target, timeout_s=60, shm=shm, bulk=False) as client:
        client.put_many("warm", batch())
        start = rss_bytes(pid)
        sampler = Sampler(pid)
        sent = 0
        last: list[tuple[bytes, object]] = []
        while sent < flood_x * cap:
            last = batch()
            client.put_many("flood", last)
            sent += sum(len(h) + len(p) for _, (h, p) in last)  # type: ignore[misc]
        got = client.get_many("flood", [k for k, _ in last])
        if any(b is None for b in got):
            raise RuntimeError("the newest blocks are not all there")
        peak = sampler.stop()
        ram = client.stats().tier("ram")
    return {
        "sent_mib": sent / MiB,
        "start_mib": start / MiB,
        "peak_mib": peak / MiB,
        "growth_mib": (peak - start) / MiB,
        "growth_over_cap": (peak - start) / cap,
        "ram_used_mib": ram.used_bytes / MiB,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ram-mib", type=int, default=64, help="the RAM tier's cap in MiB (default 64)")
    p.add_argument("--flood-x", type=int, default=10, help="flood this many times the cap (default 10)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = p.parse_args()
    exit_on_sigterm()
    cap = args.ram_mib * MiB
    rows = []
    configs = {
        "malloc_trim every 1 s (default)": [],
        "trim threshold 256 MiB": ["server.malloc_trim_threshold_bytes=268435456"],
        "mmap threshold 128 KiB": ["server.malloc_mmap_threshold_bytes=131072"],
        "malloc left alone": ["server.malloc_trim_interval_s=0"],
    }
    print(f"RAM cap {args.ram_mib} MiB, flood {args.flood_x}x, blocks of 1/2/4 MiB in batches of 8")
    print(f"{'allocator':<36} {'path':<5} {'start MiB':>9} {'peak MiB':>9} {'growth MiB':>10} {'growth/cap':>10}")
    for name, sets in configs.items():
        for shm in (True, False):
            argv = python_cmd("-m", "kvcache_server", "--port", "0", "--log-level", "warning")
            argv += ["--ram-capacity", str(cap), "--max-block-bytes", "8MiB"]
            for s in sets:
                argv += ["--set", s]
            server = ServerProcess("kvcache", argv, cwd=str(REPO))
            try:
                port = server.start(r"serving \S+ on [^\s:]+:(\d+)")
                assert server.proc is not None
                row = flood(f"127.0.0.1:{port}", server.proc.pid, cap, args.flood_x, shm)
            finally:
                server.stop()
            row.update(allocator=name, path="shm" if shm else "gRPC")
            rows.append(row)
            print(
                f"{name:<36} {row['path']:<5} {row['start_mib']:9.0f} {row['peak_mib']:9.0f} "
                f"{row['growth_mib']:10.0f} {row['growth_over_cap']:10.2f}"
            )
            sys.stdout.flush()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
