"""glibc malloc: what the server does so that freed block memory goes back to the OS.

Blocks are large (KiB to tens of MiB) and short-lived in churn: a flood of puts into a small RAM tier
evicts as fast as it stores. glibc serves allocations below its mmap threshold from heap arenas,
and the threshold grows by itself up to 32 MiB as large blocks are freed, so after a while every
block lands in an arena whose freed holes are reused piecemeal and seldom returned to the OS.

Two remedies, measured by bench/bench_memory.py (RSS) and bench/bench_throughput.py (speed):

- malloc_trim(0) every server.malloc_trim_interval_s (default 1 s, in a worker thread): returns the
  free pages inside the arenas (not only their tops) to the OS while keeping the heap's reuse. The
  default: it costs no throughput.
- a fixed mmap threshold (server.malloc_mmap_threshold_bytes, default 0 = off): every allocation of
  that size or more is its own mapping, unmapped when freed. RSS follows the RAM cap most closely,
  but every new block is fresh memory that page-faults in: puts over gRPC ran 2-3x slower with
  128 KiB. For memory-tight deployments only (a preallocated block arena is the real cure).
- or, opt-in, a fixed trim threshold (server.malloc_trim_threshold_bytes, e.g. 256 MiB; default 0 =
  off) and the mmap threshold at its ceiling (32 MiB). glibc's own trim threshold follows its
  self-raised mmap threshold (twice it): with gRPC's messages of a few MiB it hands the heap's top
  back to the OS at nearly every free, and the next message's bytes (gRPC's own copies, the reply's
  join) fault in page by page. With the fixed thresholds a Get over pure gRPC (16 x 2 MiB) cost the
  server 18-19 ms of CPU instead of 39-40 and moved 1.21 GB/s instead of 0.81. Not the default:
  with every allocation up to 32 MiB on the heap, freed holes stay resident until the next periodic
  trim, and under tests/test_budget_shares.py's stalled callers peak RSS rose from 357-370 MiB to
  391-436 against the documented bound of 412 (with 64 MiB, or an 8-16 MiB mmap threshold: 394-422).
  For servers whose clients use pure gRPC (no bulk port) and that have memory to spare.

Only glibc has mallopt and malloc_trim; elsewhere this does nothing (and says so once).
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import platform
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvcache_server.config import ServerSection

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20
"""glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX): mallopt refuses more."""


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if platform.libc_ver()[0] != "glibc":
        log.info("not glibc: malloc is left as it is (the server.malloc_* settings apply to glibc only)")
        return None
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def malloc_trim() -> bool:
    """Returns the heap's free pages to the OS (glibc); whether any memory was released."""
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.malloc_trim(0))


async def trim_forever(interval_s: float) -> None:
    """malloc_trim every `interval_s`, in a worker thread (it walks the arenas), until cancelled."""
    if _libc() is None:
        return
    while True:
        await asyncio.sleep(interval_s)
        await asyncio.to_thread(malloc_trim)


def malloc_thresholds(server: ServerSection) -> tuple[int, int]:
    """tune_malloc's arguments for the server's settings: (mmap threshold, trim threshold). Without
    the periodic trim (malloc_trim_interval_s 0) a fixed trim threshold would keep its bytes for good,
    so glibc keeps its own thresholds then."""
    keep = server.malloc_trim_threshold_bytes if server.malloc_trim_interval_s > 0 else 0
    return server.malloc_mmap_threshold_bytes, keep


def tune_malloc(mmap_threshold_bytes: int, trim_threshold_bytes: int = 0) -> bool:
    """Fixes glibc's mmap and trim thresholds: both at `mmap_threshold_bytes` when it is set (every
    allocation of that size or more its own mapping), else the trim threshold at
    `trim_threshold_bytes` and the mmap threshold at glibc's ceiling, 32 MiB (both 0: malloc is left
    alone). Setting either turns glibc's self-adjusting thresholds off.

    Returns whether the settings took effect.
    """
    if mmap_threshold_bytes > 0:
        mmap_at, trim_at = mmap_threshold_bytes, mmap_threshold_bytes
    elif trim_threshold_bytes > 0:
        mmap_at, trim_at = MMAP_THRESHOLD_MAX, trim_threshold_bytes
    else:
        return False
    libc = _libc()
    if libc is None:
        return False
    mallopt = libc.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(_M_MMAP_THRESHOLD, mmap_at)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_at))
    if not ok:
        log.warning("mallopt refused mmap/trim thresholds of %d/%d bytes; malloc left as it is", mmap_at, trim_at)
    return ok
