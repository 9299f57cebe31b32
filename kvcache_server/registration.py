"""Registering the KVCache service with a grpc.aio server: which codec each RPC uses.

Put and Get use the blockwire codec (same wire format as the generated code, fewer copies of block
bytes); the small RPCs use the generated classes. No parser raises: a malformed request reaches its
handler as _Malformed and is answered INVALID_ARGUMENT, where gRPC would answer a raising
deserializer with INTERNAL. Put messages reach the service as raw bytes: it decodes them itself,
bounded by the stream's limits and off the event loop when large (gRPC would decode them on it,
whole). Get is a coroutine that sends with context.write, so a reader that stalls can be noticed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError

from kvcache_core.blockwire import encode_get_response
from kvcache_proto import kvcache_pb2 as pb
from kvcache_server.service import SERVICE_NAME, KVCacheService


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


def _coroutine_streaming(behavior: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
    async def checked(request: object, context: grpc.aio.ServicerContext) -> None:
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
        await behavior(request, context)

    return checked


def add_to_server(service: KVCacheService, server: grpc.aio.Server) -> None:
    """Registers the service's RPCs under kvcache.v1.KVCache."""
    unary, stream = grpc.unary_unary_rpc_method_handler, grpc.unary_stream_rpc_method_handler
    handlers = {
        "Lookup": unary(_unary(service.Lookup), _parser(pb.LookupRequest), pb.LookupResponse.SerializeToString),
        "Put": grpc.stream_unary_rpc_method_handler(service.Put, None, pb.PutResponse.SerializeToString),
        "Get": stream(_coroutine_streaming(service.Get), _parser(pb.GetRequest), encode_get_response),
        "Delete": unary(_unary(service.Delete), _parser(pb.DeleteRequest), pb.DeleteResponse.SerializeToString),
        "Stats": unary(_unary(service.Stats), _parser(pb.StatsRequest), pb.StatsResponse.SerializeToString),
        "Info": unary(_unary(service.Info), _parser(pb.InfoRequest), pb.InfoResponse.SerializeToString),
        "ArenaReserve": unary(
            _unary(service.ArenaReserve), _parser(pb.ArenaReserveRequest), pb.ArenaReserveResponse.SerializeToString
        ),
        "ArenaCommit": unary(
            _unary(service.ArenaCommit), _parser(pb.ArenaCommitRequest), pb.PutResponse.SerializeToString
        ),
        "LeaseGet": unary(_unary(service.LeaseGet), _parser(pb.LeaseGetRequest), pb.LeaseGetResponse.SerializeToString),
        "LeaseRelease": unary(
            _unary(service.LeaseRelease), _parser(pb.LeaseReleaseRequest), pb.LeaseReleaseResponse.SerializeToString
        ),
        "Prefetch": unary(_unary(service.Prefetch), _parser(pb.PrefetchRequest), pb.PrefetchResponse.SerializeToString),
        "WatchEvents": stream(
            _streaming(service.WatchEvents), _parser(pb.WatchEventsRequest), pb.KVEvent.SerializeToString
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
