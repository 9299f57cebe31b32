"""The disk tier against its baselines, measured in the same run, and what it does to the hit rate.

Run from the repository root with the project's virtualenv:

    python bench/bench_disk_tier.py                  # full run (~1-2 minutes)
    python bench/bench_disk_tier.py --quick          # smoke run (< 30 s)
    python bench/bench_disk_tier.py --dir /nvme/tmp  # on the disk you mean to use (default: a temp dir)
    python bench/bench_disk_tier.py --only-stream    # Part 3 alone: the tier against dd and fio (~1 min)

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

Part 3, streams of 1 MiB and 4 MiB blocks (--stream-mib, 512 MiB each; 128 with --quick) against dd
and fio on the same file system (the same directory), in the same run, GB/s (10^9 bytes/s) of the
median of --stream-iters rounds in which dd, fio and the tier take turns (the machine is shared: its
load changes). 512 MiB, not less: a warm read of 128 MiB lasts 15-30 ms, and on a VM the few ms it takes
to get an idle vCPU back (after dd's and fio's processes ran, or a 0.3 s sleep) once moved a 128 MiB
tier read from 5.4 to 2.8 GB/s while dd, one process reading alone, did not move (docs/disk-benchmarks.md,
"Round 4"). Each tier row measures the path the server uses for it (TierStream):
    write       into the page cache (what the tier does: no fsync). dd if=/dev/zero of=F bs=B (into a
                new file); fio --rw=write --ioengine=psync (buffered, one job); the tier: put_many in
                the batches the stack's write-behind worker takes (at most 64 blocks and 32 MiB), one
                after the other, into a new tier: the disk's side of a write-behind put and of a
                demotion (RAM eviction -> disk).
    write+fsync to the device: dd conv=fsync (its time includes the fsync); the tier's puts, then an
                fsync of each region file, timed together. (No fio here: its bandwidth leaves the
                final fsync out.)
    read warm   from the page cache: dd of=/dev/null; fio --rw=read --invalidate=0; the tier:
                TierStack.get of batches of 64 keys held by the disk and not by RAM (emptied before
                each round, untimed): the promotion path of a Get, each block read into its RAM
                arena slot, verified there, indexed and leased.
    read warm, no promotion: the same baselines; the tier: DiskTier.get_many, blocks read into its
                reused buffers (tiers/reuse.py; gets that do not promote, a compressed disk tier).
    Both warm reads also print a floor beside dd and fio: one os.preadv per block of dd's file, each
                into a place of its own in a pre-faulted buffer, no check: what any reader that keeps
                every block (a cache does) can move, where dd and fio reuse one cache-resident buffer.
    read cold   from the device: the files' pages dropped first (fsync, POSIX_FADV_DONTNEED), untimed;
                dd; fio --invalidate=1 (fio drops them itself); the tier as in read warm.
    The ratio is the tier's GB/s over the faster of dd and fio (1.00x: as fast; the issue's target
    is >= 0.5x). dd and fio times are their own reports (no process start-up; fio's from the time
    its calls took, lat_ns); fio is skipped when it is not installed (apt-get install fio). Also
    printed: the minor page faults per MiB of the tier's warm reads (getrusage): none into the arena,
    which is mapped once, nor into get_many's reused buffers; one per 4 KiB page into new bytes (as
    get_many read before them, and still does with disk.read_buffers_bytes = 0).

Longer than the project's ~500-line module guideline on purpose: one self-contained benchmark whose
three parts (raw I/O floor, the Zipf replay, the stream against dd and fio) share its servers and tables.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
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
WB_ITEMS = 64  # the stack's write-behind batches (kvcache_server.stack._BATCH_ITEMS, _BATCH_BYTES)
WB_BYTES = 32 << 20


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


# -- Part 3: streams of large blocks against dd and fio ------------------------------------------

DD_COPIED = re.compile(r"(\d+) bytes .* copied, ([0-9.e+-]+) s")


def dd_gb_s(*args: str) -> float:
    """GB/s of one dd run, from its own report (bytes and seconds: no process start-up)."""
    out = subprocess.run(
        ["dd", *args], capture_output=True, text=True, timeout=300, env={**os.environ, "LC_ALL": "C"}, check=True
    )
    m = DD_COPIED.search(out.stderr)
    if m is None:
        raise RuntimeError(f"dd printed no timing: {out.stderr!r}")
    return int(m.group(1)) / float(m.group(2)) / 1e9


def fio_gb_s(path: Path, rw: str, block: int, nbytes: int, invalidate: bool) -> float:
    """GB/s of one fio job (buffered psync, one job), from its JSON report: its bytes over the time its
    calls took (lat_ns, nanoseconds; its bw_bytes divides by a runtime in whole milliseconds, too coarse
    for a 20 ms read from the page cache, and this leaves fio's own loop out: a baseline no slower)."""
    argv = ["fio", "--name=kvcache", f"--filename={path}", f"--rw={rw}", f"--bs={block}", f"--size={nbytes}"]
    argv += ["--ioengine=psync", "--numjobs=1", f"--invalidate={int(invalidate)}", "--output-format=json"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=True)
    job = json.loads(out.stdout)["jobs"][0][rw]
    return job["io_bytes"] / (job["lat_ns"]["mean"] * job["total_ios"])


def interleaved(fns: dict[str, Callable[[], float] | None], iters: int) -> dict[str, object]:
    """Each fn's median GB/s (and, under "<name>_range", its min and max) over `iters` rounds in which
    the fns take turns, so that a change in the shared machine's load falls on all of them alike; a
    None fn gives None. Each fn times itself (what it does before its timed part, such as dropping
    the page cache, is not counted)."""
    runs: dict[str, list[float]] = {k: [] for k, fn in fns.items() if fn is not None}
    for _ in range(iters):
        for k, xs in runs.items():
            fn = fns[k]
            assert fn is not None
            xs.append(fn())
    out: dict[str, object] = {k: median(runs[k]) if k in runs else None for k in fns}
    out.update({f"{k}_range": [min(xs), max(xs)] for k, xs in runs.items()})
    return out


class TierStream:
    """A stream of equal blocks through the disk tier on the paths the server uses for them.

    write: DiskTier.put_many in the batches the stack's write-behind worker takes from its queue (at
    most WB_ITEMS blocks and WB_BYTES bytes each, one batch at a time): what a write-behind put and a
    demotion (RAM eviction -> disk) cost the disk. read: TierStack.get of batches of BATCH keys that
    RAM does not hold and the disk does, through a stack whose RAM tier has room for the stream
    (pre-faulted, as a server's): a disk hit is read straight into its RAM arena slot, verified
    there (checksum), indexed and leased (the promotion path of every Get). read_plain: DiskTier.
    get_many, every block in a buffer of its pool (tiers/reuse.py): the path of gets that do not
    promote (and of a compressed disk tier). Before each read RAM forgets the stream (untimed), so
    every block comes from disk.
    """

    def __init__(self, base: Path, block: int, nbytes: int, io_threads: int, write_threads: int) -> None:
        self.base = base
        self.items = [block_of(block) for _ in range(max(1, nbytes // block))]
        self.nbytes = sum(len(b) for _, b in self.items)
        self.region = 64 * MiB
        self.capacity = (-(-self.nbytes * 11 // 10 // self.region) + write_threads + 1) * self.region
        self.threads = (io_threads, write_threads)
        self.tier: DiskTier | None = None
        self.stack: TierStack | None = None
        self.made = 0
        self.faults: list[int] = []  # minor page faults of each read()
        self.plain_faults: list[int] = []  # and of each read_plain()

    def files(self) -> list[Path]:
        assert self.tier is not None
        return sorted(Path(self.tier._dir).glob("r*.kvd"))

    def write(self, fsync: bool) -> float:
        """GB/s of writing the stream into a new tier (made and the old one removed untimed)."""
        self.close()
        self.made += 1
        self.tier = DiskTier(
            str(self.base / f"stream{self.made}"),
            capacity_bytes=self.capacity,
            region_bytes=self.region,
            io_threads=self.threads[0],
            write_threads=self.threads[1],
        )
        batches, batch, size = [], [], 0
        for item in self.items:  # the write-behind worker's batches (WriteQueue.take)
            if batch and (len(batch) >= WB_ITEMS or size + len(item[1]) > WB_BYTES):
                batches.append(batch)
                batch, size = [], 0
            batch.append(item)
            size += len(item[1])
        batches.append(batch)
        t0 = time.perf_counter()
        for batch in batches:
            stored = call(self.tier.put_many(NS, batch))
            assert all(stored), "the stream does not fit in the tier"
        if fsync:
            for path in self.files():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        return self.nbytes / (time.perf_counter() - t0) / 1e9

    def _stack(self) -> TierStack:
        if self.stack is None:
            assert self.tier is not None
            ram = self.nbytes + len(self.items) * 4096 + 16 * MiB
            self.stack = TierStack(ram, [(self.tier, LowerTierPolicy(write_mode=WriteMode.BEHIND))], prefault=True)
            call(self.stack.start())
        self.stack.ram.delete_many_sync(NS, [k for k, _ in self.items])  # every block from disk
        return self.stack

    def read(self) -> float:
        """GB/s of the stream's Gets through the stack (disk hit -> RAM slot); faults into self.faults."""
        stack = self._stack()
        keys = [k for k, _ in self.items]
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        for i in range(0, len(keys), BATCH):
            found = call(stack.get(NS, keys[i : i + BATCH]))
            assert all(f is not None and f.tier is TierKind.DISK and f.lease is not None for f in found)
            stack.release(found)
        gb_s = self.nbytes / (time.perf_counter() - t0) / 1e9
        self.faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
        return gb_s

    def read_plain(self) -> float:
        """GB/s of DiskTier.get_many of the stream (its pooled buffers); faults into self.plain_faults."""
        assert self.tier is not None
        keys = [k for k, _ in self.items]
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        for i in range(0, len(keys), BATCH):
            got = call(self.tier.get_many(NS, keys[i : i + BATCH]))
            assert all(g is not None for g in got)
            del got
        gb_s = self.nbytes / (time.perf_counter() - t0) / 1e9
        self.plain_faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
        return gb_s

    def close(self) -> None:
        if self.tier is not None:
            directory = Path(self.tier._dir)
            call(self.stack.close() if self.stack is not None else self.tier.close())
            shutil.rmtree(directory, ignore_errors=True)
            self.tier = self.stack = None


def measure_stream(d: Path, block: int, nbytes: int, iters: int, fio: bool, threads: tuple[int, int]) -> dict:
    """{op: {"dd", "fio", "tier": GB/s}} for one block size, every file in `d`."""
    f = d / "dd.bin"
    count = max(1, nbytes // block)
    stream = TierStream(d, block, nbytes, *threads)

    def dd_write(*extra: str) -> float:
        f.unlink(missing_ok=True)
        return dd_gb_s("if=/dev/zero", f"of={f}", f"bs={block}", f"count={count}", *extra)

    def fio_write() -> float:
        (d / "fio.bin").unlink(missing_ok=True)
        return fio_gb_s(d / "fio.bin", "write", block, count * block, invalidate=False)

    def dd_read() -> float:
        return dd_gb_s(f"if={f}", "of=/dev/null", f"bs={block}")

    def fio_read(invalidate: bool) -> float:
        return fio_gb_s(f, "read", block, count * block, invalidate)

    landing = bytearray(count * block)  # faulted in once: the floor reads each block into its own place

    def distinct_read() -> float:
        """A Python loop of one os.preadv per block, each into its own place of `landing`: what any
        reader that keeps the blocks (a cache does) moves out of the page cache, without a check."""
        view = memoryview(landing)
        fd = os.open(f, os.O_RDONLY)
        try:
            t0 = time.perf_counter()
            for i in range(count):
                os.preadv(fd, [view[i * block : (i + 1) * block]], i * block)
            return count * block / (time.perf_counter() - t0) / 1e9
        finally:
            os.close(fd)

    def dd_cold() -> float:
        drop_cache([f])
        return dd_read()

    def tier_cold() -> float:
        drop_cache(stream.files())
        return stream.read()

    try:
        measured = {
            "write": interleaved(
                {"dd": dd_write, "fio": fio_write if fio else None, "tier": lambda: stream.write(False)}, iters
            ),
            "write+fsync": interleaved(
                {"dd": lambda: dd_write("conv=fsync"), "fio": None, "tier": lambda: stream.write(True)}, iters
            ),
        }
        dd_write("conv=fsync")  # the file the reads read, on the device
        dd_read()
        stream.read()
        stream.read_plain()
        stream.faults.clear()
        stream.plain_faults.clear()
        distinct_read()
        measured["read warm"] = interleaved(
            {
                "dd": dd_read,
                "fio": (lambda: fio_read(False)) if fio else None,
                "tier": stream.read,
                "distinct": distinct_read,
            },
            iters,
        )
        measured["read warm"]["tier_faults_per_mib"] = median(stream.faults) * MiB / stream.nbytes
        measured["read warm, no promotion"] = interleaved(
            {
                "dd": dd_read,
                "fio": (lambda: fio_read(False)) if fio else None,
                "tier": stream.read_plain,
                "distinct": distinct_read,
            },
            iters,
        )
        measured["read warm, no promotion"]["tier_faults_per_mib"] = median(stream.plain_faults) * MiB / stream.nbytes
        measured["read cold"] = interleaved(
            {"dd": dd_cold, "fio": (lambda: fio_read(True)) if fio else None, "tier": tier_cold}, iters
        )
    finally:
        stream.close()
    return measured


def part3(base: Path, sizes: list[int], nbytes: int, iters: int, threads: tuple[int, int]) -> list[dict]:
    """The tier against dd and fio on one file system; returns the rows (also printed as a markdown table)."""
    fio = shutil.which("fio") is not None
    load = os.getloadavg()[0]
    print(
        f"\nPart 3: streams of {nbytes // MiB} MiB, the disk tier against dd"
        + (" and fio" if fio else " (fio not installed)")
        + f" in {base}; median of {iters}; load average {load:.1f}"
    )
    rows = []
    for block in sizes:
        d = base / f"stream-{block}"
        d.mkdir()
        try:
            measured = measure_stream(d, block, nbytes, iters, fio, threads)
        finally:
            shutil.rmtree(d, ignore_errors=True)
        for op, m in measured.items():
            best = max(m[k] for k in ("dd", "fio") if m.get(k) is not None)
            rows.append({"block": block, "op": op, **m, "ratio": m["tier"] / best})
    print(f"| block | op | dd GB/s (min-max) | fio GB/s | disk tier GB/s | tier / best of dd, fio | load {load:.1f} |")
    print("|---:|---|---:|---:|---:|---:|---|")

    def cell(r: dict, k: str) -> str:
        if r[k] is None:
            return "-"
        lo, hi = r[f"{k}_range"]
        return f"{r[k]:.2f} ({lo:.2f}-{hi:.2f})"

    for r in rows:
        cells = [
            f"{r['block'] // MiB} MiB",
            r["op"],
            cell(r, "dd"),
            cell(r, "fio"),
            cell(r, "tier"),
            f"{r['ratio']:.2f}x",
        ]
        print("| " + " | ".join(cells) + " | |")
    faults = ", ".join(
        f"{r['tier_faults_per_mib']:.0f} ({r['block'] // MiB} MiB blocks, {r['op']})"
        for r in rows
        if "tier_faults_per_mib" in r
    )
    print(f"(minor page faults per MiB of the tier's warm reads: {faults}; dd and fio read into one buffer they reuse)")
    floors = ", ".join(
        f"{r['block'] // MiB} MiB {r['op']}: preadv into distinct memory {r['distinct']:.2f} GB/s, "
        f"tier / that {r['tier'] / r['distinct']:.2f}x"
        for r in rows
        if r.get("distinct")
    )
    print(f"(a floor that lands every block in a place of its own, as a cache must, unchecked: {floors})")
    print(f"(load average at the end {os.getloadavg()[0]:.1f})")
    return rows


loop = asyncio.new_event_loop()  # the tiers' event loop, in a thread of its own; the timing loop calls into it


def call(coro):
    return asyncio.run_coroutine_threadsafe(coro, loop).result()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dir", default="")
    parser.add_argument("--io-threads", type=int, default=8)
    parser.add_argument("--write-threads", type=int, default=2)
    parser.add_argument("--only-stream", action="store_true", help="run Part 3 alone (the tier against dd and fio)")
    parser.add_argument(
        "--stream-mib", type=int, default=0, help="bytes of each Part 3 stream, MiB (default 512; 128 with --quick)"
    )
    parser.add_argument("--stream-iters", type=int, default=5, help="Part 3 measurements per figure (default 5)")
    parser.add_argument("--json", metavar="PATH", help="write Part 3's rows as JSON to PATH")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="kvcache-bench-disk-", dir=args.dir or None))
    sizes = [16 * KiB, 256 * KiB] if args.quick else [16 * KiB, 256 * KiB, 2 * MiB]
    iters = 5 if args.quick else 15
    threading.Thread(target=loop.run_forever, daemon=True).start()
    try:
        if not args.only_stream:
            part1(base, sizes, iters, args.io_threads, args.write_threads)
            requests = 1500 if args.quick else 6000
            call(part2(base, requests, 16 * KiB))
        threads = (args.io_threads, args.write_threads)
        stream_mib = args.stream_mib or (128 if args.quick else 512)
        rows = part3(base, [MiB, 4 * MiB], stream_mib * MiB, args.stream_iters, threads)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))
    finally:
        loop.call_soon_threadsafe(loop.stop)
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
