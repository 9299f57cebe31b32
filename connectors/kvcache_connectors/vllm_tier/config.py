"""The tier's options: the keys of its entry in `secondary_tiers`, parsed once into a frozen dataclass.

    {"type": "KVCacheTier", "module_path": "kvcache_connectors.vllm_tier", "target": "HOST:51051", ...}

vLLM's SecondaryTierFactory pops `type`, `module_path` and `backpressure` and passes every other
key of the entry to the tier's constructor; `from_options` refuses a key it does not know, so a
typo fails at start-up instead of silently meaning the default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvcache_core.hints import parse_ttl_s


@dataclass(frozen=True, slots=True)
class KVCacheTierConfig:
    """Options of one kvcache secondary tier.

    Attributes:
        target: The kvcache server ("host:port").
        timeout_s: Deadline of one load or store job's call (one attempt, never retried), plus the
            job's bytes at min_rate_bytes_s.
        min_rate_bytes_s: The slowest transfer a job is given time for: a job of B bytes has
            timeout_s + B / min_rate_bytes_s (100 MB/s: 64 chunks of 2 MiB get 1.3 s more).
        lookup_timeout_s: Deadline of each Lookup call of a request's batch (a failure is a miss).
        breaker_cooldown_s: After a failed call, the tier stops calling the server for this long
            (lookups are misses, jobs fail at once), then probes it with one call: a dead server
            costs one timeout per cooldown, not one per job.
        max_queued_jobs: Jobs queued per direction (loads, stores) before a new one fails at once.
        shm: Same-host transfers through the server's block arena and shared memory (docs/arena.md).
        bulk: Remote transfers over the server's bulk port (docs/bulk.md).
        token: API token; None reads KVCACHE_TOKEN.
        model_revision: The checkpoint revision, part of the namespace ("" when unknown).
        namespace_extra: More facts that make KV incompatible (a fine-tune, a quantization recipe),
            part of the namespace.
        enable_kv_events: Report the chunks this tier stored through take_events (needs vLLM's
            KV cache events on, --kv-events-config).
        locality: "LOCAL" or "REMOTE" (vLLM's Locality), for tier filters and events; None for unknown.
        retain_ttl_s: Every store asks the server to retain its chunks for this many seconds (a
            number, or "300s", "5m", "1h"): evicted from the server's RAM after every unretained
            block, within its [retention] shares (docs/tiers.md, "Sessions that stay"); None (the
            default) retains nothing.
    """

    target: str
    timeout_s: float = 5.0
    min_rate_bytes_s: float = 100e6
    lookup_timeout_s: float = 1.0
    breaker_cooldown_s: float = 5.0
    max_queued_jobs: int = 64
    shm: bool = True
    bulk: bool = True
    token: str | None = field(default=None, repr=False)
    model_revision: str = ""
    namespace_extra: Mapping[str, str] = field(default_factory=dict)
    enable_kv_events: bool = False
    locality: str | None = "REMOTE"
    retain_ttl_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.target, str) or not self.target:
            raise ValueError("the kvcache tier needs 'target' (host:port of a kvcache server)")
        if self.retain_ttl_s is not None:
            object.__setattr__(self, "retain_ttl_s", parse_ttl_s(self.retain_ttl_s, what="retain_ttl_s"))
        for name in ("timeout_s", "lookup_timeout_s", "breaker_cooldown_s", "min_rate_bytes_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                unit = "bytes per second" if name == "min_rate_bytes_s" else "seconds"
                raise ValueError(f"{name} must be a positive number of {unit}, got {value!r}")
        if not isinstance(self.max_queued_jobs, int) or self.max_queued_jobs < 1:
            raise ValueError(f"max_queued_jobs must be a positive integer, got {self.max_queued_jobs!r}")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in dict(self.namespace_extra).items()):
            raise ValueError("namespace_extra must map strings to strings")
        for name in ("shm", "bulk", "enable_kv_events"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.locality not in (None, "LOCAL", "REMOTE"):
            raise ValueError(f"locality must be 'LOCAL', 'REMOTE' or null, got {self.locality!r}")

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> KVCacheTierConfig:
        """Parses the tier entry's keys (those vLLM's factory hands the constructor).

        Raises:
            ValueError: an unknown key, a missing target, or a value out of range.
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown kvcache tier option(s) {unknown}; known: {sorted(known)}")
        return cls(**dict(options))
