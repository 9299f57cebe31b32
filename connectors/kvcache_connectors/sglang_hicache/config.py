"""The backend's options: its keys of `--hicache-storage-backend-extra-config`, parsed once.

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{
        "backend_name": "kvcache", "module_path": "kvcache_connectors.sglang_hicache",
        "class_name": "KVCacheHiCacheStorage", "interface_v1": 1, "target": "HOST:51051"}'

SGLang's dynamic backend factory hands the backend the whole JSON object (as
HiCacheStorageConfig.extra_config), its own keys included; `from_extra_config` skips those and
refuses a key it does not know, so a typo fails at start-up instead of silently meaning the
default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvcache_core.hints import parse_ttl_s

# Keys of the extra config that SGLang itself reads: the factory's three, the controller's switch
# to the zero-copy v1 path, and what HiCacheController / its parser pop before building the
# backend (listed too, for a backend built from the raw JSON).
SGLANG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "tp_lcm_size",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
    }
)


@dataclass(frozen=True, slots=True)
class HiCacheBackendConfig:
    """Options of the kvcache HiCache storage backend.

    Attributes:
        target: The kvcache server ("host:port").
        timeout_s: Deadline of one batch_get_v1 or batch_set_v1 call to the server (one attempt,
            never retried: SGLang retries a page on a later request anyway).
        lookup_timeout_s: Deadline of one batch_exists call (a failure is 0 pages).
        breaker_cooldown_s: After a failed call, the backend stops calling the server for this
            long (every call is a miss at once), then probes it with one call: a dead server
            costs one timeout per cooldown, not one per page batch.
        shm: Same-host transfers through the server's block arena and shared memory (docs/arena.md).
        bulk: Remote transfers over the server's bulk port (docs/bulk.md).
        presence_index: batch_exists reads the server's presence index where it shares one
            (same host; docs/presence.md), without an RPC; false asks the server every time.
        token: API token; None reads KVCACHE_TOKEN.
        model_revision: The checkpoint revision, part of the namespace ("" when unknown).
        namespace_extra: More facts that make KV incompatible (a fine-tune, a quantization recipe),
            part of the namespace.
        log_interval_s: At most one warning per kind of failure in this many seconds (the rest
            are counted, and the count is in the next warning).
        interface_v1: Whether SGLang's extra config switched its controller to the zero-copy v1
            path ("interface_v1": 1); only logged, the controller reads it itself.
        retain_ttl_s: Every store asks the server to retain its chunks for this many seconds (a
            number, or "300s", "5m", "1h"): evicted from the server's RAM after every unretained
            block, within its [retention] shares (docs/tiers.md, "Sessions that stay"); None (the
            default) retains nothing.
    """

    target: str
    timeout_s: float = 5.0
    lookup_timeout_s: float = 1.0
    breaker_cooldown_s: float = 5.0
    shm: bool = True
    bulk: bool = True
    presence_index: bool = True
    token: str | None = field(default=None, repr=False)
    model_revision: str = ""
    namespace_extra: Mapping[str, str] = field(default_factory=dict)
    log_interval_s: float = 10.0
    interface_v1: bool = False
    retain_ttl_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.target, str) or not self.target:
            raise ValueError("the kvcache HiCache backend needs 'target' (host:port of a kvcache server)")
        if self.retain_ttl_s is not None:
            object.__setattr__(self, "retain_ttl_s", parse_ttl_s(self.retain_ttl_s, what="retain_ttl_s"))
        for name in ("timeout_s", "lookup_timeout_s", "breaker_cooldown_s", "log_interval_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        for name in ("shm", "bulk", "presence_index", "interface_v1"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.token is not None and not isinstance(self.token, str):
            raise ValueError("token must be a string")
        if not isinstance(self.model_revision, str):
            raise ValueError("model_revision must be a string")
        if not isinstance(self.namespace_extra, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.namespace_extra.items()
        ):
            raise ValueError("namespace_extra must map strings to strings")

    @classmethod
    def from_extra_config(cls, extra_config: Mapping[str, Any] | None) -> HiCacheBackendConfig:
        """Parses HiCacheStorageConfig.extra_config (SGLang's own keys are skipped).

        Raises:
            ValueError: no extra config, an unknown key, a missing target, or a value out of range.
        """
        if not extra_config:
            raise ValueError("the kvcache HiCache backend needs --hicache-storage-backend-extra-config with 'target'")
        options = {k: v for k, v in extra_config.items() if k not in SGLANG_KEYS}
        known = {f.name for f in fields(cls)} - {"interface_v1"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown kvcache HiCache option(s) {unknown}; known: {sorted(known)}")
        if "target" not in options:
            raise ValueError("the kvcache HiCache backend needs 'target' (host:port of a kvcache server)")
        options["interface_v1"] = bool(extra_config.get("interface_v1", 0))  # as HiCacheController reads it
        if "namespace_extra" in options and isinstance(options["namespace_extra"], Mapping):
            options["namespace_extra"] = dict(options["namespace_extra"])
        return cls(**options)
