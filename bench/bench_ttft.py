"""Time to first token (TTFT) of a transformers model with and without kvcache: cold, warm, half hit.

Run from the repository root with the project's virtualenv:

    python bench/bench_ttft.py                  # 1k, 4k, 8k tokens, the ~156M bench model (~5 minutes on 2 cores)
    python bench/bench_ttft.py --quick          # small model, 512 and 1k tokens: smoke run (< 1 minute)
    python bench/bench_ttft.py --dtype float32 --lengths 1024,4096 --json out.json

Set-up: a random Llama written by examples/make_random_model.py (--size bench: 8 layers, hidden 1024,
16 heads, 4 KV heads, ~156M parameters; bfloat16 by default, the dtype a server would run) and loaded
with `AutoModelForCausalLM.from_pretrained`, as a real checkpoint would be. A kvcache server runs in its
own process (`python -m kvcache_server --port 0`, RAM tier only); this process is its client
(KVCacheClient over gRPC on localhost) and runs the model on the CPU. Chunks of --chunk-tokens tokens.

For each prompt length L, prompts of random token ids:
    cold   no cache: one forward pass over all L tokens, then the argmax of the last logits.
    warm   the whole prompt was saved before: `connector.load` fetches the KV of L - 1 tokens (lookup and
           get over gRPC, checksum verification, building the DynamicCache), one forward pass over the
           last token, the argmax.
    half   only the first L/2 tokens were saved: load them, compute the other L/2.
TTFT is the wall time from having the token ids to having the first token, every load included. Saving
is timed on its own (it runs after the first token is out, from the cache the cold run left). Cold runs
--repeats - 1 times on the warm prompt and once on the half prompt (each needs a cold reference; at
least twice in all), warm and half --repeats times; the table shows medians. The
first token of warm and half is compared with cold's; in bfloat16 a near-tie between two logits can flip
it, so a difference is reported, not fatal, with the largest logit difference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # for examples/

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, PreTrainedModel  # noqa: E402
from transformers.cache_utils import Cache  # noqa: E402

from examples._support import KVCacheServerProcess, greedy, random_prompt  # noqa: E402
from examples.make_random_model import make_random_model, parameter_count  # noqa: E402
from kvcache_client import KVCacheClient  # noqa: E402
from kvcache_connectors.transformers import TransformersKVConnector, namespace_for_model  # noqa: E402

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class FirstToken:
    """One TTFT measurement, and the cache it left (the prompt's KV)."""

    token: int
    logits: torch.Tensor
    ttft_s: float
    load_s: float
    tokens_loaded: int
    bytes_loaded: int
    cache: Cache


@dataclass(frozen=True, slots=True)
class Row:
    """One prompt length's results; times in seconds (medians), bytes of KV payload."""

    tokens: int
    cold_s: float
    warm_s: float
    half_s: float
    warm_load_s: float
    half_load_s: float
    warm_tokens_loaded: int
    half_tokens_loaded: int
    warm_kv_bytes: int
    half_kv_bytes: int
    save_s: float
    save_bytes: int
    warm_same_token: bool
    half_same_token: bool
    max_logit_diff: float


def first_token(model: PreTrainedModel, connector: TransformersKVConnector | None, prompt: list[int]) -> FirstToken:
    """TTFT of `prompt`: the kvcache load (when a connector is given), then the forward pass."""
    start = time.perf_counter()
    if connector is None:
        cache, loaded, bytes_loaded = None, 0, 0
    else:
        before = connector.stats.bytes_loaded
        cache, loaded = connector.load(prompt, device=model.device)
        bytes_loaded = connector.stats.bytes_loaded - before
    load_s = time.perf_counter() - start
    out = greedy(model, prompt, cache=cache, cached_tokens=loaded, new_tokens=1)
    return FirstToken(out.tokens[0], out.first_logits, load_s + out.ttft_s, load_s, loaded, bytes_loaded, out.cache)


def timed_save(connector: TransformersKVConnector, prompt: list[int], cache: Cache) -> tuple[float, int]:
    """Saves the KV of `prompt` from `cache`; returns (seconds, bytes sent)."""
    before = connector.stats.bytes_saved
    start = time.perf_counter()
    connector.save(prompt, cache)
    return time.perf_counter() - start, connector.stats.bytes_saved - before


def measure(model: PreTrainedModel, connector: TransformersKVConnector, length: int, repeats: int, seed: int) -> Row:
    vocab = model.config.get_text_config(decoder=True).vocab_size
    full = random_prompt(length, vocab, seed)
    halved = random_prompt(length, vocab, seed + 1)

    cold = [first_token(model, None, full) for _ in range(max(1, repeats - 1))]
    cold.append(first_token(model, None, halved))
    # What a server does after answering: save the prompt's KV from the cache the prefill left.
    save_s, save_bytes = timed_save(connector, full, cold[0].cache)
    timed_save(connector, halved[: length // 2], cold[-1].cache)  # only the first half of this one
    reference_full, reference_half = cold[0], cold[-1]
    cold_s = statistics.median(r.ttft_s for r in cold)
    del cold

    warm, half = [], []
    for _ in range(repeats):  # interleaved, so that a noisy moment of the machine hits both alike
        warm.append(first_token(model, connector, full))
        half.append(first_token(model, connector, halved))
    diffs = [float((r.logits - reference_full.logits).abs().max()) for r in warm]
    diffs += [float((r.logits - reference_half.logits).abs().max()) for r in half]
    return Row(
        tokens=length,
        cold_s=cold_s,
        warm_s=statistics.median(r.ttft_s for r in warm),
        half_s=statistics.median(r.ttft_s for r in half),
        warm_load_s=statistics.median(r.load_s for r in warm),
        half_load_s=statistics.median(r.load_s for r in half),
        warm_tokens_loaded=warm[0].tokens_loaded,
        half_tokens_loaded=half[0].tokens_loaded,
        warm_kv_bytes=warm[0].bytes_loaded,
        half_kv_bytes=half[0].bytes_loaded,
        save_s=save_s,
        save_bytes=save_bytes,
        warm_same_token=all(r.token == reference_full.token for r in warm),
        half_same_token=all(r.token == reference_half.token for r in half),
        max_logit_diff=max(diffs),
    )


def print_table(rows: Sequence[Row]) -> None:
    print()
    print(
        "tokens |  cold TTFT |        warm TTFT (load)   ratio |        half TTFT (load)   ratio |"
        " KV loaded warm / half |  save (KV sent)"
    )
    for r in rows:
        warm = f"{r.warm_s:>8.3f} s ({r.warm_load_s:>6.3f} s) {r.warm_s / r.cold_s:>6.3f}x"
        half = f"{r.half_s:>8.3f} s ({r.half_load_s:>6.3f} s) {r.half_s / r.cold_s:>6.3f}x"
        print(
            f"{r.tokens:>6} | {r.cold_s:>8.3f} s | {warm} | {half} |"
            f" {r.warm_kv_bytes / MiB:>7.1f} / {r.half_kv_bytes / MiB:>6.1f} MiB |"
            f" {r.save_s:>6.3f} s ({r.save_bytes / MiB:.1f} MiB)"
        )
    print()
    for r in rows:
        print(
            f"{r.tokens:>6} tokens: warm loaded {r.warm_tokens_loaded}, half loaded {r.half_tokens_loaded}; "
            f"first token as cold: warm {'yes' if r.warm_same_token else 'NO'}, "
            f"half {'yes' if r.half_same_token else 'NO'}; max |logit diff| {r.max_logit_diff:.2e}"
        )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small model, 512 and 1024 tokens, one repeat")
    p.add_argument("--model", help="checkpoint folder to use instead of writing a random one")
    p.add_argument("--size", choices=("small", "bench"), help="random model size (default: bench, small with --quick)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--lengths", help="comma-separated prompt lengths (default 1024,4096,8192)")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, help="warm and half runs per length (default 3, 1 with --quick)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the rows to this file")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    size = args.size or ("small" if args.quick else "bench")
    lengths = [int(x) for x in (args.lengths or ("512,1024" if args.quick else "1024,4096,8192")).split(",")]
    repeats = args.repeats or (1 if args.quick else 3)
    transformers.utils.logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="kvcache-bench-model-") as folder:
        model_path = args.model or str(make_random_model(folder, size=size, dtype=args.dtype, seed=0))
        model = AutoModelForCausalLM.from_pretrained(model_path).eval()
        # Room for every prompt's KV, the half prompts' included, with margin.
        kv_bytes_per_token = 2 * model.config.num_hidden_layers * model.config.num_key_value_heads
        kv_bytes_per_token *= model.config.head_dim * model.dtype.itemsize
        capacity_mib = max(256, 3 * kv_bytes_per_token * sum(lengths) // MiB)
        with KVCacheServerProcess(ram_capacity=f"{capacity_mib}MiB") as server:
            print(
                f"model: {'random ' + size if not args.model else model_path} Llama, "
                f"{parameter_count(size) / 1e6 if not args.model else model.num_parameters() / 1e6:.0f}M parameters, "
                f"{model.dtype}, {model.config.num_hidden_layers} layers, "
                f"{kv_bytes_per_token / 1024:.0f} KiB of KV per token"
            )
            print(
                f"kvcache server {server.target} (own process, RAM tier {capacity_mib} MiB); "
                f"chunks of {args.chunk_tokens} tokens; torch {torch.__version__}, {torch.get_num_threads()} threads"
            )
            with KVCacheClient(server.target, timeout_s=120) as client:
                ns = namespace_for_model(model, chunk_tokens=args.chunk_tokens, cache_salt=f"bench-{time.time_ns()}")
                connector = TransformersKVConnector(client, ns)
                # Untimed warm-up: first-call allocations in torch, the gRPC channel's connection.
                warm_up = random_prompt(min(lengths), model.config.vocab_size, args.seed + 99)
                for _ in range(2):
                    timed_save(connector, warm_up, first_token(model, None, warm_up).cache)
                    first_token(model, connector, warm_up)
                rows = []
                for length in lengths:
                    rows.append(measure(model, connector, length, repeats, args.seed + length))
                    r = rows[-1]
                    print(f"  {length} tokens: cold {r.cold_s:.3f} s, warm {r.warm_s:.3f} s, half {r.half_s:.3f} s")
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
