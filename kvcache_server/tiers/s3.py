"""The S3 tier: one object per block, parallel requests in a bounded thread pool, via boto3.

Objects live at `<prefix>/<namespace>/<chunk key hex>` in one bucket. Each
object is a whole block (possibly compressed by the stack), written with one
PutObject, which S3 makes visible atomically.

boto3 is blocking, so every request runs in this tier's own thread pool; the
server's event loop only awaits. The pool size bounds the concurrency against
S3 (and the memory of blocks in flight). Works with AWS, MinIO and any other
S3 API: the endpoint, region and path-style addressing are settings, and
credentials come from boto3's standard chain (environment, shared files,
instance roles).

Presence checks (Lookup) run in a small pool of their own, so they never queue
behind block transfers, and skip what the presence index knows: the keys this
server wrote, read or saw present in the bucket recently (PresenceIndex). Keys
it does not know are checked with HEADs, a few in parallel, and a prefix check
stops after the first absent key.

S3 content may vanish (lifecycle rules, an operator): a missing object is a miss.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvcache_core.threads import in_pool
from kvcache_server.tiers.base import Tier, TierError, TierKind, TierStats
from kvcache_server.write_queue import DeleteFence

try:
    import boto3
    from botocore.config import Config as BotoConfig
    from botocore.exceptions import BotoCoreError, ClientError
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError("the S3 tier needs boto3: pip install 'kvcache[s3]'") from exc

T = TypeVar("T")
_MISSING = {"404", "NoSuchKey", "NotFound"}


class PresenceIndex:
    """Keys known to be in the bucket, so that a Lookup need not send a HEAD for them.

    Holds a 64-bit hash of (namespace, key) for each key this server wrote, read, or saw present
    with a HEAD; a Get or HEAD that finds a key absent, and a Delete, remove it. What it can get
    wrong: a key it does not hold is only a HEAD away (errs towards a miss); a key it holds may have
    vanished from the bucket behind this server's back (lifecycle rules, an operator, another
    server's Delete), and a Lookup then reports it present: the Get that follows misses (and
    removes it here). It never makes a Get return wrong data, as every block read is verified
    under its key. A hash collision (about entries / 2**64 per key asked) is the same kind of
    false present.

    A request that saw keys present adds them only if this server has not begun deleting them
    since the request began (begin/end, a DeleteFence of its own): a Get that read a block before
    a Delete removed it does not put the key back here.

    Bounds: at most `max_bytes` (ENTRY_BYTES per key), in two generations of half as many keys;
    when the newer one is full, or older than half of `ttl_s`, the older one is dropped and the
    newer one takes its place. So a key is trusted at most `ttl_s` after S3 last confirmed it.
    Deletes made while older requests run leave tombstones until those end (DeleteFence).
    """

    ENTRY_BYTES = 96
    """Memory per key: the hash as a Python int (36 bytes) and its set slot (measured: 77 bytes)."""

    def __init__(self, max_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._half = max_bytes // self.ENTRY_BYTES // 2  # keys per generation; 0 disables the index
        self._ttl_s = ttl_s
        self._clock = clock
        self._new: set[int] = set()
        self._old: set[int] = set()
        self._new_since = self._old_since = clock()
        self._fence = DeleteFence()

    def __len__(self) -> int:
        return len(self._new | self._old)

    def _expire(self) -> None:
        now = self._clock()
        if now - self._old_since >= self._ttl_s:
            self._old = set()
        if now - self._new_since >= self._ttl_s / 2 or len(self._new) >= self._half:
            self._old, self._old_since = self._new, self._new_since
            self._new, self._new_since = set(), now

    def begin(self) -> int:
        """A request that may add keys begins; returns its token for add() and end()."""
        return self._fence.begin()

    def end(self, token: int) -> None:
        self._fence.end(token)

    def add(self, token: int, namespace: str, keys: Sequence[bytes]) -> None:
        """Keys the request `token` found present (or wrote), except those discarded since it began."""
        if not self._half:
            return
        for key in keys:
            if not self._fence.blocked(token, namespace, key):
                self._expire()
                self._new.add(hash((namespace, key)))

    def discard(self, namespace: str, keys: Sequence[bytes], *, deleting: bool = False) -> None:
        """Keys found absent; with `deleting`, keys this server deletes: requests that began before
        cannot add them back (the others may: a false present, which the next Get corrects)."""
        if deleting:
            self._fence.deleting(namespace, keys)
        for key in keys:
            h = hash((namespace, key))
            self._new.discard(h)
            self._old.discard(h)
        if deleting:
            self._fence.deleted(namespace, keys)

    def known(self, namespace: str, keys: Sequence[bytes]) -> list[bool]:
        if not self._new and not self._old:
            return [False] * len(keys)
        self._expire()
        return [(h := hash((namespace, k))) in self._new or h in self._old for k in keys]


class S3Tier(Tier):
    """Blocks as objects in an S3-compatible bucket."""

    name = "s3"
    kind = TierKind.S3

    def __init__(
        self,
        bucket: str,
        *,
        prefix: str = "kvcache",
        endpoint_url: str = "",
        region: str = "us-east-1",
        path_style: bool = False,
        max_concurrency: int = 16,
        timeout_s: float = 5.0,
        create_bucket: bool = False,
        presence_index_bytes: int = 64 << 20,
        presence_ttl_s: float = 600.0,
    ) -> None:
        """Creates the client; `create_bucket` makes the bucket if it does not exist (for MinIO/tests).

        `max_concurrency` bounds block transfers; presence checks get max(2, max_concurrency // 4)
        threads of their own. `presence_index_bytes` (0: no index) and `presence_ttl_s` bound the
        PresenceIndex.
        """
        if not bucket:
            raise ValueError("the S3 tier needs a bucket")
        self._head_width = max(2, max_concurrency // 4)  # HEADs in flight for one presence check
        config = BotoConfig(
            region_name=region,
            s3={"addressing_style": "path" if path_style else "auto"},
            connect_timeout=timeout_s,
            read_timeout=timeout_s,
            retries={"max_attempts": 1, "mode": "standard"},
            max_pool_connections=max_concurrency + self._head_width,
        )
        self._client = boto3.session.Session().client("s3", endpoint_url=endpoint_url or None, config=config)
        self._bucket = bucket
        self._prefix = prefix.strip("/")
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="kvcache-s3")
        self._heads = ThreadPoolExecutor(max_workers=self._head_width, thread_name_prefix="kvcache-s3-head")
        self.index = PresenceIndex(presence_index_bytes, presence_ttl_s)
        self._stats = TierStats(name=self.name, kind=self.kind)
        self._create_bucket = create_bucket
        self._bucket_ready = not create_bucket

    def _object(self, namespace: str, key: bytes) -> str:
        return f"{self._prefix}/{namespace}/{key.hex()}"

    async def _run(self, fn: Callable[..., T], *args: Any, pool: ThreadPoolExecutor | None = None) -> T:
        return await asyncio.get_running_loop().run_in_executor(pool or self._pool, fn, *args)

    async def _ensure_bucket(self) -> None:
        if self._bucket_ready:
            return
        try:
            await self._run(self._make_bucket)
        except (BotoCoreError, ClientError) as exc:
            raise TierError(f"s3 bucket {self._bucket}: {exc}") from exc
        self._bucket_ready = True

    def _make_bucket(self) -> None:
        try:
            self._client.head_bucket(Bucket=self._bucket)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in _MISSING:
                raise
            self._client.create_bucket(Bucket=self._bucket)

    def _get(self, name: str) -> bytes | None:
        try:
            return self._client.get_object(Bucket=self._bucket, Key=name)["Body"].read()
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in _MISSING:
                return None
            raise

    def _head(self, name: str) -> bool:
        try:
            self._client.head_object(Bucket=self._bucket, Key=name)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in _MISSING:
                return False
            raise
        return True

    def _put(self, name: str, block: bytes | memoryview) -> None:
        # botocore wants bytes (it hashes and may retry the body); a view of a received message is copied here.
        self._client.put_object(Bucket=self._bucket, Key=name, Body=bytes(block))

    def _delete(self, names: list[str]) -> None:
        for start in range(0, len(names), 1000):  # DeleteObjects takes at most 1000 keys
            objects = [{"Key": n} for n in names[start : start + 1000]]
            self._client.delete_objects(Bucket=self._bucket, Delete={"Objects": objects, "Quiet": True})

    async def _gather(
        self, what: str, fn: Callable[[str], T], names: list[str], pool: ThreadPoolExecutor | None = None
    ) -> list[T]:
        await self._ensure_bucket()
        try:
            return list(await asyncio.gather(*(self._run(fn, n, pool=pool) for n in names)))
        except (BotoCoreError, ClientError) as exc:
            raise TierError(f"s3 {what} in bucket {self._bucket}: {exc}") from exc

    async def get_many(self, namespace: str, keys: Sequence[bytes]) -> list[bytes | None]:
        token = self.index.begin()
        try:
            blocks = await self._gather("GET", self._get, [self._object(namespace, k) for k in keys])
            self.index.add(token, namespace, [k for k, b in zip(keys, blocks, strict=True) if b is not None])
        finally:
            self.index.end(token)
        self.index.discard(namespace, [k for k, b in zip(keys, blocks, strict=True) if b is None])
        for b in blocks:
            if b is None:
                self._stats.misses += 1
            else:
                self._stats.hits += 1
        return blocks

    async def _heads_of(self, namespace: str, keys: Sequence[bytes]) -> list[bool]:
        token = self.index.begin()
        try:
            names = [self._object(namespace, k) for k in keys]
            found = await self._gather("HEAD", self._head, names, self._heads)
            self.index.add(token, namespace, [k for k, here in zip(keys, found, strict=True) if here])
        finally:
            self.index.end(token)
        self.index.discard(namespace, [k for k, here in zip(keys, found, strict=True) if not here])
        return found

    async def contains_many(self, namespace: str, keys: Sequence[bytes]) -> list[bool]:
        return await self._heads_of(namespace, keys)

    async def contains_prefix(self, namespace: str, keys: Sequence[bytes]) -> list[bool]:
        """HEADs a few keys at a time, in order, until one is absent."""
        found: list[bool] = []
        for start in range(0, len(keys), self._head_width):
            found += await self._heads_of(namespace, keys[start : start + self._head_width])
            if not all(found):
                break
        return found + [False] * (len(keys) - len(found))

    def known(self, namespace: str, keys: Sequence[bytes]) -> list[bool]:
        return self.index.known(namespace, keys)

    async def put_many(self, namespace: str, items: Sequence[tuple[bytes, bytes]]) -> list[bool]:
        await self._ensure_bucket()
        token = self.index.begin()
        try:
            # Each PUT waited to its end even when the stack's timeout cancels the call (RedisTier.put_many).
            await asyncio.gather(*(in_pool(self._pool, self._put, self._object(namespace, k), b) for k, b in items))
            self.index.add(token, namespace, [k for k, _ in items])
        except (BotoCoreError, ClientError) as exc:
            raise TierError(f"s3 PUT in bucket {self._bucket}: {exc}") from exc
        finally:
            self.index.end(token)
        self._stats.puts += len(items)
        return [True] * len(items)

    async def delete_many(self, namespace: str, keys: Sequence[bytes]) -> int:
        return sum(await self.delete_present(namespace, keys))

    async def delete_present(self, namespace: str, keys: Sequence[bytes]) -> list[bool]:
        self.index.discard(namespace, keys, deleting=True)  # first: from now on, Lookups HEAD these keys
        names = [self._object(namespace, k) for k in keys]
        here = await self._gather("HEAD", self._head, names)
        present = [n for n, h in zip(names, here, strict=True) if h]
        if present:
            try:
                await self._run(self._delete, present)
            except (BotoCoreError, ClientError) as exc:
                raise TierError(f"s3 DELETE in bucket {self._bucket}: {exc}") from exc
        return [bool(h) for h in here]

    def stats(self) -> TierStats:
        s = self._stats
        return TierStats(name=s.name, kind=s.kind, hits=s.hits, misses=s.misses, puts=s.puts)

    async def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._heads.shutdown(wait=False, cancel_futures=True)
        self._client.close()
