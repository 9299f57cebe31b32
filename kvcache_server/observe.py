"""The observation seam: core code reports timings here, metrics.py turns them into Prometheus metrics.

Counters that tiers already keep (hits, evictions, queue depth, ...) are not
reported through this seam: the metrics module reads them from Stats at scrape
time. Only what has no counter elsewhere goes through it: latencies and
per-namespace lookup results.
"""

from __future__ import annotations

from typing import Protocol


class Observer(Protocol):
    def tier_op(self, tier: str, op: str, seconds: float, ok: bool) -> None:
        """One call to a tier: op is lookup, get, put, delete, write_behind, ..."""

    def lookup(self, namespace: str, keys: int, hit_keys: int) -> None:
        """One Lookup: how many keys were asked and how long the stored prefix was."""

    def rpc(self, method: str, code: str, seconds: float) -> None:
        """One finished RPC with its status code name."""


class NullObserver:
    """Observes nothing (metrics disabled, unit tests)."""

    def tier_op(self, tier: str, op: str, seconds: float, ok: bool) -> None:
        pass

    def lookup(self, namespace: str, keys: int, hit_keys: int) -> None:
        pass

    def rpc(self, method: str, code: str, seconds: float) -> None:
        pass
