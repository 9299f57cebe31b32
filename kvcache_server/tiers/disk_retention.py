"""Retention in the disk tier: which records a put (or the demotion of a retained RAM block) asked to
keep, until when, and the per-tenant accounts (docs/tiers.md, "Disk tier", "Retention on disk").

The disk evicts whole regions (tiers/disk.py). A retained record is evicted last by being *copied
forward*: when its region is chosen for eviction, the writer thread that takes it reads the region's
live retained records (their header checked and their block verified, as every read is), reuses the
region, and appends them to it first, as the first records of its new epoch; then the plain records
of that region are gone and the put goes on into what is left. The copy is bounded by the retained
bytes of that one region; a record that cannot be read, fails verification, or finds no room (a full
disk) is dropped with its region and counted, never an error of the put.

Bounded as in RAM (tiers/retention.py, the same [retention] section, shares of the disk's capacity):
a tenant's retained record spans stay within `max_share` of capacity_bytes, all tenants' within
`max_total_share`; a block past either is stored unretained (counted in `refused`). A retention ends
at its deadline (a monotonic time the stack computed from the put's TTL, or what was left of a RAM
retention when the block was demoted); a hit on the disk renews it for the span it was granted with;
an expired record is plain again and is evicted with its region.

Not persisted: the record header has no field for it (disk_layout.py), so after a restart every block
comes back plain (docs/tiers.md says so); a session re-put with its TTL is retained again.

The disk tier calls every method under its lock.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcache_server.tiers.ram import tenant_of
from kvcache_server.tiers.retention import Retention, RetentionLimits


@dataclass(slots=True)
class Moved:
    """One retained record on its way from an evicted region to the region that reuses it."""

    entry: bytes  # the disk index key (namespace id + key)
    namespace: bytes  # as stored in the record header
    block: bytearray  # read and verified under its key


class DiskRetention:
    """The retained records of one disk tier and the counters of copying them forward."""

    def __init__(self, limits: RetentionLimits, capacity_bytes: int) -> None:
        self._accounts = Retention(limits, capacity_bytes)
        self.copied = 0  # retained records copied forward out of an evicted region
        self.dropped = 0  # retained records lost with their region (unreadable, failed verification, no room)

    def __contains__(self, entry: object) -> bool:
        return entry in self._accounts

    def __len__(self) -> int:
        return len(self._accounts)

    @property
    def retained_bytes(self) -> int:
        return self._accounts.retained_bytes

    @property
    def refused(self) -> int:
        return self._accounts.refused

    @property
    def expired(self) -> int:
        return self._accounts.expired

    def grant(self, entry: bytes, namespace: str, span: int, until: float, now: float) -> bool:
        """Retains an indexed record until `until` (or renews its retention to at least then); False,
        counted in `refused`, when its tenant's or the tier's share has no room; False, uncounted, for
        a deadline already passed."""
        if until <= now:
            return False
        return self._accounts.grant(entry, tenant_of(namespace), span, until - now, now)

    def touched(self, entry: bytes, now: float) -> None:
        """A hit: the record's retention, if any, renewed for the span it was granted with."""
        self._accounts.touched(entry, now)

    def drop(self, entry: bytes) -> bool:
        """The record left the index (evicted plain, deleted, dropped): its retention ends."""
        return self._accounts.drop(entry)

    def decay(self, now: float) -> int:
        """Ends the retentions whose deadline passed: those records are plain again. Returns how many."""
        return len(self._accounts.due(now))

    def stats(self) -> dict[str, int]:
        return {
            "blocks": len(self._accounts),
            "bytes": self._accounts.retained_bytes,
            "refused": self._accounts.refused,
            "expired": self._accounts.expired,
            "copied": self.copied,
            "dropped": self.dropped,
        }
