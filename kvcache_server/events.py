"""KV events: which chunk keys were stored in or removed from which tier, for routers and dashboards.

The stack publishes an event per batch operation (a put of 8 blocks into RAM is
one STORED event with 8 keys). Publishing never blocks and never waits for a
subscriber: each subscriber has its own bounded buffer, and a subscriber whose
buffer is full is cut off: its stream ends with RESOURCE_EXHAUSTED, and it
should reconnect and resynchronise (e.g. with Lookup). The server's speed never
depends on how fast anyone reads events.

What is and is not reported:
    STORED   RAM: puts and promotions; Redis/S3: successful writes (put, write-behind,
             demotion, promotion).
    REMOVED  RAM: evictions and deletes; Redis/S3: deletes (all keys named by the
             Delete call) and corrupt copies removed on read.
    Not seen: Redis expiring or evicting values itself (TTL, maxmemory) and S3
    lifecycle rules; routers should treat events as hints, never as truth.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvcache_server.tiers.base import TierKind


class EventKind(enum.IntEnum):
    """Matches kvcache.v1.KVEvent.Kind on the wire."""

    STORED = 1
    REMOVED = 2


@dataclass(frozen=True, slots=True)
class KVEvent:
    sequence: int
    timestamp_s: float
    kind: EventKind
    tier: TierKind
    namespace: str
    keys: tuple[bytes, ...]


class SubscriberOverflow(Exception):
    """The subscriber's buffer filled up; it was dropped."""


@dataclass(eq=False, slots=True)
class Subscription:
    """One subscriber's bounded buffer. Read with `next_batch()` from the subscriber's own task."""

    namespace: str  # "" for all namespaces (under `prefix`)
    max_events: int
    prefix: str = ""  # only namespaces starting with this (a tenant's "tenant:" scope)
    _buffer: deque[KVEvent] = field(default_factory=deque)
    _ready: asyncio.Event = field(default_factory=asyncio.Event)
    overflowed: bool = False

    def _offer(self, event: KVEvent) -> None:
        if self.overflowed:
            return
        if len(self._buffer) >= self.max_events:
            self.overflowed = True
            self._buffer.clear()  # nothing more will be read; free it now
        else:
            self._buffer.append(event)
        self._ready.set()

    async def next_batch(self) -> list[KVEvent]:
        """Waits for events and returns all buffered ones.

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

    def __init__(self, max_subscribers: int = 64, buffer_events: int = 10_000) -> None:
        self._subscribers: set[Subscription] = set()
        self._sequence = itertools.count(1)
        self.max_subscribers = max_subscribers
        self.buffer_events = buffer_events
        self.dropped_subscribers = 0
        self.published = 0

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    def subscribe(self, namespace: str = "", prefix: str = "") -> Subscription | None:
        """A new subscription, or None when max_subscribers are already connected."""
        if len(self._subscribers) >= self.max_subscribers:
            return None
        sub = Subscription(namespace=namespace, max_events=self.buffer_events, prefix=prefix)
        self._subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        if sub in self._subscribers:
            self._subscribers.discard(sub)
            if sub.overflowed:
                self.dropped_subscribers += 1

    def publish(self, kind: EventKind, tier: TierKind, namespace: str, keys: Sequence[bytes]) -> None:
        if not self._subscribers or not keys:
            return
        event = KVEvent(next(self._sequence), time.time(), kind, tier, namespace, tuple(keys))
        self.published += 1
        for sub in self._subscribers:
            if (sub.namespace == namespace) if sub.namespace else namespace.startswith(sub.prefix):
                sub._offer(event)
