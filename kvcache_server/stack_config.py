"""The tier stack a ServerConfig describes: RAM (its arena shared with same-host clients or not),
then disk, Redis or Redis Cluster, and S3 where enabled, with their policies and the event hub.

Tier modules are imported only when their tier is enabled (a RAM-only server never imports redis,
boto3 or the disk tier). kvcache_server.app builds the rest of the server around what this returns.
"""

from __future__ import annotations

import logging
import platform
import socket
from urllib.parse import unquote, urlsplit

from kvcache_server.auth import TokenStore
from kvcache_server.config import DiskSection, LowerTierSection, RedisSection, ServerConfig
from kvcache_server.events import EventHub, EventKind
from kvcache_server.observe import Observer
from kvcache_server.stack import LowerTierPolicy, PinLimits, QueueFull, TierStack, WriteMode
from kvcache_server.tiers import codec
from kvcache_server.tiers.base import Tier, TierKind
from kvcache_server.tiers.codec import CompressionMode
from kvcache_server.tiers.retention import RetentionLimits

log = logging.getLogger(__name__)


def _policy(section: LowerTierSection) -> LowerTierPolicy:
    return LowerTierPolicy(
        write_mode=WriteMode(section.write_mode),
        compression=CompressionMode(section.compression),
        promote=section.promote,
        timeout_s=section.timeout_s,
        lookup_timeout_s=section.lookup_timeout_s,
        codec_threads=section.codec_threads,
        queue_max_bytes=section.queue_max_bytes,
        queue_full=QueueFull(section.queue_full),
        breaker_failures=section.breaker_failures,
        breaker_reset_s=section.breaker_reset_s,
    )


def _cluster_tier(r: RedisSection) -> Tier:
    from kvcache_server.tiers.redis_cluster import RedisClusterTier

    url = urlsplit(r.url)
    return RedisClusterTier(
        r.startup_nodes(),
        key_prefix=r.key_prefix,
        ttl_s=r.ttl_s,
        timeout_s=r.timeout_s,
        username=unquote(url.username or ""),
        password=r.password or unquote(url.password or ""),
        tls=url.scheme == "rediss",
        tls_ca_file=r.tls_ca_file,
        max_connections=r.max_connections,
    )


def _disk_tier(d: DiskSection, events: EventHub, retention: RetentionLimits) -> Tier:
    from kvcache_server.tiers.disk import DiskTier

    return DiskTier(
        d.dir,
        capacity_bytes=d.capacity_bytes,
        region_bytes=d.region_bytes,
        io_threads=d.io_threads,
        write_threads=d.write_threads,
        read_buffers_bytes=d.read_buffers_bytes,
        on_evict=lambda namespace, keys: events.publish(EventKind.REMOVED, TierKind.DISK, namespace, keys),
        retention=retention,  # the [retention] shares, of the disk's capacity (tiers/disk_retention.py)
        verify=codec.check_stored,
    )


def build_stack(
    config: ServerConfig,
    observer: Observer | None = None,
    tokens: TokenStore | None = None,
    arena_dir: str | None = None,
) -> TierStack:
    """RAM, then disk, Redis and S3 where enabled; tier modules are imported only when used.

    With `arena_dir` (the shm directory) the RAM tier's arena is a file there that same-host clients
    map (docs/arena.md); when it cannot be made there (a small tmpfs), it is private memory (logged).
    """
    lower: list[tuple[Tier, LowerTierPolicy]] = []
    r = config.redis
    if r.enabled and r.cluster:
        tier: Tier = _cluster_tier(r)
        lower.append((tier, _policy(r)))
    elif r.enabled:
        from kvcache_server.tiers.redis import RedisTier

        tier = RedisTier(
            r.url,
            key_prefix=r.key_prefix,
            ttl_s=r.ttl_s,
            timeout_s=r.timeout_s,
            password=r.password,
            tls_ca_file=r.tls_ca_file,
            max_connections=r.max_connections,
            sentinel_master=r.sentinel_master,
            sentinels=r.sentinels() if r.sentinel_master else (),
        )
        lower.append((tier, _policy(r)))
    s3 = config.s3
    if s3.enabled:
        from kvcache_server.tiers.s3 import S3Tier

        tier = S3Tier(
            s3.bucket,
            prefix=s3.prefix,
            endpoint_url=s3.endpoint_url,
            region=s3.region,
            path_style=s3.path_style,
            max_concurrency=s3.max_concurrency,
            timeout_s=s3.timeout_s,
            create_bucket=s3.create_bucket,
            presence_index_bytes=s3.presence_index_bytes,
            presence_ttl_s=s3.presence_ttl_s,
        )
        lower.append((tier, _policy(s3)))
    e = config.events
    share = e.tenant_share  # a tenant's subscribers unless its own entry says otherwise; no tenants without auth
    tenant_max = (lambda tenant: tokens.limits(tenant).max_event_subscribers or share) if tokens else None
    events = EventHub(
        max_subscribers=e.max_subscribers,
        buffer_events=e.buffer_events,
        tenant_max_subscribers=tenant_max,
        server_id=e.server_id or f"{socket.gethostname()}:{config.server.port}",  # create_server: the bound port
    )
    rt = config.retention
    retention = RetentionLimits(rt.max_share, rt.max_total_share, rt.max_ttl_s, rt.default_ttl_s)
    if config.disk.enabled:  # first below RAM: demotions go to it; Redis/S3 behind it unchanged
        lower.insert(0, (_disk_tier(config.disk, events, retention), _policy(config.disk)))

    def stack(where: str | None) -> TierStack:
        built = TierStack(
            config.ram.capacity_bytes,
            lower,
            demote_on_evict=config.ram.demote_on_evict,
            events=events,
            observer=observer,
            ram_quota_of=(lambda tenant: tokens.limits(tenant).ram_quota_bytes) if tokens else None,
            arena_dir=where,
            prefault=config.ram.prefault,
            pins=PinLimits(config.ram.pin_share, config.ram.max_leases_per_tenant, config.ram.max_keys_per_lease),
            retention=retention,
        )
        # Same-host Lookups without an RPC, where the arena is shared (docs/presence.md).
        block_bytes = config.ram.presence_block_bytes if config.ram.presence_index else 0
        # Locations only where the arena is one tenant's, and where stores and loads keep their order
        # (x86-64: the index's seqlock relies on it; docs/presence.md, "Reads straight out of the arena").
        locations = len(tenants) <= 1 and platform.machine() in ("x86_64", "AMD64")
        built.ram.enable_presence(block_bytes, lower_tiers=bool(lower), locations=locations)
        return built

    tenants = sorted({t.principal.tenant for t in tokens.tokens}) if tokens else []
    if arena_dir is not None and config.shm.share_arena and len(tenants) > 1:
        if not config.shm.share_arena_across_tenants:
            # One arena file holds every tenant's blocks, and a process of the server's user can map
            # it whole: the server must not hand it to one tenant's clients. Same-host clients get
            # their blocks through segments of their own instead, holding only what they asked for.
            log.warning(
                "block arena not shared: auth has %d tenants (%s) and any process of this user could map "
                "every tenant's blocks; same-host clients use per-call segments. Run each tenant's clients as "
                "their own Unix user, or set shm.share_arena_across_tenants = true if they trust each other "
                "(docs/security.md)",
                len(tenants),
                ", ".join(tenants),
            )
            arena_dir = None
        else:
            log.warning(
                "block arena shared by %d tenants (%s; shm.share_arena_across_tenants = true): a client of any "
                "of them running as this server's user can read every tenant's blocks in it (docs/security.md)",
                len(tenants),
                ", ".join(tenants),
            )
    if arena_dir is not None and config.shm.share_arena:
        try:
            return stack(arena_dir)
        except OSError as exc:
            log.warning("block arena not shared (in-place transfers off): cannot create it in %s: %s", arena_dir, exc)
    try:
        return stack(None)
    except OSError as exc:
        raise OSError(
            exc.errno,
            f"cannot preallocate the block arena of ram.capacity_bytes = {_gib(config.ram.capacity_bytes)}: "
            f"{exc.strerror or exc}; lower ram.capacity_bytes",
        ) from None


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"
