"""Reassembling blocks that a Put stream sends in parts (Block.more, Block.total_length).

A client may send a large block as several Blocks, in one or more messages, so
that no gRPC message holds all of it:

    Block{key, data=part 0, more=true, total_length=N}   first part: the key and the whole length
    Block{data=part 1, more=true}                        continuations: no key, no total_length
    ...
    Block{data=part k}                                   the last part: more=false

The assembler copies each part into one buffer of exactly N bytes (N is checked
against max_block_bytes before anything is allocated) and hands out the whole
block after its last part; the service then verifies and stores it like any
other. Anything else is refused with INVALID_ARGUMENT or RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from kvcache_core.blockwire import BlockPart
from kvcache_server.refusal import Refused

Buffer = bytes | bytearray | memoryview


@dataclass(slots=True)
class _Pending:
    index: int  # the block's position in the stream, for messages
    key: bytes
    buf: bytearray
    filled: int


class BlockAssembler:
    """Follows one Put stream: passes whole blocks through and puts blocks sent in parts together."""

    def __init__(self, max_block_bytes: int) -> None:
        self._max_block_bytes = max_block_bytes
        self._pending: _Pending | None = None

    def feed(self, index: int, key: bytes, data: Buffer | BlockPart) -> tuple[bytes, Buffer] | None:
        """Takes the stream's next Block (`index`: the position the next whole block will have).

        Returns:
            (key, block) when a whole block is complete (a plain one, or the last part of one in
            parts), None when the Block was a part of one still incomplete.

        Raises:
            Refused: a part out of place, lengths that disagree, a block over max_block_bytes.
        """
        if self._pending is not None:
            return self._continue(self._pending, key, data)
        if isinstance(data, BlockPart):
            self._pending = self._start(index, key, data)
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

    def _start(self, index: int, key: bytes, part: BlockPart) -> _Pending:
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
        buf = bytearray(total)
        buf[: len(first)] = first
        return _Pending(index, key, buf, len(first))

    def _continue(self, block: _Pending, key: bytes, data: Buffer | BlockPart) -> tuple[bytes, Buffer] | None:
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
        if block.filled + n > len(block.buf):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: its parts exceed total_length={len(block.buf)}")
        block.buf[block.filled : block.filled + n] = data
        block.filled += n
        if more:
            return None
        self._pending = None
        if block.filled != len(block.buf):
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{where}: its parts hold {block.filled} bytes, total_length={len(block.buf)}",
            )
        return block.key, memoryview(block.buf).toreadonly()
