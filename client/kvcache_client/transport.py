"""The seam where block bytes move between the SDK and the server.

`KVCacheClient` and `AsyncKVCacheClient` do keys, retries, deadlines and
verification; a transport only moves requests and bytes. The gRPC transports
here are the default. A same-host shared-memory path or a bulk socket path
plugs in by implementing the same methods (`put` and `get` carry the bytes;
the rest are small control calls that may stay on gRPC), without changing the
clients' API.

Transports raise grpc.RpcError (or an RPCError subclass) on failure; the
clients map, retry and time out.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Protocol

import grpc

from kvcache_client.blockwire import (
    BlockData,
    BlockPart,
    GetItem,
    PutData,
    ShmRange,
    data_len,
    decode_get_response,
    encode_put_request,
    split_block,
)
from kvcache_client.errors import KVCacheError
from kvcache_client.shm import Segment, ShmLink, resolve
from kvcache_proto import kvcache_pb2 as pb
from kvcache_proto import kvcache_pb2_grpc as pb_grpc

TIER_NAMES = {pb.TIER_RAM: "ram", pb.TIER_REDIS: "redis", pb.TIER_S3: "s3"}

DEFAULT_MESSAGE_BYTES = 4 << 20
"""Target size of one Put message: small blocks are packed up to it, larger ones go one per message."""

DEFAULT_PART_BYTES = 1 << 20
"""Size of the parts a large block travels in over gRPC (puts: when the server accepts parts)."""

PARTS_ABOVE_BYTES = 4 << 20
"""Blocks larger than this travel in parts, both ways (the server applies the same rule to gets).
Measured here: 16 MiB blocks in 1 MiB messages took about two thirds of the time of one 16 MiB
message for puts, and about half for gets in a long-running client, although the client joins the
parts (one copy); 2 MiB blocks gained nothing."""


@dataclass(frozen=True, slots=True)
class LookupResult:
    """The longest stored prefix of a list of keys.

    Attributes:
        prefix_length: keys[:prefix_length] are stored.
        tiers: For each of those keys, the fastest tier holding it ("ram", "redis", "s3").
    """

    prefix_length: int
    tiers: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class PutResult:
    """What a put_many stored.

    Attributes:
        stored: Blocks the server now holds.
        rejected: Valid blocks the server could not keep (larger than its RAM tier).
        bytes_sent: Block bytes sent, headers included.
    """

    stored: int
    rejected: int
    bytes_sent: int


@dataclass(frozen=True, slots=True)
class TierInfo:
    """One tier's counters, as reported by Stats (field meanings: kvcache.v1.TierStats)."""

    name: str
    used_bytes: int
    capacity_bytes: int
    blocks: int
    hits: int
    misses: int
    puts: int
    evictions: int
    rejected: int
    checksum_failures: int
    errors: int
    healthy: bool
    promotions: int = 0
    demotions: int = 0
    write_errors: int = 0
    queue_depth: int = 0
    queue_bytes: int = 0
    queue_dropped: int = 0
    breaker: str = "closed"
    skipped: int = 0
    bytes_written: int = 0
    bytes_read: int = 0


_TIER_INFO_FIELDS = [f.name for f in fields(TierInfo)]


@dataclass(frozen=True, slots=True)
class ServerStats:
    """The server's Stats answer."""

    version: str
    uptime_s: float
    put_checksum_failures: int
    failed_requests: int
    max_block_bytes: int
    max_keys_per_request: int
    tiers: tuple[TierInfo, ...] = field(default_factory=tuple)
    shm_bytes_received: int = 0
    shm_bytes_sent: int = 0

    def tier(self, name: str) -> TierInfo:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(name)


Metadata = Sequence[tuple[str, str]]
"""gRPC metadata sent with every call (the authorization header)."""

Fetched = tuple[memoryview | bytes, str]
"""A block as received (a view into the received message) and the name of the tier that served it."""


class Transport(Protocol):
    """What KVCacheClient needs from a transport (blocking calls)."""

    def lookup(self, namespace: str, keys: Sequence[bytes], timeout_s: float) -> LookupResult: ...

    def put(self, namespace: str, items: Sequence[tuple[bytes, BlockData]], timeout_s: float) -> PutResult: ...

    def get(
        self, namespace: str, keys: Sequence[bytes], prefix_only: bool, timeout_s: float
    ) -> list[Fetched | None]: ...

    def delete(self, namespace: str, keys: Sequence[bytes], timeout_s: float) -> int: ...

    def stats(self, timeout_s: float) -> ServerStats: ...

    def close(self) -> None: ...


class AsyncTransport(Protocol):
    """What AsyncKVCacheClient needs from a transport (coroutines)."""

    async def lookup(self, namespace: str, keys: Sequence[bytes], timeout_s: float) -> LookupResult: ...

    async def put(self, namespace: str, items: Sequence[tuple[bytes, BlockData]], timeout_s: float) -> PutResult: ...

    async def get(
        self, namespace: str, keys: Sequence[bytes], prefix_only: bool, timeout_s: float
    ) -> list[Fetched | None]: ...

    async def delete(self, namespace: str, keys: Sequence[bytes], timeout_s: float) -> int: ...

    async def stats(self, timeout_s: float) -> ServerStats: ...

    async def close(self) -> None: ...


# -- message building and parsing, shared by both gRPC transports ---------------------------------


_SHM_REF_BYTES = 64
"""What a block sent as a ShmRange adds to a Put message, about."""


def put_messages(
    namespace: str,
    items: Sequence[tuple[bytes, PutData]],
    message_bytes: int = DEFAULT_MESSAGE_BYTES,
    part_bytes: int = 0,
) -> Iterator[bytes]:
    """Encoded PutRequest messages of about `message_bytes` each (the namespace in the first).

    Encoded with blockwire: each block's bytes are copied once, into the message (blocks given as
    ShmRange travel as their few bytes of reference). With `part_bytes`, a block larger than
    PARTS_ABOVE_BYTES travels in parts of `part_bytes`, one message each (Block.more; the server must
    accept parts).
    Messages are built as gRPC asks for them, so building one overlaps sending the one before.
    """
    batch: list[tuple[bytes, PutData]] = []
    size = 0
    first = True
    for key, data in items:
        n = _SHM_REF_BYTES if isinstance(data, ShmRange) else data_len(data)
        if part_bytes and n > max(part_bytes, PARTS_ABOVE_BYTES) and not isinstance(data, ShmRange | BlockPart):
            if batch:
                yield encode_put_request(namespace if first else "", batch)
                first, batch, size = False, [], 0
            for i, part in enumerate(split_block(data, part_bytes)):
                yield encode_put_request(namespace if first else "", [(key if i == 0 else b"", part)])
                first = False
            continue
        if batch and size + n > message_bytes:
            yield encode_put_request(namespace if first else "", batch)
            first, batch, size = False, [], 0
        batch.append((key, data))
        size += n
    if batch or first:
        yield encode_put_request(namespace if first else "", batch)


def lookup_result(response: pb.LookupResponse) -> LookupResult:
    return LookupResult(response.prefix_length, tuple(TIER_NAMES.get(t, "unknown") for t in response.tiers))


def put_result(response: pb.PutResponse) -> PutResult:
    return PutResult(response.stored, response.rejected, response.bytes_received)


class GetCollector:
    """Gathers streamed GetResponse items into a list indexed like the request's keys."""

    def __init__(self, n: int) -> None:
        self.out: list[Fetched | None] = [None] * n
        self._in_segment: list[tuple[int, ShmRange, str]] = []
        self._parts: tuple[int, list[memoryview | bytes], str] | None = None  # a block arriving in parts

    def add(self, items: list[GetItem]) -> None:
        for item in items:
            if item.index >= len(self.out):
                raise KVCacheError(f"server sent item index {item.index} for {len(self.out)} keys")
            if self._parts is not None:
                index, chunks, tier = self._parts
                if item.index != index or not item.found or item.shm is not None:
                    raise KVCacheError(f"server interrupted block {index}, sent in parts, with another item")
                chunks.append(item.data)
                if not item.more:  # the last part: one copy joins them
                    self.out[index] = (b"".join(chunks), tier)
                    self._parts = None
                continue
            if item.more:
                if not item.found or item.shm is not None:
                    raise KVCacheError(f"server sent a part of block {item.index} without data")
                self._parts = (item.index, [item.data], TIER_NAMES.get(item.tier, "unknown"))
                continue
            if item.found:
                tier = TIER_NAMES.get(item.tier, "unknown")
                if item.shm is not None:
                    self._in_segment.append((item.index, item.shm, tier))
                else:
                    self.out[item.index] = (item.data, tier)

    @property
    def segment_bytes(self) -> int:
        """Bytes of the blocks the server wrote into the request's segment."""
        return sum(ref.length for _, ref, _ in self._in_segment)

    def resolve(self, segment: Segment | None) -> list[Fetched | None]:
        """The result, with blocks the server wrote into `segment` as views of its mapping."""
        if self._parts is not None:
            raise KVCacheError(f"Get stream ended inside block {self._parts[0]}, sent in parts")
        if not self._in_segment:
            return self.out
        if segment is None:
            raise KVCacheError("server sent a shared-memory range for a request without a segment")
        view = segment.map(max(ref.offset + ref.length for _, ref, _ in self._in_segment))
        for index, ref, tier in self._in_segment:
            if ref.segment != segment.name:
                raise KVCacheError(f"server named segment {ref.segment!r}, not this request's {segment.name!r}")
            try:
                self.out[index] = (resolve(view, ref), tier)
            except ValueError as exc:
                raise KVCacheError(str(exc)) from None
        return self.out


def shm_get_request(
    namespace: str, keys: Sequence[bytes], prefix_only: bool, segment: Segment | None, link: ShmLink
) -> pb.GetRequest:
    request = pb.GetRequest(namespace=namespace, keys=keys, prefix_only=prefix_only, accept_parts=True)
    if segment is not None:
        # The segment is sparse: capacity costs nothing until the server writes.
        request.shm.segment = segment.name
        request.shm.capacity = len(keys) * max(link.max_block_bytes, 1)
    return request


def shm_fallback(exc: grpc.RpcError, link: ShmLink) -> bool:
    """True when an shm call failed because the server cannot reach the segment: the path is
    switched off and the caller redoes the call inline."""
    if exc.code() is not grpc.StatusCode.FAILED_PRECONDITION:
        return False
    link.off(exc.details() or "the server cannot use shared memory")
    return True


def apply_info(link: ShmLink, info: pb.InfoResponse | None) -> int:
    """Takes the server's Info answer (None: the server has no Info call); returns the part size
    for large blocks (0: send them whole)."""
    if info is None:
        link.off("the server has no Info call (it predates the shared-memory path)")
        return 0
    if link.needs_info:
        link.configure(info.shm_dir, info.max_block_bytes)
    return DEFAULT_PART_BYTES if info.block_parts else 0


def server_stats(r: pb.StatsResponse) -> ServerStats:
    return ServerStats(
        version=r.version,
        uptime_s=r.uptime_s,
        put_checksum_failures=r.put_checksum_failures,
        failed_requests=r.failed_requests,
        max_block_bytes=r.max_block_bytes,
        max_keys_per_request=r.max_keys_per_request,
        shm_bytes_received=r.shm_bytes_received,
        shm_bytes_sent=r.shm_bytes_sent,
        tiers=tuple(TierInfo(**{name: getattr(t, name) for name in _TIER_INFO_FIELDS}) for t in r.tiers),
    )


def channel_options(max_message_bytes: int) -> list[tuple[str, int | str]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


# -- gRPC transports ---------------------------------------------------------------------------


_PUT = "/kvcache.v1.KVCache/Put"
_GET = "/kvcache.v1.KVCache/Get"


def _identity(data: bytes) -> bytes:
    return data


class GrpcTransport:
    """Blocking gRPC transport over one channel."""

    def __init__(
        self,
        channel: grpc.Channel,
        *,
        message_bytes: int = DEFAULT_MESSAGE_BYTES,
        metadata: Metadata = (),
        shm: bool = True,
    ) -> None:
        self._channel = channel
        self._md = tuple(metadata)
        self._stub = pb_grpc.KVCacheStub(channel)
        # Put and Get carry block bytes: blockwire instead of the generated classes (same wire format).
        self._put = channel.stream_unary(_PUT, _identity, pb.PutResponse.FromString)
        self._get = channel.unary_stream(_GET, pb.GetRequest.SerializeToString, decode_get_response)
        self._message_bytes = message_bytes
        self.shm = ShmLink(shm)
        self.part_bytes = 0  # set from the server's Info
        self._info_done = False

    def _check_info(self, timeout_s: float) -> None:
        """Asks the server once what it accepts (shm directory, blocks in parts)."""
        if self._info_done:
            return
        try:
            info = self._stub.Info(pb.InfoRequest(), timeout=timeout_s, metadata=self._md)
        except grpc.RpcError as exc:
            if exc.code() is not grpc.StatusCode.UNIMPLEMENTED:
                raise
            info = None
        self.part_bytes = apply_info(self.shm, info)
        self._info_done = True

    def lookup(self, namespace: str, keys: Sequence[bytes], timeout_s: float) -> LookupResult:
        return lookup_result(
            self._stub.Lookup(pb.LookupRequest(namespace=namespace, keys=keys), timeout=timeout_s, metadata=self._md)
        )

    def put(self, namespace: str, items: Sequence[tuple[bytes, BlockData]], timeout_s: float) -> PutResult:
        self._check_info(timeout_s)
        segment = self.shm.put_segment(sum(data_len(d) for _, d in items))
        if segment is not None:
            try:
                refs = segment.write_blocks(items)
                try:
                    return self._send_put(namespace, refs, timeout_s)
                except grpc.RpcError as exc:
                    if not shm_fallback(exc, self.shm):
                        raise
            finally:
                self.shm.release(segment)
        return self._send_put(namespace, items, timeout_s)

    def _send_put(self, namespace: str, items: Sequence[tuple[bytes, PutData]], timeout_s: float) -> PutResult:
        messages = put_messages(namespace, items, self._message_bytes, self.part_bytes)
        return put_result(self._put(messages, timeout=timeout_s, metadata=self._md))

    def get(self, namespace: str, keys: Sequence[bytes], prefix_only: bool, timeout_s: float) -> list[Fetched | None]:
        self._check_info(timeout_s)
        segment = self.shm.get_segment()
        if segment is not None:
            try:
                return self._fetch(namespace, keys, prefix_only, timeout_s, segment)
            except grpc.RpcError as exc:
                if not shm_fallback(exc, self.shm):
                    raise
            finally:
                self.shm.release(segment)
        return self._fetch(namespace, keys, prefix_only, timeout_s, None)

    def _fetch(
        self, namespace: str, keys: Sequence[bytes], prefix_only: bool, timeout_s: float, segment: Segment | None
    ) -> list[Fetched | None]:
        collector = GetCollector(len(keys))
        request = shm_get_request(namespace, keys, prefix_only, segment, self.shm)
        for items in self._get(request, timeout=timeout_s, metadata=self._md):
            collector.add(items)
        return collector.resolve(segment)

    def delete(self, namespace: str, keys: Sequence[bytes], timeout_s: float) -> int:
        return self._stub.Delete(
            pb.DeleteRequest(namespace=namespace, keys=keys), timeout=timeout_s, metadata=self._md
        ).deleted

    def stats(self, timeout_s: float) -> ServerStats:
        return server_stats(self._stub.Stats(pb.StatsRequest(), timeout=timeout_s, metadata=self._md))

    def close(self) -> None:
        self.shm.close()
        self._channel.close()


_OFFLOAD_BYTES = 1 << 20
"""Async puts at least this large copy into their segment in a worker thread."""


async def _aiter(requests: Iterable[bytes]) -> AsyncIterator[bytes]:
    for request in requests:
        yield request


class AsyncGrpcTransport:
    """asyncio gRPC transport over one grpc.aio channel."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        *,
        message_bytes: int = DEFAULT_MESSAGE_BYTES,
        metadata: Metadata = (),
        shm: bool = True,
    ) -> None:
        self._channel = channel
        self._md = tuple(metadata)
        self._stub = pb_grpc.KVCacheStub(channel)
        self._put = channel.stream_unary(_PUT, _identity, pb.PutResponse.FromString)
        self._get = channel.unary_stream(_GET, pb.GetRequest.SerializeToString, decode_get_response)
        self._message_bytes = message_bytes
        self.shm = ShmLink(shm)
        self.part_bytes = 0  # set from the server's Info
        self._info_done = False

    async def _check_info(self, timeout_s: float) -> None:
        """Asks the server once what it accepts (shm directory, blocks in parts)."""
        if self._info_done:
            return
        try:
            info = await self._stub.Info(pb.InfoRequest(), timeout=timeout_s, metadata=self._md)
        except grpc.RpcError as exc:
            if exc.code() is not grpc.StatusCode.UNIMPLEMENTED:
                raise
            info = None
        self.part_bytes = apply_info(self.shm, info)
        self._info_done = True

    async def lookup(self, namespace: str, keys: Sequence[bytes], timeout_s: float) -> LookupResult:
        request = pb.LookupRequest(namespace=namespace, keys=keys)
        return lookup_result(await self._stub.Lookup(request, timeout=timeout_s, metadata=self._md))

    async def put(self, namespace: str, items: Sequence[tuple[bytes, BlockData]], timeout_s: float) -> PutResult:
        await self._check_info(timeout_s)
        nbytes = sum(data_len(d) for _, d in items)
        segment = self.shm.put_segment(nbytes)
        if segment is not None:
            try:
                # Copying into the segment drops the GIL: off the event loop when it is large.
                big = nbytes >= _OFFLOAD_BYTES
                refs = await asyncio.to_thread(segment.write_blocks, items) if big else segment.write_blocks(items)
                try:
                    return await self._send_put(namespace, refs, timeout_s)
                except grpc.RpcError as exc:
                    if not shm_fallback(exc, self.shm):
                        raise
            finally:
                self.shm.release(segment)
        return await self._send_put(namespace, items, timeout_s)

    async def _send_put(self, namespace: str, items: Sequence[tuple[bytes, PutData]], timeout_s: float) -> PutResult:
        messages = _aiter(put_messages(namespace, items, self._message_bytes, self.part_bytes))
        return put_result(await self._put(messages, timeout=timeout_s, metadata=self._md))

    async def get(
        self, namespace: str, keys: Sequence[bytes], prefix_only: bool, timeout_s: float
    ) -> list[Fetched | None]:
        await self._check_info(timeout_s)
        segment = self.shm.get_segment()
        if segment is not None:
            try:
                return await self._fetch(namespace, keys, prefix_only, timeout_s, segment)
            except grpc.RpcError as exc:
                if not shm_fallback(exc, self.shm):
                    raise
            finally:
                self.shm.release(segment)
        return await self._fetch(namespace, keys, prefix_only, timeout_s, None)

    async def _fetch(
        self, namespace: str, keys: Sequence[bytes], prefix_only: bool, timeout_s: float, segment: Segment | None
    ) -> list[Fetched | None]:
        collector = GetCollector(len(keys))
        request = shm_get_request(namespace, keys, prefix_only, segment, self.shm)
        async for items in self._get(request, timeout=timeout_s, metadata=self._md):
            collector.add(items)
        if collector.segment_bytes >= _OFFLOAD_BYTES:  # mapping (and populating) it is off the event loop
            return await asyncio.to_thread(collector.resolve, segment)
        return collector.resolve(segment)

    async def delete(self, namespace: str, keys: Sequence[bytes], timeout_s: float) -> int:
        response = await self._stub.Delete(
            pb.DeleteRequest(namespace=namespace, keys=keys), timeout=timeout_s, metadata=self._md
        )
        return response.deleted

    async def stats(self, timeout_s: float) -> ServerStats:
        return server_stats(await self._stub.Stats(pb.StatsRequest(), timeout=timeout_s, metadata=self._md))

    async def close(self) -> None:
        self.shm.close()
        await self._channel.close()
