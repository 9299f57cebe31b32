"""What the transformers examples, their tests and bench/bench_ttft.py share.

- `KVCacheServerProcess`: `python -m kvcache_server --port 0` in a child process (kvcache_server.launcher),
  its address read from the first line it prints, stopped with SIGTERM for sure.
- `random_prompt`: fixed-seed token ids, standing in for a tokenizer's output.
- `greedy`: a forward pass over the tokens a cache does not hold, then greedy decoding; it reports the
  time to the first token and that token's logits, which `model.generate` does not expose cheaply.
- `OpenAIWorkerProcess`, `RouterProcess`: examples/openai_worker.py and kvcache-router in child
  processes on free ports, for tests/test_router.py and bench/bench_router.py.

This module imports no sibling module, so it loads both as `_support` (scripts in this folder) and as
`examples._support` (tests, the benchmark).
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvcache_server.launcher import ChildServer, LocalKVCacheServer

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel
    from transformers.cache_utils import Cache


class KVCacheServerProcess(LocalKVCacheServer):
    """A kvcache server in a child process on a free port (kvcache_server.launcher); a context manager."""

    def __init__(
        self, *, ram_capacity: str = "1GiB", max_block_bytes: str = "64MiB", start_timeout_s: float = 60.0
    ) -> None:
        super().__init__(
            "--ram-capacity",
            ram_capacity,
            "--max-block-bytes",
            max_block_bytes,
            "--log-level",
            "warning",
            start_timeout_s=start_timeout_s,
        )


class OpenAIWorkerProcess(ChildServer):
    """examples/openai_worker.py in a child process on a free port; a context manager.

    Args:
        model: The model folder (examples/make_chat_model.py).
        role: "prefill" or "decode".
        kvcache: The kvcache server's host:port.
        args: More worker flags (--chunk-tokens 16, --delay-s 2, ...).
    """

    def __init__(self, model: str, role: str, kvcache: str, *args: str, start_timeout_s: float = 120.0) -> None:
        script = Path(__file__).resolve().parent / "openai_worker.py"
        argv = [sys.executable, str(script), "--model", model, "--role", role, "--kvcache", kvcache, *args]
        super().__init__(f"openai-worker-{role}", argv)
        self.start_timeout_s = start_timeout_s
        self.url = ""

    def __enter__(self) -> OpenAIWorkerProcess:
        match = self.launch(re.compile(r" on (\S+):(\d+)$"), self.start_timeout_s)
        assert match is not None
        self.url = f"http://{match.group(1)}:{match.group(2)}"
        return self


class RouterProcess(ChildServer):
    """`python -m kvcache_router --port 0` in a child process; a context manager.

    Args:
        prefill: Prefill worker URLs.
        decode: Decode worker URLs.
        kvcache: The kvcache server's host:port, or "" for no lookups.
        args: More router flags (--set workers.health_interval_s=0.2, ...).
    """

    def __init__(
        self, prefill: Sequence[str], decode: Sequence[str], kvcache: str, *args: str, start_timeout_s: float = 60.0
    ) -> None:
        argv = [sys.executable, "-m", "kvcache_router", "--port", "0", "--log-level", "warning"]
        argv += [f"--prefill={url}" for url in prefill] + [f"--decode={url}" for url in decode]
        argv += ["--kvcache", kvcache] if kvcache else []
        super().__init__("kvcache-router", [*argv, *args])
        self.start_timeout_s = start_timeout_s
        self.url = ""

    def __enter__(self) -> RouterProcess:
        match = self.launch(re.compile(r" serving \S+ on (\S+):(\d+) "), self.start_timeout_s)
        assert match is not None
        self.url = f"http://{match.group(1)}:{match.group(2)}"
        return self


def random_prompt(num_tokens: int, vocab_size: int, seed: int) -> list[int]:
    """`num_tokens` token ids in [0, vocab_size), the same for the same seed on every machine."""
    return np.random.default_rng(seed).integers(0, vocab_size, num_tokens).tolist()


@dataclass(slots=True)
class Greedy:
    """What `greedy` produced.

    Attributes:
        tokens: The new tokens.
        first_logits: Logits that chose the first new token (float32, on CPU).
        ttft_s: Seconds from the call to the first token, the load of a cache not included.
        cache: The cache after the prompt (and the new tokens but the last): save it to reuse it.
    """

    tokens: list[int]
    first_logits: torch.Tensor
    ttft_s: float
    cache: Cache = field(repr=False)


def greedy(
    model: PreTrainedModel, prompt: list[int], *, cache: Cache | None, cached_tokens: int, new_tokens: int
) -> Greedy:
    """Greedy decoding of `new_tokens` tokens after `prompt`, of which `cache` holds the first `cached_tokens`.

    The same computation as `model.generate(..., do_sample=False)`, written out so the first token
    can be timed alone: one forward pass over prompt[cached_tokens:], then one per new token.
    """
    import torch
    from transformers import DynamicCache

    from kvcache_connectors.transformers import cache_kwargs

    if not 0 <= cached_tokens < len(prompt):
        raise ValueError(f"cached_tokens {cached_tokens} must leave at least one of {len(prompt)} tokens to compute")
    if cache is None:
        cache = DynamicCache()
    kw = cache_kwargs(model, cache)
    device = model.device
    with torch.no_grad():
        start = time.perf_counter()
        ids = torch.tensor([prompt[cached_tokens:]], device=device)
        logits = model(input_ids=ids, use_cache=True, logits_to_keep=1, **kw).logits[0, -1]
        token = int(logits.argmax())
        ttft_s = time.perf_counter() - start
        first_logits = logits.float().cpu()
        tokens = [token]
        for _ in range(new_tokens - 1):
            ids = torch.tensor([[token]], device=device)
            token = int(model(input_ids=ids, use_cache=True, logits_to_keep=1, **kw).logits[0, -1].argmax())
            tokens.append(token)
    return Greedy(tokens=tokens, first_logits=first_logits, ttft_s=ttft_s, cache=cache)
