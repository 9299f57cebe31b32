"""One byte budget for what calls in flight hold, so no client can make the server allocate first.

What counts against it (limits.inflight_bytes): the bytes of Put messages while the server decodes,
verifies and commits them, blocks sent in parts while they are assembled (as their bytes arrive,
never their announced length ahead of time), blocks copied out of a client's shared-memory segment,
and blocks a Get fetched from Redis or S3 until they are sent. What does not: blocks held by the
RAM tier (ram.capacity_bytes caps those) and blocks a Get serves from RAM (references, no copy).

A call that needs more than is free waits up to limits.admission_wait_s for others to release
theirs, then is refused with RESOURCE_EXHAUSTED; bytes that already exist when they are counted
(a message gRPC has received) are counted at once, so `used` may pass the capacity by at most one
message per call, and new work then waits. Every call releases what it holds when it ends, however
it ends (`Holding` is a context manager).

    peak RSS  <=  ram.capacity_bytes + limits.inflight_bytes + gRPC's own buffers + baseline
"""

from __future__ import annotations

import asyncio
from types import TracebackType

import grpc

from kvcache_server.refusal import Refused


class MemoryBudget:
    """Bytes held by calls in flight, against a capacity. Used only on the server's event loop."""

    def __init__(self, capacity: int, wait_s: float) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self.wait_s = wait_s
        self.used = 0
        self.peak = 0
        self.refused = 0  # reservations refused after waiting
        self._freed = asyncio.Event()

    def _take(self, n: int) -> None:
        self.used += n
        self.peak = max(self.peak, self.used)

    def count(self, n: int) -> None:
        """Counts `n` bytes that exist already (a received message): never waits, never refuses."""
        self._take(n)

    async def reserve(self, n: int, what: str) -> None:
        """Counts `n` bytes before they are allocated; waits for room up to wait_s.

        Raises:
            Refused: RESOURCE_EXHAUSTED, when `n` is more than the whole budget or no room came.
        """
        if n <= self.capacity - self.used:
            self._take(n)
            return
        if n > self.capacity:
            self.refused += 1
            raise Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{what}: {n} bytes exceed the server's whole in-flight budget (limits.inflight_bytes={self.capacity})",
            )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        while n > self.capacity - self.used:
            remaining = deadline - loop.time()
            if remaining <= 0:
                self.refused += 1
                raise Refused(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{what}: the server holds {self.used} of limits.inflight_bytes={self.capacity} bytes for calls "
                    f"in flight and {n} more did not fit within {self.wait_s:g} s; retry later",
                )
            self._freed.clear()
            try:
                await asyncio.wait_for(self._freed.wait(), remaining)
            except TimeoutError:
                continue
        self._take(n)

    def release(self, n: int) -> None:
        if n <= 0:
            return
        self.used -= n
        assert self.used >= 0, "released more than was counted"
        self._freed.set()

    def holding(self) -> Holding:
        """What one call holds; released when the `with` block ends."""
        return Holding(self)


class Holding:
    """The bytes one call counts against the budget; `with` releases whatever is left at the end."""

    def __init__(self, budget: MemoryBudget) -> None:
        self._budget = budget
        self.bytes = 0

    def count(self, n: int) -> None:
        self._budget.count(n)
        self.bytes += n

    async def reserve(self, n: int, what: str) -> None:
        await self._budget.reserve(n, what)
        self.bytes += n

    def release(self, n: int) -> None:
        n = min(n, self.bytes)
        self.bytes -= n
        self._budget.release(n)

    def release_all(self) -> None:
        self.release(self.bytes)

    def __enter__(self) -> Holding:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release_all()
