"""The contract every storage tier implements.

Who calls what:
    The tier stack (kvcache_server.stack) is the only caller. It runs on the
    server's asyncio event loop and calls the async methods below; a tier that
    does blocking I/O (S3 through boto3) moves it to threads itself, so the
    loop never blocks. Tiers must be safe when several requests are in flight
    at once (interleaved coroutines, and threads where the tier uses them).

What a tier stores:
    Whole blocks (header + payload, docs/format.md) as opaque bytes, under
    (namespace, 16-byte key). A tier never splits a block and never returns
    part of one. Which bytes it stores is up to it (a lower tier may compress),
    but `get_many` returns exactly the block bytes that `put_many` was given,
    or None: as `bytes`, or as a read-only memoryview of them (the disk tier's
    pooled reads, tiers/reuse.py), so callers use the buffer protocol only
    (len, slices, comparisons, hashing, bytes(), b"".join), never bytes methods.

Misses and failures:
    A missing block is None, never an exception. A tier whose backend fails
    raises TierError; the stack turns that into a miss and counts it.

Writes end when they have landed:
    `put_many` does not end, even when the stack's timeout cancels it, before
    the backend write it started is over (kvcache_core.threads.in_pool waits for
    the thread): the stack then knows when a write that a Delete waited for has
    really landed, and deletes it again if it landed after the Delete returned.

Batched calls are the real methods: one call per request, never one per key.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass


class TierKind(enum.IntEnum):
    """Matches kvcache.v1.Tier on the wire."""

    RAM = 1
    REDIS = 2
    S3 = 3
    DISK = 4


class TierError(Exception):
    """A tier's backend failed (connection refused, timeout, ...). The stack counts it as a miss."""


@dataclass(slots=True)
class TierStats:
    """A snapshot of one tier's counters (monotonic since start, except gauges)."""

    name: str
    kind: TierKind
    used_bytes: int = 0  # gauge
    capacity_bytes: int = 0  # 0: no cap of its own
    blocks: int = 0  # gauge
    hits: int = 0
    misses: int = 0
    puts: int = 0
    evictions: int = 0
    rejected: int = 0
    checksum_failures: int = 0
    errors: int = 0
    healthy: bool = True
    # Filled in by the stack for lower tiers (and promotions for RAM):
    promotions: int = 0
    demotions: int = 0
    write_errors: int = 0
    queue_depth: int = 0  # gauge
    queue_bytes: int = 0  # gauge
    queue_dropped: int = 0
    breaker: str = "closed"  # gauge: closed, open, half_open
    skipped: int = 0  # calls not attempted because the breaker was open
    bytes_written: int = 0  # as stored, after compression
    bytes_read: int = 0
    lookup_late_hits: int = 0  # keys found by Lookup calls that answered after their Lookup stopped waiting
    retained_blocks: int = 0  # gauge, RAM and disk: blocks held under retention (docs/tiers.md, "Sessions that stay")
    retained_bytes: int = 0  # gauge, RAM: their entry costs; disk: their record spans
    # Disk only (RAM's are the server-wide retention_refused / retention_expired):
    retention_refused: int = 0  # blocks stored unretained, their tenant's or the tier's retained share full
    retention_expired: int = 0  # retentions that ran out (the record plain again)
    retention_copied: int = 0  # retained records copied forward out of an evicted region
    retention_dropped: int = 0  # retained records lost with their region (unreadable, invalid, no room)


class Tier(ABC):
    """A store of whole blocks keyed by (namespace, key)."""

    name: str
    kind: TierKind

    @abstractmethod
    async def get_many(self, namespace: str, keys: Sequence[bytes]) -> Sequence[bytes | memoryview | None]:
        """The stored block for each key (bytes, or a read-only memoryview), or None where absent.
        Same order as `keys`."""

    @abstractmethod
    async def put_many(self, namespace: str, items: Sequence[tuple[bytes, bytes]]) -> list[bool]:
        """Stores (key, block) pairs; returns, per item, whether it is now stored.

        An item may be refused (False) when it can never fit; that is not an error.
        Storing a key that exists replaces it (content addressing makes the bytes equal).
        """

    async def put_retained(
        self, namespace: str, items: Sequence[tuple[bytes, bytes]], until: Sequence[float]
    ) -> list[bool]:
        """put_many, each block retained until its deadline in `until` (time.monotonic; 0.0: plain).
        Tiers that can retain (disk) override it; the default, for those that cannot (Redis, S3),
        ignores the deadlines."""
        return await self.put_many(namespace, items)

    @abstractmethod
    async def delete_many(self, namespace: str, keys: Sequence[bytes]) -> int:
        """Removes the keys; returns how many were stored."""

    async def delete_present(self, namespace: str, keys: Sequence[bytes]) -> list[bool]:
        """Removes the keys; returns, per key, whether it was stored (the keys a Delete's REMOVED event names).

        Tiers whose backend answers a delete per key override this (one round trip). The default asks
        contains_many, then delete_many: a key another server writes between the two is removed but
        not reported (this server's own writes of the keys are held off by the stack's DeleteFence).
        """
        present = await self.contains_many(namespace, keys)
        await self.delete_many(namespace, keys)
        return present

    @abstractmethod
    def stats(self) -> TierStats:
        """A snapshot of this tier's counters."""

    async def contains_many(self, namespace: str, keys: Sequence[bytes]) -> list[bool]:
        """Presence of each key. Tiers override this with a cheaper batched check."""
        return [block is not None for block in await self.get_many(namespace, keys)]

    async def contains_prefix(self, namespace: str, keys: Sequence[bytes]) -> list[bool]:
        """Presence of each key, except that keys after the first absent one may be reported absent
        without being checked (for a prefix, nothing after a miss matters). Defaults to contains_many."""
        return await self.contains_many(namespace, keys)

    def known(self, namespace: str, keys: Sequence[bytes]) -> list[bool]:
        """Keys this tier knows it holds without asking its backend (no I/O, on the event loop).

        May err only towards absent, or report a key whose block has since vanished from the
        backend (a Get of it then misses); never a key this server deleted. Default: knows none.
        """
        return [False] * len(keys)

    async def prefix_length(self, namespace: str, keys: Sequence[bytes]) -> int:
        """How many leading keys are present."""
        n = 0
        for present in await self.contains_many(namespace, keys):
            if not present:
                break
            n += 1
        return n

    async def close(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Releases connections and threads. Called once at shutdown."""
