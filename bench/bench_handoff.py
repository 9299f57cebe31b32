"""Same-host clients of another Unix user: memfd segments handed over the segment socket, beside the
same-user arena path and the gRPC path such a client had before (docs/shm.md, "Clients of another user").

    sudo python bench/bench_handoff.py                    # 4 x 32 MiB and 16 x 2 MiB, 9 rounds
    sudo python bench/bench_handoff.py --rounds 15 --shapes 4x32

Runs as root (it creates the Unix user `kvcache-bench` and runs one client as that user with
setpriv); elsewhere it says so and exits. One kvcache server child (its shm directory and socket in
/dev/shm), three long-lived client children driven round by round, interleaved:

- same user, arena: put_many (the server reads the SDK's segment into slots), get_into (one copy out
  of leased slots, verified), get_many;
- another user, handed segments: put_many (the same read into slots, from a memfd), get_into and
  get_many (the server writes into the client's memfd, the SDK verifies there);
- same user, shm=False: gRPC, what a client of another user used before.

Medians over the rounds, GB/s of block payload, and ratios to memcpy, to the arena and to gRPC.
Figures only: nothing here is a pass/fail threshold.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import GB, MiB, ServerProcess, python_cmd

import kvcache_server

CODE_ROOT = Path(kvcache_server.__file__).resolve().parent.parent
USER = "kvcache-bench"

CHILD = r"""
import json, os, statistics, sys, time
import numpy as np
from kvcache_client import KVCacheClient
from kvcache_client.format import encode_block
args = json.loads(sys.argv[1])
rng = np.random.default_rng(7)
with KVCacheClient(args["target"], timeout_s=60, shm=args["shm"]) as c:
    shape = args["shape"]
    for line in sys.stdin:
        n, size = shape
        tag = line.strip()
        payloads = [rng.integers(0, 255, size, dtype=np.uint8) for _ in range(n)]
        keys = [f"{tag}-{i}".encode().ljust(16, b"\0") for i in range(n)]
        blocks = [(k, encode_block(p, key=k, dtype="uint8", shape=(size,))) for k, p in zip(keys, payloads)]
        t0 = time.perf_counter(); c.put_many("bench-handoff", blocks); put = time.perf_counter() - t0
        outs = [np.empty(size, dtype=np.uint8) for _ in range(n)]
        t0 = time.perf_counter(); found = c.get_into("bench-handoff", keys, outs); into = time.perf_counter() - t0
        assert all(found) and all(np.array_equal(a, b) for a, b in zip(outs, payloads))
        t0 = time.perf_counter(); got = c.get_many("bench-handoff", keys); many = time.perf_counter() - t0
        assert all(g is not None for g in got)
        del got
        link = c._transport.shm
        print(json.dumps({"put": put, "get_into": into, "get_many": many, "shm": link.state,
                          "arena": c._transport.arena.on, "fallbacks": link.fallbacks}), flush=True)
"""


def ensure_user() -> int:
    try:
        return pwd.getpwnam(USER).pw_uid
    except KeyError:
        subprocess.run(["useradd", "--system", "-M", "-s", "/usr/sbin/nologin", USER], check=True)
        return pwd.getpwnam(USER).pw_uid


def child(target: str, shape: tuple[int, int], *, shm: bool, uid: int | None) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=f"{CODE_ROOT}/client:{CODE_ROOT}:{CODE_ROOT}/connectors", HOME="/tmp")
    cmd = [sys.executable, "-c", CHILD, json.dumps({"target": target, "shape": shape, "shm": shm})]
    if uid is not None:
        cmd = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *cmd]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def round_of(proc: subprocess.Popen[str], tag: str) -> dict[str, float]:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(tag + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"a client child died (exit {proc.wait()})")
    return json.loads(line)


def memcpy_s(n: int, size: int) -> float:
    """One warm copy of the prompt (destinations touched first: no page faults timed)."""
    src = [np.ones(size, dtype=np.uint8) for _ in range(n)]
    dst = [np.zeros(size, dtype=np.uint8) for _ in range(n)]
    for d in dst:
        d[:] = 1
    t0 = time.perf_counter()
    for s, d in zip(src, dst, strict=True):
        np.copyto(d, s)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--shapes", default="4x32,16x2", help="chunks x MiB, comma-separated")
    args = ap.parse_args()
    if os.geteuid() != 0 or shutil.which("setpriv") is None or shutil.which("useradd") is None:
        print("bench_handoff: needs root, useradd and setpriv (it runs a client as another Unix user); skipped")
        return 0
    uid = ensure_user()
    place = Path(tempfile.mkdtemp(prefix="kvbench-", dir="/dev/shm"))
    place.chmod(0o755)
    argv = python_cmd(
        "-m", "kvcache_server", "--port", "0", "--ram-capacity", str(1 << 30),
        "--set", "limits.max_block_bytes=256MiB", "--set", "limits.inflight_bytes=2GiB",
        "--set", f"shm.dir={place / 'shm'}", "--set", f"shm.socket_path={place / 'seg.sock'}",
    )  # fmt: skip
    server = ServerProcess("kvcache-server", argv, cwd=str(CODE_ROOT))
    try:
        port = server.start(r"serving \S+ on [^\s:]+:(\d+)", timeout_s=120)
        target = f"127.0.0.1:{port}"
        for spec in args.shapes.split(","):
            n, mib = (int(x) for x in spec.split("x"))
            shape = (n, mib * MiB)
            paths = {
                "same user, arena": child(target, shape, shm=True, uid=None),
                "another user, handed segments": child(target, shape, shm=True, uid=uid),
                "gRPC (shm=False)": child(target, shape, shm=False, uid=None),
            }
            times: dict[str, dict[str, list[float]]] = {p: {"put": [], "get_into": [], "get_many": []} for p in paths}
            copies: list[float] = []
            states: dict[str, dict[str, object]] = {}
            for r in range(args.rounds + 1):  # round 0 warms up
                copies.append(memcpy_s(*shape))
                for name, proc in paths.items():
                    got = round_of(proc, f"{spec}-{r}-{len(states)}")
                    states[name] = {k: got[k] for k in ("shm", "arena", "fallbacks")}
                    if r:
                        for op in ("put", "get_into", "get_many"):
                            times[name][op].append(got[op])
            for proc in paths.values():
                if proc.stdin is not None:
                    proc.stdin.close()
                proc.wait(60)
            nbytes = n * mib * MiB
            floor = nbytes / statistics.median(copies[1:]) / GB
            print(f"\n{n} x {mib} MiB, {args.rounds} rounds (medians, GB/s); numpy memcpy {floor:.2f} GB/s")
            print(f"{'path':<32} {'put':>7} {'get_into':>9} {'get_many':>9}   state")
            rates = {p: {op: nbytes / statistics.median(ts) / GB for op, ts in ops.items()} for p, ops in times.items()}
            for name, r in rates.items():
                print(f"{name:<32} {r['put']:>7.2f} {r['get_into']:>9.2f} {r['get_many']:>9.2f}   {states[name]}")
            arena, handed, grpc_ = (rates[p] for p in paths)
            for op in ("put", "get_into", "get_many"):
                print(
                    f"  {op:<9} handed / arena {handed[op] / arena[op]:.2f}x,"
                    f" handed / gRPC {handed[op] / grpc_[op]:.2f}x, handed / memcpy {handed[op] / floor:.2f}x"
                )
    finally:
        server.stop()
        shutil.rmtree(place, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
