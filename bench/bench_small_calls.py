"""What a small call costs the server: CPU per Lookup (1 and 128 keys) and per small Get, against a bare
grpc.aio server answering the same RPCs with nothing, measured in the same run.

    python bench/bench_small_calls.py                       # 3 rounds x 2,000 calls per shape
    python bench/bench_small_calls.py --before /tmp/old     # also the code tree at /tmp/old, interleaved

CPU time, not wall time: each server is its own process and the figure is its user + system CPU
(from /proc/PID/stat) over the calls, divided by their count, so a loaded machine inflates it far
less than it inflates latencies. The client is one blocking KVCacheClient in another process, one
call at a time; the wall time per call is printed beside it. The bare server is grpc.aio with the
generated KVCache servicer: Lookup answers an empty LookupResponse, Get ends its stream at once,
so its CPU is gRPC Python's own floor for a call of that shape.

Ratios are to the bare server of the same round (medians over rounds). Figures only: nothing here
is a pass/fail threshold.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ServerProcess, python_cmd

import kvcache_server

CODE_ROOT = Path(kvcache_server.__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")

BARE = r"""
import asyncio, sys
import grpc
from kvcache_proto import kvcache_pb2 as pb, kvcache_pb2_grpc as pb_grpc

class Bare(pb_grpc.KVCacheServicer):
    async def Lookup(self, request, context):
        return pb.LookupResponse()

    async def Get(self, request, context):
        return

async def main():
    server = grpc.aio.server()
    pb_grpc.add_KVCacheServicer_to_server(Bare(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"bare serving on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""

CLIENT = r"""
import sys, time
from kvcache_client import KVCacheClient
from kvcache_client.format import encode_block
target, shape, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
c = KVCacheClient(target, timeout_s=10, shm=False)
keys = [i.to_bytes(16, "big") for i in range(128)]
if shape == "get" and "bare" not in sys.argv[4:]:
    c.put_many("bench-small", [(keys[0], encode_block(b"x" * 16384, key=keys[0], dtype="uint8", shape=(16384,)))])
call = {
    "lookup1": lambda: c.lookup("bench-small", keys[:1]),
    "lookup128": lambda: c.lookup("bench-small", keys),
    "get": lambda: c.get_many("bench-small", keys[:1]),
}[shape]
for _ in range(50):
    call()
print("ready", flush=True)
sys.stdin.readline()
t0 = time.perf_counter()
for _ in range(n):
    call()
print((time.perf_counter() - t0) / n * 1e6, flush=True)
"""


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def start(root: Path, bare: bool) -> tuple[ServerProcess, str]:
    env_path = f"{root}/client:{root}:{root}/connectors"
    if bare:
        argv = [sys.executable, "-c", BARE]
        pattern = r"bare serving on [^\s:]+:(\d+)"
    else:
        argv = python_cmd(
            "-m", "kvcache_server", "--port", "0", "--ram-capacity", str(64 << 20),
            "--set", "ram.prefault=false", "--set", "bulk.enabled=false",
        )  # fmt: skip
        pattern = r"serving \S+ on [^\s:]+:(\d+)"
    proc = ServerProcess("bare" if bare else "kvcache", argv, cwd=str(root), env={**os.environ, "PYTHONPATH": env_path})
    port = proc.start(pattern, timeout_s=120)
    return proc, f"127.0.0.1:{port}"


def measure(server: ServerProcess, target: str, shape: str, n: int, root: Path, bare: bool) -> tuple[float, float]:
    """(server CPU us per call, client wall us per call)."""
    env = {**os.environ, "PYTHONPATH": f"{root}/client:{root}:{root}/connectors"}
    argv = [sys.executable, "-c", CLIENT, target, shape, str(n)] + (["bare"] if bare else [])
    client = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert client.stdin is not None and client.stdout is not None
    if client.stdout.readline().strip() != "ready":
        raise SystemExit("the client failed")
    pid = server.proc.pid  # type: ignore[union-attr]
    before = cpu_s(pid)
    client.stdin.write("\n")
    client.stdin.flush()
    wall_us = float(client.stdout.readline())
    used = cpu_s(pid) - before
    client.wait(30)
    return used / n * 1e6, wall_us


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--before", type=Path, help="another code tree (an older commit) measured interleaved")
    args = ap.parse_args()
    trees = {"kvcache": CODE_ROOT} | ({"kvcache before": args.before} if args.before else {})
    servers = {"bare gRPC": start(CODE_ROOT, bare=True)} | {
        name: start(root, bare=False) for name, root in trees.items()
    }
    try:
        for shape in ("lookup1", "lookup128", "get"):
            cpu: dict[str, list[float]] = {name: [] for name in servers}
            wall: dict[str, list[float]] = {name: [] for name in servers}
            for _ in range(args.rounds):
                for name, (proc, target) in servers.items():
                    root = trees.get(name, CODE_ROOT)
                    c, w = measure(proc, target, shape, args.calls, root, bare=name == "bare gRPC")
                    cpu[name].append(c)
                    wall[name].append(w)
            floor = statistics.median(cpu["bare gRPC"])
            print(f"\n{shape}: {args.rounds} rounds x {args.calls} calls, medians")
            print(f"{'server':<16} {'CPU us/call':>12} {'x bare':>7} {'wall us/call':>13}")
            for name in servers:
                c = statistics.median(cpu[name])
                print(f"{name:<16} {c:>12.0f} {c / floor:>6.2f}x {statistics.median(wall[name]):>13.0f}")
    finally:
        for proc, _ in servers.values():
            proc.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
