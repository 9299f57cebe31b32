"""A tiny hybrid model with a recurrent state group, for vLLM 0.33's OffloadingConnector on a CPU.

Layer 0 is full attention over fp16 K/V in the paged KV cache (vLLM's full-attention group). Layer 1 is
a recurrent layer (a Mamba stand-in) whose state lives in vLLM's Mamba cache, one page per block of a
`MambaSpec` group: a conv state (the last CONV inputs, fp16) and an SSM-like state (fp32), the same two
kinds of state a Mamba2 layer keeps. Greedy tokens depend on both: on every earlier position's K/V
(attention) and on the state carried from position to position (the recurrence).

vLLM's Mamba layers and its runner's state copies are Triton kernels, absent on a CPU; `run_step`
keeps the state the way vLLM 0.33's model runner and kernels do (vllm/v1/worker/mamba_utils.py,
`preprocess_mamba`):

- mamba_cache_mode "align" (prefix caching on): a step computing positions start..end-1 starts from
  the state held by block table[(start - 1) // BLOCK] (the state after token start - 1; none when
  start is 0), and leaves its final state once, in table[cdiv(end, BLOCK) - 1]. vLLM's scheduler
  ends every prefill step on a block boundary (or at the prompt's end), so a block whose tokens are all
  computed holds the state after its last token: the state vLLM's prefix cache hashes, and its
  offloading stores at chunk boundaries.
- mamba_cache_mode "none" (prefix caching off): one state block per request, table[0], read and
  written in place.

`generate` is the same computation with no cache at all (K/V and state in local variables).

The weights are random (fixed seed) and saved in the model directory (`state_model.pt`) beside a
tiny Llama's config.json, which is all vLLM's ModelConfig reads; the KV-cache config (harness.py,
`mamba_kv_cache_config`) is the one vLLM's hybrid allocator builds for such a model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import torch

from tests.vllm.harness import BLOCK, HEAD, KV_HEADS, TINY_MODEL, read_token, write_token

HIDDEN = KV_HEADS * 2 * HEAD  # the tiny models' shapes (TINY_MODEL)
VOCAB = 1000
assert (TINY_MODEL["hidden_size"], TINY_MODEL["vocab_size"]) == (HIDDEN, VOCAB)
MAX_POSITIONS = 256
CONV = 3  # the conv state: the last CONV inputs of the recurrent layer
STATE_SHAPES = ((CONV, HIDDEN), (HIDDEN,))  # as MambaSpec takes them: conv state, then the SSM-like state
STATE_DTYPES = (torch.float16, torch.float32)
WEIGHTS = "state_model.pt"


def save_state_model(path: Path) -> None:
    """Random weights (seed 0) of the model, into `path`."""
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * scale

    weights = {
        "embed": randn(VOCAB, HIDDEN, scale=1.0),
        "position": randn(MAX_POSITIONS, HIDDEN, scale=0.5),
        "wq": randn(HIDDEN, KV_HEADS * HEAD, scale=HIDDEN**-0.5),
        "wk": randn(HIDDEN, KV_HEADS * HEAD, scale=HIDDEN**-0.5),
        "wv": randn(HIDDEN, KV_HEADS * HEAD, scale=HIDDEN**-0.5),
        "wo": randn(KV_HEADS * HEAD, HIDDEN, scale=(KV_HEADS * HEAD) ** -0.5),
        "conv": randn(CONV + 1, HIDDEN, scale=0.6),
        "decay": torch.sigmoid(2.0 + randn(HIDDEN, scale=0.5)),  # ~0.88: a state remembers many tokens
        "w_in": randn(HIDDEN, HIDDEN, scale=HIDDEN**-0.5),
        "w_state": randn(HIDDEN, HIDDEN, scale=3 * HIDDEN**-0.5),
        "lm_head": randn(HIDDEN, VOCAB, scale=HIDDEN**-0.5),
    }
    torch.save(weights, path / WEIGHTS)


def state_views(page: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The conv and SSM-like states in one block's page (int8 bytes, as vLLM's allocate_kv_cache views it)."""
    flat = page.reshape(-1)
    conv_bytes = CONV * HIDDEN * 2
    conv = flat[:conv_bytes].view(torch.float16).view(CONV, HIDDEN)
    ssm = flat[conv_bytes : conv_bytes + HIDDEN * 4].view(torch.float32)
    return conv, ssm


class StateModel:
    """The model (see the module's docstring): one token per forward, from the paged K/V and a state."""

    def __init__(self, model_dir: str) -> None:
        torch.set_num_threads(1)  # one thread: the same sums in the same order in every process
        self.w: dict[str, torch.Tensor] = torch.load(Path(model_dir) / WEIGHTS)

    @torch.no_grad()
    def _token(
        self, token: int, p: int, prefix_kv: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Position p of `token` over the fp16 K/V [2, H, p, D] of 0..p-1 and the state after p - 1; returns
        its K/V [2, H, D] (fp16), the state after p (conv fp16, SSM fp32) and the logits."""
        w = self.w
        x = w["embed"][token] + w["position"][p]
        q = (x @ w["wq"]).view(KV_HEADS, HEAD)
        kv = torch.stack([(x @ w["wk"]).view(KV_HEADS, HEAD), (x @ w["wv"]).view(KV_HEADS, HEAD)]).half()
        keys = torch.cat([prefix_kv[0], kv[0, :, None]], dim=1).float()  # [H, p + 1, D]
        values = torch.cat([prefix_kv[1], kv[1, :, None]], dim=1).float()
        attention = torch.softmax((keys @ q[:, :, None])[..., 0] / HEAD**0.5, dim=-1)  # [H, p + 1]
        x = x + (attention[:, None, :] @ values)[:, 0].reshape(-1) @ w["wo"]
        window = torch.cat([conv, x.half()[None]])  # the conv inputs, stored as fp16
        mixed = torch.nn.functional.silu((window.float() * w["conv"]).sum(0))
        ssm = w["decay"] * ssm + (1 - w["decay"]) * torch.tanh(mixed @ w["w_in"])
        y = x + ssm @ w["w_state"]
        logits = (y * torch.rsqrt(y.pow(2).mean() + 1e-6)) @ w["lm_head"]
        return kv, window[1:].clone(), ssm, logits

    def run_step(
        self,
        caches: dict[str, torch.Tensor],
        names: Sequence[str],
        tables: Sequence[Sequence[int]],
        tokens: Sequence[int],
        start: int,
        end: int,
        mode: str,
    ) -> tuple[int, bytes]:
        """Computes positions start..end-1 of one request as vLLM's runner would in one step: K/V of layer
        names[0] through tables[0], the state of layer names[1] through tables[1] (mamba_cache_mode `mode`,
        see the module's docstring). Returns the greedy next token and the logits' bytes of position end-1."""
        attention, recurrent = caches[names[0]], caches[names[1]]
        attention_table, state_table = tables
        if mode == "align":
            source, target = (start - 1) // BLOCK if start else None, -(-end // BLOCK) - 1
        else:
            source, target = 0 if start else None, 0
        if source is None:
            conv, ssm = torch.zeros(CONV, HIDDEN, dtype=torch.float16), torch.zeros(HIDDEN)
        else:
            assert state_table[source] != 0, f"the state after token {start - 1} is in vLLM's null block"
            conv, ssm = (s.clone() for s in state_views(recurrent[state_table[source]]))
        kv_prefix = torch.zeros(2, KV_HEADS, start, HEAD, dtype=torch.float16)
        for q in range(start):
            block = attention_table[q // BLOCK]
            assert block != 0, f"position {q} is in vLLM's null block"
            kv_prefix[:, :, q] = read_token(attention, block, q % BLOCK)
        logits = torch.empty(0)
        for p in range(start, end):
            kv, conv, ssm, logits = self._token(tokens[p], p, kv_prefix, conv, ssm)
            write_token(attention, attention_table[p // BLOCK], p % BLOCK, kv)
            kv_prefix = torch.cat([kv_prefix, kv[:, :, None]], dim=2)
        assert state_table[target] != 0, f"the state after token {end - 1} would go to vLLM's null block"
        for view, value in zip(state_views(recurrent[state_table[target]]), (conv, ssm), strict=True):
            view.copy_(value)
        return int(logits.argmax()), logits.numpy().tobytes()

    def generate(self, prompt: Sequence[int], max_tokens: int) -> tuple[list[int], str]:
        """Greedy tokens and the digest of the logits they were sampled from, with no cache of any kind."""
        tokens = list(prompt)
        kv_prefix = torch.zeros(2, KV_HEADS, 0, HEAD, dtype=torch.float16)
        conv, ssm = torch.zeros(CONV, HIDDEN, dtype=torch.float16), torch.zeros(HIDDEN)
        digest = hashlib.sha256()
        for p in range(len(prompt) + max_tokens - 1):
            kv, conv, ssm, logits = self._token(tokens[p], p, kv_prefix, conv, ssm)
            kv_prefix = torch.cat([kv_prefix, kv[:, :, None]], dim=2)
            if p >= len(prompt) - 1:
                tokens.append(int(logits.argmax()))
                digest.update(logits.numpy().tobytes())
        return tokens[len(prompt) :], digest.hexdigest()
