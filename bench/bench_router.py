"""Time to first token through kvcache-router against a decode worker doing the whole prompt, in one run.

Run from the repository root with the project's virtualenv:

    python bench/bench_router.py                 # 2048-token prompts, the bench chat model (~2 minutes on 2 cores)
    python bench/bench_router.py --quick         # tiny model, 256-token prompts: smoke run
    python bench/bench_router.py --tokens 4096 --repeats 5 --json out.json

Set-up, every piece its own process on loopback: a kvcache server (RAM tier), a prefill and a decode
worker (examples/openai_worker.py, one torch thread each, on a random-weight Llama with its tokenizer
from examples/make_chat_model.py --size bench: 6 layers, hidden 512), and kvcache-router in front of
them. Chunks of --chunk-tokens tokens. Every request is a streamed /v1/completions with max_tokens 8;
TTFT is the client's wall time from sending the request to the first event carrying a token.

    decode alone    the decode worker, called directly, computes a prompt nothing has stored: the baseline
    cold            a new prompt through the router: tokenize, lookup, prefill worker, decode worker
                    (which loads all prompt tokens but the last from kvcache and computes one)
    repeated        the same prompt again: the router finds it stored and skips the prefill worker
    shared system   one system prompt (whole chunks) and a new question per request (shorter than a
                    chunk): after the first, the router skips prefill and the decode worker computes
                    only the question. The first request, which stores the system prompt, is not timed.

Each row is the median of --repeats requests, each on a prompt of its own (repeated: each cold prompt
once more); the ratio is against decode alone. The router's own overhead is in every routed number:
one /tokenize call and one Lookup (X-KVCache-* headers report them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # for examples/

from examples._support import KVCacheServerProcess, OpenAIWorkerProcess, RouterProcess  # noqa: E402
from examples.make_chat_model import make_chat_model, vocabulary_words  # noqa: E402

WORDS = vocabulary_words()


def prompt(n: int, seed: int) -> str:
    """`n` words (`n` tokens) drawn from `seed`; different seeds share no chunk."""
    import random

    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def ttft(url: str, text: str, max_tokens: int) -> tuple[float, dict[str, str]]:
    """Seconds to the first token event of a streamed completion (the rest is read and dropped), and the headers."""
    body = json.dumps({"prompt": text, "max_tokens": max_tokens, "stream": True}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    first = None
    with urllib.request.urlopen(request, timeout=600) as resp:
        for line in resp:
            if first is None and line.startswith(b"data: {") and b'"text": "' in line:
                first = time.perf_counter() - start
        headers = dict(resp.headers)
    assert first is not None, "no token in the stream"
    return first, headers


def run(args: argparse.Namespace, workdir: str) -> list[dict[str, Any]]:
    size = "tiny" if args.quick else "bench"
    model = str(make_chat_model(Path(workdir) / "model", size=size))
    chunk = ("--chunk-tokens", str(args.chunk_tokens))
    n, q = args.tokens, args.question_tokens
    system_tokens = (n - q) // args.chunk_tokens * args.chunk_tokens
    with (
        KVCacheServerProcess(ram_capacity="2GiB") as kv,
        OpenAIWorkerProcess(model, "prefill", kv.target, *chunk) as prefill,
        OpenAIWorkerProcess(model, "decode", kv.target, *chunk) as decode,
        RouterProcess([prefill.url], [decode.url], kv.target) as router,
    ):
        ttft(decode.url, prompt(64, seed=999), args.max_tokens)  # warm both paths up: first calls pay for imports
        ttft(router.url, prompt(64, seed=998), args.max_tokens)
        rows: dict[str, list[float]] = {"decode alone": [], "cold": [], "repeated": [], "shared system": []}
        routes: dict[str, set[str]] = {name: set() for name in rows}

        def measure(name: str, url: str, text: str) -> None:
            seconds, headers = ttft(url, text, args.max_tokens)
            rows[name].append(seconds)
            routes[name].add(headers.get("X-KVCache-Route", "direct"))

        system = prompt(system_tokens, seed=500)
        ttft(router.url, f"{system} {prompt(q, seed=600)}", args.max_tokens)  # stores the system prompt
        for i in range(args.repeats):
            measure("decode alone", decode.url, prompt(n, seed=100 + i))
            cold = prompt(n, seed=200 + i)
            measure("cold", router.url, cold)
            measure("repeated", router.url, cold)
            measure("shared system", router.url, f"{system} {prompt(q, seed=700 + i)}")
    base = statistics.median(rows["decode alone"])
    return [
        {
            "scenario": name,
            "route": ",".join(sorted(routes[name])),
            "ttft_s": statistics.median(times),
            "ratio": statistics.median(times) / base,
            "runs": times,
        }
        for name, times in rows.items()
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model, short prompts (a smoke run)")
    p.add_argument("--tokens", type=int, help="prompt tokens (default 2048; 256 with --quick)")
    p.add_argument("--question-tokens", type=int, help="question tokens after the shared system prompt")
    p.add_argument("--chunk-tokens", type=int, help="tokens per kvcache chunk (default 256; 32 with --quick)")
    p.add_argument("--repeats", type=int, default=3, help="requests per scenario (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens each request generates (default %(default)s)")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args()
    args.tokens = args.tokens or (256 if args.quick else 2048)
    args.chunk_tokens = args.chunk_tokens or (32 if args.quick else 256)
    args.question_tokens = args.question_tokens or args.chunk_tokens // 2
    with tempfile.TemporaryDirectory(prefix="kvcache-bench-router-") as workdir:
        results = run(args, workdir)
    print(
        f"prompt {args.tokens} tokens, chunks of {args.chunk_tokens}, shared system prompt "
        f"{(args.tokens - args.question_tokens) // args.chunk_tokens * args.chunk_tokens} + question "
        f"{args.question_tokens} tokens; medians of {args.repeats}"
    )
    print(f"{'scenario':<14} | {'route':<11} | {'TTFT':>8} | ratio vs decode alone")
    for r in results:
        print(f"{r['scenario']:<14} | {r['route']:<11} | {r['ttft_s']:>7.3f}s | {r['ratio']:.3f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
