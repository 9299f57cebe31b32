"""The memory get_many and get_tensors hand out: one buffer per block, reused once its caller dropped it.

Why a pool: a block copied out of the server's arena (docs/arena.md) or received from the bulk
port (docs/bulk.md) lands in memory this client owns, where it is then verified. Fresh memory
costs a page fault per 4 KiB page at its first write, more than the copy itself: copying 16 blocks
of 2 MiB ran at 2.7 GB/s into fresh pages and 18.5 GB/s into warm ones on the machine of issue 25
(32 MiB blocks: 7.9 against 18.5; numpy asks for huge pages from 4 MiB on). get_into copies into
destinations its caller keeps warm; the pool gives get_many the same, for every caller that drops
one call's blocks before a later call (a loop over prompts, an engine that copies each block into
its own KV cache and lets it go).

When a buffer is free: CPython counts references, and everything through which a caller can reach
a block's bytes holds one on the numpy array that owns them, directly or through the buffer the
array exported: the memoryview get_many returned, any memoryview, slice or numpy array made from
it, a tensor of get_tensors (torch.frombuffer keeps its buffer) and that tensor's views. An array
that only the pool refers to is reachable by no caller, so its bytes may be overwritten by the
next call (kvcache_client.shm.Segment.lent tells a segment still in use the same way). A copy the
caller made (bytes(block), tensor.clone()) is memory of its own.

Bounds: the arrays the pool keeps, lent or free, add up to at most `capacity_bytes`; a block that
would pass it gets memory of its own, which the allocator takes back when the caller drops it.
Blocks under MIN_POOLED_BYTES are not pooled (the allocator keeps small ones warm, and a scan
costs more than their faults). What the pool costs is its free arrays: up to capacity_bytes stay
allocated while no call uses them; `clear()` (the clients' close) lets them go. Thread-safe: the
bulk path receives in worker threads, the asyncio face copies in them.
"""

from __future__ import annotations

import sys
import threading
from collections import deque

import numpy as np

DEFAULT_POOL_BYTES = 256 << 20
"""A client's default cap: twice a 128 MiB get, so a caller may hold one call's blocks while it makes the next."""

MIN_POOLED_BYTES = 1 << 20
"""Blocks smaller than this get fresh memory (the bulk path's own threshold, docs/bulk.md)."""

SCAN = 16
"""Arrays of a size looked at per take: a caller that holds many blocks costs a bounded scan each."""


def _refs(arrays: deque[np.ndarray], i: int) -> int:
    """References to arrays[i]: the deque's and the argument's when nobody else holds it."""
    return sys.getrefcount(arrays[i])


_FREE = _refs(deque([np.empty(1, np.uint8)]), 0)
"""What _refs counts for an array only the pool holds (measured, not assumed: it varies by interpreter)."""


class BufferPool:
    """Per-block buffers of one client, reused once no caller reaches them (see the module's docstring).

    Attributes:
        capacity_bytes: The most bytes the pool keeps; 0 turns pooling off.
        reused: Takes answered with a free array of the pool (warm memory).
        allocated: Takes answered with fresh memory (kept by the pool or not).
    """

    def __init__(self, capacity_bytes: int = DEFAULT_POOL_BYTES, *, min_bytes: int = MIN_POOLED_BYTES) -> None:
        """Raises:
        ValueError: a negative capacity or minimum.
        """
        if capacity_bytes < 0 or min_bytes < 0:
            raise ValueError(f"a buffer pool needs sizes >= 0, got {capacity_bytes} and {min_bytes}")
        self.capacity_bytes = capacity_bytes
        self.min_bytes = min_bytes
        self.reused = 0
        self.allocated = 0
        self._arrays: dict[int, deque[np.ndarray]] = {}  # by size; a reused array goes to the back
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def kept_bytes(self) -> int:
        """Bytes of the arrays the pool keeps, lent or free."""
        with self._lock:
            return self._bytes

    def take(self, nbytes: int) -> np.ndarray:
        """A writable uint8 array of `nbytes`, which nobody else can reach: a free one of the pool,
        or fresh memory (kept by the pool while it has room)."""
        if nbytes < max(self.min_bytes, 1) or nbytes > self.capacity_bytes:
            with self._lock:
                self.allocated += 1
            return np.empty(nbytes, np.uint8)
        with self._lock:
            same = self._arrays.setdefault(nbytes, deque())
            for _ in range(min(SCAN, len(same))):
                if _refs(same, 0) == _FREE:
                    same.rotate(-1)  # the one taken goes to the back, the next free ones stay in front
                    self.reused += 1
                    return same[-1]
                same.rotate(-1)  # lent: looked at again after the others
            self.allocated += 1
            if self._bytes + nbytes > self.capacity_bytes:
                self._drop_free(self._bytes + nbytes - self.capacity_bytes)
            array = np.empty(nbytes, np.uint8)
            if self._bytes + nbytes <= self.capacity_bytes:
                same.append(array)
                self._bytes += nbytes
            return array

    def _drop_free(self, need: int) -> None:
        """Lets free arrays go (other sizes too) until `need` bytes are, or none is left; lock held."""
        for size, arrays in list(self._arrays.items()):
            for _ in range(len(arrays)):
                if need <= 0:
                    return
                if _refs(arrays, 0) == _FREE:
                    arrays.popleft()
                    self._bytes -= size
                    need -= size
                else:
                    arrays.rotate(-1)
            if not arrays:
                del self._arrays[size]

    def clear(self) -> None:
        """Lets every array go; those still lent stay valid for their callers (they hold them)."""
        with self._lock:
            self._arrays.clear()
            self._bytes = 0
