"""The Redis tier: one value per block, via redis-py's blocking clients in this tier's own threads.

Layout in Redis: the key `<key_prefix>/<namespace>/<chunk key hex>` holds the
whole block (header and payload, possibly compressed by the stack) as one
string value, written with SET (and EX when a TTL is set). Readers never see a
header without its payload: a SET is atomic.

Round trips: a presence check for a whole prompt is one pipelined round trip
of EXISTS commands (not one round trip per key); a batch put is one pipeline
of SETs; a delete is one DEL of all keys. Batch gets and puts, which move the
block bytes, run in this tier's own threads on redis-py's blocking client
(hiredis parses the replies), so the event loop never copies or parses them:
gets as pipelines of GET_PIPELINE GETs (for MiB-sized values about twice as
fast as the asyncio client's single pipeline, whose reply buffer grows by the
whole batch); puts as one pipeline whose large values go to the socket as
they are (the asyncio client joins a whole pipeline into one buffer first:
64 MiB copied on the event loop). Presence checks and deletes, small, run on
a client and two threads of their own (SMALL_THREADS), so that they never
queue behind a batch of block bytes, nor parse replies on the event loop: a
demotion check per write-behind batch on the asyncio client took about 5% of
the loop's time under same-host puts (bench/bench_lookup_inplace.py).

Redis may drop any value at any time (maxmemory eviction, TTL expiry, a
FLUSHALL by an operator): that is a miss, nothing else.

Sentinel: given a master's name and sentinels, the clients ask the sentinels
where that master is and follow it when they fail over (redis-py's Sentinel);
`url` then gives only the scheme (TLS), user, password and database. A Redis
Cluster is kvcache_server.tiers.redis_cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvcache_core.threads import in_pool
from kvcache_server.tiers.base import Tier, TierError, TierKind, TierStats

try:
    import redis
    from redis.connection import Encoder, PythonRespSerializer
    from redis.exceptions import RedisError
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError("the Redis tier needs redis-py: pip install 'kvcache[redis]'") from exc


GET_PIPELINE = 4
"""GETs per round trip of a batch get."""

SMALL_THREADS = 2
"""Threads (and connections) for presence checks and deletes."""

T = TypeVar("T")


class RedisTier(Tier):
    """Blocks in Redis (or Valkey, or anything speaking the Redis protocol)."""

    name = "redis"
    kind = TierKind.REDIS

    def __init__(
        self,
        url: str,
        *,
        key_prefix: str = "kvcache",
        ttl_s: int = 0,
        timeout_s: float = 1.0,
        password: str = "",
        tls_ca_file: str = "",
        max_connections: int = 32,
        sentinel_master: str = "",
        sentinels: Sequence[tuple[str, int]] = (),
    ) -> None:
        """Connects lazily to `url` ("redis://host:port/db" or "rediss://" for TLS).

        Args:
            url: Redis URL; a password may be given in it or in `password`.
            key_prefix: Prefix of every key, so several deployments can share a Redis.
            ttl_s: Expire blocks after this many seconds; 0 keeps them until Redis evicts them.
            timeout_s: Socket connect and read timeout of each command.
            password: Overrides the URL's password when set.
            tls_ca_file: CA bundle to verify the server with, for rediss:// URLs.
            max_connections: Connection pool size of the client for gets and puts, and its threads.
            sentinel_master: The master's name at the sentinels; with `sentinels`, the master is found
                (and followed on failover) through them instead of `url`'s host.
            sentinels: The sentinels' (host, port).
        """
        kwargs: dict[str, Any] = {
            "socket_timeout": timeout_s,
            "socket_connect_timeout": timeout_s,
            "max_connections": max_connections,
            "retry_on_timeout": False,
        }
        if password:
            kwargs["password"] = password
        if url.startswith("rediss://"):
            kwargs["ssl_cert_reqs"] = ssl.CERT_REQUIRED
            if tls_ca_file:
                kwargs["ssl_ca_certs"] = tls_ca_file
        # Batch gets and puts, in self._pool. Commands are packed by redis-py's pure-Python packer, which
        # hands large values to the socket as they are; hiredis's copies each one into a new buffer,
        # holding the GIL (so stalling the event loop) for ~20-50 ms per 32 MiB.
        packer = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
        small = {**kwargs, "max_connections": SMALL_THREADS}
        if sentinel_master:
            self._blocking = _sentinel_client(url, sentinel_master, sentinels, kwargs, packer)
            self._small = _sentinel_client(url, sentinel_master, sentinels, small, packer)
            url = f"master {sentinel_master!r} of sentinels " + ",".join(f"{h}:{p}" for h, p in sentinels)
        else:
            self._blocking = redis.Redis.from_url(url, command_packer=packer, **kwargs)
            self._small = redis.Redis.from_url(url, command_packer=packer, **small)
        self._pool = ThreadPoolExecutor(max_workers=max_connections, thread_name_prefix="kvcache-redis")
        self._small_pool = ThreadPoolExecutor(max_workers=SMALL_THREADS, thread_name_prefix="kvcache-redis-small")
        self._prefix = key_prefix
        self._ttl_s = ttl_s
        self._url_for_logs = url.split("@")[-1]
        self._stats = TierStats(name=self.name, kind=self.kind)

    def _key(self, namespace: str, key: bytes) -> str:
        return f"{self._prefix}/{namespace}/{key.hex()}"

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def get_many(self, namespace: str, keys: Sequence[bytes]) -> list[bytes | None]:
        names = [self._key(namespace, k) for k in keys]
        try:
            values = await self._run(self._get_blocking, names)
        except RedisError as exc:
            raise TierError(f"redis GET pipeline on {self._url_for_logs}: {exc}") from exc
        for v in values:
            if v is None:
                self._stats.misses += 1
            else:
                self._stats.hits += 1
        return list(values)

    def _get_blocking(self, names: list[str]) -> list[bytes | None]:
        values: list[bytes | None] = []
        for i in range(0, len(names), GET_PIPELINE):
            with self._blocking.pipeline(transaction=False) as pipe:
                for name in names[i : i + GET_PIPELINE]:
                    pipe.get(name)
                values.extend(pipe.execute())
        return values

    async def contains_many(self, namespace: str, keys: Sequence[bytes]) -> list[bool]:
        names = [self._key(namespace, k) for k in keys]
        try:
            # Not waited for when cancelled (a Lookup's deadline): a presence check changes nothing, and
            # one still queued is dropped by the executor.
            counts = await asyncio.get_running_loop().run_in_executor(self._small_pool, self._each, "EXISTS", names)
        except RedisError as exc:
            raise TierError(f"redis EXISTS pipeline on {self._url_for_logs}: {exc}") from exc
        return [bool(c) for c in counts]

    def _each(self, command: str, names: list[str]) -> list[Any]:
        """One `command` per name, pipelined in one round trip; the replies in order."""
        with self._small.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.execute_command(command, name)
            return pipe.execute()

    async def put_many(self, namespace: str, items: Sequence[tuple[bytes, bytes]]) -> list[bool]:
        named = [(self._key(namespace, k), block) for k, block in items]
        try:
            # Waited to its end even when the stack's timeout cancels the call: a SET that lands after
            # the call was given up is still a write a Delete must wait for (kvcache_server/stack.py).
            await in_pool(self._pool, self._put_blocking, named)
        except RedisError as exc:
            raise TierError(f"redis SET pipeline on {self._url_for_logs}: {exc}") from exc
        self._stats.puts += len(items)
        return [True] * len(items)

    def _put_blocking(self, named: list[tuple[str, bytes]]) -> None:
        with self._blocking.pipeline(transaction=False) as pipe:
            for name, block in named:
                pipe.set(name, block, ex=self._ttl_s or None)
            pipe.execute()

    async def delete_many(self, namespace: str, keys: Sequence[bytes]) -> int:
        return sum(await self.delete_present(namespace, keys))

    async def delete_present(self, namespace: str, keys: Sequence[bytes]) -> list[bool]:
        names = [self._key(namespace, k) for k in keys]
        try:  # one DEL per key, pipelined: each reply says whether that key was there; waited for to its end
            counts = await in_pool(self._small_pool, self._each, "DEL", names)
        except RedisError as exc:
            raise TierError(f"redis DEL pipeline on {self._url_for_logs}: {exc}") from exc
        return [bool(c) for c in counts]

    def stats(self) -> TierStats:
        s = self._stats
        return TierStats(name=s.name, kind=s.kind, hits=s.hits, misses=s.misses, puts=s.puts)

    async def close(self) -> None:
        for pool in (self._pool, self._small_pool):
            pool.shutdown(wait=False, cancel_futures=True)
        for client in (self._blocking, self._small):
            with contextlib.suppress(RedisError):
                client.close()


def _sentinel_client(
    url: str, master: str, sentinels: Sequence[tuple[str, int]], kwargs: dict[str, Any], packer: Any
) -> Any:
    """A blocking client of the master the sentinels name `master`, with `url`'s credentials, database
    and TLS, and kwargs' max_connections."""
    from urllib.parse import unquote, urlsplit

    from redis.sentinel import Sentinel

    if not sentinels:
        raise ValueError("a Sentinel-managed Redis needs at least one sentinel")
    parts = urlsplit(url)
    conn = {k: v for k, v in kwargs.items() if k != "max_connections"}
    conn["db"] = int(parts.path.strip("/") or 0)
    if parts.username:
        conn["username"] = unquote(parts.username)
    if parts.password and "password" not in conn:
        conn["password"] = unquote(parts.password)
    if parts.scheme == "rediss":
        conn["ssl"] = True
    at_sentinels = {"socket_timeout": kwargs["socket_timeout"], "socket_connect_timeout": kwargs["socket_timeout"]}
    pool = {"max_connections": kwargs["max_connections"]}
    return Sentinel(list(sentinels), sentinel_kwargs=at_sentinels, **conn).master_for(
        master, command_packer=packer, **pool
    )
