"""In-place transfers through the shared block arena: the ArenaReserve/ArenaCommit and
LeaseGet/LeaseRelease RPCs (docs/arena.md, docs/shm.md).

Put, same host: no longer here. A client writes its blocks into its own segment and the Put
pipeline reads them straight into slots the server reserves (pipeline.put._shm_into_slots), so no
client ever holds a writable slot; ArenaReserve and ArenaCommit answer FAILED_PRECONDITION.
Get, same host: locate + lease = RamTier.lease_many; send = only the slot's place: the client
verifies the key-bound checksum and copies or reads in place, then releases. Keys RAM lacks are
misses here: the client fetches them
with Get, which reads the lower tiers and promotes into RAM.

The bulk TCP path receives into arena slots the same way, through kvcache_server.bulk.sink.ArenaSink.

Who may: the arena file is 0400 in the owner-only shm directory, so only processes of the server's
user map it, read-only; token rights and tenant scoping apply to these RPCs as to Put and Get
(leases are released only by their tenant; each tenant's leases are capped, RamTier.lease_many).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn

import grpc

from kvcache_proto import kvcache_pb2 as pb
from kvcache_server.auth import Principal, current_principal
from kvcache_server.pipeline.verify import BlockRefused
from kvcache_server.tiers.ram import tenant_of

if TYPE_CHECKING:
    from kvcache_server.config import LimitsSection
    from kvcache_server.stack import TierStack
    from kvcache_server.tiers.ram import Lease, RamTier

MAX_RELEASES = 65536
"""Lease ids one LeaseRelease may name (and one bulk LEASE or RELEASE frame: bulkwire.MAX_IDS)."""


def leading_leases(ram: RamTier, leases: list[Lease | None]) -> list[Lease | None]:
    """A prefix_only answer: the leases through the first miss (which answers as a miss); the
    leases after it are ended (a key named twice shares one lease: only those no answered
    position names). Thread-safe (the bulk path's LEASE runs in its session's thread)."""
    end = next((i for i, lease in enumerate(leases) if lease is None), len(leases))
    answered = {lease.id for lease in leases[: end + 1] if lease is not None}
    ram.release(list({lease.id for lease in leases[end:] if lease is not None} - answered))
    return leases[: end + 1]


def releasing_tenant(principal: Principal | None) -> str | None:
    """Whose leases a caller may end: its tenant's only, with auth; anyone's without."""
    return tenant_of(f"{principal.tenant}:") if principal is not None else None


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
        await self._writes_withdrawn(context)
        raise AssertionError("unreachable")

    async def ArenaCommit(self, request: pb.ArenaCommitRequest, context: grpc.aio.ServicerContext) -> pb.PutResponse:
        await self._writes_withdrawn(context)
        raise AssertionError("unreachable")

    async def _writes_withdrawn(self, context: grpc.aio.ServicerContext) -> NoReturn:
        """Clients are no longer handed writable arena slots: a client stalled past its
        reservation's time-out wrote into a slot already reused for another key (docs/arena.md).
        Same-host puts go through the client's own segment, which the server reads into a slot."""
        await self._abort(
            context,
            grpc.StatusCode.FAILED_PRECONDITION,
            "in-place writes into the block arena are withdrawn (a stalled writer could change another key's "
            "block); put through a shared-memory segment (Put with shm ranges; kvcache_client does) or inline",
        )

    async def LeaseGet(self, request: pb.LeaseGetRequest, context: grpc.aio.ServicerContext) -> pb.LeaseGetResponse:
        await self._shared_arena(context)
        namespace = await self._namespace(context, request.namespace)
        keys = await self._keys(context, list(request.keys))
        ram = self._stack.ram
        leases = self._stack.lease(namespace, keys, self.lease_timeout_s)
        if request.prefix_only:
            leases = leading_leases(ram, leases)
        self.inplace_bytes_leased += sum({lease.id: lease.length for lease in leases if lease is not None}.values())
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
        tenant = releasing_tenant(current_principal.get())
        return pb.LeaseReleaseResponse(released=self._stack.ram.release(ids, tenant))
