"""A bounded write-behind queue for one lower tier, and the fence that keeps deletes deleted.

Puts (write-behind mode), demotions of blocks evicted from RAM and promotions
into intermediate tiers are queued here and written by one background task
per tier, in batches. The queue is bounded by bytes; what happens when it is
full is the caller's explicit policy (drop and count, or write synchronously),
never an unbounded buffer.

Deleting a key removes its pending writes. Writes already past the queue (a
batch the writer has taken, a write-through put, a promotion whose read began
before the Delete) are stopped by the DeleteFence instead: each checks it
right before it lands.
"""

from __future__ import annotations

import asyncio
import enum
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
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
    # Retained until (time.monotonic; 0.0: plain): a put's retain_ttl_s, or what was left of a RAM
    # block's retention when it was demoted. Tiers that cannot retain (Redis, S3) ignore it.
    retain_until: float = 0.0


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
            write.retain_until = max(write.retain_until, old.retain_until)  # the same bytes: keep the longer
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


Entry = tuple[str, bytes]
"""(namespace, key)"""


class DeleteFence:
    """Keeps a Delete from being undone by writes and promotions that began before it returned.

    Every operation that may write blocks (a put, a get that may promote, a write-behind batch)
    takes a start epoch with begin() and hands it back with end(). Right before any of its
    writes lands (in RAM, in a queue, or as a call to a lower tier), it asks blocked(): True
    while a Delete of the key is running, and afterwards when that Delete returned after the
    operation began. Checks and landings in RAM and in queues are synchronous on the event
    loop, so nothing runs between them; a lower tier's write is awaited, so the stack makes a
    Delete wait for lower-tier writes that passed the check before it began.

    Memory: a Delete leaves one tombstone per key (about 200 bytes) only if an operation that
    began before it is still open, and the tombstone goes when the last such operation ends.
    Every operation is bounded by its tiers' timeouts, so at most the keys deleted within that
    long are held. Running deletes hold one entry per key until they return.
    """

    def __init__(self) -> None:
        self._epoch = 0  # advances when a Delete returns
        self._open: Counter[int] = Counter()  # start epochs of the operations in flight
        self._running: Counter[Entry] = Counter()  # keys of the Deletes in progress
        self._tombstones: dict[Entry, int] = {}  # key -> epoch its latest Delete returned at
        self._expiry: deque[tuple[int, Entry]] = deque()  # tombstones, oldest first

    def begin(self) -> int:
        """Opens an operation; returns its start epoch for blocked() and end()."""
        self._open[self._epoch] += 1
        return self._epoch

    def end(self, start: int) -> None:
        """Closes an operation opened at `start`; frees the tombstones no open operation needs."""
        left = self._open[start] - 1
        if left:
            self._open[start] = left
        else:
            del self._open[start]
        if self._expiry:
            oldest = min(self._open, default=self._epoch)
            while self._expiry and self._expiry[0][0] <= oldest:
                epoch, entry = self._expiry.popleft()
                if self._tombstones.get(entry) == epoch:
                    del self._tombstones[entry]

    def deleting(self, namespace: str, keys: Sequence[bytes]) -> None:
        """A Delete of these keys begins: from now on nothing lands them, until deleted()."""
        for key in keys:
            self._running[(namespace, key)] += 1

    def deleted(self, namespace: str, keys: Sequence[bytes]) -> None:
        """The Delete that called deleting() with these keys returns."""
        self._epoch += 1
        for key in keys:
            entry = (namespace, key)
            left = self._running[entry] - 1
            if left:
                self._running[entry] = left
            else:
                del self._running[entry]
            if self._open:  # every open operation began before this epoch
                self._tombstones[entry] = self._epoch
                self._expiry.append((self._epoch, entry))

    def blocked(self, start: int, namespace: str, key: bytes) -> bool:
        """Whether an operation begun at `start` must not land this key (a Delete ran since)."""
        if not self._running and not self._tombstones:
            return False  # the common case: no Delete running or remembered
        entry = (namespace, key)
        return entry in self._running or self._tombstones.get(entry, -1) > start

    def running(self, namespace: str, key: bytes) -> bool:
        """Whether a Delete of this key is in progress."""
        return (namespace, key) in self._running

    @property
    def tombstones(self) -> int:
        """Tombstones held (a gauge; 0 whenever no operation older than the last Delete is open)."""
        return len(self._tombstones)
