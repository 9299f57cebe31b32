"""Which kvcache namespace vLLM's offload chunks go under (docs/keys.md, "Engine-keyed namespaces").

A chunk of vLLM's CPU tier is one row of the primary buffer: every KV-cache group's pages of
`blocks_per_chunk` blocks, for every worker, in vLLM's own byte layout. Its OffloadKey
(`block_hash || u32be(group_idx)`, vllm.v1.kv_offload.base.make_offload_key) says which
tokens, never which model or layout, so the namespace carries those facts, the same ones
vLLM's own `fs` tier hashes into its folder name (vllm.v1.kv_offload.file_mapper), plus the
bytes per chunk, the page layout and this tier's own options:

    model_name, model_revision, dtype           the model and its KV-cache element type
    tokens_per_hash, blocks_per_chunk,          chunking (tokens per key, blocks per chunk,
    chunk_bytes                                 bytes per chunk across all workers)
    kv_cache_groups                             JSON: per group id, tokens per block, layers, window
    tp_size, pp_size, pcp_size, dcp_size        the parallel layout (all 1 when vLLM certifies the
                                                bytes as parallelism-agnostic)
    replicated_layout, canonical_format,        vLLM's host layout choices (canonical_layout's
    kv_cache_layout                             format id, e.g. for topology-free pages)
    quantization, hf_overrides                  from vLLM's model config: other weights, other KV
    vllm_version                                the row layout is vLLM's own (not a wire format)
    model_facts                                 "engine" when the three above came from the running
                                                engine's config, "none" when the tier was built
                                                without one (such instances never share bytes with
                                                an engine's)
    extra.*                                     the tier's namespace_extra

OffloadingConfig does not carry the revision, the quantization or hf_overrides; a checkpoint
that differs there gives other K/V for the same tokens, and the key-bound checksum would pass:
they are read from vLLM's current config (set while the engine builds its connector).

Every fact is the same in every process given the same engine: hf_overrides, which vLLM takes
as a dict or a callable, is written by hf_overrides_fact (JSON, or a function's importable
name), and a value with no such spelling is refused rather than written with str() (a
callable's str() holds its address: every process would get its own namespace, and no hits).
"""

from __future__ import annotations

import inspect
import json
import math
import sys
from collections.abc import Mapping
from typing import Any

import vllm
from vllm.config import get_current_vllm_config_or_none
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import canonical_format_id
from vllm.v1.kv_offload.base import OffloadingSpec

from kvcache_connectors.engine_keys import EngineNamespace

ENGINE = "vllm"
KEY_FORMAT = "vllm.offload_key.v1"  # block_hash || u32 big-endian group_idx, vLLM's make_offload_key


def vllm_facts(
    spec: OffloadingSpec, *, chunk_bytes: int, model_revision: str = "", extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The facts of one vLLM instance's offload chunks, as strings (what the namespace hashes)."""
    config = spec.config
    parallel = config.parallel
    agnostic = parallel.is_parallelism_agnostic or config.replicated_layout
    groups = [
        {
            "group_id": g.group_id,
            "tokens_per_block": g.tokens_per_block,
            "layer_names": list(g.layer_names),
            "sliding_window_size_in_chunks": g.sliding_window_size_in_chunks,
        }
        for g in config.groups
    ]
    facts = {
        "model_name": config.model.name,
        "model_revision": model_revision,
        "dtype": config.model.dtype,
        "tokens_per_hash": str(config.cache.tokens_per_hash),
        "blocks_per_chunk": str(config.cache.blocks_per_chunk),
        "chunk_bytes": str(chunk_bytes),
        "kv_cache_groups": json.dumps(groups, sort_keys=True, separators=(",", ":")),
        "tp_size": str(1 if agnostic else parallel.tp_size),
        "pp_size": str(1 if agnostic else parallel.pp_size),
        "pcp_size": str(1 if agnostic else parallel.pcp_size),
        "dcp_size": str(1 if agnostic else parallel.dcp_size),
        "replicated_layout": str(config.replicated_layout).lower(),
        "canonical_format": (
            canonical_format_id(config.kv_cache_layout)
            if config.canonical_layout and config.kv_cache_layout is not None
            else ""
        ),
        "kv_cache_layout": config.kv_cache_layout or "",
    }
    model: Any = getattr(get_current_vllm_config_or_none(), "model_config", None)
    if model is not None:
        model_revision = model_revision or (model.revision or "")
        facts["model_revision"] = model_revision
        facts["quantization"] = str(model.quantization or "")
        facts["hf_overrides"] = hf_overrides_fact(model.hf_overrides)
    facts["model_facts"] = "engine" if model is not None else "none"
    facts["vllm_version"] = vllm.__version__
    for k, v in (extra or {}).items():
        facts[f"extra.{k}"] = v
    return facts


def hf_overrides_fact(overrides: object) -> str:
    """vLLM's hf_overrides as the namespace writes it, alike in every process.

    None is ""; a dict is its JSON (json.dumps, keys sorted, default separators); a callable
    (vLLM applies it to the HF config) is "<module>.<qualname>", for a function or class that
    is importable under that name. The name stands for the code: change it (or namespace_extra)
    when the function's effect changes.

    Raises:
        ValueError: a value no other process could spell the same way: a dict holding anything
            but str keys, str, int, float (finite), bool, None, lists, tuples and dicts; a
            lambda, a nested function, a bound method, a partial or another callable object.
    """
    if overrides is None:
        return ""
    if isinstance(overrides, dict):
        _check_json(overrides, "hf_overrides")
        return json.dumps(overrides, sort_keys=True, allow_nan=False)
    if callable(overrides):
        return _importable_name(overrides)
    raise ValueError(f"hf_overrides must be a dict, a callable or None for the kvcache tier, got {type(overrides)!r}")


def _check_json(value: object, where: str) -> None:
    if value is None or isinstance(value, str | bool | int):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where} is {value!r}: the kvcache tier's namespace needs finite floats")
        return
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check_json(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, item in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{where} has the key {k!r}: the kvcache tier's namespace needs str keys")
            _check_json(item, f"{where}[{k!r}]")
        return
    raise ValueError(
        f"{where} is a {type(value).__name__} ({value!r}), which has no spelling the kvcache tier's namespace can "
        "give alike in every process: use JSON values (str, int, float, bool, None, lists, dicts)"
    )


def _importable_name(obj: object) -> str:
    """`module.qualname` of a function or class that the name finds in its module (a reloaded
    module's older function object included), so that every process reads one thing from it."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    target: object = sys.modules.get(module) if isinstance(module, str) else None
    # Not <lambda> nor <locals> (one name for many functions), not a method bound to its object.
    if isinstance(qualname, str) and "<" not in qualname and not inspect.ismethod(obj):
        for part in qualname.split("."):
            target = getattr(target, part, None)
    else:
        target = None
    if not callable(target) or getattr(target, "__qualname__", None) != qualname:
        raise ValueError(
            f"hf_overrides is {obj!r}: the kvcache tier's namespace names a callable override by its module and "
            "qualified name, so it must be a module-level function or class (not a lambda, a nested function, "
            "a bound method, a partial or a callable object)"
        )
    return f"{module}.{qualname}"


def vllm_namespace(
    spec: OffloadingSpec, *, chunk_bytes: int, model_revision: str = "", extra: Mapping[str, str] | None = None
) -> EngineNamespace:
    """The namespace of one vLLM instance's offload chunks."""
    facts = vllm_facts(spec, chunk_bytes=chunk_bytes, model_revision=model_revision, extra=extra)
    return EngineNamespace.of(ENGINE, KEY_FORMAT, facts)
