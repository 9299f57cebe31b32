"""The kvcache.v1.KVCache gRPC service: request validation and status codes, nothing else.

Each handler checks what the client sent, answers a precise status for what
is wrong (see proto/kvcache/v1/kvcache.proto), and hands valid work to the
TierStack. Block bytes are taken from the request message once and stored as
that same bytes object; on reads the stored object goes into the reply as is.

Work per call is bounded (docs/limits.md): what a call holds in flight counts against one
MemoryBudget (kvcache_server.budget) before it is allocated or as soon as it exists; a Put
message is decoded no further than the stream's block limit allows, large ones off the event
loop, and large blocks are verified off it too; a Get fetches from lower tiers window by window
and sends each window before fetching the next; a Put stream that goes quiet, or a Get whose
client stops reading, is cut off with DEADLINE_EXCEEDED and what it held is released.

Longer than the project's ~500-line module guideline: each RPC's validation, status codes and budget
accounting are read together with the wire contract; the Put and Get data paths (budget, windows, shm,
parts) are the candidates to move out when the bulk path of issue 14 adds a third transport.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import sys
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from typing import NoReturn

import grpc

from kvcache_core.blockwire import (
    BlockPart,
    GetPart,
    PutMessage,
    ShmRange,
    data_len,
    decode_put_request,
)
from kvcache_core.keys import KEY_BYTES
from kvcache_proto import kvcache_pb2 as pb
from kvcache_proto import kvcache_pb2_grpc as pb_grpc
from kvcache_server.auth import current_principal
from kvcache_server.budget import Holding, MemoryBudget
from kvcache_server.config import LimitsSection
from kvcache_server.events import SubscriberOverflow, TooManySubscribers
from kvcache_server.observe import NullObserver, Observer
from kvcache_server.parts import BlockAssembler
from kvcache_server.pipeline.inplace import InPlaceRPCs
from kvcache_server.pipeline.verify import BlockRefused, verify_block_for_put
from kvcache_server.refusal import Refused
from kvcache_server.shm import (
    FULL_METADATA,
    SPACE_ERRNOS,
    ShmDirectory,
    ShmError,
    align,
    read_ranges,
    read_ranges_in_thread,
    write_ranges,
    write_ranges_in_thread,
)
from kvcache_server.stack import Found, TierPut, TierStack
from kvcache_server.tiers.base import TierKind, TierStats

log = logging.getLogger(__name__)

MAX_NAMESPACE_BYTES = 128
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVCache"].full_name
# TierStats travels field by field under the same names; `kind` is `tier` on the wire.
_TIER_STATS_FIELDS = [f for f in dataclasses.fields(TierStats) if f.name != "kind"]


class _Counters:
    def __init__(self) -> None:
        self.failed_requests = 0
        self.put_checksum_failures = 0
        self.shm_bytes_received = 0
        self.shm_bytes_sent = 0


GetReply = list[tuple[int, bool, bytes | memoryview | ShmRange | GetPart, int]]
"""One streamed Get message: (index, found, block or its place in the shm segment, tier) per item."""

_OFFLOAD_BYTES = 256 << 10
"""Segment reads and writes at least this large run in a worker thread, off the event loop."""

_GET_PART_BYTES = 1 << 20
_GET_PARTS_ABOVE = 4 << 20
"""Inline blocks larger than _GET_PARTS_ABOVE go to clients that accept parts in messages of
_GET_PART_BYTES (the same rule as the SDK's puts; see kvcache_client.messages.PARTS_ABOVE_BYTES)."""

_SHM_ITEM_BYTES = 96
"""What a Get item sent as a ShmRange counts against stream_message_bytes."""

_DECODE_OFF_LOOP_BYTES = 256 << 10
_INLINE_DECODE_BLOCKS = 64
"""Put messages at least _DECODE_OFF_LOOP_BYTES large that hold more than _INLINE_DECODE_BLOCKS blocks
are decoded in a worker thread (many small blocks take milliseconds of Python); the rest inline,
where a thread hop would cost more than the parsing (a 1 MiB part parses in microseconds)."""

_MAX_WINDOW_KEYS = 1024
"""A Get window never spans more keys than this, however small its blocks."""

_BLOCK_SIZE_NAMESPACES = 4096
"""Namespaces whose largest block the server remembers (for Get windows), least recently used out."""


def _sent_through(reply: GetReply) -> int:
    """The highest key index whose block a written reply completed (a part with more to come does not)."""
    index, _, data, _ = reply[-1]
    return index - 1 if isinstance(data, GetPart) and data.more else index


class KVCacheService(InPlaceRPCs, pb_grpc.KVCacheServicer):
    """Validates requests and forwards them to the tier stack (the in-place RPCs: pipeline.inplace)."""

    def __init__(
        self,
        stack: TierStack,
        limits: LimitsSection,
        *,
        version: str,
        observer: Observer | None = None,
        shm: ShmDirectory | None = None,
        lease_timeout_s: float = 30.0,
    ) -> None:
        self._stack = stack
        self.lease_timeout_s = lease_timeout_s
        self.inplace_bytes_received = 0  # blocks committed from arena reservations
        self.inplace_bytes_leased = 0  # blocks read in place under leases
        self._shm = shm
        self._observer = observer or NullObserver()
        self._limits = limits
        self._version = version
        self._started = time.monotonic()
        self._counters = _Counters()
        self.budget = MemoryBudget(limits.inflight_bytes, limits.admission_wait_s)
        self._block_sizes: OrderedDict[str, int] = OrderedDict()  # namespace -> largest block seen
        self.cut_off = 0  # Put streams gone quiet and Gets not read, ended by the server

    def counters(self) -> dict[str, int]:
        """Service-level counters, for metrics."""
        return {
            "failed_requests": self._counters.failed_requests,
            "put_checksum_failures": self._counters.put_checksum_failures,
            "shm_bytes_received": self._counters.shm_bytes_received,
            "shm_bytes_sent": self._counters.shm_bytes_sent,
            "inplace_bytes_received": self.inplace_bytes_received,
            "inplace_bytes_leased": self.inplace_bytes_leased,
            "inflight_bytes": self.budget.used,
            "inflight_peak_bytes": self.budget.peak,
            "inflight_refused": self.budget.refused,
            "cut_off_calls": self.cut_off,
        }

    # -- validation ---------------------------------------------------------------------------

    async def _abort(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
        self._counters.failed_requests += 1
        await context.abort(code, message)
        raise AssertionError("unreachable: context.abort raises")

    async def _cut_off(self, context: grpc.aio.ServicerContext, why: str) -> NoReturn:
        """Ends a call whose peer went quiet (DEADLINE_EXCEEDED); what it held is released as it unwinds."""
        self.cut_off += 1
        await self._abort(context, grpc.StatusCode.DEADLINE_EXCEEDED, f"{why}: the call is cut off")

    async def _namespace(self, context: grpc.aio.ServicerContext, namespace: str) -> str:
        """The validated namespace, scoped by the caller's tenant: "<tenant>:<namespace>" with auth on.

        Every tier stores the scoped name, so tenants with identical namespaces and keys never
        meet: another tenant's blocks are not hidden, they are looked for in another place.
        """
        if not namespace:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, "namespace is required")
        if (
            len(namespace) > MAX_NAMESPACE_BYTES
            or not namespace.isascii()
            or not namespace.isprintable()
            or " " in namespace
            or ":" in namespace
        ):
            await self._abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"namespace must be 1..{MAX_NAMESPACE_BYTES} printable ASCII characters without spaces or ':'",
            )
        principal = current_principal.get()
        scoped = f"{principal.tenant}:{namespace}" if principal is not None else namespace
        # One shared str per namespace (interned strings are freed with their last reference):
        # index entries then point at one object instead of one copy per request.
        return sys.intern(scoped)

    async def _keys(self, context: grpc.aio.ServicerContext, keys: Sequence[bytes]) -> list[bytes]:
        if not keys:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, "keys must not be empty")
        if len(keys) > self._limits.max_keys_per_request:
            await self._abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(keys)} keys exceed max_keys_per_request={self._limits.max_keys_per_request}",
            )
        out = list(keys)
        for i, key in enumerate(out):
            if len(key) != KEY_BYTES:
                await self._abort(
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"keys[{i}] is {len(key)} bytes; a chunk key is {KEY_BYTES} bytes",
                )
        return out

    async def _block(self, context: grpc.aio.ServicerContext, index: int, key: bytes, data: bytes | memoryview) -> None:
        """The verify stage (kvcache_server.pipeline.verify); a refused block ends the call with its status."""
        try:
            await verify_block_for_put(index, key, data, self._limits.max_block_bytes)
        except BlockRefused as exc:
            await self._refuse_block(context, exc)

    async def _refuse_block(self, context: grpc.aio.ServicerContext, exc: BlockRefused) -> NoReturn:
        if exc.checksum:
            self._counters.put_checksum_failures += 1
        await self._abort(context, exc.code, exc.message)

    # -- RPCs ---------------------------------------------------------------------------------

    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        namespace = await self._namespace(context, request.namespace)
        keys = await self._keys(context, request.keys)
        tiers = await self._stack.lookup(namespace, keys)
        self._observer.lookup(namespace, len(keys), len(tiers))
        return pb.LookupResponse(prefix_length=len(tiers), tiers=[int(t) for t in tiers])

    async def Put(self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> pb.PutResponse:
        segments: dict[str, tuple[int, int]] = {}  # open shm segments: name -> (fd, size)
        try:
            with self.budget.holding() as held:
                return await self._put(request_iterator, context, segments, held)
        finally:
            # No worker thread still reads through these: _read_shm_blocks waits for its thread even
            # when the call is cancelled (and the thread reads through its own duplicates).
            for fd, _ in segments.values():
                os.close(fd)

    async def _next_message(self, messages: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes | None:
        """The stream's next raw message, None at its end; a stream quiet for put_idle_timeout_s is cut off."""
        idle = self._limits.put_idle_timeout_s
        try:
            async with asyncio.timeout(idle):  # a timer on this task, no task per message
                return await anext(messages)
        except StopAsyncIteration:
            return None
        except TimeoutError:
            await self._cut_off(context, f"no Put message for {idle:g} s (limits.put_idle_timeout_s)")

    async def _decode(self, raw: bytes, max_blocks: int) -> PutMessage:
        """Decodes one Put message, no further than `max_blocks` blocks. Parsing costs per block: a
        message of a few blocks (a large block, a part) is decoded inline; one that turns out to hold
        more than _INLINE_DECODE_BLOCKS is decoded again in a worker thread when it is large."""
        if len(raw) < _DECODE_OFF_LOOP_BYTES or max_blocks <= _INLINE_DECODE_BLOCKS:
            return decode_put_request(raw, max_blocks)
        message = decode_put_request(raw, _INLINE_DECODE_BLOCKS)
        if not message.over_limit:
            return message
        return await asyncio.to_thread(decode_put_request, raw, max_blocks)

    async def _put(
        self,
        request_iterator: AsyncIterator[bytes],
        context: grpc.aio.ServicerContext,
        segments: dict[str, tuple[int, int]],
        held: Holding,
    ) -> pb.PutResponse:
        namespace: str | None = None  # scoped
        first_namespace = ""  # as the client sent it
        index = stored = rejected = received = entries = 0
        tiers: list[TierPut] = []  # what each tier took, summed over the stream's messages
        assembler = BlockAssembler(self._limits.max_block_bytes, held)  # blocks sent in parts
        limits = self._limits
        messages = aiter(request_iterator)
        while (raw := await self._next_message(messages, context)) is not None:
            # The message exists already (gRPC received it): counted at once. Everything decoded from
            # it is released once its blocks are committed; parts of an unfinished block stay counted.
            held.count(len(raw))
            message_bytes = len(raw)
            message = await self._decode(raw, limits.max_put_stream_blocks - entries)
            if message.over_limit:
                await self._abort(
                    context,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"Put stream exceeds max_put_stream_blocks={limits.max_put_stream_blocks}; split it",
                )
            if message.error:
                await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, message.error)
            del raw  # large blocks are views into it; small ones were copied out (counted below)
            copied = sum(
                len(d)
                for d in (b.data if isinstance(b, BlockPart) else b for _, b in message.blocks)
                if type(d) is bytes
            )
            held.count(copied)
            message_bytes += copied
            entries += len(message.blocks)
            received += sum(data_len(d) for _, d in message.blocks)
            if received > limits.max_put_stream_bytes:
                await self._abort(
                    context,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"Put stream exceeds max_put_stream_bytes={limits.max_put_stream_bytes}; split it",
                )
            if namespace is None:
                namespace = await self._namespace(context, message.namespace)
                first_namespace = message.namespace
            elif message.namespace and message.namespace != first_namespace:
                await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, "namespace changed within one Put stream")
            blocks = message.blocks
            if any(isinstance(d, ShmRange) for _, d in blocks):
                from_shm = sum(d.length for _, d in blocks if isinstance(d, ShmRange))
                try:
                    await held.reserve(from_shm, f"block {index}")  # before copying them out of the segment
                except Refused as exc:
                    await self._abort(context, exc.code, exc.message)
                message_bytes += from_shm
                blocks = await self._read_shm_blocks(context, index, blocks, segments)
            complete: list[tuple[bytes, bytes | memoryview]] = []
            assembled = 0  # bytes of blocks completed from parts in this message (counted by the assembler)
            for key, data in blocks:
                where = index + len(complete)
                continues = assembler.assembling  # this Block is the next part of a block in parts
                try:
                    whole = await assembler.feed(where, key, data)  # type: ignore[arg-type]
                except Refused as exc:
                    await self._abort(context, exc.code, exc.message)
                if whole is None:
                    continue
                if continues:  # its last part: the assembler counted all of it
                    assembled += len(whole[1])
                await self._block(context, where, *whole)
                complete.append(whole)
            index += len(complete)
            # Commit this message's complete blocks (all verified) before reading the next message.
            if complete:
                self._saw_block_size(namespace, max(len(d) for _, d in complete))
                outcome = await self._stack.put(namespace, complete)
                stored += sum(outcome.kept)
                rejected += len(outcome.kept) - sum(outcome.kept)
                if not tiers:
                    tiers = outcome.tiers
                else:
                    for total, took in zip(tiers, outcome.tiers, strict=True):
                        total.add(took)
            del message, blocks, complete
            # What the RAM tier kept is its capacity's business from now on.
            held.release(message_bytes + assembled)
        try:
            assembler.finish()
        except Refused as exc:
            await self._abort(context, exc.code, exc.message)
        if namespace is None or index == 0:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, "Put carried no blocks")
        return pb.PutResponse(
            stored=stored,
            rejected=rejected,
            bytes_received=received,
            tiers=[
                pb.TierPutResult(
                    tier=int(t.kind),
                    name=t.name,
                    stored=t.stored,
                    queued=t.queued,
                    dropped=t.dropped,
                    failed=t.failed,
                    deleted=t.deleted,
                )
                for t in tiers
            ],
        )

    async def _read_shm_blocks(
        self,
        context: grpc.aio.ServicerContext,
        first_index: int,
        blocks: list[tuple[bytes, bytes | memoryview | ShmRange]],
        segments: dict[str, tuple[int, int]],
    ) -> list[tuple[bytes, bytes | memoryview]]:
        """The message's blocks with every ShmRange replaced by the bytes it names (copied out of the
        client's segment now: the client may reuse it as soon as the call returns). One worker-thread
        hop for the whole message when it is large; a cancelled call waits for that thread to stop."""
        reads: list[tuple[int, int, int, ShmRange]] = []
        for i, (_, data) in enumerate(blocks):
            if not isinstance(data, ShmRange):
                continue
            where = first_index + i
            if data.length > self._limits.max_block_bytes:
                await self._abort(
                    context,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"block {where}: {data.length} bytes exceed max_block_bytes={self._limits.max_block_bytes}",
                )
            try:
                if data.segment not in segments:
                    segments[data.segment] = self._open_segment(data.segment, writable=False)
            except ShmError as exc:
                await self._abort(context, exc.code, f"block {where}: {exc.message}")
            reads.append((where, *segments[data.segment], data))
        try:
            if sum(r[3].length for r in reads) >= _OFFLOAD_BYTES:
                contents = await read_ranges_in_thread(reads)
            else:
                contents = read_ranges(reads)
        except ShmError as exc:
            await self._abort(context, exc.code, exc.message)
        self._counters.shm_bytes_received += sum(len(c) for c in contents)
        it = iter(contents)
        return [(key, next(it) if isinstance(data, ShmRange) else data) for key, data in blocks]

    def _open_segment(self, name: str, *, writable: bool) -> tuple[int, int]:
        if self._shm is None:
            raise ShmError(
                grpc.StatusCode.FAILED_PRECONDITION, "this server has no shared-memory path (Info.shm_dir is empty)"
            )
        return self._shm.open_segment(name, writable=writable)

    async def Get(self, request: pb.GetRequest, context: grpc.aio.ServicerContext) -> None:
        """Streams the found blocks with context.write, so that a client that stops reading is noticed:
        a reply not taken within get_stall_timeout_s cuts the call off."""
        namespace = await self._namespace(context, request.namespace)
        keys = await self._keys(context, request.keys)
        segment: tuple[int, int] | None = None
        if request.HasField("shm"):
            try:
                segment = self._open_segment(request.shm.segment, writable=True)
            except ShmError as exc:
                await self._abort(context, exc.code, exc.message)
        stall = self._limits.get_stall_timeout_s
        leased: list[tuple[int, Found]] = []  # RAM hits whose arena slots are leased until they are sent
        try:
            with self.budget.holding() as held:
                found = self._windows(context, namespace, keys, request.prefix_only, held, leased)
                async for reply in self._get_replies(context, found, request, segment):
                    try:
                        async with asyncio.timeout(stall):  # a timer on this task, no task per message
                            await context.write(reply)  # serialised (copied) before it returns
                    except TimeoutError:
                        await self._cut_off(
                            context, f"the client read nothing for {stall:g} s (limits.get_stall_timeout_s)"
                        )
                    sent = _sent_through(reply)
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
        held: Holding,
        leased: list[tuple[int, Found]],
    ) -> AsyncIterator[tuple[int, Found | None]]:
        """(index, block or None) for every key, fetched window by window; RAM hits (views of leased
        arena slots) are noted in `leased` for the caller to release once sent.

        Keys the RAM tier holds cost nothing (the reply views their leased arena slots); the others
        are fetched from lower tiers at most about get_window_bytes at a time, sized by the largest
        block this server has seen in the namespace (max_block_bytes when it has seen none). What a
        window fetched stays counted in `held` until the next window is asked for, by which time
        the replies holding it have been sent (all but the one being filled): a Get of any size
        holds about one window at a time.
        """
        limits = self._limits
        ram = self._stack.ram
        start = 0
        while start < len(keys):
            per_block = self._block_size(namespace)
            allowed = max(1, limits.get_window_bytes // per_block)  # lower-tier blocks in this window
            held.release_all()  # the previous window has been sent
            try:
                await held.reserve(min(allowed * per_block, limits.get_window_bytes), "Get")
            except Refused as exc:
                await self._abort(context, exc.code, exc.message)
            # Which keys RAM holds, asked right before the stack reads RAM (no await in between):
            # promotions of earlier windows may have evicted some since the Get began.
            ahead = keys[start : start + _MAX_WINDOW_KEYS]
            end, lower_keys = start, 0
            for held_in_ram in ram.contains_many_sync(namespace, ahead):
                if not held_in_ram:
                    if lower_keys == allowed:
                        break
                    lower_keys += 1
                end += 1
            found = await self._stack.get(namespace, keys[start:end])
            lower = [len(f.data) for f in found if f is not None and f.tier is not TierKind.RAM]
            held.release_all()
            held.count(sum(lower))  # what this window really holds beyond RAM's references
            if lower:
                self._saw_block_size(namespace, max(lower))
            leased.extend((i, hit) for i, hit in enumerate(found, start) if hit is not None and hit.lease is not None)
            for i, hit in enumerate(found, start):
                yield i, hit
                if hit is None and prefix_only:
                    return
            start = end

    def _block_size(self, namespace: str) -> int:
        """The largest block seen in `namespace` (the size a Get window assumes per lower-tier block)."""
        size = self._block_sizes.get(namespace)
        if size is None:
            return self._limits.max_block_bytes
        self._block_sizes.move_to_end(namespace)
        return size

    def _saw_block_size(self, namespace: str, size: int) -> None:
        sizes = self._block_sizes
        sizes[namespace] = max(size, sizes.get(namespace, 0))
        sizes.move_to_end(namespace)
        if len(sizes) > _BLOCK_SIZE_NAMESPACES:
            sizes.popitem(last=False)

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
            if nbytes >= _OFFLOAD_BYTES:
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

    async def Delete(self, request: pb.DeleteRequest, context: grpc.aio.ServicerContext) -> pb.DeleteResponse:
        namespace = await self._namespace(context, request.namespace)
        keys = await self._keys(context, request.keys)
        return pb.DeleteResponse(deleted=await self._stack.delete(namespace, keys))

    async def WatchEvents(
        self, request: pb.WatchEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.KVEvent]:
        hub = self._stack.events
        namespace = await self._namespace(context, request.namespace) if request.namespace else ""
        principal = current_principal.get()
        scope = f"{principal.tenant}:" if principal is not None else ""
        try:
            sub = hub.subscribe(namespace, prefix=scope, tenant=principal.tenant if principal is not None else None)
        except TooManySubscribers as exc:
            await self._abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        try:
            while True:
                try:
                    batch = await sub.next_batch()
                except SubscriberOverflow as exc:
                    await self._abort(
                        context, grpc.StatusCode.RESOURCE_EXHAUSTED, f"{exc}: dropped; reconnect and resync"
                    )
                for sequence, event in batch:  # numbered per subscriber: 1, 2, 3, ... without gaps
                    yield pb.KVEvent(
                        sequence=sequence,
                        timestamp_s=event.timestamp_s,
                        kind=int(event.kind),
                        tier=int(event.tier),
                        namespace=event.namespace.removeprefix(scope),
                        keys=event.keys,
                    )
        finally:
            hub.unsubscribe(sub)

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        arena = self._stack.ram.arena_stats()
        tiers = [
            pb.TierStats(tier=int(s.kind), **{f.name: getattr(s, f.name) for f in _TIER_STATS_FIELDS})
            for s in self._stack.stats()
        ]
        return pb.StatsResponse(
            version=self._version,
            uptime_s=time.monotonic() - self._started,
            tiers=tiers,
            put_checksum_failures=self._counters.put_checksum_failures,
            failed_requests=self._counters.failed_requests,
            max_block_bytes=self._limits.max_block_bytes,
            max_keys_per_request=self._limits.max_keys_per_request,
            shm_bytes_received=self._counters.shm_bytes_received,
            shm_bytes_sent=self._counters.shm_bytes_sent,
            inflight_bytes=self.budget.used,
            inflight_peak_bytes=self.budget.peak,
            inflight_refused=self.budget.refused,
            cut_off_calls=self.cut_off,
            inplace_bytes_received=self.inplace_bytes_received,
            inplace_bytes_leased=self.inplace_bytes_leased,
            arena_leases=arena["leases"],
            arena_reservations=arena["reservations"],
            arena_leases_expired=arena["leases_expired"],
            arena_reservations_reclaimed=arena["reservations_reclaimed"],
        )

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        return pb.InfoResponse(
            version=self._version,
            max_block_bytes=self._limits.max_block_bytes,
            max_keys_per_request=self._limits.max_keys_per_request,
            shm_dir=str(self._shm.path) if self._shm is not None else "",
            block_parts=True,
            arena_path=self._stack.ram.region.path,
            arena_bytes=self._stack.ram.region.size if self._stack.ram.region.path else 0,
        )
