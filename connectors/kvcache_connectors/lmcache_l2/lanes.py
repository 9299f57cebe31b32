"""Lane: one worker thread and its bounded queue (tasks and bytes), so LMCache's threads never wait.

The adapter's submit_* calls only append a task to a lane and return; the lane's thread runs it
(each call to the server bounded by its deadline) and the task publishes its own result. A lane
refuses a task (submit returns False) when its queue holds `max_tasks` tasks or `max_bytes` bytes
of LMCache's buffers; the caller then completes it at once as a failure or a miss.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
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
    """A daemon thread running queued tasks in order. Thread-safe."""

    def __init__(self, name: str, *, max_tasks: int, max_bytes: int) -> None:
        self.name = name
        self._max_tasks = max_tasks
        self._max_bytes = max_bytes
        self._queue: deque[Task] = deque()
        self._queued_bytes = 0
        self._running = False
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, task: Task, *, force: bool = False) -> bool:
        """Queues `task`; False (nothing queued) when the lane is closed or, unless `force`, full."""
        with self._cond:
            if self._closed:
                return False
            if not force and len(self._queue) >= self._max_tasks:
                return False
            # One task larger than the whole cap still runs when the lane is empty: refusing it
            # forever would make that chunk size unusable.
            if not force and self._queue and self._queued_bytes + task.nbytes > self._max_bytes:
                return False
            self._queue.append(task)
            self._queued_bytes += task.nbytes
            self._cond.notify()
            return True

    def queued(self) -> tuple[int, int]:
        """(tasks, bytes) queued and not yet running."""
        with self._cond:
            return len(self._queue), self._queued_bytes

    def idle(self, timeout_s: float) -> bool:
        """Waits until nothing is queued or running; False when `timeout_s` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._running, timeout_s)

    def close(self, timeout_s: float) -> bool:
        """Drops the queued tasks (each drop() called), waits up to `timeout_s` for the running one;
        False when it is still running."""
        with self._cond:
            self._closed = True
            dropped = list(self._queue)
            self._queue.clear()
            self._queued_bytes = 0
            self._cond.notify_all()
        for task in dropped:
            task.drop()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._running = False
                self._cond.notify_all()
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                task = self._queue.popleft()
                self._queued_bytes -= task.nbytes
                self._running = True
            try:
                task.run()
            except Exception:  # a bug in a task: logged, and the lane keeps serving the others
                log.exception("kvcache L2 adapter: a %s task failed", self.name)
