"""The workers behind the router: least-outstanding-requests choice, health checks, ejection.

A worker is in rotation (`healthy`) after a health check it passed (GET /health answering 200 within
health_timeout_s). It leaves rotation after `health_failures` consecutive failed checks, or at once
when a request cannot connect to it (it is down; waiting for the checks would send it more requests
to fail); the next passed check brings it back. Choice is the healthy worker with the fewest
requests in flight from this router, ties broken in turn, never one the request already tried.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import aiohttp

from kvcache_router.metrics import RouterMetrics

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class Worker:
    """One worker's state, as this router sees it.

    Attributes:
        url: Base URL, no trailing slash.
        role: "prefill" or "decode".
        healthy: In rotation.
        outstanding: Requests in flight to it from this router.
        failures: Consecutive failed health checks.
    """

    url: str
    role: str
    healthy: bool = False
    outstanding: int = 0
    failures: int = 0


class WorkerPool:
    """The workers of one role.

    Args:
        role: "prefill" or "decode".
        urls: Their base URLs.
        metrics: Where their state is published.
        health_failures: Consecutive failed checks that eject a worker.
    """

    def __init__(self, role: str, urls: Sequence[str], metrics: RouterMetrics, *, health_failures: int) -> None:
        self.role = role
        self.workers = [Worker(url.rstrip("/"), role) for url in urls]
        self._metrics = metrics
        self._health_failures = health_failures
        self._turn = 0
        for w in self.workers:
            self._publish(w)

    def healthy(self) -> list[Worker]:
        return [w for w in self.workers if w.healthy]

    def pick(self, exclude: Sequence[Worker] = ()) -> Worker | None:
        """The healthy worker with the fewest requests in flight, not in `exclude`; None if there is none."""
        candidates = [w for w in self.workers if w.healthy and w not in exclude]
        if not candidates:
            return None
        least = min(w.outstanding for w in candidates)
        tied = [w for w in candidates if w.outstanding == least]
        self._turn += 1
        return tied[self._turn % len(tied)]

    @contextmanager
    def serving(self, worker: Worker) -> Iterator[Worker]:
        """Counts a request in flight to `worker` for as long as the block runs."""
        worker.outstanding += 1
        self._publish(worker)
        try:
            yield worker
        finally:
            worker.outstanding -= 1
            self._publish(worker)

    def failed(self, worker: Worker, reason: str, *, eject: bool) -> None:
        """A request's call to `worker` failed (`reason` for the metrics); `eject` takes it out of rotation."""
        self._metrics.upstream_failures.labels(self.role, worker.url, reason).inc()
        if eject and worker.healthy:
            log.warning("%s worker %s ejected: %s", self.role, worker.url, reason)
            worker.healthy = False
            worker.failures = self._health_failures
            self._metrics.ejections.labels(self.role, worker.url).inc()
            self._publish(worker)

    async def check(self, session: aiohttp.ClientSession, timeout_s: float) -> None:
        """One health check of every worker, at once; each bounded by `timeout_s`."""
        await asyncio.gather(*(self._check_one(session, w, timeout_s) for w in self.workers))

    async def _check_one(self, session: aiohttp.ClientSession, worker: Worker, timeout_s: float) -> None:
        try:
            async with session.get(f"{worker.url}/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                await resp.read()
                ok = resp.status == 200
                reason = f"health check answered {resp.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            ok, reason = False, f"health check failed: {type(exc).__name__} {exc}"
        if ok:
            if not worker.healthy:
                log.info("%s worker %s is in rotation", self.role, worker.url)
            worker.healthy, worker.failures = True, 0
        else:
            worker.failures += 1
            if worker.healthy and worker.failures >= self._health_failures:
                log.warning("%s worker %s ejected: %s", self.role, worker.url, reason)
                worker.healthy = False
                self._metrics.ejections.labels(self.role, worker.url).inc()
        self._publish(worker)

    def _publish(self, worker: Worker) -> None:
        self._metrics.healthy.labels(self.role, worker.url).set(1 if worker.healthy else 0)
        self._metrics.outstanding.labels(self.role, worker.url).set(worker.outstanding)


def note_stale(exc: aiohttp.ClientConnectionError, worker: Worker, tried: list[Worker], stale: list[Worker]) -> None:
    """Keeps `worker` for one more try when no other is left, if it closed the connection before answering
    for the first time in this request. That is how a kept-alive connection looks when the worker closed
    it just as the request went out (uvicorn, vLLM's server, closes idle ones after 5 s); a second time,
    or a refused or reset connection, is the worker's trouble.
    """
    if isinstance(exc, aiohttp.ServerDisconnectedError) and tried.count(worker) == 1:
        stale.append(worker)


def second_chance(stale: list[Worker]) -> Worker | None:
    """A worker kept by note_stale that is still in rotation, taken once."""
    while stale:
        worker = stale.pop(0)
        if worker.healthy:
            return worker
    return None


def failure_reason(exc: aiohttp.ClientConnectionError) -> str:
    """The metrics' name for a connection failure: refused (down), or closed or reset mid-call (dying)."""
    return "connect" if isinstance(exc, aiohttp.ClientConnectorError) else "disconnect"
