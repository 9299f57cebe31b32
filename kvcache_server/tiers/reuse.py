"""Block buffers a reader fills again once nothing else in the process references them.

Why: a read that lands in a new `bytes` lands in fresh memory. glibc hands a large allocation pages
the kernel must fault in and zero (one fault per 4 KiB page), and gives them back when they are
freed, so every read of a 1 MiB block paid ~220 page faults: DiskTier.get_many moved 2.1 GB/s out
of the page cache while dd moved 6.4 (bench/bench_disk_tier.py, "read warm, no promotion").
Reading into memory already faulted in removes that cost.

How a buffer is known to be free: CPython counts references, and everything that can read a
buffer's bytes holds one (a memoryview, any slice of it, numpy's frombuffer, a socket send or a
gRPC serializer through the buffer protocol, a queue or a dict holding the view). The pool hands
out read-only memoryviews of its bytearrays and refills a bytearray only when the pool's own
references are the only ones left: a caller that forgets its view, or keeps it for ever, never sees
its bytes change; it only keeps that buffer out of reuse (and a new one is allocated, or the read
takes fresh memory when the pool is full). No release call to forget, none to call twice.

Bounds: at most `cap_bytes` of buffers (a stated RSS cost: disk.read_buffers_bytes), only for
blocks of at least `min_bytes` (smaller allocations are served from malloc's arenas without
faults), at most `per_length` buffers of one length scanned per take. Off (cap 0) where reference
counts cannot be trusted to say this: another interpreter than CPython, a free-threaded build, or a
trace function that holds frame locals while the pool is made.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict

DEFAULT_MIN_BYTES = 256 << 10
_FREE_REFS = 3


def _refcounts_reliable() -> bool:
    """CPython with its GIL: reference counts are exact and change only under the GIL."""
    gil = getattr(sys, "_is_gil_enabled", None)
    return sys.implementation.name == "cpython" and (gil is None or gil())


class ReusePool:
    """Bytearrays of exact lengths, refilled once only the pool references them (thread-safe)."""

    def __init__(self, cap_bytes: int, *, min_bytes: int = DEFAULT_MIN_BYTES, per_length: int = 256) -> None:
        self.cap_bytes = max(0, cap_bytes)
        self.min_bytes = min_bytes
        self._per_length = per_length
        self._lock = threading.Lock()
        self._by_length: OrderedDict[int, list[bytearray]] = OrderedDict()  # least recently taken first
        self._bytes = 0
        self.reused = 0  # takes that refilled a buffer (counters, read without the lock)
        self.grown = 0  # buffers added
        self.fresh = 0  # takes of a pooled length answered None (every buffer in use, the cap reached)
        # What "only the pool" reads as (_FREE_REFS): the list's slot, the scan's variable,
        # getrefcount's argument. Checked on a probe: a trace function reading frame locals while the
        # pool is built (a debugger, some profilers) would measure one more, and a buffer held by one
        # view would then pass for free. If the probe reads otherwise, or this is not CPython with a
        # GIL, the pool stays off.
        if not _refcounts_reliable() or self._refs_of_first([bytearray(1)]) != _FREE_REFS:
            self.cap_bytes = 0

    @staticmethod
    def _refs_of_first(bufs: list[bytearray]) -> int:
        for buf in bufs:  # the same shape as take's scan: the list's slot, `buf`, getrefcount's argument
            return sys.getrefcount(buf)
        return 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def take(self, length: int) -> bytearray | None:
        """A bytearray of exactly `length` bytes that no one but the pool references (the caller may
        fill it, then hand out views of it), or None: allocate fresh memory instead."""
        if length < self.min_bytes or length > self.cap_bytes:
            return None  # not pooled at all: not counted
        with self._lock:
            bufs = self._by_length.get(length)
            if bufs is not None:
                self._by_length.move_to_end(length)
                for buf in bufs:
                    if sys.getrefcount(buf) <= _FREE_REFS:
                        self.reused += 1
                        return buf
                if len(bufs) >= self._per_length:
                    self.fresh += 1
                    return None
            if self._bytes + length > self.cap_bytes and not self._shrink(length, keep=length):
                self.fresh += 1
                return None
            buf = bytearray(length)
            self._by_length.setdefault(length, []).append(buf)
            self._bytes += length
            self.grown += 1
            return buf

    def _shrink(self, want: int, *, keep: int) -> bool:
        """Drops free buffers of other lengths, least recently taken first, until `want` more bytes
        fit under the cap (under the lock); whether they do. Buffers in use stay (they are the
        caller's memory now, freed by Python when their last view goes)."""
        for length in list(self._by_length):
            if self._bytes + want <= self.cap_bytes:
                break
            if length == keep:
                continue
            bufs = self._by_length[length]
            kept = []
            for buf in bufs:
                if self._bytes + want > self.cap_bytes and sys.getrefcount(buf) <= _FREE_REFS:
                    self._bytes -= length
                else:
                    kept.append(buf)
            if kept:
                self._by_length[length] = kept
            else:
                del self._by_length[length]
        return self._bytes + want <= self.cap_bytes
