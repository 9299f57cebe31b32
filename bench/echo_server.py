"""A bare gRPC store/echo server for bench_throughput.py: the rawest gRPC Python can do, as a baseline.

One grpc.aio server (same message-size options as the kvcache server), generic handlers, two services:

    /echo.Raw/Put   client-streaming, identity serializers (messages are raw bytes, no protobuf).
                    Keeps every message, in order, under the slot named by the "slot" metadata entry;
                    answers an 8-byte little-endian message count.
    /echo.Raw/Get   server-streaming; the request is the slot name as raw bytes; streams back the
                    stored messages as they were received.
    /echo.Pb/Put    the same with protobuf messages holding one bytes field
    /echo.Pb/Get    (google.protobuf.BytesValue); the server keeps `message.value` (one copy out of the
                    message, as the kvcache server does) and answers with BytesValue(value=stored).

Data lives in a dict in this process, so Get returns real bytes. Prints one line on start-up:
    echo-server serving on 127.0.0.1:PORT
and runs until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import struct
from collections.abc import AsyncIterator

import grpc
from google.protobuf.wrappers_pb2 import BytesValue, UInt64Value


def _slot(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "slot":
            return value if isinstance(value, str) else value.decode()
    return ""


class Store:
    def __init__(self) -> None:
        self.raw: dict[str, list[bytes]] = {}
        self.pb: dict[str, list[bytes]] = {}

    async def raw_put(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
        messages = [m async for m in requests]
        self.raw[_slot(context)] = messages
        return struct.pack("<Q", len(messages))

    async def raw_get(self, request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        for m in self.raw.get(request.decode(), ()):
            yield m

    async def pb_put(self, requests: AsyncIterator[BytesValue], context: grpc.aio.ServicerContext) -> UInt64Value:
        values = [m.value async for m in requests]
        self.pb[_slot(context)] = values
        return UInt64Value(value=len(values))

    async def pb_get(self, request: BytesValue, context: grpc.aio.ServicerContext) -> AsyncIterator[BytesValue]:
        for v in self.pb.get(request.value.decode(), ()):
            yield BytesValue(value=v)


async def serve(host: str, port: int, max_message_bytes: int) -> None:
    store = Store()
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),
        ],
        maximum_concurrent_rpcs=1024,
    )
    raw = grpc.method_handlers_generic_handler(
        "echo.Raw",
        {
            # No (de)serializers: the handlers see and return bytes as they are on the wire.
            "Put": grpc.stream_unary_rpc_method_handler(store.raw_put),
            "Get": grpc.unary_stream_rpc_method_handler(store.raw_get),
        },
    )
    pb = grpc.method_handlers_generic_handler(
        "echo.Pb",
        {
            "Put": grpc.stream_unary_rpc_method_handler(
                store.pb_put,
                request_deserializer=BytesValue.FromString,
                response_serializer=UInt64Value.SerializeToString,
            ),
            "Get": grpc.unary_stream_rpc_method_handler(
                store.pb_get,
                request_deserializer=BytesValue.FromString,
                response_serializer=BytesValue.SerializeToString,
            ),
        },
    )
    server.add_generic_rpc_handlers((raw, pb))
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    await server.start()
    print(f"echo-server serving on {host}:{bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--max-message-bytes", type=int, default=65 << 20)
    args = p.parse_args()
    asyncio.run(serve(args.host, args.port, args.max_message_bytes))


if __name__ == "__main__":
    main()
