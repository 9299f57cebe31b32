"""In-place transfers through the shared block arena: the ArenaReserve/ArenaCommit and
LeaseGet/LeaseRelease RPCs (docs/arena.md, docs/shm.md).

Put, same host: receive = the client writes each block into a slot ArenaReserve handed out (its one
copy, from its tensor); verify = pipeline.verify in place, in the slot; commit = TierStack.put_reserved
(RAM indexes the slot without a copy, lower tiers get theirs). Get, same host: locate + lease =
RamTier.lease_many; send = only the slot's place: the client verifies the key-bound checksum and
copies or reads in place, then releases. Keys RAM lacks are misses here: the client fetches them
with Get, which reads the lower tiers and promotes into RAM.

The bulk TCP path receives into arena slots the same way, through kvcache_server.bulk.sink.ArenaSink.

Who may: the arena file is 0600 in the owner-only shm directory, so only processes of the server's
user map it; token rights and tenant scoping apply to these RPCs as to Put and Get (reservations
commit only into the namespace they were made for, leases are released only by their tenant).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn

import grpc

from kvcache_proto import kvcache_pb2 as pb
from kvcache_server.auth import current_principal
from kvcache_server.pipeline.verify import BlockRefused, verify_block_for_put
from kvcache_server.tiers.ram import Reservation, tenant_of

if TYPE_CHECKING:
    from kvcache_server.config import LimitsSection
    from kvcache_server.stack import TierStack

MAX_RELEASES = 65536
"""Lease ids one LeaseRelease may name."""


class InPlaceRPCs:
    """The in-place RPCs, mixed into KVCacheService (which provides validation and the stack)."""

    _stack: TierStack
    _limits: LimitsSection
    lease_timeout_s: float
    inplace_bytes_received: int
    inplace_bytes_leased: int

    if TYPE_CHECKING:  # provided by KVCacheService and the other stages (a stub here would shadow them)

        async def _abort(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn: ...

        async def _namespace(self, context: grpc.aio.ServicerContext, namespace: str) -> str: ...

        async def _keys(self, context: grpc.aio.ServicerContext, keys: list[bytes]) -> list[bytes]: ...

        async def _refuse_block(self, context: grpc.aio.ServicerContext, exc: BlockRefused) -> NoReturn: ...

        def _saw_block_size(self, namespace: str, size: int) -> None: ...

    async def _shared_arena(self, context: grpc.aio.ServicerContext) -> None:
        if not self._stack.ram.region.path:
            await self._abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                "this server's block arena is not shared (Info.arena_path is empty); use Put and Get",
            )

    async def ArenaReserve(
        self, request: pb.ArenaReserveRequest, context: grpc.aio.ServicerContext
    ) -> pb.ArenaReserveResponse:
        await self._shared_arena(context)
        namespace = await self._namespace(context, request.namespace)
        lengths = list(request.lengths)
        if not lengths or len(lengths) > self._limits.max_keys_per_request:
            await self._abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"ArenaReserve needs 1..{self._limits.max_keys_per_request} lengths, got {len(lengths)}",
            )
        for i, n in enumerate(lengths):
            if n == 0 or n > self._limits.max_block_bytes:
                code = grpc.StatusCode.RESOURCE_EXHAUSTED if n else grpc.StatusCode.INVALID_ARGUMENT
                await self._abort(
                    context, code, f"lengths[{i}] = {n}: a block is 1..max_block_bytes={self._limits.max_block_bytes}"
                )
        ram = self._stack.ram
        made: list[Reservation] = []
        for n in lengths:
            res = ram.reserve(namespace, n, self.lease_timeout_s)
            if res is None:
                ram.abandon([r.id for r in made])
                await self._abort(
                    context,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"no room in the block arena for {len(lengths)} blocks of {sum(lengths)} bytes now "
                    "(leases and reservations pin it); send them with Put",
                )
            made.append(res)
        return pb.ArenaReserveResponse(
            slots=[pb.ArenaSlot(id=r.id, offset=r.offset, length=r.length) for r in made],
            expires_in_s=self.lease_timeout_s,
            arena_path=ram.region.path,
        )

    async def ArenaCommit(self, request: pb.ArenaCommitRequest, context: grpc.aio.ServicerContext) -> pb.PutResponse:
        await self._shared_arena(context)
        namespace = await self._namespace(context, request.namespace)
        ram = self._stack.ram
        items = list(request.items)
        all_ids = [it.reservation for it in items]
        try:
            if len(items) > self._limits.max_keys_per_request:
                await self._abort(
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{len(items)} items exceed max_keys_per_request={self._limits.max_keys_per_request}",
                )
            ram.abandon(list(request.abandon), namespace)
            taken: list[tuple[bytes, Reservation]] = []
            for i, item in enumerate(items):
                res = ram.reservation(item.reservation)
                if res is None or res.namespace != namespace:
                    await self._abort(
                        context,
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"block {i}: reservation {item.reservation} is not open for this namespace (expired "
                        f"after {self.lease_timeout_s:g} s, committed or abandoned); send the block with Put",
                    )
                try:
                    await verify_block_for_put(i, item.key, res.buffer, self._limits.max_block_bytes)
                except BlockRefused as exc:
                    await self._refuse_block(context, exc)
                taken.append((item.key, res))
            if taken:
                self._saw_block_size(namespace, max(r.length for _, r in taken))
            outcome = await self._stack.put_reserved(namespace, taken)
        finally:
            ram.abandon(all_ids, namespace)  # whatever was not committed (a refused block, a cancelled call)
        self.inplace_bytes_received += sum(r.length for _, r in taken)
        return pb.PutResponse(
            stored=sum(outcome.kept),
            rejected=len(outcome.kept) - sum(outcome.kept),
            bytes_received=sum(r.length for _, r in taken),
            tiers=[
                pb.TierPutResult(
                    tier=int(t.kind),
                    name=t.name,
                    stored=t.stored,
                    queued=t.queued,
                    dropped=t.dropped,
                    failed=t.failed,
                    deleted=t.deleted,
                )
                for t in outcome.tiers
            ],
        )

    async def LeaseGet(self, request: pb.LeaseGetRequest, context: grpc.aio.ServicerContext) -> pb.LeaseGetResponse:
        await self._shared_arena(context)
        namespace = await self._namespace(context, request.namespace)
        keys = await self._keys(context, list(request.keys))
        ram = self._stack.ram
        leases = self._stack.lease(namespace, keys, self.lease_timeout_s)
        if request.prefix_only:
            end = next((i for i, lease in enumerate(leases) if lease is None), len(leases))
            ram.release([lease.id for lease in leases[end:] if lease is not None])
            leases = leases[: end + 1]
        self.inplace_bytes_leased += sum(lease.length for lease in leases if lease is not None)
        return pb.LeaseGetResponse(
            leases=[
                pb.ArenaSlot(id=lease.id, offset=lease.offset, length=lease.length) if lease else pb.ArenaSlot()
                for lease in leases
            ],
            expires_in_s=self.lease_timeout_s,
            arena_path=ram.region.path,
        )

    async def LeaseRelease(
        self, request: pb.LeaseReleaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.LeaseReleaseResponse:
        ids = list(request.leases)
        if len(ids) > MAX_RELEASES:
            await self._abort(
                context, grpc.StatusCode.INVALID_ARGUMENT, f"{len(ids)} lease ids exceed {MAX_RELEASES} per call"
            )
        principal = current_principal.get()
        tenant = tenant_of(f"{principal.tenant}:") if principal is not None else None
        return pb.LeaseReleaseResponse(released=self._stack.ram.release(ids, tenant))
