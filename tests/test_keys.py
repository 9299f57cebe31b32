"""The chunk-key contract (docs/keys.md): vectors from an independent implementation, plus properties."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache_core.keys import KEY_BYTES, MLA_LAYOUT, Namespace, chunk_key, chunk_keys

pytestmark = pytest.mark.timeout(60)

VECTORS_PATH = Path(__file__).resolve().parent / "vectors" / "keys.json"
VECTORS: list[dict[str, Any]] = json.loads(VECTORS_PATH.read_text(encoding="utf-8"))["vectors"]

BASE = {
    "model_id": "meta-llama/Llama-3.1-8B",
    "kv_dtype": "bfloat16",
    "chunk_tokens": 4,
    "num_layers": 32,
    "num_kv_heads": 8,
    "head_size": 128,
}
NS = Namespace(**BASE)
U32_MAX = 2**32 - 1

token_ids = st.integers(min_value=0, max_value=U32_MAX)
token_lists = st.lists(token_ids, max_size=80)
chunk_sizes = st.integers(min_value=1, max_value=17)


def hexes(keys: list[bytes]) -> list[str]:
    return [k.hex() for k in keys]


# --- vectors -----------------------------------------------------------------------------------------------------


def test_vector_file_covers_the_contract() -> None:
    names = [v["name"] for v in VECTORS]
    assert len(names) >= 24 and len(set(names)) == len(names)
    all_tokens = [t for v in VECTORS for t in v["tokens"]]
    assert U32_MAX in all_tokens and any(t > 2**31 for t in all_tokens) and any(2**16 < t < 2**31 for t in all_tokens)
    assert any(not v["tokens"] for v in VECTORS)
    assert any(v["namespace"]["layout"] == MLA_LAYOUT for v in VECTORS)
    assert {1, 16, 256} <= {v["namespace"]["chunk_tokens"] for v in VECTORS}
    assert any(list(v["namespace"]["extra"]) != sorted(v["namespace"]["extra"]) for v in VECTORS)
    assert len({v["namespace"]["tp_rank"] for v in VECTORS if v["namespace"]["tp_size"] > 1}) >= 3
    assert any(v["namespace"]["cache_salt"] for v in VECTORS) and any(not v["namespace"]["cache_salt"] for v in VECTORS)
    assert any(v["namespace"]["model_revision"] for v in VECTORS)
    tails = [len(v["tokens"]) % v["namespace"]["chunk_tokens"] for v in VECTORS if v["tokens"]]
    assert 0 in tails and any(tails)
    assert any(0 < len(v["tokens"]) < v["namespace"]["chunk_tokens"] for v in VECTORS)
    assert any(len(v["tokens"]) >= 1000 for v in VECTORS)


@pytest.mark.parametrize("vector", VECTORS, ids=[v["name"] for v in VECTORS])
def test_vector(vector: dict[str, Any]) -> None:
    ns = Namespace(**vector["namespace"])
    if "canonical" in vector:
        assert ns.canonical_bytes().hex() == vector["canonical"]
    assert ns.fingerprint.hex() == vector["fingerprint"]
    assert ns.name == vector["namespace_name"] == vector["fingerprint"]
    assert hexes(chunk_keys(vector["tokens"], ns)) == vector["keys"]
    full = len(vector["tokens"]) // ns.chunk_tokens
    assert hexes(chunk_keys(vector["tokens"], ns, include_partial=False)) == vector["keys"][:full]
    # The one-chunk-at-a-time API agrees with the batch API.
    parent, tokens, size = ns.fingerprint, vector["tokens"], ns.chunk_tokens
    for i, expected in enumerate(vector["keys"]):
        parent = chunk_key(parent, tokens[i * size : (i + 1) * size])
        assert parent.hex() == expected


def test_docs_worked_example() -> None:
    """The numbers printed in docs/keys.md, "Worked example"."""
    ns = Namespace(**{**BASE, "extra": {"lora": "sql-adapter"}})
    assert len(ns.canonical_bytes()) == 169
    assert ns.name == "00dc6ec939e1ae0d3487d40b5fc0c6ac"
    assert hexes(chunk_keys([128000, 791, 6460, 374, 6437, 13], ns)) == [
        "82a825cc8a8cef6b9227e27359fc5d7f",
        "1349d924c1d4d9d364ed7c9bcd7154cd",
    ]
    assert xxhash.xxh3_128_digest(b"").hex() == "99aa06d3014798d86001c324468d497f"


# --- properties --------------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(tokens=token_lists, size=chunk_sizes)
def test_include_partial_false_drops_only_the_tail(tokens: list[int], size: int) -> None:
    ns = dataclasses.replace(NS, chunk_tokens=size)
    with_tail = chunk_keys(tokens, ns)
    without = chunk_keys(tokens, ns, include_partial=False)
    full = len(tokens) // size
    assert len(without) == full
    assert with_tail[:full] == without
    assert len(with_tail) == full + (1 if len(tokens) % size else 0)
    assert all(len(k) == KEY_BYTES for k in with_tail)


@settings(max_examples=60, deadline=None)
@given(tokens=token_lists, size=chunk_sizes, cut=st.integers(min_value=0, max_value=80))
def test_prefix_keys_are_a_prefix_of_the_prompt_keys(tokens: list[int], size: int, cut: int) -> None:
    ns = dataclasses.replace(NS, chunk_tokens=size)
    prefix = tokens[: min(cut, len(tokens))]
    full = len(prefix) // size
    prompt_keys = chunk_keys(tokens, ns)
    assert chunk_keys(prefix, ns, include_partial=False) == prompt_keys[:full]
    if len(prefix) % size and len(prefix) < len(tokens):
        # A prefix's partial tail names "these tokens and no more": never a key of the longer prompt.
        assert chunk_keys(prefix, ns)[-1] not in prompt_keys


@settings(max_examples=40, deadline=None)
@given(tokens=st.lists(token_ids, min_size=2, max_size=40), data=st.data())
def test_partial_chunk_key_differs_from_full_chunk_key(tokens: list[int], data: st.DataObject) -> None:
    size = len(tokens)
    n = data.draw(st.integers(min_value=1, max_value=size - 1))
    ns = dataclasses.replace(NS, chunk_tokens=size)
    (full_key,) = chunk_keys(tokens, ns)
    (partial_key,) = chunk_keys(tokens[:n], ns)
    assert partial_key != full_key
    assert chunk_key(ns.fingerprint, tokens[:n]) == partial_key
    assert chunk_key(ns.fingerprint, tokens) == full_key


def test_partial_tail_after_full_chunks_differs_from_full_chunk() -> None:
    tokens = list(range(100, 112))  # three full chunks of 4
    full = chunk_keys(tokens, NS)
    for n in range(1, 4):
        partial = chunk_keys(tokens[: 8 + n], NS)
        assert partial[:2] == full[:2]
        assert partial[2] != full[2]
        assert partial[2] not in full


FIELD_CHANGES: list[tuple[str, Any]] = [
    ("model_id", "meta-llama/Llama-3.1-8B-Instruct"),
    ("model_id", "meta-llama/llama-3.1-8b"),
    ("model_revision", "main"),
    ("kv_dtype", "float16"),
    ("layout", MLA_LAYOUT),
    ("layout_version", 2),
    ("layout_version", 0),
    ("chunk_tokens", 5),
    ("num_layers", 33),
    ("num_kv_heads", 4),
    ("head_size", 64),
    ("tp_size", 2),
    ("cache_salt", "tenant-a"),
    ("cache_salt", " "),
    ("extra", {"lora": "x"}),
    ("extra", {"": ""}),
]


@pytest.mark.parametrize(("field", "value"), FIELD_CHANGES, ids=[f"{f}={v!r}" for f, v in FIELD_CHANGES])
def test_changing_any_namespace_field_changes_every_key(field: str, value: Any) -> None:
    tokens = list(range(7, 7 + 4 * 5 + 2))  # five full chunks of 4 and a tail (chunk_tokens=5 also gets a tail)
    base_keys = chunk_keys(tokens, NS)
    changed = dataclasses.replace(NS, **{field: value})
    assert changed.fingerprint != NS.fingerprint
    new_keys = chunk_keys(tokens, changed)
    assert not set(new_keys) & set(base_keys)


def test_changing_tp_rank_and_extra_details_changes_every_key() -> None:
    tokens = list(range(30))
    ranks = [Namespace(**{**BASE, "tp_size": 4, "tp_rank": r}) for r in range(4)]
    variants = [
        *ranks,
        Namespace(**BASE, extra={"lora": "a"}),
        Namespace(**BASE, extra={"lora": "b"}),
        Namespace(**BASE, extra={"lorb": "a"}),
        Namespace(**BASE, extra={"lora": "a", "pp_rank": "0"}),
        Namespace(**BASE, extra={"lo": "ra"}),
        Namespace(**{**BASE, "model_id": "caf\u00e9"}),  # NFC
        Namespace(**{**BASE, "model_id": "cafe\u0301"}),  # NFD: no normalization, so a different namespace
    ]
    all_keys = [k for ns in variants for k in chunk_keys(tokens, ns)]
    assert len(set(all_keys)) == len(all_keys)


def test_extra_order_does_not_matter() -> None:
    a = Namespace(**BASE, extra={"b": "2", "a": "1", "\U0001f600": "x", "\uff21": "y"})
    b = Namespace(**BASE, extra={"\uff21": "y", "a": "1", "\U0001f600": "x", "b": "2"})
    assert a.fingerprint == b.fingerprint


@settings(max_examples=30, deadline=None)
@given(tokens=token_lists, size=chunk_sizes)
def test_token_container_types_give_equal_keys(tokens: list[int], size: int) -> None:
    ns = dataclasses.replace(NS, chunk_tokens=size)
    expected = chunk_keys(tokens, ns)
    assert chunk_keys(tuple(tokens), ns) == expected
    assert chunk_keys(np.array(tokens, dtype=np.int64), ns) == expected
    assert chunk_keys(np.array(tokens, dtype=np.uint32), ns) == expected
    assert chunk_keys(np.array(tokens, dtype=np.uint64), ns) == expected
    assert chunk_keys(np.array(tokens, dtype=">u4"), ns) == expected  # byte order of the input is irrelevant


def test_token_container_types_fixed_example() -> None:
    tokens = [0, 1, 65536, 2**31, U32_MAX, 128000, 7, 9, 11]
    expected = chunk_keys(tokens, NS)
    assert len(expected) == 3
    for variant in (tuple(tokens), np.array(tokens, dtype=np.int64), np.array(tokens, dtype=np.uint32)):
        assert chunk_keys(variant, NS) == expected


@pytest.mark.parametrize(
    "tokens",
    [
        [-1],
        [1, 2, -5],
        [2**32],
        [1, 2**32 + 7],
        [2**63],
        [2**64],
        [-(2**63) - 1],
        np.array([-1, 3], dtype=np.int64),
        np.array([2**32], dtype=np.int64),
        np.array([2**64 - 1], dtype=np.uint64),
        np.array([-1], dtype=np.int8),
    ],
    ids=lambda t: repr(t)[:40],
)
def test_out_of_range_token_ids_raise(tokens: Any) -> None:
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 2\*\*32\)"):
        chunk_keys(tokens, NS)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 2\*\*32\)"):
        chunk_key(NS.fingerprint, tokens)


def test_non_integer_and_malformed_tokens_raise() -> None:
    with pytest.raises(ValueError):
        chunk_keys(np.array([1.0, 2.0]), NS)
    with pytest.raises(ValueError):
        chunk_keys(np.array([[1, 2], [3, 4]]), NS)
    with pytest.raises(ValueError):
        chunk_key(NS.fingerprint, [])
    with pytest.raises(ValueError):
        chunk_key(b"\x00" * 15, [1])


def test_empty_prompt_has_no_keys() -> None:
    assert chunk_keys([], NS) == []
    assert chunk_keys(np.array([], dtype=np.int64), NS) == []
    assert chunk_keys([1, 2, 3], NS, include_partial=False) == []


@pytest.mark.parametrize(
    "overrides",
    [
        {"model_id": ""},
        {"kv_dtype": ""},
        {"chunk_tokens": 0},
        {"chunk_tokens": -4},
        {"num_layers": 0},
        {"num_kv_heads": 0},
        {"head_size": 0},
        {"tp_size": 0},
        {"tp_size": 2, "tp_rank": 2},
        {"tp_size": 2, "tp_rank": 5},
        {"tp_rank": -1},
        {"layout_version": -1},
        {"extra": {"lora": 1}},
        {"extra": {1: "x"}},
    ],
    ids=repr,
)
def test_namespace_validation_errors(overrides: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        Namespace(**{**BASE, **overrides})


def test_namespace_copies_the_callers_extra() -> None:
    extra = {"lora": "a"}
    ns = Namespace(**BASE, extra=extra)
    before = ns.fingerprint
    extra["pp_rank"] = "1"
    assert ns.fingerprint == before


_SUBPROCESS_CODE = """
from kvcache_core.keys import Namespace, chunk_keys
ns = Namespace(model_id="m/\\u65e5\\u672c", kv_dtype="bfloat16", chunk_tokens=4, num_layers=2, num_kv_heads=2,
               head_size=8, cache_salt="s", extra={"b": "2", "a": "1", "c": "3"})
print(ns.name)
for k in chunk_keys(list(range(100, 111)), ns):
    print(k.hex())
"""


def test_keys_do_not_depend_on_pythonhashseed() -> None:
    outputs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run(
            [sys.executable, "-c", _SUBPROCESS_CODE], env=env, capture_output=True, text=True, timeout=30, check=True
        )
        outputs.append(proc.stdout.split())
    ns = Namespace(
        model_id="m/\u65e5\u672c",
        kv_dtype="bfloat16",
        chunk_tokens=4,
        num_layers=2,
        num_kv_heads=2,
        head_size=8,
        cache_salt="s",
        extra={"b": "2", "a": "1", "c": "3"},
    )
    expected = [ns.name, *hexes(chunk_keys(list(range(100, 111)), ns))]
    assert len(expected) == 4
    assert outputs[0] == outputs[1] == expected


# --- hardening: inputs that must fail early and clearly -------------------------------------------------------------


def test_namespace_extra_cannot_be_mutated_after_construction() -> None:
    ns = Namespace(**BASE, extra={"b": "1"})
    with pytest.raises((TypeError, AttributeError)):
        ns.extra["a"] = "2"  # type: ignore[index]
    # Insertion order does not matter: equal namespaces, equal names, equal hashes.
    a = Namespace(**BASE, extra={"a": "2", "b": "1"})
    b = Namespace(**BASE, extra={"b": "1", "a": "2"})
    assert a == b and hash(a) == hash(b) and a.name == b.name


def test_namespace_survives_pickling() -> None:
    import pickle

    ns = Namespace(**BASE, extra={"lora": "x"})
    again = pickle.loads(pickle.dumps(ns))
    assert again == ns and again.name == ns.name


@pytest.mark.parametrize("tokens", [[1.7, 2.0], ["1", "2"], [True], [1, None], np.array([1.0, 2.0])])
def test_non_integer_token_ids_are_rejected(tokens: object) -> None:
    with pytest.raises(ValueError, match="integers"):
        chunk_keys(tokens, NS)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "changes",
    [
        {"tp_rank": 0.0},
        {"layout_version": 1.5},
        {"num_layers": 2**64},
        {"cache_salt": None},
        {"model_revision": 3},
        {"model_id": "bad\ud800"},
        {"layout": ""},
        {"layout": "engine.paged"},
        {"chunk_tokens": 2**32},
        {"head_size": True},
        {"extra": {"k": 1}},
    ],
)
def test_namespace_rejects_bad_fields_at_construction(changes: dict) -> None:
    with pytest.raises(ValueError):
        Namespace(**{**BASE, **changes})


def test_numpy_integers_are_accepted_as_fields() -> None:
    assert Namespace(**{**BASE, "num_layers": np.int64(BASE["num_layers"])}).name == Namespace(**BASE).name
