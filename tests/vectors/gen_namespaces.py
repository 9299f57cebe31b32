"""The connectors' namespaces and keys, computed by the project's own code; writes tests/vectors/namespaces.json.

Unlike gen_keys.py and gen_blocks.py (independent implementations of a spec), this generator runs the
code that production runs: `kvcache_connectors.vllm.namespaces.kv_groups` and `scheduler.request_extra`
(the vLLM connector), `kvcache_connectors.transformers.namespace_for_model`, and
`kvcache_connectors.vllm_tier.namespace.vllm_namespace` (the vLLM tier). Each vector records the
engine facts those functions read (as plain data) and what they made of them: every namespace's
fields, canonical bytes and name, the chunk keys of a prompt, the keys of a chunk's stored blocks and
which tensor-parallel rank reads and writes which. tests/test_vectors_spec.py recomputes every
expected value from the inputs with an implementation written from the docs alone (docs/vllm.md,
docs/transformers.md, docs/keys.md), and checks that this file's output equals the committed JSON.

vLLM's config objects are stood in for by plain objects carrying exactly the attributes the
connector reads (a real ModelConfig would need a checkpoint); the KV-cache specs, KVCacheConfig,
OffloadingConfig and transformers' model configs are the libraries' real classes.

Run from the repository root:  .venv/bin/python tests/vectors/gen_namespaces.py
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import vllm
import vllm.config.vllm as vllm_config_module
from transformers import Gemma2Config, LlamaConfig, Qwen2Config
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import canonical_format_id
from vllm.lora.request import LoRARequest
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

from kvcache_connectors.transformers import namespace_for_model
from kvcache_connectors.vllm.config import KVCacheConnectorConfig
from kvcache_connectors.vllm.namespaces import kv_groups
from kvcache_connectors.vllm.scheduler import request_extra
from kvcache_connectors.vllm_tier.namespace import vllm_namespace
from kvcache_core.keys import Namespace, chunk_keys

OUT = Path(__file__).resolve().parent / "namespaces.json"

# A fixed prompt of 3 full 16-token chunks and a 5-token tail (chunk_tokens 16 in most cases).
PROMPT = [(i * 7919 + 13) % 128256 for i in range(53)]


def llama_layers(n: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(n)]


# --- the vLLM connector -----------------------------------------------------------------------------------------


def vllm_case(
    name: str,
    *,
    model: str = "meta-llama/Llama-3.1-8B-Instruct",
    revision: str | None = None,
    cache_dtype: str = "auto",
    quantization: str | None = None,
    tensor_parallel_size: int = 1,
    kv_tp_replicas: int = 1,
    block_size: int = 16,
    extra_config: Mapping[str, Any] | None = None,
    groups: list[dict[str, Any]] | None = None,
    request: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Inputs of one vLLM case as plain data (what docs/vllm.md says the namespace is made of)."""
    groups = groups or [
        {"spec": "FullAttentionSpec", "layer_names": llama_layers(32), "num_kv_heads": 8, "head_size": 128}
    ]
    for g in groups:
        g.setdefault("dtype", "torch.bfloat16")
        g.setdefault("sliding_window", None)
    req = {
        "prompt_token_ids": PROMPT,
        "prompt_embeds": False,
        "cache_salt": None,
        "lora_name": None,
        "lora_path": None,
        "mm_features": [],
    }
    req.update(request or {})
    return {
        "name": name,
        "connector": "vllm",
        "inputs": {
            "model": model,
            "revision": revision,
            "cache_dtype": cache_dtype,
            "quantization": quantization,
            "tensor_parallel_size": tensor_parallel_size,
            "kv_tp_replicas": kv_tp_replicas,
            "block_size": block_size,
            "kv_connector_extra_config": {"chunk_tokens": 16, **(extra_config or {})},
            "kv_cache_groups": groups,
            "request": req,
        },
    }


def _spec(group: Mapping[str, Any], block_size: int) -> FullAttentionSpec:
    dtype = getattr(torch, group["dtype"].removeprefix("torch."))
    common = {
        "block_size": block_size,
        "num_kv_heads": group["num_kv_heads"],
        "head_size": group["head_size"],
        "dtype": dtype,
    }
    if group["spec"] == "SlidingWindowSpec":
        return SlidingWindowSpec(**common, sliding_window=group["sliding_window"])
    if group["spec"] == "MLAAttentionSpec":
        return MLAAttentionSpec(**common)
    return FullAttentionSpec(**common)


def vllm_expected(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """What the connector computes for these inputs, through kv_groups and request_extra."""
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(
            pipeline_parallel_size=1,
            decode_context_parallel_size=1,
            prefill_context_parallel_size=1,
            tensor_parallel_size=inputs["tensor_parallel_size"],
        ),
        model_config=SimpleNamespace(
            model=inputs["model"], revision=inputs["revision"], quantization=inputs["quantization"]
        ),
        cache_config=SimpleNamespace(cache_dtype=inputs["cache_dtype"]),
        compilation_config=SimpleNamespace(static_forward_context={}),
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=1,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(list(g["layer_names"]), _spec(g, inputs["block_size"])) for g in inputs["kv_cache_groups"]
        ],
    )
    kv_cache_config.kv_tp_replicas = inputs["kv_tp_replicas"]
    config = KVCacheConnectorConfig.from_extra_config(
        inputs["kv_connector_extra_config"], block_size=inputs["block_size"]
    )
    facts = kv_groups(vllm_config, kv_cache_config, config)  # type: ignore[arg-type]

    r = inputs["request"]
    request = SimpleNamespace(
        prompt_token_ids=r["prompt_token_ids"],
        prompt_embeds=object() if r["prompt_embeds"] else None,
        lora_request=None if r["lora_name"] is None else LoRARequest(r["lora_name"], 1, r["lora_path"]),
        mm_features=[
            SimpleNamespace(identifier=f["identifier"], mm_position=SimpleNamespace(offset=f["offset"]))
            for f in r["mm_features"]
        ],
        cache_salt=r["cache_salt"],
    )
    extra = request_extra(request)  # type: ignore[arg-type]
    if extra is None:
        return {"cached": False, "groups": []}
    salt = request.cache_salt or ""  # as the scheduler's _plan does
    groups = []
    for group in facts:
        namespaces = group.namespaces(salt, extra)
        keys = [chunk_keys(r["prompt_token_ids"], ns) for ns in namespaces]
        per_chunk = list(zip(*keys, strict=True))  # [chunk][namespace]
        heads_per_block = None if group.mla else group.heads_per_block
        groups.append(
            {
                "namespaces": [namespace_entry(ns) for ns in namespaces],
                "chunk_keys": [[k.hex() for k in ks] for ks in keys],
                "heads_per_block": heads_per_block,
                "block_keys": [[k.hex() for k in group.unit_keys(chunk, heads_per_block)] for chunk in per_chunk],
                "ranks": [
                    {
                        "tp_rank": rank,
                        "shard": group.shard_of(rank),
                        "writer": group.is_writer(rank),
                        "blocks": list(group.units(group.shard_of(rank), heads_per_block)),
                    }
                    for rank in range(inputs["tensor_parallel_size"])
                ],
            }
        )
    return {"cached": True, "groups": groups}


def namespace_entry(ns: Namespace) -> dict[str, Any]:
    return {"fields": ns.to_dict(), "canonical": ns.canonical_bytes().hex(), "name": ns.name}


def sliding(window: int, layers: list[str], heads: int = 8, head_size: int = 64) -> dict[str, Any]:
    return {
        "spec": "SlidingWindowSpec",
        "layer_names": layers,
        "num_kv_heads": heads,
        "head_size": head_size,
        "sliding_window": window,
    }


def full(layers: list[str], heads: int = 8, head_size: int = 64) -> dict[str, Any]:
    return {"spec": "FullAttentionSpec", "layer_names": layers, "num_kv_heads": heads, "head_size": head_size}


GEMMA_LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(6)]

VLLM_CASES = [
    vllm_case("vllm_plain_tp1"),
    vllm_case(
        "vllm_model_id_revision_namespace_extra",
        revision="0e9e39f249a16976918f6564b8830bc894c89659",
        extra_config={
            "model_id": "llama-3.1-8b-instruct",
            "namespace_extra": {"deployment": "blue", "région": "eu-west-1", "": "empty key"},
        },
    ),
    vllm_case(
        "vllm_model_revision_option_overrides_revision",
        revision="main",
        extra_config={"model_revision": ""},
    ),
    vllm_case(
        "vllm_cache_dtype_fp8", cache_dtype="fp8", groups=[{**full(llama_layers(32), 8, 128), "dtype": "torch.uint8"}]
    ),
    vllm_case(
        "vllm_cache_dtype_fp8_e4m3_alias",
        cache_dtype="fp8_e4m3",
        groups=[{**full(llama_layers(32), 8, 128), "dtype": "torch.uint8"}],
    ),
    vllm_case(
        "vllm_cache_dtype_fp8_inc",
        cache_dtype="fp8_inc",
        groups=[{**full(llama_layers(32), 8, 128), "dtype": "torch.float8_e4m3fn"}],
    ),
    vllm_case(
        "vllm_quantization",
        model="Qwen/Qwen2.5-7B-Instruct-AWQ",
        quantization="awq_marlin",
        groups=[{**full(llama_layers(28), 4, 128), "dtype": "torch.float16"}],
    ),
    vllm_case("vllm_lora", request={"lora_name": "sql-adapter", "lora_path": "/adapters/sql-adapter"}),
    vllm_case(
        "vllm_multimodal",
        model="Qwen/Qwen2.5-VL-7B-Instruct",
        groups=[full(llama_layers(28), 4, 128)],
        request={
            "mm_features": [
                {"identifier": "9f1c2b7e4d3a5f60a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718", "offset": 3},
                {"identifier": "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef", "offset": 40},
            ]
        },
    ),
    vllm_case(
        "vllm_lora_and_multimodal_tower_lora",
        model="Qwen/Qwen2.5-VL-7B-Instruct",
        groups=[full(llama_layers(28), 4, 128)],
        request={
            "lora_name": "captioner",
            "lora_path": "org/captioner-lora",
            "mm_features": [{"identifier": "captioner:abc123", "offset": 0}],
        },
    ),
    vllm_case(
        "vllm_request_facts_escaped",
        model="Qwen/Qwen2.5-VL-7B-Instruct",
        groups=[full(llama_layers(28), 4, 128)],
        request={
            "lora_name": "sql@v2",
            "lora_path": "/adapters/sql;v2/100%",
            "mm_features": [{"identifier": "a@1;b", "offset": 2}, {"identifier": "50%40 off", "offset": 9}],
        },
    ),
    vllm_case(
        "vllm_multimodal_two_items_not_one",
        model="Qwen/Qwen2.5-VL-7B-Instruct",
        groups=[full(llama_layers(28), 4, 128)],
        request={"mm_features": [{"identifier": "a", "offset": 1}, {"identifier": "b", "offset": 2}]},
    ),
    vllm_case("vllm_cache_salt", request={"cache_salt": "tenant-42"}),
    vllm_case("vllm_prompt_embeds_not_cached", request={"prompt_embeds": True}),
    vllm_case(
        "vllm_everything",
        revision="v2",
        cache_dtype="fp8_e5m2",
        quantization="fp8",
        extra_config={"namespace_extra": {"deployment": "green"}},
        groups=[{**full(llama_layers(32), 8, 128), "dtype": "torch.uint8"}],
        request={
            "cache_salt": "s",
            "lora_name": "med",
            "lora_path": "/loras/med",
            "mm_features": [{"identifier": "img-uuid-1", "offset": 7}],
        },
    ),
    vllm_case(
        "vllm_hybrid_full_and_sliding",
        model="google/gemma-2-9b-it",
        groups=[full(GEMMA_LAYERS[1::2], 8, 256), sliding(4096, GEMMA_LAYERS[0::2], 8, 256)],
    ),
    vllm_case(
        "vllm_hybrid_with_lora",
        model="google/gemma-2-9b-it",
        groups=[full(GEMMA_LAYERS[1::2], 8, 256), sliding(4096, GEMMA_LAYERS[0::2], 8, 256)],
        request={"lora_name": "sql-adapter", "lora_path": "/adapters/sql-adapter"},
    ),
    vllm_case(
        "vllm_one_sliding_window_group",
        model="mistralai/Mistral-7B-v0.1",
        groups=[sliding(4096, llama_layers(32), 8, 128)],
    ),
    vllm_case(
        "vllm_hybrid_two_full_groups",
        model="hybrid/two-full-groups",
        groups=[full(["layers.0.attn", "layers.2.attn"], 2, 64), full(["layers.1.attn", "layers.3.attn"], 2, 64)],
    ),
    vllm_case(
        "vllm_mla_tp1",
        model="deepseek-ai/DeepSeek-V2-Lite",
        groups=[{"spec": "MLAAttentionSpec", "layer_names": llama_layers(27), "num_kv_heads": 1, "head_size": 576}],
    ),
    vllm_case(
        "vllm_mla_tp2_replicated",
        model="deepseek-ai/DeepSeek-V2-Lite",
        tensor_parallel_size=2,
        kv_tp_replicas=2,
        groups=[{"spec": "MLAAttentionSpec", "layer_names": llama_layers(27), "num_kv_heads": 1, "head_size": 576}],
    ),
    vllm_case(
        "vllm_mla_tp2_not_replicated",
        model="deepseek-ai/DeepSeek-V2-Lite",
        tensor_parallel_size=2,
        kv_tp_replicas=1,
        groups=[{"spec": "MLAAttentionSpec", "layer_names": llama_layers(27), "num_kv_heads": 1, "head_size": 576}],
    ),
    vllm_case("vllm_tp2", tensor_parallel_size=2, groups=[full(llama_layers(32), 4, 128)]),
    vllm_case(
        "vllm_tp4_kv_heads_per_block_2",
        tensor_parallel_size=4,
        extra_config={"kv_heads_per_block": 2},
        groups=[full(llama_layers(32), 2, 128)],
    ),
    vllm_case(
        "vllm_tp1_kv_heads_per_block_2",
        extra_config={"kv_heads_per_block": 2},
        groups=[full(llama_layers(32), 8, 128)],
    ),
    vllm_case(
        "vllm_tp8_two_kv_heads_replicated",
        model="tiny/two-kv-heads",
        tensor_parallel_size=8,
        kv_tp_replicas=4,
        groups=[full(llama_layers(4), 1, 64)],
    ),
    vllm_case(
        "vllm_tp8_two_kv_heads_as_vllm_reports",
        model="tiny/two-kv-heads",
        tensor_parallel_size=8,
        kv_tp_replicas=1,
        groups=[full(llama_layers(4), 1, 64)],
    ),
    vllm_case(
        "vllm_tp4_hybrid_kv_heads_per_block_1",
        model="google/gemma-2-9b-it",
        tensor_parallel_size=4,
        extra_config={"kv_heads_per_block": 1},
        groups=[full(GEMMA_LAYERS[1::2], 2, 256), sliding(4096, GEMMA_LAYERS[0::2], 2, 256)],
    ),
    vllm_case("vllm_chunk_32_block_16", extra_config={"chunk_tokens": 32}),
]


# --- the transformers connector ---------------------------------------------------------------------------------


def transformers_case(
    name: str, config_class: str, config: Mapping[str, Any], dtype: str, **kwargs: Any
) -> dict[str, Any]:
    return {
        "name": name,
        "connector": "transformers",
        "inputs": {
            "config_class": config_class,
            "config": dict(config),
            "dtype": dtype,
            "namespace_for_model": kwargs,
            "prompt_token_ids": PROMPT,
        },
    }


CONFIG_CLASSES = {"LlamaConfig": LlamaConfig, "Qwen2Config": Qwen2Config, "Gemma2Config": Gemma2Config}

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 1000}

TRANSFORMERS_CASES = [
    transformers_case(
        "transformers_llama_gqa",
        "LlamaConfig",
        {**TINY, "num_attention_heads": 4, "num_key_value_heads": 2, "_name_or_path": "meta-llama/Llama-3.2-1B"},
        "torch.bfloat16",
        chunk_tokens=16,
    ),
    transformers_case(
        "transformers_mha_no_kv_heads_commit_hash",
        "LlamaConfig",
        {**TINY, "num_attention_heads": 4, "_name_or_path": "./checkpoints/llama", "_commit_hash": "abc123"},
        "torch.float32",
        chunk_tokens=16,
    ),
    transformers_case(
        "transformers_overrides",
        "LlamaConfig",
        {**TINY, "num_attention_heads": 4, "num_key_value_heads": 1, "_name_or_path": "/tmp/x", "_commit_hash": "c"},
        "torch.float16",
        model_id="team/llama-ft",
        model_revision="v7",
        chunk_tokens=20,
        cache_salt="tenant-a",
    ),
    transformers_case(
        "transformers_explicit_head_dim",
        "Gemma2Config",
        {
            **TINY,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 48,
            "sliding_window": 8,
            "_name_or_path": "google/gemma-2-2b",
        },
        "torch.bfloat16",
        chunk_tokens=16,
    ),
    transformers_case(
        "transformers_sliding_window_qwen2",
        "Qwen2Config",
        {
            **TINY,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "use_sliding_window": True,
            "sliding_window": 8,
            "max_window_layers": 1,
            "_name_or_path": "Qwen/Qwen2-0.5B",
        },
        "torch.float16",
        chunk_tokens=16,
    ),
]


TEXT_CONFIG_ATTRIBUTES = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size")


def make_model(inputs: Mapping[str, Any]) -> SimpleNamespace:
    """A stand-in for a PreTrainedModel: a real transformers config and a dtype (all namespace_for_model reads)."""
    config_dict = dict(inputs["config"])
    name_or_path = config_dict.pop("_name_or_path")
    commit_hash = config_dict.pop("_commit_hash", None)
    config = CONFIG_CLASSES[inputs["config_class"]](**config_dict)
    config._name_or_path = name_or_path
    config._commit_hash = commit_hash
    return SimpleNamespace(config=config, dtype=getattr(torch, inputs["dtype"].removeprefix("torch.")))


def config_attributes(model: SimpleNamespace) -> dict[str, Any]:
    """What the config holds once its class filled in its defaults: the values docs/transformers.md names."""
    config = model.config
    text = config.get_text_config(decoder=True)
    attributes = {name: getattr(text, name, None) for name in TEXT_CONFIG_ATTRIBUTES}
    return {"_name_or_path": config._name_or_path, "_commit_hash": config._commit_hash, **attributes}


def transformers_expected(inputs: Mapping[str, Any]) -> dict[str, Any]:
    ns = namespace_for_model(make_model(inputs), **inputs["namespace_for_model"])  # type: ignore[arg-type]
    return {**namespace_entry(ns), "chunk_keys": [k.hex() for k in chunk_keys(inputs["prompt_token_ids"], ns)]}


# --- the vLLM tier (engine-keyed namespaces) --------------------------------------------------------------------


def tier_case(
    name: str,
    *,
    engine_config: Mapping[str, Any] | None,
    groups: list[dict[str, Any]] | None = None,
    parallel: Mapping[str, Any] | None = None,
    replicated_layout: bool = False,
    canonical_layout: bool = False,
    kv_cache_layout: str | None = "LBNHC",
    tier_options: Mapping[str, Any] | None = None,
    dtype: str = "bfloat16",
    chunk_bytes: int = 2097152,
) -> dict[str, Any]:
    groups = groups or [
        {
            "group_id": 0,
            "tokens_per_block": 16,
            "layer_names": llama_layers(2),
            "sliding_window_size_in_chunks": None,
        }
    ]
    return {
        "name": name,
        "connector": "vllm_tier",
        "inputs": {
            "offloading_config": {
                "model": {"name": "meta-llama/Llama-3.1-8B", "dtype": dtype},
                "cache": {"tokens_per_hash": 16, "blocks_per_chunk": 1},
                "groups": groups,
                "parallel": {
                    "tp_size": 1,
                    "pp_size": 1,
                    "pcp_size": 1,
                    "dcp_size": 1,
                    "is_parallelism_agnostic": False,
                    **(parallel or {}),
                },
                "replicated_layout": replicated_layout,
                "canonical_layout": canonical_layout,
                "kv_cache_layout": kv_cache_layout,
            },
            "canonical_format_id": canonical_format_id(kv_cache_layout) if kv_cache_layout else None,
            "chunk_bytes": chunk_bytes,
            "engine_config": None if engine_config is None else dict(engine_config),
            "tier_options": {"model_revision": "", "namespace_extra": {}, **(tier_options or {})},
            "vllm_version": vllm.__version__,
            "offload_keys": [
                {"block_hash": bytes(range(32)).hex(), "group_idx": 0},
                {"block_hash": bytes(range(32, 64)).hex(), "group_idx": 1},
            ],
        },
    }


@contextmanager
def current_vllm_config(engine_config: Mapping[str, Any] | None) -> Iterator[None]:
    """The engine's config as vLLM's get_current_vllm_config_or_none returns it while it builds the tier."""
    saved = vllm_config_module._current_vllm_config
    if engine_config is not None:
        vllm_config_module._current_vllm_config = SimpleNamespace(  # type: ignore[assignment]
            model_config=SimpleNamespace(**engine_config)
        )
    try:
        yield
    finally:
        vllm_config_module._current_vllm_config = saved


def tier_expected(inputs: Mapping[str, Any]) -> dict[str, Any]:
    oc = inputs["offloading_config"]
    config = OffloadingConfig(
        groups=tuple(
            OffloadingGroupConfig(
                tokens_per_block=g["tokens_per_block"],
                layer_names=tuple(g["layer_names"]),
                group_id=g["group_id"],
                sliding_window_size_in_chunks=g["sliding_window_size_in_chunks"],
            )
            for g in oc["groups"]
        ),
        worker_kv_bytes_per_block=inputs["chunk_bytes"],
        enable_kv_cache_events=False,
        extra_config={},
        engine_id="engine-0",
        model=OffloadingModelConfig(**oc["model"]),
        cache=OffloadingCacheConfig(**oc["cache"]),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=oc["parallel"]["tp_size"],
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            **oc["parallel"],
        ),
        replicated_layout=oc["replicated_layout"],
        canonical_layout=oc["canonical_layout"],
        kv_cache_layout=oc["kv_cache_layout"],
    )
    options = inputs["tier_options"]
    with current_vllm_config(inputs["engine_config"]):
        ns = vllm_namespace(
            SimpleNamespace(config=config),  # type: ignore[arg-type]
            chunk_bytes=inputs["chunk_bytes"],
            model_revision=options["model_revision"],
            extra=options["namespace_extra"],
        )
    offload_keys = [bytes.fromhex(k["block_hash"]) + k["group_idx"].to_bytes(4, "big") for k in inputs["offload_keys"]]
    return {
        "facts": dict(ns.facts),
        "canonical": ns.canonical_bytes().hex(),
        "name": ns.name,
        "offload_keys": [k.hex() for k in offload_keys],
        "keys": [k.hex() for k in ns.keys(offload_keys)],
    }


ENGINE = {"revision": None, "quantization": None, "hf_overrides": {}}

TIER_CASES = [
    tier_case("tier_without_engine_config", engine_config=None),
    tier_case("tier_engine_config", engine_config=ENGINE),
    tier_case(
        "tier_revision_quantization_hf_overrides",
        engine_config={
            "revision": "abc",
            "quantization": "fp8",
            "hf_overrides": {"rope_scaling": {"type": "yarn", "factor": 4.0}, "max_position_embeddings": 131072},
        },
    ),
    tier_case(
        "tier_option_revision_and_extra",
        engine_config={**ENGINE, "revision": "engine-rev"},
        tier_options={"model_revision": "option-rev", "namespace_extra": {"finetune": "med-v2", "é": "ü"}},
    ),
    tier_case(
        "tier_hybrid_groups_tp2",
        engine_config=ENGINE,
        dtype="float8_e4m3fn",
        groups=[
            {
                "group_id": 0,
                "tokens_per_block": 16,
                "layer_names": ["model.layers.1.attn", "model.layers.3.attn"],
                "sliding_window_size_in_chunks": None,
            },
            {
                "group_id": 1,
                "tokens_per_block": 16,
                "layer_names": ["model.layers.0.attn", "model.layers.2.attn", "couche.é"],
                "sliding_window_size_in_chunks": 256,
            },
        ],
        parallel={"tp_size": 2},
        chunk_bytes=4194304,
    ),
    tier_case(
        "tier_parallelism_agnostic_canonical",
        engine_config=ENGINE,
        parallel={"tp_size": 4, "pp_size": 2, "is_parallelism_agnostic": True},
        canonical_layout=True,
        kv_cache_layout="LBHNC",
    ),
    tier_case(
        "tier_replicated_layout_no_kv_cache_layout",
        engine_config=ENGINE,
        parallel={"tp_size": 2},
        replicated_layout=True,
        kv_cache_layout=None,
    ),
]


def build() -> dict[str, Any]:
    """Every vector, inputs and the project's expected outputs."""
    vectors = []
    for case in VLLM_CASES:
        vectors.append({**case, "expected": vllm_expected(case["inputs"])})
    for case in TRANSFORMERS_CASES:
        inputs = {**case["inputs"], "config_attributes": config_attributes(make_model(case["inputs"]))}
        vectors.append({**case, "inputs": inputs, "expected": transformers_expected(inputs)})
    for case in TIER_CASES:
        vectors.append({**case, "expected": tier_expected(case["inputs"])})
    return {"version": 1, "vectors": vectors}


def render(data: Mapping[str, Any]) -> str:
    return json.dumps(data, indent=1, ensure_ascii=False) + "\n"


def main() -> None:
    data = build()
    OUT.write_text(render(data), encoding="utf-8")
    print(f"wrote {len(data['vectors'])} vectors to {OUT}")


if __name__ == "__main__":
    main()
