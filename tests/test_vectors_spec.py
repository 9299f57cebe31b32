"""The connectors' namespace vectors, recomputed by a second implementation written from the docs alone.

tests/vectors/namespaces.json holds what the project's connector code computes (tests/vectors/
gen_namespaces.py). Everything below the imports is written from docs/keys.md, docs/vllm.md
("Namespaces and keys, byte for byte") and docs/transformers.md ("The namespace") only: it imports
nothing of kvcache_core, kvcache_client or kvcache_connectors, just `struct` and xxhash, as an
implementation in another language would. Each vector's expected output must come out byte for byte
from its inputs; a mismatch means the docs and the code disagree. A last test checks that the
generator, run now, writes exactly the committed JSON.
"""

from __future__ import annotations

import importlib.util
import json
import math
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from xxhash import xxh3_64_intdigest, xxh3_128_digest

ROOT = Path(__file__).resolve().parents[1]
VECTORS_DIR = ROOT / "tests" / "vectors"
DATA: dict[str, Any] = json.loads((VECTORS_DIR / "namespaces.json").read_text(encoding="utf-8"))
VECTORS: list[dict[str, Any]] = DATA["vectors"]

# --- docs/keys.md: notation, namespace, chunk keys, head blocks, engine-keyed namespaces -------------------------

NS_DOMAIN = b"kvcache.ns.v1\0"
HEADS_DOMAIN = b"kvcache.heads.v1\0"
ENGINE_NS_DOMAIN = b"kvcache.ns.engine.v1\0"
ENGINE_KEY_DOMAIN = b"kvcache.engine-key.v1\0"


def H(message: bytes) -> bytes:
    return xxh3_128_digest(message)


def u32le(x: int) -> bytes:
    return struct.pack("<I", x)


def u64le(x: int) -> bytes:
    return struct.pack("<Q", x)


def enc(s: str) -> bytes:
    data = s.encode("utf-8")
    return u32le(len(data)) + data


def sorted_pairs(m: Mapping[str, str]) -> list[tuple[str, str]]:
    return sorted(m.items(), key=lambda kv: kv[0].encode("utf-8"))  # by UTF-8 bytes = by code point


def namespace_canonical(f: Mapping[str, Any]) -> bytes:
    out = NS_DOMAIN + enc(f["model_id"]) + enc(f["model_revision"]) + enc(f["kv_dtype"]) + enc(f["layout"])
    for name in ("layout_version", "chunk_tokens", "num_layers", "num_kv_heads", "head_size", "tp_size", "tp_rank"):
        out += u64le(f[name])
    out += enc(f["cache_salt"]) + u64le(len(f["extra"]))
    for k, v in sorted_pairs(f["extra"]):
        out += enc(k) + enc(v)
    return out


def chunk_keys(fingerprint: bytes, tokens: Sequence[int], chunk_tokens: int) -> list[bytes]:
    keys, parent = [], fingerprint
    for start in range(0, len(tokens), chunk_tokens):
        chunk = tokens[start : start + chunk_tokens]
        parent = H(parent + u32le(len(chunk)) + b"".join(u32le(t) for t in chunk))
        keys.append(parent)
    return keys


def head_block_key(key: bytes, first: int, n: int, total: int) -> bytes:
    return key if n == total else H(HEADS_DOMAIN + key + u32le(first) + u32le(n))


def namespace_entry(f: dict[str, Any]) -> dict[str, Any]:
    canonical = namespace_canonical(f)
    return {"fields": f, "canonical": canonical.hex(), "name": H(canonical).hex()}


def fields(**kw: Any) -> dict[str, Any]:
    """A namespace's fields, keys.md's defaults for those not given."""
    base = {
        "model_revision": "",
        "layout": "kvcache.canonical",
        "layout_version": 1,
        "tp_size": 1,
        "tp_rank": 0,
        "cache_salt": "",
        "extra": {},
    }
    base.update(kw)
    order = ("model_id", "model_revision", "kv_dtype", "layout", "layout_version", "chunk_tokens", "num_layers")
    order += ("num_kv_heads", "head_size", "tp_size", "tp_rank", "cache_salt", "extra")
    return {k: base[k] for k in order}


# --- docs/vllm.md: the vLLM connector ---------------------------------------------------------------------------


def layers_digest(names: Sequence[str]) -> str:
    digest = xxh3_64_intdigest("\0".join(names).encode("utf-8")).to_bytes(8, "big").hex()
    return f"{len(names)}:{names[0]}..{names[-1]}:{digest}"


def group_kind(group: Mapping[str, Any]) -> str:
    if group["spec"] == "SlidingWindowSpec":
        return f"sliding_window:{group['sliding_window']}"
    return "mla" if group["spec"] == "MLAAttentionSpec" else "full"


def escape(s: str) -> str:
    return "".join({"%": "%25", "@": "%40", ";": "%3B"}.get(ch, ch) for ch in s)


def vllm_spec(inputs: Mapping[str, Any]) -> dict[str, Any]:
    request = inputs["request"]
    tokens = request["prompt_token_ids"]
    if tokens is None or request["prompt_embeds"]:
        return {"cached": False, "groups": []}
    cfg = inputs["kv_connector_extra_config"]
    block = inputs["block_size"]
    chunk_tokens = cfg.get("chunk_tokens", block * math.ceil(256 / block))
    model_id = cfg.get("model_id") or inputs["model"]
    revision = cfg["model_revision"] if cfg.get("model_revision") is not None else (inputs["revision"] or "")
    extra = dict(cfg.get("namespace_extra", {}))
    if inputs["cache_dtype"] != "auto":
        extra["vllm.cache_dtype"] = inputs["cache_dtype"]
    if inputs["quantization"]:
        extra["vllm.quantization"] = inputs["quantization"]
    if request["lora_name"] is not None:
        extra["vllm.lora"] = escape(request["lora_name"]) + "@" + escape(request["lora_path"])
    if request["mm_features"]:
        extra["vllm.mm"] = ";".join(f"{escape(f['identifier'])}@{f['offset']}" for f in request["mm_features"])
    salt = request["cache_salt"] or ""
    tp, replicas = inputs["tensor_parallel_size"], inputs["kv_tp_replicas"]
    shards = tp // replicas
    groups = inputs["kv_cache_groups"]
    out = []
    for group in groups:
        group_extra = dict(extra)
        if len(groups) > 1 or group["spec"] == "SlidingWindowSpec":
            group_extra["vllm.kv_group"] = group_kind(group)
            group_extra["vllm.kv_group_layers"] = layers_digest(group["layer_names"])
        common = {
            "model_id": model_id,
            "model_revision": revision,
            "kv_dtype": group["dtype"].removeprefix("torch."),
            "chunk_tokens": chunk_tokens,
            "num_layers": len(group["layer_names"]),
            "head_size": group["head_size"],
            "cache_salt": salt,
            "extra": dict(sorted_pairs(group_extra)),
        }
        h = group["num_kv_heads"]
        if group["spec"] == "MLAAttentionSpec":
            namespaces = [
                fields(**common, layout="kvcache.mla", layout_version=1, num_kv_heads=h, tp_size=shards, tp_rank=s)
                for s in range(shards)
            ]
            g = None
        else:
            namespaces = [fields(**common, layout="kvcache.canonical", layout_version=2, num_kv_heads=h * shards)]
            g = cfg.get("kv_heads_per_block") or h
        entries = [namespace_entry(f) for f in namespaces]
        keys = [chunk_keys(bytes.fromhex(e["name"]), tokens, chunk_tokens) for e in entries]
        if g is None:  # MLA: a chunk's block in namespace s is its chunk key there
            blocks = [[keys[s][i].hex() for s in range(shards)] for i in range(len(keys[0]))]
            owned = [[s] for s in range(shards)]
        else:
            total = h * shards
            blocks = [[head_block_key(k, j * g, g, total).hex() for j in range(total // g)] for k in keys[0]]
            owned = [list(range(s * h // g, (s + 1) * h // g)) for s in range(shards)]
        out.append(
            {
                "namespaces": entries,
                "chunk_keys": [[k.hex() for k in ks] for ks in keys],
                "heads_per_block": g,
                "block_keys": blocks,
                "ranks": [
                    {"tp_rank": r, "shard": r // replicas, "writer": r % replicas == 0, "blocks": owned[r // replicas]}
                    for r in range(tp)
                ],
            }
        )
    return {"cached": True, "groups": out}


# --- docs/transformers.md: the transformers connector -----------------------------------------------------------


def transformers_spec(inputs: Mapping[str, Any]) -> dict[str, Any]:
    attrs, args = inputs["config_attributes"], inputs["namespace_for_model"]
    model_id = args.get("model_id") if args.get("model_id") is not None else attrs["_name_or_path"]
    revision = args["model_revision"] if args.get("model_revision") is not None else (attrs["_commit_hash"] or "")
    heads = attrs["num_attention_heads"]
    f = fields(
        model_id=model_id,
        model_revision=revision,
        kv_dtype=inputs["dtype"].removeprefix("torch."),
        layout="kvcache.canonical",
        layout_version=2,
        chunk_tokens=args.get("chunk_tokens", 256),
        num_layers=attrs["num_hidden_layers"],
        num_kv_heads=attrs["num_key_value_heads"] or heads,
        head_size=attrs["head_dim"] or attrs["hidden_size"] // heads,
        cache_salt=args.get("cache_salt", ""),
    )
    entry = namespace_entry(f)
    keys = chunk_keys(bytes.fromhex(entry["name"]), inputs["prompt_token_ids"], f["chunk_tokens"])
    return {**entry, "chunk_keys": [k.hex() for k in keys]}


# --- docs/keys.md, "Engine-keyed namespaces": the vLLM tier -----------------------------------------------------

JSON_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}


def json_string(s: str) -> str:
    out = []
    for ch in s:
        if ch in JSON_ESCAPES:
            out.append(JSON_ESCAPES[ch])
        elif 0x20 <= ord(ch) <= 0x7E:
            out.append(ch)
        elif ord(ch) > 0xFFFF:
            v = ord(ch) - 0x10000
            out.append(f"\\u{0xD800 + (v >> 10):04x}\\u{0xDC00 + (v & 0x3FF):04x}")
        else:
            out.append(f"\\u{ord(ch):04x}")
    return '"' + "".join(out) + '"'


def json_value(v: Any, item_sep: str, key_sep: str) -> str:
    if v is None:
        return "null"
    if v is True or v is False:
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, str):
        return json_string(v)
    if isinstance(v, list):
        return "[" + item_sep.join(json_value(x, item_sep, key_sep) for x in v) + "]"
    items = sorted(v.items())
    return "{" + item_sep.join(json_string(k) + key_sep + json_value(x, item_sep, key_sep) for k, x in items) + "}"


def tier_spec(inputs: Mapping[str, Any]) -> dict[str, Any]:
    oc, options, engine = inputs["offloading_config"], inputs["tier_options"], inputs["engine_config"]
    par = oc["parallel"]
    agnostic = par["is_parallelism_agnostic"] or oc["replicated_layout"]
    groups = [
        {k: g[k] for k in ("group_id", "tokens_per_block", "layer_names", "sliding_window_size_in_chunks")}
        for g in oc["groups"]
    ]
    facts = {
        "model_name": oc["model"]["name"],
        "model_revision": options["model_revision"],
        "dtype": oc["model"]["dtype"],
        "tokens_per_hash": str(oc["cache"]["tokens_per_hash"]),
        "blocks_per_chunk": str(oc["cache"]["blocks_per_chunk"]),
        "chunk_bytes": str(inputs["chunk_bytes"]),
        "kv_cache_groups": json_value(groups, ",", ":"),
        "replicated_layout": "true" if oc["replicated_layout"] else "false",
        "canonical_format": (
            inputs["canonical_format_id"] if oc["canonical_layout"] and oc["kv_cache_layout"] is not None else ""
        ),
        "kv_cache_layout": oc["kv_cache_layout"] or "",
        "model_facts": "none" if engine is None else "engine",
        "vllm_version": inputs["vllm_version"],
    }
    for name in ("tp_size", "pp_size", "pcp_size", "dcp_size"):
        facts[name] = "1" if agnostic else str(par[name])
    if engine is not None:
        facts["model_revision"] = options["model_revision"] or (engine["revision"] or "")
        facts["quantization"] = engine["quantization"] or ""
        overrides = engine["hf_overrides"]
        facts["hf_overrides"] = json_value(overrides, ", ", ": ") if isinstance(overrides, dict) else ""
    for k, v in options["namespace_extra"].items():
        facts["extra." + k] = v
    pairs = sorted_pairs(facts)
    canonical = ENGINE_NS_DOMAIN + enc("vllm") + enc("vllm.offload_key.v1") + u64le(len(pairs))
    canonical += b"".join(enc(k) + enc(v) for k, v in pairs)
    fingerprint = H(canonical)
    offload_keys = [bytes.fromhex(k["block_hash"]) + struct.pack(">I", k["group_idx"]) for k in inputs["offload_keys"]]
    return {
        "facts": dict(pairs),
        "canonical": canonical.hex(),
        "name": fingerprint.hex(),
        "offload_keys": [k.hex() for k in offload_keys],
        "keys": [H(ENGINE_KEY_DOMAIN + fingerprint + u32le(len(k)) + k).hex() for k in offload_keys],
    }


SPEC = {"vllm": vllm_spec, "transformers": transformers_spec, "vllm_tier": tier_spec}


# --- the tests ---------------------------------------------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("vector", VECTORS, ids=[v["name"] for v in VECTORS])
def test_the_spec_reproduces_the_vector(vector: dict[str, Any]) -> None:
    got = SPEC[vector["connector"]](vector["inputs"])
    assert json.loads(json.dumps(got)) == vector["expected"]


@pytest.mark.timeout(30)
def test_the_spec_implementation_matches_the_keys_md_worked_example() -> None:
    """A check of the notation above against docs/keys.md's printed numbers (its own vectors are keys.json)."""
    f = fields(
        model_id="meta-llama/Llama-3.1-8B",
        kv_dtype="bfloat16",
        chunk_tokens=4,
        num_layers=32,
        num_kv_heads=8,
        head_size=128,
        extra={"lora": "sql-adapter"},
    )
    fingerprint = H(namespace_canonical(f))
    assert fingerprint.hex() == "00dc6ec939e1ae0d3487d40b5fc0c6ac"
    keys = chunk_keys(fingerprint, [128000, 791, 6460, 374, 6437, 13], 4)
    assert [k.hex() for k in keys] == ["82a825cc8a8cef6b9227e27359fc5d7f", "1349d924c1d4d9d364ed7c9bcd7154cd"]
    assert head_block_key(keys[0], 2, 2, 8).hex() == "4b298d5d09da89536d57ee6592bfa734"


@pytest.mark.timeout(30)
def test_the_vectors_cover_every_extra_and_rule() -> None:
    extras: set[str] = set()
    kinds: set[str] = set()
    for v in VECTORS:
        for g in v["expected"].get("groups", []):
            for ns in g["namespaces"]:
                extras |= set(ns["fields"]["extra"])
                kinds.add(ns["fields"]["extra"].get("vllm.kv_group", "").split(":")[0])
    vllm_keys = {k for k in extras if k.startswith("vllm.")}
    assert vllm_keys == {
        "vllm.cache_dtype",
        "vllm.quantization",
        "vllm.lora",
        "vllm.mm",
        "vllm.kv_group",
        "vllm.kv_group_layers",
    }
    assert {"full", "sliding_window"} <= kinds
    requests = [v["inputs"]["request"] for v in VECTORS if v["connector"] == "vllm"]
    escaped = "".join(f["identifier"] for r in requests for f in r["mm_features"]) + "".join(
        (r["lora_name"] or "") + (r["lora_path"] or "") for r in requests
    )
    assert {"%", "@", ";"} <= set(escaped)
    by_name = {v["name"]: v for v in VECTORS}
    tp_over_heads = by_name["vllm_tp8_two_kv_heads_replicated"]
    assert (
        tp_over_heads["inputs"]["tensor_parallel_size"]
        > tp_over_heads["expected"]["groups"][0]["namespaces"][0]["fields"]["num_kv_heads"]
    )
    assert not by_name["vllm_prompt_embeds_not_cached"]["expected"]["cached"]
    assert {v["connector"] for v in VECTORS} == set(SPEC)
    facts = set().union(*(v["expected"]["facts"] for v in VECTORS if v["connector"] == "vllm_tier"))
    assert {"quantization", "hf_overrides", "extra.finetune", "canonical_format", "kv_cache_groups"} <= facts


@pytest.mark.timeout(30)
def test_the_docs_worked_examples_are_the_vectors() -> None:
    by_name = {v["name"]: v for v in VECTORS}
    vllm_md = (ROOT / "docs" / "vllm.md").read_text(encoding="utf-8")
    hybrid = by_name["vllm_hybrid_with_lora"]["expected"]["groups"][1]
    ns = hybrid["namespaces"][0]
    assert ns["name"] in vllm_md and ns["fields"]["extra"]["vllm.kv_group_layers"] in vllm_md
    assert f"{len(ns['canonical']) // 2} canonical bytes" in vllm_md
    assert hybrid["chunk_keys"][0][0] in vllm_md
    tp2 = by_name["vllm_tp2"]["expected"]["groups"][0]
    assert tp2["namespaces"][0]["name"] in vllm_md and tp2["chunk_keys"][0][0] in vllm_md
    assert all(k in vllm_md for k in tp2["block_keys"][0])
    transformers_md = (ROOT / "docs" / "transformers.md").read_text(encoding="utf-8")
    assert by_name["transformers_llama_gqa"]["expected"]["name"] in transformers_md


def _load_generator() -> Any:
    spec = importlib.util.spec_from_file_location("gen_namespaces", VECTORS_DIR / "gen_namespaces.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(300)
def test_the_committed_vectors_are_what_the_generator_writes() -> None:
    """namespaces.json is fresh: the connectors' code, run now, computes exactly the committed vectors."""
    pytest.importorskip("vllm")
    pytest.importorskip("transformers")
    generator = _load_generator()
    assert generator.render(generator.build()) == (VECTORS_DIR / "namespaces.json").read_text(encoding="utf-8"), (
        "tests/vectors/namespaces.json is stale: run .venv/bin/python tests/vectors/gen_namespaces.py "
        "and review the diff (a change there changes the keys every deployed instance computes)"
    )


@pytest.mark.timeout(30)
def test_nothing_of_the_project_is_imported_by_the_spec() -> None:
    source = Path(__file__).read_text(encoding="utf-8")
    head = source[: source.index("# --- the tests")]
    for package in ("kvcache_core", "kvcache_client", "kvcache_connectors"):
        assert f"import {package}" not in head and f"from {package}" not in head


@pytest.mark.timeout(120)
def test_vllm_reports_tp_replicas_as_docs_vllm_md_says() -> None:
    """docs/vllm.md's rank-to-head rule takes vLLM's kv_tp_replicas as given, and says how vLLM 0.33 computes
    it: T for MLA layers (max_tp_shards 1), 1 for other attention even when T exceeds the KV heads."""
    pytest.importorskip("vllm")
    import torch
    from vllm.v1.core.kv_cache_planning import kv_cache_groups_tp_replicas
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MLAAttentionSpec

    gqa = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    assert gqa.max_tp_shards is None
    assert kv_cache_groups_tp_replicas([KVCacheGroupSpec(["l0", "l1"], gqa)], 8) == 1
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, max_tp_shards=1)
    assert kv_cache_groups_tp_replicas([KVCacheGroupSpec(["l0", "l1"], mla)], 8) == 8
