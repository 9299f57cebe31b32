"""Per-RPC context: a request id for the logs, admission, and the RPC's status and duration for metrics.

The request id is the caller's `x-request-id` metadata when present (so a trace
can follow a request from an engine into kvcache), else a fresh random one. It
is echoed back in the trailing metadata of unary calls and in the initial
metadata of streaming ones (Put, Get, WatchEvents: sent when the call is
admitted), and in the trailing metadata of a call refused before it started and set in a context variable that the
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
import os
import re
import time
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


def _incoming_id(metadata: Any) -> str:
    for key, value in metadata or ():
        if key == REQUEST_ID_HEADER and isinstance(value, str) and _VALID_ID.match(value):
            return value
    return os.urandom(8).hex()


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


class _Method:
    """What the interceptor knows of one method, worked out once (not per call): its name, whether
    it is a KVCache method, and what checks its calls (authentication, admission)."""

    __slots__ = ("admission", "auth", "id_in_trailers", "name", "observer", "ours")

    def __init__(self, full_name: str, interceptor: RequestContextInterceptor, *, id_in_trailers: bool) -> None:
        # Unary calls echo the request id in their trailing metadata, sent with the answer: sending it
        # in initial metadata ahead of the answer is one more operation of gRPC's per call (about a
        # quarter of a Lookup's server CPU). Streaming calls send it at admission, in initial
        # metadata: a client sees that its Put stream was admitted before it ends, and a Get's
        # headers are out before its replies, so the status of a Get cut off because its client
        # stopped reading still reaches that client (without them it saw "Stream removed").
        self.id_in_trailers = id_in_trailers
        service, _, self.name = full_name.lstrip("/").rpartition("/")
        self.ours = service == KVCACHE_SERVICE
        self.observer = interceptor._observer
        self.auth = interceptor._auth if self.ours else None
        self.admission = interceptor._admission if self.ours and self.name not in UNCOUNTED_METHODS else None


class _Call:
    """One call from admission to its end: reports its status code and duration, releases its slot,
    and logs one line when it failed or ended early (at DEBUG, one line in any case)."""

    __slots__ = ("admitted", "context", "logged", "method", "rid", "start", "tenant")

    def __init__(self, method: _Method, context: grpc.aio.ServicerContext) -> None:
        self.method = method
        self.context = context
        self.admitted = False
        self.logged = False  # a refusal logged its own line
        self.tenant: str | None = None
        self.rid = ""
        self.start = 0.0

    async def __aenter__(self) -> _Call:
        self.start = time.perf_counter()
        self.rid = rid = _incoming_id(self.context.invocation_metadata())
        request_id.set(rid)
        return self

    async def admit(self) -> None:
        """Authenticates and admits the call, then sends the request id; aborts a refused call before
        anything was sent (its request id then travels in the trailing metadata)."""
        context, m, rid = self.context, self.method, self.rid
        if m.auth is not None:
            metadata = {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}
            try:
                principal = m.auth.check(m.name, metadata)
            except AuthError as exc:
                self.logged = True
                log.info("refused %s (request %s): %s", m.name, rid, exc)
                await context.abort(grpc.StatusCode[exc.code_name], str(exc), ((REQUEST_ID_HEADER, rid),))
            current_principal.set(principal)
            self.tenant = principal.tenant
        if m.admission is not None:
            refusal = m.admission.acquire(self.tenant)
            if refusal is not None:
                self.logged = True
                log.info("refused %s (request %s): %s", m.name, rid, refusal)
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal, ((REQUEST_ID_HEADER, rid),))
            self.admitted = True
        if m.id_in_trailers:  # sent with the answer, or with the status of a call the handler aborts
            context.set_trailing_metadata(((REQUEST_ID_HEADER, rid),))
        else:
            await context.send_initial_metadata(((REQUEST_ID_HEADER, rid),))

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: object, tb: object) -> bool:
        m = self.method
        if self.admitted:
            m.admission.release(self.tenant)  # type: ignore[union-attr]
        if exc_type is None or issubclass(exc_type, grpc.aio.AbortError):
            code = _code(self.context)
        elif issubclass(exc_type, asyncio.CancelledError | grpc.aio.InternalError):
            # InternalError is gRPC's ExecuteBatchError: a send (a response, a status) failed because
            # the call is over: the client cancelled it, or its deadline passed. (The two look alike
            # here: a client ends the call at its deadline, a moment before the server's copy of the
            # deadline passes.)
            code = "CANCELLED"
            log.log(
                logging.INFO if m.ours else logging.DEBUG,
                "%s (request %s) ended early: cancelled by the client or its deadline after %.3fs",
                m.name,
                self.rid,
                time.perf_counter() - self.start,
            )
            self.logged = True
        else:
            code = "UNKNOWN"
        elapsed_s = time.perf_counter() - self.start
        m.observer.rpc(m.name, code, elapsed_s)
        if code != "OK":
            if not self.logged:  # log.log formats nothing unless its level is enabled
                level = logging.WARNING if code in SERVER_SIDE_CODES else logging.INFO
                log.log(
                    level if m.ours else logging.DEBUG,
                    "%s (request %s) failed: %s after %.3fs",
                    m.name,
                    self.rid,
                    code,
                    elapsed_s,
                )
        elif log.isEnabledFor(logging.DEBUG):
            log.debug("%s (request %s) OK in %.3fs", m.name, self.rid, elapsed_s)
        return False


def _unary(method: _Method, behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def wrapped(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            async with _Call(method, context) as call:
                await call.admit()
                return await behavior(request_or_iterator, context)
        except grpc.aio.InternalError:
            raise _ended() from None

    return wrapped


def _streaming(method: _Method, behavior: Callable[..., AsyncIterator[Any]]) -> Callable[..., Awaitable[None]]:
    if not inspect.isasyncgenfunction(behavior):
        # A streaming handler may also be a coroutine that sends with context.write() (the health
        # servicer's Watch is one): `async for` over it would fail every call.
        return _unary(method, behavior)

    async def wrapped(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        # Sends the responses itself (gRPC's reader/writer form) rather than yielding them to gRPC: a
        # write that fails because the call is over then ends the call here, quietly, and the
        # handler's generator is closed at once (its finally blocks run now, not at garbage
        # collection), so the call's admission slot is released exactly when it ends.
        try:
            async with _Call(method, context) as call:
                await call.admit()
                async with contextlib.aclosing(behavior(request_or_iterator, context)) as responses:
                    async for response in responses:
                        await context.write(response)
        except grpc.aio.InternalError:
            raise _ended() from None

    return wrapped


class RequestContextInterceptor(grpc.aio.ServerInterceptor):
    """Per call: the request id, authentication and admission (KVCache methods only; health and
    reflection stay open), and the status code and duration reported to the observer.

    A method's handler is wrapped once, on its first call, and the wrapped handler is reused for
    every later call of the method (what differs per call, its metadata, is read from the call's
    context): no class, closure or handler tuple is built per call."""

    def __init__(
        self, observer: Observer, authenticator: Authenticator | None = None, admission: Admission | None = None
    ) -> None:
        self._observer = observer
        self._auth = authenticator
        self._admission = admission
        self._wrapped: dict[tuple[str, int], grpc.RpcMethodHandler] = {}  # (method, id(handler)) -> wrapped

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        cache_key = (details.method, id(handler))
        wrapped = self._wrapped.get(cache_key)
        if wrapped is None:
            wrapped = self._wrap(details.method, handler)
            # The registered handlers live as long as the server: ids are not reused meanwhile.
            self._wrapped[cache_key] = wrapped
        return wrapped

    def _wrap(self, full_name: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        method = _Method(full_name, self, id_in_trailers=handler.unary_unary is not None)
        if handler.unary_unary:
            return handler._replace(unary_unary=_unary(method, handler.unary_unary))
        if handler.stream_unary:
            return handler._replace(stream_unary=_unary(method, handler.stream_unary))
        if handler.unary_stream:
            return handler._replace(unary_stream=_streaming(method, handler.unary_stream))
        return handler._replace(stream_stream=_streaming(method, handler.stream_stream))
