"""1-key Lookup latency, idle and while a same-host client commits puts in place with write-behind below.

Run from the repository root with the project's virtualenv:

    python bench/bench_lookup_inplace.py              # ~40 s
    python bench/bench_lookup_inplace.py --seconds 30 --blocks 32 --block-mib 2 --json out.json

What it answers (issue #22, invariant 8): does a Lookup keep its latency while the server commits
same-host puts (the client's segment read into arena slots, verified there, indexed; RAM full, so
every put evicts and demotes) and a write-behind Redis tier drains them?

Started here on free ports and stopped at the end: redis-server (no persistence) and one
`python -m kvcache_server` (RAM --ram-mib, its arena shared in the default shm directory, Redis
write-behind). A writer in its own process loops put_many of --blocks fresh blocks of --block-mib
(the SDK's same-host path: in place); the Lookup client (vLLM's: 0.5 s, one attempt) asks for one
key held in RAM, back to back with a 2 ms pause, idle for --idle-seconds, then under the writer for
--seconds. Reported: p50/p99/max of each phase, p99 busy / p99 idle, the writer's rounds and GB/s,
and the bytes the server received in place (Stats), which must be the writer's bytes.

With --hog-seconds, a control phase between the two: the same Lookups while --hogs processes only
spin (no server work, no copies), for what CPU contention alone does to the p99 on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from _common import MiB, ServerProcess, exit_on_sigterm, python_cmd
from bench_tiers import find_binary, percentile, start_redis

from kvcache_client import KVCacheClient, KVCacheError, RetryPolicy
from kvcache_core.format import encode_block

NAMESPACE = "bench-lookup-inplace"
HOG = "while True: pass"
WRITER = r"""
import os, sys
from kvcache_client import KVCacheClient
from kvcache_core.format import encode_block
target, blocks, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
payload = os.urandom(size)
with KVCacheClient(target, timeout_s=120) as client:
    print("ready", flush=True)
    while True:
        items = []
        for _ in range(blocks):
            key = os.urandom(16)
            items.append((key, encode_block(payload, key=key, dtype="uint8", shape=(size,))))
        client.put_many("bench-writer", items)
        print(sum(len(b) for _, b in items), flush=True)
"""


def lookups(client: KVCacheClient, key: bytes, seconds: float) -> tuple[list[float], int]:
    times: list[float] = []
    failed = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        try:
            client.lookup(NAMESPACE, [key])
            times.append(time.perf_counter() - t0)
        except KVCacheError:
            failed += 1
        time.sleep(0.002)
    return times, failed


def run(args: argparse.Namespace) -> dict[str, object]:
    servers: list[ServerProcess] = []
    try:
        redis_port, _ = start_redis(find_binary("redis-server"), servers)
        argv = python_cmd(
            "-m", "kvcache_server", "--port", "0", "--log-level", "warning", "--ram-capacity", f"{args.ram_mib}MiB",
            "--set", "redis.enabled=true", "--set", f"redis.url=redis://127.0.0.1:{redis_port}/0",
            "--set", "redis.write_mode=behind",
        )  # fmt: skip
        server = ServerProcess("kvcache", argv)
        servers.append(server)
        port = server.start(r" on \S+:(\d+)")
        target = f"127.0.0.1:{port}"
        key = os.urandom(16)
        with KVCacheClient(target, shm=False) as admin:
            admin.put_many(NAMESPACE, [(key, encode_block(b"x" * 4096, key=key, dtype="uint8", shape=(4096,)))])
            before = admin.stats().shm_bytes_received
        with KVCacheClient(target, timeout_s=0.5, retry=RetryPolicy(max_attempts=1), shm=False) as client:
            idle, idle_failed = lookups(client, key, args.idle_seconds)
            hogged: list[float] = []
            if args.hog_seconds > 0:
                hogs = [subprocess.Popen(python_cmd("-c", HOG)) for _ in range(args.hogs)]
                try:
                    hogged, _ = lookups(client, key, args.hog_seconds)
                finally:
                    for hog in hogs:
                        hog.kill()
                        hog.wait(10)
            size = args.block_mib * MiB - 4096
            writer = subprocess.Popen(
                python_cmd("-c", WRITER, target, str(args.blocks), str(size)), stdout=subprocess.PIPE, text=True
            )
            moved = [0, 0]  # rounds, bytes
            ready = threading.Event()

            def read() -> None:
                assert writer.stdout is not None
                for line in writer.stdout:
                    if line.strip() == "ready":
                        ready.set()
                    else:
                        moved[0] += 1
                        moved[1] += int(line)

            threading.Thread(target=read, daemon=True).start()
            try:
                assert ready.wait(60), "the writer did not start"
                time.sleep(1.0)
                start_rounds, start_bytes, t0 = moved[0], moved[1], time.monotonic()
                busy, busy_failed = lookups(client, key, args.seconds)
                elapsed = time.monotonic() - t0
                rounds, nbytes = moved[0] - start_rounds, moved[1] - start_bytes
            finally:
                writer.kill()
                writer.wait(10)
        with KVCacheClient(target, shm=False) as admin:
            stats = admin.stats()
        result = {
            "idle": {"p50_ms": percentile(idle, 50) * 1e3, "p99_ms": percentile(idle, 99) * 1e3, "failed": idle_failed},
            "busy": {
                "p50_ms": percentile(busy, 50) * 1e3,
                "p99_ms": percentile(busy, 99) * 1e3,
                "max_ms": max(busy) * 1e3,
                "failed": busy_failed,
            },
            "p99_ratio": percentile(busy, 99) / percentile(idle, 99),
            "hogs": {
                "processes": args.hogs,
                "p99_ms": percentile(hogged, 99) * 1e3,
                "p99_ratio": percentile(hogged, 99) / percentile(idle, 99),
            }
            if hogged
            else None,
            "writer_rounds": rounds,
            "writer_gb_s": nbytes / elapsed / 1e9,
            "in_place_mib": (stats.shm_bytes_received - before) // MiB,
            "ram_evictions": stats.tier("ram").evictions,
        }
        return result
    finally:
        for proc in reversed(servers):
            proc.stop()


def main(argv: Sequence[str] | None = None) -> int:
    exit_on_sigterm()
    p = argparse.ArgumentParser(description="1-key Lookup latency under same-host in-place puts (see docstring).")
    p.add_argument("--seconds", type=float, default=20.0, help="busy phase (default 20)")
    p.add_argument("--idle-seconds", type=float, default=5.0, help="idle phase (default 5)")
    p.add_argument("--blocks", type=int, default=32, help="blocks per put (default 32)")
    p.add_argument("--block-mib", type=int, default=2, help="block size in MiB (default 2)")
    p.add_argument("--ram-mib", type=int, default=256, help="RAM tier (default 256 MiB)")
    p.add_argument("--hog-seconds", type=float, default=0.0, help="control phase with spinning processes (default off)")
    p.add_argument("--hogs", type=int, default=os.cpu_count() or 2, help="spinning processes (default: the CPUs)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = p.parse_args(argv)
    r = run(args)
    idle, busy = r["idle"], r["busy"]
    assert isinstance(idle, dict) and isinstance(busy, dict)
    shape = f"{args.blocks} x {args.block_mib} MiB in place, Redis write-behind, RAM {args.ram_mib} MiB"
    print(f"cpus {os.cpu_count()}; {shape}")
    print(f"idle  Lookup p50 {idle['p50_ms']:.2f} ms  p99 {idle['p99_ms']:.2f} ms  failed {idle['failed']}")
    print(
        f"busy  Lookup p50 {busy['p50_ms']:.2f} ms  p99 {busy['p99_ms']:.2f} ms  max {busy['max_ms']:.1f} ms  "
        f"failed {busy['failed']}  (p99 {r['p99_ratio']:.1f}x idle)"
    )
    hogs = r["hogs"]
    if isinstance(hogs, dict):
        print(
            f"hogs  Lookup p99 {hogs['p99_ms']:.2f} ms with {hogs['processes']} spinning processes "
            f"(p99 {hogs['p99_ratio']:.1f}x idle)"
        )
    print(
        f"writer {r['writer_rounds']} rounds, {r['writer_gb_s']:.2f} GB/s; in place {r['in_place_mib']} MiB; "
        f"RAM evictions {r['ram_evictions']}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
