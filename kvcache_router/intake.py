"""A request's way in, before any worker is asked: its id, its body, its JSON and its request slot.

    X-Request-Id                     kept when 1 to 128 of [A-Za-z0-9._:-], else one made up here
    Content-Length > max_body_bytes  413 request_too_large, at once
    room for one more body           http.max_concurrent_bodies           -> 503 overloaded (queue_timeout_s)
    the body, whole                  within http.body_timeout_s           -> 408 request_timeout
                                     at most http.max_body_bytes          -> 413 request_too_large
    its JSON                         an object                            -> 400 invalid_json
                                     nested at most http.max_json_depth   -> 400 json_too_deep
                                     at most http.max_json_containers     -> 400 json_too_large
                                     objects and arrays
    a request slot                   http.max_concurrent_requests         -> 503 overloaded (queue_timeout_s)

The body is read BEFORE a request slot is taken: a client that sends its body slowly, or never,
holds room for one body (for body_timeout_s at most), not one of the slots that bound the calls
to the workers. The room is given back once the request has its slot, so requests without a slot
hold at most max_concurrent_bodies bodies of max_body_bytes each (plus what their JSON parses
into); requests in a slot at most max_concurrent_requests more. Parsed JSON is bigger than its
bytes: 8 MiB of empty objects is 194 MiB of Python dicts (measured), and the container cap keeps
the worst case near 12x (8 MiB of two-letter strings: 95 MiB); text prompts are about 1x. One body
is parsed at a time (on the event loop), so a refused one costs its transient peak once. The two
waits, for room and for a slot, share one queue_timeout_s; reading the body is not waiting and has
its own deadline.

The request id goes into log lines and upstream headers, so it is checked here: a client cannot
write spaces, quotes or `key=value` text into the router's log, or into the workers' request ids.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from kvcache_router.errors import RouterError
from kvcache_router.metrics import RouterMetrics

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_READ_PIECE_BYTES = 1 << 16


def request_id(given: str | None) -> str:
    """The client's X-Request-Id when it is 1 to 128 of [A-Za-z0-9._:-], else one made up (32 hex digits)."""
    if given is not None and _REQUEST_ID.fullmatch(given):
        return given
    return uuid.uuid4().hex


class ClientGone(Exception):
    """The client closed its connection before its request was whole: there is nobody to answer."""


@dataclass(frozen=True, slots=True)
class IntakeLimits:
    """The [http] settings of the way in (docs/router.md)."""

    max_body_bytes: int
    body_timeout_s: float
    max_json_depth: int
    max_json_containers: int
    max_concurrent_bodies: int
    max_concurrent_requests: int
    queue_timeout_s: float


class Intake:
    """Reads and checks request bodies outside the request slots, then hands each request its slot.

    Args:
        limits: The bounds above.
        metrics: Where the bodies held (`bodies_in_flight`) are published.
    """

    def __init__(self, limits: IntakeLimits, metrics: RouterMetrics) -> None:
        self._limits = limits
        self._metrics = metrics
        self._bodies = asyncio.Semaphore(limits.max_concurrent_bodies)
        self._slots = asyncio.Semaphore(limits.max_concurrent_requests)

    @asynccontextmanager
    async def admit(self, request: web.Request, *, json_body: bool) -> AsyncIterator[dict[str, Any]]:
        """Holds a request slot for the block; yields the body's JSON object ({} when `json_body` is False).

        Raises:
            RouterError: 413, 408, 400 or 503 as the table above says.
            ClientGone: the client went away while sending its body.
        """
        budget_s = self._limits.queue_timeout_s
        body: dict[str, Any] = {}
        if json_body:
            cap = self._limits.max_body_bytes
            if request.content_length is not None and request.content_length > cap:
                raise _too_large(cap)
            budget_s -= await _acquire(self._bodies, budget_s)
            self._metrics.bodies_in_flight.inc()
            try:
                data = await self._read(request)
                body = parse_json_object(
                    data, max_depth=self._limits.max_json_depth, max_containers=self._limits.max_json_containers
                )
                await _acquire(self._slots, budget_s)
            finally:
                self._bodies.release()
                self._metrics.bodies_in_flight.dec()
        else:
            await _acquire(self._slots, budget_s)
        try:
            yield body
        finally:
            self._slots.release()

    async def _read(self, request: web.Request) -> bytes:
        cap, timeout_s = self._limits.max_body_bytes, self._limits.body_timeout_s
        data = bytearray()
        try:
            # One deadline for the whole body: a per-read timeout never fires on a byte-a-second trickle.
            async with asyncio.timeout(timeout_s):
                async for piece in request.content.iter_chunked(_READ_PIECE_BYTES):
                    data += piece
                    if len(data) > cap:
                        raise _too_large(cap)
        except TimeoutError:
            raise RouterError(
                408, f"the request body did not arrive within {timeout_s}s", code="request_timeout", close=True
            ) from None
        except ConnectionError:
            raise ClientGone from None
        except aiohttp.ClientPayloadError:
            raise RouterError(400, "the request body was cut short", code="invalid_body", close=True) from None
        return bytes(data)


async def _acquire(semaphore: asyncio.Semaphore, timeout_s: float) -> float:
    """Takes `semaphore` within `timeout_s` (503 overloaded otherwise); returns the seconds waited."""
    started = time.monotonic()
    try:
        async with asyncio.timeout(max(timeout_s, 0.0)):
            await semaphore.acquire()
    except TimeoutError:
        raise RouterError(503, "the router is at capacity", code="overloaded") from None
    return time.monotonic() - started


def _too_large(cap: int) -> RouterError:
    return RouterError(413, f"the request body exceeds {cap} bytes", code="request_too_large", close=True)


def parse_json_object(data: bytes, *, max_depth: int, max_containers: int) -> dict[str, Any]:
    """`data` as a JSON object nested at most `max_depth` deep (the object itself is 1), of at most
    `max_containers` objects and arrays (itself included).

    Raises:
        RouterError: 400 invalid_json (not JSON, not an object), 400 json_too_deep, 400 json_too_large.
    """
    too_deep = RouterError(400, f"the body's JSON nests deeper than {max_depth}", code="json_too_deep")
    try:
        body = json.loads(data)
    except RecursionError:  # the decoder's own limit, far past max_depth
        raise too_deep from None
    except ValueError as exc:  # UnicodeDecodeError too, and integers past Python's digit limit
        raise RouterError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise RouterError(400, "the body must be a JSON object", code="invalid_json")
    # Fewer brackets than both limits can neither nest deeper nor count more (brackets inside
    # strings only over-count): the walk below is skipped for nearly every request.
    if data.count(b"[") + data.count(b"{") <= min(max_depth, max_containers):
        return body
    exceeded = _exceeded(body, max_depth, max_containers)
    if exceeded == "depth":
        raise too_deep
    if exceeded == "containers":
        raise RouterError(
            400, f"the body's JSON has more than {max_containers} objects and arrays", code="json_too_large"
        )
    return body


def _exceeded(value: dict[str, Any] | list[Any], max_depth: int, max_containers: int) -> str | None:
    """Which bound `value` exceeds, "depth" or "containers", or None; iterative, so any depth is safe
    to walk, and it stops at the first container past a bound."""
    stack: list[tuple[dict[str, Any] | list[Any], int]] = [(value, 1)]
    seen = 0
    while stack:
        item, depth = stack.pop()
        seen += 1
        if depth > max_depth:
            return "depth"
        if seen > max_containers:
            return "containers"
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return None
