"""What storing a chunk as blocks of KV heads costs (head-sharded storage, docs/vllm.md "Mixed tensor parallelism").

    .venv/bin/python bench/bench_head_blocks.py [--chunks 16] [--layers 8] [--rounds 5] [--quick]

A rank of a model with 8 KV heads of 128 (bf16, 256-token chunks) moves --chunks chunks of a
prompt through a real `python -m kvcache_server` subprocess, as the vLLM connector's worker does:
one put_many (a save) and one get_many (a load) of all of them, plus the scheduler's one Lookup of
their keys, with each chunk stored as 8 / n blocks of n heads (kv_heads_per_block = n, keys from
kvcache_core.keys.head_block_key). n = 8 is one block per chunk under the chunk key, what an
instance whose ranks hold 8 heads does by default: the baseline, measured in the same run. Smaller
n is what a fleet mixing TP sizes sets so that smaller ranks load exactly their heads; a rank with
all 8 heads then moves the same bytes in more, smaller blocks.

Reported per n: blocks per call, the median wall time of the put, the get and the lookup over
--rounds rounds (each round deletes the blocks first, so every put stores them), the get's
throughput, and each median as a ratio to n = 8's (1.00x = as fast as one block per chunk).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from examples._support import KVCacheServerProcess
from kvcache_client import KVCacheClient
from kvcache_client.tensors import tensor_block_parts
from kvcache_core.keys import HEADS_LAYOUT_VERSION, Namespace, chunk_keys, head_block_key

HEADS, HEAD_SIZE, CHUNK = 8, 128, 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="4 chunks of 2 layers, 3 rounds")
    args = parser.parse_args()
    if args.quick:
        args.chunks, args.layers, args.rounds = 4, 2, 3
    namespace = Namespace(
        model_id="bench/heads",
        kv_dtype="bfloat16",
        chunk_tokens=CHUNK,
        num_layers=args.layers,
        num_kv_heads=HEADS,
        head_size=HEAD_SIZE,
        layout_version=HEADS_LAYOUT_VERSION,
    )
    keys = chunk_keys(list(range(args.chunks * CHUNK)), namespace)
    generator = torch.Generator().manual_seed(0)
    chunks = [
        torch.randn(args.layers, 2, HEADS, CHUNK, HEAD_SIZE, generator=generator).to(torch.bfloat16) for _ in keys
    ]
    chunk_bytes = chunks[0].nbytes
    ram = max(256 << 20, 2 * chunk_bytes * args.chunks)
    print(
        f"{args.chunks} chunks of {chunk_bytes / (1 << 20):.1f} MiB ({args.layers} layers x 2 x {HEADS} heads x "
        f"{CHUNK} tokens x {HEAD_SIZE}, bf16); medians of {args.rounds} rounds; ratios to n = {HEADS}"
    )
    rows = []
    with KVCacheServerProcess(ram_capacity=f"{ram >> 20}MiB", max_block_bytes="64MiB") as server:
        target = server.start()
        with KVCacheClient(target, timeout_s=120) as client:
            for n in (8, 4, 2, 1):
                blocks = [
                    (head_block_key(key, first, n, HEADS), chunk[:, :, first : first + n].contiguous())
                    for key, chunk in zip(keys, chunks, strict=True)
                    for first in range(0, HEADS, n)
                ]
                block_keys = [key for key, _ in blocks]
                times: dict[str, list[float]] = {"put": [], "get": [], "lookup": []}
                for _ in range(args.rounds):
                    client.delete(namespace, block_keys)
                    started = time.perf_counter()
                    result = client.put_many(namespace, [(k, tensor_block_parts(t, k)) for k, t in blocks])
                    times["put"].append(time.perf_counter() - started)
                    assert result.stored == len(blocks), result
                    started = time.perf_counter()
                    found = client.lookup(namespace, block_keys).prefix_length
                    times["lookup"].append(time.perf_counter() - started)
                    assert found == len(blocks)
                    started = time.perf_counter()
                    got = client.get_many(namespace, block_keys)
                    times["get"].append(time.perf_counter() - started)
                    assert all(block is not None for block in got)
                rows.append((n, len(blocks), {op: statistics.median(t) for op, t in times.items()}))
                client.delete(namespace, block_keys)
    base = rows[0][2]
    total = chunk_bytes * args.chunks
    print(" n | blocks |   put ms  ratio |   get ms  ratio |  get MB/s | lookup ms  ratio")
    for n, count, median in rows:
        print(
            f"{n:2d} | {count:6d} | {median['put'] * 1e3:8.1f} {median['put'] / base['put']:5.2f}x |"
            f" {median['get'] * 1e3:8.1f} {median['get'] / base['get']:5.2f}x | {total / median['get'] / 1e6:9.0f} |"
            f" {median['lookup'] * 1e3:9.2f} {median['lookup'] / base['lookup']:5.2f}x"
        )


if __name__ == "__main__":
    main()
