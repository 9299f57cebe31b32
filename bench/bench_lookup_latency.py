"""1-key Lookup latency of a kvcache server, idle and while another client streams 32 MiB blocks.

Run from the repository root with the project's virtualenv:

    python bench/bench_lookup_latency.py                # full run (~1.5 minutes)
    python bench/bench_lookup_latency.py --quick        # smoke run (< 40 s)
    python bench/bench_lookup_latency.py --no-s3 --seconds 30 --json out.json

What it answers: does a Lookup stay inside vLLM's budget (0.5 s, one attempt; vLLM's breaker opens
after one failure) while the server moves big blocks? Lookups wait for the server's event loop, so
anything that holds the loop (compression, checksums, copies of block bytes) shows up here.

Backends, started here on free ports and stopped at the end: redis-server (no persistence) and,
unless --no-s3, moto_server (moto's S3 API over HTTP, credentials "testing").

kvcache servers (`python -m kvcache_server`, one per compression setting, both alive during the run):
RAM 16 MiB (smaller than a block: the 32 MiB blocks live only in the lower tiers), Redis write-through,
S3 write-behind (unless --no-s3), each lower tier with the compression of the scenario ("none", then
"shuffle-lz4").

For each server:
    idle        1-key Lookups back to back, for --idle-seconds.
    streaming   the same, for --seconds, while a client in another process loops: put_many of --blocks
                blocks of 32 MiB (bf16-like payload, which shuffle-lz4 shrinks to ~85%), get_many of them
                (from Redis: decompressed and verified by the server), the same after deleting their Redis
                copies (from S3, where the write-behind got there first; skipped with --no-s3), delete.
The Lookup key's block is written straight into Redis, so every Lookup misses RAM and asks Redis (one
EXISTS round trip through the server's event loop). The Lookup client is vLLM's: timeout 0.5 s, one
attempt; a Lookup that fails counts in "failed" and not in the percentiles; one that answers without the
key (Redis did not answer within redis.lookup_timeout_s, so the server counted it a miss) in "missed".

Reported per server and phase: Lookups, p50, p99 and max (linear interpolation), failed, and p50/p99
as ratios to the same server's idle figures (1.00x = as fast as idle), plus the streamer's rounds and
block throughput. The machine is shared with the backends and the streaming client: on a small
machine the streaming phase also measures CPU contention, not only the server.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import redis
from _common import MiB, ServerProcess, exit_on_sigterm, python_cmd
from bench_tiers import find_binary, percentile, render_table, start_kvcaches, start_moto, start_redis

from kvcache_client import KVCacheClient, KVCacheError, RetryPolicy
from kvcache_core.format import encode_block

NAMESPACE = "bench-lookup"
STREAM_NAMESPACE = "bench-stream"
BUCKET = "kvbench"
BLOCK_BYTES = 32 * MiB
DEADLINE_S = 0.5  # vLLM's Lookup budget
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
COMPRESSIONS = ("none", "shuffle-lz4")

STREAMER = r"""
import os, sys
import numpy as np
import redis
from kvcache_client import KVCacheClient
from kvcache_core.format import encode_block

target, redis_url, ns, per, s3 = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] == "1"
n = 16 << 20  # bf16 elements: 32 MiB
rng = np.random.default_rng()
payload = ((rng.standard_normal(n, dtype=np.float32) * 0.1).view(np.uint32) >> 16).astype(np.uint16)
r = redis.Redis.from_url(redis_url)
with KVCacheClient(target, timeout_s=300) as client:
    print("ready", flush=True)
    while True:
        items = []
        for _ in range(per):
            key = os.urandom(16)
            payload[:8] = rng.integers(0, 1 << 16, 8)
            items.append((key, encode_block(payload.tobytes(), key=key, dtype="bfloat16", shape=(n,))))
        keys = [k for k, _ in items]
        client.put_many(ns, items)
        moved = per * (len(items[0][1]) * 2)
        client.get_many(ns, keys)
        if s3:
            r.delete(*[f"kvcache/{ns}/{k.hex()}" for k in keys])
            moved += sum(len(b) for b in client.get_many(ns, keys) if b is not None)
        client.delete(ns, keys)
        print(moved, flush=True)
"""


@dataclass
class Phase:
    server: str
    phase: str
    times_s: list[float] = field(default_factory=list)
    failed: int = 0  # the RPC failed (deadline exceeded)
    missed: int = 0  # answered, without the key: Redis did not answer within redis.lookup_timeout_s
    rounds: int = 0
    moved_bytes: int = 0
    seconds: float = 0.0

    def p(self, q: float) -> float:
        return percentile(self.times_s, q) if self.times_s else float("nan")


class Streamer:
    """The streaming client in its own process; counts its finished rounds and the bytes they moved."""

    def __init__(self, target: str, redis_url: str, blocks: int, s3: bool, env: dict[str, str]) -> None:
        argv = python_cmd("-c", STREAMER, target, redis_url, STREAM_NAMESPACE, str(blocks), "1" if s3 else "0")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.rounds = 0
        self.moved = 0
        self.ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.strip() == "ready":
                self.ready.set()
            else:
                self.rounds += 1
                self.moved += int(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def failure(self) -> str | None:
        """Why the streamer stopped on its own, if it did."""
        if self.proc.poll() is None or self.proc.returncode == -9:
            return None
        assert self.proc.stderr is not None
        return f"streaming client exited with {self.proc.returncode}: {self.proc.stderr.read()[-2000:]}"


def lookups(client: KVCacheClient, key: bytes, seconds: float, into: Phase) -> None:
    """1-key Lookups back to back for `seconds`."""
    end = time.monotonic() + seconds
    start = time.monotonic()
    while time.monotonic() < end:
        t0 = time.perf_counter()
        try:
            found = client.lookup(NAMESPACE, [key])
        except KVCacheError:
            into.failed += 1
            continue
        into.times_s.append(time.perf_counter() - t0)
        into.missed += found.prefix_length != 1
    into.seconds = time.monotonic() - start


def run_server(
    name: str, port: int, redis_url: str, rclient: redis.Redis, args: argparse.Namespace, env: dict[str, str]
) -> list[Phase]:
    target = f"127.0.0.1:{port}"
    key = os.urandom(16)
    # Only in Redis: every Lookup asks the Redis tier.
    rclient.set(f"kvcache/{NAMESPACE}/{key.hex()}", encode_block(key * 64, key=key, dtype="uint8", shape=(1024,)))
    idle, busy = Phase(name, "idle"), Phase(name, "streaming")
    with KVCacheClient(target, timeout_s=DEADLINE_S, retry=RetryPolicy(max_attempts=1)) as client:
        lookups(client, key, 0.5, Phase(name, "warm-up"))
        lookups(client, key, args.idle_seconds, idle)
        streamer = Streamer(target, redis_url, args.blocks, not args.no_s3, env)
        try:
            if not streamer.ready.wait(60):
                raise RuntimeError(f"{name}: the streaming client did not start{streamer.failure() or ''}")
            lookups(client, key, args.seconds, busy)
            busy.rounds, busy.moved_bytes = streamer.rounds, streamer.moved
            problem = streamer.failure()
        finally:
            streamer.stop()
    if problem:
        raise RuntimeError(f"{name}: {problem}")
    for phase in (idle, busy):
        print(
            f"  {name:<12} {phase.phase:<10} {len(phase.times_s):6d} lookups  p50 {phase.p(50) * 1e3:7.2f} ms"
            f"  p99 {phase.p(99) * 1e3:7.2f} ms  failed {phase.failed}  missed {phase.missed}",
            flush=True,
        )
    return [idle, busy]


def report(phases: Sequence[Phase]) -> str:
    idle = {p.server: p for p in phases if p.phase == "idle"}
    rows = []
    for p in phases:
        base = idle[p.server]
        stream = f"{p.rounds} rounds, {p.moved_bytes / p.seconds / 1e6:,.0f} MB/s" if p.phase == "streaming" else "-"
        rows.append(
            [
                p.server,
                p.phase,
                str(len(p.times_s)),
                f"{p.p(50) * 1e3:.2f}",
                f"{p.p(99) * 1e3:.2f}",
                f"{max(p.times_s, default=float('nan')) * 1e3:.2f}",
                str(p.failed),
                str(p.missed),
                f"{p.p(50) / base.p(50):.2f}x",
                f"{p.p(99) / base.p(99):.2f}x",
                stream,
            ]
        )
    headers = ["compression", "phase", "lookups", "p50 ms", "p99 ms", "max ms", "failed", "missed", "p50/idle"]
    headers.append("p99/idle")
    return render_table([*headers, "streaming client"], rows)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="1-key Lookup latency, idle and under 32 MiB streaming (see docstring).")
    p.add_argument("--quick", action="store_true", help="smoke run: short phases (< 40 s)")
    p.add_argument("--seconds", type=float, help="streaming phase per server (default 20, quick 5)")
    p.add_argument("--idle-seconds", type=float, help="idle phase per server (default 5, quick 2)")
    p.add_argument("--blocks", type=int, default=4, help="32 MiB blocks per put and get (default 4)")
    p.add_argument("--no-s3", action="store_true", help="no S3 tier (and no moto_server)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument("--redis-server", default="redis-server", help="redis-server executable")
    p.add_argument("--moto-server", default="moto_server", help="moto_server executable")
    args = p.parse_args(argv)
    args.seconds = args.seconds or (5.0 if args.quick else 20.0)
    args.idle_seconds = args.idle_seconds or (2.0 if args.quick else 5.0)
    if args.blocks < 1:
        p.error("--blocks must be >= 1")
    return args


def run(args: argparse.Namespace) -> int:
    t_start = time.monotonic()
    print("kvcache Lookup latency under streaming" + (" (--quick)" if args.quick else ""))
    print(
        f"  {os.cpu_count()} CPUs; Lookups: 1 key, deadline {DEADLINE_S} s, one attempt; streaming: "
        f"{args.blocks} x {BLOCK_BYTES // MiB} MiB per put and get, {'Redis' if args.no_s3 else 'Redis and S3'}"
    )
    env = {**os.environ, **S3_ENV}
    servers: list[ServerProcess] = []
    closers: list[Callable[[], object]] = []
    phases: list[Phase] = []
    try:
        redis_port, rclient = start_redis(find_binary(args.redis_server), servers)
        closers.append(rclient.close)
        redis_url = f"redis://127.0.0.1:{redis_port}/0"
        print(f"  started redis-server on 127.0.0.1:{redis_port}")
        sets = {}
        endpoint = "" if args.no_s3 else start_moto(find_binary(args.moto_server), servers, env)
        for compression in COMPRESSIONS:
            s = ["ram.capacity_bytes=16MiB", "redis.enabled=true", f"redis.url={redis_url}", "redis.timeout_s=30"]
            s.append(f"redis.compression={compression}")
            if endpoint:
                s += [
                    "s3.enabled=true",
                    f"s3.bucket={BUCKET}",
                    f"s3.endpoint_url={endpoint}",
                    "s3.path_style=true",
                    "s3.create_bucket=true",
                    "s3.write_mode=behind",
                    "s3.timeout_s=30",
                    f"s3.compression={compression}",
                ]
            sets[compression] = s
        ports = start_kvcaches(sets, servers, env)
        for compression in COMPRESSIONS:
            phases += run_server(compression, ports[compression], redis_url, rclient, args, env)
            rclient.flushall()
        for proc in servers:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited during the run{proc.stderr_tail()}")
    finally:
        for close in reversed(closers):
            try:
                close()
            except Exception as exc:  # cleanup must go on
                print(f"warning: close failed: {exc}", file=sys.stderr)
        for proc in reversed(servers):
            proc.stop()
    print()
    print(report(phases))
    failed, missed = sum(p.failed for p in phases), sum(p.missed for p in phases)
    print(f"\n{failed} Lookups failed (deadline {DEADLINE_S} s); {missed} answered without the key (Redis late)")
    print(f"total run time {time.monotonic() - t_start:.1f} s")
    if args.json:
        doc = [
            {
                "compression": p.server,
                "phase": p.phase,
                "lookups": len(p.times_s),
                "p50_s": p.p(50),
                "p99_s": p.p(99),
                "max_s": max(p.times_s, default=None),
                "median_s": statistics.median(p.times_s) if p.times_s else None,
                "failed": p.failed,
                "missed": p.missed,
                "streaming_rounds": p.rounds,
                "streaming_bytes": p.moved_bytes,
                "seconds": p.seconds,
            }
            for p in phases
        ]
        Path(args.json).write_text(json.dumps(doc, indent=2))
        print(f"wrote {args.json}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    exit_on_sigterm()
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
