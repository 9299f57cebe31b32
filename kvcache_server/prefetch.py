"""Prefetch: promotions from the lower tiers (disk, Redis, S3) into RAM in the background, so that
a session's next turn finds its prefix in RAM (docs/tiers.md, "Prefetch").

    Prefetch RPC ──> Prefetcher.submit: where is each key (TierStack.locate, Lookup's deadlines)
                       in RAM ──> counted, nothing to do
                       in a lower tier ──> a job in the queue (bounded in keys, per tenant too)
                       nowhere ──> counted unknown
                     answers at once
    worker tasks ──> a job: TierStack.get(promote=True) window by window, each window's bytes
                     reserved in the in-flight budget first; the blocks verified as a Get's are,
                     leases released at once; each job within prefetch.timeout_s

Work is bounded: a call names at most `max_keys` keys; at most `queue_max_keys` keys wait, and
one tenant's at most half of them (with auth), the rest of a call's keys are dropped (counted);
`workers` jobs run at once, each reading at most limits.get_window_bytes (at the largest block
size seen in its namespace; one block when none was seen yet) per window from the lower tiers,
counted against the server's in-flight budget; a job that outlives `timeout_s` is cancelled and
its keys not yet in RAM count as failed.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass

from kvcache_server.budget import MemoryBudget
from kvcache_server.pipeline.get import BlockSizes
from kvcache_server.refusal import Refused
from kvcache_server.stack import TierStack
from kvcache_server.tiers.base import TierKind

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PrefetchLimits:
    """The [prefetch] section's values (kvcache_server.config.PrefetchSection)."""

    max_keys: int = 4096
    queue_max_keys: int = 65536
    workers: int = 2
    timeout_s: float = 10.0
    window_bytes: int = 64 << 20  # limits.get_window_bytes


@dataclass(frozen=True, slots=True)
class PrefetchAnswer:
    """What one Prefetch did with its keys: in_ram + queued + unknown + dropped = keys asked."""

    in_ram: int
    queued: int
    unknown: int
    dropped: int


@dataclass(slots=True)
class _Job:
    namespace: str
    tenant: str | None
    keys: list[bytes]


class PrefetchCounters:
    """Monotonic counters (Stats, metrics)."""

    __slots__ = ("dropped", "failed", "promoted", "queued")

    def __init__(self) -> None:
        self.queued = 0  # keys queued for promotion
        self.promoted = 0  # keys a job found in RAM once it ended (promoted by it, or meanwhile)
        self.dropped = 0  # keys not queued: the queue (or the tenant's half of it) was full
        self.failed = 0  # keys a job did not bring into RAM: gone, corrupt, no room, its deadline

    def snapshot(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


class Prefetcher:
    """The Prefetch RPC's queue and workers; one per server, started and closed with it."""

    def __init__(self, stack: TierStack, limits: PrefetchLimits, budget: MemoryBudget, block_sizes: BlockSizes) -> None:
        self._stack = stack
        self.limits = limits
        self._budget = budget
        self._block_sizes = block_sizes
        self._jobs: deque[_Job] = deque()
        self._ready = asyncio.Event()
        self._waiting = 0  # keys in queued jobs (not yet taken by a worker)
        self._by_tenant: dict[str | None, int] = {}
        self._workers: list[asyncio.Task[None]] = []
        self.counters = PrefetchCounters()

    def start(self) -> None:
        self._workers = [
            asyncio.create_task(self._work_forever(), name=f"kvcache-prefetch-{i}") for i in range(self.limits.workers)
        ]

    async def close(self) -> None:
        """Stops the workers; queued jobs are dropped (their keys were only a hint)."""
        for task in self._workers:
            task.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers = []
        self._jobs.clear()
        self._waiting = 0
        self._by_tenant.clear()

    @property
    def waiting_keys(self) -> int:
        return self._waiting

    async def submit(
        self, namespace: str, keys: list[bytes], tenant: str | None, answer_by: float | None
    ) -> PrefetchAnswer:
        """Queues the keys a lower tier holds for promotion into RAM; answers at once (after one
        presence check per lower tier, within `answer_by` as a Lookup's)."""
        where = await self._stack.locate(namespace, keys, answer_by=answer_by)
        in_ram = sum(1 for kind in where if kind is TierKind.RAM)
        lower = list(dict.fromkeys(k for k, kind in zip(keys, where, strict=True) if kind not in (None, TierKind.RAM)))
        unknown = sum(1 for kind in where if kind is None)
        room = self.limits.queue_max_keys - self._waiting
        if tenant is not None:  # one tenant waits on at most half the queue
            room = min(room, self.limits.queue_max_keys // 2 - self._by_tenant.get(tenant, 0))
        take = lower[: max(0, room)]
        if take:
            self._jobs.append(_Job(namespace, tenant, take))
            self._waiting += len(take)
            self._by_tenant[tenant] = self._by_tenant.get(tenant, 0) + len(take)
            self._ready.set()
        self.counters.queued += len(take)
        self.counters.dropped += len(lower) - len(take)
        # Per key asked (a key named twice counts twice, and is promoted once).
        taken = set(take)
        queued = sum(1 for k, kind in zip(keys, where, strict=True) if kind not in (None, TierKind.RAM) and k in taken)
        return PrefetchAnswer(
            in_ram=in_ram, queued=queued, unknown=unknown, dropped=len(keys) - in_ram - unknown - queued
        )

    async def _work_forever(self) -> None:
        while True:
            while not self._jobs:
                self._ready.clear()
                await self._ready.wait()
            job = self._jobs.popleft()
            self._waiting -= len(job.keys)
            self._by_tenant[job.tenant] -= len(job.keys)
            if not self._by_tenant[job.tenant]:
                del self._by_tenant[job.tenant]
            try:
                async with asyncio.timeout(self.limits.timeout_s):
                    await self._promote(job)
            except TimeoutError:
                log.info("prefetch of %d keys in %s passed prefetch.timeout_s", len(job.keys), job.namespace)
            except Refused as exc:  # no room in the in-flight budget within its wait
                log.info("prefetch of %d keys in %s: %s", len(job.keys), job.namespace, exc.message)
            except Exception:  # a bug must not stop the worker: the job's keys count as failed below
                log.exception("prefetch of %d keys in %s failed", len(job.keys), job.namespace)
            in_ram = sum(self._stack.ram.contains_many_sync(job.namespace, job.keys))
            self.counters.promoted += in_ram
            self.counters.failed += len(job.keys) - in_ram

    async def _promote(self, job: _Job) -> None:
        """Reads the job's keys window by window through the stack's get (verified, promoted into
        RAM whatever the tiers' `promote` says), each window's bytes counted in the budget first."""
        keys = job.keys
        start = 0
        with self._budget.holding(job.tenant) as held:
            while start < len(keys):
                per_block = self._block_sizes.get(job.namespace)
                count = max(1, self.limits.window_bytes // per_block) if per_block else 1
                window = keys[start : start + count]
                reserved = len(window) * per_block if per_block else 0
                if reserved:
                    await held.reserve(reserved, "Prefetch")
                try:
                    found = await self._stack.get(job.namespace, window, promote=True)
                    self._stack.release(found)
                finally:
                    held.release(reserved)
                sizes = [len(f.data) for f in found if f is not None]
                if sizes:
                    self._block_sizes.saw(job.namespace, max(sizes))
                start += len(window)
