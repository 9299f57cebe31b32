"""The Redis tier on a Redis Cluster (or Valkey cluster): the same values as on one Redis, spread by slot.

Layout: the same keys and values as kvcache_server.tiers.redis (one string per block, SET/GET), so a
block's key hashes to one of the 16384 slots, each owned by one master (and copied to its replicas).

Round trips: a batch (get, put, presence check, delete) is grouped by the master that owns each key's
slot, from the cluster's slot map, and sent as one pipeline per master, all masters in parallel: in one
of this tier's threads (the event loop never parses block bytes), every master's pipeline is written
before any reply is read, on redis-py's blocking connections (hiredis parses the replies). No command
names keys of two slots (a DEL is one key per command), so nothing is refused as CROSSSLOT.
`round_trips` counts the pipelines sent.

Topology changes:
    MOVED or ASK (a slot moved, or is moving, to another master): the redirected keys are sent again,
    one by one, through redis-py's RedisCluster, which follows the redirection; the slot map is read
    again in the background (no batch waits for it).
    A master that does not answer (killed, partitioned, or silent for half the tier's timeout): its keys
    are read from one of its replicas (READONLY) where it has one, else they are misses, counted in
    `errors`; its puts report False and a delete fails (TierError). For DOWN_S it is not tried again
    (its keys go straight to the replica). The slot map is refreshed (at most every REFRESH_S) until the
    cluster has promoted a replica, after which its slots are served by the new master.
    A batch whose masters all fail raises TierError: the stack counts it as a failure of the tier
    (its breaker, one per tier, opens after breaker_failures of them in a row).

Values are whole blocks or nothing (SET is atomic, replication copies whole values), and every block
is checked against its key by the stack, so no topology change can serve wrong bytes.
"""

from __future__ import annotations

import asyncio
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvcache_core.threads import in_pool
from kvcache_server.tiers.base import Tier, TierError, TierKind, TierStats

try:
    import redis
    from redis.backoff import ExponentialBackoff, NoBackoff
    from redis.cluster import ClusterNode, RedisCluster
    from redis.connection import Encoder, PythonRespSerializer
    from redis.crc import key_slot
    from redis.exceptions import RedisClusterException, RedisError, ResponseError
    from redis.retry import Retry
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError("the Redis tier needs redis-py: pip install 'kvcache[redis]'") from exc

T = TypeVar("T")

REFRESH_S = 0.25
"""Least time between two slot-map refreshes (after a redirection or a master that failed)."""

DOWN_S = 1.0
"""A master whose pipeline failed is not tried again for this long: its keys go straight to its replica."""


class _NodeDown(Exception):
    """A node's pipeline failed as a whole (connection refused or reset, timeout, LOADING...)."""


class RedisClusterTier(Tier):
    """Blocks in a Redis Cluster, one pipeline per master per batch."""

    name = "redis"
    kind = TierKind.REDIS

    def __init__(
        self,
        nodes: Sequence[tuple[str, int]],
        *,
        key_prefix: str = "kvcache",
        ttl_s: int = 0,
        timeout_s: float = 1.0,
        username: str = "",
        password: str = "",
        tls: bool = False,
        tls_ca_file: str = "",
        max_connections: int = 32,
    ) -> None:
        """Connects lazily: the slot map is read from the first start-up node that answers, at the first call.

        Args:
            nodes: Start-up nodes (host, port); any master or replica of the cluster will do.
            key_prefix: Prefix of every key, so several deployments can share a cluster.
            ttl_s: Expire blocks after this many seconds; 0 keeps them until Redis evicts them.
            timeout_s: The stack's time for one call: a node gets half of it (to connect, and per read),
                so a master that stays silent leaves the other half to read its replica.
            username: ACL user, if any.
            password: The nodes' password (requirepass / masterauth), if any.
            tls: Speak TLS to every node.
            tls_ca_file: CA bundle to verify the nodes with, when `tls`.
            max_connections: Connections per node, and threads for batch calls.
        """
        if not nodes:
            raise ValueError("a Redis Cluster tier needs at least one start-up node")
        # Half the call's time for one node, so a hung master leaves time to read its replica.
        self._kwargs: dict[str, Any] = {
            "socket_timeout": timeout_s / 2,
            "socket_connect_timeout": timeout_s / 2,
            "max_connections": max_connections,
        }
        if username:
            self._kwargs["username"] = username
        if password:
            self._kwargs["password"] = password
        if tls:
            self._kwargs["ssl"] = True
            self._kwargs["ssl_cert_reqs"] = ssl.CERT_REQUIRED
            if tls_ca_file:
                self._kwargs["ssl_ca_certs"] = tls_ca_file
        self._startup = [ClusterNode(host, port) for host, port in nodes]
        self._nodes_for_logs = ",".join(f"{h}:{p}" for h, p in nodes)
        self._cluster: RedisCluster | None = None
        self._lock = threading.Lock()
        self._clients: dict[str, redis.Redis] = {}  # node name -> its client (own pools, pure-Python packer)
        self._stale = False
        self._refreshed_at = 0.0
        self._refreshing = threading.Lock()  # held while a refresh runs in self._refresher
        self._refresher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvcache-rcluster-map")
        self._down_until: dict[str, float] = {}  # node name -> monotonic time to try it again
        self._pool = ThreadPoolExecutor(max_workers=max_connections, thread_name_prefix="kvcache-rcluster")
        self._prefix = key_prefix
        self._ttl_s = ttl_s
        self._stats = TierStats(name=self.name, kind=self.kind)
        self.round_trips = 0
        """Pipelines sent to nodes (one per master per batch, plus one per replica read)."""
        self.refreshes = 0
        """Slot-map refreshes after a redirection or a failed master."""
        self.node_failures = 0
        """Pipelines to a master that failed as a whole."""
        self.replica_reads = 0
        """Pipelines sent to a replica instead of its master that failed."""

    def _key(self, namespace: str, key: bytes) -> str:
        return f"{self._prefix}/{namespace}/{key.hex()}"

    # -- topology ----------------------------------------------------------------------------------

    def _topology(self) -> RedisCluster:
        """The cluster client (slot map), created at first use and refreshed when marked stale."""
        cluster = self._cluster
        if cluster is None:
            with self._lock:
                if self._cluster is None:
                    try:
                        self._cluster = RedisCluster(
                            startup_nodes=list(self._startup),
                            require_full_coverage=False,
                            retry=Retry(ExponentialBackoff(cap=0.1, base=0.01), 2),
                            **self._kwargs,
                        )
                    except (RedisError, RedisClusterException) as exc:
                        raise TierError(
                            f"redis cluster {self._nodes_for_logs}: no start-up node answered: {exc}"
                        ) from exc
                    self._refreshed_at = time.monotonic()
                return self._cluster
        if (
            self._stale
            and time.monotonic() - self._refreshed_at >= REFRESH_S
            and self._refreshing.acquire(blocking=False)
        ):
            self._refreshed_at = time.monotonic()
            try:
                self._refresher.submit(self._refresh, cluster)
            except RuntimeError:  # closed
                self._refreshing.release()
        return cluster

    def _refresh(self, cluster: RedisCluster) -> None:
        """Reads the slot map again, in its own thread: no batch waits for it (a hung start-up node
        would hold it up to the socket timeout); batches meanwhile use the old map."""
        try:
            self._stale = False  # a failure seen from now on marks it stale again
            cluster.nodes_manager.initialize()
            self.refreshes += 1
        except (RedisError, RedisClusterException, OSError):
            self._stale = True  # tried again after REFRESH_S
        finally:
            self._refreshed_at = time.monotonic()
            self._refreshing.release()

    def _client(self, host: str, port: int) -> redis.Redis:
        name = f"{host}:{port}"
        with self._lock:
            client = self._clients.get(name)
            if client is None:
                # redis-py's pure-Python packer hands large values to the socket as they are (see redis.py).
                packer = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
                kwargs = {k: v for k, v in self._kwargs.items() if k != "ssl"}  # the scheme says TLS
                scheme = "rediss" if self._kwargs.get("ssl") else "redis"
                client = redis.Redis.from_url(
                    f"{scheme}://{host}:{port}/0", command_packer=packer, retry=Retry(NoBackoff(), 0), **kwargs
                )  # no retries: a master that failed is read from its replica, or is a miss
                self._clients[name] = client
            return client

    def _route(self, names: Sequence[str]) -> tuple[dict[str, list[int]], dict[str, Any], list[int]]:
        """Groups indexes of `names` by the master owning their slot: ({node: [i]}, {node: ClusterNode},
        indexes whose slot no master covers)."""
        manager = self._topology().nodes_manager
        groups: dict[str, list[int]] = {}
        nodes: dict[str, Any] = {}
        uncovered: list[int] = []
        slots = manager.slots_cache
        for i, name in enumerate(names):
            owners = slots.get(key_slot(name.encode()))
            if not owners:
                uncovered.append(i)
                continue
            node = owners[0]
            groups.setdefault(node.name, []).append(i)
            nodes[node.name] = node
        return groups, nodes, uncovered

    def _replica_of(self, node_name: str, index_name: str) -> Any | None:
        cluster = self._cluster
        owners = cluster.nodes_manager.slots_cache.get(key_slot(index_name.encode())) if cluster else None
        owners = owners or []
        return next((n for n in owners[1:] if n.name != node_name), None)

    def _send(self, host: str, port: int, commands: list[tuple[Any, ...]]) -> tuple[Any, Any]:
        """Writes one pipeline to one node, without waiting for its replies: (connection, pool)."""
        with self._lock:
            self.round_trips += 1
        pool = self._client(host, port).connection_pool
        try:
            conn = pool.get_connection()
        except (RedisError, OSError) as exc:
            raise _NodeDown(f"{host}:{port}: {exc}") from exc
        try:
            conn.send_packed_command(conn.pack_commands(commands))
        except (RedisError, OSError) as exc:
            conn.disconnect()
            pool.release(conn)
            raise _NodeDown(f"{host}:{port}: {exc}") from exc
        return conn, pool

    @staticmethod
    def _read(conn: Any, pool: Any, n: int) -> list[Any]:
        """The `n` replies of a pipeline that _send wrote, error replies in place; _NodeDown when the
        connection failed (it is then closed, so no later reader sees a reply of this one)."""
        replies: list[Any] = []
        try:
            for _ in range(n):
                try:
                    replies.append(conn.read_response())
                except ResponseError as exc:
                    replies.append(exc)
        except (RedisError, OSError) as exc:
            conn.disconnect()
            raise _NodeDown(f"{conn.host}:{conn.port}: {exc}") from exc
        finally:
            pool.release(conn)
        return replies

    def _node_failed(self, node_name: str) -> None:
        with self._lock:
            self.node_failures += 1
            self._down_until[node_name] = time.monotonic() + DOWN_S
        self._stale = True

    def _fan_out(
        self, names: Sequence[str], command: Callable[[int], tuple[Any, ...]], *, replica_reads: bool
    ) -> tuple[list[Any], list[int], list[str]]:
        """Sends `command(i)` for every name, one pipeline per master: every master's pipeline is written
        first, then their replies are read, so the masters work on them in parallel.

        Returns (raw replies in the order of `names`, None for keys not answered; indexes not answered;
        nodes that failed). Error replies (a redirection) are left in place for _redirected; keys of a
        failed master are read from one of its replicas when `replica_reads`.
        """
        groups, nodes, uncovered = self._route(names)
        replies: list[Any] = [None] * len(names)
        unanswered = list(uncovered)
        failed: list[str] = []
        fallback: list[tuple[str, list[int]]] = []
        sent = []
        now = time.monotonic()
        for node_name, indexes in groups.items():
            if self._down_until.get(node_name, 0.0) > now:  # failed less than DOWN_S ago
                failed.append(node_name)
                fallback.append((node_name, indexes))
                continue
            node = nodes[node_name]
            try:
                sent.append((node_name, indexes, *self._send(node.host, node.port, [command(i) for i in indexes])))
            except _NodeDown:
                self._node_failed(node_name)
                failed.append(node_name)
                fallback.append((node_name, indexes))
        for node_name, indexes, conn, pool in sent:
            try:
                out = self._read(conn, pool, len(indexes))
            except _NodeDown:
                self._node_failed(node_name)
                failed.append(node_name)
                fallback.append((node_name, indexes))
                continue
            for i, reply in zip(indexes, out, strict=True):
                replies[i] = reply
        for node_name, indexes in fallback:
            replica = self._replica_of(node_name, names[indexes[0]]) if replica_reads else None
            if replica is None:
                unanswered.extend(indexes)
                continue
            with self._lock:
                self.replica_reads += 1
            try:
                conn, pool = self._send(replica.host, replica.port, [("READONLY",), *(command(i) for i in indexes)])
                out = self._read(conn, pool, len(indexes) + 1)[1:]
            except _NodeDown:
                unanswered.extend(indexes)
                continue
            for i, reply in zip(indexes, out, strict=True):
                replies[i] = reply
        if uncovered:
            self._stale = True
        return replies, sorted(unanswered), failed

    def _redirected(self, replies: list[Any], retry: Callable[[RedisCluster, int], Any]) -> list[int]:
        """Re-sends, through RedisCluster (which follows MOVED and ASK and retries TRYAGAIN), each key
        whose reply was an error (a redirection, CLUSTERDOWN, LOADING...); returns the indexes that
        still failed."""
        still: list[int] = []
        for i, reply in enumerate(replies):
            if isinstance(reply, Exception):
                self._stale = True
                try:
                    replies[i] = retry(self._topology(), i)
                except (RedisError, RedisClusterException, OSError):
                    replies[i] = None
                    still.append(i)
        return still

    def _cluster_down(self) -> bool:
        """Whether every master of the slot map failed less than DOWN_S ago (or the map has none)."""
        cluster = self._cluster
        if cluster is None:
            return True
        masters = {owners[0].name for owners in cluster.nodes_manager.slots_cache.values() if owners}
        now = time.monotonic()
        with self._lock:
            return all(self._down_until.get(m, 0.0) > now for m in masters)

    def _check(self, op: str, names: Sequence[str], unanswered: list[int], failed: list[str]) -> None:
        """Raises TierError when no key was answered and no master is up (the stack counts the failed
        call against the tier's breaker); else counts the keys no node answered for in `errors` (they
        are misses). A batch whose keys all live on one dead master (a small one, or one window of a
        bulk GET) is misses, not a failed tier: the other masters still serve."""
        if names and len(unanswered) == len(names) and self._cluster_down():
            raise TierError(
                f"redis cluster {op} on {self._nodes_for_logs}: no node answered for any key "
                f"(failed: {', '.join(sorted(set(failed))) or 'slots not covered'})"
            )
        self._stats.errors += len(unanswered)

    # -- the tier ----------------------------------------------------------------------------------

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def get_many(self, namespace: str, keys: Sequence[bytes]) -> list[bytes | None]:
        names = [self._key(namespace, k) for k in keys]
        values = await self._run(self._get_blocking, names)
        for v in values:
            if v is None:
                self._stats.misses += 1
            else:
                self._stats.hits += 1
        return values

    def _get_blocking(self, names: list[str]) -> list[bytes | None]:
        replies, unanswered, failed = self._fan_out(names, lambda i: ("GET", names[i]), replica_reads=True)
        unanswered += self._redirected(replies, lambda c, i: c.get(names[i]))
        self._check("GET", names, unanswered, failed)
        return [r if isinstance(r, bytes) else None for r in replies]

    async def contains_many(self, namespace: str, keys: Sequence[bytes]) -> list[bool]:
        names = [self._key(namespace, k) for k in keys]
        return await self._run(self._contains_blocking, names)

    def _contains_blocking(self, names: list[str]) -> list[bool]:
        replies, unanswered, failed = self._fan_out(names, lambda i: ("EXISTS", names[i]), replica_reads=True)
        unanswered += self._redirected(replies, lambda c, i: c.exists(names[i]))
        self._check("EXISTS", names, unanswered, failed)
        return [bool(r) for r in replies]

    async def put_many(self, namespace: str, items: Sequence[tuple[bytes, bytes]]) -> list[bool]:
        named = [(self._key(namespace, k), block) for k, block in items]
        # Waited to its end even when the stack's timeout cancels the call (see redis.py): every
        # per-node pipeline has ended when this returns.
        written = await in_pool(self._pool, self._put_blocking, named)
        self._stats.puts += sum(written)
        return written

    def _put_blocking(self, named: list[tuple[str, bytes]]) -> list[bool]:
        names = [n for n, _ in named]
        ex = self._ttl_s or None
        expiry = ("EX", ex) if ex else ()
        replies, unanswered, failed = self._fan_out(
            names, lambda i: ("SET", names[i], named[i][1], *expiry), replica_reads=False
        )
        unanswered += self._redirected(replies, lambda c, i: c.set(names[i], named[i][1], ex=ex))
        self._check("SET", names, unanswered, failed)
        return [r is True or r == b"OK" for r in replies]  # raw replies, or RedisCluster's parsed ones

    async def delete_many(self, namespace: str, keys: Sequence[bytes]) -> int:
        return sum(await self.delete_present(namespace, keys))

    async def delete_present(self, namespace: str, keys: Sequence[bytes]) -> list[bool]:
        names = [self._key(namespace, k) for k in keys]
        return await in_pool(self._pool, self._delete_blocking, names)

    def _delete_blocking(self, names: list[str]) -> list[bool]:
        replies, unanswered, failed = self._fan_out(names, lambda i: ("DEL", names[i]), replica_reads=False)
        unanswered += self._redirected(replies, lambda c, i: c.delete(names[i]))
        if unanswered:  # a Delete that did not reach every key's master has failed, whatever it removed
            raise TierError(
                f"redis cluster DEL on {self._nodes_for_logs}: {len(unanswered)} of {len(names)} key(s) not "
                f"deleted (failed: {', '.join(sorted(set(failed))) or 'slots not covered'})"
            )
        return [int(r) > 0 for r in replies]

    def stats(self) -> TierStats:
        s = self._stats
        return TierStats(name=s.name, kind=s.kind, hits=s.hits, misses=s.misses, puts=s.puts, errors=s.errors)

    async def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._refresher.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
            cluster, self._cluster = self._cluster, None
        for client in clients:
            client.close()
        if cluster is not None:
            cluster.close()
