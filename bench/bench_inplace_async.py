"""The asyncio SDK on the same host: in place through the server's arena vs per-call segments vs gRPC.

    python bench/bench_inplace_async.py                     # 4 chunks x 8 MiB, 9 interleaved rounds
    python bench/bench_inplace_async.py --chunk-mib 32 --rounds 15

Two kvcache server children, one sharing its arena (shm.share_arena = true, the default) and one not
(false: same-host clients use per-call segments). Paths, each timed on the same prompt and
interleaved round by round (medians over the rounds):

- numpy memcpy: the floor (copy the prompt into a warm buffer, and back);
- AsyncKVCacheClient, arena shared: put_many (one copy into the reserved slots), get_into (one copy
  out of leased slots into warm buffers, verified) and get_many (a copy into the client's memory);
- AsyncKVCacheClient, arena not shared: put_many and get_many through segments;
- AsyncKVCacheClient with shm=False: gRPC;
- KVCacheClient (blocking), arena shared, get_into: the sync SDK's figure, for reference.

Then ratios to memcpy and to the async segment path. Figures only: nothing here is a pass/fail threshold.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np

from kvcache_client import AsyncKVCacheClient, KVCacheClient
from kvcache_core.format import encode_block

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import GB, MiB, ServerProcess, python_cmd

import kvcache_server

CODE_ROOT = Path(kvcache_server.__file__).resolve().parent.parent
NS = "bench-inplace-async"


def start_kvcache(capacity_bytes: int, share_arena: bool) -> tuple[ServerProcess, str]:
    argv = python_cmd(
        "-m", "kvcache_server", "--port", "0", "--ram-capacity", str(capacity_bytes),
        "--set", "limits.max_block_bytes=256MiB", "--set", "limits.inflight_bytes=2GiB",
        "--set", f"shm.share_arena={'true' if share_arena else 'false'}",
    )  # fmt: skip
    proc = ServerProcess("kvcache-server", argv, cwd=str(CODE_ROOT))
    port = proc.start(r"serving \S+ on [^\s:]+:(\d+)", timeout_s=120)
    return proc, f"127.0.0.1:{port}"


class Path_:
    name = ""

    async def put(self) -> None: ...

    async def get(self) -> None: ...

    async def close(self) -> None: ...


class Memcpy(Path_):
    name = "numpy memcpy (floor)"

    def __init__(self, chunks: list[np.ndarray]) -> None:
        self.chunks = chunks
        self.dst = [np.empty_like(c) for c in chunks]

    async def put(self) -> None:
        for c, d in zip(self.chunks, self.dst, strict=True):
            np.copyto(d, c)

    async def get(self) -> None:
        for c, d in zip(self.chunks, self.dst, strict=True):
            np.copyto(c, d)


class Sdk(Path_):
    def __init__(self, name: str, client: AsyncKVCacheClient | KVCacheClient, chunks: list[np.ndarray], into: bool):
        self.name = name
        self.client = client
        self.keys = [os.urandom(16) for _ in chunks]
        self.items = [
            (k, encode_block(memoryview(c).cast("B"), key=k, dtype="bfloat16", shape=(c.nbytes // 2,)))
            for k, c in zip(self.keys, chunks, strict=True)
        ]
        self.into = into
        self.dst = [np.empty(c.nbytes, dtype=np.uint8) for c in chunks]

    async def _do(self, result: object) -> object:
        return await result if isinstance(result, Awaitable) else result

    async def put(self) -> None:
        result = await self._do(self.client.put_many(NS, self.items))
        assert result.stored == len(self.keys), result  # type: ignore[attr-defined]

    async def get(self) -> None:
        if self.into:
            assert all(await self._do(self.client.get_into(NS, self.keys, self.dst)))  # type: ignore[arg-type]
        else:
            got = await self._do(self.client.get_many(NS, self.keys))
            assert all(g is not None for g in got)  # type: ignore[attr-defined]

    async def close(self) -> None:
        await self._do(self.client.close())


async def timed(fn: Callable[[], Awaitable[None]]) -> float:
    t0 = time.perf_counter()
    await fn()
    return time.perf_counter() - t0


async def run(args: argparse.Namespace, shared: str, private: str) -> dict[str, dict[str, float]]:
    rng = np.random.default_rng(0)
    chunks = [rng.integers(0, 256, args.chunk_mib * MiB, dtype=np.uint8) for _ in range(args.chunks)]
    total = sum(c.nbytes for c in chunks)
    paths: list[Path_] = [
        Memcpy(chunks),
        Sdk("async, arena shared, get_into", AsyncKVCacheClient(shared, timeout_s=120), chunks, True),
        Sdk("async, arena shared, get_many", AsyncKVCacheClient(shared, timeout_s=120), chunks, False),
        Sdk("async, segments (share_arena=false)", AsyncKVCacheClient(private, timeout_s=120), chunks, False),
        Sdk("async, shm=False (gRPC)", AsyncKVCacheClient(shared, shm=False, timeout_s=120), chunks, False),
        Sdk("sync, arena shared, get_into", KVCacheClient(shared, timeout_s=120), chunks, True),
    ]
    times: dict[str, dict[str, list[float]]] = {p.name: {"put": [], "get": []} for p in paths}
    try:
        for p in paths:  # warm-up round, untimed
            await p.put()
            await p.get()
        for _ in range(args.rounds):
            for p in paths:
                times[p.name]["put"].append(await timed(p.put))
                times[p.name]["get"].append(await timed(p.get))
    finally:
        for p in paths:
            await p.close()
    return {name: {op: total / statistics.median(ts) / GB for op, ts in ops.items()} for name, ops in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--chunk-mib", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args(argv)
    capacity = max(512 * MiB, 8 * args.chunks * args.chunk_mib * MiB)
    shared_proc, shared = start_kvcache(capacity, True)
    private_proc, private = start_kvcache(capacity, False)
    try:
        rates = asyncio.run(run(args, shared, private))
    finally:
        shared_proc.stop()
        private_proc.stop()
    names = list(rates)
    floor, segments = rates[names[0]], rates["async, segments (share_arena=false)"]
    print(f"\n{args.chunks} chunks x {args.chunk_mib} MiB, {args.rounds} interleaved rounds, medians (GB/s)\n")
    print("| path | put GB/s | get GB/s | put / memcpy | get / memcpy | put / async segments | get / async segments |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        r = rates[name]
        print(
            f"| {name} | {r['put']:.2f} | {r['get']:.2f} | {r['put'] / floor['put']:.2f} | "
            f"{r['get'] / floor['get']:.2f} | {r['put'] / segments['put']:.2f} | {r['get'] / segments['get']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
