"""Where the bulk path's received blocks land: reserve(nbytes) -> a writable slot, then commit or abandon.

The session asks the sink for one slot per announced block before receiving it, receives the
block's bytes with recv_into straight into `slot.view`, verifies it in place, and only then
commits the request's slots under their keys (a put is visible all at once or not at all). A slot
of a request that fails (a lying frame, a checksum mismatch, a peer gone mid-frame) is abandoned.

BufferSink implements this over fresh buffers and the tier stack's put (the RAM tier stores the
buffer itself, without a copy). A preallocated shared-memory arena can implement the same protocol
to receive straight into its slots.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from kvcache_server.stack import PutOutcome, TierStack


class Slot(Protocol):
    """A reserved, writable place for one block."""

    @property
    def view(self) -> memoryview:
        """Exactly the reserved bytes, writable."""
        ...


class BlockSink(Protocol):
    """Reserves slots for blocks being received and commits verified ones under their keys.

    reserve and abandon are called from session threads; commit runs on the server's event loop.
    """

    def reserve(self, nbytes: int) -> Slot: ...

    def abandon(self, slot: Slot) -> None: ...

    async def commit(self, namespace: str, blocks: Sequence[tuple[bytes, Slot]]) -> PutOutcome: ...


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

    def reserve(self, nbytes: int) -> Slot:
        with self._lock:
            self.reserved += 1
        return _Buffer(nbytes)

    def abandon(self, slot: Slot) -> None:
        with self._lock:
            self.abandoned += 1
        slot.view.release()

    async def commit(self, namespace: str, blocks: Sequence[tuple[bytes, Slot]]) -> PutOutcome:
        with self._lock:
            self.committed += len(blocks)
        items = [(key, slot.view.toreadonly()) for key, slot in blocks]
        return await self._stack.put(namespace, items)  # type: ignore[arg-type]
