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

S3 content may vanish (lifecycle rules, an operator): a missing object is a miss.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvcache_server.tiers.base import Tier, TierError, TierKind, TierStats

try:
    import boto3
    from botocore.config import Config as BotoConfig
    from botocore.exceptions import BotoCoreError, ClientError
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError("the S3 tier needs boto3: pip install 'kvcache[s3]'") from exc

T = TypeVar("T")
_MISSING = {"404", "NoSuchKey", "NotFound"}


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
    ) -> None:
        """Creates the client; `create_bucket` makes the bucket if it does not exist (for MinIO/tests)."""
        if not bucket:
            raise ValueError("the S3 tier needs a bucket")
        config = BotoConfig(
            region_name=region,
            s3={"addressing_style": "path" if path_style else "auto"},
            connect_timeout=timeout_s,
            read_timeout=timeout_s,
            retries={"max_attempts": 1, "mode": "standard"},
            max_pool_connections=max_concurrency,
        )
        self._client = boto3.session.Session().client("s3", endpoint_url=endpoint_url or None, config=config)
        self._bucket = bucket
        self._prefix = prefix.strip("/")
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="kvcache-s3")
        self._stats = TierStats(name=self.name, kind=self.kind)
        self._create_bucket = create_bucket
        self._bucket_ready = not create_bucket

    def _object(self, namespace: str, key: bytes) -> str:
        return f"{self._prefix}/{namespace}/{key.hex()}"

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

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

    async def _gather(self, what: str, fn: Callable[[str], T], names: list[str]) -> list[T]:
        await self._ensure_bucket()
        try:
            return list(await asyncio.gather(*(self._run(fn, n) for n in names)))
        except (BotoCoreError, ClientError) as exc:
            raise TierError(f"s3 {what} in bucket {self._bucket}: {exc}") from exc

    async def get_many(self, namespace: str, keys: Sequence[bytes]) -> list[bytes | None]:
        blocks = await self._gather("GET", self._get, [self._object(namespace, k) for k in keys])
        for b in blocks:
            if b is None:
                self._stats.misses += 1
            else:
                self._stats.hits += 1
        return blocks

    async def contains_many(self, namespace: str, keys: Sequence[bytes]) -> list[bool]:
        return await self._gather("HEAD", self._head, [self._object(namespace, k) for k in keys])

    async def put_many(self, namespace: str, items: Sequence[tuple[bytes, bytes]]) -> list[bool]:
        await self._ensure_bucket()
        try:
            await asyncio.gather(*(self._run(self._put, self._object(namespace, k), b) for k, b in items))
        except (BotoCoreError, ClientError) as exc:
            raise TierError(f"s3 PUT in bucket {self._bucket}: {exc}") from exc
        self._stats.puts += len(items)
        return [True] * len(items)

    async def delete_many(self, namespace: str, keys: Sequence[bytes]) -> int:
        names = [self._object(namespace, k) for k in keys]
        present = [n for n, here in zip(names, await self.contains_many(namespace, keys), strict=True) if here]
        if present:
            try:
                await self._run(self._delete, present)
            except (BotoCoreError, ClientError) as exc:
                raise TierError(f"s3 DELETE in bucket {self._bucket}: {exc}") from exc
        return len(present)

    def stats(self) -> TierStats:
        s = self._stats
        return TierStats(name=s.name, kind=s.kind, hits=s.hits, misses=s.misses, puts=s.puts)

    async def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()
