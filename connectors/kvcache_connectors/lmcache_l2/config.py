"""The adapter's options: LMCache's `adapter_params`, parsed once into a frozen dataclass.

    lmcache server ... --l2-adapter '{"type": "plugin", "module_path": "kvcache_connectors.lmcache_l2",
        "class_name": "KVCacheL2Adapter", "adapter_params": {"target": "HOST:51051"}}'

LMCache's plugin factory hands `adapter_params` (a dict) to the adapter's constructor; `from_params`
refuses a key it does not know, so a typo fails at start-up instead of silently meaning the default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvcache_core.hints import parse_ttl_s

LOCKS = ("leases", "keys")


@dataclass(frozen=True, slots=True)
class KVCacheL2Config:
    """Options of one kvcache L2 adapter.

    Attributes:
        target: The kvcache server ("host:port").
        token: API token; None reads KVCACHE_TOKEN.
        timeout_s: Deadline of each store, load and delete call (one attempt, never retried).
        lookup_timeout_s: Deadline of each lookup-and-lock call (a failure makes its keys misses).
        breaker_cooldown_s: After a failed call the adapter stops calling the server for this long
            (lookups are misses, loads miss, stores fail at once), then probes it with one call.
        max_queued_tasks: Tasks queued per lane (store, lookup, load, control) before a new one
            completes at once as a failure or a miss.
        max_queued_bytes: Bytes of LMCache's buffers queued per data lane (store, load) before a new
            task completes at once as a failure or a miss.
        max_locked_bytes: Bytes of blocks held under locks (lookup-and-lock to unlock) at once; a
            lookup past it answers its hits without holding them (its load reads them again).
        locks: What a lookup-and-lock holds. "leases" (the default): read leases on the server, so
            a hit stays loadable until its unlock (the server cannot evict or delete it meanwhile).
            "keys": what LMCache's own adapters hold, a lock on the key in this process only (the
            adapter's delete skips it): the lookup is one Lookup, answered on the same host from
            the server's presence index without a call, and the load reads the blocks; a hit the
            server evicts before its load is a counted load miss, never other bytes.
        early_lookups: With locks="leases" on the server's host: a lookup that the server's presence
            index answers (every key in RAM or in no tier) is answered at once on LMCache's thread,
            each hit locked, and the hits' leases are taken right behind it on a lane of their own; a
            load waits for them. A hit the server evicts in that window (one LEASE round trip) is
            read again by its load, a counted miss if it is gone (`leases_lost`), never other
            bytes. false: a lookup's answer waits for its leases.
        shm: Same-host transfers through the server's block arena and shared memory (docs/arena.md);
            locks then pin the blocks in the server's RAM under read leases.
        bulk: Remote transfers over the server's bulk port (docs/bulk.md).
        max_capacity_bytes: Capacity LMCache may evict against (0: none; kvcache evicts on its own).
        namespace_extra: More facts that make KV incompatible (dtype, chunk size, a quantization
            recipe) that LMCache's ObjectKey does not carry; part of every namespace.
        retain_ttl_s: Every store asks the server to retain its chunks for this many seconds (a
            number, or "300s", "5m", "1h"): evicted from the server's RAM after every unretained
            block, within its [retention] shares (docs/tiers.md, "Sessions that stay"); None (the
            default) retains nothing.
    """

    target: str
    token: str | None = field(default=None, repr=False)
    timeout_s: float = 5.0
    lookup_timeout_s: float = 1.0
    breaker_cooldown_s: float = 5.0
    max_queued_tasks: int = 256
    max_queued_bytes: int = 1 << 30
    max_locked_bytes: int = 1 << 30
    shm: bool = True
    bulk: bool = True
    max_capacity_bytes: int = 0
    namespace_extra: Mapping[str, str] = field(default_factory=dict)
    retain_ttl_s: float | None = None
    locks: str = "leases"
    early_lookups: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.target, str) or not self.target:
            raise ValueError("the kvcache L2 adapter needs 'target' (host:port of a kvcache server)")
        if self.retain_ttl_s is not None:
            object.__setattr__(self, "retain_ttl_s", parse_ttl_s(self.retain_ttl_s, what="retain_ttl_s"))
        if self.token is not None and not isinstance(self.token, str):
            raise ValueError("token must be a string or null")
        for name in ("timeout_s", "lookup_timeout_s", "breaker_cooldown_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        for name in ("max_queued_tasks", "max_queued_bytes", "max_locked_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.max_capacity_bytes, bool) or not isinstance(self.max_capacity_bytes, int):
            raise ValueError(f"max_capacity_bytes must be an integer, got {self.max_capacity_bytes!r}")
        if self.max_capacity_bytes < 0:
            raise ValueError(f"max_capacity_bytes must be >= 0, got {self.max_capacity_bytes!r}")
        if self.locks not in LOCKS:
            raise ValueError(f"locks must be one of {list(LOCKS)}, got {self.locks!r}")
        for name in ("shm", "bulk", "early_lookups"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        extra = self.namespace_extra
        if not isinstance(extra, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in extra.items()
        ):
            raise ValueError("namespace_extra must map strings to strings")

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> KVCacheL2Config:
        """Parses LMCache's `adapter_params`.

        Raises:
            ValueError: params is not a mapping, an unknown key, a missing target, or a value out of range.
        """
        if not isinstance(params, Mapping):
            raise ValueError(f"adapter_params must be a JSON object, got {type(params).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"unknown kvcache L2 adapter option(s) {unknown}; known: {sorted(known)}")
        if "target" not in params:
            raise ValueError("the kvcache L2 adapter needs 'target' (host:port of a kvcache server)")
        return cls(**dict(params))
