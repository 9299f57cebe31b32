"""Independent reference implementation of docs/keys.md; writes tests/vectors/keys.json.

Written from the specification alone: it uses only `struct` and `xxhash.xxh3_128_digest` and
deliberately does not import kvcache_client, so tests/test_keys.py checks the client against a
second implementation rather than against itself.

Run from anywhere:  python tests/vectors/gen_keys.py
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from xxhash import xxh3_128_digest

DOMAIN = b"kvcache.ns.v1\x00"
OUT = Path(__file__).resolve().parent / "keys.json"

STR_FIELDS_HEAD = ("model_id", "model_revision", "kv_dtype", "layout")
INT_FIELDS = ("layout_version", "chunk_tokens", "num_layers", "num_kv_heads", "head_size", "tp_size", "tp_rank")


def h(message: bytes) -> bytes:
    """XXH3-128, seed 0, 16-byte big-endian canonical form."""
    return xxh3_128_digest(message)


def enc_str(s: str) -> bytes:
    data = s.encode("utf-8")  # no normalization
    return struct.pack("<I", len(data)) + data


def enc_u64(x: int) -> bytes:
    return struct.pack("<Q", x)


def canonical(ns: dict[str, Any]) -> bytes:
    out = [DOMAIN]
    out += [enc_str(ns[f]) for f in STR_FIELDS_HEAD]
    out += [enc_u64(ns[f]) for f in INT_FIELDS]
    out.append(enc_str(ns["cache_salt"]))
    extra = ns["extra"]
    out.append(enc_u64(len(extra)))
    for k in sorted(extra):  # Python str order = code point order
        out.append(enc_str(k))
        out.append(enc_str(extra[k]))
    return b"".join(out)


def keys(tokens: list[int], ns: dict[str, Any]) -> list[bytes]:
    for t in tokens:
        if not 0 <= t < 2**32:
            raise ValueError("token ids must be in [0, 2**32)")
    size = ns["chunk_tokens"]
    parent = h(canonical(ns))
    result = []
    for start in range(0, len(tokens), size):
        chunk = tokens[start : start + size]
        parent = h(parent + struct.pack("<I", len(chunk)) + struct.pack(f"<{len(chunk)}I", *chunk))
        result.append(parent)
    return result


def lcg_tokens(n: int, seed: int, modulus: int) -> list[int]:
    """Fixed pseudo-random ids (64-bit LCG, Knuth's MMIX constants); stored explicitly in the JSON anyway."""
    x = seed
    out = []
    for _ in range(n):
        x = (x * 6364136223846793005 + 1442695040888963407) % 2**64
        out.append((x >> 32) % modulus)
    return out


def ns(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "model_id": "meta-llama/Llama-3.1-8B",
        "model_revision": "",
        "kv_dtype": "bfloat16",
        "layout": "kvcache.canonical",
        "layout_version": 1,
        "chunk_tokens": 16,
        "num_layers": 32,
        "num_kv_heads": 8,
        "head_size": 128,
        "tp_size": 1,
        "tp_rank": 0,
        "cache_salt": "",
        "extra": {},
    }
    unknown = set(overrides) - set(base)
    if unknown:
        raise KeyError(unknown)
    base.update(overrides)
    return base


def seq(n: int, start: int = 1) -> list[int]:
    return list(range(start, start + n))


def cases() -> list[tuple[str, dict[str, Any], list[int]]]:
    prompt40 = lcg_tokens(40, seed=7, modulus=128256)
    long1000 = lcg_tokens(1000, seed=2024, modulus=2**32)
    return [
        ("basic_partial_tail", ns(), prompt40),
        ("exact_multiple_of_chunk", ns(), prompt40[:32]),
        ("shorter_than_one_chunk", ns(), prompt40[:5]),
        ("empty_prompt", ns(), []),
        ("single_token", ns(), [128000]),
        ("chunk_tokens_1", ns(chunk_tokens=1), [128000, 9906, 11, 1917, 0, 0, 7]),
        ("chunk_tokens_256_partial", ns(chunk_tokens=256), lcg_tokens(600, seed=11, modulus=151936)),
        ("chunk_tokens_256_exact", ns(chunk_tokens=256), lcg_tokens(512, seed=12, modulus=151936)),
        ("cache_salt_nonempty", ns(cache_salt="tenant-42"), prompt40),
        ("cache_salt_unicode", ns(cache_salt="租户-ünïcødé-🔑"), prompt40),
        ("model_id_japanese", ns(model_id="日本語モデル/ライト-7B"), prompt40[:20]),
        ("model_id_emoji", ns(model_id="🦙 llama-🔥/v2"), prompt40[:20]),
        ("model_id_combining_nfc", ns(model_id="caf\u00e9-lm"), prompt40[:20]),
        ("model_id_combining_nfd", ns(model_id="cafe\u0301-lm"), prompt40[:20]),
        ("model_id_with_nul", ns(model_id="model\x00x"), prompt40[:20]),
        ("model_revision_set", ns(model_revision="0e9e39f249a16976918f6564b8830bc894c89659"), prompt40),
        (
            "extra_several_unsorted",
            ns(extra={"pp_rank": "1", "lora": "sql-adapter", "Zeta": "upper", "adapter_scale": "0.5", "ñ": "tilde"}),
            prompt40,
        ),
        # U+FF21 < U+1F600 by code point (and UTF-8 bytes), but not by UTF-16 code units.
        ("extra_astral_key_order", ns(extra={"\U0001f600": "grin", "\uff21": "fullwidth-A", "a": ""}), prompt40),
        ("extra_empty_value", ns(extra={"lora": ""}), prompt40),
        ("tp4_rank0", ns(tp_size=4, tp_rank=0, num_kv_heads=2), prompt40),
        ("tp4_rank1", ns(tp_size=4, tp_rank=1, num_kv_heads=2), prompt40),
        ("tp4_rank3", ns(tp_size=4, tp_rank=3, num_kv_heads=2), prompt40),
        ("token_ids_above_2_16", ns(chunk_tokens=4), [65536, 65537, 100000, 151935, 262143, 70000]),
        ("token_ids_above_2_31", ns(chunk_tokens=4), [2**31, 2**31 + 1, 3_000_000_000, 1, 2**31 - 1]),
        ("token_id_max_u32", ns(chunk_tokens=4), [2**32 - 1, 0, 2**32 - 1, 0, 2**32 - 1]),
        ("long_1000_chunk_16", ns(), long1000),
        ("long_1000_chunk_256", ns(chunk_tokens=256), long1000),
        (
            "mla_layout",
            ns(
                model_id="deepseek-ai/DeepSeek-V3",
                layout="kvcache.mla",
                kv_dtype="float8_e4m3fn",
                num_layers=61,
                num_kv_heads=1,
                head_size=576,
            ),
            prompt40,
        ),
        ("layout_version_2", ns(layout_version=2), prompt40),
        ("kv_dtype_float16", ns(kv_dtype="float16"), prompt40),
        ("u64_fields_above_2_32", ns(num_layers=2**33 + 5, head_size=2**40, layout_version=2**63), prompt40),
        (
            "everything_set",
            ns(
                model_id="Qwen/Qwen2.5-72B-Instruct",
                model_revision="main",
                kv_dtype="float16",
                chunk_tokens=64,
                num_layers=80,
                num_kv_heads=1,
                head_size=128,
                tp_size=8,
                tp_rank=5,
                cache_salt="s3cr3t",
                extra={"pp_rank": "0", "lora": "med"},
            ),
            lcg_tokens(200, seed=99, modulus=152064),
        ),
    ]


def main() -> None:
    vectors = []
    names = set()
    for name, namespace, tokens in cases():
        assert name not in names, name
        names.add(name)
        fp = h(canonical(namespace))
        vectors.append(
            {
                "name": name,
                "namespace": namespace,
                "tokens": tokens,
                "canonical": canonical(namespace).hex(),
                "fingerprint": fp.hex(),
                "namespace_name": fp.hex(),
                "keys": [k.hex() for k in keys(tokens, namespace)],
            }
        )
    lines = ",\n".join("    " + json.dumps(v, ensure_ascii=True) for v in vectors)
    OUT.write_text('{\n  "spec": "docs/keys.md",\n  "vectors": [\n' + lines + "\n  ]\n}\n", encoding="utf-8")
    print(f"wrote {len(vectors)} vectors to {OUT}")


if __name__ == "__main__":
    main()
