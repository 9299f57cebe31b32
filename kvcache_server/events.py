"""KV events: which chunk keys were stored in or removed from which tier, for routers and dashboards.

The stack publishes an event per batch operation (a put of 8 blocks into RAM is
one STORED event with 8 keys). Publishing never blocks and never waits for a
subscriber: each subscriber has its own bounded buffer, and a subscriber whose
buffer is full is cut off: its stream ends with RESOURCE_EXHAUSTED, and it
should reconnect and resynchronise (e.g. with Lookup). The server's speed never
depends on how fast anyone reads events.

What is and is not reported:
    STORED   RAM: puts and promotions; disk/Redis/S3: successful writes (put, write-behind,
             demotion, promotion).
    REMOVED  RAM and disk: evictions and deletes; Redis/S3: deletes (the keys the tier held,
             Tier.delete_present); any lower tier: corrupt copies removed on read.
    The disk tier's events carry tier TIER_DISK. vLLM's events carry a medium instead: its
    offloading tier (kvcache_connectors.vllm_tier) reports kvcache as STORAGE, whichever of
    kvcache's tiers holds a block.
    Not seen: Redis expiring or evicting values itself (TTL, maxmemory) and S3
    lifecycle rules; routers should treat events as hints, never as truth.

Sequence numbers are per subscriber: 1, 2, 3, ... over the events that
subscriber receives, so a gap never stands for events it was not shown (another
tenant's or namespace's writes). Nothing is skipped silently: a subscriber that
would miss an event is cut off instead.

With auth, a tenant may hold only its share of the subscriber slots
(`events.tenant_max_subscribers`, or its own `max_event_subscribers`).
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvcache_server.tiers.base import TierKind


class EventKind(enum.IntEnum):
    """Matches kvcache.v1.KVEvent.Kind on the wire."""

    STORED = 1
    REMOVED = 2


@dataclass(frozen=True, slots=True)
class KVEvent:
    """One published event, shared by every subscriber it matches (each numbers it in its own sequence)."""

    timestamp_s: float
    kind: EventKind
    tier: TierKind
    namespace: str
    keys: tuple[bytes, ...]


class SubscriberOverflow(Exception):
    """The subscriber's buffer filled up; it was dropped."""


class TooManySubscribers(Exception):
    """A new subscription was refused: the server, or the subscriber's tenant, has all it may have."""


@dataclass(eq=False, slots=True)
class Subscription:
    """One subscriber's bounded buffer. Read with `next_batch()` from the subscriber's own task."""

    namespace: str  # "" for all namespaces (under `prefix`)
    max_events: int
    prefix: str = ""  # only namespaces starting with this (a tenant's "tenant:" scope)
    tenant: str | None = None  # counted against this tenant's share
    _buffer: deque[tuple[int, KVEvent]] = field(default_factory=deque)
    _ready: asyncio.Event = field(default_factory=asyncio.Event)
    _sequence: int = 0  # the last sequence number given out
    overflowed: bool = False

    def _offer(self, event: KVEvent) -> None:
        if self.overflowed:
            return
        if len(self._buffer) >= self.max_events:
            self.overflowed = True
            self._buffer.clear()  # nothing more will be read; free it now
        else:
            self._sequence += 1
            self._buffer.append((self._sequence, event))
        self._ready.set()

    async def next_batch(self) -> list[tuple[int, KVEvent]]:
        """Waits for events and returns all buffered ones, each with its sequence number for this subscriber.

        Raises:
            SubscriberOverflow: the buffer overflowed; the subscription is over.
        """
        await self._ready.wait()
        self._ready.clear()
        if self.overflowed:
            raise SubscriberOverflow(f"subscriber fell more than {self.max_events} events behind")
        batch = list(self._buffer)
        self._buffer.clear()
        return batch


class EventHub:
    """Fans events out to subscribers; cheap when there are none."""

    def __init__(
        self,
        max_subscribers: int = 64,
        buffer_events: int = 10_000,
        tenant_max_subscribers: Callable[[str], int] | None = None,
        server_id: str = "",
    ) -> None:
        """
        Args:
            max_subscribers: Subscribers connected at once, all tenants together.
            buffer_events: Events buffered per subscriber before it is cut off.
            tenant_max_subscribers: A tenant's share of the subscribers (None: no per-tenant limit).
            server_id: Names this server in every event it publishes (KVEvent.server_id).
        """
        self.server_id = server_id
        self._subscribers: set[Subscription] = set()
        self._tenants: dict[str, int] = {}  # subscribers per tenant
        self.max_subscribers = max_subscribers
        self.buffer_events = buffer_events
        self._tenant_max = tenant_max_subscribers
        self.dropped_subscribers = 0
        self.refused_subscribers = 0
        self.published = 0

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    def tenant_subscribers(self, tenant: str) -> int:
        return self._tenants.get(tenant, 0)

    def subscribe(self, namespace: str = "", prefix: str = "", tenant: str | None = None) -> Subscription:
        """A new subscription, counted against `tenant`'s share when given.

        Raises:
            TooManySubscribers: max_subscribers are connected, or the tenant has its share.
        """
        if len(self._subscribers) >= self.max_subscribers:
            self.refused_subscribers += 1
            raise TooManySubscribers(f"too many event subscribers (events.max_subscribers={self.max_subscribers})")
        if tenant is not None and self._tenant_max is not None:
            limit = min(self._tenant_max(tenant), self.max_subscribers)
            if self._tenants.get(tenant, 0) >= limit:
                self.refused_subscribers += 1
                raise TooManySubscribers(
                    f"tenant {tenant!r} is at its limit of {limit} event subscribers "
                    "(events.tenant_max_subscribers, or its own max_event_subscribers)"
                )
            self._tenants[tenant] = self._tenants.get(tenant, 0) + 1
        else:
            tenant = None
        sub = Subscription(namespace=namespace, max_events=self.buffer_events, prefix=prefix, tenant=tenant)
        self._subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        if sub in self._subscribers:
            self._subscribers.discard(sub)
            if sub.tenant is not None:
                left = self._tenants[sub.tenant] - 1
                if left:
                    self._tenants[sub.tenant] = left
                else:
                    del self._tenants[sub.tenant]
            if sub.overflowed:
                self.dropped_subscribers += 1

    def publish(self, kind: EventKind, tier: TierKind, namespace: str, keys: Sequence[bytes]) -> None:
        if not self._subscribers or not keys:
            return
        event = KVEvent(time.time(), kind, tier, namespace, tuple(keys))
        self.published += 1
        for sub in self._subscribers:
            if (sub.namespace == namespace) if sub.namespace else namespace.startswith(sub.prefix):
                sub._offer(event)
