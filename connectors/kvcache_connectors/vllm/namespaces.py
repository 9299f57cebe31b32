"""Which kvcache namespace a vLLM instance's KV goes under, per tensor-parallel shard.

A namespace (docs/keys.md) fingerprints everything that makes two chunks' KV
incompatible. The facts come from vLLM's configs and the KV-cache spec that the
scheduler and every worker receive alike, so both processes derive the same
namespaces without talking to each other and without PYTHONHASHSEED:

    model_id, model_revision      --model / --revision (or the model_id / model_revision keys)
    kv_dtype                      the KV-cache spec's dtype ("bfloat16", ...)
    layout, layout_version        kvcache.canonical v2 (head-sharded), or kvcache.mla v1 for latent (MLA) caches
    chunk_tokens                  the chunk_tokens key
    num_layers                    layers of the KV-cache group
    num_kv_heads, head_size       all KV heads of the model (MLA: 1 and the latent size)
    tp_size, tp_rank              1 and 0 (MLA: shards and this shard's index, see below)
    cache_salt                    the request's cache_salt
    extra                         namespace_extra, plus vllm.* facts: --kv-cache-dtype when not
                                  "auto", --quantization, the request's LoRA adapter (lora_fact)
                                  and multimodal inputs (mm_fact), and for a hybrid model the
                                  group's spec (vllm.kv_group) and layers (vllm.kv_group_layers)

The request's facts join user-supplied strings (adapter names and paths, multimodal
identifiers, which may be the request's own multi_modal_uuids) with "@" and ";"; each
string is percent-escaped first (escape_fact), so two different requests never give one
value, and one request gives the same value in every process and language.

Hybrid models (vLLM's hybrid memory allocator): every KV-cache group is its own KVFacts
and namespace, so chunks of a full-attention group and of a sliding-window group never
mix, while their keys chain over the same tokens. A model with one full-attention (or
MLA) group keeps the namespace it always had. Supported group specs: FullAttentionSpec,
MLAAttentionSpec and SlidingWindowSpec, all of one block size; any other spec vLLM can
configure (Mamba-style state, chunked-local, sink, ring-buffer, sliding-window MLA with
bounded replay, packed or compressed pages, ...) is refused at start-up, naming it.

Tensor parallelism, head-sharded (kvcache.canonical v2): the namespace holds the model's
KV whatever the TP size, and each chunk is stored as blocks of `heads_per_block`
consecutive KV heads, under keys derived from the chunk key and the head range
(keys.head_block_key). `heads_per_block` defaults to a rank's head count, so at equal TP
size a rank's heads are one block per chunk (one Get, one Put per rank and step, as
before); instances of TP 1, 2 and 4 that set the same kv_heads_per_block (one that
divides every rank's head count) share every chunk, and each rank reads exactly its heads. Ranks
that hold identical KV (vLLM's `kv_tp_replicas`: GQA heads replicated when there are
fewer KV heads than ranks, MLA's latent cache on every rank) form one shard: only its
first rank saves, every rank of it loads. MLA caches have no heads to split and keep
the per-shard namespaces of kvcache.mla v1.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash
from vllm.config import VllmConfig
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVQuantMode,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from kvcache_connectors.vllm.config import KVCacheConnectorConfig
from kvcache_core.format import DType
from kvcache_core.keys import CANONICAL_LAYOUT, HEADS_LAYOUT_VERSION, MLA_LAYOUT, Namespace, head_block_key

Extra = tuple[tuple[str, str], ...]


def escape_fact(value: str) -> str:
    """`value` with "%", "@" and ";" written "%25", "%40" and "%3B": it then holds no separator.

    "%" is replaced first, so an escape is never read as text and every escaped string decodes
    to one value; strings without the three characters (hex digests, UUIDs, most names and
    paths) stay as they are.
    """
    return value.replace("%", "%25").replace("@", "%40").replace(";", "%3B")


def lora_fact(lora_name: str, lora_path: str) -> str:
    """The vllm.lora fact of a LoRA adapter: "<name>@<path>", both escaped (escape_fact).

    The path is what tells an adapter's weights apart across instances (two instances may load
    different weights under one name); vLLM's lora_int_id is per process and is left out.
    """
    return f"{escape_fact(lora_name)}@{escape_fact(lora_path)}"


def mm_fact(items: Iterable[tuple[str, int]]) -> str:
    """The vllm.mm fact of multimodal items (identifier, offset of its first placeholder token),
    in prompt order: "<identifier>@<offset>" per item, identifiers escaped (escape_fact), joined by ";"."""
    return ";".join(f"{escape_fact(identifier)}@{offset}" for identifier, offset in items)


@dataclass(frozen=True, slots=True)
class KVFacts:
    """The engine facts that fingerprint KV, and how TP ranks map onto shards.

    Attributes:
        model_id: Model identity.
        model_revision: Checkpoint revision, "" when unknown.
        kv_dtype: Name of the KV-cache element type, e.g. "bfloat16".
        torch_dtype: The same as a torch dtype (what the paged cache tensors hold).
        mla: Whether the cache holds MLA latents ([tokens, head_size] per layer) rather than K and V.
        chunk_tokens: Tokens per chunk.
        block_size: vLLM's block size (tokens per paged block).
        layer_names: Attention layers in chunk order (index l of a chunk is layer_names[l]).
        num_kv_heads: KV heads of one shard (1 for MLA).
        heads_per_block: KV heads per block this instance saves (kv_heads_per_block; 1 for MLA).
        head_size: Size of one head (of the latent vector for MLA).
        tp_size: vLLM's tensor-parallel size.
        tp_replicas: Consecutive TP ranks that hold identical KV.
        extra: Instance-wide namespace extras (namespace_extra and vllm.* facts), the group's included.
        group: Index of the KV-cache group (vLLM's kv_cache_group_id) these facts describe.
        sliding_window: The group's window in tokens (SlidingWindowSpec), None for full attention.
        retained_tokens: Tokens below a hit point whose KV a request still needs: the window less
            one plus vLLM's extra retained tokens for a sliding-window group, None for full attention
            (every token before the hit).
        attention_layers: vLLM's static forward context (layer name -> attention layer), which
            vLLM fills when it builds the model, before it registers the KV caches; not a
            namespace fact (excluded from equality and hashing).
    """

    model_id: str
    model_revision: str
    kv_dtype: str
    torch_dtype: torch.dtype
    mla: bool
    chunk_tokens: int
    block_size: int
    layer_names: tuple[str, ...]
    num_kv_heads: int
    head_size: int
    tp_size: int
    tp_replicas: int
    extra: Extra
    heads_per_block: int = 1
    group: int = 0
    sliding_window: int | None = None
    retained_tokens: int | None = None
    attention_layers: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    @classmethod
    def from_vllm(
        cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: KVCacheConnectorConfig, group: int = 0
    ) -> KVFacts:
        """Reads one KV-cache group's facts from vLLM's configs (see kv_groups for all of them).

        Raises:
            ValueError: a setup the connector cannot serve correctly (a group spec it cannot
                store exactly, quantized KV with scales, pipeline or context parallelism, ...).
        """
        return kv_groups(vllm_config, kv_cache_config, config)[group]

    def attention_backend(self, layer_name: str) -> type | None:
        """The attention backend class vLLM chose for a layer, None if vLLM exposes none."""
        get_backend = getattr(self.attention_layers.get(layer_name), "get_attn_backend", None)
        return None if get_backend is None else get_backend()

    @property
    def num_shards(self) -> int:
        """Distinct KV shards across the TP ranks (the namespaces' tp_size)."""
        return self.tp_size // self.tp_replicas

    def shard_of(self, tp_rank: int) -> int:
        """The shard (namespace tp_rank) whose KV this TP rank holds."""
        return tp_rank // self.tp_replicas

    def is_writer(self, tp_rank: int) -> bool:
        """Whether this TP rank saves its shard (the first rank of each replica group does)."""
        return tp_rank % self.tp_replicas == 0

    def namespaces(self, cache_salt: str = "", request_extra: Extra = ()) -> tuple[Namespace, ...]:
        """The group's namespaces for requests with this salt and these request facts: one,
        head-sharded, or one per shard for MLA."""
        return _namespaces(self, cache_salt, request_extra)

    @property
    def total_heads(self) -> int:
        """KV heads across the shards (1 for MLA)."""
        return 1 if self.mla else self.num_kv_heads * self.num_shards

    def unit_keys(self, chunk_keys: tuple[bytes, ...], heads_per_block: int | None) -> tuple[bytes, ...]:
        """The keys of a chunk's stored blocks, from its key in each namespace: one per block of
        heads_per_block heads (None: a shard's heads; head-sharded), or the keys themselves, one per
        shard (MLA)."""
        if self.mla:
            return chunk_keys
        (key,) = chunk_keys
        g = heads_per_block or self.num_kv_heads
        return tuple(head_block_key(key, j * g, g, self.total_heads) for j in range(self.total_heads // g))

    def units(self, shard: int, heads_per_block: int | None) -> range:
        """The blocks (indices into unit_keys) a shard's heads span."""
        if self.mla:
            return range(shard, shard + 1)
        h = self.num_kv_heads
        g = heads_per_block or h
        return range(shard * h // g, (shard + 1) * h // g)

    @property
    def sliding(self) -> bool:
        """Whether the group is a sliding-window group (needs only the window before a hit point)."""
        return self.retained_tokens is not None

    def needed_from(self, hit_tokens: int) -> int:
        """First token whose KV a request with `hit_tokens` computed tokens needs, block-aligned.

        Full attention needs every token. A sliding-window group needs the blocks vLLM keeps
        allocated (SlidingWindowManager.get_num_skipped_tokens): the blocks that are not wholly
        below hit_tokens - retained_tokens; vLLM's own prefix cache asks for the same blocks
        (find_longest_cache_hit: cdiv(window - 1, block_size) blocks before the hit).
        """
        if self.retained_tokens is None:
            return 0
        skipped = max(0, hit_tokens - self.retained_tokens)
        return skipped // self.block_size * self.block_size

    def chunk_shape(self, num_tokens: int, heads: int | None = None) -> tuple[int, ...]:
        """Shape of num_tokens tokens of a shard's KV (kvcache.canonical or kvcache.mla), or of a
        stored block of `heads` heads of them."""
        if self.mla:
            return (len(self.layer_names), num_tokens, self.head_size)
        return (len(self.layer_names), 2, self.num_kv_heads if heads is None else heads, num_tokens, self.head_size)


def kv_groups(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: KVCacheConnectorConfig
) -> tuple[KVFacts, ...]:
    """Every KV-cache group's facts, in vLLM's group order.

    Raises:
        ValueError: pipeline or context parallelism; no group; a group whose spec the connector
            cannot store and load exactly (named with its layers); groups of different block
            sizes; a quantization mode with scales; unequal K and V head sizes.
    """
    parallel = vllm_config.parallel_config
    for name, size in (
        ("pipeline_parallel_size", parallel.pipeline_parallel_size),
        ("decode_context_parallel_size", parallel.decode_context_parallel_size),
        ("prefill_context_parallel_size", parallel.prefill_context_parallel_size),
    ):
        if size != 1:
            raise ValueError(f"KVCacheConnector supports tensor parallelism only; {name} is {size}")
    groups = kv_cache_config.kv_cache_groups
    if not groups:
        raise ValueError("KVCacheConnector needs at least one KV-cache group, got none")
    block_sizes = sorted({group.kv_cache_spec.block_size for group in groups})
    if len(block_sizes) > 1:
        raise ValueError(
            f"KVCacheConnector needs one block size across KV-cache groups, got {block_sizes} "
            "(a hybrid model whose groups have different page sizes)"
        )
    replicas = kv_cache_config.kv_tp_replicas
    if parallel.tensor_parallel_size % replicas:
        raise ValueError(
            f"kv_tp_replicas {replicas} does not divide tensor_parallel_size {parallel.tensor_parallel_size}"
        )
    model = vllm_config.model_config
    extra = dict(config.namespace_extra)
    if vllm_config.cache_config.cache_dtype != "auto":
        extra["vllm.cache_dtype"] = str(vllm_config.cache_config.cache_dtype)
    if model.quantization:
        extra["vllm.quantization"] = str(model.quantization)
    hybrid = len(groups) > 1
    facts = []
    for index, group in enumerate(groups):
        spec = _checked_spec(index, group)
        group_extra = dict(extra)
        window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
        if hybrid or window is not None:
            group_extra["vllm.kv_group"] = group_kind(spec)
            group_extra["vllm.kv_group_layers"] = _layers_digest(group.layer_names)
        kv_dtype = str(spec.dtype).removeprefix("torch.")
        mla = isinstance(spec, MLAAttentionSpec)
        heads_per_block = 1 if mla else (config.kv_heads_per_block or spec.num_kv_heads)
        if spec.num_kv_heads % heads_per_block:
            raise ValueError(
                f"kv_connector_extra_config['kv_heads_per_block'] = {heads_per_block} must divide the "
                f"{spec.num_kv_heads} KV heads of one rank (KV-cache group {index})"
            )
        facts.append(
            KVFacts(
                model_id=config.model_id or model.model,
                model_revision=config.model_revision if config.model_revision is not None else (model.revision or ""),
                kv_dtype=kv_dtype,
                torch_dtype=spec.dtype,
                mla=mla,
                chunk_tokens=config.chunk_tokens,
                block_size=spec.block_size,
                layer_names=tuple(group.layer_names),
                num_kv_heads=spec.num_kv_heads,
                head_size=spec.head_size,
                tp_size=parallel.tensor_parallel_size,
                tp_replicas=replicas,
                extra=tuple(sorted(group_extra.items())),
                heads_per_block=heads_per_block,
                group=index,
                sliding_window=window,
                retained_tokens=spec.num_retained_tokens if isinstance(spec, SlidingWindowSpec) else None,
                attention_layers=vllm_config.compilation_config.static_forward_context,
            )
        )
    return tuple(facts)


_SUPPORTED_SPECS = (FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec)


def group_kind(spec: FullAttentionSpec | SlidingWindowSpec) -> str:
    """The group's spec as its namespace records it: "full", "mla" or "sliding_window:<window>"."""
    if isinstance(spec, SlidingWindowSpec):
        return f"sliding_window:{spec.sliding_window}"
    return "mla" if isinstance(spec, MLAAttentionSpec) else "full"


def _layers_digest(layer_names: Sequence[str]) -> str:
    """The group's layers, short: count, first, last and a digest of all names."""
    digest = xxhash.xxh3_64_hexdigest("\0".join(layer_names).encode())
    return f"{len(layer_names)}:{layer_names[0]}..{layer_names[-1]}:{digest}"


def _checked_spec(index: int, group: KVCacheGroupSpec) -> FullAttentionSpec | SlidingWindowSpec:
    """The group's spec if the connector stores it exactly; otherwise a ValueError naming it."""
    spec = group.kv_cache_spec
    layers = list(group.layer_names)
    where = f"KV-cache group {index} ({type(spec).__name__}, layers {layers[:3]}{'...' if len(layers) > 3 else ''})"
    if type(spec) not in _SUPPORTED_SPECS:
        supported = ", ".join(t.__name__ for t in _SUPPORTED_SPECS)
        kind = "a recurrent-state (Mamba-style) group" if "Mamba" in type(spec).__name__ else "its spec"
        raise ValueError(
            f"KVCacheConnector cannot serve {where}: {kind} is not one it can store and load exactly "
            f"(supported KV-cache specs: {supported})"
        )
    if not group.enable_kv_transfer:
        raise ValueError(f"KVCacheConnector cannot serve {where}: vLLM excludes it from KV transfer")
    assert isinstance(spec, FullAttentionSpec | SlidingWindowSpec)
    # Per-tensor fp8 stores plain fp8 values (the scale is a fixed model fact, and the cache
    # dtype is in the namespace); every other mode keeps scales or packed codes beside the values.
    if spec.kv_quant_mode not in (KVQuantMode.NONE, KVQuantMode.FP8_PER_TENSOR):
        raise ValueError(f"KVCacheConnector does not support KV quantization mode {spec.kv_quant_mode.name} ({where})")
    if spec.num_head_slots is not None or spec.state_content_bytes is not None or spec.tokens_per_state != 1:
        raise ValueError(f"KVCacheConnector does not support packed or compressed KV pages ({where})")
    if not isinstance(spec, MLAAttentionSpec) and spec.head_size_v != spec.head_size:
        raise ValueError(
            f"KVCacheConnector needs equal K and V head sizes, got {spec.head_size} and {spec.head_size_v} ({where})"
        )
    DType.from_name(str(spec.dtype).removeprefix("torch."))  # a dtype the block format cannot hold
    return spec


@functools.lru_cache(maxsize=1024)
def _namespaces(facts: KVFacts, cache_salt: str, request_extra: Extra) -> tuple[Namespace, ...]:
    # Cached: a namespace hashes its ~200 canonical bytes, and most requests share a few salts.
    if not facts.mla:
        namespace = Namespace(
            model_id=facts.model_id,
            model_revision=facts.model_revision,
            kv_dtype=facts.kv_dtype,
            layout=CANONICAL_LAYOUT,
            layout_version=HEADS_LAYOUT_VERSION,
            chunk_tokens=facts.chunk_tokens,
            num_layers=len(facts.layer_names),
            num_kv_heads=facts.total_heads,
            head_size=facts.head_size,
            cache_salt=cache_salt,
            extra=dict(facts.extra + request_extra),
        )
        return (namespace,)
    return tuple(
        Namespace(
            model_id=facts.model_id,
            model_revision=facts.model_revision,
            kv_dtype=facts.kv_dtype,
            layout=MLA_LAYOUT,
            chunk_tokens=facts.chunk_tokens,
            num_layers=len(facts.layer_names),
            num_kv_heads=facts.num_kv_heads,
            head_size=facts.head_size,
            tp_size=facts.num_shards,
            tp_rank=shard,
            cache_salt=cache_salt,
            extra=dict(facts.extra + request_extra),
        )
        for shard in range(facts.num_shards)
    )
