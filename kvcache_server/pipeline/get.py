"""The Get pipeline, stage by stage, the same for gRPC replies and shm segments (docs/arena.md):

    locate    _windows: the stack (RAM, lower tiers, promotion) window by window, bounded by
              limits.get_window_bytes
    lease     RAM hits are views of their arena slots under read leases, released as soon as the
              reply naming them is written (_serve_get), whatever way the call ends
    send      _get_replies: messages of about stream_message_bytes, blocks in parts, or written into
              the client's segment (_write_segment) and only named; _serve_get writes each reply
              with a stall timeout (the in-place path sends only the lease: pipeline.inplace)

Mixed into KVCacheService, which provides validation (_namespace, _keys, _abort, _cut_off), the
stack, the budget and the counters.
"""

from __future__ import annotations

import asyncio
import os
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, NoReturn

import grpc

from kvcache_core.blockwire import GetPart, ShmRange
from kvcache_proto import kvcache_pb2 as pb
from kvcache_server.budget import Holding
from kvcache_server.refusal import Refused
from kvcache_server.shm import (
    FULL_METADATA,
    OFFLOAD_BYTES,
    SPACE_ERRNOS,
    ShmDirectory,
    align,
    write_ranges,
    write_ranges_in_thread,
)
from kvcache_server.stack import Found
from kvcache_server.tiers.base import TierKind

if TYPE_CHECKING:
    from kvcache_server.budget import MemoryBudget
    from kvcache_server.config import LimitsSection
    from kvcache_server.pipeline import Counters
    from kvcache_server.stack import TierStack


GetReply = list[tuple[int, bool, bytes | memoryview | ShmRange | GetPart, int]]
"""One streamed Get message: (index, found, block or its place in the shm segment, tier) per item."""

_GET_PART_BYTES = 1 << 20
_GET_PARTS_ABOVE = 4 << 20
"""Inline blocks larger than _GET_PARTS_ABOVE go to clients that accept parts in messages of
_GET_PART_BYTES (the same rule as the SDK's puts; see kvcache_client.messages.PARTS_ABOVE_BYTES)."""

_SHM_ITEM_BYTES = 96
"""What a Get item sent as a ShmRange counts against stream_message_bytes."""

_MAX_WINDOW_KEYS = 1024
"""A Get window never spans more keys than this, however small its blocks."""

_BLOCK_SIZE_NAMESPACES = 4096
"""Namespaces whose largest block the server remembers (for Get windows), least recently used out."""


_SHED_AFTER_S = 0.5
"""A Get reply its client has not taken for this long sheds the window's blocks not yet in a reply."""


class BlockSizes:
    """The largest block seen per namespace (what a Get window reserves per lower-tier block), for
    the most recently used _BLOCK_SIZE_NAMESPACES namespaces. Shared by gRPC and the bulk path."""

    def __init__(self) -> None:
        self._sizes: OrderedDict[str, int] = OrderedDict()

    def get(self, namespace: str) -> int | None:
        size = self._sizes.get(namespace)
        if size is not None:
            self._sizes.move_to_end(namespace)
        return size

    def saw(self, namespace: str, size: int) -> None:
        sizes = self._sizes
        sizes[namespace] = max(size, sizes.get(namespace, 0))
        sizes.move_to_end(namespace)
        if len(sizes) > _BLOCK_SIZE_NAMESPACES:
            sizes.popitem(last=False)


class _Window:
    """The lower-tier blocks of a Get's current window, and the budget they hold until written."""

    def __init__(self, held: Holding) -> None:
        self.held = held
        self.pending: dict[int, Found] = {}  # fetched, not yet in a reply
        self._unsent: dict[int, int] = {}  # in a reply not yet written: index -> bytes counted
        self.sheds = 0

    def take(self, index: int) -> Found | None:
        """The block at `index` for a reply; None when it was shed."""
        hit = self.pending.pop(index, None)
        if hit is not None:
            self._unsent[index] = len(hit.data)
        return hit

    def sent_through(self, index: int) -> None:
        """The replies through `index` are written: their blocks are no longer held here."""
        done = [i for i in self._unsent if i <= index]
        self.held.release(sum(self._unsent.pop(i) for i in done))

    def shed(self) -> None:
        """Drops the blocks not yet in a reply and what they held (the client is not reading)."""
        if not self.pending:
            return
        self.sheds += 1
        self.held.release(sum(len(f.data) for f in self.pending.values()))
        self.pending.clear()


async def locate_window(
    stack: TierStack,
    held: Holding,
    namespace: str,
    keys: list[bytes],
    start: int,
    per_block: int | None,
    window_bytes: int,
    what: str,
) -> tuple[int, list[Found | None]]:
    """One Get window from `start`: every key RAM holds (leased views, no copy) and lower-tier keys up
    to what `window_bytes` (and the call's share, held.share) allows at `per_block` bytes each, or one
    when the block size is not known. Reserves that much before reading, then holds in `held`
    exactly what the lower tiers returned. Returns the window's end and its blocks (None: a miss).

    Raises:
        Refused: RESOURCE_EXHAUSTED, when the reservation found no room in time.
    """
    ram = stack.ram
    ahead = keys[start : start + _MAX_WINDOW_KEYS]
    # Blocks of earlier windows not yet written (the reply being filled) count against the share.
    allowed = max(1, min(window_bytes, held.share - held.bytes) // per_block) if per_block else 1
    lower_keys = sum(1 for in_ram in ram.contains_many_sync(namespace, ahead) if not in_ram)
    reserved = min(lower_keys, allowed) * per_block if per_block else 0
    if reserved:
        await held.reserve(reserved, what)
    # Which keys RAM holds, asked again right before the stack reads RAM (no await in between):
    # promotions and evictions may have changed it while the reservation waited.
    end, lower_keys = start, 0
    for in_ram in ram.contains_many_sync(namespace, ahead):
        if not in_ram:
            if lower_keys == allowed:
                break
            lower_keys += 1
        end += 1
    try:
        found = await stack.get(namespace, keys[start:end])
    finally:
        held.release(reserved)
    held.count(sum(len(f.data) for f in found if f is not None and f.tier is not TierKind.RAM))
    return end, found


def _reply_bytes(reply: GetReply) -> int:
    """The block bytes a reply carries inline (what gRPC copies when it serialises the message)."""
    total = 0
    for _, _, data, _ in reply:
        if isinstance(data, GetPart):
            total += len(data.data)
        elif not isinstance(data, ShmRange):
            total += len(data)
    return total


def _sent_through(reply: GetReply) -> int:
    """The highest key index whose block a written reply completed (a part with more to come does not)."""
    index, _, data, _ = reply[-1]
    return index - 1 if isinstance(data, GetPart) and data.more else index


class GetStages:
    """locate -> lease -> send (module docstring)."""

    _stack: TierStack
    _limits: LimitsSection
    _shm: ShmDirectory | None
    _counters: Counters
    budget: MemoryBudget

    if TYPE_CHECKING:  # provided by KVCacheService (declared only: a stub here would shadow it)

        async def _abort(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn: ...

        async def _namespace(self, context: grpc.aio.ServicerContext, namespace: str) -> str: ...

        async def _cut_off(
            self, context: grpc.aio.ServicerContext, why: str, held: Holding | None = None
        ) -> NoReturn: ...

        def _tenant(self) -> str | None: ...

    block_sizes: BlockSizes

    async def _serve_get(
        self,
        context: grpc.aio.ServicerContext,
        namespace: str,
        keys: list[bytes],
        request: pb.GetRequest,
        segment: tuple[int, int] | None,
    ) -> None:
        """The Get pipeline: locate (window by window) -> lease (RAM hits' slots, until sent) -> send
        (each reply written with context.write, so that a client that stops reading is noticed: a reply
        not taken within get_stall_timeout_s cuts the call off). Closes `segment` when it ends.

        A reply not taken within _SHED_AFTER_S sheds the window's blocks not yet handed to a reply
        (they are read again if the client reads on): a Get whose client stalls holds at most the
        reply it is writing and the one being filled, not a whole window of the budget.
        """
        stall = self._limits.get_stall_timeout_s
        loop = asyncio.get_running_loop()
        leased: list[tuple[int, Found]] = []  # RAM hits whose arena slots are leased until they are sent
        try:
            with self.budget.holding(self._tenant(), capped=True) as held:
                window = _Window(held)
                found = self._windows(context, namespace, keys, request.prefix_only, window, leased)
                async for reply in self._get_replies(context, found, request, segment):
                    shed = loop.call_later(_SHED_AFTER_S, window.shed) if window.pending else None
                    # gRPC's serialised copy of the reply, held until its client takes it (RAM hits too).
                    copy = _reply_bytes(reply)
                    held.count(copy)
                    try:
                        async with asyncio.timeout(stall):  # a timer on this task, no task per message
                            await context.write(reply)  # serialised (copied) before it returns
                    except TimeoutError:
                        await self._cut_off(
                            context, f"the client read nothing for {stall:g} s (limits.get_stall_timeout_s)", held
                        )
                    finally:
                        held.release(copy)
                        if shed is not None:
                            shed.cancel()
                    sent = _sent_through(reply)
                    window.sent_through(sent)
                    done = [f for i, f in leased if i <= sent]
                    if done:
                        self._stack.release(done)
                        leased[:] = [(i, f) for i, f in leased if i > sent]
        finally:
            self._stack.release(f for _, f in leased)
            # No worker thread still writes through it: _write_segment waits for its thread even when
            # the call is cancelled (and the thread writes through its own duplicate).
            if segment is not None:
                os.close(segment[0])

    async def _windows(
        self,
        context: grpc.aio.ServicerContext,
        namespace: str,
        keys: list[bytes],
        prefix_only: bool,
        window: _Window,
        leased: list[tuple[int, Found]],
    ) -> AsyncIterator[tuple[int, Found | None]]:
        """(index, block or None) for every key, fetched window by window; RAM hits (views of leased
        arena slots) are noted in `leased` for the caller to release once sent.

        Keys the RAM tier holds cost nothing (the reply views their leased arena slots); the others
        are fetched from lower tiers at most about get_window_bytes (and one call's share of the
        budget) at a time. A window reserves what it will carry: its lower-tier keys times the
        largest block this server has seen in the namespace; in a namespace it has not seen, a
        window carries one lower-tier block, counted when it arrives (as a received Put message
        is). Each block stays counted in `window` until the reply holding it is written, or the
        window sheds it (the caller's client stopped reading): it is read again from here.
        """
        held = window.held
        start = 0
        while start < len(keys):
            per_block = self.block_sizes.get(namespace)
            try:
                end, found = await locate_window(
                    self._stack, held, namespace, keys, start, per_block, self._limits.get_window_bytes, "Get"
                )
            except Refused as exc:
                await self._abort(context, exc.code, exc.message)
            lower = {i: f for i, f in enumerate(found, start) if f is not None and f.tier is not TierKind.RAM}
            if lower:
                self.block_sizes.saw(namespace, max(len(f.data) for f in lower.values()))
            window.pending.update(lower)
            leased.extend((i, hit) for i, hit in enumerate(found, start) if hit is not None and hit.lease is not None)
            order = [(i, i in lower, None if i in lower else hit) for i, hit in enumerate(found, start)]
            del found, lower  # the window's lower-tier blocks are referenced from window.pending only
            for i, from_lower, hit in order:
                if from_lower and (hit := window.take(i)) is None:  # shed while the client did not read
                    end = i  # read again from here
                    break
                yield i, hit
                if hit is None and prefix_only:
                    return
            start = end

    async def _get_replies(
        self,
        context: grpc.aio.ServicerContext,
        found: AsyncIterator[tuple[int, Found | None]],
        request: pb.GetRequest,
        segment: tuple[int, int] | None,
    ) -> AsyncIterator[GetReply]:
        """Found blocks in messages of about stream_message_bytes. With a segment, the blocks that fit
        are written into it (in key order, 64-byte aligned, within its capacity; one worker-thread hop
        per message) and only their place is sent; the rest go inline."""
        budget = self._limits.stream_message_bytes
        capacity = request.shm.capacity if segment is not None else 0
        offset = 0
        items: GetReply = []
        writes: list[tuple[bytes | memoryview, int]] = []
        size = 0
        async for i, hit in found:
            if hit is None:
                items.append((i, False, b"", 0))
                if request.prefix_only:
                    break
                continue
            data = hit.data
            n = len(data)
            sent: bytes | memoryview | ShmRange = data
            if segment is not None and offset + n <= capacity:
                writes.append((data, offset))
                sent = ShmRange(request.shm.segment, offset, n)
                offset = align(offset + n)
            elif request.accept_parts and n > _GET_PARTS_ABOVE:
                if items:
                    await self._write_segment(context, segment, writes)
                    writes = []
                    yield items
                    items, size = [], 0
                view, tier = memoryview(data), int(hit.tier)
                for start in range(0, n, _GET_PART_BYTES):
                    end = start + _GET_PART_BYTES
                    yield [(i, True, GetPart(view[start:end], end < n), tier)]
                continue
            cost = _SHM_ITEM_BYTES if isinstance(sent, ShmRange) else n
            if size and size + cost > budget:
                await self._write_segment(context, segment, writes[:-1] if isinstance(sent, ShmRange) else writes)
                writes = writes[-1:] if isinstance(sent, ShmRange) else []
                yield items
                items, size = [], 0
            items.append((i, True, sent, int(hit.tier)))
            size += cost
        if items:
            await self._write_segment(context, segment, writes)
            yield items

    async def _write_segment(
        self,
        context: grpc.aio.ServicerContext,
        segment: tuple[int, int] | None,
        writes: list[tuple[bytes | memoryview, int]],
    ) -> None:
        """Writes the blocks of one reply into the client's segment before the reply names them.

        Large writes run in a worker thread, which a cancelled call stops before its next block and
        waits for: nothing is written into the segment once the call has ended. A write that fails
        for want of room (tmpfs full) fails the call with RESOURCE_EXHAUSTED and FULL_METADATA: the
        client redoes this call inline and keeps using segments. Any other failed write is
        FAILED_PRECONDITION: the client stops using segments with this server."""
        if segment is None or not writes:
            return
        nbytes = sum(len(d) for d, _ in writes)
        try:
            if nbytes >= OFFLOAD_BYTES:
                await write_ranges_in_thread(segment[0], writes)
            else:
                write_ranges(segment[0], writes)
        except OSError as exc:
            if exc.errno in SPACE_ERRNOS:
                context.set_trailing_metadata([FULL_METADATA])
                await self._abort(
                    context,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"no room for this Get's blocks in the shared-memory directory ({exc.strerror}); "
                    "redo this call inline",
                )
            await self._abort(context, grpc.StatusCode.FAILED_PRECONDITION, f"cannot write into shm segment: {exc}")
        self._counters.shm_bytes_sent += nbytes
