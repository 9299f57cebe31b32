"""The client's side of the presence index: Lookups of blocks the server's RAM holds, without an RPC.

A server that shares its block arena with this process (same host, same user, its tenant: the trust
rules of docs/arena.md) also names, in its Info answer, its presence index for the caller's tenant:
a read-only file of fingerprints of the (namespace, key)s its RAM tier indexes (layout:
kvcache_core.presence; docs/presence.md). KVCacheClient.lookup and AsyncKVCacheClient.lookup
(kvcache_client.calls, written once) read it first: the longest prefix of the keys whose
fingerprints it holds; when that is every key, or the first absent key is certainly absent (no
tier below RAM, its bucket never overflowed), the answer needs no RPC (tiers "ram"); otherwise one
Lookup RPC for the keys from the first absent one on, combined with the prefix.

The index is a hint, as a Lookup answer always is: a key evicted right after it was read is a miss
of the Get that follows, never wrong bytes (blocks are verified under their key). What is not
trusted at all (the lookup then goes by RPC): an index not mapped (another host or user, an older
server, `presence_index=False`, `shm=False`), one whose header does not name the instance id Info
named or whose server closed it (stopped) or no longer holds its lock (killed; a restarted server
has a new index, which the next Info maps: asked at most once a second while the old one is stale).
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import stat
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import xxhash

from kvcache_core.filelock import record_lock_held
from kvcache_core.presence import (
    BUCKET_SLOTS,
    FLAG_CLOSED,
    FLAG_LOCATIONS,
    FLAG_LOWER_TIERS,
    HEADER_BYTES,
    MAGIC,
    VERSION,
    W_BUCKETS,
    W_FLAGS,
    W_INSTANCE,
    W_MAGIC,
    W_SEED,
    W_VERSION,
    file_bytes,
    locations_at,
    table_bytes,
    versions_at,
)

log = logging.getLogger(__name__)

REFRESH_INTERVAL_S = 1.0
"""A stale index (its server gone) is looked for again in Info at most this often."""

_SCALAR_KEYS = 128
"""Up to this many keys are looked up one by one (a struct read of each key's bucket); more go through
numpy at once. numpy is faster warm past ~24 keys (128: 37 against 50 us) but touches far more code
and memory: SGLang's batch_exists of 128 keys right after a 48 MiB store (the caller's caches cold)
took 0.20-0.26 ms one by one against 0.28 through numpy, alternating in one session (0.066-0.074 ms
warm either way)."""


@dataclass(slots=True)
class PresenceCounters:
    """How this client's lookups were answered (a plain object: read, never reset).

    Attributes:
        local: answered from the index alone, without an RPC.
        partial: a prefix from the index, one RPC for the keys after it.
        rpc: by RPC only (the index off or in doubt: the first key absent with lower tiers, an
            overflowed bucket, a stale or unmapped index).
        read_in_place: blocks get_into copied straight out of the arena where the index located
            them, verified where they landed (kvcache_client.local_reads).
        read_again: get_into calls whose copies out of the arena did not hold (a slot reused or being
            written meanwhile: the index's bucket changed, or a block did not verify), asked of the
            server instead; counted once a call.
    """

    local: int = 0
    partial: int = 0
    rpc: int = 0
    read_in_place: int = 0
    read_again: int = 0


@dataclass(slots=True)
class Located:
    """PresenceLink.locate's answer for a prefix of keys: each one's location word, its bucket and
    that bucket's version as read before the location (for PresenceLink.unchanged)."""

    words: list[int] = field(default_factory=list)
    buckets: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    instance: int = 0  # the server instance whose table was read


_BUCKET = struct.Struct(f"={BUCKET_SLOTS}Q")
"""One bucket's fingerprints, read in one call (a tuple): a third of a memoryview slice's .tolist()."""

KEY_BYTES = 16
MAX_NAMESPACE_BYTES = 128  # the server's rule (kvcache_server/service.py)


def _fingerprints(ns: bytes, keys: Sequence[bytes], seed: int) -> np.ndarray:
    """The keys' fingerprints under `ns` (its name and a NUL) as uint64s: a list, then one array (128
    keys: 37 us with the table read after, against 47 through np.fromiter over a generator)."""
    h = xxhash.xxh3_64_intdigest
    return np.array([h(ns + k, seed) or 1 for k in keys], np.uint64)


def well_formed(namespace: str, keys: Sequence[bytes], max_keys: int) -> bool:
    """Whether the server would take this Lookup: a namespace of 1..128 printable ASCII characters
    without spaces or ':', 16-byte keys, at most its max_keys_per_request of them (when known).
    Anything else is asked of the server, so that bad input gets its INVALID_ARGUMENT, never a
    local answer."""
    if max_keys and len(keys) > max_keys:
        return False
    if not (0 < len(namespace) <= MAX_NAMESPACE_BYTES and namespace.isascii() and namespace.isprintable()):
        return False
    if " " in namespace or ":" in namespace:
        return False
    return all(type(k) is bytes and len(k) == KEY_BYTES for k in keys)


class PresenceLink:
    """This client's mapping of its tenant's presence index, and the counters. Thread-safe.

    States: "unknown" until the first Info, then "on", "stale" (its server stopped or restarted:
    the next Info maps the new one) or "off".
    """

    def __init__(self, enabled: bool = True) -> None:
        self.state = "unknown" if enabled else "off"
        self.reason = "" if enabled else "disabled by the client"
        self.path = ""
        self.counters = PresenceCounters()
        self._instance = 0
        self._fd = -1
        self._words: memoryview | None = None  # the file as uint64 words (header, buckets)
        self._mapped: mmap.mmap | None = None  # the same, for struct reads of a bucket
        self._table: np.ndarray | None = None  # the buckets, (n, 8) uint64
        self._overflow: np.ndarray | None = None  # n x uint8
        self._locations: np.ndarray | None = None  # (n, 8) uint64, with FLAG_LOCATIONS
        self._versions: np.ndarray | None = None  # n uint64, with FLAG_LOCATIONS
        self._located = 0  # a slot's word index + this: its location's
        self._versions_at = 0  # the word index of bucket 0's version
        self._mask = 0
        self._seed = 0
        self._stale_since = 0.0
        self._lock = threading.Lock()
        self.max_keys = 0  # the server's max_keys_per_request (0: not known yet)

    @property
    def wants_info(self) -> bool:
        """Whether an Info answer would help: never asked yet, or stale for REFRESH_INTERVAL_S."""
        if self.state == "unknown":
            return True
        return self.state == "stale" and time.monotonic() - self._stale_since >= REFRESH_INTERVAL_S

    def configure(self, path: str, instance_id: int, max_keys_per_request: int = 0) -> None:
        """Takes the server's Info answer: maps the index it names, if it is this process's to map."""
        self.max_keys = max_keys_per_request
        with self._lock:
            if self.state == "off":
                return
            if path == self.path and instance_id == self._instance and self.state == "on":
                return
            self._unmap()
            if not path:
                self._set("off", "the server names no presence index (not sharing its arena with this client)")
                return
            self._map(path, instance_id)

    def close(self) -> None:
        """Unmaps the index for good (its client is closed): a closed client kept the tenant's table
        mapped until the client object itself was collected, and an engine's connector often never is."""
        with self._lock:
            self._unmap()
            self._set("off", "the client is closed")

    def _set(self, state: str, reason: str) -> None:
        if state != self.state:
            log.debug("presence index %s: %s", state, reason)
        self.state, self.reason = state, reason

    def _map(self, path: str, instance_id: int) -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            self._set("off", f"cannot open the presence index {path} ({exc.strerror}): another host or user")
            return
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size < HEADER_BYTES:
                raise ValueError(f"{path} is not a presence index of this user")
            mapped = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            words = memoryview(mapped).cast("Q")
            buckets = words[W_BUCKETS]
            if (
                words[W_MAGIC] != MAGIC
                or words[W_VERSION] != VERSION
                or words[W_INSTANCE] != instance_id
                or not buckets
                or buckets & (buckets - 1)
                or st.st_size < table_bytes(buckets)
            ):
                raise ValueError(f"{path} is not the presence index of server instance {instance_id}")
        except (OSError, ValueError) as exc:
            os.close(fd)
            self._set("off", str(exc))
            return
        self._fd, self._words, self._mapped, self.path, self._instance = fd, words, mapped, path, instance_id
        self._table = np.frombuffer(mapped, np.uint64, buckets * BUCKET_SLOTS, HEADER_BYTES).reshape(buckets, -1)
        self._overflow = np.frombuffer(mapped, np.uint8, buckets, HEADER_BYTES + buckets * BUCKET_SLOTS * 8)
        self._mask, self._seed = buckets - 1, words[W_SEED]
        if words[W_FLAGS] & FLAG_LOCATIONS and st.st_size >= file_bytes(buckets):
            at = locations_at(buckets)
            self._locations = np.frombuffer(mapped, np.uint64, buckets * BUCKET_SLOTS, at).reshape(buckets, -1)
            self._versions = np.frombuffer(mapped, np.uint64, buckets, versions_at(buckets))
            self._located, self._versions_at = at // 8 - HEADER_BYTES // 8, versions_at(buckets) // 8
        self._set("on", "")

    def _unmap(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        self._fd, self._words, self._mapped, self._table, self._overflow, self.path = -1, None, None, None, None, ""
        self._locations = self._versions = None

    def _trusted(self) -> bool:
        """The header names the instance Info named, is not closed, and its server holds its lock."""
        words, fd = self._words, self._fd
        if words is None or fd < 0:  # not mapped, or unmapped by another thread meanwhile
            return False
        if words[W_FLAGS] & FLAG_CLOSED or words[W_INSTANCE] != self._instance:
            return self._stale("the server closed its presence index")
        if record_lock_held(fd):
            return True  # the server holds its record lock: it lives (one fcntl call, no exception)
        try:  # no record lock: a server without one, or a dead server (its flock says which)
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True  # the server holds its exclusive lock: it lives
        except OSError:
            return self._stale("cannot check the presence index's lock")
        fcntl.flock(fd, fcntl.LOCK_UN)
        return self._stale("the server of the presence index is gone")

    def _stale(self, reason: str) -> bool:
        with self._lock:
            self._unmap()
            self._set("stale", reason)
            self._stale_since = time.monotonic()
        return False

    @property
    def locates(self) -> bool:
        """Whether the mapped index says where blocks lie (a server with FLAG_LOCATIONS)."""
        return self.state == "on" and self._locations is not None

    def locate(self, namespace: str, keys: Sequence[bytes]) -> Located:
        """The location words (kvcache_core.presence.unpack_location) of the longest prefix of `keys`
        the index holds and locates, with their buckets' versions as read before them; empty when
        the index is not to be trusted or has no locations, and it stops at a bucket the server is
        changing. A copy made from a location is this (namespace, key)'s block if unchanged() still
        holds after the copy (the seqlock of kvcache_core.presence)."""
        if not self.locates or not well_formed(namespace, keys, self.max_keys) or not self._trusted():
            return Located()
        words, table, locations, versions, mapped = (
            self._words, self._table, self._locations, self._versions, self._mapped
        )  # fmt: skip  # one snapshot: a bucket's slots and its location words from the same table
        if words is None or table is None or locations is None or versions is None or mapped is None:
            return Located()  # unmapped meanwhile
        ns, seed, mask, located = namespace.encode() + b"\x00", self._seed, self._mask, self._located
        out = Located(instance=self._instance)
        if len(keys) <= _SCALAR_KEYS:
            at_versions = self._versions_at
            fingerprint, read_bucket = xxhash.xxh3_64_intdigest, _BUCKET.unpack_from
            for key in keys:
                fp = fingerprint(ns + key, seed) or 1
                bucket = fp & mask
                version = words[at_versions + bucket]  # first: then the slots, then the copy
                base = HEADER_BYTES // 8 + bucket * BUCKET_SLOTS
                try:
                    at = base + read_bucket(mapped, base * 8).index(fp)
                except ValueError:
                    break
                word = words[at + located]
                if not word or version & 1:
                    break
                out.words.append(word)
                out.buckets.append(bucket)
                out.versions.append(version)
            return out
        n = len(keys)
        fps = _fingerprints(ns, keys, seed)
        buckets = fps & np.uint64(mask)
        seen = versions[buckets]  # first: then the slots, then the copy
        match = table[buckets] == fps[:, None]
        hit = match.any(axis=1)
        found = n if hit.all() else int(hit.argmin())
        words_at = locations[buckets[:found], match[:found].argmax(axis=1)]
        stop = np.flatnonzero((words_at == 0) | ((seen[:found] & np.uint64(1)) == 1))
        end = int(stop[0]) if stop.size else found
        out.words, out.buckets, out.versions = words_at[:end].tolist(), buckets[:end].tolist(), seen[:end].tolist()
        return out

    def unchanged(self, located: Located) -> bool:
        """Whether no bucket of `located` changed since locate() read it: every entry it located stayed
        indexed, at its location, all along (its slot not freed, so not reused). Read after the copy;
        False if the table is no longer the one read (another instance mapped, or closed by its server).
        A server killed meanwhile changes nothing more: what was indexed at its death was copied."""
        words, versions = self._words, self._versions
        if words is None or versions is None or located.instance != self._instance:
            return False
        if words[W_FLAGS] & FLAG_CLOSED or words[W_INSTANCE] != located.instance:
            return False
        if len(located.buckets) <= _SCALAR_KEYS:
            at = self._versions_at
            return all(words[at + b] == v for b, v in zip(located.buckets, located.versions, strict=True))
        now = versions[np.asarray(located.buckets, dtype=np.int64)]
        return bool((now == np.asarray(located.versions, dtype=np.uint64)).all())

    def prefix(self, namespace: str, keys: Sequence[bytes]) -> tuple[int, bool] | None:
        """The longest prefix of `keys` the index holds, and whether that is the whole answer (every
        key, or the first absent one certainly in no tier); None when the index is not to be trusted.

        Args:
            namespace: the namespace as the client names it (the index is its tenant's own).
            keys: the keys, in order.
        """
        if self.state != "on" or not well_formed(namespace, keys, self.max_keys) or not self._trusted():
            return None  # a request the server would refuse goes to it, for its precise error
        table, overflow, words, mapped = self._table, self._overflow, self._words, self._mapped
        if table is None or overflow is None or words is None or mapped is None:  # unmapped meanwhile
            return None
        ns, seed, mask = namespace.encode() + b"\x00", self._seed, self._mask
        n = len(keys)
        if n <= _SCALAR_KEYS:
            found, absent = n, 0
            fingerprint, bucket = xxhash.xxh3_64_intdigest, _BUCKET.unpack_from
            for i, key in enumerate(keys):
                fp = fingerprint(ns + key, seed) or 1
                if fp not in bucket(mapped, HEADER_BYTES + (fp & mask) * _BUCKET.size):
                    found, absent = i, fp & mask
                    break
        else:
            fps = _fingerprints(ns, keys, seed)
            buckets = fps & np.uint64(mask)
            hit = (table[buckets] == fps[:, None]).any(axis=1)
            found = n if hit.all() else int(hit.argmin())
            absent = int(buckets[found]) if found < n else 0
        if found == n:
            return n, True
        certain = not words[W_FLAGS] & FLAG_LOWER_TIERS and not overflow[absent]
        return found, certain
