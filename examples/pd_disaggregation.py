"""Prefill/decode disaggregation with transformers and kvcache: two processes, one KV hand-off.

    python examples/pd_disaggregation.py                          # random small model, own server
    python examples/pd_disaggregation.py --model DIR --target 127.0.0.1:51051 --check

1. A kvcache server: the one at --target, or one started here (`python -m kvcache_server --port 0`).
2. A prefill process loads the model, runs the prompt once and stores its KV in kvcache.
3. A decode process, a different process with its own copy of the model, loads that KV (all of the
   prompt but its last token, see docs/transformers.md), computes only the last token and generates.
4. With --check, this process generates without any cache and compares: the tokens must be identical.

--model takes any full-attention causal LM folder or hub id (`AutoModelForCausalLM.from_pretrained`);
without it a random Llama is written to a temporary folder (examples/make_random_model.py). Prompts are
random token ids, so no tokenizer is needed. Both workers are started with the "spawn" method: fresh
interpreters sharing nothing with this one but the arguments they are given.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack
from typing import Any

from _support import KVCacheServerProcess, random_prompt
from make_random_model import make_random_model


def load_model(model_path: str) -> Any:
    """The model as any user loads a checkpoint, in inference mode."""
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(model_path).eval()


def prefill_worker(model_path: str, target: str, prompt: list[int], chunk_tokens: int) -> dict[str, Any]:
    """Runs in the prefill process: one forward pass over the prompt, its KV saved to kvcache."""
    import torch
    from transformers import DynamicCache

    from kvcache_client import KVCacheClient
    from kvcache_connectors.transformers import TransformersKVConnector, cache_kwargs, namespace_for_model

    model = load_model(model_path)
    with KVCacheClient(target, timeout_s=60) as client, torch.no_grad():
        connector = TransformersKVConnector(client, namespace_for_model(model, chunk_tokens=chunk_tokens))
        start = time.perf_counter()
        cache = DynamicCache()
        logits = model(torch.tensor([prompt]), use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache)).logits
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        stored = connector.save(prompt, cache)
        save_s = time.perf_counter() - start
    return {
        "pid": os.getpid(),
        "prefill_s": prefill_s,
        "save_s": save_s,
        "chunks_stored": stored,
        "bytes_sent": connector.stats.bytes_saved,
        "first_token": int(logits[0, -1].argmax()),
    }


def decode_worker(
    model_path: str, target: str, prompt: list[int], chunk_tokens: int, new_tokens: int
) -> dict[str, Any]:
    """Runs in the decode process: the prompt's KV fetched from kvcache, then `model.generate`."""
    import torch

    from kvcache_client import KVCacheClient
    from kvcache_connectors.transformers import TransformersKVConnector, cache_kwargs, namespace_for_model

    model = load_model(model_path)
    with KVCacheClient(target, timeout_s=60) as client, torch.no_grad():
        connector = TransformersKVConnector(client, namespace_for_model(model, chunk_tokens=chunk_tokens))
        start = time.perf_counter()
        cache, loaded = connector.load(prompt, device=model.device, config=model.config)
        load_s = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(
            torch.tensor([prompt], device=model.device),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            **cache_kwargs(model, cache),
        )
        generate_s = time.perf_counter() - start
    return {
        "pid": os.getpid(),
        "tokens_loaded": loaded,
        "bytes_loaded": connector.stats.bytes_loaded,
        "load_s": load_s,
        "generate_s": generate_s,
        "tokens": out[0, len(prompt) :].tolist(),
    }


def in_own_process(fn: Any, *args: Any) -> Any:
    """`fn(*args)` in a freshly spawned process that exits afterwards."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def reference_tokens(model_path: str, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy generation in this process, without kvcache."""
    import torch

    model = load_model(model_path)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt], device=model.device),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
        )
    return out[0, len(prompt) :].tolist()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint folder or hub id (default: a random small Llama in a temp folder)")
    p.add_argument("--target", help="kvcache server host:port (default: start one here)")
    p.add_argument("--prompt-tokens", type=int, default=1000, help="length of the random prompt (default %(default)s)")
    p.add_argument(
        "--new-tokens", type=int, default=16, help="tokens the decode process generates (default %(default)s)"
    )
    p.add_argument("--chunk-tokens", type=int, default=256, help="tokens per kvcache chunk (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt (default %(default)s)")
    p.add_argument("--check", action="store_true", help="also generate here without kvcache and compare (default: off)")
    args = p.parse_args()

    with ExitStack() as stack:
        model_path = args.model
        if model_path is None:
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvcache-pd-model-"))
            model_path = str(make_random_model(folder, size="small"))
            print(f"model: random small Llama written to {model_path}")
        target = args.target
        if target is None:
            target = stack.enter_context(KVCacheServerProcess()).target
            print(f"kvcache server: started on {target} (python -m kvcache_server --port 0)")
        else:
            print(f"kvcache server: {target}")

        from transformers import AutoConfig

        vocab_size = AutoConfig.from_pretrained(model_path).get_text_config(decoder=True).vocab_size
        prompt = random_prompt(args.prompt_tokens, vocab_size, args.seed)
        print(f"prompt: {len(prompt)} random token ids; chunks of {args.chunk_tokens} tokens")

        pre = in_own_process(prefill_worker, model_path, target, prompt, args.chunk_tokens)
        print(
            f"prefill pid {pre['pid']}: {len(prompt)} tokens in {pre['prefill_s'] * 1e3:.0f} ms; "
            f"stored {pre['chunks_stored']} chunks ({pre['bytes_sent'] / 2**20:.2f} MiB) "
            f"in {pre['save_s'] * 1e3:.0f} ms"
        )
        dec = in_own_process(decode_worker, model_path, target, prompt, args.chunk_tokens, args.new_tokens)
        print(
            f"decode  pid {dec['pid']}: loaded {dec['tokens_loaded']} tokens ({dec['bytes_loaded'] / 2**20:.2f} MiB) "
            f"in {dec['load_s'] * 1e3:.0f} ms, computed {len(prompt) - dec['tokens_loaded']}; "
            f"generated {len(dec['tokens'])} tokens in {dec['generate_s'] * 1e3:.0f} ms"
        )
        print(f"tokens: {dec['tokens']}")
        if dec["tokens"][0] != pre["first_token"]:
            print(f"MISMATCH: the prefill's first token was {pre['first_token']}", file=sys.stderr)
            return 1
        if args.check:
            ref = reference_tokens(model_path, prompt, args.new_tokens)
            if ref != dec["tokens"]:
                print(f"MISMATCH: without kvcache this process generates {ref}", file=sys.stderr)
                return 1
            print(f"check: pid {os.getpid()} without kvcache generated identical tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
