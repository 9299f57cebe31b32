"""Connector counters: recorded by each process, drained into vLLM's KV-connector stats every step.

The scheduler counts lookups and hits; each worker counts what it loaded and saved.
vLLM sums the workers' `KVCacheConnectorStats` with the scheduler's (`aggregate`),
ships them as the plain `data` dict, and its logger prints `reduce()` every interval:

    KV Transfer metrics: lookups=12, hit_tokens=3072, hit_rate=0.75, load_chunks=12, load_MBps=2310.4, ...
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats


@dataclass(slots=True)
class Counters:
    """What one process did since the last drain. Units are in the names; times are wall seconds.

    Attributes:
        lookups: Prompts looked up on the server (scheduler).
        lookup_failures: Lookups that failed or timed out (each a miss).
        lookups_skipped: Lookups not attempted while the breaker was open (each a miss).
        lookup_tokens: Prompt tokens looked up.
        hit_tokens: Tokens the scheduler was told it can load (after the local prefix cache hit).
        load_chunks: Chunks fetched and written into vLLM's blocks (workers).
        load_failures: Chunks that could not be loaded: missing, corrupt, of the wrong shape, or a failed call.
        load_bytes: Bytes of chunks loaded.
        load_s: Time spent loading (fetch, checks, scatter).
        save_chunks: Chunks the server stored.
        save_failures: Chunks not stored: a failed call, the breaker open, refused by the server,
            or computed from a block that failed to load in the same step.
        save_bytes: Bytes of chunks stored.
        save_dropped: Chunks not stored because the save queue or the staging memory was full
            (the oldest queued save is dropped; also counted in save_failures).
        save_s: Time spent saving (gather and copy to host on the model runner's thread; put on
            the save thread).
        save_retained_chunks: Chunks stored with a retention (of save_chunks; docs/vllm.md, "Sessions").
        retain_hints_ignored: Requests whose retention hint in kv_transfer_params was malformed
            (scheduler): logged, ignored, the request served as if it had none.
    """

    lookups: int = 0
    lookup_failures: int = 0
    lookups_skipped: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    load_chunks: int = 0
    load_failures: int = 0
    load_bytes: int = 0
    load_s: float = 0.0
    save_chunks: int = 0
    save_failures: int = 0
    save_bytes: int = 0
    save_dropped: int = 0
    save_s: float = 0.0
    save_retained_chunks: int = 0
    retain_hints_ignored: int = 0

    def add(self, other: Counters) -> None:
        """Adds another record's counts to this one."""
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def drain(self) -> dict[str, int | float] | None:
        """The non-zero counters, then resets them all; None when nothing happened."""
        data = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name)}
        for f in fields(self):
            setattr(self, f.name, type(getattr(self, f.name))())
        return data or None


@dataclass
class KVCacheConnectorStats(KVConnectorStats):
    """vLLM's stats container for this connector: `data` maps Counters field names to sums."""

    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVCacheConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self.data)
        if self.data.get("lookup_tokens"):
            out["hit_rate"] = round(self.data.get("hit_tokens", 0) / self.data["lookup_tokens"], 4)
        for what in ("load", "save"):
            seconds = self.data.get(f"{what}_s", 0.0)
            if seconds > 0:
                out[f"{what}_MBps"] = round(self.data.get(f"{what}_bytes", 0) / seconds / 1e6, 1)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())
