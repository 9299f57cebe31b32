"""Same-host puts whose checksums the server computes (ShmRange.seal_before_ns; docs/shm.md,
"Checksums computed by the server"): the SDK's side of put_payloads and put_tensors.

From the blocking client on the server's host, a put's blocks go as ranges of this process's memory
with headers of checksum 0 (sealed_ranges), under a deadline that is also the call's, so the SDK
never returns, and its caller never reuses a buffer, while the server may still read it (wait_out);
everywhere else, and after a refusal this avoids (sealed_refused), the blocks are checksummed here
(payload_items, encoded_off_loop) and put as any.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from kvcache_client.shm import MIN_PUT_BYTES, ShmLink
from kvcache_core.blockwire import BlockData, Buffer, ShmRange
from kvcache_core.format import encode_bytes_parts, seal_parts

SEAL_MIN_WINDOW_S = 1.0
SEAL_WINDOW_BYTES_PER_S = 200e6
"""A sealed put gives the server until now + max(SEAL_MIN_WINDOW_S, its bytes at this rate), or the
call's deadline if sooner, to have read its blocks (ShmRange.seal_before_ns): its gRPC deadline
too, so the SDK never returns (and its caller never reuses a buffer) before the server's reads
are over or refused. A server too slow for it answers ABORTED (or the call its deadline) and the
SDK puts the blocks again, checksummed by itself, within what is left of the caller's deadline."""


MIN_FALLBACK_S = 0.05
"""A refused sealed put is put again, checksummed by the SDK, only with at least this much of its
deadline left; with less, the refusal is the call's outcome (a hash of every payload and an RPC
sure to miss its deadline would be work for nothing)."""


@dataclass
class Sealed:
    """A put_payloads's blocks as sealed ranges of this process's memory (ProcessLink.sealed_ranges)."""

    refs: list[tuple[bytes, ShmRange]]
    held: list[Any]  # each payload's buffer, exported until the put returns
    before_ns: int  # CLOCK_MONOTONIC: the server stores nothing it read from then on
    window_s: float  # the call's timeout: it ends no earlier than before_ns


def sealed_ranges(
    link: ShmLink,
    keys: Sequence[bytes],
    payloads: Sequence[Buffer],
    timeout_s: float,
    headers: Sequence[bytes] | None = None,
) -> Sealed | None:
    """A put_payloads's blocks as ranges of this process's memory that the server checksums as it
    reads them, or None: too small, or the path is not there."""
    if len(keys) != len(payloads):
        raise ValueError(f"{len(keys)} keys for {len(payloads)} payloads")
    nbytes = sum(memoryview(p).nbytes for p in payloads)
    if nbytes < MIN_PUT_BYTES or not link.process.sealing or link.process.name() is None:
        return None  # name(): registered again first where needed, before the window starts
    window_s = min(timeout_s, max(SEAL_MIN_WINDOW_S, nbytes / SEAL_WINDOW_BYTES_PER_S))
    before_ns = time.monotonic_ns() + int(window_s * 1e9)
    found = link.process.sealed_ranges(keys, payloads, before_ns, headers)
    return None if found is None else Sealed(found[0], found[1], before_ns, window_s)


def sealed_refused(link: ShmLink, exc: grpc.RpcError) -> bool:
    """Whether a sealed put failed in a way the same put checksummed by the SDK avoids: the server
    read too late (ABORTED, or the window's deadline), refused the process (ProcessLink.refused), or
    does not seal (DATA_LOSS: a server that took checksum 0 for a checksum; sealing goes off)."""
    code = exc.code()
    if code is grpc.StatusCode.DATA_LOSS:
        link.process.sealing = False
        return True
    return code in (grpc.StatusCode.ABORTED, grpc.StatusCode.DEADLINE_EXCEEDED) or link.process.refused(exc)


SERVER_ENDED = frozenset(
    {
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.DATA_LOSS,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    }
)
"""Statuses of a sealed put after which the server reads nothing more of it: the server's own
answers (its handler has ended, its reads with it; gRPC raises RESOURCE_EXHAUSTED on the client's
side only for a message over its size limits, and a sealed put's messages carry headers, not
payloads), and the deadline, which is before_ns or later. Any other (UNAVAILABLE, CANCELLED,
INTERNAL, ..., which gRPC may raise here while the server's handler still runs) is followed by
wait_out before the SDK retries, falls back or returns."""


def wait_out(sealed: Sealed) -> None:
    """Blocks until the server can no longer store what it reads of `sealed` (its before_ns): for a
    put cut off in this process while the server may still be reading. An exception raised meanwhile
    (a second KeyboardInterrupt, a signal handler's) is held until then, and raised after."""
    pending: BaseException | None = None
    while (left_ns := sealed.before_ns - time.monotonic_ns()) > 0:
        try:
            time.sleep(left_ns / 1e9)
        except BaseException as exc:
            pending = pending or exc
    if pending is not None:
        raise pending


def payload_items(
    keys: Sequence[bytes], payloads: Sequence[Buffer], headers: Sequence[bytes] | None = None
) -> list[tuple[bytes, BlockData]]:
    """put_payloads's blocks with their checksums computed in this process, for every path but a
    sealed one: format.encode_bytes_parts, or each of `headers` (checksum 0) sealed here."""
    if headers is None:
        return list(zip(keys, encode_bytes_parts(keys, payloads), strict=True))
    return [(k, (seal_parts(k, h, p), p)) for k, h, p in zip(keys, headers, payloads, strict=True)]


ENCODE_OFF_LOOP_BYTES = 1 << 20
"""The asyncio face encodes put_payloads's blocks in a worker thread from this many bytes (XXH3 lets
go of the GIL): never a hash of MiBs on the event loop."""


async def encoded_off_loop(
    keys: Sequence[bytes], payloads: Sequence[Buffer], headers: Sequence[bytes] | None = None
) -> list[tuple[bytes, BlockData]]:
    """payload_items, in a worker thread when the payloads are large."""
    if sum(memoryview(p).nbytes for p in payloads) >= ENCODE_OFF_LOOP_BYTES:
        return await asyncio.to_thread(payload_items, keys, payloads, headers)
    return payload_items(keys, payloads, headers)
