"""A put's read lanes (kvcache_server.shm.read_ranges_into_slots_in_lanes): the second and later lanes are
woken by the first lane's thread, not the event loop, and every lane is still waited for however the
call ends, with each lane's own descriptors closed. Real threads (procmem.DaemonThreads, the executor
a registered process's reads run in) reading a real tmpfs segment.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from typing import Any

import grpc
import numpy as np
import pytest

from kvcache_core.blockwire import ShmRange
from kvcache_server.procmem import DaemonThreads
from kvcache_server.shm import ShmError, lanes_for, read_ranges_into_slots_in_lanes

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20
BLOCK = 4 * MiB


class Recording(Executor):
    """An executor passing work on to `inner`, noting which thread submitted each piece; the n-th
    submit (1-based) in `refuse` raises RuntimeError as a shut-down executor's does."""

    def __init__(self, inner: Executor, refuse: tuple[int, ...] = ()) -> None:
        self.inner, self.refuse = inner, refuse
        self.submitters: list[str] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        self.submitters.append(threading.current_thread().name)
        if len(self.submitters) in self.refuse:
            raise RuntimeError("cannot schedule new work after shutdown")
        return self.inner.submit(fn, *args)


@pytest.fixture
def segment() -> Iterator[tuple[int, int, bytes]]:
    """A 4-block segment file in tmpfs (or the temp dir): (fd, size, its bytes)."""
    data = np.random.default_rng(7).integers(0, 256, 4 * BLOCK, dtype=np.uint8).tobytes()
    with tempfile.TemporaryFile(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as f:
        f.write(data)
        f.flush()
        yield f.fileno(), len(data), data


def _reads(fd: int, size: int) -> tuple[list, list[bytearray]]:
    slots = [bytearray(BLOCK) for _ in range(4)]
    reads = [(i, fd, size, ShmRange("seg", i * BLOCK, BLOCK), memoryview(slots[i])) for i in range(4)]
    return reads, slots


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _two_cpus() -> None:
    if len(os.sched_getaffinity(0)) < 2:  # lanes_for gives one lane per CPU: nothing to wake
        pytest.skip("one CPU: a put reads in one lane")


def test_the_first_lane_wakes_the_others_and_every_byte_lands(segment) -> None:  # type: ignore[no-untyped-def]
    """The event loop submits the first lane only; the first lane's thread submits the second (the
    code before submitted both from the loop, one after the other). Every block lands exactly."""
    _two_cpus()
    fd, size, data = segment
    pool = DaemonThreads(2, "lanes-test")
    executor = Recording(pool)
    reads, slots = _reads(fd, size)
    assert lanes_for(reads) == 2
    before = _open_fds()
    try:
        asyncio.run(read_ranges_into_slots_in_lanes(reads, None, executor))
    finally:
        pool.shutdown()
    assert [bytes(s) for s in slots] == [data[i * BLOCK : (i + 1) * BLOCK] for i in range(4)]
    assert executor.submitters[0] == "MainThread" and executor.submitters[1].startswith("lanes-test")
    assert len(executor.submitters) == 2 and _open_fds() == before


def test_a_cancelled_call_waits_for_every_lane_and_closes_their_descriptors(segment) -> None:  # type: ignore[no-untyped-def]
    """The first lane is held in its check after its first block lands; the call is cancelled: it
    ends only after both lanes' threads have (no write outlives it), the first lane stops before its
    next block, and every descriptor the lanes duplicated is closed."""
    _two_cpus()
    fd, size, _ = segment
    pool = DaemonThreads(2, "lanes-test")
    reads, _ = _reads(fd, size)
    entered, release, ended = threading.Event(), threading.Event(), []

    def check(where: int, slot: memoryview, fill: Callable[[int, int], None]) -> None:
        fill(0, len(slot))
        if where == 0:
            entered.set()
            release.wait(30)
        ended.append(where)

    async def run() -> None:
        task = asyncio.create_task(read_ranges_into_slots_in_lanes(reads, check, pool))
        while not entered.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.sleep(0.2)
        assert not task.done()  # the first lane's thread still runs: the call may not end
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert 0 in ended and 1 not in ended  # the first lane stopped before its next block

    before = _open_fds()
    try:
        asyncio.run(run())
    finally:
        pool.shutdown()
    assert _open_fds() == before


@pytest.mark.parametrize("refuse", [(1,), (2,), (1, 2)], ids=["first", "second", "both"])
def test_a_lane_that_cannot_start_fails_the_call_and_holds_nothing_up(segment, refuse) -> None:  # type: ignore[no-untyped-def]
    """The executor refuses the first lane's submit (the loop's), the second's (the first lane's
    thread's), or both, as a registration dropped mid-call does: the call fails FAILED_PRECONDITION
    within its bound (a held lane never released would hang it), after every lane that started has
    ended, with every descriptor closed."""
    _two_cpus()
    fd, size, _ = segment
    pool = DaemonThreads(2, "lanes-test")
    executor = Recording(pool, refuse)
    reads, _ = _reads(fd, size)
    before = _open_fds()

    async def run() -> None:
        await asyncio.wait_for(read_ranges_into_slots_in_lanes(reads, None, executor), 20)

    try:
        with pytest.raises(ShmError) as failed:
            asyncio.run(run())
    finally:
        pool.shutdown()
    assert failed.value.code is grpc.StatusCode.FAILED_PRECONDITION
    assert len(executor.submitters) == 2 and _open_fds() == before
