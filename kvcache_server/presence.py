"""The writer of a tenant's presence index: which (namespace, key)s the RAM tier indexes, in shared memory.

Same-host clients to whom the server shares its block arena map their own tenant's table read-only
and answer Lookups of blocks RAM holds without an RPC (docs/presence.md; the layout is
kvcache_core.presence's). The RAM tier calls add() and remove() under its lock on every index change
(an entry indexed, evicted, deleted or replaced), so the table holds exactly the fingerprints of the
entries the tier indexes, with three exceptions a reader knows how to treat:

- a full bucket: the fingerprint (and its location) is kept here (`_spilled`) and the bucket's
  overflow flag set, so a reader takes "not in this bucket" as unknown and asks the server; a removal
  from the bucket moves a spilled fingerprint into the freed slot (its location, then the slot, then
  the flag cleared once none is left);
- two keys of one fingerprint (2^-64 per pair): counted (`_counts`), stored once, removed with the last;
- a 64-bit fingerprint that another key shares: a false "present" for that key, a hint that a Get
  then answers as a miss (never wrong bytes: blocks are verified under their own key).

Beside each fingerprint slot the table keeps where the entry's block lies in the arena (FLAG_LOCATIONS),
so a same-host client can copy a block straight out of the arena it maps and verify it where it landed
(kvcache_client.local_reads).

Every store into the table is one aligned 8-byte store (a memoryview cast to "Q": CPython packs one
unsigned long long), a location before its fingerprint and the fingerprint before the overflow flag
changes, so a reader racing a change sees the table before or after it; every change of a bucket's
slots lies between two increments of the bucket's version (a seqlock: kvcache_core.presence), so a
reader can tell that an entry it located stayed indexed while it copied the block (x86-64 keeps
stores, and loads, in program order).

The file is created 0600, made 0400 at once (as the arena: the server's descriptor stays writable, every
other open is read-only) and flock'd while the server lives: a reader that can take the lock knows the
server is gone.
"""

from __future__ import annotations

import contextlib
import os
import secrets

from kvcache_core.presence import (
    BUCKET_SLOTS,
    FLAG_CLOSED,
    FLAG_LOCATIONS,
    FLAG_LOWER_TIERS,
    HEADER_BYTES,
    MAGIC,
    PRESENCE_PREFIX,
    VERSION,
    W_BUCKETS,
    W_COUNT,
    W_FLAGS,
    W_INSTANCE,
    W_MAGIC,
    W_SEED,
    W_VERSION,
    buckets_for,
    file_bytes,
    fingerprint,
    locations_at,
    versions_at,
)
from kvcache_server.arena import create_shared_file

DEFAULT_BLOCK_BYTES = 64 << 10
"""ram.presence_block_bytes: the block size a table is sized for (smaller blocks fill buckets sooner)."""


class PresenceTable:
    """One tenant's presence table in a file of the shared-memory directory. Not thread-safe: the RAM
    tier's lock guards every call.

    Attributes:
        path: the file a client of this tenant maps.
        buckets: buckets in the table (a power of two).
        nbytes: bytes of the file.
    """

    def __init__(
        self, directory: str, blocks: int, *, instance_id: int, lower_tiers: bool, locations: bool = False
    ) -> None:
        """Creates the file, sized for `blocks` fingerprints (kvcache_core.presence.buckets_for).

        Raises:
            OSError: the file cannot be created or its space reserved (a full tmpfs).
        """
        self.buckets = buckets_for(blocks)
        self.nbytes = file_bytes(self.buckets)
        self._seed = secrets.randbits(64)
        self._counts: dict[int, int] = {}
        self._spilled: dict[int, dict[int, int]] = {}  # bucket -> {fingerprint: location} kept here
        self._fd, self.path, self._map = create_shared_file(directory, PRESENCE_PREFIX, self.nbytes)
        self._words = memoryview(self._map).cast("Q")
        self._slots = HEADER_BYTES // 8  # the word index of bucket 0's first slot
        self._overflow = HEADER_BYTES + self.buckets * BUCKET_SLOTS * 8  # byte offset of the flags
        self._located = locations_at(self.buckets) // 8 - self._slots  # slot word + this: its location's
        self._versions = versions_at(self.buckets) // 8  # + bucket: the bucket's version word
        w = self._words
        w[W_VERSION], w[W_INSTANCE], w[W_BUCKETS], w[W_SEED] = VERSION, instance_id, self.buckets, self._seed
        w[W_FLAGS] = (FLAG_LOCATIONS if locations else 0) | (FLAG_LOWER_TIERS if lower_tiers else 0)
        w[W_MAGIC] = MAGIC  # last: a reader that sees it sees the rest of the header

    def set_lower_tiers(self, lower_tiers: bool) -> None:
        """Whether a key absent from RAM may be stored below it (readers then ask the server)."""
        flags = self._words[W_FLAGS]
        self._words[W_FLAGS] = flags | FLAG_LOWER_TIERS if lower_tiers else flags & ~FLAG_LOWER_TIERS

    def _fp(self, namespace: str, key: bytes) -> int:
        """The fingerprint under the namespace as the client names it: the table is its tenant's own, so
        the server's tenant scope ("tenant:ns" with auth; namespaces never hold ":") is dropped."""
        _, scoped, name = namespace.partition(":")
        return fingerprint(self._seed, (name if scoped else namespace).encode(), key)

    def add(self, namespace: str, key: bytes, location: int = 0) -> None:
        """(namespace, key) is indexed now, its block where `location` says (kvcache_core.presence.
        pack_location; 0: not known)."""
        fp = self._fp(namespace, key)
        n = self._counts.get(fp, 0)
        self._counts[fp] = n + 1
        if n:
            return
        w = self._words
        bucket = fp & (self.buckets - 1)
        base = self._slots + bucket * BUCKET_SLOTS
        for i in range(base, base + BUCKET_SLOTS):
            if w[i] == 0:
                version = self._versions + bucket
                w[version] += 1  # odd: the bucket is changing
                w[i + self._located] = location
                w[i] = fp
                w[version] += 1
                w[W_COUNT] += 1
                return
        self._spilled.setdefault(bucket, {})[fp] = location
        self._map[self._overflow + bucket] = 1

    def remove(self, namespace: str, key: bytes) -> None:
        """(namespace, key) left the index (evicted, deleted, replaced). Before the RAM tier frees its
        slot: a reader that saw the bucket's version unchanged across its copy copied this entry."""
        fp = self._fp(namespace, key)
        n = self._counts.get(fp, 0)
        if n == 0:
            return
        w = self._words
        bucket = fp & (self.buckets - 1)
        base = self._slots + bucket * BUCKET_SLOTS
        version = self._versions + bucket
        if n > 1:  # another (namespace, key) of this fingerprint stays: which one the location was is not kept
            self._counts[fp] = n - 1
            waiting = self._spilled.get(bucket)
            if waiting is not None and fp in waiting:
                waiting[fp] = 0
            for i in range(base, base + BUCKET_SLOTS):
                if w[i] == fp:
                    w[version] += 1
                    w[i + self._located] = 0
                    w[version] += 1
            return
        del self._counts[fp]
        spilled = self._spilled.get(bucket)
        if spilled is not None and fp in spilled:
            del spilled[fp]
        else:
            for i in range(base, base + BUCKET_SLOTS):
                if w[i] == fp:
                    w[version] += 1
                    if spilled:  # the freed slot takes a spilled one (its location first): still flagged meanwhile
                        moved, w[i + self._located] = spilled.popitem()
                        w[i] = moved
                    else:
                        w[i] = 0
                        w[i + self._located] = 0
                        w[W_COUNT] -= 1
                    w[version] += 1
                    break
        if spilled is not None and not spilled:
            del self._spilled[bucket]
            self._map[self._overflow + bucket] = 0  # every fingerprint of the bucket is in it again

    def close(self) -> None:
        """Marks the table closed (readers stop trusting it at once), removes the file and unmaps it."""
        if self._fd < 0:
            return
        self._words[W_FLAGS] = self._words[W_FLAGS] | FLAG_CLOSED
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self._fd)
        self._fd = -1
        self._words.release()
        with contextlib.suppress(BufferError):
            self._map.close()
