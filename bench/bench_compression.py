"""Compression of real-model-shaped KV by the tier codec (none, lz4, shuffle-lz4): ratio and speed.

Run from the repository root with the project's virtualenv:

    python bench/bench_compression.py              # full run (~1 minute)
    python bench/bench_compression.py --quick      # smoke run (< 30 s)
    python bench/bench_compression.py --json out.json

The KV: a Llama built in memory from a LlamaConfig (4 layers, hidden 512, 8 heads, 2 KV heads,
vocab 32000) with random weights (torch.manual_seed(--seed)), one forward pass with use_cache=True
over --tokens random token ids (seeded too). The model runs in each dtype (float32, float16,
bfloat16: the float32 weights cast, then the forward pass in that dtype), so the KV carries that
dtype's own rounding. The DynamicCache's per-layer keys and values are stacked into the canonical
layout [num_layers, 2, num_kv_heads, tokens, head_size] and cut into --chunk-tokens chunks; each
chunk becomes a block with kvcache_client.tensors.tensor_to_block, as the connectors store it.

For each dtype and each kvcache_server.tiers.codec.CompressionMode:
    ratio           block bytes / stored bytes, over all chunks (headers included; > 1 = smaller)
    compressed      chunks stored compressed (the codec stores a block as is when compressing does not
                    shrink it)
    compress MB/s   raw payload bytes / time of codec.encode over all chunks (NONE: a pass-through)
    decompress MB/s raw payload bytes / time of codec.decode over all chunks; decode always verifies the
                    XXH3 checksum, exactly as a lower tier's read path does, so NONE measures verification
Times are medians over repeated passes (MB/s = 10^6 B/s). Every stored block is checked to decode to
the original block.

Random-weight KV is not a trained model's KV: trained models have structured activations (outlier
channels, attention sinks, low-rank structure) that may compress better or worse than this. Treat the
ratios as indicative of the codec on near-Gaussian 16-bit data, not as a prediction for a real model.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import lz4
import numpy as np
import torch
import transformers
from _common import KiB, Measurement, TimingPlan, exit_on_sigterm, measure
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvcache_client.tensors import tensor_to_block
from kvcache_core.format import Compression, Layout, parse_header
from kvcache_server.tiers import codec
from kvcache_server.tiers.codec import CompressionMode

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MODES = (CompressionMode.NONE, CompressionMode.LZ4, CompressionMode.SHUFFLE_LZ4)
MODEL = {
    "vocab_size": 32000,
    "hidden_size": 512,
    "intermediate_size": 1376,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- the KV --------------------------------------------------------------------------------------


def build_model(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(**MODEL)
    return LlamaForCausalLM(config).eval()


def layer_kv(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) per layer, each [batch, kv_heads, tokens, head_size], across transformers versions."""
    layers = getattr(cache, "layers", None)
    if layers:  # transformers >= 4.56: cache.layers[i].keys / .values
        return [(layer.keys, layer.values) for layer in layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))  # older: parallel lists


def canonical_kv(model: LlamaForCausalLM, token_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[num_layers, 2, num_kv_heads, tokens, head_size] of one forward pass of `model` cast to `dtype`."""
    m = copy.deepcopy(model).to(dtype)
    cache = DynamicCache()
    # transformers 5 renamed `past_key_values` to `cache` (the old name warns); older releases know only the old one.
    name = "cache" if "cache" in inspect.signature(m.forward).parameters else "past_key_values"
    with torch.no_grad():
        m(token_ids, use_cache=True, logits_to_keep=1, **{name: cache})
    kv = torch.stack([torch.stack((k[0], v[0])) for k, v in layer_kv(cache)])
    if kv.dtype != dtype:
        raise RuntimeError(f"the cache holds {kv.dtype}, expected {dtype}")
    return kv.contiguous()


def chunk_key(i: int) -> bytes:
    """A stand-in chunk key (the codec binds nothing new to it; format v2 only needs one per block)."""
    return i.to_bytes(16, "little")


def chunk_blocks(kv: torch.Tensor, chunk_tokens: int) -> list[bytes]:
    tokens = kv.shape[3]
    return [
        tensor_to_block(kv[:, :, :, s : s + chunk_tokens].contiguous(), chunk_key(i), Layout.CANONICAL)
        for i, s in enumerate(range(0, tokens, chunk_tokens))
    ]


# -- measurement ---------------------------------------------------------------------------------


@dataclass
class Row:
    dtype: str
    mode: str
    chunks: int
    compressed_chunks: int
    block_bytes: int  # uncompressed blocks, headers included
    stored_bytes: int
    payload_bytes: int  # raw payload, the throughput numerator
    encode: Measurement
    decode: Measurement

    @property
    def ratio(self) -> float:
        return self.block_bytes / self.stored_bytes

    def to_json(self) -> dict[str, object]:
        return {
            "dtype": self.dtype,
            "mode": self.mode,
            "chunks": self.chunks,
            "compressed_chunks": self.compressed_chunks,
            "block_bytes": self.block_bytes,
            "stored_bytes": self.stored_bytes,
            "payload_bytes": self.payload_bytes,
            "ratio": self.ratio,
            "compress_mb_s": self.encode.mb_s,
            "decompress_mb_s": self.decode.mb_s,
            "compress_iters": self.encode.iters,
            "decompress_iters": self.decode.iters,
        }


def bench_mode(dtype: str, mode: CompressionMode, blocks: list[bytes], plan: TimingPlan) -> Row:
    stored = [codec.encode(b, mode) for b in blocks]
    for i, (b, s) in enumerate(zip(blocks, stored, strict=True)):
        if codec.decode(s, chunk_key(i)) != b:
            raise RuntimeError(f"{dtype} {mode}: chunk {i} does not decode to the original block")
    payload = sum(parse_header(b).raw_len for b in blocks)
    compressed = sum(parse_header(s).compression is not Compression.NONE for s in stored)
    enc = measure(dtype, str(mode), "encode", payload, lambda: [codec.encode(b, mode) for b in blocks], plan)
    dec = measure(
        dtype, str(mode), "decode", payload, lambda: [codec.decode(s, chunk_key(i)) for i, s in enumerate(stored)], plan
    )
    return Row(
        dtype,
        str(mode),
        len(blocks),
        compressed,
        sum(map(len, blocks)),
        sum(map(len, stored)),
        payload,
        enc,
        dec,
    )


def describe_kv(kv: torch.Tensor) -> str:
    k, v = kv[:, 0].float(), kv[:, 1].float()
    return (
        f"keys mean|x| {k.abs().mean():.3g} max|x| {k.abs().max():.3g}; "
        f"values mean|x| {v.abs().mean():.3g} max|x| {v.abs().max():.3g}"
    )


# -- report --------------------------------------------------------------------------------------


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    align = ["<", "<"] + [">"] * (len(headers) - 2)

    def line(cells: Sequence[str]) -> str:
        return "  ".join(f"{c:{a}{w}}" for c, a, w in zip(cells, align, widths, strict=True)).rstrip()

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *(line(r) for r in rows)])


def build_table(rows: Sequence[Row]) -> str:
    cells = []
    for r in rows:
        none = r.mode == CompressionMode.NONE
        cells.append(
            [
                r.dtype,
                r.mode,
                f"{r.block_bytes / KiB:,.0f}",
                f"{r.stored_bytes / KiB:,.0f}",
                f"{r.ratio:.3f}",
                f"{r.compressed_chunks}/{r.chunks}",
                "pass-through" if none else f"{r.encode.mb_s:,.0f}",
                f"{r.decode.mb_s:,.0f}" + (" (verify only)" if none else ""),
            ]
        )
    headers = ["dtype", "mode", "raw KiB", "stored KiB", "ratio", "compressed", "compress MB/s", "decompress MB/s"]
    return render_table(headers, cells)


# -- main ----------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Tier codec on random-weight Llama KV (see module docstring).")
    p.add_argument("--quick", action="store_true", help="smoke run: few iterations (< 30 s)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument("--tokens", type=int, default=512, help="prompt tokens of the forward pass (default 512)")
    p.add_argument("--chunk-tokens", type=int, default=256, help="tokens per block (default 256)")
    p.add_argument("--seed", type=int, default=0, help="torch seed of the weights and the token ids (default 0)")
    p.add_argument("--min-time", type=float, help="seconds per measurement (default 1.0, quick 0.1)")
    args = p.parse_args(argv)
    if args.tokens < 1 or args.chunk_tokens < 1:
        p.error("--tokens and --chunk-tokens must be positive")
    return args


def run(args: argparse.Namespace) -> int:
    t_start = time.monotonic()
    min_time = args.min_time if args.min_time is not None else (0.1 if args.quick else 1.0)
    plan = TimingPlan(
        min_time_s=min_time, min_iters=2 if args.quick else 5, max_iters=1000, max_time_s=max(3.0, min_time)
    )
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "lz4": lz4.library_version_string(),
        "numpy": np.__version__,
    }
    print("kvcache tier codec benchmark" + (" (--quick)" if args.quick else ""))
    print("  " + ", ".join(f"{k} {v}" for k, v in info.items()))
    model = build_model(args.seed)
    cfg = model.config
    head_size = cfg.hidden_size // cfg.num_attention_heads
    print(
        f"  model: random-weight Llama (seed {args.seed}), {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_attention_heads} heads, {cfg.num_key_value_heads} KV heads, head size {head_size}, "
        f"vocab {cfg.vocab_size}"
    )
    gen = torch.Generator().manual_seed(args.seed)
    token_ids = torch.randint(0, cfg.vocab_size, (1, args.tokens), generator=gen)
    print(
        f"  KV: one forward pass over {args.tokens} random tokens, chunks of {args.chunk_tokens} tokens "
        f"[{cfg.num_hidden_layers}, 2, {cfg.num_key_value_heads}, {args.chunk_tokens}, {head_size}]"
    )
    print(f"  timing: median over >= {plan.min_iters} passes and >= {plan.min_time_s:.1f}s per measurement\n")

    rows: list[Row] = []
    for dtype in DTYPES:
        t0 = time.perf_counter()
        kv = canonical_kv(model, token_ids, dtype)
        blocks = chunk_blocks(kv, args.chunk_tokens)
        print(
            f"  {dtype_name(dtype):<9} KV {tuple(kv.shape)} in {time.perf_counter() - t0:.1f}s, {len(blocks)} blocks "
            f"of {len(blocks[0]) / KiB:,.0f} KiB; {describe_kv(kv)}",
            flush=True,
        )
        for mode in MODES:
            rows.append(bench_mode(dtype_name(dtype), mode, blocks, plan))

    elapsed = time.monotonic() - t_start
    print()
    print(build_table(rows))
    print(
        "\nratio = block bytes / stored bytes (headers included). decompress includes the XXH3 checksum check that "
        "every lower-tier read does;\nNONE decode is that check alone. MB/s = 10^6 B/s of raw payload."
    )
    print(
        "note: random-weight KV (near-Gaussian activations) may compress differently from a trained model's KV "
        "(outlier channels,\n      attention sinks, low-rank structure): treat these ratios as indicative only."
    )
    print(f"\ntotal run time {elapsed:.1f} s")
    if args.json:
        doc = {
            "quick": args.quick,
            "timing": vars(plan),
            "versions": info,
            "model": {**MODEL, "seed": args.seed},
            "tokens": args.tokens,
            "chunk_tokens": args.chunk_tokens,
            "elapsed_s": elapsed,
            "results": [r.to_json() for r in rows],
        }
        Path(args.json).write_text(json.dumps(doc, indent=2))
        print(f"wrote {args.json}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    exit_on_sigterm()
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
