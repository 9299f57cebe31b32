"""Content addresses of KV chunks: the namespace fingerprint and chained chunk keys.

The byte-exact specification, with the reasoning, is docs/keys.md; the test
vectors in tests/vectors/keys.json pin it. In short:

    fingerprint = xxh3_128(b"kvcache.ns.v1\\0" || field_1 || ... || field_n)
    key_0       = xxh3_128(fingerprint || u32le(n_0) || u32le(t) for t in chunk_0)
    key_i       = xxh3_128(key_{i-1}   || u32le(n_i) || u32le(t) for t in chunk_i)

Digests are the 16-byte big-endian canonical form of XXH3-128 with seed 0.
Nothing here depends on Python's `hash`, so keys agree across processes,
restarts, machines and languages. This module never imports torch.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

KEY_BYTES = 16
"""Length of a chunk key and of a namespace fingerprint."""

CANONICAL_LAYOUT = "kvcache.canonical"
"""Canonical layout name: `[num_layers, 2 (K, V), num_kv_heads, chunk_tokens, head_size]`."""

MLA_LAYOUT = "kvcache.mla"
"""Canonical layout for MLA (latent) caches: `[num_layers, chunk_tokens, head_size]`."""

LAYOUT_VERSION = 1

HEADS_LAYOUT_VERSION = 2
"""`kvcache.canonical` v2, head-sharded: a namespace holds all of a model's KV heads (tp fields 1 and 0),
and each chunk is stored as blocks of consecutive heads under head_block_key (docs/keys.md)."""

_HEADS_DOMAIN = b"kvcache.heads.v1\x00"

_NAMESPACE_DOMAIN = b"kvcache.ns.v1\x00"
_MAX_TOKEN_ID = 2**32 - 1


def _str_field(value: str) -> bytes:
    data = value.encode("utf-8")
    return struct.pack("<I", len(data)) + data


def _int_field(value: int) -> bytes:
    return struct.pack("<Q", value)


def _check_str(name: str, value: object, *, allow_empty: bool) -> None:
    if not isinstance(value, str):
        raise ValueError(f"Namespace.{name} must be a str, got {type(value).__name__}")
    if not value and not allow_empty:
        raise ValueError(f"Namespace.{name} must not be empty")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"Namespace.{name} is not encodable as UTF-8 (lone surrogate?)") from None


def _check_int(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool):
        raise ValueError(f"Namespace.{name} must be an int, got a bool")
    try:
        number = operator.index(value)  # int and numpy integers; never floats
    except TypeError:
        raise ValueError(f"Namespace.{name} must be an int, got {type(value).__name__}") from None
    if not minimum <= number < 2**64:
        raise ValueError(f"Namespace.{name} must be in [{minimum}, 2**64), got {number}")
    return number


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything that makes two chunks' KV tensors incompatible.

    Two processes that build equal `Namespace` objects compute equal keys for
    equal tokens; any field that differs gives disjoint keys.

    Attributes:
        model_id: Model name or path identity, e.g. "meta-llama/Llama-3.1-8B".
        kv_dtype: KV element type name, e.g. "bfloat16" (see format.DTYPES).
        chunk_tokens: Tokens per chunk (the last chunk of a prompt may be shorter).
        num_layers: Attention layers whose KV the chunk holds.
        num_kv_heads: KV heads held by this shard (after tensor parallelism).
        head_size: Size of one head.
        tp_size: Tensor-parallel world size.
        tp_rank: This shard's tensor-parallel rank.
        model_revision: Checkpoint revision, "" when not known.
        cache_salt: Per-tenant or per-request isolation string, "" for none.
        layout: Canonical layout name (CANONICAL_LAYOUT or MLA_LAYOUT).
        layout_version: Version of that layout.
        extra: Further engine facts that change the KV (LoRA name, pipeline
            rank, ...), as a str -> str mapping; stored as sorted (key, value)
            pairs and encoded in that order.
    """

    model_id: str
    kv_dtype: str
    chunk_tokens: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    tp_size: int = 1
    tp_rank: int = 0
    model_revision: str = ""
    cache_salt: str = ""
    layout: str = CANONICAL_LAYOUT
    layout_version: int = LAYOUT_VERSION
    extra: Mapping[str, str] | tuple[tuple[str, str], ...] = ()
    _fingerprint: bytes = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        for name in ("model_id", "kv_dtype", "layout", "model_revision", "cache_salt"):
            _check_str(name, getattr(self, name), allow_empty=name in ("model_revision", "cache_salt"))
        if self.layout not in (CANONICAL_LAYOUT, MLA_LAYOUT):
            raise ValueError(f"Namespace.layout must be {CANONICAL_LAYOUT!r} or {MLA_LAYOUT!r}, got {self.layout!r}")
        for name in ("chunk_tokens", "num_layers", "num_kv_heads", "head_size", "tp_size", "tp_rank", "layout_version"):
            value = _check_int(name, getattr(self, name), minimum=0 if name in ("tp_rank", "layout_version") else 1)
            object.__setattr__(self, name, value)
        if self.chunk_tokens > _MAX_TOKEN_ID:
            raise ValueError(f"Namespace.chunk_tokens must be < 2**32, got {self.chunk_tokens}")
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"Namespace.tp_rank {self.tp_rank} not in [0, {self.tp_size})")
        pairs = dict(self.extra.items() if isinstance(self.extra, Mapping) else self.extra)
        for k, v in pairs.items():
            _check_str("extra key", k, allow_empty=True)
            _check_str(f"extra[{k!r}]", v, allow_empty=True)
        # Sorted pairs in a tuple: immutable, hashable and picklable, so neither the caller's
        # dict nor anyone holding the namespace can change its keys later.
        object.__setattr__(self, "extra", tuple(sorted(pairs.items())))
        object.__setattr__(self, "_fingerprint", xxhash.xxh3_128_digest(self.canonical_bytes()))

    def canonical_bytes(self) -> bytes:
        """The exact bytes hashed into the fingerprint (docs/keys.md, "Namespace")."""
        parts = [
            _NAMESPACE_DOMAIN,
            _str_field(self.model_id),
            _str_field(self.model_revision),
            _str_field(self.kv_dtype),
            _str_field(self.layout),
            _int_field(self.layout_version),
            _int_field(self.chunk_tokens),
            _int_field(self.num_layers),
            _int_field(self.num_kv_heads),
            _int_field(self.head_size),
            _int_field(self.tp_size),
            _int_field(self.tp_rank),
            _str_field(self.cache_salt),
            _int_field(len(self.extra)),
        ]
        for k, v in self.extra:
            parts.append(_str_field(k))
            parts.append(_str_field(v))
        return b"".join(parts)

    @property
    def fingerprint(self) -> bytes:
        """16-byte XXH3-128 digest of `canonical_bytes()` (computed once, at construction)."""
        return self._fingerprint

    @property
    def name(self) -> str:
        """The namespace string sent to the server: hex of the fingerprint."""
        return self.fingerprint.hex()

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form, as used by tests/vectors/keys.json."""
        return {
            "model_id": self.model_id,
            "model_revision": self.model_revision,
            "kv_dtype": self.kv_dtype,
            "layout": self.layout,
            "layout_version": self.layout_version,
            "chunk_tokens": self.chunk_tokens,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "tp_size": self.tp_size,
            "tp_rank": self.tp_rank,
            "cache_salt": self.cache_salt,
            "extra": dict(self.extra),
        }


def _token_array(tokens: Sequence[int] | np.ndarray | Iterable[int]) -> np.ndarray:
    """Token ids as little-endian uint32, refusing non-integers and ids outside [0, 2**32)."""
    if isinstance(tokens, np.ndarray):
        arr = tokens
        if arr.dtype == object:
            arr = _token_array(arr.tolist())
    else:
        items = tokens if isinstance(tokens, Sequence) else list(tokens)
        if len(items) == 0:
            return np.empty(0, dtype="<u4")
        arr = np.asarray(items)
        if arr.dtype == object:  # ints too large for int64, or mixed types: check one by one
            for t in items:
                if isinstance(t, bool) or not isinstance(t, int | np.integer):
                    raise ValueError(f"token ids must be integers, got {type(t).__name__}")
            raise ValueError("token ids must be in [0, 2**32)")
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return arr.astype("<u4")
    if arr.dtype.kind not in "iu":  # floats, bools, strings
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) > _MAX_TOKEN_ID:
        raise ValueError("token ids must be in [0, 2**32)")
    return arr.astype("<u4", copy=False)


def chunk_key(parent: bytes, chunk: Sequence[int] | np.ndarray) -> bytes:
    """Key of one chunk given its parent (the previous key, or the fingerprint)."""
    if len(parent) != KEY_BYTES:
        raise ValueError(f"parent key must be {KEY_BYTES} bytes, got {len(parent)}")
    arr = _token_array(chunk)
    if arr.size == 0:
        raise ValueError("a chunk must hold at least one token")
    return xxhash.xxh3_128_digest(bytes(parent) + struct.pack("<I", arr.size) + arr.tobytes())


def chunk_keys(
    tokens: Sequence[int] | np.ndarray,
    namespace: Namespace,
    *,
    include_partial: bool = True,
) -> list[bytes]:
    """Keys of every chunk of `tokens`, in order.

    Args:
        tokens: The prompt's token ids, each in [0, 2**32).
        namespace: The namespace the KV belongs to; its chunk_tokens sets the chunk size.
        include_partial: Also key the final chunk when it holds fewer than
            chunk_tokens tokens (its hashed message differs from any full chunk's).

    Returns:
        One 16-byte key per chunk: len(tokens) // chunk_tokens keys, plus one
        for a partial tail when include_partial is true.
    """
    arr = _token_array(tokens)
    size = namespace.chunk_tokens
    parent = namespace.fingerprint
    keys: list[bytes] = []
    end = len(arr) if include_partial else len(arr) - len(arr) % size
    data = arr.tobytes()
    for start in range(0, end, size):
        n = min(size, end - start)
        parent = xxhash.xxh3_128_digest(parent + struct.pack("<I", n) + data[4 * start : 4 * (start + n)])
        keys.append(parent)
    return keys


def head_block_key(chunk_key: bytes, first_head: int, num_heads: int, total_heads: int) -> bytes:
    """Key of heads [first_head, first_head + num_heads) of a chunk in a head-sharded namespace.

    A block of all `total_heads` heads is the chunk itself, under the chunk's own key; any other
    head range gets H("kvcache.heads.v1\\0" || chunk_key || u32le(first_head) || u32le(num_heads)),
    so blocks of different ranges never share a key (docs/keys.md, "Head-sharded namespaces").

    Raises:
        ValueError: a key that is not 16 bytes, or a head range outside [0, total_heads).
    """
    if len(chunk_key) != KEY_BYTES:
        raise ValueError(f"chunk key must be {KEY_BYTES} bytes, got {len(chunk_key)}")
    if not (first_head >= 0 and num_heads >= 1 and first_head + num_heads <= total_heads < 2**32):
        raise ValueError(f"head range [{first_head}, {first_head + num_heads}) is not within {total_heads} heads")
    if num_heads == total_heads:
        return bytes(chunk_key)
    return xxhash.xxh3_128_digest(_HEADS_DOMAIN + bytes(chunk_key) + struct.pack("<II", first_head, num_heads))


def validate_key(key: bytes) -> None:
    """Raises ValueError unless `key` is a 16-byte chunk key."""
    if not isinstance(key, bytes | bytearray | memoryview) or len(key) != KEY_BYTES:
        raise ValueError(f"a chunk key is {KEY_BYTES} bytes, got {len(key) if hasattr(key, '__len__') else key!r}")
