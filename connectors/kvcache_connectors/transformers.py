"""Hugging Face transformers connector: a model's DynamicCache <-> kvcache chunks.

Who calls what (any process; nothing here is shared between processes but the server):

    prefill side    ns = namespace_for_model(model)              the key space, from the model's config
                    conn = TransformersKVConnector(client, ns)
                    out = model(input_ids, **cache_kwargs(model, DynamicCache()), use_cache=True)
                    conn.save(input_ids, cache)                  stores the chunks the server lacks
    decode side     cache, n = conn.load(input_ids)              longest stored prefix, at most len - 1 tokens
                    model.generate(input_ids, **cache_kwargs(model, cache), ...)   computes tokens n.. only

Layouts. A transformers DynamicCache holds, per layer, `keys` and `values` of shape
[batch, num_kv_heads, seq, head_size] (keys after RoPE, exactly as attention reads them). A kvcache
chunk holds tokens [i*C, i*C + T) of every layer in the canonical layout (docs/format.md):

    DynamicCache                              chunk i (C = chunk_tokens, T = C, or fewer for the tail)
    layers[l].keys   [1, H, S, D] ──┐         [num_layers, 2, H, T, D]
    layers[l].values [1, H, S, D] ──┴──────►  [l, 0, h, t, :] = layers[l].keys  [0, h, i*C + t, :]
                                              [l, 1, h, t, :] = layers[l].values[0, h, i*C + t, :]

Why `load` stops one token short. To generate, the model needs the logits of the prompt's last token,
and those come only from running that token. So `load` returns the KV of at most len(prompt) - 1
tokens (the stored prefix cut there, as `cache.crop` would) and the caller's forward pass or
`generate` computes the rest, at least the last token. Storing logits next to the KV would save one
token's forward pass at the price of a second kind of block; one token is cheap.

Failures. `load` is on a request's critical path and a miss is always safe (the model recomputes), so
a server that is down, slow or overloaded (Unavailable, DeadlineExceeded, ResourceExhausted) reads as
a miss: `(None, 0)`, logged and counted in `stats.load_failures`. A request the server refuses as
malformed or unauthorized raises: that is a configuration bug, and hiding it would be a silent 0 %
hit rate. `save` raises the SDK's error (a `KVCacheError`): in P/D disaggregation the prefill worker
must know that its hand-off failed. `save` never modifies the cache, so generation can go on with it.

Sliding-window and hybrid models (Mistral, Qwen2 with `use_sliding_window`, Gemma2/3, any mixed
`layer_types` of full and sliding attention). A token's K and V do not depend on the window, only the
attention that reads them does; so a chunk holds every layer's KV of every token, in the same
canonical layout as any model. Saving needs a cache that kept every token in every layer: prefill
with a plain `DynamicCache()` (its layers are full `DynamicLayer`s; the model's masks still apply the
window), not the model's own cache, whose `DynamicSlidingWindowLayer`s drop what falls out of the
window (such a cache is refused with ValueError naming the layer). `load(..., config=model.config)`
rebuilds the model's own cache layers: its sliding-window layers keep only their window, as after
the model's own prefill.

Limits: batch size 1; full-attention (`DynamicLayer`) and sliding-window (`DynamicSlidingWindowLayer`)
layers only. Linear-attention or recurrent-state layers, quantized, offloaded and static caches are
refused with ValueError rather than stored in a form nobody can read.

Just past the project's ~500-line module guideline: the connector, its stats and the tensor <-> chunk
conversions of one cache layout are read together (save and load are each other's inverse).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

import numpy as np
import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from kvcache_client import DeadlineExceeded, KVCacheClient, Namespace, ResourceExhausted, Unavailable
from kvcache_client.tensors import block_to_tensor
from kvcache_core.format import DType
from kvcache_core.keys import CANONICAL_LAYOUT, HEADS_LAYOUT_VERSION

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

log = logging.getLogger(__name__)

TokenIds = Sequence[int] | np.ndarray | torch.Tensor
"""A prompt: token ids as a list, a 1-D array, or a [1, seq] / [seq] tensor (batch size 1)."""

DEFAULT_CHUNK_TOKENS = 256

# Server trouble that recomputing answers: a load degrades to a miss. Anything else raises.
_DEGRADE_TO_MISS = (Unavailable, DeadlineExceeded, ResourceExhausted)

__all__ = [
    "DEFAULT_CHUNK_TOKENS",
    "ConnectorStats",
    "TokenIds",
    "TransformersKVConnector",
    "cache_from_chunks",
    "cache_kwargs",
    "chunks_from_cache",
    "namespace_for_model",
]


def namespace_for_model(
    model: PreTrainedModel,
    *,
    model_id: str | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    cache_salt: str = "",
    model_revision: str | None = None,
) -> Namespace:
    """The namespace of a model's KV: equal in every process that loads the same checkpoint.

    Args:
        model: A causal LM whose cache layers are full-attention or sliding-window ones (Llama, Qwen2,
            Mistral, Gemma2/3, mixed `layer_types`, ...).
        model_id: Identity of the weights; defaults to `config._name_or_path`, i.e. the hub id or the
            path given to `from_pretrained`. Pass one when that path differs between processes (a
            relative path, a copy on another machine) or for a model built in memory.
        chunk_tokens: Tokens per chunk; both sides must use the same value.
        cache_salt: Separates key spaces (per tenant, say); not an access control (docs/keys.md).
        model_revision: Checkpoint revision; defaults to the hub commit hash when the config has one.

    Raises:
        ValueError: The model has no usable id, a dtype kvcache cannot store, or a cache structure
            this connector does not support (linear attention or recurrent state, shared KV).
    """
    config = model.config
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    name = model_id if model_id is not None else getattr(config, "_name_or_path", "")
    if not name:
        raise ValueError("the model has no config._name_or_path (built in memory?): pass model_id=")
    revision = model_revision if model_revision is not None else (getattr(config, "_commit_hash", None) or "")
    kv_dtype = _dtype_name(model.dtype)
    # The layers generate() would build for this config: anything but a full or sliding-window layer
    # keeps something other than one K and one V per token (a recurrent state, nothing at all).
    probe = DynamicCache(config=config)
    unsupported = sorted({type(layer).__name__ for layer in probe.layers if type(layer) not in _KV_LAYERS})
    if unsupported:
        raise ValueError(
            f"unsupported cache layers {unsupported}: only full-attention (DynamicLayer) and sliding-window "
            "(DynamicSlidingWindowLayer) layers hold one K and one V per token"
        )
    if len(probe.layers) != text.num_hidden_layers:  # layers sharing another's KV (older transformers drop them)
        raise ValueError(
            f"{len(probe.layers)} cache layers for {text.num_hidden_layers} layers: shared KV is unsupported"
        )
    num_heads = text.num_attention_heads
    num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
    head_size = getattr(text, "head_dim", None) or text.hidden_size // num_heads
    return Namespace(
        model_id=name,
        model_revision=revision,
        kv_dtype=kv_dtype,
        chunk_tokens=chunk_tokens,
        num_layers=text.num_hidden_layers,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        cache_salt=cache_salt,
        layout_version=HEADS_LAYOUT_VERSION,  # all heads of an unsharded model: one block per chunk
    )


def cache_kwargs(model: PreTrainedModel, cache: Cache | None) -> dict[str, Cache]:
    """`{name: cache}` for `model(...)` and `model.generate(...)`, under the name this transformers uses.

    transformers 5 renamed `past_key_values` to `cache` (the old name warns, then goes away); older
    releases know only `past_key_values`. Returns {} for no cache.
    """
    if cache is None:
        return {}
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache}


def chunks_from_cache(cache: Cache, start: int, end: int, chunk_tokens: int) -> list[torch.Tensor]:
    """Tokens [start, end) of `cache` as canonical chunks [num_layers, 2, H, T, D], on the cache's device.

    `start` must be a chunk boundary; every chunk holds `chunk_tokens` tokens but the last, which holds
    what is left. Each chunk is a new contiguous tensor (the cache is not modified).
    """
    if start % chunk_tokens:
        raise ValueError(f"start {start} is not a multiple of chunk_tokens {chunk_tokens}")
    layers = _kv_layers(cache)
    seq = layers[0][0].shape[2]
    if not 0 <= start <= end <= seq:
        raise ValueError(f"tokens [{start}, {end}) are not in a cache of {seq} tokens")
    chunks = []
    for s in range(start, end, chunk_tokens):
        e = min(s + chunk_tokens, end)
        chunks.append(torch.stack([torch.stack((k[0, :, s:e], v[0, :, s:e])) for k, v in layers]))
    return chunks


def cache_from_chunks(
    chunks: Sequence[torch.Tensor],
    num_tokens: int,
    *,
    device: torch.device | str | None = None,
    config: PretrainedConfig | None = None,
) -> DynamicCache:
    """A DynamicCache holding the first `num_tokens` tokens of consecutive canonical chunks.

    Tokens past `num_tokens` (in the last chunk used) are left out, the same result as building the
    whole cache and calling `cache.crop`, without copying them. With the model's `config`, the cache
    has the model's own layers: a sliding-window layer then keeps the last `sliding_window - 1` tokens,
    exactly what the model's prefill of those tokens leaves; without it every layer keeps every token.
    """
    if not chunks:
        raise ValueError("no chunks")
    num_layers, _, heads, _, head_size = chunks[0].shape
    available = sum(c.shape[3] for c in chunks)
    if not 0 < num_tokens <= available:
        raise ValueError(f"num_tokens {num_tokens} not in [1, {available}]")
    # One CPU buffer, one transfer to the device; cache.update then gives each layer its own tensors.
    full = torch.empty((num_layers, 2, heads, num_tokens, head_size), dtype=chunks[0].dtype)
    pos = 0
    for chunk in chunks:
        take = min(chunk.shape[3], num_tokens - pos)
        full[:, :, :, pos : pos + take].copy_(chunk[:, :, :, :take])
        pos += take
        if pos == num_tokens:
            break
    if device is not None:
        full = full.to(device)
    cache = DynamicCache() if config is None else DynamicCache(config=config)
    if config is not None and len(cache.layers) != num_layers:
        raise ValueError(f"the config makes {len(cache.layers)} cache layers, the chunks hold {num_layers}")
    for layer in range(num_layers):
        cache.update(full[layer, 0].unsqueeze(0), full[layer, 1].unsqueeze(0), layer)
    return cache


@dataclass(slots=True)
class ConnectorStats:
    """Counters of one connector since it was made or last drained (`take_stats`).

    Attributes:
        loads: load calls.
        load_hits: loads that returned a cache.
        load_failures: loads that met server trouble and returned a miss instead.
        tokens_loaded: tokens whose KV was returned.
        chunks_loaded: chunks fetched and used (fully or in part).
        bytes_loaded: KV payload bytes fetched.
        invalid_chunks: fetched chunks whose shape or dtype did not fit the namespace (treated as misses).
        saves: save calls.
        chunks_saved: chunks the server stored.
        chunks_skipped: chunks the server already held (not sent).
        chunks_rejected: valid chunks the server could not keep (larger than its RAM tier).
        bytes_saved: block bytes sent.
    """

    loads: int = 0
    load_hits: int = 0
    load_failures: int = 0
    tokens_loaded: int = 0
    chunks_loaded: int = 0
    bytes_loaded: int = 0
    invalid_chunks: int = 0
    saves: int = 0
    chunks_saved: int = 0
    chunks_skipped: int = 0
    chunks_rejected: int = 0
    bytes_saved: int = 0


class _Default:
    """The type of _DEFAULT: an argument not given (None means "not retained")."""


_DEFAULT = _Default()


def _checked_ttl(ttl_s: float | None) -> float | None:
    number = isinstance(ttl_s, int | float) and not isinstance(ttl_s, bool)
    if ttl_s is not None and not (number and math.isfinite(ttl_s) and ttl_s > 0):
        raise ValueError(f"retain_ttl_s must be None or a positive, finite number of seconds; got {ttl_s!r}")
    return ttl_s


class TransformersKVConnector:
    """Saves and loads one model's KV for prompts of batch size 1.

    Safe to share between threads as the client is, except for the stats counters: use one connector
    per thread when their exact values matter.

    Args:
        client: The kvcache client; its deadline and retry policy apply to every call.
        namespace: From `namespace_for_model`; canonical layout, no tensor parallelism.
        retain_ttl_s: Every save asks the server to retain what it stores for this many seconds (a
            session that stays: docs/tiers.md, "Sessions that stay"); None (the default) retains
            nothing. A save may ask otherwise.
    """

    def __init__(self, client: KVCacheClient, namespace: Namespace, *, retain_ttl_s: float | None = None) -> None:
        if namespace.layout != CANONICAL_LAYOUT:
            raise ValueError(f"the transformers connector stores {CANONICAL_LAYOUT!r}, not {namespace.layout!r}")
        if namespace.tp_size != 1:
            raise ValueError("the transformers connector runs one unsharded model: tp_size must be 1")
        self.client = client
        self.namespace = namespace
        self.retain_ttl_s = _checked_ttl(retain_ttl_s)
        self.stats = ConnectorStats()

    def take_stats(self) -> ConnectorStats:
        """The counters so far; starts new ones."""
        taken = replace(self.stats)
        for f in fields(ConnectorStats):
            setattr(self.stats, f.name, 0)
        return taken

    def save(self, input_ids: TokenIds, cache: Cache, *, retain_ttl_s: float | _Default | None = _DEFAULT) -> int:
        """Stores the KV of `input_ids` (the first len(input_ids) tokens of `cache`) in chunks.

        One lookup finds the longest prefix the server already holds; only the chunks after it are
        built and sent. The final partial chunk is stored too, so the exact same prompt is found whole.
        The cache may hold more tokens than `input_ids` (after generation, say); the rest is ignored.

        Args:
            input_ids: The prompt (and what was generated, if the cache holds it).
            cache: The model's cache after running `input_ids`.
            retain_ttl_s: Retain the chunks this call stores for this many seconds (None: not
                retained); the connector's `retain_ttl_s` when not given. The chunks the server
                held already keep their own retention (a load's hit renews it).

        Returns:
            The number of chunks stored by this call (0 when all were stored already).

        Raises:
            ValueError: A batch larger than 1, a cache shorter than the prompt, a cache whose
                layers, heads, head size or dtype do not match the namespace, or a `retain_ttl_s`
                that is not a positive, finite number of seconds.
            KVCacheError: The server could not be reached or refused the blocks; nothing is
                guaranteed stored, and the cache is unchanged.
        """
        ttl = self.retain_ttl_s if isinstance(retain_ttl_s, _Default) else _checked_ttl(retain_ttl_s)
        tokens = _token_array(input_ids)
        self._check_cache(cache, len(tokens))
        self.stats.saves += 1
        if len(tokens) == 0:
            return 0
        keys = self.client.chunk_keys(tokens, self.namespace)
        stored = self.client.lookup(self.namespace, keys).prefix_length
        self.stats.chunks_skipped += stored
        if stored == len(keys):
            return 0
        size = self.namespace.chunk_tokens
        chunks = chunks_from_cache(cache, stored * size, len(tokens), size)
        result = self.client.put_tensors(self.namespace, keys[stored:], chunks, retain_ttl_s=ttl)
        self.stats.chunks_saved += result.stored
        self.stats.chunks_rejected += result.rejected
        self.stats.bytes_saved += result.bytes_sent
        return result.stored

    def load(
        self,
        input_ids: TokenIds,
        *,
        device: torch.device | str | None = None,
        config: PretrainedConfig | None = None,
    ) -> tuple[DynamicCache | None, int]:
        """A cache holding the longest stored prefix of `input_ids`, at most len(input_ids) - 1 tokens.

        One round trip fetches the chunks covering the first len - 1 tokens up to the first one
        missing; a chunk that is missing, fails its checksum or does not fit the namespace ends the
        prefix there, even if later chunks exist (their KV depends on it).

        Args:
            input_ids: The prompt.
            device: Where the cache's tensors go (the model's device); CPU by default.
            config: The model's config, to build the model's own cache layers (a sliding-window
                layer keeps only its window); None keeps every token in every layer.

        Returns:
            (cache, n): the KV of tokens [0, n), ready for `model.generate(input_ids, cache=cache)`
            or a forward pass on `input_ids[n:]`; or (None, 0) on a miss or server trouble.
        """
        tokens = _token_array(input_ids)
        self.stats.loads += 1
        limit = len(tokens) - 1  # the last prompt token is always run: its logits give the first new token
        if limit <= 0:
            return None, 0
        size = self.namespace.chunk_tokens
        # The prompt's own chunk keys (tail included), not those of tokens[:limit]: when len is a
        # multiple of chunk_tokens the last needed chunk is a full one, whose key is what was stored.
        keys = self.client.chunk_keys(tokens, self.namespace)[: -(-limit // size)]
        # Read in place (the server's arena, on its host) and copied once, into the cache's buffer.
        with contextlib.ExitStack() as held:
            try:
                blocks = held.enter_context(self.client.leased(self.namespace, keys, prefix_only=True))
            except _DEGRADE_TO_MISS as exc:
                self.stats.load_failures += 1
                log.warning("kvcache load failed, recomputing the prompt: %s", exc)
                return None, 0
            fetched = [None if b is None else block_to_tensor(b, verify=False) for b in blocks]  # verified
            chunks = self._valid_prefix(fetched, len(tokens))
            if not chunks:
                return None, 0
            num_tokens = min(limit, sum(c.shape[3] for c in chunks))
            cache = cache_from_chunks(chunks, num_tokens, device=device, config=config)
            if blocks.expired():  # the copy outlived the leases: not trusted
                self.stats.load_failures += 1
                log.warning("kvcache load outlived its arena leases, recomputing the prompt")
                return None, 0
            loaded, nbytes = len(chunks), sum(c.nbytes for c in chunks)
            del fetched, chunks  # the leases end with this block
        self.stats.load_hits += 1
        self.stats.tokens_loaded += num_tokens
        self.stats.chunks_loaded += loaded
        self.stats.bytes_loaded += nbytes
        return cache, num_tokens

    # -- checks --------------------------------------------------------------------------------

    def _expected_shape(self, index: int, prompt_len: int) -> tuple[int, ...]:
        ns = self.namespace
        tokens = min(ns.chunk_tokens, prompt_len - index * ns.chunk_tokens)
        return (ns.num_layers, 2, ns.num_kv_heads, tokens, ns.head_size)

    def _valid_prefix(self, fetched: Sequence[torch.Tensor | None], prompt_len: int) -> list[torch.Tensor]:
        """The chunks before the first missing or unfit one."""
        dtype = _torch_dtype(self.namespace.kv_dtype)
        chunks: list[torch.Tensor] = []
        for i, chunk in enumerate(fetched):
            if chunk is None:
                break
            want = self._expected_shape(i, prompt_len)
            if tuple(chunk.shape) != want or chunk.dtype != dtype:
                # Keys name the namespace, so this is a writer's bug, not a different model: refuse it.
                self.stats.invalid_chunks += 1
                log.error(
                    "chunk %d is %s %s, expected %s %s: treated as a miss",
                    i,
                    chunk.dtype,
                    tuple(chunk.shape),
                    dtype,
                    want,
                )
                break
            chunks.append(chunk)
        return chunks

    def _check_cache(self, cache: Cache, num_tokens: int) -> None:
        ns = self.namespace
        layers = _kv_layers(cache)
        if len(layers) != ns.num_layers:
            raise ValueError(f"the cache has {len(layers)} layers, the namespace {ns.num_layers}")
        keys = layers[0][0]
        batch, heads, seq, head_size = keys.shape
        if batch != 1:
            raise ValueError(f"the cache holds a batch of {batch}; the connector stores batch size 1")
        if (heads, head_size) != (ns.num_kv_heads, ns.head_size):
            raise ValueError(
                f"the cache has {heads} KV heads of size {head_size}, "
                f"the namespace {ns.num_kv_heads} of size {ns.head_size}"
            )
        if _dtype_name(keys.dtype) != ns.kv_dtype:
            raise ValueError(f"the cache is {keys.dtype}, the namespace {ns.kv_dtype}")
        if seq < num_tokens:
            raise ValueError(f"the cache holds {seq} tokens, fewer than the {num_tokens} to save")


_KV_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)
"""Cache layers that hold one K and one V per token (a sliding-window one, of the tokens in its window)."""


def _kv_layers(cache: Cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (keys, values) of every token, all of one shape; refuses a layer of another kind,
    and a sliding-window layer that has dropped tokens (its chunks would miss their beginning)."""
    layers = getattr(cache, "layers", None)
    if not layers:
        raise ValueError(f"{type(cache).__name__} has no layers (empty, or not a transformers Cache)")
    out = []
    for i, layer in enumerate(layers):
        if type(layer) not in _KV_LAYERS:
            raise ValueError(
                f"layer {i} is a {type(layer).__name__}: only DynamicLayer and DynamicSlidingWindowLayer are stored"
            )
        if layer.keys is None or layer.keys.dim() != 4:
            raise ValueError(f"layer {i} holds no KV")
        if isinstance(layer, DynamicSlidingWindowLayer) and layer.keys.shape[2] < layer.cumulative_length:
            raise ValueError(
                f"layer {i} is a DynamicSlidingWindowLayer (window {layer.sliding_window}) that kept only its last "
                f"{layer.keys.shape[2]} of {layer.cumulative_length} tokens: save from a cache that keeps every "
                "token, e.g. prefill with DynamicCache() instead of the model's own cache"
            )
        out.append((layer.keys.detach(), layer.values.detach()))
    shape = out[0][0].shape
    for i, (k, v) in enumerate(out):
        if k.shape != shape or v.shape != shape:
            raise ValueError(f"layer {i} has keys {tuple(k.shape)}, values {tuple(v.shape)}, layer 0 {tuple(shape)}")
    return out


def _token_array(input_ids: TokenIds) -> np.ndarray:
    """The prompt as a 1-D integer array, refusing a batch of more than one."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 2:
            if input_ids.shape[0] != 1:
                raise ValueError(f"input_ids has a batch of {input_ids.shape[0]}; the connector handles batch size 1")
            input_ids = input_ids[0]
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids must be [seq] or [1, seq], got shape {tuple(input_ids.shape)}")
        return input_ids.detach().cpu().numpy()
    arr = np.asarray(input_ids)
    if arr.ndim == 2 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 1:
        raise ValueError(f"input_ids must be one prompt ([seq] or [1, seq]), got shape {arr.shape}")
    return arr


def _dtype_name(dtype: torch.dtype) -> str:
    """torch.float32 -> "float32", checked against the dtypes a block can hold."""
    name = str(dtype).removeprefix("torch.")
    try:
        DType.from_name(name)
    except ValueError:
        raise ValueError(f"kvcache blocks cannot hold {dtype}") from None
    return name


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"this torch has no dtype {name!r}")
    return dtype
