"""Drives LMCache 0.5.6's multiprocess ("MP") server for bench_peers.py, its shared-memory L1 path.

    python bench/peers/lmcache_mp_driver.py CHUNKS CHUNK_MIB

Starts `lmcache server` (zmq request port, HTTP port and metrics port all on 127.0.0.1, free ports)
with `--shm-name`, `--supported-transfer-mode auto` and an LRU L1 pool, and drives it with LMCache's
own Python client, `lmcache.sdk.context.LMCacheSDKContext`. No vLLM instance registers a model here,
so the driver publishes the layout itself (a per-layer vLLM flash-attention page layout, bf16).

Path measured: the engine-driven SHM transfer (`EngineDrivenContextShm`). A store is PREPARE_STORE
(the server reserves slots in its preallocated shared-memory pool `lmcache_l1_pool_<name>`), a copy
of each chunk by the client straight into those slots, then COMMIT_STORE; a retrieve is LOOKUP and
prefetch, PREPARE_RETRIEVE (slots in the pool), one copy out (`torch.cat`) and COMMIT_RETRIEVE. The
SDK silently falls back to pickling the chunks over zmq when the pool cannot be mapped, so before
"ready" the driver checks that the context is the SHM one, and on the first put and get that the
slots it wrote and read lie inside the pool's mapping; it exits non-zero otherwise.

Geometry: bf16, head size 128, `--chunk-size 256` tokens, layers x KV heads = 8 x CHUNK_MIB (32
layers x 8 heads, Llama-3-8B's, for 32 MiB), so one LMCache chunk is exactly CHUNK_MIB MiB and
the prompt is CHUNKS x 256 tokens of random bytes (fixed seed).

A store of tokens already cached is a no-op (PREPARE_STORE answers no slots and nothing is copied),
so each "put" stores a fresh prompt (token ids offset by a round counter) and each "get" retrieves
the last one stored; the first get is checked byte for byte. Before "ready" the pool is faulted in
(MADV_POPULATE_WRITE on the client's mapping, content untouched), as a server that has run a while
has it and as kvcache's arena is at start-up: cold, each fresh put pays tmpfs first-touch faults
(4 x 32 MiB here: ~2.9 GB/s put instead of ~8.8). The pool (LRU) holds 20 rounds' prompts, 4 GiB
at least: LMCache evicts once a second, and a store into a full pool fails (the driver then exits).

Protocol on stdin/stdout: "ready", then one line with the seconds each "put" or "get" took; "quit"
ends it. Everything else (the server's log too) goes to stderr. The server is stopped on exit, on
errors, and (PDEATHSIG) if the driver is killed; it unlinks its pool itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

MiB = 1 << 20
GiB = 1 << 30
CHUNK_TOKENS = 256
HEAD_SIZE = 128
BLOCK_TOKENS = 16  # vLLM's default page size: 16 pages per LMCache chunk
MODEL = "kvbench/geometry-only"
START_DEADLINE_S = 90.0
MADV_POPULATE_WRITE = 23


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def geometry(chunk_mib: int) -> tuple[int, int]:
    """(layers, KV heads) such that 2 (K, V) x layers x 256 tokens x heads x 128 x 2 bytes = CHUNK_MIB MiB."""
    per_chunk = chunk_mib * MiB // (2 * CHUNK_TOKENS * HEAD_SIZE * 2)  # layers x heads
    layers = math.gcd(32, per_chunk)
    return layers, per_chunk // layers


def _die_with_parent() -> None:
    # The server must not outlive a driver that is SIGKILLed (bench_peers kills a stuck peer).
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@contextlib.contextmanager
def server(pool_bytes: int) -> Iterator[tuple[int, int]]:
    """Starts `lmcache server` on free 127.0.0.1 ports; yields (zmq port, http port) once its HTTP
    API answers, and stops it after (it unlinks its shared-memory pool on SIGTERM)."""
    port, http, metrics = free_port(), free_port(), free_port()
    shm = f"kvbench{os.getpid()}-{uuid.uuid4().hex[:8]}"
    argv = [
        sys.executable, "-m", "lmcache.cli.main", "server", "--host", "127.0.0.1", "--port", str(port),
        "--http-host", "127.0.0.1", "--http-port", str(http), "--prometheus-port", str(metrics),
        "--l1-size-gb", f"{pool_bytes / GiB:g}", "--eviction-policy", "LRU",
        "--chunk-size", str(CHUNK_TOKENS), "--max-workers", "1", "--supported-transfer-mode", "auto",
        "--shm-name", shm,
    ]  # fmt: skip
    env = {**os.environ, "LMCACHE_DISABLE_BANNER": "1"}
    t0 = time.monotonic()
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=sys.stderr, stderr=sys.stderr, env=env, preexec_fn=_die_with_parent
    )
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"lmcache server exited with {proc.returncode} while starting")
            if time.monotonic() - t0 > START_DEADLINE_S:
                raise RuntimeError(f"lmcache server did not answer on 127.0.0.1:{http} in {START_DEADLINE_S:.0f} s")
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"http://127.0.0.1:{http}/config", timeout=2) as r,
            ):
                if r.status == 200:
                    break
            time.sleep(0.2)
        print(f"lmcache server up in {time.monotonic() - t0:.1f} s (shm {shm})", file=sys.stderr, flush=True)
        yield port, http
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        with contextlib.suppress(FileNotFoundError):  # only if it died without unlinking it
            os.unlink(f"/dev/shm/lmcache_l1_pool_{shm}")


def make_context(port: int, http: int, layers: int, heads: int) -> Any:
    from lmcache.sdk.context import LMCacheSDKContext

    class GeometryContext(LMCacheSDKContext):
        """The SDK context with the layout a vLLM instance would have published in /status."""

        def register_geometry(self) -> None:
            shape = f"{layers} x [2, 1, {BLOCK_TOKENS}, {heads}, {HEAD_SIZE}]"  # NL x [2, NB, BS, NH, HS]
            group = {
                "dtype": "torch.bfloat16",
                "tokens_per_block": BLOCK_TOKENS,
                "engine_kv_concrete_shape": shape,
                "engine_kv_format": "NL_X_TWO_NB_BS_NH_HS",
            }
            self._cache_context_meta_conf = {
                "bench": {
                    "model_name": MODEL,
                    "world_size": 1,
                    "kv_cache_layout": {"num_layers": layers, "kernel_groups": [group]},
                }
            }
            self.register_caches()

    ctx = GeometryContext(f"tcp://127.0.0.1:{port}", f"http://127.0.0.1:{http}", MODEL, timeout=120.0)
    ctx.register_geometry()
    return ctx


class ShmCheck:
    """Records, for one put and one get, whether the slots LMCache handed out lie in the pool."""

    def __init__(self, ctx: Any) -> None:
        import torch
        from lmcache.v1.multiprocess.transfer_context.shm import EngineDrivenContextShm

        self.inner = ctx.transfer_ctx._context
        if not isinstance(self.inner, EngineDrivenContextShm):
            raise RuntimeError(f"LMCache fell back to {type(self.inner).__name__}, not the shared-memory pool")
        buf = self.inner._shm_buffer
        self.lo = torch.frombuffer(buf, dtype=torch.uint8, count=1).data_ptr()
        self.hi = self.lo + len(buf)
        self.stored: list[bool] = []
        self.read: list[bool] = []

    def prefault(self) -> str:
        """Faults the whole pool in through this client's mapping, as a server that has run a while has
        it (and as kvcache's arena is at start-up): otherwise each fresh prompt's put pays tmpfs
        first-touch faults (measured here: ~2.9 GB/s instead of ~8.8). Content is left untouched."""
        t0 = time.monotonic()
        try:
            self.inner._shm._mmap.madvise(MADV_POPULATE_WRITE)
            how = "MADV_POPULATE_WRITE"
        except (AttributeError, OSError, ValueError):  # older kernels: one write per page, before anything is stored
            import numpy as np

            np.frombuffer(self.inner._shm_buffer, dtype=np.uint8)[::4096] = 0
            how = "touch"
        return f"{(self.hi - self.lo) / GiB:g} GiB in {time.monotonic() - t0:.1f} s ({how})"

    def _in_pool(self, tensors: list[Any]) -> bool:
        return bool(tensors) and all(self.lo <= t.data_ptr() < self.hi for t in tensors)

    def install(self) -> None:
        prepare_store, prepare_retrieve = self.inner.prepare_store, self.inner.prepare_retrieve

        def store(*a: Any) -> Any:
            out = prepare_store(*a)
            self.stored.append(out is not None and self._in_pool(out[0]))
            return out

        def retrieve(*a: Any) -> Any:
            out = prepare_retrieve(*a)
            self.read.append(out is not None and self._in_pool(out))
            return out

        self.inner.prepare_store, self.inner.prepare_retrieve = store, retrieve

    def verify(self) -> None:
        del self.inner.prepare_store, self.inner.prepare_retrieve  # back to the class's methods, untimed
        if self.stored != [True] or self.read != [True]:
            raise RuntimeError(f"not the shared-memory path: store slots in pool {self.stored}, read {self.read}")


def main() -> None:
    chunks, chunk_mib = int(sys.argv[1]), int(sys.argv[2])
    # Only protocol lines on stdout: keep it aside and send fd 1 (LMCache, C code) to stderr.
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: stop the server
    os.environ["LMCACHE_DISABLE_BANNER"] = "1"
    import torch

    layers, heads = geometry(chunk_mib)
    tokens = chunks * CHUNK_TOKENS
    payload = chunks * chunk_mib * MiB
    gen = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (payload,), dtype=torch.uint8, generator=gen)
    kv = raw.view(torch.bfloat16).view(2, layers, tokens, heads * HEAD_SIZE)
    assert kv.nbytes == payload
    # Room for every round's fresh prompt (bench_peers: 1 warm-up + up to ~18): eviction is not relied on.
    pool = max(4 * GiB, math.ceil(20 * payload / GiB) * GiB)
    with server(pool) as (port, http):
        ctx = make_context(port, http, layers, heads)
        check = ShmCheck(ctx)
        faulted = check.prefault()
        check.install()
        print(
            f"geometry: {layers} layers x {heads} heads x {HEAD_SIZE}, bf16, {CHUNK_TOKENS}-token chunks of "
            f"{chunk_mib} MiB, {tokens} tokens; pool faulted in: {faulted}; path {type(check.inner).__name__}",
            file=sys.stderr,
            flush=True,
        )
        round_ = 0
        prompt: list[int] = []
        gets = 0
        print("ready", file=proto, flush=True)
        for line in sys.stdin:
            op = line.strip()
            if op == "quit":
                break
            if op == "put":
                round_ += 1
                fresh = list(range(round_ * tokens, (round_ + 1) * tokens))  # new tokens: a repeat is a no-op
                t0 = time.perf_counter()
                ok = ctx.store(kv, fresh)
                took = time.perf_counter() - t0
                if not ok:
                    raise RuntimeError(f"store returned False in round {round_} (pool full?)")
                prompt = fresh
            elif op == "get":
                t0 = time.perf_counter()
                got = ctx.retrieve(prompt)
                took = time.perf_counter() - t0
                gets += 1
                if got is None or got.shape != kv.shape:
                    raise RuntimeError(f"retrieve returned {None if got is None else tuple(got.shape)}")
                if gets == 1:
                    if not torch.equal(got.contiguous().view(torch.uint8).flatten(), raw):
                        raise RuntimeError("retrieved bytes differ from the stored ones")
                    check.verify()
                    print("first get verified: bytes equal, slots in the shm pool", file=sys.stderr, flush=True)
            else:
                raise RuntimeError(f"unknown op {op!r}")
            print(took, file=proto, flush=True)
        ctx.close()


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()  # to stderr: bench_peers keeps it in the peer's log
        raise SystemExit(1) from None
