"""Which kvcache namespace and key an LMCache ObjectKey goes under (docs/lmcache.md, "Keys").

LMCache names a chunk with ObjectKey(chunk_hash, model_name, kv_rank, object_group_id, cache_salt):
the hash says which tokens, the other fields which model, which slice of the parallel layout
(kv_rank packs world size, global rank, local world size and local rank, 8 bits each), which object
group (an attention group, recurrent state) and which user or deployment (cache_salt). Everything
but the hash goes into the namespace (kvcache_connectors.engine_keys, "Engine-keyed namespaces"):

    namespace = EngineNamespace("lmcache", "lmcache.chunk_hash.v1", facts)
    facts     = model_name, kv_rank (decimal), object_group_id (decimal), cache_salt,
                extra.<k> for each of the adapter's namespace_extra
    key       = namespace.key(chunk_hash)

so two models, ranks, object groups or salts never share bytes: their namespaces differ, and so do
their keys (the namespace's fingerprint is in every key).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Protocol

from kvcache_connectors.engine_keys import EngineNamespace

ENGINE = "lmcache"
KEY_FORMAT = "lmcache.chunk_hash.v1"  # ObjectKey.chunk_hash, as LMCache's token hasher computes it


class ObjectKeyLike(Protocol):
    """The fields of LMCache's ObjectKey this mapping reads (nothing here imports LMCache)."""

    @property
    def chunk_hash(self) -> bytes: ...
    @property
    def model_name(self) -> str: ...
    @property
    def kv_rank(self) -> int: ...
    @property
    def object_group_id(self) -> int: ...
    @property
    def cache_salt(self) -> str: ...


Scope = tuple[str, int, int, str]
"""(model_name, kv_rank, object_group_id, cache_salt): what picks a namespace."""


def scope_of(key: ObjectKeyLike) -> Scope:
    return (key.model_name, key.kv_rank, key.object_group_id, key.cache_salt)


def lmcache_namespace(scope: Scope, extra: Mapping[str, str] | None = None) -> EngineNamespace:
    """The namespace of one (model, kv_rank, object group, salt) scope."""
    model_name, kv_rank, object_group_id, cache_salt = scope
    facts = {
        "model_name": model_name,
        "kv_rank": str(kv_rank),
        "object_group_id": str(object_group_id),
        "cache_salt": cache_salt,
    }
    for k, v in (extra or {}).items():
        facts[f"extra.{k}"] = v
    return EngineNamespace.of(ENGINE, KEY_FORMAT, facts)


class KeyMapper:
    """ObjectKeys to (namespace, key) groups; namespaces cached (at most `max_scopes`, least recent out).

    Thread-safe: the adapter's lanes map keys concurrently.
    """

    def __init__(self, extra: Mapping[str, str] | None = None, max_scopes: int = 4096) -> None:
        self._extra = dict(extra or {})
        self._max = max_scopes
        self._cache: OrderedDict[Scope, EngineNamespace] = OrderedDict()
        self._lock = threading.Lock()

    def namespace(self, scope: Scope) -> EngineNamespace:
        with self._lock:
            ns = self._cache.get(scope)
            if ns is not None:
                self._cache.move_to_end(scope)
                return ns
        ns = lmcache_namespace(scope, self._extra)
        with self._lock:
            self._cache[scope] = ns
            while len(self._cache) > self._max:
                self._cache.popitem(last=False)
        return ns

    def group(self, keys: Sequence[ObjectKeyLike]) -> list[tuple[str, list[int], list[bytes]]]:
        """The keys grouped by namespace: (namespace name, positions in `keys`, kvcache keys), in
        order of first appearance."""
        by_scope: dict[Scope, list[int]] = {}
        for i, key in enumerate(keys):
            by_scope.setdefault(scope_of(key), []).append(i)
        out = []
        for scope, positions in by_scope.items():
            ns = self.namespace(scope)
            out.append((ns.name, positions, ns.keys(keys[i].chunk_hash for i in positions)))
        return out
