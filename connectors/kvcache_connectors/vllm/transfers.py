"""Background transfers of a worker: one thread with a bounded job queue, and bounded host staging memory.

The model runner's thread only hands jobs over (`submit`) and collects what they
produced (in WorkerSide.get_finished); every call to the server runs on the job
thread, so a slow or hung server costs the engine nothing but the jobs' deadlines.

    loads   a job per step: Get, check, scatter into the request's blocks; a full queue
            fails the load at once (vLLM recomputes)
    saves   a job per step: the chunks already copied to host staging memory, then Put;
            a full queue (jobs or staging bytes) drops the oldest queued save, counted
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Job:
    """Work for the job thread: `run` there, or `drop` (on the submitting thread) when it never runs."""

    run: Callable[[], None]
    drop: Callable[[], None]


class JobThread:
    """One daemon thread running jobs in submission order from a queue of at most `max_jobs`."""

    def __init__(self, name: str, max_jobs: int) -> None:
        self._name = name
        self._max_jobs = max_jobs
        self._jobs: deque[Job] = deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._running = False  # a job is running now
        self._closed = False

    def submit(self, job: Job) -> bool:
        """Queues a job; False (and the job is not queued) when the queue is full or closed."""
        with self._cv:
            if self._closed or len(self._jobs) >= self._max_jobs:
                return False
            self._jobs.append(job)
            self._start()
            self._cv.notify()
        return True

    def drop_oldest(self) -> Job | None:
        """Takes the oldest queued (not running) job out of the queue; the caller drops it."""
        with self._cv:
            return self._jobs.popleft() if self._jobs else None

    @property
    def full(self) -> bool:
        with self._cv:
            return len(self._jobs) >= self._max_jobs

    def idle(self, timeout_s: float) -> bool:
        """Waits until no job is queued or running, at most timeout_s; whether it is idle."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._jobs and not self._running, timeout_s)

    def close(self) -> None:
        """Drops the queued jobs and lets the thread end after the running one."""
        with self._cv:
            self._closed = True
            dropped = list(self._jobs)
            self._jobs.clear()
            self._cv.notify_all()
        for job in dropped:
            job.drop()

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._running = False
                self._cv.notify_all()
                self._cv.wait_for(lambda: self._jobs or self._closed)
                if not self._jobs:
                    return
                job = self._jobs.popleft()
                self._running = True
            try:
                job.run()
            except Exception:  # a job records its own failures; this is a bug, never the engine's problem
                log.exception("kvcache %s job failed", self._name)


class StagingPool:
    """Host buffers for gathered chunks, reused across steps, at most `max_bytes` handed out at once.

    Buffers are pinned when the KV lives on a CUDA device, so the device-to-host copy
    can run without a bounce buffer.
    """

    def __init__(self, max_bytes: int, *, pin: bool) -> None:
        self._max_bytes = max_bytes
        self._pin = pin
        self._free: list[torch.Tensor] = []
        self._in_use = 0
        self._lock = threading.Lock()

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A uint8 buffer of at least nbytes, or None when that would exceed max_bytes."""
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            best = min(fits, key=lambda i: self._free[i].numel()) if fits else None
            size = nbytes if best is None else self._free[best].numel()
            if self._in_use + size > self._max_bytes:
                return None
            self._in_use += size
            if best is not None:
                return self._free.pop(best)  # by index: == on tensors compares elements
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pin)

    def give_back(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._in_use -= buffer.numel()
            self._free.append(buffer)
            # Keep what fits in the budget; the largest buffers are the most reusable.
            self._free.sort(key=torch.Tensor.numel, reverse=True)
            kept, total = [], self._in_use
            for b in self._free:
                if total + b.numel() <= self._max_bytes:
                    kept.append(b)
                    total += b.numel()
            self._free = kept
