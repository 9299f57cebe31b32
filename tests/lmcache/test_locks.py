"""LockTable's accounting: locks per key, holds released on their last reference, the byte bound."""

from __future__ import annotations

import contextlib

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
