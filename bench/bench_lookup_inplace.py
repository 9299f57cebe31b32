"""1-key Lookup latency, idle and while a same-host client commits puts in place with write-behind below.

Run from the repository root with the project's virtualenv:

    python bench/bench_lookup_inplace.py              # ~60 s
    python bench/bench_lookup_inplace.py --windows 6 --window-seconds 5 --blocks 32 --block-mib 2 --json out.json

What it answers (issue #22, invariant 8): does a Lookup keep its latency while the server commits
same-host puts (the client's segment read into arena slots, verified there, indexed; RAM full, so
every put evicts and demotes) and a write-behind Redis tier drains them?

Started here on free ports and stopped at the end: redis-server (no persistence) and one
`python -m kvcache_server` (RAM --ram-mib, its arena shared in the default shm directory, Redis
write-behind). A writer in its own process loops put_many of --blocks fresh blocks of --block-mib
(the SDK's same-host path: in place); the Lookup client (vLLM's: 0.5 s, one attempt) asks for one
key held in RAM, back to back with a 2 ms pause, over the bulk port (LOOKUP frames, the SDK's default)
or, with --lookup-path grpc, over gRPC. The key is put retained, so that the writer's flood
never evicts it: a Lookup does not refresh a block's place in the LRU, and with --no-retain the key
is demoted within a few rounds and the busy Lookups measure Redis EXISTS calls instead ("not from
RAM" counts those).

Idle and busy windows alternate (--windows pairs of --window-seconds each), so that what else runs
on the machine weighs on both alike: in an idle window the writer is paused between rounds and the
write-behind queue has had a second to drain; in a busy one it writes. Reported: p50/p99/max of all
idle and all busy Lookups, p99 busy / p99 idle, the same ratio per window pair, the writer's rounds
and GB/s, and the bytes the server received in place (Stats), which must be the writer's bytes.

With --hog-seconds, a control phase before the writer starts: the same Lookups while --hogs processes only
spin (no server work, no copies), for what CPU contention alone does to the p99 on this machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
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
import time
target, blocks, size, pause = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
payload = os.urandom(size)
with KVCacheClient(target, timeout_s=120) as client:
    print("ready", flush=True)
    while True:
        if os.path.exists(pause):
            print("paused", flush=True)
            while os.path.exists(pause):
                time.sleep(0.01)
        items = []
        for _ in range(blocks):
            key = os.urandom(16)
            items.append((key, encode_block(payload, key=key, dtype="uint8", shape=(size,))))
        client.put_many("bench-writer", items)
        print(sum(len(b) for _, b in items), flush=True)
"""


def lookups(client: KVCacheClient, key: bytes, seconds: float) -> tuple[list[float], int, int]:
    """(latencies, failed calls, answers not from RAM) of back-to-back 1-key Lookups for `seconds`."""
    times: list[float] = []
    failed = not_ram = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        try:
            found = client.lookup(NAMESPACE, [key])
            times.append(time.perf_counter() - t0)
            if found.tiers != ("ram",):
                not_ram += 1
        except KVCacheError:
            failed += 1
        time.sleep(0.002)
    return times, failed, not_ram


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
            # Retained, so that the writer's flood never evicts it: the Lookups ask RAM alone (a Lookup does
            # not refresh a block's place in the LRU; without this the key is demoted to Redis within a few
            # rounds and the busy phase measures Redis EXISTS calls instead).
            block = encode_block(b"x" * 4096, key=key, dtype="uint8", shape=(4096,))
            admin.put_many(NAMESPACE, [(key, block)], retain_ttl_s=None if args.no_retain else 3600)
            before = admin.stats().shm_bytes_received
        with KVCacheClient(
            target,
            timeout_s=0.5,
            retry=RetryPolicy(max_attempts=1),
            shm=args.lookup_path == "presence",
            bulk=args.lookup_path != "grpc",
        ) as client:
            hogged: list[float] = []
            if args.hog_seconds > 0:
                before_hogs, _, _ = lookups(client, key, args.hog_seconds)
                hogs = [subprocess.Popen(python_cmd("-c", HOG)) for _ in range(args.hogs)]
                try:
                    hogged, _, _ = lookups(client, key, args.hog_seconds)
                finally:
                    for hog in hogs:
                        hog.kill()
                        hog.wait(10)
            size = args.block_mib * MiB - 4096
            pause = os.path.join(tempfile.mkdtemp(prefix="kvcache-bench-"), "pause")
            writer = subprocess.Popen(
                python_cmd("-c", WRITER, target, str(args.blocks), str(size), pause), stdout=subprocess.PIPE, text=True
            )
            moved = [0, 0]  # rounds, bytes
            ready, paused = threading.Event(), threading.Event()

            def read() -> None:
                assert writer.stdout is not None
                for line in writer.stdout:
                    if line.strip() == "ready":
                        ready.set()
                    elif line.strip() == "paused":
                        paused.set()
                    else:
                        moved[0] += 1
                        moved[1] += int(line)

            threading.Thread(target=read, daemon=True).start()
            idle: list[float] = []
            busy: list[float] = []
            pairs: list[float] = []
            idle_failed = busy_failed = idle_not_ram = busy_not_ram = 0
            rounds = nbytes = 0
            busy_s = 0.0
            try:
                assert ready.wait(60), "the writer did not start"
                time.sleep(1.0)
                for _ in range(args.windows):
                    paused.clear()
                    open(pause, "w").close()
                    assert paused.wait(120), "the writer did not pause"
                    time.sleep(1.0)  # the write-behind queue drains
                    times, failed, not_ram = lookups(client, key, args.window_seconds)
                    idle += times
                    idle_failed += failed
                    idle_not_ram += not_ram
                    window_idle_p99 = percentile(times, 99)
                    os.unlink(pause)
                    first = moved[0]
                    while moved[0] == first:  # one whole round first: RAM is full and evicting again
                        time.sleep(0.01)
                    start_rounds, start_bytes, t0 = moved[0], moved[1], time.monotonic()
                    times, failed, not_ram = lookups(client, key, args.window_seconds)
                    busy_s += time.monotonic() - t0
                    rounds += moved[0] - start_rounds
                    nbytes += moved[1] - start_bytes
                    busy += times
                    busy_failed += failed
                    busy_not_ram += not_ram
                    pairs.append(percentile(times, 99) / window_idle_p99)
            finally:
                writer.kill()
                writer.wait(10)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(pause)
                os.rmdir(os.path.dirname(pause))
            presence = client.presence
            counted = None if presence is None else presence.counters
            answered = (
                None if counted is None else {"local": counted.local, "partial": counted.partial, "rpc": counted.rpc}
            )
        with KVCacheClient(target, shm=False) as admin:
            stats = admin.stats()
        result = {
            "presence_answers": answered,
            "idle": {
                "p50_ms": percentile(idle, 50) * 1e3,
                "p99_ms": percentile(idle, 99) * 1e3,
                "failed": idle_failed,
                "not_ram": idle_not_ram,
            },
            "busy": {
                "p50_ms": percentile(busy, 50) * 1e3,
                "p99_ms": percentile(busy, 99) * 1e3,
                "max_ms": max(busy) * 1e3,
                "failed": busy_failed,
                "not_ram": busy_not_ram,
            },
            "p99_ratio": percentile(busy, 99) / percentile(idle, 99),
            "p99_ratio_per_window": pairs,
            "hogs": {
                "processes": args.hogs,
                "p99_ms": percentile(hogged, 99) * 1e3,
                "p99_ratio": percentile(hogged, 99) / percentile(before_hogs, 99),
            }
            if hogged
            else None,
            "writer_rounds": rounds,
            "writer_gb_s": nbytes / busy_s / 1e9,
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
    p.add_argument("--windows", type=int, default=4, help="pairs of idle and busy windows (default 4)")
    p.add_argument("--window-seconds", type=float, default=5.0, help="each window (default 5)")
    p.add_argument("--blocks", type=int, default=32, help="blocks per put (default 32)")
    p.add_argument("--block-mib", type=int, default=2, help="block size in MiB (default 2)")
    p.add_argument("--ram-mib", type=int, default=256, help="RAM tier (default 256 MiB)")
    p.add_argument("--hog-seconds", type=float, default=0.0, help="control phase with spinning processes (default off)")
    p.add_argument("--hogs", type=int, default=os.cpu_count() or 2, help="spinning processes (default: the CPUs)")
    p.add_argument(
        "--no-retain", action="store_true", help="put the looked-up key unretained (it is demoted: Lookups reach Redis)"
    )
    p.add_argument(
        "--lookup-path",
        choices=("bulk", "grpc", "presence"),
        default="bulk",
        help="where the Lookups go: the bulk port's LOOKUP frames (a remote client's default), gRPC (bulk=False), "
        "or a same-host client's default (shm=True): the tenant's presence index, docs/presence.md",
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = p.parse_args(argv)
    r = run(args)
    idle, busy = r["idle"], r["busy"]
    assert isinstance(idle, dict) and isinstance(busy, dict)
    shape = f"{args.blocks} x {args.block_mib} MiB in place, Redis write-behind, RAM {args.ram_mib} MiB"
    shape += (
        "; Lookups "
        + {
            "bulk": "over the bulk port",
            "grpc": "over gRPC",
            "presence": "from the presence index (same host)",
        }[args.lookup_path]
    )
    print(f"cpus {os.cpu_count()}; {shape}")
    print(f"idle  Lookup p50 {idle['p50_ms']:.2f} ms  p99 {idle['p99_ms']:.2f} ms  failed {idle['failed']}")
    print(
        f"busy  Lookup p50 {busy['p50_ms']:.2f} ms  p99 {busy['p99_ms']:.2f} ms  max {busy['max_ms']:.1f} ms  "
        f"failed {busy['failed']}  not from RAM {busy['not_ram']}  (p99 {r['p99_ratio']:.1f}x idle)"
    )
    ratios = r["p99_ratio_per_window"]
    assert isinstance(ratios, list)
    print("per window pair, p99 busy / p99 idle: " + ", ".join(f"{x:.1f}x" for x in ratios))
    hogs = r["hogs"]
    if isinstance(hogs, dict):
        print(
            f"hogs  Lookup p99 {hogs['p99_ms']:.2f} ms with {hogs['processes']} spinning processes "
            f"(p99 {hogs['p99_ratio']:.1f}x the same Lookups just before)"
        )
    answers = r["presence_answers"]
    if args.lookup_path == "presence" and isinstance(answers, dict):
        print(
            f"presence index answers: {answers['local']} local, {answers['partial']} partial, {answers['rpc']} by RPC"
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
