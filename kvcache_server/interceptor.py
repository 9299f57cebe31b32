"""Per-RPC context: a request id for the logs, and the RPC's status and duration for metrics.

The request id is the caller's `x-request-id` metadata when present (so a trace
can follow a request from an engine into kvcache), else a fresh random one. It
is echoed back in the response's initial metadata and set in a context
variable that the logging filter adds to every record logged while the RPC
runs. Logs never carry block bytes or token ids: handlers log keys' hex at most.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from kvcache_server.auth import Authenticator, AuthError, current_principal
from kvcache_server.observe import Observer

log = logging.getLogger(__name__)
KVCACHE_SERVICE = "kvcache.v1.KVCache"

REQUEST_ID_HEADER = "x-request-id"
request_id: contextvars.ContextVar[str] = contextvars.ContextVar("kvcache_request_id", default="-")
_VALID_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


class RequestIdFilter(logging.Filter):
    """Adds `request_id` to every log record (\"-\" outside an RPC)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()
        return True


def _incoming_id(details: grpc.HandlerCallDetails) -> str:
    for key, value in details.invocation_metadata or ():
        if key == REQUEST_ID_HEADER and isinstance(value, str) and _VALID_ID.match(value):
            return value
    return uuid.uuid4().hex[:16]


def _code(context: grpc.aio.ServicerContext) -> str:
    code = context.code()
    if code is None:
        return "OK"
    return code.name if isinstance(code, grpc.StatusCode) else str(code)


class RequestContextInterceptor(grpc.aio.ServerInterceptor):
    """Per call: the request id, authentication (KVCache methods only; health and reflection
    stay open), and the status code and duration reported to the observer."""

    def __init__(self, observer: Observer, authenticator: Authenticator | None = None) -> None:
        self._observer = observer
        self._auth = authenticator

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        service, _, method = details.method.lstrip("/").rpartition("/")
        rid = _incoming_id(details)
        observer = self._observer
        auth = self._auth if service == KVCACHE_SERVICE else None
        metadata = {k: v for k, v in details.invocation_metadata or () if isinstance(v, str)}

        async def admit(context: grpc.aio.ServicerContext) -> None:
            """Sets the call's context; aborts the call when its credentials do not admit it."""
            request_id.set(rid)
            await context.send_initial_metadata(((REQUEST_ID_HEADER, rid),))
            if auth is None:
                return
            try:
                current_principal.set(auth.check(method, metadata))
            except AuthError as exc:
                log.info("refused %s: %s", method, exc)
                await context.abort(grpc.StatusCode[exc.code_name], str(exc))

        class Call:
            """Admits the call on entry; reports its status code and duration on exit."""

            def __init__(self, context: grpc.aio.ServicerContext) -> None:
                self.context = context

            async def __aenter__(self) -> None:
                self.start = time.perf_counter()
                await admit(self.context)

            async def __aexit__(self, exc_type: type[BaseException] | None, exc: object, tb: object) -> None:
                if exc_type is None or issubclass(exc_type, grpc.aio.AbortError):
                    code = _code(self.context)
                elif issubclass(exc_type, asyncio.CancelledError | GeneratorExit):
                    code = "CANCELLED"
                else:
                    code = "UNKNOWN"
                observer.rpc(method, code, time.perf_counter() - self.start)

        def unary(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
            async def wrapped(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
                async with Call(context):
                    return await behavior(request_or_iterator, context)

            return wrapped

        def streaming(behavior: Callable[..., AsyncIterator[Any]]) -> Callable[..., Any]:
            if not inspect.isasyncgenfunction(behavior):
                # A streaming handler may also be a coroutine that sends with context.write() (the
                # health servicer's Watch is one): `async for` over it would fail every call.
                return unary(behavior)  # type: ignore[arg-type]

            async def wrapped(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                async with Call(context):
                    async for response in behavior(request_or_iterator, context):
                        yield response

            return wrapped

        if handler.unary_unary:
            return handler._replace(unary_unary=unary(handler.unary_unary))
        if handler.stream_unary:
            return handler._replace(stream_unary=unary(handler.stream_unary))
        if handler.unary_stream:
            return handler._replace(unary_stream=streaming(handler.unary_stream))
        return handler._replace(stream_stream=streaming(handler.stream_stream))
