"""What the transformers examples, their tests and bench/bench_ttft.py share.

- `KVCacheServerProcess`: `python -m kvcache_server --port 0` in a child process, its address read from
  the first line it prints, stopped with SIGTERM for sure.
- `random_prompt`: fixed-seed token ids, standing in for a tokenizer's output.
- `greedy`: a forward pass over the tokens a cache does not hold, then greedy decoding; it reports the
  time to the first token and that token's logits, which `model.generate` does not expose cheaply.

This module imports no sibling module, so it loads both as `_support` (scripts in this folder) and as
`examples._support` (tests, the benchmark).
"""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel
    from transformers.cache_utils import Cache

# "kvcache-server 0.1.0 serving kvcache.v1.KVCache on 127.0.0.1:PORT (tiers: ...)"
_SERVING = re.compile(r" serving \S+ on (\S+):(\d+)(?: |$)")


class ServerStartError(RuntimeError):
    """The server child exited or printed no address line in time; the message ends with its stderr."""


class KVCacheServerProcess:
    """A kvcache server in a child process on a free port; a context manager.

    The child's stdout is read for the start-up line, then drained by a thread so the child never
    blocks on a full pipe; its stderr goes to a temporary file that start-up errors quote.
    """

    def __init__(
        self, *, ram_capacity: str = "1GiB", max_block_bytes: str = "64MiB", start_timeout_s: float = 60.0
    ) -> None:
        self.argv = [
            sys.executable,
            "-m",
            "kvcache_server",
            "--port",
            "0",
            "--ram-capacity",
            ram_capacity,
            "--max-block-bytes",
            max_block_bytes,
            "--log-level",
            "warning",
        ]
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.target = ""
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 (lives as long as the child; closed in stop)

    def start(self) -> str:
        """Starts the child and returns its address, "host:port", once it takes calls."""
        self.proc = subprocess.Popen(
            self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self._stderr, start_new_session=True
        )
        try:
            line = self._first_line()
            match = _SERVING.search(line)
            if match is None:
                raise ServerStartError(f"no address in the server's first line {line!r}{self._stderr_tail()}")
        except BaseException:
            self.stop()
            raise
        threading.Thread(target=self._drain, name="kvcache-server-stdout", daemon=True).start()
        self.target = f"{match.group(1)}:{match.group(2)}"
        return self.target

    def _first_line(self) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + self.start_timeout_s
        buf = b""
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while b"\n" not in buf:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ServerStartError(f"no start-up line within {self.start_timeout_s:.0f}s{self._stderr_tail()}")
                if not sel.select(remaining):
                    continue
                data = os.read(self.proc.stdout.fileno(), 4096)
                if not data:
                    code = self.proc.wait()
                    raise ServerStartError(f"the server exited with {code} before serving{self._stderr_tail()}")
                buf += data
        return buf.split(b"\n", 1)[0].decode(errors="replace")

    def _drain(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        while self.proc.stdout.read(65536):
            pass

    def _stderr_tail(self) -> str:
        self._stderr.seek(0)
        text = self._stderr.read()[-2000:].decode(errors="replace").strip()
        return f"\nserver stderr:\n{text}" if text else ""

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout_s`; returns the exit status (None if never started)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        self._stderr.close()
        return proc.returncode

    def __enter__(self) -> KVCacheServerProcess:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


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
