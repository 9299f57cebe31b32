"""Where the bulk path's received blocks land: reserve(nbytes) -> a writable slot, then commit or abandon.

The session asks the sink for one slot per announced block before receiving it, receives the
block's bytes with recv_into straight into `slot.view`, verifies it in place, and only then
commits the request's slots under their keys (a put is visible all at once or not at all). A slot
of a request that fails (a lying frame, a checksum mismatch, a peer gone mid-frame) is abandoned.
A small PUT (session._STAGED_PUT_BYTES) is received and verified in the session's own memory first;
its slots are reserved, written (a copy on the event loop) and committed in one coroutine there.

ArenaSink (the server's) receives straight into slots of the RAM tier's block arena
(kvcache_server.arena, docs/arena.md): a slot is reserved before its block's first byte arrives,
and committing indexes it under its key without a copy. Where RAM has no room for a reservation
now (every slot leased or reserved), that block falls back to a fresh buffer, which the stack's put
then stores as any other put. BufferSink is that fallback alone (tests, and a stack without an arena).

Reservations are made on the event loop (reserving may evict, and eviction feeds demotions), except
on a stack of RAM alone with no event subscriber (TierStack.commits_off_loop), where a PUT of at most
session._RESERVE_AT_ONCE_BYTES is reserved and committed by the session's thread itself
(reserve_in_thread, commit_in_thread: no trip to the loop and back). The
session thread (or, for a small PUT, the loop's copy) only writes into the slot's memory, which
nothing else touches until it is committed or abandoned: every path out of a PUT abandons what it
did not commit, after the session thread has stopped writing. The reservations never expire
(RamTier.reserve): one reclaimed while that thread still wrote would let its late bytes land in a
slot reused for another key.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from kvcache_server.arena import Reservation
from kvcache_server.stack import PutOutcome, TierPut, TierStack


class Slot(Protocol):
    """A reserved, writable place for one block."""

    @property
    def view(self) -> memoryview:
        """Exactly the reserved bytes, writable."""
        ...


class BlockSink(Protocol):
    """Reserves slots for blocks being received and commits verified ones under their keys.

    reserve and commit run on the server's event loop; abandon is called from session threads.
    """

    async def reserve(self, namespace: str, nbytes: int) -> Slot: ...

    async def reserve_many(self, namespace: str, sizes: Sequence[int]) -> list[Slot]: ...

    def abandon(self, slot: Slot) -> None: ...

    async def commit(self, namespace: str, blocks: Sequence[tuple[bytes, Slot]]) -> PutOutcome: ...

    def reserve_in_thread(self, namespace: str, sizes: Sequence[int]) -> list[Slot] | None:
        """reserve_many from the session's thread, with no trip to the event loop; None where the loop
        must do it (then nothing is held)."""
        ...

    def commit_in_thread(self, namespace: str, blocks: Sequence[tuple[bytes, Slot]]) -> PutOutcome | None:
        """commit of reserve_in_thread's slots, from the session's thread; frees what it does not keep.
        None, with the slots untouched, where the loop must commit them (commit())."""
        ...


class _Buffer:
    __slots__ = ("view",)

    def __init__(self, nbytes: int) -> None:
        # Uninitialised: recv_into writes every byte once (a bytearray would be zeroed first, twice the cost).
        self.view = memoryview(np.empty(nbytes, np.uint8))


class BufferSink:
    """Slots are fresh uninitialised buffers; commit hands read-only views of them to the stack's put."""

    def __init__(self, stack: TierStack) -> None:
        self._stack = stack
        self._lock = threading.Lock()
        self.reserved = 0  # slots handed out, and how they ended (for tests and metrics)
        self.committed = 0
        self.abandoned = 0

    async def reserve(self, namespace: str, nbytes: int) -> Slot:
        with self._lock:
            self.reserved += 1
        return _Buffer(nbytes)

    async def reserve_many(self, namespace: str, sizes: Sequence[int]) -> list[Slot]:
        """A slot per size, in one call (a small PUT's blocks: one trip to the event loop for all)."""
        with self._lock:
            self.reserved += len(sizes)
        return [_Buffer(n) for n in sizes]

    def reserve_in_thread(self, namespace: str, sizes: Sequence[int]) -> list[Slot] | None:
        return None  # the stack's put runs on the loop

    def commit_in_thread(self, namespace: str, blocks: Sequence[tuple[bytes, Slot]]) -> PutOutcome | None:
        raise AssertionError("BufferSink.reserve_in_thread never hands out slots")

    def abandon(self, slot: Slot) -> None:
        with self._lock:
            self.abandoned += 1
        slot.view.release()

    async def commit(self, namespace: str, blocks: Sequence[tuple[bytes, Slot]]) -> PutOutcome:
        with self._lock:
            self.committed += len(blocks)
        items = [(key, slot.view.toreadonly()) for key, slot in blocks]
        return await self._stack.put(namespace, items)  # type: ignore[arg-type]


class _ArenaSlot:
    __slots__ = ("reservation", "view")

    def __init__(self, reservation: Reservation) -> None:
        self.reservation = reservation
        self.view = reservation.buffer


class ArenaSink(BufferSink):
    """Slots are reservations in the RAM tier's arena where it has room, fresh buffers elsewhere.

    Attributes (besides BufferSink's counts, which cover both kinds):
        in_arena: blocks received straight into arena slots.
    """

    def __init__(self, stack: TierStack) -> None:
        super().__init__(stack)
        self.in_arena = 0

    async def reserve(self, namespace: str, nbytes: int) -> Slot:
        # What making room evicts is copied out for demotion in a worker thread (TierStack.reserve_many),
        # never on the event loop.
        made = await self._stack.reserve_many(namespace, [nbytes])
        if made is None:  # no room now: a buffer, stored by the stack's put like any block
            return await super().reserve(namespace, nbytes)
        (reservation,) = made
        with self._lock:
            self.reserved += 1
            self.in_arena += 1
        return _ArenaSlot(reservation)

    async def reserve_many(self, namespace: str, sizes: Sequence[int]) -> list[Slot]:
        made = await self._stack.reserve_many(namespace, sizes)
        if made is None:  # no room for all of them now: buffers, stored by the stack's put
            return await super().reserve_many(namespace, sizes)
        with self._lock:
            self.reserved += len(made)
            self.in_arena += len(made)
        return [_ArenaSlot(r) for r in made]

    def reserve_in_thread(self, namespace: str, sizes: Sequence[int]) -> list[Slot] | None:
        """Arena slots reserved from the session's thread (TierStack.reserve_in_thread: RAM alone, no
        event subscriber, room now); None, with nothing held, where the loop must reserve them."""
        made = self._stack.reserve_in_thread(namespace, sizes)
        if made is None:
            return None
        with self._lock:
            self.reserved += len(made)
            self.in_arena += len(made)
        return [_ArenaSlot(r) for r in made]

    def commit_in_thread(self, namespace: str, blocks: Sequence[tuple[bytes, Slot]]) -> PutOutcome | None:
        outcome = self._stack.commit_in_thread(namespace, [(key, slot.reservation) for key, slot in blocks])  # type: ignore[attr-defined]
        if outcome is not None:
            with self._lock:
                self.committed += len(blocks)
        return outcome

    def abandon(self, slot: Slot) -> None:
        if isinstance(slot, _ArenaSlot):
            with self._lock:
                self.abandoned += 1
            self._stack.ram.abandon([slot.reservation.id])
        else:
            super().abandon(slot)

    async def commit(self, namespace: str, blocks: Sequence[tuple[bytes, Slot]]) -> PutOutcome:
        in_place = [(key, slot.reservation) for key, slot in blocks if isinstance(slot, _ArenaSlot)]
        buffered = [(key, slot) for key, slot in blocks if not isinstance(slot, _ArenaSlot)]
        if not buffered:
            with self._lock:
                self.committed += len(blocks)
            try:
                return await self._stack.put_reserved(namespace, in_place)
            finally:
                self._stack.ram.abandon([r.id for _, r in in_place])  # nothing for those committed
        if not in_place:
            return await super().commit(namespace, buffered)
        # Both kinds in one PUT (RAM ran out of room mid-way): the buffered blocks are copied into
        # arena slots of their own by the stack's put; one outcome per block, in the PUT's order.
        with self._lock:
            self.committed += len(in_place)
        try:
            first = await self._stack.put_reserved(namespace, in_place)
        finally:
            self._stack.ram.abandon([r.id for _, r in in_place])
        second = await super().commit(namespace, buffered)
        kept_in_place, kept_buffered = iter(first.kept), iter(second.kept)
        kept = [next(kept_in_place) if isinstance(slot, _ArenaSlot) else next(kept_buffered) for _, slot in blocks]
        return merge_outcomes(first, second, kept)


def merge_outcomes(first: PutOutcome, second: PutOutcome, kept: list[bool]) -> PutOutcome:
    """One PUT's outcome from two puts of parts of its blocks: `kept` in the PUT's order, each
    tier's counts summed."""
    tiers: list[TierPut] = []
    for a, b in zip(first.tiers, second.tiers, strict=True):
        counts = {
            f.name: getattr(a, f.name) + getattr(b, f.name)
            for f in dataclasses.fields(TierPut)
            if f.name not in ("name", "kind")
        }
        tiers.append(TierPut(a.name, a.kind, **counts))
    return PutOutcome(kept, tiers)
