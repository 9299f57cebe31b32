"""The SDK's bulk path (docs/bulk.md): block bytes of large puts and gets on plain TCP or TLS frames.

gRPC stays the control plane: Lookup, Delete, Stats and Info go over gRPC, and Info says whether
and where the server listens for bulk frames (bulk_port, bulk_host, bulk_tls). BulkTransport
wraps a gRPC transport and moves the bytes of puts and gets of at least `min_bytes` over a small
pool of connections (blocks striped across them), sent with sendmsg from the caller's buffers
and received with recv_into into one buffer per block. The same-host shared-memory path, when on,
is preferred (it moves bytes without a socket).

When the bulk port cannot be reached, a call goes over gRPC instead (counted in `fallbacks`) and
the bulk path is tried again after `retry_after_s`, asking Info again (a restarted server may
listen on another port). A pooled connection the server closed (a restart) is replaced once
within the same call. The call's deadline covers connecting, sending and receiving; the server's
answers (ERROR frames) arrive as the SDK's typed exceptions, as on gRPC.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import grpc

from kvcache_client.connection import TOKEN_ENV, TLSConfig
from kvcache_client.errors import DeadlineExceeded, error_for
from kvcache_client.results import TIER_NAMES, Fetched, LookupResult, PutResult, ServerStats, TierPutResult
from kvcache_client.transport import AsyncGrpcTransport, GrpcTransport
from kvcache_core import bulkwire as bw
from kvcache_core.blockwire import BlockData, data_len
from kvcache_proto import kvcache_pb2 as pb

BULK_ENV = "KVCACHE_BULK"
"""KVCACHE_BULK=0 keeps block bytes on gRPC (as bulk=False does)."""

DEFAULT_MIN_BYTES = 1 << 20
DEFAULT_CONNECTIONS = 2
DEFAULT_REQUEST_BYTES = 64 << 20
"""A put is sent as requests of at most this many bytes (one block when a block is larger): the
server counts each request against its in-flight budget while receiving it."""
DEFAULT_RETRY_AFTER_S = 2.0

T = TypeVar("T")


class BulkUnreachable(Exception):
    """The bulk stream failed (refused, reset, closed, garbled): the call may go over gRPC instead."""


def bearer_token(token: str | None) -> str:
    """The token the client sends: `token`, or the KVCACHE_TOKEN environment variable's, or none ("")."""
    return token if token is not None else os.environ.get(TOKEN_ENV, "")


def env_allows_bulk() -> bool:
    return os.environ.get(BULK_ENV, "1").strip().lower() not in {"0", "false", "no", "off"}


def split_target(target: str) -> tuple[str, int] | None:
    """("host", port) of a plain "host:port" or "[v6]:port" target; None for other gRPC target forms."""
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or "/" in target:
        return None
    return host.strip("[]"), int(port)


def client_tls_context(tls: TLSConfig) -> ssl.SSLContext:
    """The gRPC channel's TLS rules as an ssl context: the server's certificate is always verified."""
    context = ssl.create_default_context(cafile=tls.ca_file)
    if tls.cert_file:
        context.load_cert_chain(tls.cert_file, tls.key_file)
    return context


@dataclass(slots=True)
class BulkCounters:
    """Which path moved this client's block bytes (block bytes only, no framing)."""

    bulk_bytes_sent: int = 0
    bulk_bytes_received: int = 0
    grpc_bytes_sent: int = 0  # the gRPC transport's, its same-host shared-memory path included
    grpc_bytes_received: int = 0
    fallbacks: int = 0  # calls that tried the bulk path and went over gRPC
    reconnects: int = 0  # pooled connections found closed and replaced within a call
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, name: str, n: int) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + n)


class _Conn:
    """One bulk connection, after HELLO/READY. Not thread-safe: the pool lends it to one call."""

    def __init__(self, sock: socket.socket, ready: bw.Ready) -> None:
        self.sock = sock
        self.ready = ready
        self._header = bytearray(bw.HEADER_BYTES)

    @classmethod
    def open(
        cls, address: tuple[str, int], tls: ssl.SSLContext | None, server_name: str, token: str, deadline: float
    ) -> _Conn:
        """Connects, handshakes TLS, sends HELLO and reads READY.

        Raises:
            BulkUnreachable: no connection, TLS or framing failure.
            RPCError: the server refused the HELLO (Unauthenticated, ResourceExhausted, ...).
            DeadlineExceeded: the deadline passed.
        """
        try:
            sock = socket.create_connection(address, timeout=_remaining(deadline))
        except TimeoutError:
            raise DeadlineExceeded(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed connecting to bulk") from None
        except OSError as exc:
            raise BulkUnreachable(f"cannot connect to bulk {address[0]}:{address[1]}: {exc}") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if tls is not None:
                sock = tls.wrap_socket(sock, server_hostname=server_name)
            conn = cls(sock, bw.Ready(1 << 20, 0, 0))
            payload = bw.hello(token)
            conn.send([bw.header(bw.FrameType.HELLO, len(payload)), payload], deadline)
            kind, reply = conn.read_control(deadline)
            if kind is not bw.FrameType.READY:
                raise BulkUnreachable(f"bulk server answered HELLO with {kind.name}")
            conn.ready = bw.parse_ready(reply)
            return conn
        except BaseException:
            sock.close()
            raise

    def close(self) -> None:
        self.sock.close()

    def send(self, buffers: list[bytes | memoryview], deadline: float) -> None:
        self.sock.settimeout(_remaining(deadline))
        try:
            bw.send_buffers(self.sock, buffers)
        except TimeoutError:
            raise _deadline("sending") from None
        except (BrokenPipeError, ConnectionResetError):
            # The server may have refused the request and closed: its ERROR frame says why.
            self.read_control(deadline)
            raise BulkUnreachable("bulk connection closed while sending") from None
        except OSError as exc:
            raise BulkUnreachable(f"bulk send failed: {exc}") from None

    def recv(self, view: memoryview, what: str, deadline: float) -> None:
        self.sock.settimeout(_remaining(deadline))
        try:
            bw.recv_exact(self.sock, view, what)
        except TimeoutError:
            raise _deadline(f"receiving {what}") from None
        except OSError as exc:  # PeerClosed included
            raise BulkUnreachable(f"bulk receive failed: {exc}") from None

    def read_header(self, deadline: float) -> tuple[bw.FrameType, int]:
        self.recv(memoryview(self._header), "a frame header", deadline)
        try:
            kind, length = bw.parse_header(self._header, self.ready.max_frame_bytes)
        except bw.FrameError as exc:
            raise BulkUnreachable(f"bulk server sent garbage: {exc}") from None
        if kind is bw.FrameType.ERROR:
            payload = bytearray(min(length, 1 << 16))
            self.recv(memoryview(payload), "an ERROR frame", deadline)
            code, message = bw.parse_error(bytes(payload))
            raise error_for(_status(code), message)
        return kind, length

    def read_control(self, deadline: float) -> tuple[bw.FrameType, bytes]:
        kind, length = self.read_header(deadline)
        if length > 1 << 20:
            raise BulkUnreachable(f"bulk {kind.name} frame of {length} bytes is not a control frame")
        payload = bytearray(length)
        self.recv(memoryview(payload), f"a {kind.name} frame", deadline)
        return kind, bytes(payload)

    # -- requests ------------------------------------------------------------------------------

    def put(self, namespace: str, items: Sequence[tuple[bytes, BlockData]], deadline: float) -> bw.PutDone:
        sizes = [data_len(d) for _, d in items]
        payload = bw.put(namespace, [(key, n) for (key, _), n in zip(items, sizes, strict=True)])
        buffers: list[bytes | memoryview] = [bw.header(bw.FrameType.PUT, len(payload)), payload]
        for (_, data), n in zip(items, sizes, strict=True):
            buffers.append(bw.header(bw.FrameType.DATA, n))
            buffers.extend(data if isinstance(data, tuple) else (data,))  # type: ignore[arg-type]
        self.send(buffers, deadline)
        kind, reply = self.read_control(deadline)
        if kind is not bw.FrameType.PUT_DONE:
            raise BulkUnreachable(f"bulk server answered PUT with {kind.name}")
        try:
            return bw.parse_put_done(reply)
        except bw.FrameError as exc:
            raise BulkUnreachable(str(exc)) from None

    def get(self, namespace: str, keys: Sequence[bytes], prefix_only: bool, deadline: float) -> dict[int, Fetched]:
        payload = bw.get(namespace, keys, prefix_only)
        self.send([bw.header(bw.FrameType.GET, len(payload)), payload], deadline)
        found: dict[int, Fetched] = {}
        item = bytearray(bw.GET_ITEM.size)
        while True:
            kind, length = self.read_header(deadline)
            if kind is bw.FrameType.GET_DONE:
                payload = bytearray(length)
                self.recv(memoryview(payload), "GET_DONE", deadline)
                if bw.parse_get_done(bytes(payload)) != len(found):
                    raise BulkUnreachable("bulk GET_DONE disagrees with the blocks received")
                return found
            if kind is not bw.FrameType.GET_ITEM or length < bw.GET_ITEM.size:
                raise BulkUnreachable(f"bulk server sent {kind.name} ({length} bytes) within a GET")
            self.recv(memoryview(item), "a GET_ITEM header", deadline)
            index, tier = bw.GET_ITEM.unpack(item)
            if index >= len(keys) or index in found:
                raise BulkUnreachable(f"bulk server sent block {index} of a GET of {len(keys)} keys")
            block = bytearray(length - bw.GET_ITEM.size)
            self.recv(memoryview(block), f"block {index}", deadline)
            found[index] = (memoryview(block).toreadonly(), TIER_NAMES.get(tier, "unknown"))


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise _deadline("waiting")
    return left


def _deadline(doing: str) -> DeadlineExceeded:
    return DeadlineExceeded(grpc.StatusCode.DEADLINE_EXCEEDED, f"deadline passed {doing} on the bulk path")


def _status(code: int) -> grpc.StatusCode:
    for status in grpc.StatusCode:
        if status.value[0] == code:
            return status
    return grpc.StatusCode.UNKNOWN


class BulkPool:
    """Connections to one bulk listener, lent to one call at a time; several run in parallel."""

    def __init__(
        self,
        address: tuple[str, int],
        *,
        token: str,
        tls: ssl.SSLContext | None,
        server_name: str,
        connections: int,
        counters: BulkCounters,
    ) -> None:
        self.address = address
        self._token = token
        self._tls = tls
        self._server_name = server_name
        self.connections = connections
        self._counters = counters
        self._idle: list[_Conn] = []
        self._lock = threading.Lock()
        self._closed = False
        self._executor = ThreadPoolExecutor(max_workers=connections, thread_name_prefix="kvcache-bulk")

    def run(self, op: Callable[[_Conn], T], deadline: float) -> T:
        """Runs `op` on a pooled (or new) connection; one whose server went away is replaced once.

        A connection that failed in any way is closed, never returned to the pool.
        """
        for attempt in (0, 1):
            with self._lock:
                conn = self._idle.pop() if self._idle and attempt == 0 else None
            reused = conn is not None
            if conn is None:
                conn = _Conn.open(self.address, self._tls, self._server_name, self._token, deadline)
            try:
                result = op(conn)
            except BulkUnreachable:
                conn.close()
                if reused and attempt == 0:  # the server closed it (a restart?): so it did the others
                    self._counters.add("reconnects", 1)
                    self._drop_idle()
                    continue
                raise
            except BaseException:
                conn.close()
                raise
            with self._lock:
                if self._closed:
                    conn.close()
                else:
                    self._idle.append(conn)
            return result
        raise AssertionError("unreachable")

    def parallel(self, ops: list[Callable[[_Conn], T]], deadline: float) -> list[T]:
        """Runs each op on its own connection, at once; raises the first failure (after all ended)."""
        if len(ops) == 1:
            return [self.run(ops[0], deadline)]
        futures = [self._executor.submit(self.run, op, deadline) for op in ops]
        errors = [f.exception() for f in futures]
        for exc in errors:
            if exc is not None and not isinstance(exc, BulkUnreachable):
                raise exc
        for exc in errors:
            if exc is not None:
                raise exc
        return [f.result() for f in futures]

    def _drop_idle(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._drop_idle()
        self._executor.shutdown(wait=False)


def stripes(sizes: Sequence[int], n: int, request_bytes: int) -> list[list[list[int]]]:
    """Item indices per connection (at most n), each as requests of about request_bytes at most:
    items go to the least loaded connection, largest first, so connections carry similar bytes."""
    n = max(1, min(n, len(sizes)))
    loads = [0] * n
    lanes: list[list[int]] = [[] for _ in range(n)]
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        lane = loads.index(min(loads))
        lanes[lane].append(i)
        loads[lane] += sizes[i]
    out: list[list[list[int]]] = []
    for lane in lanes:
        requests: list[list[int]] = []
        size = 0
        for i in sorted(lane):
            if requests and size + sizes[i] <= request_bytes:
                requests[-1].append(i)
                size += sizes[i]
            else:
                requests.append([i])
                size = sizes[i]
        if requests:
            out.append(requests)
    return out


class BulkLink:
    """Whether this client uses the bulk path, its pool, and which path moved the bytes.

    States: "unknown" until Info was asked, "on", "down" (unreachable; retried after retry_after_s)
    or "off" (disabled, the server has no bulk port, or a target form the SDK cannot parse).
    """

    def __init__(
        self,
        target: str,
        *,
        token: str,
        tls: TLSConfig | bool,
        enabled: bool = True,
        connections: int = DEFAULT_CONNECTIONS,
        min_bytes: int = DEFAULT_MIN_BYTES,
        request_bytes: int = DEFAULT_REQUEST_BYTES,
        retry_after_s: float = DEFAULT_RETRY_AFTER_S,
    ) -> None:
        if connections < 1:
            raise ValueError("bulk connections must be at least 1")
        self.counters = BulkCounters()
        self.state = "unknown" if enabled and env_allows_bulk() else "off"
        self.reason = "" if self.state == "unknown" else "disabled by the client"
        self._target = split_target(target)
        self._token = token
        self._tls = TLSConfig() if tls is True else tls or None
        self.connections = connections
        self.min_bytes = min_bytes
        self.request_bytes = request_bytes
        self.retry_after_s = retry_after_s
        self._retry_at = 0.0
        self.pool: BulkPool | None = None
        self._lock = threading.Lock()

    @property
    def needs_info(self) -> bool:
        """Info must be asked (again) before the next call decides."""
        return self.state == "unknown" or (self.state == "down" and time.monotonic() >= self._retry_at)

    def configure(self, info: pb.InfoResponse | None, shm_on: bool) -> None:
        """Takes the server's Info answer: on when it advertises a bulk port this client can reach."""
        with self._lock:
            if self.pool is not None:
                self.pool.close()
                self.pool = None
            if info is None or not info.bulk_port:
                self._off("the server has no bulk port")
                return
            if self._target is None:
                self._off("the gRPC target is not host:port")
                return
            if shm_on:
                self._off("the same-host shared-memory path is on")
                return
            if info.bulk_tls and self._tls is None:
                self._off("the server's bulk port wants TLS, this client is plaintext")
                return
            host = info.bulk_host or self._target[0]
            tls = self._tls
            self.pool = BulkPool(
                (host, info.bulk_port),
                token=self._token,
                tls=client_tls_context(tls) if tls is not None and info.bulk_tls else None,
                server_name=(tls.server_name if tls is not None and tls.server_name else host),
                connections=self.connections,
                counters=self.counters,
            )
            self.state, self.reason = "on", ""

    def _off(self, reason: str) -> None:
        self.state, self.reason = "off", reason

    def usable(self, nbytes: int) -> BulkPool | None:
        """The pool to move `nbytes` with, or None (use gRPC)."""
        if nbytes < self.min_bytes or self.state != "on":
            return None
        return self.pool

    def down(self, reason: str) -> None:
        """The bulk path failed: gRPC until retry_after_s has passed, then Info again."""
        with self._lock:
            self.state, self.reason = "down", reason
            self._retry_at = time.monotonic() + self.retry_after_s
            self.counters.fallbacks += 1

    # -- the two data calls, blocking (the async transport runs them in a worker thread) ----------

    def put(
        self, pool: BulkPool, namespace: str, items: Sequence[tuple[bytes, BlockData]], timeout_s: float
    ) -> PutResult:
        deadline = time.monotonic() + timeout_s
        sizes = [data_len(d) for _, d in items]

        def lane(requests: list[list[int]]) -> Callable[[_Conn], list[bw.PutDone]]:
            return lambda conn: [conn.put(namespace, [items[i] for i in r], deadline) for r in requests]

        lanes = stripes(sizes, pool.connections, self.request_bytes)
        done = [d for per_lane in pool.parallel([lane(r) for r in lanes], deadline) for d in per_lane]
        self.counters.add("bulk_bytes_sent", sum(sizes))
        return _put_result(done)

    def get(
        self, pool: BulkPool, namespace: str, keys: Sequence[bytes], prefix_only: bool, timeout_s: float
    ) -> list[Fetched | None]:
        deadline = time.monotonic() + timeout_s
        n = 1 if prefix_only else max(1, min(pool.connections, len(keys)))  # prefix_only: one ordered stream
        bounds = [len(keys) * i // n for i in range(n + 1)]

        def lane(lo: int, hi: int) -> Callable[[_Conn], dict[int, Fetched]]:
            return lambda conn: {lo + i: f for i, f in conn.get(namespace, keys[lo:hi], prefix_only, deadline).items()}

        parts = pool.parallel([lane(bounds[i], bounds[i + 1]) for i in range(n) if bounds[i] < bounds[i + 1]], deadline)
        found: dict[int, Fetched] = {k: v for part in parts for k, v in part.items()}
        self.counters.add("bulk_bytes_received", sum(len(d) for d, _ in found.values()))
        return [found.get(i) for i in range(len(keys))]

    def close(self) -> None:
        with self._lock:
            if self.pool is not None:
                self.pool.close()
                self.pool = None


def _put_result(done: list[bw.PutDone]) -> PutResult:
    tiers: dict[int, list[int]] = {}
    for d in done:
        for kind, *counts in d.tiers:
            total = tiers.setdefault(kind, [0] * 5)
            for j, c in enumerate(counts):
                total[j] += c
    return PutResult(
        sum(d.stored for d in done),
        sum(d.rejected for d in done),
        sum(d.received for d in done),
        tuple(TierPutResult(TIER_NAMES.get(k, "unknown"), *c) for k, c in tiers.items()),
    )


# -- transports ---------------------------------------------------------------------------------


class BulkTransport:
    """A blocking transport: gRPC for control calls and small transfers, bulk frames for large ones."""

    def __init__(self, grpc_transport: GrpcTransport, link: BulkLink) -> None:
        self._grpc = grpc_transport
        self.link = link
        self.shm = grpc_transport.shm

    def _pool(self, nbytes: int, timeout_s: float) -> BulkPool | None:
        if self.link.needs_info:
            refresh = self.link.state == "down"
            self.link.configure(self._grpc.info(timeout_s, refresh=refresh), self._grpc.shm.on)
        return self.link.usable(nbytes)

    def lookup(self, namespace: str, keys: Sequence[bytes], timeout_s: float) -> LookupResult:
        return self._grpc.lookup(namespace, keys, timeout_s)

    def put(self, namespace: str, items: Sequence[tuple[bytes, BlockData]], timeout_s: float) -> PutResult:
        nbytes = sum(data_len(d) for _, d in items)
        start = time.monotonic()
        pool = self._pool(nbytes, timeout_s)
        if pool is not None:
            try:
                return self.link.put(pool, namespace, items, timeout_s - (time.monotonic() - start))
            except BulkUnreachable as exc:
                self.link.down(str(exc))
        result = self._grpc.put(namespace, items, timeout_s - (time.monotonic() - start))
        self.link.counters.add("grpc_bytes_sent", nbytes)
        return result

    def get(self, namespace: str, keys: Sequence[bytes], prefix_only: bool, timeout_s: float) -> list[Fetched | None]:
        start = time.monotonic()
        pool = self._pool(self.link.min_bytes, timeout_s)  # a get's size is known only once it is answered
        if pool is not None:
            try:
                return self.link.get(pool, namespace, keys, prefix_only, timeout_s - (time.monotonic() - start))
            except BulkUnreachable as exc:
                self.link.down(str(exc))
        fetched = self._grpc.get(namespace, keys, prefix_only, timeout_s - (time.monotonic() - start))
        self.link.counters.add("grpc_bytes_received", sum(len(f[0]) for f in fetched if f is not None))
        return fetched

    def delete(self, namespace: str, keys: Sequence[bytes], timeout_s: float) -> int:
        return self._grpc.delete(namespace, keys, timeout_s)

    def stats(self, timeout_s: float) -> ServerStats:
        return self._grpc.stats(timeout_s)

    def close(self) -> None:
        self.link.close()
        self._grpc.close()


class AsyncBulkTransport:
    """The asyncio counterpart: the bulk calls run in a worker thread (blocking sockets, GIL-free
    recv_into/sendmsg), bounded by the call's deadline; a cancelled call's thread ends by then."""

    def __init__(self, grpc_transport: AsyncGrpcTransport, link: BulkLink) -> None:
        self._grpc = grpc_transport
        self.link = link
        self.shm = grpc_transport.shm

    async def _pool(self, nbytes: int, timeout_s: float) -> BulkPool | None:
        if self.link.needs_info:
            refresh = self.link.state == "down"
            self.link.configure(await self._grpc.info(timeout_s, refresh=refresh), self._grpc.shm.on)
        return self.link.usable(nbytes)

    async def lookup(self, namespace: str, keys: Sequence[bytes], timeout_s: float) -> LookupResult:
        return await self._grpc.lookup(namespace, keys, timeout_s)

    async def put(self, namespace: str, items: Sequence[tuple[bytes, BlockData]], timeout_s: float) -> PutResult:
        nbytes = sum(data_len(d) for _, d in items)
        start = time.monotonic()
        pool = await self._pool(nbytes, timeout_s)
        if pool is not None:
            try:
                left = timeout_s - (time.monotonic() - start)
                return await asyncio.to_thread(self.link.put, pool, namespace, items, left)
            except BulkUnreachable as exc:
                self.link.down(str(exc))
        result = await self._grpc.put(namespace, items, timeout_s - (time.monotonic() - start))
        self.link.counters.add("grpc_bytes_sent", nbytes)
        return result

    async def get(
        self, namespace: str, keys: Sequence[bytes], prefix_only: bool, timeout_s: float
    ) -> list[Fetched | None]:
        start = time.monotonic()
        pool = await self._pool(self.link.min_bytes, timeout_s)
        if pool is not None:
            try:
                left = timeout_s - (time.monotonic() - start)
                return await asyncio.to_thread(self.link.get, pool, namespace, keys, prefix_only, left)
            except BulkUnreachable as exc:
                self.link.down(str(exc))
        fetched = await self._grpc.get(namespace, keys, prefix_only, timeout_s - (time.monotonic() - start))
        self.link.counters.add("grpc_bytes_received", sum(len(f[0]) for f in fetched if f is not None))
        return fetched

    async def delete(self, namespace: str, keys: Sequence[bytes], timeout_s: float) -> int:
        return await self._grpc.delete(namespace, keys, timeout_s)

    async def stats(self, timeout_s: float) -> ServerStats:
        return await self._grpc.stats(timeout_s)

    async def close(self) -> None:
        self.link.close()
        await self._grpc.close()
