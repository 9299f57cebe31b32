"""Per-RPC context: a request id for the logs, admission, and the RPC's status and duration for metrics.

The request id is the caller's `x-request-id` metadata when present (so a trace
can follow a request from an engine into kvcache), else a fresh random one. It
is echoed back in the response's initial metadata (in the trailing metadata of
a call refused before it started) and set in a context variable that the
logging filter adds to every record logged while the RPC runs. Logs never carry
block bytes or token ids: handlers log keys' hex at most.

Every KVCache call but Info is admitted against the global and its tenant's
caps (kvcache_server.admission) once authenticated; health, reflection and Info
never are. A call that ends early (client cancel, deadline) logs one line; so does every other failed
call, with its request id and status: WARNING for a failure on the server's side (SERVER_SIDE_CODES),
INFO for the caller's (INVALID_ARGUMENT, NOT_FOUND, a refusal, ...). At DEBUG every call logs one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from kvcache_server.admission import Admission
from kvcache_server.auth import Authenticator, AuthError, current_principal
from kvcache_server.observe import Observer

log = logging.getLogger(__name__)
KVCACHE_SERVICE = "kvcache.v1.KVCache"
UNCOUNTED_METHODS = frozenset({"Info"})
"""KVCache methods never refused for capacity (health and reflection are other services, never counted)."""

SERVER_SIDE_CODES = frozenset({"INTERNAL", "UNKNOWN", "DATA_LOSS", "UNAVAILABLE", "UNIMPLEMENTED"})
"""Status codes that mean the server (or a tier behind it) failed, logged at WARNING; others at INFO."""

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


def _ended() -> asyncio.CancelledError:
    """What a call raises when a send failed because the call is over (gRPC's ExecuteBatchError): gRPC ends
    a cancelled call quietly, where it logs an ExecuteBatchError with a traceback unless it has already
    seen the call end."""
    return asyncio.CancelledError()


class RequestContextInterceptor(grpc.aio.ServerInterceptor):
    """Per call: the request id, authentication and admission (KVCache methods only; health and
    reflection stay open), and the status code and duration reported to the observer."""

    def __init__(
        self, observer: Observer, authenticator: Authenticator | None = None, admission: Admission | None = None
    ) -> None:
        self._observer = observer
        self._auth = authenticator
        self._admission = admission

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
        ours = service == KVCACHE_SERVICE
        auth = self._auth if ours else None
        admission = self._admission if ours and method not in UNCOUNTED_METHODS else None
        metadata = {k: v for k, v in details.invocation_metadata or () if isinstance(v, str)}

        class Call:
            """One call from admission to its end: reports its status code and duration, releases its
            slot, and logs one line when it failed or ended early (at DEBUG, one line in any case)."""

            def __init__(self, context: grpc.aio.ServicerContext) -> None:
                self.context = context
                self.admitted = False
                self.logged = False  # a refusal logged its own line
                self.tenant: str | None = None

            async def __aenter__(self) -> Call:
                self.start = time.perf_counter()
                request_id.set(rid)
                return self

            async def admit(self) -> None:
                """Authenticates and admits the call, then sends the request id; aborts a refused call
                before anything was sent (its request id then travels in the trailing metadata)."""
                context = self.context
                if auth is not None:
                    try:
                        principal = auth.check(method, metadata)
                    except AuthError as exc:
                        self.logged = True
                        log.info("refused %s (request %s): %s", method, rid, exc)
                        await context.abort(grpc.StatusCode[exc.code_name], str(exc), ((REQUEST_ID_HEADER, rid),))
                    current_principal.set(principal)
                    self.tenant = principal.tenant
                if admission is not None:
                    refusal = admission.acquire(self.tenant)
                    if refusal is not None:
                        self.logged = True
                        log.info("refused %s (request %s): %s", method, rid, refusal)
                        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal, ((REQUEST_ID_HEADER, rid),))
                    self.admitted = True
                await context.send_initial_metadata(((REQUEST_ID_HEADER, rid),))

            async def __aexit__(self, exc_type: type[BaseException] | None, exc: object, tb: object) -> bool:
                if self.admitted:
                    admission.release(self.tenant)  # type: ignore[union-attr]
                if exc_type is None or issubclass(exc_type, grpc.aio.AbortError):
                    code = _code(self.context)
                elif issubclass(exc_type, asyncio.CancelledError | grpc.aio.InternalError):
                    # InternalError is gRPC's ExecuteBatchError: a send (a response, a status) failed
                    # because the call is over: the client cancelled it, or its deadline passed.
                    # (The two look alike here: a client ends the call at its deadline, a moment before
                    # the server's copy of the deadline passes.)
                    code = "CANCELLED"
                    log.log(
                        logging.INFO if ours else logging.DEBUG,
                        "%s (request %s) ended early: cancelled by the client or its deadline after %.3fs",
                        method,
                        rid,
                        time.perf_counter() - self.start,
                    )
                    self.logged = True
                else:
                    code = "UNKNOWN"
                elapsed_s = time.perf_counter() - self.start
                observer.rpc(method, code, elapsed_s)
                if code != "OK":
                    if not self.logged:  # log.log formats nothing unless its level is enabled
                        level = logging.WARNING if code in SERVER_SIDE_CODES else logging.INFO
                        log.log(level if ours else logging.DEBUG, "%s (request %s) failed: %s after %.3fs",
                                method, rid, code, elapsed_s)
                elif log.isEnabledFor(logging.DEBUG):
                    log.debug("%s (request %s) OK in %.3fs", method, rid, elapsed_s)
                return False

        def unary(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
            async def wrapped(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    async with Call(context) as call:
                        await call.admit()
                        return await behavior(request_or_iterator, context)
                except grpc.aio.InternalError:
                    raise _ended() from None

            return wrapped

        def streaming(behavior: Callable[..., AsyncIterator[Any]]) -> Callable[..., Awaitable[None]]:
            if not inspect.isasyncgenfunction(behavior):
                # A streaming handler may also be a coroutine that sends with context.write() (the
                # health servicer's Watch is one): `async for` over it would fail every call.
                return unary(behavior)

            async def wrapped(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> None:
                # Sends the responses itself (gRPC's reader/writer form) rather than yielding them to
                # gRPC: a write that fails because the call is over then ends the call here, quietly,
                # and the handler's generator is closed at once (its finally blocks run now, not at
                # garbage collection), so the call's admission slot is released exactly when it ends.
                try:
                    async with Call(context) as call:
                        await call.admit()
                        async with contextlib.aclosing(behavior(request_or_iterator, context)) as responses:
                            async for response in responses:
                                await context.write(response)
                except grpc.aio.InternalError:
                    raise _ended() from None

            return wrapped

        if handler.unary_unary:
            return handler._replace(unary_unary=unary(handler.unary_unary))
        if handler.stream_unary:
            return handler._replace(stream_unary=unary(handler.stream_unary))
        if handler.unary_stream:
            return handler._replace(unary_stream=streaming(handler.unary_stream))
        return handler._replace(stream_stream=streaming(handler.stream_stream))
