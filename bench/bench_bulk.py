"""The bulk path (docs/bulk.md) against a raw loopback socket, bare gRPC and the SDK over gRPC.

Run from the repository root with the project's virtualenv:

    python bench/bench_bulk.py                  # 4 x 32 MiB blocks per call, 15 rounds
    python bench/bench_bulk.py --quick          # smoke run
    python bench/bench_bulk.py --blocks 64 --block-mib 0.25

Every system moves the same payload per call (`--blocks` blocks of `--block-mib` MiB, each with its
own random key), every server in its own process, every client synchronous, as a remote client
(`shm=False`: nothing through shared memory):

    raw socket    this script's --raw-server child: one plain TCP connection, the client sends an
                  8-byte length and each block with sendall; the server recv_into's a fresh
                  uninitialised buffer per block (numpy.empty, as the kvcache server's bulk path)
                  and keeps it, one byte of acknowledgement per call; get sends them back the same
                  way, into fresh buffers. No framing, no checksums, no thread hop: the floor for a
                  Python client and server.
    bare gRPC     bench/echo_server.py with identity serializers, blocks as 1 MiB messages prebuilt
                  outside the timed region (the fastest way gRPC Python moves them).
    SDK gRPC      KVCacheClient(bulk=False, shm=False) against `python -m kvcache_server`.
    SDK bulk xN   KVCacheClient(shm=False, bulk_connections=N) against the same server: block bytes
                  on the bulk port, striped over N connections. Put includes the server's checksum
                  verification, get the SDK's.

Rounds are interleaved (rotating order); each round times --iters calls per system and op; the
table shows payload bytes / median call time (GB/s = 10^9 B/s) and ratios to the raw socket.

Then the concurrency sweep (--sweep, default 1, 4 and 16 client processes): every process puts and
gets its own --sweep-blocks x --sweep-block-mib blocks --sweep-iters times once all are ready, once
with bulk=False and once over the bulk path; the table shows the aggregate GB/s (put and get bytes
of all processes over the wall time from the first start to the last end) and the p99 call latency.
The server runs with limits.inflight_bytes=1GiB and admission_wait_s=30 so that 16 clients queue
instead of being refused.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import socket
import statistics
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from _common import GB, MiB, ServerProcess, exit_on_sigterm, python_cmd

from kvcache_client import KVCacheClient
from kvcache_client.messages import channel_options
from kvcache_core.format import encode_block

REPO = Path(__file__).resolve().parent.parent
_LEN = struct.Struct("<Q")


# -- the raw socket baseline -------------------------------------------------------------------


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed")
        got += n


def raw_server() -> None:
    """One connection at a time: b"P" + count + (length, bytes)* stores; b"G" sends them back."""
    listener = socket.create_server(("127.0.0.1", 0))
    print(f"raw-server serving on 127.0.0.1:{listener.getsockname()[1]}", flush=True)
    stored: list[np.ndarray] = []
    head = bytearray(9)
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            try:
                while True:
                    _recv_exact(conn, memoryview(head))
                    op, count = head[:1], _LEN.unpack_from(head, 1)[0]
                    if op == b"P":
                        stored = []
                        for _ in range(count):
                            _recv_exact(conn, memoryview(head)[:8])
                            buf = np.empty(_LEN.unpack_from(head)[0], np.uint8)
                            _recv_exact(conn, memoryview(buf))
                            stored.append(buf)
                        conn.sendall(b"k")
                    else:
                        for buf in stored:
                            conn.sendall(_LEN.pack(len(buf)))
                            conn.sendall(buf)
            except ConnectionError:
                continue


class RawSocket:
    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def put(self, blocks: list[bytes]) -> None:
        self.sock.sendall(b"P" + _LEN.pack(len(blocks)))
        for b in blocks:
            self.sock.sendall(_LEN.pack(len(b)))
            self.sock.sendall(b)
        _recv_exact(self.sock, memoryview(bytearray(1)))

    def get(self, n: int) -> list[np.ndarray]:
        self.sock.sendall(b"G" + _LEN.pack(n))
        out = []
        head = bytearray(8)
        for _ in range(n):
            _recv_exact(self.sock, memoryview(head))
            buf = np.empty(_LEN.unpack(head)[0], np.uint8)
            _recv_exact(self.sock, memoryview(buf))
            out.append(buf)
        return out


# -- the concurrency sweep ---------------------------------------------------------------------


def sweep_client(target: str, bulk: bool, blocks: int, block_bytes: int, iters: int, barrier: Any, out: Any) -> None:
    """One client process: its own blocks, a warm-up, then `iters` put+get pairs once all are ready."""
    with KVCacheClient(target, shm=False, bulk=bulk, timeout_s=120) as client:
        items = []
        for _ in range(blocks):
            key = os.urandom(16)
            items.append((key, encode_block(os.urandom(block_bytes), key=key, dtype="uint8", shape=(block_bytes,))))
        keys = [k for k, _ in items]
        client.put_many("bench-sweep", items)
        client.get_many("bench-sweep", keys)
        barrier.wait()
        puts, gets = [], []
        start = time.monotonic()
        for _ in range(iters):
            t0 = time.monotonic()
            client.put_many("bench-sweep", items)
            t1 = time.monotonic()
            if any(g is None for g in client.get_many("bench-sweep", keys)):
                raise RuntimeError("a block went missing")
            puts.append(t1 - t0)
            gets.append(time.monotonic() - t1)
        assert client.bulk is not None
        over_grpc = client.bulk.counters.grpc_bytes_sent + client.bulk.counters.grpc_bytes_received
        out.put((start, time.monotonic(), puts, gets, 2 * iters * sum(len(b) for _, b in items), over_grpc))


def _p99_ms(times: list[float]) -> float:
    ordered = sorted(times)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)] * 1e3


def sweep(target: str, counts: list[int], blocks: int, block_bytes: int, iters: int) -> None:
    """Aggregate GB/s (put+get bytes over the wall time of all clients) and p99 call latency, per path."""
    ctx = multiprocessing.get_context("spawn")
    print(f"\nconcurrency sweep: each client process {blocks} x {block_bytes / MiB:g} MiB, {iters} put+get pairs")
    print("\n| clients | path | aggregate GB/s | put p99 ms | get p99 ms |\n|---:|---|---:|---:|---:|")
    for n in counts:
        for label, bulk in (("SDK gRPC", False), ("SDK bulk", True)):
            barrier, out = ctx.Barrier(n), ctx.Queue()
            args = (target, bulk, blocks, block_bytes, iters, barrier, out)
            procs = [ctx.Process(target=sweep_client, args=args) for _ in range(n)]
            for p in procs:
                p.start()
            results = [out.get(timeout=600) for _ in procs]
            for p in procs:
                p.join(60)
                if p.exitcode != 0:
                    raise RuntimeError(f"a sweep client failed (exit {p.exitcode})")
            if bulk and any(r[5] for r in results):
                raise RuntimeError("bulk sweep clients moved bytes over gRPC")
            wall = max(r[1] for r in results) - min(r[0] for r in results)
            rate = sum(r[4] for r in results) / wall / GB
            puts = [t for r in results for t in r[2]]
            gets = [t for r in results for t in r[3]]
            print(f"| {n} | {label} | {rate:.2f} | {_p99_ms(puts):.0f} | {_p99_ms(gets):.0f} |")


# -- runs --------------------------------------------------------------------------------------


def start(name: str, argv: list[str], pattern: str, env: dict[str, str] | None = None) -> tuple[ServerProcess, int]:
    proc = ServerProcess(name, argv, cwd=str(REPO), env=env)
    port = proc.start(pattern)
    assert port is not None
    return proc, port


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--raw-server", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--block-mib", type=float, default=32.0)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--iters", type=int, default=2, help="timed calls per system, op and round")
    parser.add_argument("--connections", default="1,2,4", help="bulk connection counts to measure")
    parser.add_argument("--quick", action="store_true", help="3 rounds of 1 call, sweep of 1 and 4 clients")
    parser.add_argument("--sweep", default="1,4,16", help="client process counts of the concurrency sweep; '' skips it")
    parser.add_argument("--sweep-blocks", type=int, default=4)
    parser.add_argument("--sweep-block-mib", type=float, default=4.0)
    parser.add_argument("--sweep-iters", type=int, default=3)
    args = parser.parse_args(argv)
    if args.raw_server:
        raw_server()
        return 0
    if args.quick:
        args.rounds, args.iters, args.sweep = 3, 1, "1,4"
    exit_on_sigterm()
    block_bytes = int(args.block_mib * MiB)
    keys = [os.urandom(16) for _ in range(args.blocks)]
    payloads = [os.urandom(block_bytes) for _ in range(args.blocks)]
    blocks = [encode_block(p, key=k, dtype="uint8", shape=(len(p),)) for k, p in zip(keys, payloads, strict=True)]
    nbytes = sum(len(b) for b in blocks)
    messages = [b[i : i + MiB] for b in blocks for i in range(0, len(b), MiB)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "client"), str(REPO / "connectors")])}
    servers: list[ServerProcess] = []
    try:
        raw_proc, raw_port = start("raw-server", python_cmd(__file__, "--raw-server"), r":(\d+)$", env)
        servers.append(raw_proc)
        echo_proc, echo_port = start(
            "echo-server",
            python_cmd(str(REPO / "bench" / "echo_server.py"), "--port", "0", "--max-message-bytes", str(256 * MiB)),
            r"serving on [^\s:]+:(\d+)",
            env,
        )
        servers.append(echo_proc)
        kv_argv = python_cmd(
            "-m",
            "kvcache_server",
            "--port",
            "0",
            "--ram-capacity",
            "4GiB",
            "--max-block-bytes",
            "64MiB",
            "--set",
            "limits.inflight_bytes=1GiB",
            "--set",
            "limits.admission_wait_s=30",
        )
        kv_proc, kv_port = start(
            "kvcache-server", kv_argv, r"serving \S+ on [^\s:]+:(\d+)", {**env, "KVCACHE_SHM_ENABLED": "0"}
        )
        servers.append(kv_proc)
        target = f"127.0.0.1:{kv_port}"

        raw = RawSocket(raw_port)
        channel = grpc.insecure_channel(f"127.0.0.1:{echo_port}", options=channel_options(256 * MiB))
        echo_put, echo_get = channel.stream_unary("/echo.Raw/Put"), channel.unary_stream("/echo.Raw/Get")
        meta = (("slot", "bench-bulk"),)
        sdk_grpc = KVCacheClient(target, shm=False, bulk=False, timeout_s=120)
        bulk_clients = {
            int(n): KVCacheClient(target, shm=False, bulk_connections=int(n), timeout_s=120)
            for n in args.connections.split(",")
        }
        items = list(zip(keys, blocks, strict=True))

        def sdk_ops(client: KVCacheClient) -> tuple[Callable[[], object], Callable[[], object]]:
            def get() -> None:
                got = client.get_many("bench-bulk", keys)
                if any(g is None for g in got):
                    raise RuntimeError("a block went missing")

            return (lambda: client.put_many("bench-bulk", items)), get

        systems: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
            "raw socket": (lambda: raw.put(blocks), lambda: raw.get(len(blocks))),
            "bare gRPC": (
                lambda: echo_put(iter(messages), metadata=meta, timeout=120),
                lambda: list(echo_get(b"bench-bulk", timeout=120)),
            ),
            "SDK gRPC": sdk_ops(sdk_grpc),
            **{f"SDK bulk x{n}": sdk_ops(c) for n, c in bulk_clients.items()},
        }
        # Correctness first: byte-exact round trips, and the bulk clients really used the bulk path.
        for put, get in systems.values():
            put()
            get()
        assert [b.tobytes() for b in raw.get(len(blocks))] == blocks
        for n, c in bulk_clients.items():
            assert [bytes(g) for g in c.get_many("bench-bulk", keys)] == blocks
            assert c.bulk is not None and c.bulk.state == "on", (n, c.bulk and c.bulk.reason)
        times: dict[tuple[str, str], list[float]] = {}
        names = list(systems)
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                for op, fn in zip(("put", "get"), systems[name], strict=True):
                    for _ in range(args.iters):
                        t0 = time.perf_counter()
                        fn()
                        times.setdefault((name, op), []).append(time.perf_counter() - t0)
        for n, c in bulk_clients.items():
            moved = c.bulk.counters  # type: ignore[union-attr]
            if moved.grpc_bytes_sent or moved.grpc_bytes_received or moved.fallbacks:
                raise RuntimeError(f"SDK bulk x{n} moved bytes over gRPC: {moved}")
        stats = sdk_grpc.stats()
        print(
            f"payload {args.blocks} x {args.block_mib:g} MiB = {nbytes / MiB:.1f} MiB per call; {args.rounds} rounds x "
            f"{args.iters} calls; python {sys.version.split()[0]}, {os.cpu_count()} CPUs; "
            f"server bulk bytes in/out {stats.bulk_bytes_received / GB:.1f}/{stats.bulk_bytes_sent / GB:.1f} GB"
        )
        rate = {k: nbytes / statistics.median(v) / GB for k, v in times.items()}
        print("\n| path | put GB/s | get GB/s | put / raw | get / raw |\n|---|---:|---:|---:|---:|")
        for name in names:
            put, get = rate[(name, "put")], rate[(name, "get")]
            raw_put, raw_get = rate[("raw socket", "put")], rate[("raw socket", "get")]
            print(f"| {name} | {put:.2f} | {get:.2f} | {put / raw_put:.2f}x | {get / raw_get:.2f}x |")
        best = max(bulk_clients, key=lambda n: rate[(f"SDK bulk x{n}", "put")] + rate[(f"SDK bulk x{n}", "get")])
        b = f"SDK bulk x{best}"
        print(
            f"\n{b} / SDK gRPC: put {rate[(b, 'put')] / rate[('SDK gRPC', 'put')]:.2f}x, "
            f"get {rate[(b, 'get')] / rate[('SDK gRPC', 'get')]:.2f}x; "
            f"/ bare gRPC: put {rate[(b, 'put')] / rate[('bare gRPC', 'put')]:.2f}x, "
            f"get {rate[(b, 'get')] / rate[('bare gRPC', 'get')]:.2f}x"
        )
        for c in (sdk_grpc, *bulk_clients.values()):
            c.close()
        channel.close()
        counts = [int(n) for n in args.sweep.split(",") if n.strip()]
        if counts:
            sweep(target, counts, args.sweep_blocks, int(args.sweep_block_mib * MiB), args.sweep_iters)
    finally:
        for proc in servers:
            proc.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
