"""The Put pipeline, stage by stage, the same for every way block bytes arrive (docs/arena.md):

    receive   _next_message (a gRPC message, bounded in time), _decode (bounded in blocks, large
              ones off the event loop), _read_shm_blocks (ranges of a client's shm segment)
    assemble  kvcache_server.parts.BlockAssembler (blocks sent in parts)
    verify    _block -> kvcache_server.pipeline.verify (size, format, key-bound checksum)
    commit    TierStack.put, message by message (the in-place path: pipeline.inplace ->
              TierStack.put_reserved; the same verify stage, in the arena slot)

Mixed into KVCacheService, which provides validation (_namespace, _abort), the stack and the budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import grpc

from kvcache_core.blockwire import BlockPart, PutMessage, ShmRange, data_len, decode_put_request
from kvcache_core.errors import UnknownFormatVersion
from kvcache_core.format import CHECKSUM_AT, FIXED_HEADER_BYTES, BlockFormatError, seal_block
from kvcache_proto import kvcache_pb2 as pb
from kvcache_server.budget import Holding
from kvcache_server.parts import BlockAssembler
from kvcache_server.pipeline.verify import BlockRefused, check_block_for_put, verify_block_for_put
from kvcache_server.procmem import ProcessReads
from kvcache_server.refusal import Refused
from kvcache_server.shm import (
    OFFLOAD_BYTES,
    ShmDirectory,
    ShmError,
    read_ranges,
    read_ranges_in_thread,
    read_ranges_into,
    read_ranges_into_slots_in_lanes,
)
from kvcache_server.stack import PutOutcome, TierPut
from kvcache_server.tiers.ram import Reservation

if TYPE_CHECKING:
    from kvcache_server.budget import MemoryBudget
    from kvcache_server.config import LimitsSection
    from kvcache_server.pipeline import Counters
    from kvcache_server.pipeline.get import BlockSizes
    from kvcache_server.stack import TierStack


_DECODE_OFF_LOOP_BYTES = 256 << 10
_INLINE_DECODE_BLOCKS = 64
"""Put messages at least _DECODE_OFF_LOOP_BYTES large that hold more than _INLINE_DECODE_BLOCKS blocks
are decoded in a worker thread (many small blocks take milliseconds of Python); the rest inline,
where a thread hop would cost more than the parsing (a 1 MiB part parses in microseconds)."""


class _Totals:
    """A Put stream's outcome, summed message by message (each message's blocks commit on their own)."""

    def __init__(self) -> None:
        self.stored = self.rejected = 0
        self.tiers: list[TierPut] = []

    def add(self, outcome: PutOutcome) -> None:
        self.stored += sum(outcome.kept)
        self.rejected += len(outcome.kept) - sum(outcome.kept)
        if not self.tiers:
            self.tiers = outcome.tiers
        else:
            for total, took in zip(self.tiers, outcome.tiers, strict=True):
                total.add(took)

    def response(self, received: int) -> pb.PutResponse:
        return pb.PutResponse(
            stored=self.stored,
            rejected=self.rejected,
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
                for t in self.tiers
            ],
        )


class PutStages:
    """receive -> assemble -> verify -> commit (module docstring)."""

    _stack: TierStack
    _limits: LimitsSection
    _shm: ShmDirectory | None
    _counters: Counters
    budget: MemoryBudget
    block_sizes: BlockSizes

    if TYPE_CHECKING:  # provided by KVCacheService (declared only: a stub here would shadow it)

        async def _abort(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn: ...

        async def _namespace(self, context: grpc.aio.ServicerContext, namespace: str) -> str: ...

        def _open_segment(self, name: str, *, writable: bool) -> tuple[int, int]: ...

        def _process_reads(self, name: str) -> ProcessReads | None: ...

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
        retain_ttl_s = 0.0  # the first message's PutRequest.retain_ttl_s
        index = received = entries = 0
        totals = _Totals()  # what each message's commit kept, summed over the stream
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
                retain_ttl_s = await self._retain_ttl(context, message.retain_ttl_s)
            elif message.namespace and message.namespace != first_namespace:
                await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, "namespace changed within one Put stream")
            elif message.retain_ttl_s and message.retain_ttl_s != retain_ttl_s:
                await self._abort(
                    context, grpc.StatusCode.INVALID_ARGUMENT, "retain_ttl_s changed within one Put stream"
                )
            blocks = message.blocks
            if blocks and not assembler.assembling and all(isinstance(d, ShmRange) for _, d in blocks):
                # Same host: straight from the client's segment into arena slots the server reserves.
                outcome = await self._shm_into_slots(context, index, namespace, blocks, segments, retain_ttl_s)  # type: ignore[arg-type]
                if outcome is not None:
                    index += len(blocks)
                    totals.add(outcome)
                    del message, blocks
                    held.release(message_bytes)
                    continue
            if any(isinstance(d, ShmRange) for _, d in blocks):
                from_shm = sum(d.block_length for _, d in blocks if isinstance(d, ShmRange))
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
                self.block_sizes.saw(namespace, max(len(d) for _, d in complete))
                totals.add(await self._stack.put(namespace, complete, retain_ttl_s=retain_ttl_s))
            # Nothing may keep the message alive past its release (a part is a view into it): the
            # loop's last `data` did, so a stream stopped after one part held it uncounted.
            del message, blocks, complete
            data = whole = None  # type: ignore[assignment]
            # What the RAM tier kept is its capacity's business from now on.
            held.release(message_bytes + assembled)
        try:
            assembler.finish()
        except Refused as exc:
            await self._abort(context, exc.code, exc.message)
        if namespace is None or index == 0:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, "Put carried no blocks")
        return totals.response(received)

    async def _shm_into_slots(
        self,
        context: grpc.aio.ServicerContext,
        first_index: int,
        namespace: str,
        blocks: list[tuple[bytes, ShmRange]],
        segments: dict[str, tuple[int, int]],
        retain_ttl_s: float = 0.0,
    ) -> PutOutcome | None:
        """receive + verify + commit for a message of segment ranges, without a copy of the server's
        heap: each block is read (by the kernel: pread from the client's segment, process_vm_readv from
        its memory) straight into an
        arena slot the server reserved for it, verified there, where no client can write (clients map
        the arena read-only and are never handed a writable slot), and committed without a copy.
        None when RAM has no room for them all now (the caller reads them into memory instead).

        The slots are the server's own: the worker thread that fills them is waited for however the
        call ends (cancelled, a deadline), and only then is whatever was not committed abandoned, so
        no late write can land in a slot that was reused."""
        for i, (_, ref) in enumerate(blocks):
            await self._segment_of(context, first_index + i, ref, segments)
        if not all(ref.block_length for _, ref in blocks):
            return None
        process = await self._reads_of(context, blocks, segments)
        # Out of a client process's memory: on its own threads, and only STAGE_CALLS of its puts at
        # once hold arena room for it (a client that stalls its reads stalls only itself).
        async with process.stage if process is not None else contextlib.nullcontext():
            ram = self._stack.ram
            # The slots come after what reserving them evicted is copied out (off the loop when large).
            sizes = [ref.block_length for _, ref in blocks]
            await self._sealed_in_time(context, [ref for _, ref in blocks], process)
            made: list[Reservation] = await self._stack.reserve_many(namespace, sizes) or []
            if not made:
                return None
            reads = [
                (first_index + i, *segments[ref.segment], ref, res.buffer)
                for i, ((_, ref), res) in enumerate(zip(blocks, made, strict=True))
            ]
            try:
                keys = {first_index + i: key for i, (key, _) in enumerate(blocks)}
                sealed = {first_index + i for i, (_, ref) in enumerate(blocks) if ref.seal}
                limit = self._limits.max_block_bytes

                landed: list[int] = []  # bytes read out of the segment, block by block

                def check(where: int, slot: memoryview, fill: Callable[[int, int], None]) -> None:
                    def counted(start: int, end: int) -> None:
                        fill(start, end)
                        landed.append(end - start)

                    # verified (or sealed) where it lies, each piece right after its copy (in cache)
                    check_block_for_put(where, keys[where], slot, limit, counted, seal=where in sealed)

                try:
                    if _off_the_loop(reads):  # one thread hop for reads and checks (a few, for many bytes)
                        await read_ranges_into_slots_in_lanes(reads, check, process.executor if process else None)
                    else:
                        read_ranges_into(reads, check)
                except ShmError as exc:
                    await self._abort(context, exc.code, exc.message)
                except BlockRefused as exc:
                    self._counters.shm_bytes_received += sum(landed)
                    await self._refuse_block(context, exc)
                self._counters.shm_bytes_received += sum(landed)
                await self._sealed_in_time(context, [ref for _, ref in blocks], process)
                self._counters.sealed_blocks += len(sealed)
                self.block_sizes.saw(namespace, max(r.length for r in made))
                outcome = await self._stack.put_reserved(
                    namespace,
                    [(key, res) for (key, _), res in zip(blocks, made, strict=True)],
                    retain_ttl_s=retain_ttl_s,
                )
                # Committed from the server's reservations: what RAM kept (refused blocks are not counted).
                kept = sum(r.length for r, ok in zip(made, outcome.kept, strict=True) if ok)
                self.inplace_bytes_received += kept  # type: ignore[attr-defined]  # one add: PUT_MEM's threads add too
                return outcome
            finally:
                ram.abandon([r.id for r in made])  # what was not committed: refused, cancelled, no room

    async def _reads_of(
        self,
        context: grpc.aio.ServicerContext,
        blocks: Sequence[tuple[bytes, Any]],
        segments: dict[str, tuple[int, int]],
    ) -> ProcessReads | None:
        """The read threads of the registered client process a message's ranges name (None:
        segments only). A process whose registration ended since its name was opened ends the call
        (FAILED_PRECONDITION): its reads never run on the server's shared threads.

        A message names one process at most in practice (its client's); with several, the first's
        threads read them all, which stalls only that client's calls."""
        found: ProcessReads | None = None
        for _, ref in blocks:
            if found is None and isinstance(ref, ShmRange) and segments[ref.segment][1] < 0:
                found = self._process_reads(ref.segment)
                if found is None:
                    await self._abort(
                        context,
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"{ref.segment}: the client process's registration ended; send the bytes another way",
                    )
        return found

    async def _retain_ttl(self, context: grpc.aio.ServicerContext, asked_s: float) -> float:
        """PutRequest.retain_ttl_s, checked: 0 or a positive, finite number of seconds (the stack caps it)."""
        if not (asked_s == 0 or (math.isfinite(asked_s) and asked_s > 0)):
            await self._abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"retain_ttl_s must be 0 (no retention) or a positive, finite number of seconds; got {asked_s!r}",
            )
        return asked_s

    async def _segment_of(
        self, context: grpc.aio.ServicerContext, where: int, ref: ShmRange, segments: dict[str, tuple[int, int]]
    ) -> None:
        """Checks a range's size and opens its segment once per call (into `segments`); a bad one ends the call."""
        if len(ref.head) > MAX_HEAD_BYTES:
            await self._abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"block {where}: {len(ref.head)} bytes of data beside shm; a head is at most {MAX_HEAD_BYTES}",
            )
        if ref.block_length > self._limits.max_block_bytes:
            await self._abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"block {where}: {ref.block_length} bytes exceed max_block_bytes={self._limits.max_block_bytes}",
            )
        try:
            if ref.segment not in segments:
                segments[ref.segment] = self._open_segment(ref.segment, writable=False)
        except ShmError as exc:
            await self._abort(context, exc.code, f"block {where}: {exc.message}")
        if ref.seal:
            if segments[ref.segment][1] >= 0:
                message = f"seal is for ranges of a registered process's memory, not of segment {ref.segment}"
                await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"block {where}: {message}")
            if (message := sealed_head_refusal(ref)) is not None:
                await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"block {where}: {message}")

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
            await self._segment_of(context, where, data, segments)
            reads.append((where, *segments[data.segment], data))
        process = await self._reads_of(context, blocks, segments)

        def seal(where: int, block: memoryview) -> None:  # in the reading thread (sealed: a process's)
            try:
                seal_block(block, blocks[where - first_index][0])
            except (BlockFormatError, UnknownFormatVersion) as exc:
                raise ShmError(grpc.StatusCode.INVALID_ARGUMENT, f"block {where}: malformed block: {exc}") from None

        try:
            async with process.stage if process is not None else contextlib.nullcontext():
                await self._sealed_in_time(context, [ref for *_, ref in reads], process)
                if _off_the_loop(reads):
                    contents = await read_ranges_in_thread(reads, process.executor if process else None, seal)
                else:
                    contents = read_ranges(reads, seal=seal)
        except ShmError as exc:
            await self._abort(context, exc.code, exc.message)
        self._counters.shm_bytes_received += sum(len(c) for c in contents)
        await self._sealed_in_time(context, [ref for *_, ref in reads], process)
        self._counters.sealed_blocks += sum(1 for *_, ref in reads if ref.seal)
        it = iter(contents)
        return [(key, next(it) if isinstance(data, ShmRange) else data) for key, data in blocks]

    async def _sealed_in_time(
        self, context: grpc.aio.ServicerContext, refs: Sequence[ShmRange], process: ProcessReads | None
    ) -> None:
        """Ends the call (ABORTED) when a sealed block of it was read at or after its client's
        seal_before_ns: the client may have given up on the call by then and reused the buffer the
        server read, and a checksum computed over such bytes would bind them to the key. Called once
        every read of the message has ended, before anything of it is stored (and before they start,
        so that a late message is not read for nothing). A client in another time namespace than the
        server's (procmem.same_clock) may not seal: its deadline is in another clock."""
        if (message := seal_refusal(refs, process, self._counters)) is not None:
            await self._abort(context, grpc.StatusCode.ABORTED, message)

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


MAX_HEAD_BYTES = 64 << 10
"""A block that names a shm range may carry at most this many of its first bytes inline (a header)."""


def _off_the_loop(reads: Sequence[tuple[Any, ...]]) -> bool:
    """Whether a message's segment reads go to a worker thread: when they are large, and always when
    any is out of a client process's memory (a read the client's mappings could make slow must never
    hold the event loop). reads: (block index, fd, size, range, ...); size < 0: a process."""
    return any(r[2] < 0 for r in reads) or sum(r[3].block_length for r in reads) >= OFFLOAD_BYTES


def sealed_head_refusal(ref: ShmRange) -> str | None:
    """Why a sealed range may not be taken as it is (its header not inline, or with a checksum), or
    None: the gRPC Put's and the bulk PUT_MEM's check, before anything is reserved."""
    if ref.seal and (len(ref.head) < FIXED_HEADER_BYTES or any(ref.head[CHECKSUM_AT : CHECKSUM_AT + 8])):
        return "a sealed block sends its header inline, with checksum 0"
    return None


def seal_refusal(refs: Iterable[ShmRange], process: ProcessReads | None, counters: Counters | None) -> str | None:
    """Why sealed blocks of `refs` may not be stored now (ABORTED), or None: read at or after their
    client's seal_before_ns (counted in `counters.sealed_too_late`), or from a process whose
    CLOCK_MONOTONIC is not the server's (procmem.same_clock), whose deadline is in another clock.
    The gRPC Put's _sealed_in_time and the bulk PUT_MEM's, before their reads and after them."""
    due = min((ref.seal_before_ns for ref in refs if ref.seal), default=0)
    if due and (process is None or not process.same_clock):
        return "sealed blocks from a process whose CLOCK_MONOTONIC is not the server's (a time namespace)"
    if due and time.monotonic_ns() >= due:
        if counters is not None:
            counters.sealed_too_late += 1
        return "sealed blocks read after the client's seal_before_ns: not stored (the client puts them again)"
    return None
