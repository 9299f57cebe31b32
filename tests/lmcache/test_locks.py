"""LockTable's accounting: locks per key, holds released on their last reference, the byte bound."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from kvcache_connectors.lmcache_l2.locks import LockTable

pytestmark = pytest.mark.timeout(10)


def blocks(*sizes: int | None) -> list[memoryview | None]:
    return [None if n is None else memoryview(bytes(n)) for n in sizes]


def test_the_last_unlock_of_a_lookup_releases_its_hold() -> None:
    table = LockTable(max_bytes=100)
    stack = contextlib.ExitStack()
    assert table.lock(["a", "b", "c"], stack, blocks(10, None, 20)) == (2, True)
    assert table.usage() == (2, 30)
    assert table.is_locked("a") and not table.is_locked("b")
    assert table.unlock(["a", "b"]) == (1, [])  # b holds no lock
    dropped, done = table.unlock(["c"])
    assert dropped == 1 and [h.stack for h in done] == [stack]
    assert table.usage() == (0, 0)


def test_a_borrow_keeps_the_hold_past_its_unlock() -> None:
    table = LockTable(max_bytes=100)
    table.lock(["a"], contextlib.ExitStack(), blocks(10))
    hold, index = table.borrow("a")
    assert index == 0 and bytes(hold.blocks[index]) == bytes(10)
    assert table.unlock(["a"]) == (1, [])  # the load still copies from it
    assert table.usage() == (0, 10)
    assert table.give_back(hold) is True
    assert table.usage() == (0, 0)
    assert table.borrow("a") is None


def test_the_same_key_locked_twice_needs_two_unlocks() -> None:
    table = LockTable(max_bytes=100)
    first, second = contextlib.ExitStack(), contextlib.ExitStack()
    table.lock(["a"], first, blocks(10))
    table.lock(["a"], second, blocks(10))
    hold, _ = table.borrow("a")
    assert hold.stack is second  # the latest lock's block
    table.give_back(hold)
    assert [h.stack for h in table.unlock(["a"])[1]] == [second]
    assert table.is_locked("a")
    assert [h.stack for h in table.unlock(["a"])[1]] == [first]
    assert not table.is_locked("a")


def test_past_max_bytes_the_locks_hold_nothing() -> None:
    table = LockTable(max_bytes=25)
    assert table.lock(["a"], contextlib.ExitStack(), blocks(20)) == (1, True)
    assert table.lock(["b", "c"], contextlib.ExitStack(), blocks(3, 3)) == (2, False)  # 20 + 6 > 25
    assert table.usage() == (3, 20)
    assert table.borrow("b") is None  # locked, nothing held: the load reads it again
    assert table.lock(["d"], contextlib.ExitStack(), blocks(None)) == (0, False)
    assert len(table.drain()) == 1 and table.usage() == (0, 0)


def test_a_pending_hold_wakes_every_waiter_once_abandoned_and_abandon_is_idempotent() -> None:
    """lock_ahead's hold is pending behind a gate: every load waiting on it (Hold.wait) wakes when it is
    settled or abandoned, however many wait, and a second abandon (the lease lane's finally after a
    settle) is a no-op, never a second release of the gate."""
    table = LockTable(max_bytes=100)
    hold = table.lock_ahead(["a", "b"], [b"ka", b"kb"], time.monotonic() + 5)
    assert hold.pending() and table.waits(["a"])
    woke: list[tuple[bool, float]] = []

    def waiter() -> None:
        got = hold.wait(0.0)
        woke.append((got, time.monotonic()))

    waiters = [threading.Thread(target=waiter) for _ in range(4)]
    for t in waiters:
        t.start()
    time.sleep(0.1)
    assert woke == []  # all four waiting
    abandoned = time.monotonic()
    table.abandon(hold)
    table.abandon(hold)
    for t in waiters:
        t.join(5)
    assert [got for got, _ in woke] == [True] * 4 and not hold.pending() and not table.waits(["a"])
    # Each woke when the gate opened, not at the hold's deadline 5 s on (a waiter that did not pass
    # the gate on would leave the others to time out, then answer from `settled`).
    assert max(at for _, at in woke) - abandoned < 2.0
    assert hold.wait(0.0)  # a later waiter does not wait


def test_a_pending_hold_not_settled_by_its_deadline_is_waited_for_no_longer() -> None:
    table = LockTable(max_bytes=100)
    hold = table.lock_ahead(["a"], [b"ka"], time.monotonic() + 0.05)
    start = time.monotonic()
    assert not hold.wait(0.05)  # deadline plus grace: about 0.1 s, then not there
    assert 0.05 <= time.monotonic() - start < 5
    stack = contextlib.ExitStack()
    assert table.settle(hold, stack, blocks(10))  # the leases came late: the hold keeps them
    assert hold.wait(0.0) and not hold.pending() and table.usage() == (1, 10)
