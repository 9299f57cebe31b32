"""kvcache beside its floors and peers on the same payloads, in one run (issue 14's tables).

    python bench/bench_peers.py                        # 4 chunks x 32 MiB, 15 interleaved rounds
    python bench/bench_peers.py --chunk-mib 8 --rounds 5 --sweep 1,2,4,8,16
    python bench/bench_peers.py --chunks 16 --chunk-mib 2 --no-peers --sweep ''   # issue 25's other shape
    PYTHONPATH=/path/to/other/checkout python bench/bench_peers.py   # the same bench on other code

Paths, each timed on the same prompt (`--chunks` blocks of `--chunk-mib`, bf16-like random bytes)
and interleaved round by round (every path once per round, medians over the rounds):

- numpy memcpy: the floor (copy the prompt into a warm buffer, and back);
- the verified copy floor: what one verified copy on one host costs on the threads and in the pieces the
  SDK and the server use, with no call around it (put: out of another process's memory with
  process_vm_readv, as the server reads a same-host put, hashed as it lands; get: out of a shared
  mapping, as get_into copies out of the arena, hashed as it lands): what a same-host put or get
  could reach here;
- raw loopback TCP socket, Python at both ends (sendall / recv_into into warm buffers): the floor
  of a remote client;
- redis-py: SET / MGET of the chunks against a redis-server child (pipelined);
- bare gRPC Python: bench/echo_server.py's raw service, the chunks as 1 MiB messages of raw bytes
  (stream out, stream back), the floor of the SDK's pure-gRPC row;
- the kvcache SDK against a kvcache server child, with `shm` (same host: the block arena in place,
  or segments on code without it) and with `shm=False` (as a remote client: the bulk port). Each
  of its three gets is a row: get_into (one copy into a warm destination, verified), get_many and
  get_tensors (memory the SDK hands out), with their time over get_into's in a table of their own;
  and with `shm=False, bulk=False` (pure gRPC, as a client in another language starts), get_into,
  beside the bulk port in a table of its own; and same host once more with the blocks it puts in one
  numpy buffer, which numpy has the kernel back with huge pages (the server reads a same-host put out
  of the client's memory, 1.4-1.6x faster out of huge pages: docs/shm.md);
- peers, where they are installed (docs: ../shared/reference/peers.md; `--peers-dir`), each driven
  by a child (bench/peers/*.py), skipped with a message otherwise: LMCache's MP server with its
  shared-memory L1 (in `<peers-dir>/lmc`, else in this Python where it has lmcache) and Mooncake
  Store (in its own virtual environment).

Then ratios to memcpy, to the raw socket and to each peer, and the concurrency sweep: N client
processes (`--sweep`) each putting and getting its own prompt (`--sweep-chunk-mib`) for
`--sweep-rounds`, aggregate GB/s (all bytes moved / wall time) and p99 of one call, for the SDK with
shm on and off. Figures only: nothing here is a pass/fail threshold.

(Over 500 lines: one script, each compared path a small class driven by the same rounds, and
the tables; the peers' drivers are bench/peers/*.py.)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import xxhash

from kvcache_client import KVCacheClient
from kvcache_core.format import encode_block

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import GB, MiB, ServerProcess, free_port, python_cmd

import kvcache_server

CODE_ROOT = Path(kvcache_server.__file__).resolve().parent.parent
NS = "bench-peers"

_SOCKET_SERVER = r"""
import socket, struct, sys
n = int(sys.argv[1])
buf = bytearray(n); view = memoryview(buf)
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
print("socket serving on 127.0.0.1:%d" % srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while True:
    head = conn.recv(9, socket.MSG_WAITALL)
    if len(head) < 9:
        break
    op, size = head[:1], struct.unpack("<Q", head[1:])[0]
    if op == b"P":
        got = 0
        while got < size:
            got += conn.recv_into(view[got:size])
        conn.sendall(b"k")
    else:
        conn.sendall(view[:size])
"""


class Path_:
    """One system under test: put() and get() move the whole prompt once."""

    name = ""

    def put(self) -> None:
        raise NotImplementedError

    def get(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class Memcpy(Path_):
    name = "numpy memcpy (floor)"

    def __init__(self, chunks: list[np.ndarray]) -> None:
        self.src = chunks
        self.dst = [np.empty_like(c) for c in chunks]
        self.put()

    def put(self) -> None:
        for s, d in zip(self.src, self.dst, strict=True):
            np.copyto(d, s)

    def get(self) -> None:
        for s, d in zip(self.dst, self.src, strict=True):
            np.copyto(d, s)


class RawSocket(Path_):
    name = "raw loopback TCP socket, Python"

    def __init__(self, chunks: list[np.ndarray]) -> None:
        self.chunks = chunks
        size = max(c.nbytes for c in chunks)
        self.proc = ServerProcess("socket-server", python_cmd("-c", _SOCKET_SERVER, str(size)))
        port = self.proc.start(r"on 127.0.0.1:(\d+)")
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = memoryview(bytearray(size))

    def put(self) -> None:
        for c in self.chunks:
            self.sock.sendall(b"P" + struct.pack("<Q", c.nbytes))
            self.sock.sendall(memoryview(c).cast("B"))
            self.sock.recv(1)

    def get(self) -> None:
        for c in self.chunks:
            self.sock.sendall(b"G" + struct.pack("<Q", c.nbytes))
            got = 0
            while got < c.nbytes:
                got += self.sock.recv_into(self.buf[got : c.nbytes])

    def close(self) -> None:
        self.sock.close()
        self.proc.stop()


_HOLDER = r"""
import sys
import numpy as np
sizes = [int(a) for a in sys.argv[1:]]
# bytes objects, as the SDK's rows put (encoded blocks): malloc's pages, where numpy would ask for huge pages
chunks = [np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes() for i, n in enumerate(sizes)]
print(" ".join(str(np.frombuffer(c, np.uint8).ctypes.data) for c in chunks), flush=True)
sys.stdin.read()
"""


class VerifiedCopy(Path_):
    """The floor of a verified copy on one host, on the threads the SDK and the server use
    (kvcache_core.landing.each) in the pieces they use: put, each chunk read out of another process's
    memory (process_vm_readv, as the server reads a same-host put) into a warm buffer and hashed
    (xxh3) 2 MiB at a time as it lands; get, each chunk copied out of a shared mapping (as get_into
    copies out of the arena) and hashed 1 MiB at a time. No server, no call, no bookkeeping: what the
    kernel's copy and the hash cost on this machine."""

    name = "verified copy floor (put: process_vm_readv, get: shared memory; + xxh3)"

    def __init__(self, chunks: list[np.ndarray]) -> None:
        import mmap
        import subprocess

        from kvcache_server.procmem import AVAILABLE

        if not AVAILABLE:
            raise RuntimeError("process_vm_readv or pidfd_open is missing here")
        sizes = [c.nbytes for c in chunks]
        self.holder = subprocess.Popen(
            python_cmd("-c", _HOLDER, *map(str, sizes)), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.addresses = [int(a) for a in self.holder.stdout.readline().split()]  # type: ignore[union-attr]
        self.pidfd = os.pidfd_open(self.holder.pid)
        self.dst = [np.ones(n, np.uint8) for n in sizes]
        fd = os.memfd_create("bench-shared")
        os.ftruncate(fd, sum(sizes))
        self.shared = mmap.mmap(fd, sum(sizes), flags=mmap.MAP_SHARED)
        os.close(fd)
        whole = np.frombuffer(self.shared, np.uint8)
        starts = np.cumsum([0, *sizes])
        self.src = [whole[starts[i] : starts[i + 1]] for i in range(len(sizes))]
        for s, c in zip(self.src, chunks, strict=True):
            np.copyto(s, c)
        self.sizes = sizes

    def put(self) -> None:
        from kvcache_core.landing import each
        from kvcache_server.pipeline.verify import SLOT_PIECE_BYTES
        from kvcache_server.procmem import ProcessCopy

        def one(i: int) -> int:
            dst = memoryview(self.dst[i]).cast("B")
            copy = ProcessCopy(self.holder.pid, self.pidfd, "holder", self.addresses[i], dst)
            h = xxhash.xxh3_64()
            for start in range(0, len(dst), SLOT_PIECE_BYTES):
                end = min(len(dst), start + SLOT_PIECE_BYTES)
                copy.read(start, end)
                h.update(dst[start:end])
            return h.intdigest()

        each(one, range(len(self.sizes)), self.sizes)

    def get(self) -> None:
        from kvcache_core.landing import copy_hashed, each

        def one(i: int) -> int:
            return copy_hashed(self.src[i], self.dst[i], xxhash.xxh3_64())

        each(one, range(len(self.sizes)), self.sizes)

    def close(self) -> None:
        self.holder.kill()
        self.holder.wait(10)
        os.close(self.pidfd)
        self.src = []  # the views of the mapping, which must go before it closes
        self.shared.close()


class BareGrpc(Path_):
    """bench/echo_server.py's raw service: the chunks as 1 MiB messages of raw bytes (the SDK's part
    size), no protobuf, no checksum, no store: what gRPC Python itself moves, the floor of the pure-gRPC row."""

    name = "bare gRPC Python, raw 1 MiB messages"

    def __init__(self, chunks: list[np.ndarray]) -> None:
        import grpc

        self.messages = [bytes(memoryview(c).cast("B")[i : i + MiB]) for c in chunks for i in range(0, c.nbytes, MiB)]
        argv = python_cmd(str(Path(__file__).resolve().parent / "echo_server.py"), "--port", "0")
        self.proc = ServerProcess("echo-server", argv, cwd=str(CODE_ROOT))
        port = self.proc.start(r"serving on [^\s:]+:(\d+)")
        options = [("grpc.max_receive_message_length", 8 * MiB), ("grpc.max_send_message_length", 8 * MiB)]
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=options)
        grpc.channel_ready_future(self.channel).result(timeout=30)
        self._put = self.channel.stream_unary("/echo.Raw/Put")
        self._get = self.channel.unary_stream("/echo.Raw/Get")
        self.meta = (("slot", "bench-peers"),)

    def put(self) -> None:
        ack = int.from_bytes(self._put(iter(self.messages), metadata=self.meta, timeout=120), "little")
        assert ack == len(self.messages), ack

    def get(self) -> None:
        got = sum(len(m) for m in self._get(b"bench-peers", timeout=120))
        assert got == sum(len(m) for m in self.messages), got

    def close(self) -> None:
        self.channel.close()
        self.proc.stop()


class RedisPy(Path_):
    name = "redis-py"

    def __init__(self, chunks: list[np.ndarray]) -> None:
        import redis

        self.chunks = [c.tobytes() for c in chunks]
        self.keys = [f"chunk-{i}" for i in range(len(chunks))]
        port = free_port()
        argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.proc = ServerProcess("redis-server", argv)
        self.proc.start(None)
        self.client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=60)
        deadline = time.monotonic() + 15
        while True:
            try:
                self.client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        try:
            import hiredis  # noqa: F401

            self.name = "redis-py + hiredis"
        except ImportError:
            pass

    def put(self) -> None:
        pipe = self.client.pipeline(transaction=False)
        for k, v in zip(self.keys, self.chunks, strict=True):
            pipe.set(k, v)
        pipe.execute()

    def get(self) -> None:
        got = self.client.mget(self.keys)
        assert all(g is not None for g in got)

    def close(self) -> None:
        self.client.close()
        self.proc.stop()


def start_kvcache(capacity_bytes: int) -> tuple[ServerProcess, str]:
    argv = python_cmd(
        "-m", "kvcache_server", "--port", "0", "--ram-capacity", str(capacity_bytes),
        "--set", "limits.max_block_bytes=256MiB", "--set", "limits.inflight_bytes=2GiB",
    )  # fmt: skip
    proc = ServerProcess("kvcache-server", argv, cwd=str(CODE_ROOT))
    port = proc.start(r"serving \S+ on [^\s:]+:(\d+)", timeout_s=120)
    return proc, f"127.0.0.1:{port}"


GETS = ("get_into", "get_many", "get_tensors")
PURE_GRPC = "shm=False, bulk=False: pure gRPC"
"""A remote client without the bulk port (another language, an HTTP/2-only proxy): every byte on gRPC."""
"""The SDK's three gets, each its own row: get_into copies into warm destinations the bench keeps;
get_many and get_tensors return memory the SDK owns, dropped before the next round (as a caller
that copies each block on and lets it go)."""


class Sdk(Path_):
    def __init__(
        self, target: str, chunks: list[np.ndarray], *, shm: bool, get: str, bulk: bool = True, huge: bool = False
    ) -> None:
        self.client = KVCacheClient(target, shm=shm, bulk=bulk, timeout_s=120)
        self.keys = [os.urandom(16) for _ in chunks]
        self.blocks: list[bytes | memoryview] = [
            encode_block(memoryview(c).cast("B"), key=k, dtype="bfloat16", shape=(c.nbytes // 2,))
            for k, c in zip(self.keys, chunks, strict=True)
        ]
        if huge:  # the same blocks in one numpy buffer, which numpy asks the kernel to back with huge pages
            whole = np.empty(sum(len(b) for b in self.blocks), np.uint8)
            views, at = [], 0
            for b in self.blocks:
                whole[at : at + len(b)] = np.frombuffer(b, np.uint8)
                views.append(memoryview(whole[at : at + len(b)]))
                at += len(b)
            self.blocks = views
        self.op = get if hasattr(self.client, get) else "get_many"  # code without get_into
        self.dst = [np.empty(c.nbytes, dtype=np.uint8) for c in chunks]
        self.where = "shm" if shm else "shm=False, as a remote client" if bulk else PURE_GRPC
        self.name = f"kvcache SDK ({self.where}{', blocks in huge pages' if huge else ''}), {self.op}"
        self.put()

    def put(self) -> None:
        result = self.client.put_many(NS, list(zip(self.keys, self.blocks, strict=True)))
        assert result.stored == len(self.keys), result

    def get(self) -> None:
        if self.op == "get_into":
            assert all(self.client.get_into(NS, self.keys, self.dst))
        else:
            got = getattr(self.client, self.op)(NS, self.keys)
            assert all(g is not None for g in got)

    def close(self) -> None:
        self.client.close()


class PeerDriver(Path_):
    """A peer driven by a child in its own environment: it prints "ready", then answers each "put"
    or "get" line on stdin with the seconds the operation took (bench/peers/*.py)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        import subprocess
        import tempfile

        self.name = name
        self._log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed with the driver; never a full pipe
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env
        )
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if line.strip() != "ready":
            self.proc.kill()
            self._log.seek(0)
            raise RuntimeError(f"{name} did not start: {line.strip()} {self._log.read()[-2000:]}")
        self.last = 0.0

    def _do(self, op: str) -> None:
        self.proc.stdin.write(op + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        self.last = float(self.proc.stdout.readline())  # type: ignore[union-attr]

    def put(self) -> None:
        self._do("put")

    def get(self) -> None:
        self._do("get")

    def close(self) -> None:
        try:
            self.proc.stdin.write("quit\n")  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
            self.proc.wait(30)
        except Exception:  # a peer that will not stop is killed
            self.proc.kill()
        self._log.close()


def peers(args: argparse.Namespace) -> list[Path_]:
    import importlib.util

    out: list[Path_] = []
    root = Path(args.peers_dir)
    here = Path(__file__).resolve().parent / "peers"
    # LMCache runs in peers.md's own venv, else in this Python where it imports lmcache (the test venv does).
    lmc = root / "lmc" / "bin" / "python"
    lmc = lmc if lmc.exists() or not importlib.util.find_spec("lmcache") else Path(sys.executable)
    for name, python, script, prefix in (
        ("LMCache MP (shm L1)", lmc, "lmcache_mp_driver.py", []),  # print_table: columns named by the first word
        ("Mooncake Store over TCP", root / "mc" / "bin" / "python", "mooncake_driver.py", ["unshare", "-n"]),
    ):
        if not python.exists():
            why = ", nor lmcache in this Python" if python == lmc else ""
            venv = python.parent.parent
            print(f"skipped {name}: no virtual environment at {venv}{why} (install it as peers.md says)")
            continue
        argv = [*prefix, str(python), str(here / script), str(args.chunks), str(args.chunk_mib)]
        try:  # PYTHONPATH: a driver imports only its peer's packages, never the code under test
            out.append(PeerDriver(name, argv, {**os.environ, "PYTHONPATH": ""}))
        except (OSError, RuntimeError) as exc:
            print(f"skipped {name}: {exc}")
    return out


def timed(fn: Callable[[], None], path: Path_) -> float:
    t0 = time.perf_counter()
    fn()
    took = time.perf_counter() - t0
    return path.last if isinstance(path, PeerDriver) else took


def run_table(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    rng = np.random.default_rng(0)
    n = args.chunk_mib * MiB
    chunks = [rng.integers(0, 256, n, dtype=np.uint8) for _ in range(args.chunks)]
    total = n * args.chunks
    proc, target = start_kvcache(max(1 << 30, (2 * len(GETS) + 4) * total))  # every SDK row's blocks, and room
    paths: list[Path_] = []
    try:
        paths = [Memcpy(chunks), RawSocket(chunks), RedisPy(chunks), BareGrpc(chunks)]
        try:
            paths.append(VerifiedCopy(chunks))
        except (RuntimeError, OSError) as exc:
            print(f"skipped the verified copy floor: {exc}")
        paths += [Sdk(target, chunks, shm=shm, get=get) for shm in (True, False) for get in GETS]
        paths += [Sdk(target, chunks, shm=False, get="get_into", bulk=False)]
        paths += [Sdk(target, chunks, shm=True, get="get_into", huge=True)]
        if not args.no_peers:
            paths += peers(args)
        times: dict[str, dict[str, list[float]]] = {p.name: {"put": [], "get": []} for p in paths}
        for p in paths:  # warm-up round, untimed
            p.put()
            p.get()
        for _ in range(args.rounds):
            for p in paths:
                times[p.name]["put"].append(timed(p.put, p))
                times[p.name]["get"].append(timed(p.get, p))
    finally:
        for p in paths:
            p.close()
        proc.stop()
    return {name: {op: total / statistics.median(ts) / GB for op, ts in ops.items()} for name, ops in times.items()}


def print_table(rates: dict[str, dict[str, float]], args: argparse.Namespace) -> None:
    names = list(rates)
    floor, sock = rates[names[0]], rates[names[1]]
    print(f"\n{args.chunks} chunks x {args.chunk_mib} MiB, {args.rounds} interleaved rounds, medians (GB/s)\n")
    peer_names = [n for n in names if "LMCache" in n or "Mooncake" in n]
    head = "| path | put GB/s | get GB/s | put / memcpy | get / memcpy | put / socket | get / socket |"
    head += "".join(f" put / {p.split()[0]} | get / {p.split()[0]} |" for p in peer_names)
    print(head)
    print("|" + "---|" * (7 + 2 * len(peer_names)))
    for name in names:
        r = rates[name]
        row = f"| {name} | {r['put']:.2f} | {r['get']:.2f} | {r['put'] / floor['put']:.2f} | "
        row += f"{r['get'] / floor['get']:.2f} | {r['put'] / sock['put']:.2f} | {r['get'] / sock['get']:.2f} |"
        row += "".join(f" {r['put'] / rates[p]['put']:.2f} | {r['get'] / rates[p]['get']:.2f} |" for p in peer_names)
        print(row)
    print_convenient(rates)
    print_verified_floor(rates)
    print_pure_grpc(rates)


def print_convenient(rates: dict[str, dict[str, float]]) -> None:
    """get_many's and get_tensors' time over get_into's, same host and remote (issue 25's target: at most 1.25)."""
    print("\n| SDK path | get_into GB/s | get_many / get_into time | get_tensors / get_into time |")
    print("|---|---:|---:|---:|")
    for where in ("shm", "shm=False, as a remote client"):
        row = {get: rates.get(f"kvcache SDK ({where}), {get}", {}).get("get") for get in GETS}
        if row["get_into"] is None:
            continue
        ratios = [f"{row['get_into'] / r:.2f}" if r else "-" for r in (row["get_many"], row["get_tensors"])]
        print(f"| {where} | {row['get_into']:.2f} | {ratios[0]} | {ratios[1]} |")


def print_verified_floor(rates: dict[str, dict[str, float]]) -> None:
    """The same-host SDK's put and get_into over the verified copy floor (VerifiedCopy) of the same run."""
    floor = rates.get(VerifiedCopy.name)
    sdk = rates.get("kvcache SDK (shm), get_into")
    if floor is None or sdk is None:
        return
    print("\n| same host | put GB/s | get_into GB/s |")
    print("|---|---:|---:|")
    print(f"| {VerifiedCopy.name} | {floor['put']:.2f} | {floor['get']:.2f} |")
    huge = rates.get("kvcache SDK (shm, blocks in huge pages), get_into")
    for name, row in (("kvcache SDK (shm)", sdk), ("kvcache SDK (shm), blocks in huge pages", huge)):
        if row is not None:
            print(f"| {name} | {row['put']:.2f} | {row['get']:.2f} |")
            print(f"| {name} / floor | {row['put'] / floor['put']:.2f} | {row['get'] / floor['get']:.2f} |")


def print_pure_grpc(rates: dict[str, dict[str, float]]) -> None:
    """Pure gRPC over the bulk port, both with get_into and without shm (issue 25's target: at least 0.5)."""
    grpc_row = rates.get(f"kvcache SDK ({PURE_GRPC}), get_into")
    bulk_row = rates.get("kvcache SDK (shm=False, as a remote client), get_into")
    bare_row = rates.get(BareGrpc.name)
    if grpc_row is None or bulk_row is None or bare_row is None:
        return
    head = "| remote client | put GB/s | get GB/s | put / bulk port | get / bulk port |"
    print(f"\n{head} put / bare gRPC | get / bare gRPC |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, row in (("bulk port", bulk_row), ("kvcache, pure gRPC", grpc_row), ("bare gRPC", bare_row)):
        print(
            f"| {name} | {row['put']:.2f} | {row['get']:.2f} | {row['put'] / bulk_row['put']:.2f} | "
            f"{row['get'] / bulk_row['get']:.2f} | {row['put'] / bare_row['put']:.2f} | "
            f"{row['get'] / bare_row['get']:.2f} |"
        )


def _sweep_client(
    target: str, shm: bool, chunks: int, chunk_mib: int, rounds: int, start: float, out: mp.Queue
) -> None:
    client = KVCacheClient(target, shm=shm, timeout_s=300)
    n = chunk_mib * MiB
    keys = [os.urandom(16) for _ in range(chunks)]
    blocks = [encode_block(os.urandom(n), key=k, dtype="uint8", shape=(n,)) for k in keys]
    dst = [np.empty(n, dtype=np.uint8) for _ in keys]
    items = list(zip(keys, blocks, strict=True))
    client.put_many(NS, items)  # warm: mappings, pools, first faults, imports
    into = hasattr(client, "get_into")
    if into:
        client.get_into(NS, keys, dst)
    else:
        client.get_many(NS, keys)
    while time.time() < start:
        time.sleep(0.001)
    lat: list[float] = []
    t0 = time.perf_counter()
    for _ in range(rounds):
        a = time.perf_counter()
        client.put_many(NS, items)
        b = time.perf_counter()
        if into:
            client.get_into(NS, keys, dst)
        else:
            client.get_many(NS, keys)
        lat += [b - a, time.perf_counter() - b]
    out.put((time.perf_counter() - t0, lat, 2 * rounds * chunks * n))
    client.close()


def run_sweep(args: argparse.Namespace) -> None:
    counts = [int(c) for c in args.sweep.split(",") if c]
    if not counts:
        return
    per_client = args.chunks * args.sweep_chunk_mib * MiB
    proc, target = start_kvcache(max(1 << 30, 2 * max(counts) * per_client))
    ctx = mp.get_context("spawn")
    print(f"\nConcurrency sweep: N client processes, each {args.chunks} x {args.sweep_chunk_mib} MiB put + get,")
    print(f"{args.sweep_rounds} rounds; aggregate = all bytes moved / wall time of the slowest client\n")
    print("| clients | shm GB/s | shm p99 ms | shm=False GB/s | shm=False p99 ms |")
    print("|---:|---:|---:|---:|---:|")
    try:
        for n in counts:
            cells = []
            for shm in (True, False):
                q: mp.Queue = ctx.Queue()
                start = time.time() + 3 + 0.3 * n
                ps = [
                    ctx.Process(
                        target=_sweep_client,
                        args=(target, shm, args.chunks, args.sweep_chunk_mib, args.sweep_rounds, start, q),
                    )
                    for _ in range(n)
                ]
                for p in ps:
                    p.start()
                results = [q.get(timeout=900) for _ in ps]
                for p in ps:
                    p.join(60)
                wall = max(r[0] for r in results)
                moved = sum(r[2] for r in results)
                lat = sorted(x for r in results for x in r[1])
                p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
                cells += [f"{moved / wall / GB:.2f}", f"{p99 * 1000:.0f}"]
            print(f"| {n} | " + " | ".join(cells) + " |", flush=True)
    finally:
        proc.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--chunk-mib", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--sweep", default="1,2,4,8,16", help="client process counts; '' skips the sweep")
    ap.add_argument("--sweep-chunk-mib", type=int, default=8)
    ap.add_argument("--sweep-rounds", type=int, default=5)
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--peers-dir", default=os.environ.get("KVCACHE_PEERS_DIR", "/tmp/peers"))
    ap.add_argument("--json", help="also write the table's rates here")
    args = ap.parse_args(argv)
    print(f"code under test: {CODE_ROOT}")
    rates = run_table(args)
    print_table(rates, args)
    if args.json:
        Path(args.json).write_text(json.dumps(rates, indent=2))
    run_sweep(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
