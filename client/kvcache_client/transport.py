"""The seam where block bytes move between the SDK and the server.

`KVCacheClient` and `AsyncKVCacheClient` do keys, retries, deadlines and
verification; a transport only moves requests and bytes. The gRPC transports
here are the default; they move block bytes through shared memory when the
server is on this host (kvcache_client.shm) and over gRPC otherwise. Another
data path (a bulk socket, RDMA) plugs in by implementing the same methods
(`put` and `get` carry the bytes; the rest are small control calls), without
changing the clients' API. Message building and parsing, shared by both
transports, is in kvcache_client.messages.

Transports raise grpc.RpcError (or an RPCError subclass) on failure; the
clients map, retry and time out.

Longer than the project's ~500-line module guideline: the blocking and the asyncio transport are
two faces of the same calls, kept side by side so a change to one is seen beside the other; what
they decide is written once, in kvcache_client.messages (through_segment, through_process) and
kvcache_client.sealing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from kvcache_client.arena import ArenaLink, InPlaceCalls, Leased
from kvcache_client.arena_aio import AsyncInPlaceCalls
from kvcache_client.bufpool import BufferPool
from kvcache_client.messages import (
    DEFAULT_MESSAGE_BYTES,
    PROCESS_MESSAGE_BYTES,
    GetCollector,
    LandingCollector,
    apply_info,
    lookup_result,
    prefetch_result,
    put_messages,
    put_result,
    server_stats,
    shm_get_request,
    through_process,
    through_segment,
)
from kvcache_client.presence import PresenceLink
from kvcache_client.results import Fetched, LookupResult, PrefetchResult, PutResult, ServerStats
from kvcache_client.sealing import (
    MIN_FALLBACK_S,
    SERVER_ENDED,
    encoded_off_loop,
    payload_items,
    sealed_ranges,
    sealed_refused,
    wait_out,
)
from kvcache_client.shm import Segment, ShmLink, env_allows_shm, run_to_end
from kvcache_client.steps import arun, run
from kvcache_core.blockwire import (
    BlockData,
    Buffer,
    PutData,
    ShmRange,
    data_len,
    decode_get_response,
    encode_put_request,
)
from kvcache_proto import kvcache_pb2 as pb
from kvcache_proto import kvcache_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

Metadata = Sequence[tuple[str, str]]
"""gRPC metadata sent with every call (the authorization header)."""

if TYPE_CHECKING:
    from kvcache_client.bulkconn import Received


class Transport(Protocol):
    """What KVCacheClient needs from a transport (blocking calls)."""

    def lookup(self, namespace: str, keys: Sequence[bytes], timeout_s: float) -> LookupResult: ...

    def put(self, namespace: str, items: Sequence[tuple[bytes, BlockData]], timeout_s: float) -> PutResult:
        """Transports that carry PutRequest.retain_ttl_s take it as a keyword `retain_ttl_s`."""
        ...

    def get(
        self, namespace: str, keys: Sequence[bytes], prefix_only: bool, timeout_s: float
    ) -> list[Fetched | None]: ...

    def delete(self, namespace: str, keys: Sequence[bytes], timeout_s: float) -> int: ...

    def stats(self, timeout_s: float) -> ServerStats: ...

    def close(self) -> None: ...


class AsyncTransport(Protocol):
    """What AsyncKVCacheClient needs from a transport (coroutines)."""

    async def lookup(self, namespace: str, keys: Sequence[bytes], timeout_s: float) -> LookupResult: ...

    async def put(self, namespace: str, items: Sequence[tuple[bytes, BlockData]], timeout_s: float) -> PutResult:
        """Transports that carry PutRequest.retain_ttl_s take it as a keyword `retain_ttl_s`."""
        ...

    async def get(
        self, namespace: str, keys: Sequence[bytes], prefix_only: bool, timeout_s: float
    ) -> list[Fetched | None]: ...

    async def delete(self, namespace: str, keys: Sequence[bytes], timeout_s: float) -> int: ...

    async def stats(self, timeout_s: float) -> ServerStats: ...

    async def close(self) -> None: ...


# -- gRPC transports ---------------------------------------------------------------------------


_PUT = "/kvcache.v1.KVCache/Put"
_GET = "/kvcache.v1.KVCache/Get"


def _identity(data: bytes) -> bytes:
    return data


class _Channel:
    """What both transports hold of their channel (a grpc.Channel or a grpc.aio.Channel: the same
    calls, blocking or awaited) and of the server's Info answer."""

    def __init__(
        self,
        channel: Any,
        message_bytes: int,
        metadata: Metadata,
        shm: bool,
        buffers: BufferPool | None,
        presence: bool = True,
    ) -> None:
        self._channel = channel
        self.buffers = BufferPool() if buffers is None else buffers  # where blocks leased out of the arena land
        self._md = tuple(metadata)
        self._stub = pb_grpc.KVCacheStub(channel)
        # Put and Get carry block bytes: blockwire instead of the generated classes (same wire format).
        self._put = channel.stream_unary(_PUT, _identity, pb.PutResponse.FromString)
        self._get = channel.unary_stream(_GET, pb.GetRequest.SerializeToString, decode_get_response)
        self._message_bytes = message_bytes
        self.shm = ShmLink(shm)
        self.arena = ArenaLink(shm and env_allows_shm())
        # Lookups of blocks the server's RAM holds without an RPC (kvcache_client.presence).
        self.presence = PresenceLink(presence and shm and env_allows_shm())
        self.part_bytes = 0  # set from the server's Info
        self.info_response: pb.InfoResponse | None = None
        self._info_done = False

    def _take_info(self, info: pb.InfoResponse | None) -> None:
        """Takes the server's Info answer (None: it has no Info call): the shm directory or segment
        socket, blocks in parts, the arena. Blocking (a socket connect, mapping a large arena, which
        populates it): the asyncio transport runs it in a worker thread."""
        self.part_bytes = apply_info(self.shm, info)
        self.info_response = info
        if info is None:
            self.arena.off("the server has no Info call")
            self.presence.configure("", 0)
        else:
            self.shm.handoff_from(info.shm_socket, info.server_uid, self._md)  # another Unix user's path
            self.shm.process_from(info.shm_socket, info.server_uid, self._md)  # puts out of our own memory
            self.arena.configure(info.arena_path, info.arena_bytes, info.max_keys_per_request, info.max_block_bytes)
            self.presence.configure(info.presence_path, info.instance_id, info.max_keys_per_request)
        self._info_done = True

    def unmap(self) -> None:
        """Lets go of the server's arena and presence index (the client closes): their mappings end
        once no view handed out holds them, instead of when the client object is collected."""
        self.arena.off("the client is closed")
        self.presence.close()


def _info_or_none(exc: grpc.RpcError) -> None:
    """An Info call that failed: None for a server without Info (UNIMPLEMENTED), else the error."""
    if exc.code() is not grpc.StatusCode.UNIMPLEMENTED:
        raise exc


class GrpcTransport(_Channel):
    """Blocking gRPC transport over one channel."""

    def __init__(
        self,
        channel: grpc.Channel,
        *,
        message_bytes: int = DEFAULT_MESSAGE_BYTES,
        metadata: Metadata = (),
        shm: bool = True,
        buffers: BufferPool | None = None,
        presence: bool = True,
    ) -> None:
        super().__init__(channel, message_bytes, metadata, shm, buffers, presence)
        self._inplace = InPlaceCalls(self._stub, self._md, self.arena, self._get_through_segment, self.buffers)

    def _check_info(self, timeout_s: float) -> None:
        """Asks the server once what it accepts (shm directory, blocks in parts, its arena)."""
        if self._info_done:
            return
        info = None
        try:
            info = self._stub.Info(pb.InfoRequest(), timeout=timeout_s, metadata=self._md)
        except grpc.RpcError as exc:
            _info_or_none(exc)
        self._take_info(info)

    def info(self, timeout_s: float, *, refresh: bool = False) -> pb.InfoResponse | None:
        """The server's Info answer, asked once (again with `refresh`); None when it has no Info call."""
        if refresh:
            self._info_done = False
        self._check_info(timeout_s)
        return self.info_response

    def lookup(self, namespace: str, keys: Sequence[bytes], timeout_s: float) -> LookupResult:
        return lookup_result(
            self._stub.Lookup(pb.LookupRequest(namespace=namespace, keys=keys), timeout=timeout_s, metadata=self._md)
        )

    def put(
        self, namespace: str, items: Sequence[tuple[bytes, BlockData]], timeout_s: float, *, retain_ttl_s: float = 0.0
    ) -> PutResult:
        """Through a segment of this client's own on the server's host (the server reads it straight
        into arena slots), inline elsewhere: a client never writes into the server's arena."""
        self._check_info(timeout_s)
        return run(
            through_process(
                self.shm,
                items,
                lambda refs: self._send_put(namespace, refs, timeout_s, retain_ttl_s, PROCESS_MESSAGE_BYTES),
                lambda: self._put_through_segment(namespace, items, timeout_s, retain_ttl_s),
            )
        )

    def put_payloads(
        self,
        namespace: str,
        keys: Sequence[bytes],
        payloads: Sequence[Buffer],
        timeout_s: float,
        *,
        retain_ttl_s: float = 0.0,
        headers: Sequence[bytes] | None = None,
    ) -> PutResult:
        """put() of format.encode_bytes_parts(keys, payloads), except that a same-host put out of this
        process's memory leaves the checksums to the server, which computes them as it reads the
        bytes (ShmRange.seal_before_ns): no pass over them here. A sealed put the server refuses
        in a way this avoids (kvcache_client.sealing.sealed_refused) is put again so, within what
        is left of `timeout_s`."""
        start = time.monotonic()
        self._check_info(timeout_s)
        sealed = sealed_ranges(self.shm, keys, payloads, timeout_s - (time.monotonic() - start), headers)
        if sealed is not None:
            try:
                return self._send_put(namespace, sealed.refs, sealed.window_s, retain_ttl_s, PROCESS_MESSAGE_BYTES)
            except grpc.RpcError as exc:
                if exc.code() not in SERVER_ENDED:  # the call may have ended here only: the server reads on
                    wait_out(sealed)
                if not sealed_refused(self.shm, exc) or timeout_s - (time.monotonic() - start) < MIN_FALLBACK_S:
                    raise
                log.debug("sealed put refused (%s): the SDK checksums it", exc.code())
            except BaseException:  # interrupted here: the server may read until before_ns
                wait_out(sealed)
                raise
            finally:
                del sealed  # the payloads' exports, held until the server's reads are over
        left = timeout_s - (time.monotonic() - start)
        return self.put(namespace, payload_items(keys, payloads, headers), left, retain_ttl_s=retain_ttl_s)

    def _put_through_segment(
        self, namespace: str, items: Sequence[tuple[bytes, BlockData]], timeout_s: float, retain_ttl_s: float = 0.0
    ) -> PutResult:
        segment = self.shm.put_segment(sum(data_len(d) for _, d in items))
        return run(
            through_segment(
                self.shm, segment, lambda seg: self._put_via(namespace, items, timeout_s, seg, retain_ttl_s)
            )
        )

    def _put_via(
        self,
        namespace: str,
        items: Sequence[tuple[bytes, BlockData]],
        timeout_s: float,
        segment: Segment | None,
        retain_ttl_s: float = 0.0,
    ) -> PutResult:
        if segment is None:
            return self._send_put(namespace, items, timeout_s, retain_ttl_s)
        groups = segment.writer(items, PIPELINE_GROUP_BYTES)  # OSError: no room in the tmpfs
        return self._send_staged(namespace, groups, timeout_s, retain_ttl_s)

    def _send_put(
        self,
        namespace: str,
        items: Sequence[tuple[bytes, PutData]],
        timeout_s: float,
        retain_ttl_s: float = 0.0,
        range_bytes: int = 0,
    ) -> PutResult:
        messages = put_messages(namespace, items, self._message_bytes, self.part_bytes, retain_ttl_s, range_bytes)
        return put_result(self._put(messages, timeout=timeout_s, metadata=self._md))

    def _send_staged(
        self,
        namespace: str,
        groups: Iterator[list[tuple[bytes, ShmRange]]],
        timeout_s: float,
        retain_ttl_s: float = 0.0,
    ) -> PutResult:
        """One Put whose messages name the segment's blocks group by group, each copied in as gRPC
        asks for its message (in gRPC's sending thread): the server reads one group into its slots
        while the next is copied. A failure while copying is raised as itself, not as the CANCELLED
        the call ends with."""
        failed: list[BaseException] = []

        def messages() -> Iterator[bytes]:
            first = True
            try:
                for group in groups:
                    yield encode_put_request(namespace if first else "", group, retain_ttl_s if first else 0.0)
                    first = False
            except BaseException as exc:
                failed.append(exc)
                raise

        try:
            return put_result(self._put(messages(), timeout=timeout_s, metadata=self._md))
        except grpc.RpcError:
            if failed:
                raise failed[0] from None
            raise

    def get(self, namespace: str, keys: Sequence[bytes], prefix_only: bool, timeout_s: float) -> list[Fetched | None]:
        """Blocks in this client's own memory: leased ones copied out of the arena once, then released."""
        self._check_info(timeout_s)
        return self._inplace.get(namespace, keys, prefix_only, timeout_s)

    def lease(self, namespace: str, keys: Sequence[bytes], prefix_only: bool, timeout_s: float) -> Leased:
        """As get, but blocks the server's RAM holds are read-only views of its arena under leases
        (when the arena is shared with this process), to hand back with release(leased.ids) once used
        (kvcache_client.inplace_core)."""
        self._check_info(timeout_s)
        return self._inplace.lease(namespace, keys, prefix_only, timeout_s)

    def release(self, ids: list[int]) -> None:
        """Hands back leases that lease() returned."""
        self._inplace.release(ids)

    def receive_into(
        self,
        namespace: str,
        keys: Sequence[bytes],
        sinks: Sequence[memoryview | None],
        prefix_only: bool,
        timeout_s: float,
    ) -> Received | None:
        """get_into's one-copy path over gRPC, for a client with neither the server's arena nor its
        segments (another host): each part copied straight into its key's sink and verified there
        (LandingCollector); None where those paths serve better."""
        self._check_info(timeout_s)
        if self.arena.on or self.shm.on:
            return None
        collector = LandingCollector(keys, sinks)
        request = shm_get_request(namespace, keys, prefix_only, None, self.shm)
        for items in self._get(request, timeout=timeout_s, metadata=self._md):
            collector.add(items)
        return collector.resolve()

    def _get_through_segment(
        self, namespace: str, keys: Sequence[bytes], prefix_only: bool, timeout_s: float
    ) -> list[Fetched | None]:
        segment = self.shm.get_segment()
        return run(
            through_segment(self.shm, segment, lambda seg: self._fetch(namespace, keys, prefix_only, timeout_s, seg))
        )

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

    def prefetch(self, namespace: str, keys: Sequence[bytes], timeout_s: float) -> PrefetchResult:
        request = pb.PrefetchRequest(namespace=namespace, keys=keys)
        return prefetch_result(self._stub.Prefetch(request, timeout=timeout_s, metadata=self._md))

    def close(self) -> None:
        self._inplace.drain()  # abandoned LeaseGets and their hand-backs, each with its own deadline
        self.shm.close()
        self.unmap()
        self._channel.close()


OFFLOAD_BYTES = 1 << 20
"""Async puts at least this large copy into their segment in a worker thread."""

PIPELINE_GROUP_BYTES = 8 << 20
"""A blocking put through a segment sends a message per this many bytes of blocks copied in, so the
server reads the first into arena slots while the SDK copies the next."""


async def _aiter(requests: Iterable[bytes]) -> AsyncIterator[bytes]:
    for request in requests:
        yield request


class AsyncGrpcTransport(_Channel):
    """asyncio gRPC transport over one grpc.aio channel."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        *,
        message_bytes: int = DEFAULT_MESSAGE_BYTES,
        metadata: Metadata = (),
        shm: bool = True,
        buffers: BufferPool | None = None,
        presence: bool = True,
    ) -> None:
        super().__init__(channel, message_bytes, metadata, shm, buffers, presence)
        self._inplace = AsyncInPlaceCalls(
            self._stub, self._md, self.arena, self._get_through_segment, OFFLOAD_BYTES, self.buffers
        )

    async def _check_info(self, timeout_s: float) -> None:
        """Asks the server once what it accepts (shm directory, blocks in parts, its arena)."""
        if self._info_done:
            return
        info = None
        try:
            info = await self._stub.Info(pb.InfoRequest(), timeout=timeout_s, metadata=self._md)
        except grpc.RpcError as exc:
            _info_or_none(exc)
        await asyncio.to_thread(self._take_info, info)  # a socket connect, an arena mapped: off the loop

    async def info(self, timeout_s: float, *, refresh: bool = False) -> pb.InfoResponse | None:
        """The server's Info answer, asked once (again with `refresh`); None when it has no Info call."""
        if refresh:
            self._info_done = False
        await self._check_info(timeout_s)
        return self.info_response

    async def lookup(self, namespace: str, keys: Sequence[bytes], timeout_s: float) -> LookupResult:
        request = pb.LookupRequest(namespace=namespace, keys=keys)
        return lookup_result(await self._stub.Lookup(request, timeout=timeout_s, metadata=self._md))

    async def put(
        self, namespace: str, items: Sequence[tuple[bytes, BlockData]], timeout_s: float, *, retain_ttl_s: float = 0.0
    ) -> PutResult:
        """As GrpcTransport.put."""
        await self._check_info(timeout_s)
        if self.shm.process.stale():  # registering again is socket I/O: never on the event loop
            await asyncio.to_thread(self.shm.process.name)
        return await arun(
            through_process(
                self.shm,
                items,
                lambda refs: self._send_put(namespace, refs, timeout_s, retain_ttl_s, PROCESS_MESSAGE_BYTES),
                lambda: self._put_through_segment(namespace, items, timeout_s, retain_ttl_s),
            )
        )

    async def put_payloads(
        self,
        namespace: str,
        keys: Sequence[bytes],
        payloads: Sequence[Buffer],
        timeout_s: float,
        *,
        retain_ttl_s: float = 0.0,
        headers: Sequence[bytes] | None = None,
    ) -> PutResult:
        """put() of format.encode_bytes_parts(keys, payloads), encoded in a worker thread when large.
        Never sealed (ShmRange.seal_before_ns) on this face: a cancelled task would return to its
        caller, who may reuse a buffer, while the server still reads it."""
        start = time.monotonic()
        items = await encoded_off_loop(keys, payloads, headers)
        left = max(timeout_s - (time.monotonic() - start), 1e-3)  # a put with no time left: its DEADLINE_EXCEEDED
        return await self.put(namespace, items, left, retain_ttl_s=retain_ttl_s)

    async def _put_through_segment(
        self, namespace: str, items: Sequence[tuple[bytes, BlockData]], timeout_s: float, retain_ttl_s: float = 0.0
    ) -> PutResult:
        nbytes = sum(data_len(d) for _, d in items)
        segment = self.shm.put_segment(nbytes)
        return await arun(
            through_segment(
                self.shm, segment, lambda seg: self._put_via(namespace, items, nbytes, timeout_s, seg, retain_ttl_s)
            )
        )

    async def _put_via(
        self,
        namespace: str,
        items: Sequence[tuple[bytes, BlockData]],
        nbytes: int,
        timeout_s: float,
        segment: Segment | None,
        retain_ttl_s: float = 0.0,
    ) -> PutResult:
        if segment is None:
            return await self._send_put(namespace, items, timeout_s, retain_ttl_s)
        # Copying into the segment, off the event loop when it is large. A cancelled call stops the
        # copy at its next block and waits for it before the segment is retired.
        if nbytes >= OFFLOAD_BYTES:
            refs = await run_to_end(lambda stop: segment.write_blocks(items, stop))
        else:
            refs = segment.write_blocks(items)  # OSError: no room in the tmpfs
        return await self._send_put(namespace, refs, timeout_s, retain_ttl_s)

    async def _send_put(
        self,
        namespace: str,
        items: Sequence[tuple[bytes, PutData]],
        timeout_s: float,
        retain_ttl_s: float = 0.0,
        range_bytes: int = 0,
    ) -> PutResult:
        messages = _aiter(
            put_messages(namespace, items, self._message_bytes, self.part_bytes, retain_ttl_s, range_bytes)
        )
        deadline = time.monotonic() + timeout_s
        try:
            return put_result(await self._put(messages, timeout=timeout_s, metadata=self._md))
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if (task is not None and task.cancelling()) or time.monotonic() < deadline:
                raise  # the caller was cancelled
            # A grpc.aio stream-unary call whose deadline passes while it still sends ends as a
            # CancelledError of its own, not with its status: said as the blocking face says it.
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(), "Deadline Exceeded"
            ) from None

    async def get(
        self, namespace: str, keys: Sequence[bytes], prefix_only: bool, timeout_s: float
    ) -> list[Fetched | None]:
        """Blocks in this client's own memory: leased ones copied out of the arena once (in a
        worker thread when large, waited for even when cancelled), then released."""
        await self._check_info(timeout_s)
        return await self._inplace.get(namespace, keys, prefix_only, timeout_s)

    async def lease(self, namespace: str, keys: Sequence[bytes], prefix_only: bool, timeout_s: float) -> Leased:
        """As GrpcTransport.lease: blocks the server's RAM holds are read-only views of its arena
        under leases (when it is shared with this process), to hand back with release(leased.ids).
        A call cancelled or past its deadline leaves no lease behind (kvcache_client.arena_aio)."""
        await self._check_info(timeout_s)
        return await self._inplace.lease(namespace, keys, prefix_only, timeout_s)

    async def release(self, ids: list[int]) -> None:
        """Hands back leases that lease() returned (to its end even when the caller is cancelled)."""
        await self._inplace.release(ids)

    async def _get_through_segment(
        self, namespace: str, keys: Sequence[bytes], prefix_only: bool, timeout_s: float
    ) -> list[Fetched | None]:
        segment = self.shm.get_segment()
        return await arun(
            through_segment(self.shm, segment, lambda seg: self._fetch(namespace, keys, prefix_only, timeout_s, seg))
        )

    async def receive_into(
        self,
        namespace: str,
        keys: Sequence[bytes],
        sinks: Sequence[memoryview | None],
        prefix_only: bool,
        timeout_s: float,
    ) -> Received | None:
        """As GrpcTransport.receive_into (each part copied into its sink as it is read, on the loop:
        a cancelled call stops reading, and nothing writes into the sinks after it)."""
        await self._check_info(timeout_s)
        if self.arena.on or self.shm.on:
            return None
        collector = LandingCollector(keys, sinks)
        request = shm_get_request(namespace, keys, prefix_only, None, self.shm)
        async for items in self._get(request, timeout=timeout_s, metadata=self._md):
            collector.add(items)
        return collector.resolve()

    async def _fetch(
        self, namespace: str, keys: Sequence[bytes], prefix_only: bool, timeout_s: float, segment: Segment | None
    ) -> list[Fetched | None]:
        collector = GetCollector(len(keys))
        request = shm_get_request(namespace, keys, prefix_only, segment, self.shm)
        async for items in self._get(request, timeout=timeout_s, metadata=self._md):
            collector.add(items)
        if collector.segment_bytes >= OFFLOAD_BYTES:
            # Mapping (and populating) it is off the event loop; a cancelled call waits for the thread
            # before get() retires the segment.
            return await run_to_end(lambda _: collector.resolve(segment))
        return collector.resolve(segment)

    async def delete(self, namespace: str, keys: Sequence[bytes], timeout_s: float) -> int:
        response = await self._stub.Delete(
            pb.DeleteRequest(namespace=namespace, keys=keys), timeout=timeout_s, metadata=self._md
        )
        return response.deleted

    async def stats(self, timeout_s: float) -> ServerStats:
        return server_stats(await self._stub.Stats(pb.StatsRequest(), timeout=timeout_s, metadata=self._md))

    async def prefetch(self, namespace: str, keys: Sequence[bytes], timeout_s: float) -> PrefetchResult:
        request = pb.PrefetchRequest(namespace=namespace, keys=keys)
        return prefetch_result(await self._stub.Prefetch(request, timeout=timeout_s, metadata=self._md))

    async def close(self) -> None:
        await self._inplace.drain()  # abandons and releases still under way, each with its own deadline
        self.shm.close()
        self.unmap()
        await self._channel.close()
