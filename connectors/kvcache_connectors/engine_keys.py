"""Namespaces and keys for chunks that an engine names with its own keys (docs/keys.md, "Engine-keyed namespaces").

kvcache's own connectors key a chunk by its tokens (kvcache_core.keys). An engine's cache
manager that keeps kvcache below it (vLLM's offloading tiers, LMCache's L2, SGLang's HiCache)
names its chunks with keys of its own: opaque bytes whose meaning only that engine knows, over
bytes whose layout only that engine knows. Such a chunk goes under

    namespace = hex(H(b"kvcache.ns.engine.v1\\0" || str(engine) || str(key_format)
                      || u64le(count(facts)) || str(k_1) || str(v_1) || ... ))      facts sorted by key
    key       = H(b"kvcache.engine-key.v1\\0" || fingerprint || u32le(len(engine_key)) || engine_key)

with H the XXH3-128 of docs/keys.md. `facts` are everything that makes two engines' bytes under
one engine key differ (model, dtype, page layout, chunk size, parallel layout), so two engines,
models or layouts never share bytes: they are in different namespaces, and their keys differ
too (the fingerprint is in every key). Nothing here imports an engine.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import xxhash

NAMESPACE_DOMAIN = b"kvcache.ns.engine.v1\0"
KEY_DOMAIN = b"kvcache.engine-key.v1\0"


def _str(value: str) -> bytes:
    data = value.encode("utf-8")
    return struct.pack("<I", len(data)) + data


def _h(message: bytes) -> bytes:
    return xxhash.xxh3_128_digest(message)


@dataclass(frozen=True, slots=True)
class EngineNamespace:
    """The kvcache namespace of one engine's chunks under one model and layout.

    Attributes:
        engine: The engine's name, e.g. "vllm".
        key_format: What the engine's keys are, e.g. "vllm.offload_key.v1".
        facts: Everything that changes the bytes stored under one engine key (strings only).
    """

    engine: str
    key_format: str
    facts: tuple[tuple[str, str], ...]
    # Derived once (mapping 16 keys took 7 us, 5 of them re-hashing the namespace; now 2-3).
    _fingerprint: bytes = field(init=False, repr=False, compare=False)
    _name: str = field(init=False, repr=False, compare=False)
    _key_prefix: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        fingerprint = _h(self.canonical_bytes())
        object.__setattr__(self, "_fingerprint", fingerprint)
        object.__setattr__(self, "_name", fingerprint.hex())
        object.__setattr__(self, "_key_prefix", KEY_DOMAIN + fingerprint)

    @classmethod
    def of(cls, engine: str, key_format: str, facts: Mapping[str, str]) -> EngineNamespace:
        """Builds one; facts are sorted by key (Unicode code points, as docs/keys.md's extra map).

        Raises:
            ValueError: engine or key_format is empty, or a fact's key or value is not a str.
        """
        if not engine or not key_format:
            raise ValueError("engine and key_format must be non-empty")
        for k, v in facts.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise ValueError(f"facts must map str to str, got {k!r}: {v!r}")
        return cls(engine, key_format, tuple(sorted(facts.items())))

    def canonical_bytes(self) -> bytes:
        parts = [NAMESPACE_DOMAIN, _str(self.engine), _str(self.key_format), struct.pack("<Q", len(self.facts))]
        for k, v in self.facts:
            parts += [_str(k), _str(v)]
        return b"".join(parts)

    @property
    def fingerprint(self) -> bytes:
        return self._fingerprint

    @property
    def name(self) -> str:
        """The namespace string sent to the server (32 lowercase hex characters)."""
        return self._name

    def key(self, engine_key: bytes) -> bytes:
        """The 16-byte kvcache key of one engine key in this namespace."""
        return self.keys([engine_key])[0]

    def keys(self, engine_keys: Iterable[bytes]) -> list[bytes]:
        """The kvcache keys of engine keys, in order (the fingerprint hashed once)."""
        prefix, h = self._key_prefix, xxhash.xxh3_128_digest
        heads: dict[int, bytes] = {}  # prefix || u32le(len): one per length (an engine's keys share one)
        out = []
        for k in engine_keys:
            n = len(k)
            head = heads.get(n)
            if head is None:
                head = heads[n] = prefix + n.to_bytes(4, "little")
            out.append(h(head + k if type(k) is bytes else head + bytes(k)))
        return out
