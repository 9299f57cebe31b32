"""The SDK's bulk path (docs/bulk.md): block bytes of puts and gets on plain TCP or TLS frames.

gRPC stays the control plane: Delete, Stats and Info go over gRPC, and Info says whether and
where the server listens for bulk frames (bulk_port, bulk_host, bulk_tls). Lookups take the bulk
port whenever the server has one (one socket round trip, answered in the server's connection
thread when RAM decides it, against a gRPC call's ~1 ms of CPU on both sides). BulkTransport
wraps a gRPC transport and moves the bytes of puts (of at least `min_bytes`, 0 by default) and gets over a small
pool of connections (blocks striped across them), sent with sendmsg from the caller's buffers
and received with recv_into into one buffer per block (kvcache_client.bufpool's: warm memory once
an earlier call's blocks were dropped). The same-host shared-memory path, when on, is preferred
(it moves bytes without a socket).

When the bulk port cannot be reached, a call goes over gRPC instead (counted in `fallbacks`) and
the bulk path is tried again after `retry_after_s`, asking Info again (a restarted server may
listen on another port). A pooled connection the server closed (a restart) is replaced once
within the same call. The call's deadline covers connecting, sending and receiving; the server's
answers (ERROR frames) arrive as the SDK's typed exceptions, as on gRPC.

Longer than the project's 500-line guideline: BulkLink (the path's state and its two data calls) and
the blocking and asyncio transports over it are kept together, since each face's methods mirror the
other's line for line (the asyncio one runs the same BulkLink calls in worker threads) and read best
side by side; the socket work itself is kvcache_client.bulkconn's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import grpc

from kvcache_client.arena import Leased
from kvcache_client.bufpool import BufferPool
from kvcache_client.bulkconn import BulkConnection, BulkCounters, BulkPool, BulkUnreachable, Received, stripes
from kvcache_client.connection import TOKEN_ENV, TLSConfig
from kvcache_client.errors import RPCError
from kvcache_client.inplace_core import BulkRefusal
from kvcache_client.local_reads import land_blocks, land_plan, plan, plan_blocks
from kvcache_client.results import (
    TIER_NAMES,
    Fetched,
    LookupResult,
    PrefetchResult,
    PutResult,
    ServerStats,
    TierPutResult,
)
from kvcache_client.sealing import MIN_FALLBACK_S, encoded_off_loop, payload_items, sealed_ranges, wait_out
from kvcache_client.shm import MIN_PUT_BYTES, run_to_end
from kvcache_client.transport import AsyncGrpcTransport, GrpcTransport
from kvcache_core import bulkwire as bw
from kvcache_core.blockwire import BlockData, Buffer, ShmRange, data_len
from kvcache_proto import kvcache_pb2 as pb

T = TypeVar("T")

BULK_ENV = "KVCACHE_BULK"
"""KVCACHE_BULK=0 keeps block bytes on gRPC (as bulk=False does)."""

DEFAULT_MIN_BYTES = 0
"""Remote puts of at least this many bytes take the bulk port (gets always do): every put, since one bulk
PUT (one round trip, its budget and slots reserved in one trip to the server's loop) beats a gRPC Put stream
at every size. Measured, remote puts of 16 KiB blocks on this 2-core machine, p50: 1 block 0.88 ms against
1.55 over gRPC, 8 blocks 1.96 against 3.05, 20 blocks 2.14 against 3.45."""
DEFAULT_CONNECTIONS = 2
DEFAULT_REQUEST_BYTES = 64 << 20
SAME_HOST_BULK_PUT_BYTES = 1 << 20
"""A same-host put of less than this goes over the bulk port (one round trip, the server receiving
straight into slots), not through a segment and a gRPC Put: 20 x 16 KiB took 3.5 ms against 6.1,
64 x 16 KiB 8.7 against 11.2 on this 2-core machine (the per-call and per-block costs, not the
bytes, set a small put's time). Larger ones keep the segment, which moves bytes 2-3x faster."""
SAME_HOST_BULK_GET_BYTES = 4 << 20
"""A same-host get expected to move less than this (its keys times the mean block of the last get)
is one bulk GET, its payloads received into the caller's memory and verified there, not a LEASE,
the verify and copy out of the arena, and a RELEASE: one round trip instead of two. get_into of
16 KiB blocks, p50: 1 key 0.45 ms against 0.81, 8 keys 0.88 against 1.37, 32 keys 2.29 against
3.06; 4 x 1 MiB 2.01 against 2.94; 4 x 4 MiB even (11.1 ms both), on this 2-core machine."""
LANE_MIN_BYTES = 4 << 20
"""A get is spread over as many connections as it is expected to move this many bytes (at most
bulk_connections)."""
PUT_LANE_MIN_BYTES = 32 << 20
"""A put is spread over as many connections as it has this many bytes (at most bulk_connections).
Measured 2026-12-06 on this 2-core VM, remote puts (median of 15), one connection against two:
16 x 2 MiB 2.15-2.39 GB/s against 1.60-1.82, 8 x 1 MiB 1.96-2.03 against 1.34-1.37, 4 x 32 MiB
2.40-2.52 against 2.08-2.27 (the client's and the server's threads of a second lane contend for the
same two cores); an earlier host measured two faster for 4 x 32 MiB (4.37 against 3.52 GB/s), so
a put of 64 MiB or more still takes two."""
"""A put is sent as requests of at most this many bytes (one block when a block is larger): the
server counts each request against its in-flight budget while receiving it."""
DEFAULT_RETRY_AFTER_S = 2.0


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


log = logging.getLogger(__name__)

_SHM_ON = "the same-host shared-memory path is on"


PUT_MEM_FRAME_BYTES = 128 << 20
"""A PUT_MEM frame stops taking blocks once it names this many bytes: what the server reserves in its
arena at once for one frame (a RAM tier with no room for that now answers ABORTED, and the SDK puts the
blocks through gRPC, 64 MiB a message). Twice a gRPC Put's message: each frame's blocks are read in
lanes that all end before its commit, so every frame ends on its slowest lane. 4 x 32 MiB as one frame
of four blocks instead of two of two: 22.98 against 25.40 ms p50 (this 2-core VM, one client
alternating, 2026-12-07); 64 x 2 MiB 24.33 against 25.62 ms; 16 x 2 MiB (one frame either way) the same."""


def put_mem_frames(
    refs: Sequence[tuple[bytes, ShmRange]], frame_limit: int | None = None, fixed: int = 0
) -> list[list[tuple[bytes, ShmRange]]]:
    """A PUT_MEM's blocks in frames, each taking blocks until it names PUT_MEM_FRAME_BYTES: the server
    reserves a frame's slots at once and reads its blocks in lanes, one block per lane at most. With
    `frame_limit` (the server's control frame limit, from its READY), a frame also stops before its
    encoding (`fixed` bytes, then an entry and a head per block) would pass it: many small blocks."""
    groups: list[list[tuple[bytes, ShmRange]]] = [[]]
    size = 0
    encoded = fixed
    for key, ref in refs:
        entry = bw.PUT_MEM_ENTRY_BYTES + len(ref.head)
        full = size >= PUT_MEM_FRAME_BYTES or (frame_limit is not None and encoded + entry > frame_limit)
        if groups[-1] and full:
            groups.append([])
            size = 0
            encoded = fixed
        groups[-1].append((key, ref))
        size += ref.block_length
        encoded += entry
    return groups


_PUT_MEM_ELSEWHERE = frozenset(
    {
        grpc.StatusCode.ABORTED,  # a sealed block read too late, from another clock, or no room for the slots now
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.DATA_LOSS,  # sealed: a server that took the zero for a checksum
        grpc.StatusCode.FAILED_PRECONDITION,  # the registration is gone (a restart), or no segment socket
    }
)
"""A PUT_MEM refused so is put again through gRPC (GrpcTransport.put, put_payloads), within what is
left of the caller's deadline; any other refusal is the put's outcome."""


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
        buffers: BufferPool | None = None,
    ) -> None:
        if connections < 1:
            raise ValueError("bulk connections must be at least 1")
        self.counters = BulkCounters()
        self.buffers = BufferPool() if buffers is None else buffers  # where gets receive blocks into
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
        self.lease_pool: BulkPool | None = None
        """Same host (shared memory on): where LEASE, RELEASE and TOUCH go (InPlaceCalls.bulk); None: gRPC."""
        self._block_bytes = 0  # the mean block size of the last get that found any (its lanes)
        self.same_host_put_bytes = SAME_HOST_BULK_PUT_BYTES  # 0: every same-host put through a segment
        self.same_host_get_bytes = SAME_HOST_BULK_GET_BYTES  # 0: every same-host get leases in place
        self.read_in_place = True  # get_into copies straight out of the arena where blocks are located
        self.puts_mem = False  # same-host puts out of this process's memory go as PUT_MEM frames (Info.bulk_put_mem)
        self._lock = threading.Lock()

    @property
    def needs_info(self) -> bool:
        """Info must be asked (again) before the next call decides."""
        return self.state == "unknown" or (self.state == "down" and time.monotonic() >= self._retry_at)

    def configure(self, info: pb.InfoResponse | None, shm_on: bool) -> None:
        """Takes the server's Info answer: on when it advertises a bulk port this client can reach.
        Concurrent calls that all asked Info: the first one's answer is taken, the others are ignored."""
        with self._lock:
            if not self.needs_info:
                return
            for pool in (self.pool, self.lease_pool):
                if pool is not None:
                    pool.close()
            self.pool = self.lease_pool = None
            if info is None or not info.bulk_port:
                self._off("the server has no bulk port")
                return
            if self._target is None:
                self._off("the gRPC target is not host:port")
                return
            if info.bulk_tls != (self._tls is not None):  # never a token in clear from a TLS client
                self._off(f"the bulk port is {'TLS' if info.bulk_tls else 'plaintext'}, this client is not")
                return
            host = info.bulk_host or self._target[0]
            tls = self._tls
            pool = BulkPool(
                (host, info.bulk_port),
                token=self._token,
                tls=client_tls_context(tls) if tls is not None else None,
                server_name=(tls.server_name if tls is not None and tls.server_name else host),
                connections=self.connections,
                counters=self.counters,
            )
            if shm_on:  # blocks move through shared memory; the port carries the in-place reads' leases
                self.lease_pool = pool
                self.puts_mem = info.bulk_put_mem  # and puts out of this process's memory (PUT_MEM)
                self._off(_SHM_ON)  # reconsidered once shared memory turns off (reconsider)
                return
            self.pool = pool
            self.state, self.reason = "on", ""

    def _off(self, reason: str) -> None:
        self.state, self.reason = "off", reason

    def reconsider(self, shm_on: bool) -> None:
        """Off only because shared memory was on, which it no longer is (a server whose shm directory
        exists here but is not its own turns it off at the first call): ask Info again."""
        if self.state == "off" and self.reason == _SHM_ON and not shm_on:
            with self._lock:
                if self.state == "off" and self.reason == _SHM_ON:
                    self.state, self.reason = "unknown", ""

    def usable(self, nbytes: int) -> BulkPool | None:
        """The pool to move `nbytes` with, or None (use gRPC)."""
        if nbytes < self.min_bytes or self.state != "on":
            return None
        return self.pool

    def info_failed(self, exc: grpc.RpcError) -> None:
        """Info failed for a Lookup: gRPC until retry_after_s has passed (no Info per Lookup meanwhile)."""
        log.debug("bulk port: Info failed (%s); gRPC for now", exc.code())
        with self._lock:
            if self.needs_info:
                self.state, self.reason = "down", f"Info failed: {exc.code().name}"
                self._retry_at = time.monotonic() + self.retry_after_s

    def down(self, reason: str) -> None:
        """The bulk path failed: gRPC until retry_after_s has passed, then Info again."""
        with self._lock:
            self.state, self.reason = "down", reason
            self._retry_at = time.monotonic() + self.retry_after_s
            self.counters.add("fallbacks", 1)

    # -- the two data calls, blocking (the async transport runs them in a worker thread) ----------

    def put(
        self, pool: BulkPool, namespace: str, items: Sequence[tuple[bytes, BlockData]], timeout_s: float
    ) -> PutResult:
        deadline = time.monotonic() + timeout_s
        sizes = [data_len(d) for _, d in items]

        def lane(requests: list[list[int]]) -> Callable[[BulkConnection], list[bw.PutDone]]:
            return lambda conn: [conn.put(namespace, [items[i] for i in r], deadline) for r in requests]

        # Parallel connections only where each has megabytes to move: a small put on two lanes took
        # 5.0 ms against 2.8 ms on one (20 x 16 KiB; two session threads, the loop and the client's
        # pool threads contending for two cores and the GILs).
        wide = max(1, min(pool.connections, sum(sizes) // PUT_LANE_MIN_BYTES))
        lanes = stripes(sizes, wide, self.request_bytes)
        done = [d for per_lane in pool.parallel([lane(r) for r in lanes], deadline) for d in per_lane]
        self.counters.add("bulk_bytes_sent", sum(sizes))
        return _put_result(done)

    def put_mem(
        self, pool: BulkPool, namespace: str, refs: Sequence[tuple[bytes, ShmRange]], timeout_s: float
    ) -> PutResult:
        """Blocks the server reads out of this process's memory (ProcessLink's ranges, all of one
        registration), as PUT_MEM frames one after the other on one connection, each taking blocks
        until it names PUT_MEM_FRAME_BYTES (what the server reserves at once) or its encoding would
        pass the server's control frame limit: 4 x 32 MiB is one frame of four blocks, read in two
        lanes (one block a frame, one lane each, took 50 ms p50 here against 30 through gRPC). One
        frame at a time: a put that fails has at most one frame the server may still be reading."""
        deadline = time.monotonic() + timeout_s
        process = refs[0][1].segment
        fixed = len(bw.put_mem(namespace, process, []))

        def frames(conn: BulkConnection) -> list[bw.PutDone]:
            limit = bw.control_limit(conn.ready.max_keys_per_request)
            return [conn.put_mem(namespace, process, g, deadline) for g in put_mem_frames(refs, limit, fixed)]

        done = pool.run(frames, deadline)
        self.counters.add("put_mem_bytes", sum(ref.block_length for _, ref in refs))
        return _put_result(done)

    def get(
        self, pool: BulkPool, namespace: str, keys: Sequence[bytes], prefix_only: bool, timeout_s: float
    ) -> list[Fetched | None]:
        found = self.get_into(pool, namespace, keys, prefix_only, timeout_s).found
        return [found.get(i) for i in range(len(keys))]

    def get_into(
        self,
        pool: BulkPool,
        namespace: str,
        keys: Sequence[bytes],
        prefix_only: bool,
        timeout_s: float,
        sinks: Sequence[memoryview | None] = (),
    ) -> Received:
        """A GET striped over lanes; blocks with a sink (by index into `keys`) received into it and
        verified there (BulkConnection.get_into), the others into this client's buffers."""
        deadline = time.monotonic() + timeout_s
        n = 1 if prefix_only else self._get_lanes(pool, len(keys))  # prefix_only: one ordered stream
        bounds = [len(keys) * i // n for i in range(n + 1)]

        def lane(lo: int, hi: int) -> Callable[[BulkConnection], Received]:
            def received(conn: BulkConnection) -> Received:
                got = conn.get_into(namespace, keys[lo:hi], prefix_only, deadline, self.buffers, sinks[lo:hi])
                return got.shifted(lo)

            return received

        parts = pool.parallel([lane(bounds[i], bounds[i + 1]) for i in range(n) if bounds[i] < bounds[i + 1]], deadline)
        got = Received()
        for part in parts:
            got.found.update(part.found)
            got.landed.update(part.landed)
            got.damaged.update(part.damaged)
            got.landed_bytes += part.landed_bytes
        received = sum(len(d) for d, _ in got.found.values())
        landed = got.landed_bytes
        self.counters.add("bulk_bytes_received", received + landed)
        self.counters.add("bulk_bytes_landed", landed)
        if got.count:
            self._block_bytes = (received + landed) // got.count
        return got

    def _get_lanes(self, pool: BulkPool, nkeys: int) -> int:
        """Connections a get of `nkeys` is spread over: as for a put, one per LANE_MIN_BYTES it is
        expected to move, its blocks taken to be the size of the last get's; all of them (at most one
        per key) before any get answered. Small blocks on one lane: 8 x 16 KiB took 1.2-1.3 ms on two
        lanes (a worker thread's hand-off and two sessions for 128 KiB)."""
        lanes = min(pool.connections, nkeys)
        if self._block_bytes:
            lanes = min(lanes, nkeys * self._block_bytes // LANE_MIN_BYTES)
        return max(1, lanes)

    def lookup_pool(self) -> BulkPool | None:
        """Where Lookups go: the bulk port whenever this client reaches it (the blocks' pool, or on
        the same host the leases' pool); None: gRPC."""
        return self.pool if self.state == "on" else self.lease_pool

    def lookup(self, pool: BulkPool, namespace: str, keys: Sequence[bytes], timeout_s: float) -> LookupResult:
        """A Lookup over the bulk port. A refusal (an ERROR frame, a deadline) is raised as the gRPC
        Lookup's status would be (BulkRefusal), so that it is retried or mapped as that one;
        BulkUnreachable: the port failed (the caller takes gRPC)."""
        deadline = time.monotonic() + timeout_s
        try:
            tiers = pool.run(lambda conn: conn.lookup(namespace, keys, deadline), deadline)
        except RPCError as exc:
            raise BulkRefusal(exc.code, exc.details) from None
        self.counters.add("bulk_lookups", 1)
        return LookupResult(len(tiers), tuple(TIER_NAMES.get(t, "unknown") for t in tiers))

    def unreachable(self, pool: BulkPool, reason: str) -> None:
        """`pool` failed: the blocks' pool goes down (gRPC until retry_after_s), the leases' pool off."""
        if pool is self.lease_pool:
            self.lease_down(reason)
        else:
            self.down(reason)

    def close(self) -> None:
        with self._lock:
            for pool in (self.pool, self.lease_pool):
                if pool is not None:
                    pool.close()
            self.pool = self.lease_pool = None

    def get_in_place(
        self,
        pool: BulkPool | None,
        same_host: GrpcTransport | AsyncGrpcTransport,
        namespace: str,
        keys: Sequence[bytes],
        sinks: Sequence[memoryview | None],
        timeout_s: float,
    ) -> Received:
        """get_into's blocks copied straight out of the server's arena where its presence index locates
        every one, each verified where it landed, and named to the server in one TOUCH on `pool` (the
        leases' pool: kvcache_client.local_reads). `same_host` is the gRPC transport whose Info answer
        mapped the arena and the index: they are paired only while that answer named the arena mapped.
        Empty (the usual path then) without such a pool, with a key not located, or a block that does
        not verify. A TOUCH the server refuses raises its status, as the Get would have (a client
        without a token waits only for the first of a namespace on a connection: nothing in later
        ones can be refused, BulkConnection.touch_may_go_unanswered); a port that fails takes the
        leases' pool down and the usual path.

        Raises:
            RPCError: the server refused the TOUCH (PermissionDenied without the read right, ...).
        """
        presence, info = same_host.presence, same_host.info_response
        if pool is None or info is None or not self.read_in_place or not presence.locates:
            return Received()
        copies = plan(presence, same_host.arena, info.arena_path, namespace, keys, sinks)
        if copies is None:
            return Received()

        def wipe() -> None:  # the TOUCH was refused: nothing copied is the caller's to keep
            for _, _, sink, _ in copies.jobs:
                sink[:] = bytes(len(sink))

        try:
            got = self._touched(pool, namespace, keys, lambda: land_plan(copies, presence), wipe, timeout_s)
        except BulkUnreachable as exc:
            self.lease_down(str(exc))
            return Received()
        if got.landed:
            presence.counters.read_in_place += len(got.landed)
        else:
            presence.counters.read_again += 1
        return got

    def blocks_in_place(
        self,
        pool: BulkPool | None,
        same_host: GrpcTransport | AsyncGrpcTransport,
        namespace: str,
        keys: Sequence[bytes],
        timeout_s: float,
    ) -> list[memoryview] | None:
        """get_many's blocks copied straight out of the server's arena, as get_in_place copies
        get_into's, each whole block into a buffer of the client's pool (`same_host.buffers`) and its
        payload verified there as it lands: one pass, where the lease path copies, then verifies in a
        second, after a LEASE and before a RELEASE. None (the usual path then) where get_in_place
        would take it.

        Raises:
            RPCError: the server refused the TOUCH, as get_in_place.
        """
        presence, info = same_host.presence, same_host.info_response
        if pool is None or info is None or not self.read_in_place or not presence.locates:
            return None
        copies = plan_blocks(presence, same_host.arena, info.arena_path, namespace, keys, same_host.buffers.take)
        if copies is None:
            return None
        try:
            got = self._touched(pool, namespace, keys, lambda: land_blocks(copies, presence), lambda: None, timeout_s)
        except BulkUnreachable as exc:
            self.lease_down(str(exc))
            return None
        if got is not None:
            presence.counters.read_in_place += len(got)
        else:
            presence.counters.read_again += 1
        return got

    def _touched(
        self,
        pool: BulkPool,
        namespace: str,
        keys: Sequence[bytes],
        copy: Callable[[], T],
        wipe: Callable[[], None],
        timeout_s: float,
    ) -> T:
        """copy() with the keys named to the server in one TOUCH on `pool`, whose answer is read after
        the copies (one round trip, overlapped with them); wipe() where the TOUCH is refused.

        Raises:
            RPCError: the server refused the TOUCH.
            BulkUnreachable: the port failed.
        """
        deadline = time.monotonic() + timeout_s

        def touched(conn: BulkConnection) -> T:
            # The TOUCH goes first and its answer is read after the copies: one round trip, overlapped
            # with them. Once a TOUCH of this namespace was answered on this (tokenless, open)
            # connection, the answer waits for the connection's next request: no round trip at all.
            # Should the copies not hold (a slot reused meanwhile, rare), the usual path reads the
            # keys again and the server counts them read twice.
            ahead = conn.touch_may_go_unanswered(namespace, deadline)
            conn.send_touch(namespace, keys, deadline)
            if ahead:  # owed from here on, whatever the copies do
                conn.touch_unanswered(self.counters)
            got = copy()
            if ahead:
                return got
            try:
                conn.read_touched(namespace, deadline)
            except BaseException:  # refused (the read right), or no answer: not the caller's to keep
                wipe()
                raise
            return got

        return pool.run(touched, deadline)

    def small_same_host_pool(self, nkeys: int) -> BulkPool | None:
        """The pool a same-host get of `nkeys` goes to as a bulk GET (SAME_HOST_BULK_GET_BYTES), or
        None: it leases in place (a large get, a block size not seen yet, no bulk port)."""
        expected = nkeys * self._block_bytes
        if not expected or expected >= self.same_host_get_bytes:
            return None
        return self.lease_pool

    def saw_blocks(self, blocks: Sequence[Fetched | None]) -> None:
        """A get's blocks (leased in place or not): their mean size sizes the next get's path."""
        sizes = [len(b[0]) for b in blocks if b is not None]
        if sizes:
            self._block_bytes = sum(sizes) // len(sizes)

    def lease_down(self, reason: str) -> None:
        """The bulk port failed a LEASE or RELEASE: gRPC's LeaseGet until Info is asked again."""
        with self._lock:
            if self.lease_pool is not None:
                self.lease_pool.close()
                self.lease_pool = None
            self.counters.add("fallbacks", 1)
            log.info("in-place leases over gRPC from now on: %s", reason)


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
        self.inner = grpc_transport  # the gRPC transport: control calls, small transfers, the fallback
        self.link = link
        self.shm = grpc_transport.shm
        self.arena = grpc_transport.arena  # same host: the server's block arena (docs/arena.md)
        self.presence = grpc_transport.presence  # same host: Lookups without an RPC (docs/presence.md)
        inplace = grpc_transport._inplace
        inplace.bulk, inplace.bulk_down = self._lease_pool, link.lease_down

    def _lease_pool(self, timeout_s: float) -> BulkPool | None:
        """Where the in-place reads' leases go: the bulk port, when the server has one (Info)."""
        if self.link.needs_info:
            self._ask_info(timeout_s)
        return self.link.lease_pool

    def _ask_info(self, timeout_s: float, *, lookup: bool = False) -> None:
        """Info decides the path. An Info that fails (its rate bucket spent, a deadline): a Lookup
        goes over gRPC, which needs no Info, and its own status is the one the caller sees (the bulk
        link down until retry_after_s, so no Info per Lookup meanwhile); the other calls raise
        Info's status, since their gRPC path would ask Info again first (GrpcTransport._check_info).
        """
        try:
            info = self.inner.info(timeout_s, refresh=self.link.state == "down")
        except grpc.RpcError as exc:
            if not lookup:
                raise
            self.link.info_failed(exc)
            return
        self.link.configure(info, self.inner.shm.on)

    def _pool(self, nbytes: int, timeout_s: float) -> BulkPool | None:
        self.link.reconsider(self.inner.shm.on)
        if self.link.needs_info:
            self._ask_info(timeout_s)
        return self.link.usable(nbytes)

    def lookup(self, namespace: str, keys: Sequence[bytes], timeout_s: float) -> LookupResult:
        start = time.monotonic()
        pool = self._lookup_pool(timeout_s)
        if pool is not None:
            try:
                return self.link.lookup(pool, namespace, keys, timeout_s - (time.monotonic() - start))
            except BulkUnreachable as exc:
                self.link.unreachable(pool, str(exc))
        return self.inner.lookup(namespace, keys, timeout_s - (time.monotonic() - start))

    def _lookup_pool(self, timeout_s: float) -> BulkPool | None:
        self.link.reconsider(self.inner.shm.on)
        if self.link.needs_info:
            self._ask_info(timeout_s, lookup=True)
        return self.link.lookup_pool()

    def info(self, timeout_s: float, *, refresh: bool = False) -> pb.InfoResponse | None:
        return self.inner.info(timeout_s, refresh=refresh)

    def put(
        self, namespace: str, items: Sequence[tuple[bytes, BlockData]], timeout_s: float, *, retain_ttl_s: float = 0.0
    ) -> PutResult:
        """Large puts over the bulk port; puts with retain_ttl_s always on gRPC (the bulk PUT frame
        has no place for it, docs/bulk.md)."""
        nbytes = sum(data_len(d) for _, d in items)
        start = time.monotonic()
        if retain_ttl_s:
            result = self.inner.put(namespace, items, timeout_s, retain_ttl_s=retain_ttl_s)
            self.link.counters.add("grpc_bytes_sent", nbytes)
            return result
        pool = self._pool(nbytes, timeout_s)
        if pool is None and nbytes < self.link.same_host_put_bytes:
            pool = self.link.lease_pool  # same host, a small put: the bulk port beats a segment and a gRPC Put
        if pool is not None:
            try:
                return self.link.put(pool, namespace, items, timeout_s - (time.monotonic() - start))
            except BulkUnreachable as exc:
                self.link.unreachable(pool, str(exc))
        elif (mem := self._put_mem_pool(nbytes)) is not None and (refs := self.inner.shm.process.ranges(items)):
            try:  # checksummed here: a buffer changed under the server's read fails its block (DATA_LOSS)
                return self.link.put_mem(mem, namespace, refs, timeout_s - (time.monotonic() - start))
            except BulkUnreachable as exc:
                self.link.lease_down(str(exc))  # counted as a fallback there
            except RPCError as exc:
                elsewhere = _PUT_MEM_ELSEWHERE - {grpc.StatusCode.DATA_LOSS}  # the put's own outcome here
                if exc.code not in elsewhere or timeout_s - (time.monotonic() - start) < MIN_FALLBACK_S:
                    raise
                self.link.counters.add("fallbacks", 1)
        result = self.inner.put(namespace, items, timeout_s - (time.monotonic() - start))
        self.link.counters.add("grpc_bytes_sent", nbytes)
        return result

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
        """As put() of format.encode_bytes_parts(keys, payloads); where put() would take gRPC on the
        same host, GrpcTransport.put_payloads (the server checksums what it reads)."""
        nbytes = sum(memoryview(p).nbytes for p in payloads)
        start = time.monotonic()
        on_grpc = retain_ttl_s or (self._pool(nbytes, timeout_s) is None and nbytes >= self.link.same_host_put_bytes)
        left = timeout_s - (time.monotonic() - start)
        if on_grpc and not retain_ttl_s and (mem := self._put_mem_pool(nbytes)) is not None:
            done = self._put_mem_sealed(mem, namespace, keys, payloads, left, headers)
            if done is not None:
                return done
            left = timeout_s - (time.monotonic() - start)
        if on_grpc:
            result = self.inner.put_payloads(
                namespace, keys, payloads, left, retain_ttl_s=retain_ttl_s, headers=headers
            )
            self.link.counters.add("grpc_bytes_sent", nbytes)
            return result
        return self.put(namespace, payload_items(keys, payloads, headers), left, retain_ttl_s=retain_ttl_s)

    def _put_mem_pool(self, nbytes: int) -> BulkPool | None:
        """Where a same-host put out of this process's memory goes as PUT_MEM frames: the same-host
        pool of a server whose Info says bulk_put_mem, for a put the process path takes (MIN_PUT_BYTES);
        None: through gRPC (GrpcTransport.put, put_payloads)."""
        if not self.link.puts_mem or nbytes < MIN_PUT_BYTES or self.inner.shm.process.state != "on":
            return None
        return self.link.lease_pool

    def _put_mem_sealed(
        self,
        pool: BulkPool,
        namespace: str,
        keys: Sequence[bytes],
        payloads: Sequence[Buffer],
        timeout_s: float,
        headers: Sequence[bytes] | None,
    ) -> PutResult | None:
        """GrpcTransport.put_payloads's sealed put, as PUT_MEM frames: None where it did not store the
        blocks and another path may (not sealable here, the connection failed, or a refusal a put
        checksummed by the SDK avoids). As there, this returns only once the server can no longer
        store what it reads: its answer (the server answers once its reads are over), or, where the
        connection failed or the deadline came first, after waiting out seal_before_ns."""
        start = time.monotonic()
        sealed = sealed_ranges(self.inner.shm, keys, payloads, timeout_s, headers)
        if sealed is None:
            return None
        try:
            return self.link.put_mem(pool, namespace, sealed.refs, sealed.window_s)
        except BulkUnreachable as exc:  # the server may still be reading: until before_ns
            wait_out(sealed)
            self.link.lease_down(str(exc))  # counted as a fallback there
            return None
        except RPCError as exc:
            if exc.code is grpc.StatusCode.DEADLINE_EXCEEDED:
                wait_out(sealed)  # not answered in time: the server may still be reading (past before_ns: none)
            elif exc.code is grpc.StatusCode.DATA_LOSS:  # a server that took the zero for a checksum
                self.inner.shm.process.sealing = False
            if exc.code not in _PUT_MEM_ELSEWHERE or timeout_s - (time.monotonic() - start) < MIN_FALLBACK_S:
                raise
        except BaseException:  # interrupted here: the server may read until before_ns
            wait_out(sealed)
            raise
        finally:
            del sealed  # the payloads' exports, held until the server's reads are over
        self.link.counters.add("fallbacks", 1)
        return None

    def get(self, namespace: str, keys: Sequence[bytes], prefix_only: bool, timeout_s: float) -> list[Fetched | None]:
        start = time.monotonic()
        pool = self._pool(self.link.min_bytes, timeout_s)  # a get's size is known only once it is answered
        same_host = pool is None and self.inner.arena.on
        if same_host:
            pool = self.link.small_same_host_pool(len(keys))  # a small get: one GET beats LEASE + RELEASE
        if pool is not None:
            try:
                return self.link.get(pool, namespace, keys, prefix_only, timeout_s - (time.monotonic() - start))
            except BulkUnreachable as exc:
                (self.link.lease_down if same_host else self.link.down)(str(exc))
        fetched = self.inner.get(namespace, keys, prefix_only, timeout_s - (time.monotonic() - start))
        if same_host:
            self.link.saw_blocks(fetched)
        self.link.counters.add("grpc_bytes_received", sum(len(f[0]) for f in fetched if f is not None))
        return fetched

    def blocks_in_place(self, namespace: str, keys: Sequence[bytes], timeout_s: float) -> list[memoryview] | None:
        """get_many's one-pass path on the server's host: every block copied straight out of the arena
        into a buffer of the client's pool and verified there (BulkLink.blocks_in_place); None
        elsewhere, or where the index does not locate every key (the caller then takes get())."""
        start = time.monotonic()
        self.inner.info(timeout_s)
        if not (self.inner.arena.on and self.link.read_in_place and self.presence.locates):
            return None
        pool = self._lease_pool(timeout_s)
        left = timeout_s - (time.monotonic() - start)
        got = self.link.blocks_in_place(pool, self.inner, namespace, keys, left)
        if got is not None:  # their size picks the path of a get the index cannot serve (saw_blocks)
            self.link.saw_blocks([(b, "ram") for b in got])
        return got

    def receive_into(
        self,
        namespace: str,
        keys: Sequence[bytes],
        sinks: Sequence[memoryview | None],
        prefix_only: bool,
        timeout_s: float,
    ) -> Received | None:
        """get_into's one-copy paths. On the same host: copies straight out of the arena where the
        presence index locates every key (BulkLink.get_in_place), else a small get as one bulk GET,
        else None (the caller leases in place). Elsewhere: a bulk GET whose payloads land in their
        sinks (BulkLink.get_into), else gRPC's; None where neither applies (the caller then takes the
        lease path, which goes over gRPC)."""
        start = time.monotonic()
        self.inner.info(timeout_s)
        same_host = self.inner.arena.on
        if same_host:
            pool = self._lease_pool(timeout_s) if self.link.read_in_place and self.presence.locates else None
            left = timeout_s - (time.monotonic() - start)
            local = self.link.get_in_place(pool, self.inner, namespace, keys, sinks, left)
            if local.landed:
                return local
            pool = self.link.small_same_host_pool(len(keys))  # a small get: one GET beats LEASE + RELEASE
        else:
            pool = self._pool(self.link.min_bytes, timeout_s - (time.monotonic() - start))
        if pool is not None:
            try:
                left = timeout_s - (time.monotonic() - start)
                return self.link.get_into(pool, namespace, keys, prefix_only, left, sinks)
            except BulkUnreachable as exc:
                (self.link.lease_down if same_host else self.link.down)(str(exc))
        if same_host:
            return None
        got = self.inner.receive_into(namespace, keys, sinks, prefix_only, timeout_s - (time.monotonic() - start))
        if got is not None:
            self.link.counters.add("grpc_bytes_received", got.landed_bytes + sum(len(f[0]) for f in got.found.values()))
        return got

    def lease(self, namespace: str, keys: Sequence[bytes], prefix_only: bool, timeout_s: float) -> Leased:
        """In-place reads from the server's arena on its host (docs/arena.md, the gRPC transport's);
        elsewhere a get, over the bulk port where it is usable."""
        start = time.monotonic()
        self.inner.info(timeout_s)  # what the server shares: its arena, its bulk port
        if self.inner.arena.on:
            pool = self.link.small_same_host_pool(len(keys))  # a small get: one GET beats LEASE + RELEASE
            if pool is not None:
                try:
                    left = timeout_s - (time.monotonic() - start)
                    return Leased(self.link.get(pool, namespace, keys, prefix_only, left))
                except BulkUnreachable as exc:
                    self.link.lease_down(str(exc))
            leased = self.inner.lease(namespace, keys, prefix_only, timeout_s - (time.monotonic() - start))
            self.link.saw_blocks(leased.blocks)
            return leased
        return Leased(self.get(namespace, keys, prefix_only, timeout_s - (time.monotonic() - start)))

    def release(self, ids: list[int]) -> None:
        self.inner.release(ids)

    def delete(self, namespace: str, keys: Sequence[bytes], timeout_s: float) -> int:
        return self.inner.delete(namespace, keys, timeout_s)

    def stats(self, timeout_s: float) -> ServerStats:
        return self.inner.stats(timeout_s)

    def prefetch(self, namespace: str, keys: Sequence[bytes], timeout_s: float) -> PrefetchResult:
        return self.inner.prefetch(namespace, keys, timeout_s)

    def close(self) -> None:
        self.link.close()
        self.inner.close()


class AsyncBulkTransport:
    """The asyncio counterpart: the bulk calls run in a worker thread (blocking sockets, GIL-free
    recv_into/sendmsg), bounded by the call's deadline; a cancelled call's thread ends by then, and
    drain() (close() too) waits for it: until it has, the server may still hold what its request
    reserved (a PUT's arena slots)."""

    def __init__(self, grpc_transport: AsyncGrpcTransport, link: BulkLink) -> None:
        self.inner = grpc_transport  # the gRPC transport: control calls, small transfers, the fallback
        self.link = link
        self.shm = grpc_transport.shm
        self.arena = grpc_transport.arena  # same host: the server's block arena (docs/arena.md)
        self.presence = grpc_transport.presence  # same host: Lookups without an RPC (docs/presence.md)
        inplace = grpc_transport._inplace
        inplace.bulk, inplace.bulk_down = self._lease_pool, link.lease_down
        self._running: set[asyncio.Task[object]] = set()  # the worker threads' calls, cancelled callers' too

    async def _in_thread(self, fn: Callable[..., T], *args: object) -> T:
        """fn(*args) in a worker thread. A cancelled caller returns at once; the thread runs on (its
        call has a deadline) and stays in _running, for drain(), until it ends."""
        task = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        self._running.add(task)
        task.add_done_callback(self._ended)
        return await asyncio.shield(task)  # type: ignore[return-value]

    def _ended(self, task: asyncio.Task[object]) -> None:
        self._running.discard(task)
        if not task.cancelled():
            task.exception()  # a cancelled caller's thread failed: its caller has its own answer already

    async def drain(self) -> None:
        """Waits for the worker threads of calls whose callers were cancelled (each has its own
        deadline) and for the in-place cleanups still running."""
        while self._running:
            await asyncio.wait(set(self._running))
        await self.inner._inplace.drain()

    async def _lease_pool(self, timeout_s: float) -> BulkPool | None:
        """As BulkTransport._lease_pool."""
        if self.link.needs_info:
            await self._ask_info(timeout_s)
        return self.link.lease_pool

    async def _ask_info(self, timeout_s: float, *, lookup: bool = False) -> None:
        """As BulkTransport._ask_info."""
        try:
            info = await self.inner.info(timeout_s, refresh=self.link.state == "down")
        except grpc.RpcError as exc:
            if not lookup:
                raise
            self.link.info_failed(exc)
            return
        self.link.configure(info, self.inner.shm.on)

    async def _pool(self, nbytes: int, timeout_s: float) -> BulkPool | None:
        self.link.reconsider(self.inner.shm.on)
        if self.link.needs_info:
            await self._ask_info(timeout_s)
        return self.link.usable(nbytes)

    async def lookup(self, namespace: str, keys: Sequence[bytes], timeout_s: float) -> LookupResult:
        """As BulkTransport.lookup, the socket work in a worker thread."""
        start = time.monotonic()
        self.link.reconsider(self.inner.shm.on)
        if self.link.needs_info:
            await self._ask_info(timeout_s, lookup=True)
        pool = self.link.lookup_pool()
        if pool is not None:
            try:
                left = timeout_s - (time.monotonic() - start)
                return await self._in_thread(self.link.lookup, pool, namespace, keys, left)
            except BulkUnreachable as exc:
                self.link.unreachable(pool, str(exc))
        return await self.inner.lookup(namespace, keys, timeout_s - (time.monotonic() - start))

    async def info(self, timeout_s: float, *, refresh: bool = False) -> pb.InfoResponse | None:
        return await self.inner.info(timeout_s, refresh=refresh)

    async def put(
        self, namespace: str, items: Sequence[tuple[bytes, BlockData]], timeout_s: float, *, retain_ttl_s: float = 0.0
    ) -> PutResult:
        """As BulkTransport.put."""
        nbytes = sum(data_len(d) for _, d in items)
        start = time.monotonic()
        if retain_ttl_s:
            result = await self.inner.put(namespace, items, timeout_s, retain_ttl_s=retain_ttl_s)
            self.link.counters.add("grpc_bytes_sent", nbytes)
            return result
        pool = await self._pool(nbytes, timeout_s)
        if pool is None and nbytes < self.link.same_host_put_bytes:
            pool = self.link.lease_pool  # same host, a small put: the bulk port beats a segment and a gRPC Put
        if pool is not None:
            try:
                left = timeout_s - (time.monotonic() - start)
                return await self._in_thread(self.link.put, pool, namespace, items, left)
            except BulkUnreachable as exc:
                self.link.unreachable(pool, str(exc))
        result = await self.inner.put(namespace, items, timeout_s - (time.monotonic() - start))
        self.link.counters.add("grpc_bytes_sent", nbytes)
        return result

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
        """As AsyncGrpcTransport.put_payloads: encoded (off the loop when large), then put()."""
        start = time.monotonic()
        items = await encoded_off_loop(keys, payloads, headers)
        left = max(timeout_s - (time.monotonic() - start), 1e-3)
        return await self.put(namespace, items, left, retain_ttl_s=retain_ttl_s)

    async def get(
        self, namespace: str, keys: Sequence[bytes], prefix_only: bool, timeout_s: float
    ) -> list[Fetched | None]:
        start = time.monotonic()
        pool = await self._pool(self.link.min_bytes, timeout_s)
        same_host = pool is None and self.inner.arena.on
        if same_host:
            pool = self.link.small_same_host_pool(len(keys))  # a small get: one GET beats LEASE + RELEASE
        if pool is not None:
            try:
                left = timeout_s - (time.monotonic() - start)
                return await self._in_thread(self.link.get, pool, namespace, keys, prefix_only, left)
            except BulkUnreachable as exc:
                (self.link.lease_down if same_host else self.link.down)(str(exc))
        fetched = await self.inner.get(namespace, keys, prefix_only, timeout_s - (time.monotonic() - start))
        if same_host:
            self.link.saw_blocks(fetched)
        self.link.counters.add("grpc_bytes_received", sum(len(f[0]) for f in fetched if f is not None))
        return fetched

    async def blocks_in_place(self, namespace: str, keys: Sequence[bytes], timeout_s: float) -> list[memoryview] | None:
        """As BulkTransport.blocks_in_place, the copies in a worker thread awaited to their end even
        when the caller is cancelled (run_to_end)."""
        start = time.monotonic()
        await self.inner.info(timeout_s)
        if not (self.inner.arena.on and self.link.read_in_place and self.presence.locates):
            return None
        pool = await self._lease_pool(timeout_s)
        left = timeout_s - (time.monotonic() - start)
        got = await run_to_end(lambda _: self.link.blocks_in_place(pool, self.inner, namespace, keys, left))
        if got is not None:  # their size picks the path of a get the index cannot serve (saw_blocks)
            self.link.saw_blocks([(b, "ram") for b in got])
        return got

    async def receive_into(
        self,
        namespace: str,
        keys: Sequence[bytes],
        sinks: Sequence[memoryview | None],
        prefix_only: bool,
        timeout_s: float,
    ) -> Received | None:
        """As BulkTransport.receive_into. The GET runs in a worker thread awaited to its end even when
        the caller is cancelled (run_to_end): nothing writes into the destinations after the call."""
        start = time.monotonic()
        await self.inner.info(timeout_s)
        same_host = self.inner.arena.on
        if same_host:
            pool = await self._lease_pool(timeout_s) if self.link.read_in_place and self.presence.locates else None
            left = timeout_s - (time.monotonic() - start)
            local = await run_to_end(lambda _: self.link.get_in_place(pool, self.inner, namespace, keys, sinks, left))
            if local.landed:
                return local
            pool = self.link.small_same_host_pool(len(keys))  # a small get: one GET beats LEASE + RELEASE
        else:
            pool = await self._pool(self.link.min_bytes, timeout_s - (time.monotonic() - start))
        if pool is not None:
            left = timeout_s - (time.monotonic() - start)
            try:
                return await run_to_end(lambda _: self.link.get_into(pool, namespace, keys, prefix_only, left, sinks))
            except BulkUnreachable as exc:
                (self.link.lease_down if same_host else self.link.down)(str(exc))
        if same_host:
            return None
        left = timeout_s - (time.monotonic() - start)
        got = await self.inner.receive_into(namespace, keys, sinks, prefix_only, left)
        if got is not None:
            self.link.counters.add("grpc_bytes_received", got.landed_bytes + sum(len(f[0]) for f in got.found.values()))
        return got

    async def lease(self, namespace: str, keys: Sequence[bytes], prefix_only: bool, timeout_s: float) -> Leased:
        """As BulkTransport.lease: in place from the server's arena on its host, elsewhere a get,
        over the bulk port where it is usable (get_into's remote bytes, as the blocking face's)."""
        start = time.monotonic()
        await self.inner.info(timeout_s)
        if self.inner.arena.on:
            pool = self.link.small_same_host_pool(len(keys))  # a small get: one GET beats LEASE + RELEASE
            if pool is not None:
                try:
                    left = timeout_s - (time.monotonic() - start)
                    return Leased(await self._in_thread(self.link.get, pool, namespace, keys, prefix_only, left))
                except BulkUnreachable as exc:
                    self.link.lease_down(str(exc))
            leased = await self.inner.lease(namespace, keys, prefix_only, timeout_s - (time.monotonic() - start))
            self.link.saw_blocks(leased.blocks)
            return leased
        return Leased(await self.get(namespace, keys, prefix_only, timeout_s - (time.monotonic() - start)))

    async def release(self, ids: list[int]) -> None:
        await self.inner.release(ids)

    async def delete(self, namespace: str, keys: Sequence[bytes], timeout_s: float) -> int:
        return await self.inner.delete(namespace, keys, timeout_s)

    async def stats(self, timeout_s: float) -> ServerStats:
        return await self.inner.stats(timeout_s)

    async def prefetch(self, namespace: str, keys: Sequence[bytes], timeout_s: float) -> PrefetchResult:
        return await self.inner.prefetch(namespace, keys, timeout_s)

    async def close(self) -> None:
        await self.drain()
        self.link.close()
        await self.inner.close()
