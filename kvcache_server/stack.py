"""The tier stack: the one seam between the RPC front end and storage.

The gRPC service (kvcache_server.service) validates requests and calls only
this class; the tiers below it know nothing about gRPC. Tiers are ordered
fastest first (RAM, then Redis, then S3). Reads try them in order; a tier that
raises TierError is a miss for that call, counted against the tier.

Integrity: blocks enter through `put`, after the service verified their
checksum, and the RAM tier holds them in this process. Blocks read from any
other tier left this process and are verified again before they are served; a
block that fails is deleted from that tier, counted, and treated as a miss.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from kvcache_client.format import BlockFormatError, verify_block
from kvcache_server.tiers.base import Tier, TierError, TierKind, TierStats

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Found:
    """A block served by the stack and the tier it came from."""

    data: bytes
    tier: TierKind


class TierStack:
    """Tiers in order, fastest first. The first tier is the in-process RAM tier."""

    def __init__(self, tiers: Sequence[Tier]) -> None:
        if not tiers:
            raise ValueError("a tier stack needs at least one tier")
        self._tiers = list(tiers)
        self._errors: dict[str, int] = {t.name: 0 for t in self._tiers}
        self._checksum_failures: dict[str, int] = {t.name: 0 for t in self._tiers}

    @property
    def tiers(self) -> list[Tier]:
        return list(self._tiers)

    def _failed(self, tier: Tier, what: str, exc: Exception) -> None:
        self._errors[tier.name] += 1
        log.warning("tier %s failed during %s, treating as miss: %s", tier.name, what, exc)

    async def lookup(self, namespace: str, keys: Sequence[bytes]) -> list[TierKind]:
        """The tier of each key in the longest stored prefix (at most one call per tier)."""
        where: list[TierKind | None] = [None] * len(keys)
        limit = len(keys)  # keys at or past the first key no tier has cannot extend the prefix
        for tier in self._tiers:
            ask = [i for i in range(limit) if where[i] is None]
            if not ask:
                break
            try:
                present = await tier.contains_many(namespace, [keys[i] for i in ask])
            except TierError as exc:
                self._failed(tier, "lookup", exc)
                continue
            for i, hit in zip(ask, present, strict=True):
                if hit:
                    where[i] = tier.kind
        prefix: list[TierKind] = []
        for kind in where:
            if kind is None:
                break
            prefix.append(kind)
        return prefix

    async def get(self, namespace: str, keys: Sequence[bytes]) -> list[Found | None]:
        """Each key's block, from the fastest tier that has a valid copy."""
        out: list[Found | None] = [None] * len(keys)
        missing = list(range(len(keys)))
        for depth, tier in enumerate(self._tiers):
            if not missing:
                break
            try:
                blocks = await tier.get_many(namespace, [keys[i] for i in missing])
            except TierError as exc:
                self._failed(tier, "get", exc)
                continue
            still: list[int] = []
            corrupt: list[bytes] = []
            for i, block in zip(missing, blocks, strict=True):
                if block is None:
                    still.append(i)
                elif depth > 0 and not self._valid(tier, block):
                    corrupt.append(keys[i])
                    still.append(i)
                else:
                    out[i] = Found(block, tier.kind)
            if corrupt:
                await self._drop(tier, namespace, corrupt)
            missing = still
        return out

    def _valid(self, tier: Tier, block: bytes) -> bool:
        try:
            verify_block(block)
        except BlockFormatError as exc:
            self._checksum_failures[tier.name] += 1
            log.error("tier %s returned a corrupt block, dropping it: %s", tier.name, exc)
            return False
        return True

    async def _drop(self, tier: Tier, namespace: str, keys: list[bytes]) -> None:
        try:
            await tier.delete_many(namespace, keys)
        except TierError as exc:
            self._failed(tier, "delete of corrupt blocks", exc)

    async def put(self, namespace: str, items: Sequence[tuple[bytes, bytes]]) -> list[bool]:
        """Stores verified blocks in the first tier; returns per item whether it was kept."""
        return await self._tiers[0].put_many(namespace, items)

    async def delete(self, namespace: str, keys: Sequence[bytes]) -> int:
        """Removes keys from every tier; returns the most any one tier removed."""
        deleted = 0
        for tier in self._tiers:
            try:
                deleted = max(deleted, await tier.delete_many(namespace, keys))
            except TierError as exc:
                self._failed(tier, "delete", exc)
        return deleted

    def stats(self) -> list[TierStats]:
        out = []
        for tier in self._tiers:
            s = tier.stats()
            s.errors += self._errors[tier.name]
            s.checksum_failures += self._checksum_failures[tier.name]
            out.append(s)
        return out

    async def close(self) -> None:
        for tier in self._tiers:
            await tier.close()
