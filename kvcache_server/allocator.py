"""glibc malloc settings the server applies to itself, so freed block memory goes back to the OS.

Blocks are large (KiB to tens of MiB) and short-lived in churn: a flood of puts into a small RAM tier
evicts as fast as it stores. glibc serves allocations below its mmap threshold from heap arenas,
and the threshold grows by itself up to 32 MiB as large blocks are freed, so after a while every
block lands in an arena whose freed holes are reused piecemeal and seldom returned: RSS grew to ~5x
the RAM cap under a 10x flood (bench/bench_memory.py). With a fixed threshold of 128 KiB every block
of that size or more is its own mapping, unmapped when the block is freed; the trim threshold at the
same size returns the tops of arenas promptly. Small objects are unaffected.

Only glibc has mallopt; elsewhere this does nothing (and says so).
"""

from __future__ import annotations

import ctypes
import logging
import platform

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def tune_malloc(mmap_threshold_bytes: int) -> bool:
    """Fixes glibc's mmap and trim thresholds at `mmap_threshold_bytes` (0: leave malloc alone).

    Returns whether the settings took effect.
    """
    if mmap_threshold_bytes <= 0:
        return False
    if platform.libc_ver()[0] != "glibc":
        log.info("not glibc: malloc left as it is (server.malloc_mmap_threshold_bytes applies to glibc only)")
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold_bytes)) and bool(
        mallopt(_M_TRIM_THRESHOLD, mmap_threshold_bytes)
    )
    if not ok:
        log.warning("mallopt refused an mmap threshold of %d bytes; malloc left as it is", mmap_threshold_bytes)
    return ok
