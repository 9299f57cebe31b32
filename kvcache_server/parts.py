"""Reassembling blocks that a Put stream sends in parts (Block.more, Block.total_length).

A client may send a large block as several Blocks, in one or more messages, so
that no gRPC message holds all of it:

    Block{key, data=part 0, more=true, total_length=N}   first part: the key and the whole length
    Block{data=part 1, more=true}                        continuations: no key, no total_length
    ...
    Block{data=part k}                                   the last part: more=false

The assembler appends each part to one buffer that grows as the bytes arrive (N
is checked against max_block_bytes, but nothing is allocated for it ahead of the
data: a first part that announces 64 MiB and sends 100 bytes holds 100 bytes),
counting every part against the call's share of the in-flight budget
(kvcache_server.budget) before appending it, and hands out the whole block after
its last part; the service then verifies and stores it like any other. Growing a
large bytearray reallocates in place (glibc moves such buffers with mremap, no
copy). Anything else is refused with INVALID_ARGUMENT or RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from kvcache_core.blockwire import BlockPart
from kvcache_server.budget import Holding
from kvcache_server.refusal import Refused

Buffer = bytes | bytearray | memoryview


@dataclass(slots=True)
class _Pending:
    index: int  # the block's position in the stream, for messages
    key: bytes
    buf: bytearray
    total: int  # the length the first part announced


class BlockAssembler:
    """Follows one Put stream: passes whole blocks through and puts blocks sent in parts together."""

    def __init__(self, max_block_bytes: int, holding: Holding) -> None:
        self._max_block_bytes = max_block_bytes
        self._holding = holding
        self._pending: _Pending | None = None

    @property
    def assembling(self) -> bool:
        """Whether a block sent in parts is incomplete (the next Block continues it)."""
        return self._pending is not None

    async def feed(self, index: int, key: bytes, data: Buffer | BlockPart) -> tuple[bytes, Buffer] | None:
        """Takes the stream's next Block (`index`: the position the next whole block will have).

        Returns:
            (key, block) when a whole block is complete (a plain one, or the last part of one in
            parts), None when the Block was a part of one still incomplete.

        A part's bytes are counted against the call's holding before they are appended (they stay
        counted after the block is handed out: the caller releases them once the block is stored).

        Raises:
            Refused: a part out of place, lengths that disagree, a block over max_block_bytes, no
                room in the in-flight budget.
        """
        if self._pending is not None:
            return await self._continue(self._pending, key, data)
        if isinstance(data, BlockPart):
            self._pending = await self._start(index, key, data)
            return None
        return key, data

    def finish(self) -> None:
        """Call at the end of the stream.

        Raises:
            Refused: the stream ended inside a block sent in parts.
        """
        if self._pending is not None:
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT, f"Put ended inside block {self._pending.index} (sent in parts)"
            )

    async def _start(self, index: int, key: bytes, part: BlockPart) -> _Pending:
        first = part.data
        assert not isinstance(first, tuple)  # decoded parts are one buffer
        total = part.total_length
        where = f"block {index}"
        if not part.more:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: total_length is set but more is not")
        if total == 0 or len(first) > total:
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{where}: the first part of a block in parts needs total_length >= its {len(first)} bytes, "
                f"got {total}",
            )
        if total > self._max_block_bytes:
            raise Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{where}: {total} bytes exceed max_block_bytes={self._max_block_bytes}",
            )
        await self._holding.reserve(len(first), where)
        return _Pending(index, key, bytearray(first), total)

    async def _continue(self, block: _Pending, key: bytes, data: Buffer | BlockPart) -> tuple[bytes, Buffer] | None:
        where = f"block {block.index}"
        more = False
        if isinstance(data, BlockPart):
            if data.total_length:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: a continuation part sets total_length")
            assert not isinstance(data.data, tuple)
            data, more = data.data, data.more
        if key:
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{where}: the Block after a part with more = true continues it and must not carry a key",
            )
        n = len(data)
        if len(block.buf) + n > block.total:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: its parts exceed total_length={block.total}")
        await self._holding.reserve(n, where)
        block.buf += data
        if more:
            return None
        self._pending = None
        if len(block.buf) != block.total:
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{where}: its parts hold {len(block.buf)} bytes, total_length={block.total}",
            )
        return block.key, memoryview(block.buf).toreadonly()
