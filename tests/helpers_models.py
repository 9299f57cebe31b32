"""Builders for the transformers connector tests: a random model on disk, prefill and reference runs,
and the prefill and decode workers that tests/test_pd_end_to_end.py runs in spawned processes.

The workers live in an importable module (not in a test file) because a spawned process re-imports
the function it runs by its module's name.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache, MistralConfig, MistralForCausalLM, PreTrainedModel

from examples.make_random_model import make_random_model
from kvcache_client import KVCacheClient
from kvcache_connectors.transformers import TransformersKVConnector, cache_kwargs, namespace_for_model

T = TypeVar("T")

VOCAB = 4096
"""Vocabulary of the "small" random model (examples/make_random_model.py)."""


def write_small_model(folder: Path) -> str:
    """The small random Llama (float32, seed 0) saved to `folder`; returns the path to load."""
    return str(make_random_model(folder, size="small", dtype="float32", seed=0))


SLIDING_WINDOW = 8
"""Window of the sliding-window model: shorter than every prompt its tests run."""


def write_sliding_window_model(folder: Path) -> str:
    """A small random-weight Mistral whose every layer attends to a window of SLIDING_WINDOW tokens
    (float32, seed 0), saved to `folder` as a user's checkpoint is; returns the path to load."""
    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=SLIDING_WINDOW,
        max_position_embeddings=1024,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
    )
    MistralForCausalLM(config).eval().save_pretrained(folder)
    return str(folder)


def load_model(path: str) -> PreTrainedModel:
    """The model as a user loads a checkpoint, in inference mode."""
    transformers.utils.logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(path).eval()


def prefill(model: PreTrainedModel, prompt: list[int]) -> DynamicCache:
    """The cache after one forward pass over `prompt`."""
    cache = DynamicCache()
    with torch.no_grad():
        model(torch.tensor([prompt]), use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache))
    return cache


@dataclass(frozen=True, slots=True)
class Generated:
    """Greedy output of `model.generate`, and the logits that chose its first token (float32, CPU)."""

    tokens: list[int]
    first_logits: torch.Tensor


def generate(model: PreTrainedModel, prompt: list[int], new_tokens: int, cache: DynamicCache | None) -> Generated:
    """`model.generate`, greedy, exactly `new_tokens` tokens, optionally continuing from `cache`."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            **cache_kwargs(model, cache),
        )
    return Generated(out.sequences[0, len(prompt) :].tolist(), out.logits[0][0].float().clone())


def in_spawned_process(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in a fresh interpreter ("spawn"), which exits before this returns."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def prefill_worker(model_path: str, target: str, prompts: list[list[int]], chunk_tokens: int) -> dict[str, Any]:
    """The prefill process: each prompt run once, its KV saved; returns the chunks each save stored."""
    model = load_model(model_path)
    with KVCacheClient(target, timeout_s=30) as client:
        connector = TransformersKVConnector(client, namespace_for_model(model, chunk_tokens=chunk_tokens))
        stored = [connector.save(prompt, prefill(model, prompt)) for prompt in prompts]
    return {"pid": os.getpid(), "stored": stored}


def decode_worker(
    model_path: str, target: str, prompts: list[list[int]], chunk_tokens: int, new_tokens: int
) -> dict[str, Any]:
    """The decode process: each prompt's KV loaded, then `model.generate`.

    Returns plain data only: a tensor would leave this process through shared memory, which the
    process, exiting right after, could tear down before the parent maps it.
    """
    model = load_model(model_path)
    results = []
    with KVCacheClient(target, timeout_s=30) as client:
        connector = TransformersKVConnector(client, namespace_for_model(model, chunk_tokens=chunk_tokens))
        for prompt in prompts:
            cache, loaded = connector.load(prompt, config=model.config)  # the model's own cache layers
            out = generate(model, prompt, new_tokens, cache)
            results.append({"loaded": loaded, "tokens": out.tokens, "first_logits": out.first_logits.tolist()})
    return {"pid": os.getpid(), "results": results}
