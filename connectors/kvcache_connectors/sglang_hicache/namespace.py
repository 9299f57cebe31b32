"""Which kvcache namespace and keys SGLang's HiCache pages go under (docs/sglang.md, "Keys").

SGLang names a page by a string key: the hex SHA-256 of its tokens chained on the previous
page's key (sglang.srt.mem_cache.hicache_storage.get_hash_str), so a key says which tokens and
which prefix, never which model, rank or byte layout. A page's bytes in the host pool are one or
more contiguous segments, as the pool itself reports them (get_page_buffer_meta): MHA page-first
pages are two (K, then V), MLA pages one (the latent row of every layer). Each segment is one
kvcache block:

    namespace = EngineNamespace("sglang", "sglang.hicache_page_key.v1", facts)   engine_keys.py
    key       = namespace.key(u32le(segment) || utf8(page_key))

with the facts everything that changes the bytes under one page key:

    model_name, model_revision           the model (model_name as SGLang's controller gives it,
                                         with the host pool's storage_format_tag when it has one)
    attention                            "mha" or "mla"
    host_pool, layout, dtype             the host pool's class, page layout and element type
    page_size, layer_num, geometry       tokens per page, layers in this pool, JSON of the head
                                         geometry (MHA: head_num, head_dim, v_head_dim; MLA:
                                         kv_cache_dim, kv_lora_rank, qk_rope_head_dim)
    segment_bytes                        JSON list: the bytes of each segment of a page
    tp                                   MHA: "RANK/SIZE" (each rank holds its own heads);
                                         MLA: "replicated" (every rank holds the same latent
                                         rows, so one copy serves any TP size)
    pp, layers                           "RANK/SIZE" of the pipeline stage, "START-END" layers
    attn_cp                              "RANK/SIZE" of attention context parallelism (each CP
                                         rank holds a disjoint slice of every page)
    sglang_version                       the page layout is SGLang's own, not a wire format
    extra.*                              the backend's namespace_extra

Not a fact: the data-parallel rank. With DP attention, attention-TP rank r of every DP group
computes the same heads of the same weights, so their pages are the same bytes and sharing them
is right.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from kvcache_connectors.engine_keys import EngineNamespace

ENGINE = "sglang"
KEY_FORMAT = "sglang.hicache_page_key.v1"  # u32le(segment) || utf8(SGLang page key)


def _json(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def page_geometry(host_pool: Any, *, is_mla: bool) -> dict[str, int]:
    """The head geometry of a host pool's rows (what its bytes per token are made of)."""
    names = ("kv_cache_dim", "kv_lora_rank", "qk_rope_head_dim") if is_mla else ("head_num", "head_dim", "v_head_dim")
    return {name: int(getattr(host_pool, name)) for name in names}


def sglang_facts(
    storage_config: Any,
    host_pool: Any,
    *,
    segment_bytes: Sequence[int],
    sglang_version: str,
    model_revision: str = "",
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The facts of one SGLang rank's HiCache pages, as strings (what the namespace hashes).

    Args:
        storage_config: SGLang's HiCacheStorageConfig of this rank.
        host_pool: The registered host pool (MHATokenToKVPoolHost or MLATokenToKVPoolHost).
        segment_bytes: The bytes of each segment of one page, in the pool's order.
        sglang_version: sglang.__version__.
        model_revision: The checkpoint revision ("" when unknown).
        extra: More facts (namespace_extra), stored as extra.<key>.
    """
    is_mla = bool(storage_config.is_mla_model)
    facts = {
        "model_name": storage_config.model_name or "",
        "model_revision": model_revision,
        "attention": "mla" if is_mla else "mha",
        "host_pool": type(host_pool).__name__,
        "layout": str(host_pool.layout),
        "dtype": str(host_pool.dtype).removeprefix("torch."),
        "page_size": str(int(host_pool.page_size)),
        "layer_num": str(int(host_pool.layer_num)),
        "geometry": _json(page_geometry(host_pool, is_mla=is_mla)),
        "segment_bytes": _json([int(n) for n in segment_bytes]),
        "tp": "replicated" if is_mla else f"{storage_config.tp_rank}/{storage_config.tp_size}",
        "pp": f"{storage_config.pp_rank}/{storage_config.pp_size}",
        "layers": f"{host_pool.start_layer}-{host_pool.end_layer}",
        "attn_cp": f"{storage_config.attn_cp_rank}/{storage_config.attn_cp_size}",
        "sglang_version": sglang_version,
    }
    for k, v in (extra or {}).items():
        facts[f"extra.{k}"] = v
    return facts


def sglang_namespace(
    storage_config: Any,
    host_pool: Any,
    *,
    segment_bytes: Sequence[int],
    sglang_version: str,
    model_revision: str = "",
    extra: Mapping[str, str] | None = None,
) -> EngineNamespace:
    """The namespace of one SGLang rank's HiCache pages."""
    facts = sglang_facts(
        storage_config,
        host_pool,
        segment_bytes=segment_bytes,
        sglang_version=sglang_version,
        model_revision=model_revision,
        extra=extra,
    )
    return EngineNamespace.of(ENGINE, KEY_FORMAT, facts)


def segment_engine_keys(page_keys: Sequence[str], segments: int) -> list[bytes]:
    """The engine keys of every segment of every page, page by page: u32le(segment) || utf8(key)."""
    prefixes = [struct.pack("<I", s) for s in range(segments)]
    return [prefix + key.encode("utf-8") for key in page_keys for prefix in prefixes]
