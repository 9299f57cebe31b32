"""The kvcache.v1.KVCache gRPC service: request validation and status codes, nothing else.

Each handler checks what the client sent, answers a precise status for what
is wrong (see proto/kvcache/v1/kvcache.proto), and hands valid work to the
TierStack. Block bytes are taken from the request message once and stored as
that same bytes object; on reads the stored object goes into the reply as is.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import NoReturn

import grpc
from google.protobuf.message import DecodeError

from kvcache_client.blockwire import PutMessage, decode_put_request, encode_get_response
from kvcache_client.errors import ChecksumMismatch, UnknownFormatVersion
from kvcache_client.format import BlockFormatError, Compression, verify_block
from kvcache_client.keys import KEY_BYTES
from kvcache_proto import kvcache_pb2 as pb
from kvcache_proto import kvcache_pb2_grpc as pb_grpc
from kvcache_server.auth import current_principal
from kvcache_server.config import LimitsSection
from kvcache_server.events import SubscriberOverflow
from kvcache_server.observe import NullObserver, Observer
from kvcache_server.stack import TierStack
from kvcache_server.tiers.base import TierStats

log = logging.getLogger(__name__)

MAX_NAMESPACE_BYTES = 128
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVCache"].full_name
# TierStats travels field by field under the same names; `kind` is `tier` on the wire.
_TIER_STATS_FIELDS = [f for f in dataclasses.fields(TierStats) if f.name != "kind"]


class _Counters:
    def __init__(self) -> None:
        self.failed_requests = 0
        self.put_checksum_failures = 0


GetReply = list[tuple[int, bool, bytes, int]]
"""One streamed Get message: (index, found, block, tier) per item, encoded by blockwire."""


class KVCacheService(pb_grpc.KVCacheServicer):
    """Validates requests and forwards them to the tier stack."""

    def __init__(
        self, stack: TierStack, limits: LimitsSection, *, version: str, observer: Observer | None = None
    ) -> None:
        self._stack = stack
        self._observer = observer or NullObserver()
        self._limits = limits
        self._version = version
        self._started = time.monotonic()
        self._counters = _Counters()

    def counters(self) -> dict[str, int]:
        """Service-level counters, for metrics."""
        return {
            "failed_requests": self._counters.failed_requests,
            "put_checksum_failures": self._counters.put_checksum_failures,
        }

    # -- validation ---------------------------------------------------------------------------

    async def _abort(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
        self._counters.failed_requests += 1
        await context.abort(code, message)
        raise AssertionError("unreachable: context.abort raises")

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

    async def _block(self, context: grpc.aio.ServicerContext, index: int, key: bytes, data: bytes) -> None:
        where = f"block {index}"
        if len(key) != KEY_BYTES:
            await self._abort(
                context, grpc.StatusCode.INVALID_ARGUMENT, f"{where}: key is {len(key)} bytes, expected {KEY_BYTES}"
            )
        if len(data) > self._limits.max_block_bytes:
            await self._abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{where}: {len(data)} bytes exceed max_block_bytes={self._limits.max_block_bytes}",
            )
        try:
            header = verify_block(data)
        except ChecksumMismatch as exc:
            self._counters.put_checksum_failures += 1
            await self._abort(context, grpc.StatusCode.DATA_LOSS, f"{where}: {exc}")
        except UnknownFormatVersion as exc:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"{where}: {exc}")
        except BlockFormatError as exc:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"{where}: malformed block: {exc}")
        if header.compression is not Compression.NONE:
            await self._abort(
                context, grpc.StatusCode.INVALID_ARGUMENT, f"{where}: clients must send uncompressed blocks"
            )

    # -- RPCs ---------------------------------------------------------------------------------

    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        namespace = await self._namespace(context, request.namespace)
        keys = await self._keys(context, request.keys)
        tiers = await self._stack.lookup(namespace, keys)
        self._observer.lookup(namespace, len(keys), len(tiers))
        return pb.LookupResponse(prefix_length=len(tiers), tiers=[int(t) for t in tiers])

    async def Put(
        self, request_iterator: AsyncIterator[PutMessage], context: grpc.aio.ServicerContext
    ) -> pb.PutResponse:
        namespace: str | None = None  # scoped
        first_namespace = ""  # as the client sent it
        index = stored = rejected = received = 0
        limits = self._limits
        async for message in request_iterator:
            if message.error:
                await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, message.error)
            if index + len(message.blocks) > limits.max_put_stream_blocks:
                await self._abort(
                    context,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"Put stream exceeds max_put_stream_blocks={limits.max_put_stream_blocks}; split it",
                )
            if received + sum(len(d) for _, d in message.blocks) > limits.max_put_stream_bytes:
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
            for key, data in message.blocks:
                await self._block(context, index, key, data)
                received += len(data)
                index += 1
            # Commit this message's blocks (all verified) before reading the next message.
            for kept in await self._stack.put(namespace, message.blocks):
                stored += kept
                rejected += not kept
        if namespace is None or index == 0:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, "Put carried no blocks")
        return pb.PutResponse(stored=stored, rejected=rejected, bytes_received=received)

    async def Get(self, request: pb.GetRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[GetReply]:
        namespace = await self._namespace(context, request.namespace)
        keys = await self._keys(context, request.keys)
        found = await self._stack.get(namespace, keys)
        budget = self._limits.stream_message_bytes
        items: GetReply = []
        size = 0
        for i, hit in enumerate(found):
            if hit is None:
                items.append((i, False, b"", 0))
                if request.prefix_only:
                    break
                continue
            if size and size + len(hit.data) > budget:
                yield items
                items, size = [], 0
            items.append((i, True, hit.data, int(hit.tier)))
            size += len(hit.data)
        if items:
            yield items

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
        sub = hub.subscribe(namespace, prefix=scope)
        if sub is None:
            await self._abort(
                context, grpc.StatusCode.RESOURCE_EXHAUSTED, f"too many event subscribers (max {hub.max_subscribers})"
            )
        try:
            while True:
                try:
                    batch = await sub.next_batch()
                except SubscriberOverflow as exc:
                    await self._abort(
                        context, grpc.StatusCode.RESOURCE_EXHAUSTED, f"{exc}: dropped; reconnect and resync"
                    )
                for event in batch:
                    yield pb.KVEvent(
                        sequence=event.sequence,
                        timestamp_s=event.timestamp_s,
                        kind=int(event.kind),
                        tier=int(event.tier),
                        namespace=event.namespace.removeprefix(scope),
                        keys=event.keys,
                    )
        finally:
            hub.unsubscribe(sub)

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
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
        )


@dataclasses.dataclass(frozen=True, slots=True)
class _Malformed:
    error: str


def _parser(message: type) -> Callable[[bytes], object]:
    """The message's parser, returning _Malformed instead of raising: gRPC would answer a raising
    deserializer with INTERNAL, and malformed input deserves INVALID_ARGUMENT."""

    def parse(data: bytes) -> object:
        try:
            return message.FromString(data)
        except DecodeError as exc:
            return _Malformed(f"malformed {message.__name__}: {exc}")

    return parse


def _unary(behavior: Callable[..., Awaitable[object]]) -> Callable[..., Awaitable[object]]:
    async def checked(request: object, context: grpc.aio.ServicerContext) -> object:
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
        return await behavior(request, context)

    return checked


def _streaming(behavior: Callable[..., AsyncIterator[object]]) -> Callable[..., AsyncIterator[object]]:
    async def checked(request: object, context: grpc.aio.ServicerContext) -> AsyncIterator[object]:
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
        async for response in behavior(request, context):
            yield response

    return checked


def add_to_server(service: KVCacheService, server: grpc.aio.Server) -> None:
    """Registers the service. Put and Get use the blockwire codec (same wire format as the
    generated code, fewer copies of block bytes); the small RPCs use the generated classes.
    No parser raises: malformed requests are answered INVALID_ARGUMENT."""
    unary, stream = grpc.unary_unary_rpc_method_handler, grpc.unary_stream_rpc_method_handler
    handlers = {
        "Lookup": unary(_unary(service.Lookup), _parser(pb.LookupRequest), pb.LookupResponse.SerializeToString),
        "Put": grpc.stream_unary_rpc_method_handler(service.Put, decode_put_request, pb.PutResponse.SerializeToString),
        "Get": stream(_streaming(service.Get), _parser(pb.GetRequest), encode_get_response),
        "Delete": unary(_unary(service.Delete), _parser(pb.DeleteRequest), pb.DeleteResponse.SerializeToString),
        "Stats": unary(_unary(service.Stats), _parser(pb.StatsRequest), pb.StatsResponse.SerializeToString),
        "WatchEvents": stream(
            _streaming(service.WatchEvents), _parser(pb.WatchEventsRequest), pb.KVEvent.SerializeToString
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
