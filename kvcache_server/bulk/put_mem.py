"""PUT_MEM, a bulk session's same-host put out of the client's own memory (docs/bulk.md, docs/shm.md):
the gRPC Put of ranges of a registered client process, as one frame. A mixin of Session
(kvcache_server.bulk.session), kept apart from the rest of its protocol: it needs the segment socket's
registrations, the process's read threads and the seal rules, which the other requests do not.
"""

from __future__ import annotations

import os
import select
import socket
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from kvcache_core import bulkwire as bw
from kvcache_core.blockwire import ShmRange
from kvcache_server.arena import Reservation
from kvcache_server.handoff import HandoffRegistry
from kvcache_server.pipeline.put import seal_refusal, sealed_head_refusal
from kvcache_server.pipeline.verify import BlockRefused, check_block_for_put
from kvcache_server.procmem import ProcessReads
from kvcache_server.refusal import Refused
from kvcache_server.shm import read_ranges_into_slots_here
from kvcache_server.stack import PutOutcome, TierStack

from .deadline import Deadline

if TYPE_CHECKING:
    from .session import Shared

T = TypeVar("T")


class PutMemRequests:
    """Session's PUT_MEM requests (_put_mem); the rest of a session provides what is declared here."""

    _s: Shared
    tenant: str | None
    sock: socket.socket

    if TYPE_CHECKING:  # provided by Session (declared only: a stub here would shadow it)

        def _control(self, kind: bw.FrameType, length: int, deadline: Deadline) -> bytes: ...

        def _authorize(self, method: str) -> None: ...

        def _namespace(self, namespace: str) -> str: ...

        def _put_sizes(self, sizes: list[int]) -> int: ...

        def _put_done(self, outcome: PutOutcome, blocks: int, total: int, deadline: Deadline) -> None: ...

        def _on_loop(self, coro: Coroutine[Any, Any, T], undo: Callable[[T], object] | None = None) -> T: ...

    def _put_mem(self, length: int, deadline: Deadline) -> None:
        """A Put of ranges of a registered client process's memory, as the gRPC Put's Block.shm of a
        process's name (docs/shm.md, "Puts out of the client's memory"), without a gRPC call: the
        registration bound to this connection's tenant, each block read (process_vm_readv) straight
        into an arena slot and verified there, or sealed (its checksum computed over what landed,
        ShmRange.seal_before_ns) and stored only if read before the client's deadline; the reads in
        lanes (this thread the first, the process's own read threads the others), one PUT_MEM of a
        process reading at a time. On a server of RAM alone the slots are reserved and committed in
        this thread (TierStack.commits_off_loop), elsewhere on the loop. Where RAM has no room for the
        slots now, RESOURCE_EXHAUSTED, having read nothing: the SDK puts them through gRPC, which
        reads them into memory first.

        Raises:
            Refused: as the gRPC Put of such ranges (FAILED_PRECONDITION: no such registration of this
                tenant; ABORTED: a sealed block read too late, or another clock; DATA_LOSS ...).
        """
        namespace, name, entries = bw.parse_put_mem(self._control(bw.FrameType.PUT_MEM, length, deadline))
        self._authorize("Put")
        scoped = self._namespace(namespace)
        refs = [(key, ShmRange(name, address, n, head, seal)) for key, address, n, seal, head in entries]
        total = self._put_sizes([ref.block_length for _, ref in refs])
        registry = self._s.registry
        if registry is None:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "this server has no segment socket: PUT_MEM names none")
        fd, size = registry.open(name, self.tenant, writable=False)
        try:
            if size >= 0:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"PUT_MEM names {name}, not a registered process")
            process = registry.reads(name)
            if process is None:
                raise Refused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{name}: the client process's registration ended; send the bytes another way",
                )
            for i, (_, ref) in enumerate(refs):
                if (message := sealed_head_refusal(ref)) is not None:
                    raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"block {i}: {message}")
            due = min((ref.seal_before_ns for _, ref in refs if ref.seal), default=0)
            wait_s = self._s.bulk.request_timeout_s  # at most this, whatever seal_before_ns the client named
            if due:
                wait_s = min(wait_s, max(0.0, (due - time.monotonic_ns()) / 1e9))
            if not process.thread_stage.acquire(timeout=wait_s):
                raise Refused(
                    grpc.StatusCode.ABORTED if due else grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{name}: another put of this process is still reading it",
                )
            try:
                self._in_time(refs, process)
                outcome = self._read_mem_into_slots(scoped, refs, fd, size, process, total, registry, name)
            finally:
                process.thread_stage.release()
        finally:
            os.close(fd)
        self._s.counters.add("puts")
        self._put_done(outcome, len(refs), total, deadline)

    def _in_time(self, refs: list[tuple[bytes, ShmRange]], process: ProcessReads) -> None:
        """The gRPC Put's _sealed_in_time (pipeline.put.seal_refusal): a sealed block read at or after its
        client's seal_before_ns, or from a process of another clock, is not stored: ABORTED (the SDK puts
        it again)."""
        if (message := seal_refusal([ref for _, ref in refs], process, self._s.put_counters)) is not None:
            raise Refused(grpc.StatusCode.ABORTED, message)

    def _read_mem_into_slots(
        self,
        scoped: str,
        refs: list[tuple[bytes, ShmRange]],
        fd: int,
        size: int,
        process: ProcessReads,
        total: int,
        registry: HandoffRegistry,
        name: str,
    ) -> PutOutcome:
        """_put_mem's slots: reserved, read into and verified (or sealed) in lanes, committed. Every
        reservation not committed is abandoned, after every lane ended, however this ends. A
        registration dropped during the reads (its connection closed) ends the call FAILED_PRECONDITION
        before the commit, as the gRPC Put's reads on its dropped threads do."""
        stack = self._s.stack
        sizes = [ref.block_length for _, ref in refs]
        held = self._s.budget.holding(self.tenant)
        made = stack.reserve_in_thread(scoped, sizes) if held.would_fit(total) else None
        in_thread = made is not None
        if made is None:
            made = self._on_loop(stack.reserve_many(scoped, sizes), undo=self._abandon_reservations)
        if made is None:  # ABORTED, not RESOURCE_EXHAUSTED: a limit refused is the put's outcome, this is not
            raise Refused(
                grpc.StatusCode.ABORTED,
                "RAM has no room for this put's slots now (leases or reservations pin it): put it another way",
            )
        ids = [res.id for res in made]
        owned = True  # until a commit on the loop takes them over
        try:
            keys = [key for key, _ in refs]
            limit = self._s.limits.max_block_bytes

            landed: list[int] = []  # bytes read out of the process, piece by piece (lanes append: thread-safe)

            def check(where: int, slot: memoryview, fill: Callable[[int, int], None]) -> None:
                def counted(start: int, end: int) -> None:
                    fill(start, end)
                    landed.append(end - start)

                check_block_for_put(where, keys[where], slot, limit, counted, seal=refs[where][1].seal)

            reads = [(i, fd, size, ref, res.buffer) for i, ((_, ref), res) in enumerate(zip(refs, made, strict=True))]
            counters = self._s.put_counters
            self._registered(registry, name, process)
            try:
                read_ranges_into_slots_here(reads, check, process.executor)
            except BlockRefused as exc:
                if counters is not None:  # as the gRPC Put counts a refused block's read
                    received = sum(landed)
                    counters.shm_bytes_received += received
                    if exc.checksum:
                        counters.put_checksum_failures += 1
                raise
            self._registered(registry, name, process)
            self._in_time(refs, process)
            self._client_still_there(name)
            if counters is not None:  # as a gRPC Put of these ranges counts them
                sealed = sum(1 for _, ref in refs if ref.seal)  # each += below one add, no call inside it
                counters.shm_bytes_received += total
                counters.sealed_blocks += sealed
            items = [(key, res) for key, res in zip(keys, made, strict=True)]
            outcome = stack.commit_in_thread(scoped, items) if in_thread else None
            if outcome is None:
                owned = False  # the commit on the loop owns them from here, or _abandon_unless_started does
                started: list[bool] = []
                try:
                    outcome = self._on_loop(_committed_reserved(stack, scoped, items, started))
                except BaseException:
                    self._s.loop.call_soon_threadsafe(_abandon_unless_started, started, stack, ids)
                    raise
        finally:
            if owned:
                stack.ram.abandon(ids)
        self._s.block_sizes.saw(scoped, max(sizes))
        if self._s.service is not None:  # committed from the server's reservations, as the gRPC Put counts them
            kept = sum(res.length for res, ok in zip(made, outcome.kept, strict=True) if ok)
            self._s.service.inplace_bytes_received += kept
        return outcome

    def _client_still_there(self, name: str) -> None:
        """Raises ABORTED where the client closed (or reset) this connection before the commit. The SDK
        closes it before it puts the blocks another way and returns, and its caller may then reuse the
        memory those blocks were read from: a read that overlapped the close may hold bytes put there
        since (for an unsealed block, another namespace's valid block of the same key would verify). A
        close after this check came after every read, of bytes still the put's."""
        poller = select.poll()
        poller.register(self.sock.fileno(), select.POLLRDHUP)
        if poller.poll(0):  # POLLRDHUP, POLLHUP or POLLERR: the client's end is closed
            raise Refused(
                grpc.StatusCode.ABORTED, f"{name}: the client closed the connection during the put: nothing stored"
            )

    @staticmethod
    def _registered(registry: HandoffRegistry, name: str, process: ProcessReads) -> None:
        """Raises FAILED_PRECONDITION where the registration ended (its connection closed: its read
        threads shut down), before the reads (as the gRPC Put's submit to those threads fails) and
        after them (nothing read then is committed)."""
        if process.executor.closed or registry.reads(name) is not process:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{name}: the client process's registration ended during the call; send the bytes another way",
            )

    def _abandon_reservations(self, made: list[Reservation] | None) -> None:
        if made:
            self._s.stack.ram.abandon([res.id for res in made])


async def _committed_reserved(
    stack: TierStack, namespace: str, items: list[tuple[bytes, Reservation]], started: list[bool]
) -> PutOutcome:
    """put_reserved on the loop; whatever it did not commit is abandoned as it ends. `started` is set
    as it starts (a task cancelled before its first step never runs this: _abandon_unless_started)."""
    started.append(True)
    try:
        return await stack.put_reserved(namespace, items)
    finally:
        stack.ram.abandon([res.id for _, res in items])


def _abandon_unless_started(started: list[bool], stack: TierStack, ids: list[int]) -> None:
    """On the loop, after a session gave up on a _committed_reserved: its reservations abandoned if it
    never started (a commit that starts after this finds them gone and stores nothing)."""
    if not started:
        stack.ram.abandon(ids)
