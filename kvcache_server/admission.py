"""Admission: how many KVCache calls may run at once, in all and per tenant.

gRPC's own `maximum_concurrent_rpcs` refuses any call above it, health checks
included, and knows nothing of tenants: one tenant holding idle streams took
every slot. The interceptor admits calls here instead:

- a global cap (`server.max_concurrent_rpcs`) on KVCache calls;
- with auth, a cap per tenant (`server.tenant_max_concurrent_rpcs`, or the
  tenant's own `max_concurrent_rpcs` in the tokens file), so that no tenant can
  take the whole server;
- health, reflection and `Info` are never counted nor refused.

A refused call gets RESOURCE_EXHAUSTED naming the limit. A slot is held from
admission until the call ends, however it ends. Everything runs on the
server's event loop; the metrics thread only reads the counters.
"""

from __future__ import annotations

from collections.abc import Callable

GLOBAL_LIMIT = "server.max_concurrent_rpcs"
TENANT_LIMIT = "server.tenant_max_concurrent_rpcs"


class Admission:
    """Counts running calls, in all and per tenant, and refuses calls over either cap."""

    def __init__(self, max_calls: int, tenant_max_calls: Callable[[str], int] | None = None) -> None:
        """
        Args:
            max_calls: The global cap.
            tenant_max_calls: A tenant's cap (None: no tenants, the global cap applies alone).
        """
        self.max_calls = max_calls
        self._tenant_max = tenant_max_calls
        self.active = 0
        self._tenants: dict[str, int] = {}
        self.refused = {GLOBAL_LIMIT: 0, TENANT_LIMIT: 0}

    def tenant_active(self, tenant: str) -> int:
        return self._tenants.get(tenant, 0)

    @property
    def tenants(self) -> dict[str, int]:
        """Running calls per tenant (tenants with none are absent)."""
        return dict(self._tenants)

    def acquire(self, tenant: str | None) -> str | None:
        """Takes a slot for a call of `tenant` (None with auth off); returns why not, or None when taken."""
        if self.active >= self.max_calls:
            self.refused[GLOBAL_LIMIT] += 1
            return f"server at its limit of {self.max_calls} concurrent calls ({GLOBAL_LIMIT}); retry later"
        if tenant is not None and self._tenant_max is not None:
            limit = min(self._tenant_max(tenant), self.max_calls)
            running = self._tenants.get(tenant, 0)
            if running >= limit:
                self.refused[TENANT_LIMIT] += 1
                return (
                    f"tenant {tenant!r} is at its limit of {limit} concurrent calls "
                    f"({TENANT_LIMIT}, or its own max_concurrent_rpcs); retry when one ends"
                )
            self._tenants[tenant] = running + 1
        self.active += 1
        return None

    def release(self, tenant: str | None) -> None:
        """Gives back the slot `acquire` took for a call of `tenant`."""
        self.active -= 1
        if tenant is not None and self._tenant_max is not None:
            left = self._tenants[tenant] - 1
            if left:
                self._tenants[tenant] = left
            else:
                del self._tenants[tenant]
