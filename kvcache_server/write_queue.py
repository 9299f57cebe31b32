"""A bounded write-behind queue for one lower tier.

Puts (write-behind mode), demotions of blocks evicted from RAM and promotions
into intermediate tiers are queued here and written by one background task
per tier, in batches. The queue is bounded by bytes; what happens when it is
full is the caller's explicit policy (drop and count, or write synchronously),
never an unbounded buffer.

Deleting a key removes its pending writes, so a write-behind never brings a
deleted block back.
"""

from __future__ import annotations

import asyncio
import enum
from collections import OrderedDict
from dataclasses import dataclass


class WriteKind(enum.IntEnum):
    PUT = 0
    DEMOTION = 1  # evicted from RAM: write only if the tier lacks it
    PROMOTION = 2  # found in a lower tier: copy up into this one


@dataclass(slots=True)
class PendingWrite:
    namespace: str
    key: bytes
    block: bytes  # the verified, uncompressed block
    kind: WriteKind


class WriteQueue:
    """Pending writes in arrival order, at most one per (namespace, key), bounded by bytes."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError("max_bytes must be positive")
        self.max_bytes = max_bytes
        self._items: OrderedDict[tuple[str, bytes], PendingWrite] = OrderedDict()
        self._bytes = 0
        self._in_flight = 0  # batches taken and not yet done()
        self._ready = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self.dropped = 0  # writes refused because the queue was full, or abandoned at shutdown

    def __len__(self) -> int:
        return len(self._items)

    @property
    def bytes(self) -> int:
        return self._bytes

    def offer(self, write: PendingWrite) -> bool:
        """Queues a write; False (nothing queued) when it does not fit."""
        entry = (write.namespace, write.key)
        old = self._items.pop(entry, None)
        if old is not None:
            self._bytes -= len(old.block)
        if self._bytes + len(write.block) > self.max_bytes:
            if old is not None:  # keep the write that was already accepted
                self._items[entry] = old
                self._bytes += len(old.block)
            return False
        self._items[entry] = write
        self._bytes += len(write.block)
        self._ready.set()
        self._idle.clear()
        return True

    def discard(self, namespace: str, keys: list[bytes]) -> None:
        for key in keys:
            old = self._items.pop((namespace, key), None)
            if old is not None:
                self._bytes -= len(old.block)
        self._maybe_idle()

    def take(self, max_items: int, max_bytes: int) -> list[PendingWrite]:
        """Removes and returns up to max_items / about max_bytes of the oldest writes."""
        batch: list[PendingWrite] = []
        size = 0
        while self._items and len(batch) < max_items and (not batch or size < max_bytes):
            _, write = self._items.popitem(last=False)
            self._bytes -= len(write.block)
            size += len(write.block)
            batch.append(write)
        if not self._items:
            self._ready.clear()
        if batch:
            self._in_flight += 1
        return batch

    def done(self) -> None:
        """Called by the worker after a non-empty taken batch is written (or given up)."""
        self._in_flight -= 1
        self._maybe_idle()

    def _maybe_idle(self) -> None:
        if not self._items:
            self._ready.clear()
            if self._in_flight == 0:
                self._idle.set()

    async def wait_ready(self) -> None:
        await self._ready.wait()

    async def wait_idle(self) -> None:
        await self._idle.wait()

    def abandon(self) -> int:
        """Drops everything pending (at shutdown); returns how many writes were dropped."""
        n = len(self._items)
        self._items.clear()
        self._bytes = 0
        self.dropped += n
        self._maybe_idle()
        return n
