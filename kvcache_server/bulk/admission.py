"""Who may hold the bulk port's connections (one thread each): in all, per tenant, before HELLO.

A connection takes an unauthenticated place when it is accepted and holds it until its HELLO has
passed (bulk.hello_timeout_s bounds how long that takes). Those places have their own small cap
(bulk.max_unauthenticated_connections), so peers that connect and never authenticate (a slowloris
sending its HELLO a byte at a time) cannot take the places of clients that did; and when they are
all taken, a new connection evicts the oldest of them rather than being refused: a client whose
HELLO takes one round trip gets in unless that many connections arrive within that round trip,
where a fixed cap would let a handful of slow sockets lock every new client out.

Once authenticated, a connection moves to a place under bulk.max_connections and, with auth,
under its tenant's share (bulk.tenant_max_connections, a quarter of max_connections by default),
as gRPC calls are shared (kvcache_server.admission): one tenant cannot hold every bulk connection.

A refusal is a message naming the limit (RESOURCE_EXHAUSTED on the wire; the SDK then takes
gRPC). Called from the accept thread and the session threads, hence the lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

CONNECTIONS_LIMIT = "bulk.max_connections"
UNAUTHENTICATED_LIMIT = "bulk.max_unauthenticated_connections"
TENANT_LIMIT = "bulk.tenant_max_connections"

K = TypeVar("K", bound=Hashable)


class ConnectionAdmission(Generic[K]):
    """The bulk connections, unauthenticated (oldest first) and authenticated (per tenant).

    Attributes:
        refused: connections refused, by the limit they hit.
        evicted: unauthenticated connections evicted to make room for a newer one.
    """

    def __init__(
        self, max_connections: int, max_unauthenticated: int, tenant_share: int | None, evict: Callable[[K], None]
    ) -> None:
        """
        Args:
            max_connections: authenticated connections at once.
            max_unauthenticated: connections before their HELLO passed, at once.
            tenant_share: one tenant's authenticated connections (None: no tenants, auth off).
            evict: ends an unauthenticated connection, by its key (called without the lock held).
        """
        self.max_connections = max_connections
        self.max_unauthenticated = max_unauthenticated
        self.tenant_share = None if tenant_share is None else min(tenant_share, max_connections)
        self._evict = evict
        self._unauthenticated: OrderedDict[K, None] = OrderedDict()
        self.authenticated = 0
        self._tenants: dict[str, int] = {}
        self.refused = {CONNECTIONS_LIMIT: 0, TENANT_LIMIT: 0}
        self.evicted = 0
        self._lock = threading.Lock()

    @property
    def unauthenticated(self) -> int:
        """Connections holding an unauthenticated place now."""
        with self._lock:
            return len(self._unauthenticated)

    def tenants(self) -> dict[str, int]:
        """Authenticated connections per tenant (tenants with none are absent)."""
        with self._lock:
            return dict(self._tenants)

    def open(self, key: K) -> str | None:
        """Gives the connection just accepted an unauthenticated place; why not, or None when taken.

        When those places are all taken, the oldest holder is evicted to make room. A server whose
        authenticated places are all taken refuses at once: no HELLO could get one.
        """
        oldest: K | None = None
        with self._lock:
            if self.authenticated >= self.max_connections:
                self.refused[CONNECTIONS_LIMIT] += 1
                return f"the server serves {CONNECTIONS_LIMIT}={self.max_connections} connections, all taken"
            if len(self._unauthenticated) >= self.max_unauthenticated:
                oldest, _ = self._unauthenticated.popitem(last=False)
                self.evicted += 1
            self._unauthenticated[key] = None
        if oldest is not None:
            self._evict(oldest)
        return None

    def authenticate(self, key: K, tenant: str | None) -> str | None:
        """Moves a connection whose HELLO passed from its unauthenticated place to one of `tenant`'s
        (None with auth off); why not, or None. A refused connection keeps its unauthenticated
        place until it closes."""
        with self._lock:
            if key not in self._unauthenticated:
                return (
                    f"evicted before its HELLO was done: {UNAUTHENTICATED_LIMIT}={self.max_unauthenticated} "
                    "newer connections arrived"
                )
            if self.authenticated >= self.max_connections:
                self.refused[CONNECTIONS_LIMIT] += 1
                return f"the server serves {CONNECTIONS_LIMIT}={self.max_connections} connections, all taken"
            if tenant is not None and self.tenant_share is not None:
                held = self._tenants.get(tenant, 0)
                if held >= self.tenant_share:
                    self.refused[TENANT_LIMIT] += 1
                    return (
                        f"tenant {tenant!r} holds its share of {self.tenant_share} bulk connections "
                        f"({TENANT_LIMIT}); retry when one closes"
                    )
                self._tenants[tenant] = held + 1
            del self._unauthenticated[key]
            self.authenticated += 1
            return None

    def close(self, key: K, tenant: str | None, authenticated: bool) -> None:
        """Gives back the place of a connection that ended (`authenticated`: `authenticate` took one)."""
        with self._lock:
            if not authenticated:
                self._unauthenticated.pop(key, None)  # absent when it was evicted
                return
            self.authenticated -= 1
            if tenant is not None and self.tenant_share is not None:
                left = self._tenants[tenant] - 1
                if left:
                    self._tenants[tenant] = left
                else:
                    del self._tenants[tenant]
