"""The disk tier against its baselines, measured in the same run, and what it does to the hit rate.

Run from the repository root with the project's virtualenv:

    python bench/bench_disk_tier.py                  # full run (~1-2 minutes)
    python bench/bench_disk_tier.py --quick          # smoke run (< 30 s)
    python bench/bench_disk_tier.py --dir /nvme/tmp  # on the disk you mean to use (default: a temp dir)

Part 1, batches of 64 blocks (16 KiB, 256 KiB, 2 MiB), in this process (no RPC: the tier itself):
    raw pwrite/pread  the same bytes appended to / read from one file in the same directory with
                      os.pwrite/os.pread (each batch written past the last, wrapping at the tier's
                      capacity, so both write new page-cache pages), from a pool of as many threads as
                      the tier has (io_threads for reads, write_threads for writes): what the file
                      system gives Python.
    disk tier         DiskTier.put_many / get_many (record headers, index, the region seqlock).
    ram tier          TierStack with RAM only: get of the same batch (leased views; no copy).
    redis tier        RedisTier.get_many against a redis-server started here (no persistence),
                      when redis-server is installed.
    Reads twice: warm (the page cache holds the files) and cold (fsync, then POSIX_FADV_DONTNEED on
    the files before each call, untimed, so they come from the device). Ratios: disk tier time / baseline
    time (1.00x = as fast as the baseline; raw I/O is the floor).

Part 2, hit rate (trace-like): a TierStack with a small RAM tier, alone and with a disk tier 8x
larger (write-behind, demotion on eviction), replaying sessions that share prompt prefixes with a
Zipf(1.1) popularity over prefixes; each request looks up its chunk keys, gets the prefix found
and puts the rest. Reported: blocks served from cache / blocks asked, and from which tier.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import KiB, MiB, free_port
from kvcache_core.format import encode_block
from kvcache_server.stack import LowerTierPolicy, TierStack, WriteMode
from kvcache_server.tiers.base import TierKind
from kvcache_server.tiers.disk import DiskTier

NS = "bench"
BATCH = 64


def block_of(size: int) -> tuple[bytes, bytes]:
    key = os.urandom(16)
    return key, encode_block(os.urandom(size), key=key, dtype="uint8", shape=(size,))


def median(times: list[float]) -> float:
    return statistics.median(times)


def timed(fn, iters: int, before=None) -> float:
    """Median seconds of fn() over iters calls (after one warm-up); before(), if given, runs untimed before each."""
    fn()
    times = []
    for _ in range(iters):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return median(times)


def drop_cache(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class Raw:
    """The baseline: the same blocks appended to one file with os.pwrite, read back with os.pread."""

    def __init__(self, directory: Path, items: list[tuple[bytes, bytes]], threads: int, wrap_bytes: int) -> None:
        self.path = directory / "raw.bin"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self.items = items
        self.pool = ThreadPoolExecutor(threads)
        self.threads = threads
        self.offsets = []
        self.nbytes = sum(len(b) for _, b in items)
        self.base = 0  # each write appends past the last, as the tier does, wrapping at the tier's capacity
        self.wrap = max(wrap_bytes - self.nbytes, 0)
        off = 0
        for _, b in items:
            self.offsets.append((off, len(b)))
            off += len(b)

    def _chunks(self) -> list[range]:
        step = -(-len(self.items) // self.threads)
        return [range(i, min(i + step, len(self.items))) for i in range(0, len(self.items), step)]

    def write(self) -> None:
        base = self.base
        self.base = base + self.nbytes if base + 2 * self.nbytes <= self.wrap else 0

        def part(r: range) -> None:
            for i in r:
                os.pwrite(self.fd, self.items[i][1], base + self.offsets[i][0])

        list(self.pool.map(part, self._chunks()))

    def read(self) -> list[bytes]:
        def part(r: range) -> list[bytes]:
            return [os.pread(self.fd, self.offsets[i][1], self.offsets[i][0]) for i in r]

        return [b for chunk in self.pool.map(part, self._chunks()) for b in chunk]

    def close(self) -> None:
        self.pool.shutdown()
        os.close(self.fd)


def start_redis() -> tuple[subprocess.Popen[bytes], int] | None:
    binary = shutil.which("redis-server")
    if binary is None:
        return None
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--save", "", "--appendonly", "no", "--bind", "127.0.0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    import redis

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            redis.Redis(port=port).ping()
            return proc, port
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    return None


def part1(base: Path, sizes: list[int], iters: int, io_threads: int, write_threads: int) -> None:
    redis_proc = start_redis()
    print(
        f"Part 1: batches of {BATCH} blocks; io_threads={io_threads}, write_threads={write_threads}; median of {iters}"
    )
    print(
        f"{'block':>8} {'op':<11} {'raw':>9} {'disk tier':>10} {'ratio':>7} {'ram tier':>9} {'redis':>9}"
        "  disk/ram  disk/redis"
    )
    try:
        for size in sizes:
            d = base / f"s{size}"
            d.mkdir()
            items = [block_of(size) for _ in range(BATCH)]
            keys = [k for k, _ in items]
            nbytes = sum(len(b) for _, b in items)
            region = max(MiB, 1 << (nbytes * 2 - 1).bit_length())
            capacity = region * (write_threads + 2) * 4
            raw_w = Raw(d, items, write_threads, capacity)
            raw_r = Raw(d, items, io_threads, capacity)
            raw_r.fd, raw_r.path = raw_w.fd, raw_w.path
            tier = DiskTier(
                str(d / "tier"),
                capacity_bytes=capacity,
                region_bytes=min(region, (4 << 30) - MiB),
                io_threads=io_threads,
                write_threads=write_threads,
            )

            def tier_put(tier=tier, items=items) -> None:
                tier._index.clear()  # every call writes the batch again (content addressing would skip it)
                call(tier.put_many(NS, items))

            w_raw = timed(raw_w.write, iters)
            w_tier = timed(tier_put, iters)
            print(
                f"{size // KiB:>6}Ki {'put':<11} {w_raw * 1e3:>7.2f}ms {w_tier * 1e3:>8.2f}ms {w_tier / w_raw:>6.2f}x"
                f" {'':>9} {'':>9}   ({nbytes / w_tier / 1e9:.2f} GB/s)"
            )
            stack = TierStack(nbytes * 2, prefault=False)
            call(stack.start())
            call(stack.put(NS, items))

            async def ram_get(stack=stack, keys=keys) -> None:
                stack.release(await stack.get(NS, keys))

            redis_tier = None
            if redis_proc is not None:
                from kvcache_server.tiers.redis import RedisTier

                redis_tier = RedisTier(f"redis://127.0.0.1:{redis_proc[1]}/0", timeout_s=30)
                call(redis_tier.put_many(NS, items))
            for mode in ("warm", "cold"):
                files = [raw_w.path, *sorted((d / "tier").glob("r*.kvd"))]

                def tier_read(tier=tier, keys=keys) -> None:
                    got = call(tier.get_many(NS, keys))
                    assert all(g is not None for g in got)

                cold = (lambda files=files: drop_cache(files)) if mode == "cold" else None
                r_raw = timed(raw_r.read, iters, cold)
                r_tier = timed(tier_read, iters, cold)
                ram_s = timed(lambda: call(ram_get()), iters)
                redis_s = float("nan")
                if redis_tier is not None:
                    redis_s = timed(lambda r=redis_tier, k=keys: call(r.get_many(NS, k)), iters)
                print(
                    f"{'':>8} {'get ' + mode:<11} {r_raw * 1e3:>7.2f}ms {r_tier * 1e3:>8.2f}ms {r_tier / r_raw:>6.2f}x"
                    f" {ram_s * 1e3:>7.2f}ms {redis_s * 1e3:>7.2f}ms {r_tier / ram_s:>8.1f}x {r_tier / redis_s:>8.2f}x"
                )
            call(stack.close())
            if redis_tier is not None:
                call(redis_tier.close())
            call(tier.close())
            raw_w.close()
            raw_r.pool.shutdown()
    finally:
        if redis_proc is not None:
            redis_proc[0].kill()
            redis_proc[0].wait()


def workload(requests: int, prefixes: int, seed: int = 7) -> list[list[bytes]]:
    """Chunk keys per request: a shared prefix (Zipf(1.1) over `prefixes`) and a short unique tail."""
    rng = random.Random(seed)
    weights = [1 / (i + 1) ** 1.1 for i in range(prefixes)]
    heads = [[rng.randbytes(16) for _ in range(rng.randint(4, 24))] for _ in range(prefixes)]
    out = []
    for p in rng.choices(range(prefixes), weights, k=requests):
        out.append(heads[p] + [rng.randbytes(16) for _ in range(rng.randint(1, 4))])
    return out


async def replay(requests: list[list[bytes]], ram_bytes: int, disk_dir: Path | None, block: int) -> dict[str, float]:
    lower = []
    if disk_dir is not None:
        tier = DiskTier(str(disk_dir), capacity_bytes=8 * ram_bytes, region_bytes=MiB, io_threads=4, write_threads=1)
        policy = LowerTierPolicy(write_mode=WriteMode.BEHIND, queue_max_bytes=64 * MiB, timeout_s=10.0)
        lower = [(tier, policy)]
    stack = TierStack(ram_bytes, lower, prefault=False)
    await stack.start()
    payload = os.urandom(block)
    asked = served = from_disk = 0
    t0 = time.perf_counter()
    for keys in requests:
        tiers = await stack.lookup(NS, keys)
        n = len(tiers)
        asked += len(keys)
        if n:
            found = await stack.get(NS, keys[:n])
            hits = [f for f in found if f is not None]
            served += len(hits)
            from_disk += sum(f.tier is TierKind.DISK for f in hits)
            stack.release(found)
        missing = keys[len(tiers) :]
        await stack.put(NS, [(k, encode_block(payload, key=k, dtype="uint8", shape=(block,))) for k in missing])
    await stack.wait_idle()
    elapsed = time.perf_counter() - t0
    await stack.close()
    return {"hit": served / asked, "disk": from_disk / asked, "s": elapsed}


async def part2(base: Path, requests: int, block: int) -> None:
    reqs = workload(requests, prefixes=requests // 4)
    distinct = len({k for r in reqs for k in r})
    ram = max(2 * MiB, distinct * (block + 200) // 16)  # RAM holds about 1/16 of the distinct blocks
    print(
        f"\nPart 2: {requests} requests, {distinct} distinct blocks of {block // KiB} KiB; "
        f"RAM {ram / MiB:.0f} MiB, disk 8x that"
    )
    alone = await replay(reqs, ram, None, block)
    both = await replay(reqs, ram, base / "hits", block)
    print(f"  RAM alone:        hit rate {alone['hit']:.1%}  ({alone['s']:.1f} s)")
    print(
        f"  RAM + disk (8x):  hit rate {both['hit']:.1%}  of which from disk {both['disk']:.1%}  ({both['s']:.1f} s)"
        f"  -> {both['hit'] / max(alone['hit'], 1e-9):.2f}x the hits"
    )


loop = asyncio.new_event_loop()  # the tiers' event loop, in a thread of its own; the timing loop calls into it


def call(coro):
    return asyncio.run_coroutine_threadsafe(coro, loop).result()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dir", default="")
    parser.add_argument("--io-threads", type=int, default=8)
    parser.add_argument("--write-threads", type=int, default=2)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="kvcache-bench-disk-", dir=args.dir or None))
    sizes = [16 * KiB, 256 * KiB] if args.quick else [16 * KiB, 256 * KiB, 2 * MiB]
    iters = 5 if args.quick else 15
    threading.Thread(target=loop.run_forever, daemon=True).start()
    try:
        part1(base, sizes, iters, args.io_threads, args.write_threads)
        requests = 1500 if args.quick else 6000
        call(part2(base, requests, 16 * KiB))
    finally:
        loop.call_soon_threadsafe(loop.stop)
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
