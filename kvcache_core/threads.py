"""Worker threads that a cancelled coroutine still waits for: the data paths' rule on both sides.

A coroutine that hands block bytes to a worker thread (copying into a shared-memory segment,
reading or writing one through a descriptor) must not let its caller clean up (close the
descriptor, reuse or retire the segment) while the thread may still touch them, even when the
coroutine is cancelled (a client's deadline, a cancelled call, server stop).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TypeVar

T = TypeVar("T")


async def _to_end(future: asyncio.Future[T], on_cancel: Callable[[], None] | None = None) -> T:
    """Awaits an executor future; if the awaiting task is cancelled, calls on_cancel, still waits for the
    thread to end (cancelled again: still waits), then lets CancelledError propagate."""
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        if on_cancel is not None:
            on_cancel()
        while not future.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([future])
        if not future.cancelled():
            future.exception()  # retrieved: the caller is cancelled whatever the thread ended with
        raise


async def in_pool(executor: Executor, fn: Callable[..., T], *args: object) -> T:
    """fn(*args) in `executor`, awaited to its end even when the awaiting task is cancelled.

    For blocking I/O that cannot be interrupted (a Redis pipeline, an S3 PUT): a caller that gives up
    (a timeout cancels it) still ends only when the thread has, so whoever tracks the call (the tier
    stack's writes, which Deletes wait for) knows when its effect has really landed.
    """
    return await _to_end(asyncio.get_running_loop().run_in_executor(executor, fn, *args))


async def run_to_end(fn: Callable[[threading.Event], T], executor: Executor | None = None) -> T:
    """fn(stop) in a worker thread (of `executor`, else the loop's default one), awaited to its end
    even when the awaiting task is cancelled.

    On cancellation `stop` is set (fn should stop at its next check between blocks) and the thread
    is still waited for before CancelledError propagates, so the caller's cleanup never runs while
    the thread still works. If the thread never ran (the executor was shut down), fn is not called.
    """
    stop = threading.Event()
    return await _to_end(asyncio.get_running_loop().run_in_executor(executor, fn, stop), stop.set)
