"""Prefix reuse: many prompts behind one long system prompt, whose KV is computed once.

    python examples/prefix_reuse.py                               # random small model, own server
    python examples/prefix_reuse.py --model DIR --target 127.0.0.1:51051 --system-tokens 4096

Every request is `system prompt + its own question`. Each is answered twice, greedily: once computing
the whole prompt (no cache), once through kvcache: load the longest stored prefix, compute the rest,
save what is new. The first request finds nothing and stores the system prompt's chunks; every later
one loads them and computes only its question. The table shows what each computed and its time to
first token (TTFT, the kvcache load included); the tokens of both ways must be identical.

Only whole chunks are shared: a system prompt of 2000 tokens with 256-token chunks shares 1792 of
them, because the chunk holding tokens 1792..2047 differs per question. Make the shared part a
multiple of --chunk-tokens to reuse all of it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from contextlib import ExitStack

from _support import KVCacheServerProcess, greedy, random_prompt
from make_random_model import make_random_model


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint folder or hub id (default: a random small Llama in a temp folder)")
    p.add_argument("--target", help="kvcache server host:port (default: start one here)")
    p.add_argument(
        "--system-tokens", type=int, default=2048, help="length of the shared system prompt (default %(default)s)"
    )
    p.add_argument(
        "--questions", type=int, default=6, help="requests, each with its own question (default %(default)s)"
    )
    p.add_argument("--question-tokens", type=int, default=40, help="length of each question (default %(default)s)")
    p.add_argument("--new-tokens", type=int, default=8, help="tokens generated per request (default %(default)s)")
    p.add_argument("--chunk-tokens", type=int, default=256, help="tokens per kvcache chunk (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default %(default)s)")
    args = p.parse_args()

    import transformers
    from transformers import AutoModelForCausalLM

    from kvcache_client import KVCacheClient
    from kvcache_connectors.transformers import TransformersKVConnector, namespace_for_model

    transformers.utils.logging.disable_progress_bar()
    with ExitStack() as stack:
        model_path = args.model
        if model_path is None:
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvcache-reuse-model-"))
            model_path = str(make_random_model(folder, size="small"))
        target = args.target or stack.enter_context(KVCacheServerProcess()).target
        model = AutoModelForCausalLM.from_pretrained(model_path).eval()
        client = stack.enter_context(KVCacheClient(target, timeout_s=60))
        connector = TransformersKVConnector(client, namespace_for_model(model, chunk_tokens=args.chunk_tokens))
        vocab = model.config.get_text_config(decoder=True).vocab_size
        system = random_prompt(args.system_tokens, vocab, args.seed)
        print(f"model {model_path} ({model.dtype}), kvcache {target}, chunks of {args.chunk_tokens} tokens")
        print(f"system prompt: {len(system)} tokens; {args.questions} questions of {args.question_tokens} tokens\n")

        greedy(model, system, cache=None, cached_tokens=0, new_tokens=1)  # first-call set-up, not timed
        print("                                   no cache  with kvcache")
        print("request  prompt  loaded  computed      TTFT    load + compute =   TTFT  same tokens")
        total_plain = total_cached = 0.0
        identical = True
        for i in range(args.questions):
            prompt = system + random_prompt(args.question_tokens, vocab, args.seed + 1 + i)
            plain = greedy(model, prompt, cache=None, cached_tokens=0, new_tokens=args.new_tokens)

            start = time.perf_counter()
            cache, loaded = connector.load(prompt, device=model.device, config=model.config)
            load_s = time.perf_counter() - start
            cached = greedy(model, prompt, cache=cache, cached_tokens=loaded, new_tokens=args.new_tokens)
            cached_ttft_s = load_s + cached.ttft_s  # greedy() times the forward pass only
            connector.save(prompt, cached.cache)

            same = plain.tokens == cached.tokens
            identical &= same
            total_plain += plain.ttft_s
            total_cached += cached_ttft_s
            print(
                f"{i:>7} {len(prompt):>7} {loaded:>7} {len(prompt) - loaded:>9} {plain.ttft_s * 1e3:>7.0f} ms "
                f"{load_s * 1e3:>7.0f} + {cached.ttft_s * 1e3:>7.0f} = {cached_ttft_s * 1e3:>7.0f} ms  "
                f"{'yes' if same else 'NO'}"
            )
        print(f"\ntotal TTFT: {total_plain * 1e3:.0f} ms without a cache, {total_cached * 1e3:.0f} ms with kvcache")
        if not identical:
            print("MISMATCH: kvcache changed the generated tokens", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
