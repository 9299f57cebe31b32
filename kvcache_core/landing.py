"""Verified copies: a block's payload copied into its destination and checked there, in one pass.

A reader that copies a block out of memory it does not own (an arena slot under a lease) must check
what landed, not what it read from: land() copies the payload piece by piece (numpy's copy, which
lets go of the GIL), hashing each piece right after it landed, while it is still in cache, under the
block's key-bound checksum (kvcache_core.format). Several blocks go to a few threads at once: both
the copy and xxh3 run without the GIL, so on this project's 2-core VM two threads moved 4 x 32 MiB
at 8.9 GB/s against 5.2 in one (copy + hash in 256 KiB pieces; 1 MiB pieces since, PIECE_BYTES
below), where a copy through memoryview (GIL held) and a separate verify pass managed 4.2.

Outcomes per block, as the SDK's other landing paths have them: None (verified), or why not: a
header that fails leaves the destination untouched; a checksum that fails leaves the copy in it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

import numpy as np
import xxhash

from kvcache_core.errors import BlockFormatError
from kvcache_core.format import BlockHeader, matched, parse_header, payload_hasher

PIECE_BYTES = 1 << 20
"""Bytes copied, then hashed, at a time: small enough to be hashed from cache (this VM's cores have
2 MiB of L2 each). Each copy and each hash lets go of the GIL and takes it back, so the threads of
one call hand it to each other twice a piece: land() of 16 x 2 MiB in 256 KiB pieces moved 8.2-8.5
GB/s, in 1 MiB pieces 10.7-11.1 (64 x 512 KiB: 6.6 -> 8.2; 4 x 32 MiB: 8.2-9.2 either way)."""

PARALLEL_BYTES = 8 << 20
"""Copies of at least this much in all, of two blocks or more, are shared among THREADS threads."""

THREADS = max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))

T = TypeVar("T")
R = TypeVar("R")

Job = tuple[memoryview, bytes, memoryview]
"""(block, the key it was asked for, the writable byte view its payload goes to)."""

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _threads() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(THREADS, thread_name_prefix="kvcache-landing")
        return _pool


def _forget_pool() -> None:  # a forked child has none of the parent's threads
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def land(jobs: Sequence[Job]) -> list[str | None]:
    """Copies each block's payload into its destination, verified where it landed (see the module
    docstring); None per block that did, else why not. Large batches run on a few threads; the call
    returns when every copy has ended.

    Raises:
        ValueError: a destination is not the size of its block's payload (nothing is copied).
    """
    headers: list[BlockHeader | str] = []  # why not, as text: an exception would keep this frame, and the jobs
    for block, _, target in jobs:
        try:
            header = parse_header(block)
        except BlockFormatError as exc:
            headers.append(str(exc))
            continue
        if len(target) != header.payload_len:
            raise ValueError(f"destination holds {len(target)} bytes, the block's payload is {header.payload_len}")
        headers.append(header)
    out: list[str | None] = [h if isinstance(h, str) else None for h in headers]
    work = [i for i, h in enumerate(headers) if not isinstance(h, str)]
    landed = each(lambda i: _land_one(jobs[i], headers[i]), work, [len(jobs[i][2]) for i in work])
    for i, why in zip(work, landed, strict=True):
        out[i] = why
    return out


def each(fn: Callable[[T], R], items: Sequence[T], sizes: Sequence[int]) -> list[R]:
    """[fn(item) for item in items], shared among THREADS threads (this one included) when they come
    to PARALLEL_BYTES or more (`sizes`: each item's bytes), for work that lets go of the GIL (numpy
    copies, xxh3). Returns when every call has ended; the first exception raised is raised then."""
    if len(items) < 2 or sum(sizes) < PARALLEL_BYTES or THREADS < 2:
        return [fn(item) for item in items]
    shares: list[list[int]] = [[] for _ in range(min(THREADS, len(items)))]
    loads = [0] * len(shares)
    for i in sorted(range(len(items)), key=lambda i: -sizes[i]):  # largest first, each to the least loaded
        k = loads.index(min(loads))
        shares[k].append(i)
        loads[k] += sizes[i]
    out: list[R | None] = [None] * len(items)

    def run(share: list[int]) -> None:
        for i in share:
            out[i] = fn(items[i])

    pool = _threads()
    futures: list[Future[None]] = []
    try:
        for share in shares[1:]:
            futures.append(pool.submit(run, share))
        run(shares[0])
    finally:
        _wait_all(futures)  # every call ended before the caller goes on (it may reuse what they write)
    for f in futures:
        error = f.exception()
        if error is not None:
            raise error
    return out  # type: ignore[return-value]


def _wait_all(futures: Sequence[Future[None]]) -> None:
    """Waits until every future is done, even through an interrupt (KeyboardInterrupt in the main
    thread), which is raised once they are: a caller must not go on while a thread still writes
    into its buffers."""
    interrupted: BaseException | None = None
    while True:
        try:
            wait(futures)
            break
        except BaseException as exc:
            interrupted = interrupted or exc
    if interrupted is not None:
        raise interrupted


def _land_one(job: Job, header: object) -> str | None:
    block, key, target = job
    try:
        hasher = payload_hasher(header, key)  # type: ignore[arg-type]
    except BlockFormatError as exc:  # compressed: not landed here
        return str(exc)
    if not len(target):
        return _matched_or_why(header, key, hasher.intdigest())
    src = np.frombuffer(block, np.uint8, len(target), header.header_len)  # type: ignore[attr-defined]
    return _matched_or_why(header, key, copy_hashed(src, np.frombuffer(target, np.uint8), hasher))


def copy_hashed(src: np.ndarray, dst: np.ndarray, hasher: xxhash.xxh3_64) -> int:
    """src copied into dst (uint8 arrays of one length) PIECE_BYTES at a time, each piece fed to
    `hasher` right after it landed, from dst (what is hashed is what lies there); the digest."""
    for start in range(0, len(dst), PIECE_BYTES):
        end = min(len(dst), start + PIECE_BYTES)
        np.copyto(dst[start:end], src[start:end])
        hasher.update(dst[start:end])
    return hasher.intdigest()  # type: ignore[no-any-return]


def _matched_or_why(header: object, key: bytes, digest: int) -> str | None:
    try:
        matched(header, key, digest)  # type: ignore[arg-type]
    except BlockFormatError as exc:
        return str(exc)
    return None
