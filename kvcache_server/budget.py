"""One byte budget for what calls in flight hold, so no client can make the server allocate first
(but a small bulk PUT: at most 512 KiB per connection before it is counted, docs/limits.md).

What counts against it (limits.inflight_bytes): the bytes of Put messages while the server decodes,
verifies and commits them, blocks sent in parts while they are assembled (as their bytes arrive,
never their announced length ahead of time), blocks copied out of a client's shared-memory segment,
and blocks a Get fetched from Redis or S3 until they are sent. What does not: blocks held by the
RAM tier (ram.capacity_bytes caps those) and blocks a Get serves from RAM (references, no copy).

A call that needs more than is free waits up to limits.admission_wait_s for others to release
theirs, then is refused with RESOURCE_EXHAUSTED; bytes that already exist when they are counted
(a message gRPC has received) are counted at once, so `used` may pass the capacity by at most one
message per call, and new work then waits. Every call releases what it holds when it ends, however
it ends (`Holding` is a context manager). One call reserves at most limits.inflight_call_share of
the budget, one tenant's calls (with auth) at most limits.inflight_tenant_share of it.

    peak RSS  <=  ram.capacity_bytes + limits.inflight_bytes + gRPC's own buffers + baseline
"""

from __future__ import annotations

import asyncio
from types import TracebackType

import grpc

from kvcache_server.refusal import Refused


class MemoryBudget:
    """Bytes held by calls in flight, against a capacity. Used only on the server's event loop.

    Shares: a call sizes what it reads ahead to `call_share` (a Get's window) and may reserve at most
    `call_cap` at once (its share, or one largest block and message if that is more),
    and, with auth, one tenant's calls together at most `tenant_cap`: callers that stall (a client
    that stops reading, a stream that stops sending) cannot take what the others need. A tenant
    over its share waits like a call over the capacity, then is refused; bytes counted on arrival
    (a received message, a block read for a Get) are counted whatever the shares say.
    """

    def __init__(
        self, capacity: int, wait_s: float, *, call_share: int = 0, call_cap: int = 0, tenant_cap: int = 0
    ) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self.wait_s = wait_s
        self.call_cap = min(call_cap or capacity, capacity)
        self.call_share = min(call_share or self.call_cap, self.call_cap)
        self.tenant_cap = min(tenant_cap or capacity, capacity)
        self.used = 0
        self.peak = 0
        self.refused = 0  # reservations refused after waiting
        self.by_tenant: dict[str, int] = {}  # bytes held per tenant (with auth), only those holding some
        self._freed = asyncio.Event()

    def _take(self, n: int, tenant: str | None) -> None:
        self.used += n
        self.peak = max(self.peak, self.used)
        if tenant is not None:
            self.by_tenant[tenant] = self.by_tenant.get(tenant, 0) + n

    def count(self, n: int, tenant: str | None = None) -> None:
        """Counts `n` bytes that exist already (a received message): never waits, never refuses."""
        self._take(n, tenant)

    def _fits(self, n: int, tenant: str | None) -> bool:
        if n > self.capacity - self.used:
            return False
        return tenant is None or self.by_tenant.get(tenant, 0) + n <= self.tenant_cap

    async def reserve(self, n: int, what: str, tenant: str | None = None) -> None:
        """Counts `n` bytes before they are allocated; waits for room up to wait_s.

        Raises:
            Refused: RESOURCE_EXHAUSTED, when `n` is more than the whole budget (or the tenant's
                share) or no room came.
        """
        if self._fits(n, tenant):
            self._take(n, tenant)
            return
        limit = self.capacity if tenant is None else self.tenant_cap
        if n > limit:
            self.refused += 1
            raise Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{what}: {n} bytes exceed the server's in-flight budget for one tenant "
                f"(limits.inflight_bytes={self.capacity}, limits.inflight_tenant_share: {limit} bytes)",
            )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        while not self._fits(n, tenant):
            remaining = deadline - loop.time()
            if remaining <= 0:
                self.refused += 1
                mine = "" if tenant is None else f"; this tenant holds {self.by_tenant.get(tenant, 0)} of its {limit}"
                raise Refused(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{what}: the server holds {self.used} of limits.inflight_bytes={self.capacity} bytes for calls "
                    f"in flight{mine}, and {n} more did not fit within {self.wait_s:g} s; retry later",
                )
            self._freed.clear()
            try:
                await asyncio.wait_for(self._freed.wait(), remaining)
            except TimeoutError:
                continue
        self._take(n, tenant)

    def release(self, n: int, tenant: str | None = None) -> None:
        if n <= 0:
            return
        self.used -= n
        assert self.used >= 0, "released more than was counted"
        if tenant is not None:
            left = self.by_tenant[tenant] - n
            assert left >= 0, "a tenant released more than it counted"
            if left:
                self.by_tenant[tenant] = left
            else:
                del self.by_tenant[tenant]
        self._freed.set()

    def holding(self, tenant: str | None = None, *, capped: bool = False) -> Holding:
        """What one call holds (of `tenant`'s share, with auth; `capped`: at most call_cap of its own
        reservations); released when the `with` block ends."""
        return Holding(self, tenant, capped=capped)


class Holding:
    """The bytes one call counts against the budget; `with` releases whatever is left at the end."""

    def __init__(self, budget: MemoryBudget, tenant: str | None = None, *, capped: bool = False) -> None:
        self._budget = budget
        self.tenant = tenant
        self.cap = budget.call_cap if capped else budget.capacity
        """The most one reservation of this call may be: its share, or one largest block and message."""
        self.share = budget.call_share if capped else budget.capacity
        """What this call sizes its windows to (limits.inflight_call_share of the budget)."""
        self.bytes = 0

    def count(self, n: int) -> None:
        self._budget.count(n, self.tenant)
        self.bytes += n

    async def reserve(self, n: int, what: str) -> None:
        if n > self.cap:
            self._budget.refused += 1
            raise Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{what}: {n} bytes are more than one call's share of the in-flight budget "
                f"({self.cap} bytes, limits.inflight_call_share)",
            )
        await self._budget.reserve(n, what, self.tenant)
        self.bytes += n

    def would_fit(self, n: int) -> bool:
        """Whether reserve(n) would take `n` now, without waiting: a read of the budget's counts from
        any thread (a hint there, never a reservation). A bulk session commits a put in its own thread
        only where it would (TierStack.commits_off_loop; its bytes are arena slots or its own staging
        memory, not counted): under pressure its puts go to the loop and wait their turn as others."""
        return n <= self.cap and self._budget._fits(n, self.tenant)

    def release(self, n: int) -> None:
        n = min(n, self.bytes)
        self.bytes -= n
        self._budget.release(n, self.tenant)

    def release_all(self) -> None:
        self.release(self.bytes)

    def __enter__(self) -> Holding:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release_all()
