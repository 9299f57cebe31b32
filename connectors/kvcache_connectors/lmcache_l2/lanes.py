"""Lane: one worker thread and its bounded queue (tasks and bytes), so LMCache's threads never wait.

The adapter's submit_* calls only append a task to a lane and return; the lane's thread runs it
(each call to the server bounded by its deadline) and the task publishes its own result. A lane
refuses a task (submit returns False) when its queue holds `max_tasks` tasks or `max_bytes` bytes
of LMCache's buffers; the caller then completes it at once as a failure or a miss.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Task:
    """run() on the lane's thread; drop() instead when the lane closes before running it."""

    run: Callable[[], None]
    drop: Callable[[], None]
    nbytes: int = 0


class Lane:
    """A daemon thread running queued tasks in order. Thread-safe.

    The thread sleeps in a C-level queue's get(): a submit is one put() there (one futex wake), with
    no Python-level Condition on the submitting thread (LMCache's), which is what an early lookup's
    answer waits for (adapter.py, "Early lookups"). The counts below are under one plain lock;
    idle() waiters, rare, are woken through a Condition on that lock."""

    def __init__(self, name: str, *, max_tasks: int, max_bytes: int) -> None:
        self.name = name
        self._max_tasks = max_tasks
        self._max_bytes = max_bytes
        self._inbox: queue.SimpleQueue[Task | None] = queue.SimpleQueue()  # None: stop
        self._queued = 0  # tasks submitted, not yet taken by the thread
        self._queued_bytes = 0
        self._running = False
        self._closed = False
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, task: Task, *, force: bool = False) -> bool:
        """Queues `task`; False (nothing queued) when the lane is closed or, unless `force`, full."""
        with self._lock:
            if self._closed:
                return False
            if not force and self._queued >= self._max_tasks:
                return False
            # One task larger than the whole cap still runs when the lane is empty: refusing it
            # forever would make that chunk size unusable.
            if not force and self._queued and self._queued_bytes + task.nbytes > self._max_bytes:
                return False
            self._queued += 1
            self._queued_bytes += task.nbytes
            self._inbox.put(task)  # under the lock: close() sees every task submitted before it
            return True

    def queued(self) -> tuple[int, int]:
        """(tasks, bytes) queued and not yet running."""
        with self._lock:
            return self._queued, self._queued_bytes

    def idle(self, timeout_s: float) -> bool:
        """Waits until nothing is queued or running; False when `timeout_s` passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._queued and not self._running, timeout_s)

    def close(self, timeout_s: float) -> bool:
        """Drops the queued tasks (each drop() called), waits up to `timeout_s` for the running one;
        False when it is still running."""
        dropped: list[Task] = []
        with self._lock:
            self._closed = True
            while True:  # what the thread has not taken yet: no submit adds to it any longer
                try:
                    task = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if task is not None:
                    dropped.append(task)
            # A task the thread took but has not counted yet stays counted until it does.
            self._queued -= len(dropped)
            self._queued_bytes -= sum(task.nbytes for task in dropped)
            self._inbox.put(None)
            self._idle.notify_all()
        for task in dropped:
            task.drop()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _loop(self) -> None:
        while True:
            task = self._inbox.get()
            with self._lock:
                if task is None:
                    self._idle.notify_all()
                    return
                self._queued -= 1
                self._queued_bytes -= task.nbytes
                self._running = True
            try:
                task.run()
            except Exception:  # a bug in a task: logged, and the lane keeps serving the others
                log.exception("kvcache L2 adapter: a %s task failed", self.name)
            finally:
                with self._lock:
                    self._running = False
                    if not self._queued:
                        self._idle.notify_all()
