"""Lane: the LMCache adapter's worker thread and its bounded queue (no LMCache or server needed).

Each test would fail on a lane that ran a task twice or never, dropped one it had taken, counted what
it queued wrongly, or took tasks after close.
"""

from __future__ import annotations

import threading
import time

import pytest

from kvcache_connectors.lmcache_l2.lanes import Lane, Task

pytestmark = pytest.mark.timeout(30)


def _blocked(lane: Lane) -> threading.Event:
    """Holds the lane's thread in a running task until the returned event is set."""
    gate, started = threading.Event(), threading.Event()

    def run() -> None:
        started.set()
        gate.wait(10)

    assert lane.submit(Task(run=run, drop=gate.set))
    assert started.wait(5)
    return gate


def test_close_drops_exactly_what_is_queued_and_runs_nothing_after() -> None:
    lane = Lane("t", max_tasks=10, max_bytes=1000)
    gate = _blocked(lane)
    ran: list[int] = []
    dropped: list[int] = []
    for i in range(3):
        assert lane.submit(Task(run=lambda i=i: ran.append(i), drop=lambda i=i: dropped.append(i), nbytes=100))
    assert lane.queued() == (3, 300)
    assert not lane.close(0.05)  # the running task still runs
    assert dropped == [0, 1, 2] and lane.queued() == (0, 0)
    assert not lane.submit(Task(run=lambda: ran.append(9), drop=lambda: dropped.append(9)))
    gate.set()
    assert lane.close(5)  # the thread ended once its task did
    assert ran == [] and dropped == [0, 1, 2]


def test_a_full_lane_refuses_by_count_and_by_bytes_but_takes_one_large_task_alone() -> None:
    lane = Lane("t", max_tasks=2, max_bytes=100)
    try:
        gate = _blocked(lane)
        noop = Task(run=lambda: None, drop=lambda: None, nbytes=60)
        assert lane.submit(noop) and not lane.submit(noop)  # 120 bytes would pass the cap
        assert lane.submit(Task(run=lambda: None, drop=lambda: None, nbytes=40))
        assert not lane.submit(Task(run=lambda: None, drop=lambda: None))  # two queued already
        assert lane.submit(Task(run=lambda: None, drop=lambda: None), force=True)
        assert lane.queued() == (3, 100)
        gate.set()
        assert lane.idle(5) and lane.queued() == (0, 0)
        assert lane.submit(Task(run=lambda: None, drop=lambda: None, nbytes=1000))  # alone: taken
        assert lane.idle(5)
    finally:
        lane.close(5)


def test_idle_waiters_are_woken_when_the_lane_empties_and_when_it_closes() -> None:
    """idle() returns when the last task ends (or the lane closes), not at its time-out: a lost wake-up
    would still answer True there (wait_for checks again at the end), only 10 s late."""
    lane = Lane("t", max_tasks=10, max_bytes=1000)
    gate = _blocked(lane)
    assert lane.submit(Task(run=lambda: None, drop=lambda: None))
    answers: list[tuple[bool, float]] = []

    def wait_idle() -> None:
        got = lane.idle(10)
        answers.append((got, time.monotonic()))

    waiter = threading.Thread(target=wait_idle)
    waiter.start()
    time.sleep(0.1)
    opened = time.monotonic()
    gate.set()
    waiter.join(15)
    assert answers and answers[0][0] and answers[0][1] - opened < 5

    gate = _blocked(lane)
    assert lane.submit(Task(run=lambda: None, drop=lambda: None))
    answers.clear()
    waiter = threading.Thread(target=wait_idle)
    waiter.start()
    time.sleep(0.1)
    closed = time.monotonic()
    assert not lane.close(0.05)  # drops the queued task; the running one still runs
    gate.set()
    waiter.join(15)
    assert answers and answers[0][0] and answers[0][1] - closed < 5
    assert lane.close(5)


def test_tasks_from_many_threads_each_run_once_in_order_per_thread() -> None:
    lane = Lane("t", max_tasks=100_000, max_bytes=1 << 40)
    ran: list[tuple[int, int]] = []
    try:

        def submitter(t: int) -> None:
            for i in range(500):
                assert lane.submit(Task(run=lambda i=i: ran.append((t, i)), drop=lambda: None, nbytes=1))

        threads = [threading.Thread(target=submitter, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(10)
        assert lane.idle(10)
        assert lane.queued() == (0, 0)
        assert sorted(ran) == [(t, i) for t in range(4) for i in range(500)]
        for t in range(4):
            assert [i for tt, i in ran if tt == t] == list(range(500))
    finally:
        assert lane.close(5)
