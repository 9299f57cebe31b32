"""LockTable: which keys LMCache holds locked, and the leased blocks those locks keep readable.

A lookup-and-lock leases one namespace's keys at once (KVCacheClient.leased, entered on an
ExitStack that stays open): that is one Hold. Each hit takes a Lock on its key, pointing at its
block in the hold. The hold's leases are released when its last reference goes: a lock dropped
by unlock, or a load's borrow given back.

    key A ─ [Lock ─┐, Lock ─┐]          locks per key, last taken last (LMCache unlocks one per
    key B ─ [Lock ─┤]       │            lookup that found it)
                   ▼        ▼
                 Hold 1   Hold 2        refs = locks + borrows; 0 -> release (the control lane)

`max_locked_bytes` bounds the bytes of all holds: a lookup past it takes locks without a hold
(its hits are hits, and the load reads them again). Thread-safe: the lookup, load and control
lanes and LMCache's threads all use it.

A lookup answered from the server's presence index takes its locks before its leases
(lock_ahead): its hold is pending, without blocks, until the lease lane's leases arrive and
settle() gives it them (or not: past max_bytes, every lock dropped meanwhile, the adapter
closed). A load borrowing a pending hold waits for it (Hold.wait).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass


@dataclass(eq=False, slots=True)
class Hold:
    """The leased blocks of one lookup call in one namespace, held until its last reference goes."""

    stack: contextlib.ExitStack
    blocks: Sequence[memoryview | None]
    nbytes: int
    refs: int = 0
    kv_keys: Sequence[bytes] = ()
    """Each block's kvcache key: a load verifies its copy under it (kvcache_core.landing), whether the
    block is a leased view of the server's arena or a copy this process received."""

    ready: threading.Lock | None = None
    """A pending hold's (LockTable.lock_ahead) gate: held until it is settled or abandoned (a C-level
    lock, made and released in a fraction of an Event's time, on the lookup's answer's path); None:
    its blocks came with it."""
    settled: bool = False
    """A pending hold's leases ended, one way or another (its gate released once, under the table's mutex)."""
    dropped: bool = False
    """The adapter closed (LockTable.drain): leases that arrive after are released at once."""
    deadline: float = 0.0
    """A pending hold's: time.monotonic() by which its leases' call has ended, one way or another."""

    def pending(self) -> bool:
        """Whether its leases are still on their way (lock_ahead, not yet settled or abandoned)."""
        return self.ready is not None and not self.settled

    def wait(self, grace_s: float) -> bool:
        """Whether the hold's blocks are there: a pending hold waits for its leases' call to end (at
        its deadline at the latest, plus `grace_s` for the thread that ends it)."""
        gate = self.ready
        if gate is None or self.settled:
            return True
        if gate.acquire(timeout=max(self.deadline + grace_s - time.monotonic(), 0.0)):
            gate.release()  # the next waiter's turn: a released gate stays open
            return True
        return self.settled

    def expired(self) -> bool:
        """Whether the server may have ended the leases (its slots may hold other blocks by now)."""
        expired: Callable[[], bool] | None = getattr(self.blocks, "expired", None)
        return expired() if expired is not None else False


@dataclass(slots=True)
class _Lock:
    hold: Hold | None  # None: a hit answered without holding its block
    index: int = -1


class LockTable:
    """Locks per key and the holds behind them, within `max_bytes` of held blocks."""

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._locks: dict[Hashable, list[_Lock]] = {}
        self._bytes = 0
        self._mutex = threading.Lock()

    def lock(
        self,
        keys: Sequence[Hashable],
        stack: contextlib.ExitStack,
        blocks: Sequence[memoryview | None],
        kv_keys: Sequence[bytes] = (),
    ) -> tuple[int, bool]:
        """Takes a lock on each key whose block is not None: (locks taken, whether `stack` became
        their hold). It does when the blocks fit in max_bytes; otherwise (or when nothing was
        found) the caller closes `stack` itself, and the locks hold no block."""
        hits = [j for j, block in enumerate(blocks) if block is not None]
        nbytes = sum(len(blocks[j]) for j in hits)
        with self._mutex:
            fits = bool(hits) and self._bytes + nbytes <= self._max_bytes
            hold = Hold(stack, blocks, nbytes, len(hits), kv_keys) if fits else None
            if hold is not None:
                self._bytes += nbytes
            for j in hits:
                self._locks.setdefault(keys[j], []).append(_Lock(hold, j))
        return len(hits), hold is not None

    def lock_ahead(self, keys: Sequence[Hashable], kv_keys: Sequence[bytes], deadline: float) -> Hold:
        """Takes a lock on each key before its block is leased, by a call that ends by `deadline`: the
        hold is pending (no blocks, no bytes) until settle() or abandon(), and a load that borrows
        it waits for that."""
        gate = threading.Lock()
        gate.acquire()
        hold = Hold(contextlib.ExitStack(), [None] * len(keys), 0, len(keys), kv_keys, gate, deadline=deadline)
        with self._mutex:
            for j, key in enumerate(keys):
                self._locks.setdefault(key, []).append(_Lock(hold, j))
        return hold

    def wanted(self, hold: Hold) -> bool:
        """Whether a pending hold is still referenced (a lock not dropped, a load waiting for it)."""
        with self._mutex:
            return hold.refs > 0 and not hold.dropped

    def settle(self, hold: Hold, stack: contextlib.ExitStack, blocks: Sequence[memoryview | None]) -> bool:
        """A pending hold's leases arrived: True when the hold keeps them (`stack` becomes its own, to
        be released with its last reference); False when the caller must close `stack` itself
        (nothing found, every reference gone meanwhile, the adapter closed, or past max_bytes: the
        locks then hold no block and a load reads those keys again). Wakes the loads waiting."""
        nbytes = sum(len(block) for block in blocks if block is not None)
        with self._mutex:
            keep = (
                hold.refs > 0
                and not hold.dropped
                and any(block is not None for block in blocks)
                and self._bytes + nbytes <= self._max_bytes
            )
            if keep:
                hold.stack, hold.blocks, hold.nbytes = stack, blocks, nbytes
                self._bytes += nbytes
        self.abandon(hold)
        return keep

    def abandon(self, hold: Hold) -> None:
        """Ends a pending hold's wait without blocks (its lease failed or was never asked): loads
        read its keys again. Idempotent."""
        if hold.ready is None:
            return
        with self._mutex:
            if hold.settled:
                return
            hold.settled = True
        hold.ready.release()

    def lock_keys(self, keys: Sequence[Hashable]) -> None:
        """Takes a lock on each key, holding no block (the load reads it again)."""
        with self._mutex:
            for key in keys:
                self._locks.setdefault(key, []).append(_Lock(None))

    def unlock(self, keys: Sequence[Hashable]) -> tuple[int, list[Hold]]:
        """Drops one lock per key (a key without one is skipped): (locks dropped, holds to release)."""
        dropped, done = 0, []
        with self._mutex:
            for key in keys:
                locks = self._locks.get(key)
                if not locks:
                    continue
                lock = locks.pop()
                dropped += 1
                if not locks:
                    del self._locks[key]
                if lock.hold is not None and self._unref(lock.hold):
                    done.append(lock.hold)
        return dropped, done

    def borrow(self, key: Hashable) -> tuple[Hold, int] | None:
        """The hold and index of `key`'s latest held block, referenced until give_back; else its
        latest pending hold (whose leases are on their way: Hold.wait); None if neither. A settled
        hold that found no block is skipped: an older lock's block is as good, and still there."""
        with self._mutex:
            lock = self._choice(key)
            if lock is None or lock.hold is None:
                return None
            lock.hold.refs += 1
            return lock.hold, lock.index

    def waits(self, keys: Sequence[Hashable]) -> bool:
        """Whether borrowing any of `keys` now would give a pending hold (a load would wait for it)."""
        with self._mutex:
            for key in keys:
                lock = self._choice(key)
                if lock is not None and lock.hold is not None and lock.hold.pending():
                    return True
        return False

    def _choice(self, key: Hashable) -> _Lock | None:
        """borrow()'s lock for `key` (under the mutex)."""
        pending: _Lock | None = None
        for lock in reversed(self._locks.get(key, ())):
            hold = lock.hold
            if hold is None:
                continue
            if hold.pending():
                pending = pending or lock
            elif hold.blocks[lock.index] is not None:
                return lock
        return pending

    def give_back(self, hold: Hold) -> bool:
        """Ends a borrow; True when that was the hold's last reference (release it)."""
        with self._mutex:
            return self._unref(hold)

    def is_locked(self, key: Hashable) -> bool:
        with self._mutex:
            return key in self._locks

    def drain(self) -> list[Hold]:
        """Forgets every lock (the adapter closes); the holds to release."""
        with self._mutex:
            holds = {id(lk.hold): lk.hold for locks in self._locks.values() for lk in locks if lk.hold is not None}
            for hold in holds.values():
                hold.dropped = True
            self._locks.clear()
            self._bytes = 0
        return list(holds.values())

    def usage(self) -> tuple[int, int]:
        """(keys locked, bytes held)."""
        with self._mutex:
            return len(self._locks), self._bytes

    def _unref(self, hold: Hold) -> bool:
        hold.refs -= 1
        if hold.refs:
            return False
        self._bytes -= hold.nbytes
        return True
