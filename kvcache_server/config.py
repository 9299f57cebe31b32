"""The server's configuration: one typed, frozen config, read once at start-up.

(Over 500 lines on purpose: one dataclass per TOML section, each a flat list of fields with its
comment and validation; the sections are read together and kept in one place as docs/ cite them.)

Sources, later ones winning: built-in defaults, a TOML file (`--config` or
KVCACHE_CONFIG), environment variables, command-line flags. Every field has
one name in each source:

    TOML                      environment                      flag
    [server] port = 51051     KVCACHE_SERVER_PORT=51051        --set server.port=51051  (or --port)
    [ram] capacity_bytes      KVCACHE_RAM_CAPACITY_BYTES       --set ram.capacity_bytes=4GiB

Fields ending in `_bytes` accept integers or sizes with a unit ("512MiB",
"4GiB", "1.5GB"). Unknown sections or fields are errors, so a typo never goes
silently unapplied; so is any KVCACHE_* environment variable that names no field and
is not one of ENV_NOT_FIELDS.

Longer than the project's ~500-line module guideline: one typed section per TOML table, each with its
validation next to its fields (the loader that merges file, environment and flags is config_loader.py).
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvcache_server.config_loader import ConfigError, load_layered
from kvcache_server.config_loader import parse_assignment as parse_assignment  # re-exported: the CLI, the router
from kvcache_server.config_loader import parse_size as parse_size  # re-exported: auth, tests

DEFAULT_PORT = 51051
DEFAULT_HOST = "127.0.0.1"

_GiB = 1 << 30
_MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class ServerSection:
    """Network and process settings."""

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT  # 0 picks a free port (printed at start-up)
    shutdown_grace_s: float = 5.0  # in-flight RPCs may finish within this after SIGTERM
    drain_deadline_s: float = 10.0  # then write-behind queues may drain within this
    log_level: str = "info"
    log_json: bool = False
    # glibc only (kvcache_server/allocator.py): return free heap pages to the OS this often (0: never);
    # and, when set, give every allocation of this size or more its own mapping (tighter RSS, slower).
    malloc_trim_interval_s: float = 1.0
    malloc_mmap_threshold_bytes: int = 0
    # Otherwise, when set (glibc only): free memory at the heap's top is kept for reuse up to this much
    # between those trims, and blocks up to 32 MiB come from the heap, instead of being handed back and
    # faulted in again at every message: pure-gRPC calls cost the server about half the CPU, but peak
    # RSS under churn rises past docs/limits.md's bound (0, the default, or no periodic trim: glibc's
    # own self-adjusting thresholds).
    malloc_trim_threshold_bytes: int = 0
    # How long a thread holding the GIL keeps it while another waits (sys.setswitchinterval; 0: CPython's
    # 5 ms): the event loop waits at most this behind a worker thread (docs/limits.md).
    switch_interval_s: float = 0.001
    # KVCache calls running at once (Info excepted; health and reflection are never counted).
    max_concurrent_rpcs: int = 1024
    # With auth: one tenant's calls running at once; 0 = a quarter of max_concurrent_rpcs.
    tenant_max_concurrent_rpcs: int = 0

    @property
    def tenant_share(self) -> int:
        """The calls one tenant may run at once when its [tenants] entry sets no limit of its own."""
        return self.tenant_max_concurrent_rpcs or max(1, self.max_concurrent_rpcs // 4)

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"server.port must be in [0, 65535], got {self.port}")
        if self.malloc_trim_interval_s < 0:
            raise ConfigError("server.malloc_trim_interval_s must not be negative (0 turns trimming off)")
        if not 0 <= self.switch_interval_s <= 0.1:
            raise ConfigError("server.switch_interval_s must be in [0, 0.1] (0 keeps CPython's 5 ms)")
        if not 0 <= self.malloc_mmap_threshold_bytes <= 32 * _MiB:
            raise ConfigError("server.malloc_mmap_threshold_bytes must be in [0, 32 MiB] (glibc's range)")
        if not 0 <= self.malloc_trim_threshold_bytes < 2 * _GiB:
            raise ConfigError("server.malloc_trim_threshold_bytes must be in [0, 2 GiB) (a C int)")
        if self.shutdown_grace_s < 0 or self.drain_deadline_s < 0:
            raise ConfigError("server.shutdown_grace_s and server.drain_deadline_s must be >= 0")
        if self.log_level.lower() not in {"debug", "info", "warning", "error", "critical"}:
            raise ConfigError(f"server.log_level {self.log_level!r} is not a log level")
        if self.max_concurrent_rpcs <= 0:
            raise ConfigError("server.max_concurrent_rpcs must be positive")
        if not 0 <= self.tenant_max_concurrent_rpcs <= self.max_concurrent_rpcs:
            raise ConfigError("server.tenant_max_concurrent_rpcs must be in [0, server.max_concurrent_rpcs]")


@dataclass(frozen=True, slots=True)
class RamSection:
    """The host-RAM tier."""

    capacity_bytes: int = _GiB
    # A block evicted from RAM is written to the first lower tier unless that tier holds it.
    demote_on_evict: bool = True
    # Fault the whole block arena in at start-up (docs/arena.md): RSS is the arena from the start.
    prefault: bool = True
    # Read leases end on their own after this long (docs/arena.md).
    lease_timeout_s: float = 30.0
    # What one tenant may pin at once (open leases and the server's reservations for its puts), as a
    # share of capacity_bytes, when it has no ram_quota_bytes (with one: its quota; without auth: all).
    pin_share: float = 0.5
    # Open read leases one tenant may hold; keys one LeaseGet leases (the rest are answered unleased,
    # and the SDK fetches them with Get).
    max_leases_per_tenant: int = 16384
    max_keys_per_lease: int = 16384
    # A per-tenant presence index of the blocks RAM holds, beside the shared arena, that same-host
    # clients read to answer Lookups, and locate blocks to copy, without an RPC (docs/presence.md);
    # sized for blocks of presence_block_bytes filling the tenant's quota or the capacity: 34-68
    # bytes per such block.
    presence_index: bool = True
    presence_block_bytes: int = 64 << 10

    def validate(self) -> None:
        if self.capacity_bytes <= 0:
            raise ConfigError("ram.capacity_bytes must be positive")
        if self.presence_block_bytes < 64:
            raise ConfigError("ram.presence_block_bytes must be at least 64")
        if not 0 < self.lease_timeout_s <= 3600:
            raise ConfigError("ram.lease_timeout_s must be in (0, 3600]")
        if not 0 < self.pin_share <= 1:
            raise ConfigError("ram.pin_share must be in (0, 1]")
        if self.max_leases_per_tenant <= 0 or self.max_keys_per_lease <= 0:
            raise ConfigError("ram.max_leases_per_tenant and ram.max_keys_per_lease must be positive")


@dataclass(frozen=True, slots=True)
class RetentionSection:
    """Sessions that stay: blocks a put asks to retain (PutRequest.retain_ttl_s) are evicted from
    RAM only after every unretained block (docs/tiers.md, "Sessions that stay")."""

    # What one tenant's retained blocks may hold of ram.capacity_bytes (without auth: the one
    # partition), and all tenants' together; past either, a put stores its blocks unretained (counted).
    max_share: float = 0.25
    max_total_share: float = 0.5
    # Longer TTLs are cut to this; a retention ends this long after it was granted or renewed at most.
    max_ttl_s: float = 3600.0
    # The TTL of puts that ask for none (0: only puts that ask retain anything).
    default_ttl_s: float = 0.0

    def validate(self) -> None:
        if not (0 <= self.max_share <= 1 and 0 <= self.max_total_share <= 1):
            raise ConfigError("retention.max_share and retention.max_total_share must be in [0, 1]")
        if not 0 < self.max_ttl_s <= 30 * 86400:
            raise ConfigError("retention.max_ttl_s must be in (0, 2592000]")
        if not 0 <= self.default_ttl_s <= self.max_ttl_s:
            raise ConfigError("retention.default_ttl_s must be in [0, retention.max_ttl_s]")


@dataclass(frozen=True, slots=True)
class PrefetchSection:
    """The Prefetch RPC: promotions from the lower tiers into RAM, in the background (docs/tiers.md, "Prefetch")."""

    # Keys one Prefetch may name (more: INVALID_ARGUMENT).
    max_keys: int = 4096
    # Keys waiting for promotion, all callers together; a Prefetch finding the queue full drops the rest (counted).
    queue_max_keys: int = 65536
    # Promotions running at once, and the deadline of each (one Prefetch's keys, at most max_keys).
    workers: int = 2
    timeout_s: float = 10.0

    def validate(self) -> None:
        if self.max_keys <= 0 or self.queue_max_keys < self.max_keys:
            raise ConfigError("prefetch.max_keys must be positive and at most prefetch.queue_max_keys")
        if not 1 <= self.workers <= 64:
            raise ConfigError("prefetch.workers must be in [1, 64]")
        if not 0 < self.timeout_s <= 600:
            raise ConfigError("prefetch.timeout_s must be in (0, 600]")


_WRITE_MODES = ("through", "behind")
_QUEUE_FULL = ("drop", "sync")
_COMPRESSION = ("none", "lz4", "shuffle-lz4")


@dataclass(frozen=True, slots=True)
class LowerTierSection:
    """Settings every lower tier has: how the stack writes to it, reads from it and guards it."""

    enabled: bool = False
    write_mode: str = "through"  # "through": puts wait for it; "behind": a bounded background queue
    compression: str = "none"  # "none", "lz4", "shuffle-lz4" (byte-shuffle for 16-bit dtypes, then lz4)
    promote: bool = True  # copy hits found here into the tiers above
    timeout_s: float = 2.0  # per call; a call that takes longer is a miss
    # A Lookup waits for the tier what its caller's deadline leaves (limits.lookup_deadline_share of
    # it), at most timeout_s; a positive lookup_timeout_s caps that wait too (0: no cap of its own).
    lookup_timeout_s: float = 0.0
    codec_threads: int = 0  # threads compressing/verifying this tier's blocks; 0: half the CPUs, 1 to 4
    queue_max_bytes: int = 256 * _MiB  # write-behind queue bound
    queue_full: str = "drop"  # "drop" (counted) or "sync" (write synchronously instead)
    breaker_failures: int = 3  # consecutive failures that open the circuit breaker
    breaker_reset_s: float = 2.0  # first back-off before probing again (doubles, capped at 30s)

    def _validate_common(self, name: str) -> None:
        for field_name, allowed in (
            ("write_mode", _WRITE_MODES),
            ("queue_full", _QUEUE_FULL),
            ("compression", _COMPRESSION),
        ):
            value = getattr(self, field_name)
            if value not in allowed:
                raise ConfigError(f"{name}.{field_name} must be one of {allowed}, got {value!r}")
        if self.timeout_s <= 0 or self.breaker_reset_s <= 0:
            raise ConfigError(f"{name}.timeout_s and {name}.breaker_reset_s must be positive")
        if self.lookup_timeout_s < 0:
            raise ConfigError(f"{name}.lookup_timeout_s must not be negative (0: no cap besides the caller's deadline)")
        if self.codec_threads < 0:
            raise ConfigError(f"{name}.codec_threads must be >= 0 (0: from the CPU count)")
        if self.queue_max_bytes <= 0 or self.breaker_failures < 1:
            raise ConfigError(f"{name}.queue_max_bytes and {name}.breaker_failures must be positive")


@dataclass(frozen=True, slots=True)
class RedisSection(LowerTierSection):
    """The Redis tier (redis:// or rediss:// for TLS)."""

    url: str = "redis://127.0.0.1:6379/0"
    password: str = ""  # overrides the URL's; prefer KVCACHE_REDIS_PASSWORD to a file
    tls_ca_file: str = ""
    key_prefix: str = "kvcache"
    ttl_s: int = 0  # 0: no expiry (Redis's maxmemory policy still applies)
    max_connections: int = 32
    # Per call; it must exceed the time to move the largest batch (128 MiB takes ~0.5-1 s here).
    timeout_s: float = 5.0
    # Redis Cluster (docs/tiers.md): `url` names one start-up node (its scheme, user and password
    # apply to every node), `cluster_nodes` more of them, as "host:port,host:port".
    cluster: bool = False
    cluster_nodes: str = ""
    # Redis Sentinel: the master's name and the sentinels ("host:port,host:port"); `url` then gives only
    # the scheme, user, password and database.
    sentinel_master: str = ""
    sentinel_nodes: str = ""

    def validate(self) -> None:
        self._validate_common("redis")
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"redis.url must start with redis://, rediss:// or unix://, got {self.url!r}")
        if self.ttl_s < 0 or self.max_connections < 1:
            raise ConfigError("redis.ttl_s must be >= 0 and redis.max_connections >= 1")
        if self.cluster:
            self.startup_nodes()
        elif self.cluster_nodes:
            raise ConfigError("redis.cluster_nodes is set but redis.cluster is false")
        if bool(self.sentinel_master) != bool(self.sentinel_nodes):
            raise ConfigError("redis.sentinel_master and redis.sentinel_nodes go together")
        if self.sentinel_master:
            if self.cluster:
                raise ConfigError("redis.sentinel_master and redis.cluster exclude each other")
            if not self.url.startswith(("redis://", "rediss://")):
                raise ConfigError("with redis.sentinel_master, redis.url must be redis:// or rediss://")
            self.sentinels()

    def sentinels(self) -> list[tuple[str, int]]:
        """The sentinels of `sentinel_nodes`."""
        return _host_ports("redis.sentinel_nodes", self.sentinel_nodes)

    def startup_nodes(self) -> list[tuple[str, int]]:
        """The cluster's start-up nodes: `url`'s host and port, then those of `cluster_nodes`."""
        url = urlsplit(self.url)
        if url.scheme not in ("redis", "rediss") or not url.hostname:
            raise ConfigError(f"redis.cluster needs a redis:// or rediss:// url with a host, got {self.url!r}")
        if url.path.strip("/") not in ("", "0"):
            raise ConfigError(f"a Redis Cluster has only database 0; redis.url names {url.path.strip('/')!r}")
        return [(url.hostname, url.port or 6379), *_host_ports("redis.cluster_nodes", self.cluster_nodes)]


def _host_ports(name: str, text: str) -> list[tuple[str, int]]:
    """'a:1, b:2' -> [('a', 1), ('b', 2)]."""
    out = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"{name}: {item!r} is not host:port")
        out.append((host.strip("[]"), int(port)))
    return out


@dataclass(frozen=True, slots=True)
class S3Section(LowerTierSection):
    """The S3 tier (AWS, MinIO or any S3 API). Credentials: boto3's standard chain."""

    bucket: str = ""
    prefix: str = "kvcache"
    endpoint_url: str = ""  # e.g. http://minio:9000; empty for AWS
    region: str = "us-east-1"
    path_style: bool = False  # true for MinIO and most self-hosted S3
    create_bucket: bool = False
    max_concurrency: int = 16
    timeout_s: float = 10.0
    write_mode: str = "behind"
    queue_max_bytes: int = _GiB
    # Keys known to be in the bucket, answered by Lookup without a HEAD (0 turns it off); trusted this long.
    presence_index_bytes: int = 64 * _MiB
    presence_ttl_s: float = 600.0

    def validate(self) -> None:
        self._validate_common("s3")
        if self.enabled and not self.bucket:
            raise ConfigError("s3.bucket is required when s3.enabled is true")
        if self.max_concurrency < 1:
            raise ConfigError("s3.max_concurrency must be >= 1")
        if self.presence_index_bytes < 0 or self.presence_ttl_s <= 0:
            raise ConfigError("s3.presence_index_bytes must be >= 0 and s3.presence_ttl_s positive")


@dataclass(frozen=True, slots=True)
class DiskSection(LowerTierSection):
    """The disk tier: blocks in region files on a local file system, between RAM and Redis/S3 (docs/tiers.md)."""

    # A directory on a local disk (NVMe), this server's alone (it is locked); required when enabled.
    dir: str = ""
    # The byte cap of the tier's files together; evicted by region, least recently used first.
    capacity_bytes: int = 64 * _GiB
    # The unit of eviction; a block whose record (block + ~100 bytes) exceeds a region is not stored here.
    region_bytes: int = 64 * _MiB
    # Reader threads; writer threads, each appending to a region of its own.
    io_threads: int = 8
    write_threads: int = 2
    # Buffers that gets which do not promote read blocks of 256 KiB and more into, refilled once no
    # reply references them (tiers/reuse.py): a fixed RSS cost, grown only as used; 0 = fresh memory.
    read_buffers_bytes: int = 256 * _MiB
    write_mode: str = "behind"
    # A local disk answers in milliseconds: a hung one is a miss soon, before its breaker opens.
    timeout_s: float = 1.0

    def validate(self) -> None:
        self._validate_common("disk")
        if self.enabled and not self.dir:
            raise ConfigError("disk.dir is required when disk.enabled is true")
        if not _MiB <= self.region_bytes < 4 * _GiB:
            raise ConfigError("disk.region_bytes must be in [1 MiB, 4 GiB)")
        if self.io_threads < 1 or self.write_threads < 1:
            raise ConfigError("disk.io_threads and disk.write_threads must be >= 1")
        if self.read_buffers_bytes < 0:
            raise ConfigError("disk.read_buffers_bytes must be >= 0")
        if self.capacity_bytes // self.region_bytes < self.write_threads + 1:
            raise ConfigError(
                "disk.capacity_bytes must hold at least disk.write_threads + 1 regions of disk.region_bytes"
            )


@dataclass(frozen=True, slots=True)
class LimitsSection:
    """Bounds on what a client may send (each also bounds server memory per request)."""

    max_block_bytes: int = 64 * _MiB
    max_keys_per_request: int = 65536
    # Target size of one streamed Get message; larger blocks travel one per message.
    stream_message_bytes: int = 4 * _MiB
    # One Put stream: at most this many blocks and bytes (a client cannot stream forever).
    max_put_stream_blocks: int = 262_144
    max_put_stream_bytes: int = 16 * _GiB
    # gRPC metadata per call, and concurrent calls (HTTP/2 streams) per connection.
    max_metadata_bytes: int = 16 * 1024
    max_concurrent_streams: int = 256
    # Bytes all calls in flight may hold besides the RAM tier (messages being decoded and verified,
    # blocks being assembled from parts or read from shm, blocks a Get fetched from Redis/S3): a call
    # that would pass it waits up to admission_wait_s, then gets RESOURCE_EXHAUSTED (docs/limits.md).
    inflight_bytes: int = 256 * _MiB
    admission_wait_s: float = 1.0
    # Shares of it: one call reserves at most inflight_call_share (and never less than one largest
    # block and message); with auth, one tenant's calls together at most inflight_tenant_share.
    inflight_call_share: float = 0.25
    inflight_tenant_share: float = 0.5
    # A Get fetches from Redis/S3 in windows of about this many bytes, sending each before the next.
    get_window_bytes: int = 64 * _MiB
    # A Put stream with no message for this long, or a Get whose client reads nothing for this
    # long, is cut off (DEADLINE_EXCEEDED) and its memory released.
    put_idle_timeout_s: float = 10.0
    get_stall_timeout_s: float = 10.0
    # A Lookup answers within this share of the time its caller's deadline leaves when it arrives
    # (the rest is for the answer's way back): lower tiers are awaited that long, at most timeout_s.
    lookup_deadline_share: float = 0.8

    def validate(self) -> None:
        for name in (
            "max_block_bytes",
            "max_keys_per_request",
            "stream_message_bytes",
            "max_put_stream_blocks",
            "max_put_stream_bytes",
            "max_metadata_bytes",
            "max_concurrent_streams",
            "inflight_bytes",
            "get_window_bytes",
            "put_idle_timeout_s",
            "get_stall_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"limits.{name} must be positive")
        if self.admission_wait_s < 0:
            raise ConfigError("limits.admission_wait_s must not be negative")
        if not 0 < self.lookup_deadline_share <= 1:
            raise ConfigError("limits.lookup_deadline_share must be in (0, 1]")
        for name in ("inflight_call_share", "inflight_tenant_share"):
            if not 0 < getattr(self, name) <= 1:
                raise ConfigError(f"limits.{name} must be in (0, 1]")
        if self.inflight_bytes < self.max_block_bytes + self.stream_message_bytes:
            raise ConfigError(
                "limits.inflight_bytes must hold at least one largest block and one message "
                f"(max_block_bytes + stream_message_bytes = {self.max_block_bytes + self.stream_message_bytes})"
            )

    @property
    def inflight_call_share_bytes(self) -> int:
        """What one call reads ahead (a Get's window) within inflight_bytes: inflight_call_share of it."""
        return int(self.inflight_bytes * self.inflight_call_share)

    @property
    def inflight_call_bytes(self) -> int:
        """The most one call may hold of inflight_bytes: its share, or one largest block and message."""
        share = int(self.inflight_bytes * self.inflight_call_share)
        return min(self.inflight_bytes, max(share, self.max_block_bytes + self.max_message_bytes))

    @property
    def inflight_tenant_bytes(self) -> int:
        """The most one tenant's calls may hold together (with auth), never less than one call's."""
        return max(int(self.inflight_bytes * self.inflight_tenant_share), self.inflight_call_bytes)

    @property
    def max_message_bytes(self) -> int:
        """The gRPC message limit: one block or one batch of keys, plus framing."""
        return max(self.max_block_bytes, self.stream_message_bytes, 24 * self.max_keys_per_request) + _MiB


@dataclass(frozen=True, slots=True)
class MetricsSection:
    """Prometheus metrics on their own HTTP port (docs/metrics.md)."""

    enabled: bool = False
    host: str = DEFAULT_HOST
    port: int = 9400  # 0 picks a free port

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"metrics.port must be in [0, 65535], got {self.port}")


@dataclass(frozen=True, slots=True)
class HealthSection:
    """What grpc.health.v1 reports (docs/deployment.md)."""

    # Comma-separated lower tiers ("disk", "redis", "s3") without which the server reports NOT_SERVING.
    required_tiers: str = ""
    check_interval_s: float = 1.0

    @property
    def required(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in self.required_tiers.split(",") if t.strip())

    def validate(self) -> None:
        unknown = set(self.required) - {"disk", "redis", "s3"}
        if unknown:
            raise ConfigError(f"health.required_tiers: unknown tiers {sorted(unknown)} (known: disk, redis, s3)")
        if self.check_interval_s <= 0:
            raise ConfigError("health.check_interval_s must be positive")


@dataclass(frozen=True, slots=True)
class EventsSection:
    """KV-event subscribers (docs/events.md)."""

    max_subscribers: int = 64
    buffer_events: int = 10_000  # per subscriber; a subscriber further behind is cut off
    # With auth: one tenant's subscribers; 0 = a quarter of max_subscribers.
    tenant_max_subscribers: int = 0
    # Names this server in its events (KVEvent.server_id); empty: "<hostname>:<server.port>".
    server_id: str = ""

    @property
    def tenant_share(self) -> int:
        """The subscribers one tenant may have when its [tenants] entry sets no limit of its own."""
        return self.tenant_max_subscribers or max(1, self.max_subscribers // 4)

    def validate(self) -> None:
        if self.max_subscribers < 1 or self.buffer_events < 1:
            raise ConfigError("events.max_subscribers and events.buffer_events must be positive")
        if not 0 <= self.tenant_max_subscribers <= self.max_subscribers:
            raise ConfigError("events.tenant_max_subscribers must be in [0, events.max_subscribers]")


@dataclass(frozen=True, slots=True)
class AuthSection:
    """API tokens, tenants, quotas (docs/security.md)."""

    enabled: bool = False
    tokens_file: str = ""  # TOML of token hashes, tenants and their limits
    # Serving without auth is allowed only on a loopback address unless this is set (a warning is logged).
    allow_unauthenticated: bool = False

    def validate(self) -> None:
        if self.enabled and not self.tokens_file:
            raise ConfigError("auth.enabled needs auth.tokens_file")


@dataclass(frozen=True, slots=True)
class TlsSection:
    """TLS on the gRPC and metrics ports; mTLS when client_ca_file is set."""

    cert_file: str = ""
    key_file: str = ""
    client_ca_file: str = ""  # clients must present a certificate signed by this CA

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)

    def validate(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ConfigError("tls.cert_file and tls.key_file go together")
        if self.client_ca_file and not self.cert_file:
            raise ConfigError("tls.client_ca_file (mTLS) needs tls.cert_file and tls.key_file")
        for name in ("cert_file", "key_file", "client_ca_file"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ConfigError(f"tls.{name}: {path} is not a readable file")


@dataclass(frozen=True, slots=True)
class ShmSection:
    """The same-host shared-memory data path (docs/shm.md)."""

    enabled: bool = True
    # Owner-only directory (created 0700) for segments; "" means /dev/shm/kvcache-<uid>.
    dir: str = ""
    # Segments older than this are left over from clients that died mid-call, and removed.
    stale_after_s: float = 600.0
    # Put the RAM tier's block arena in `dir` so same-host clients move bytes in place (docs/arena.md);
    # false: a private arena, and same-host clients use per-call segments.
    share_arena: bool = True
    # With auth and several tenants the arena is not shared (any process of the server's user could
    # map every tenant's blocks) unless this says their same-host clients may trust each other.
    share_arena_across_tenants: bool = False
    # A Unix socket on which same-host clients of another Unix user hand the server their segments
    # (memfd descriptors; docs/shm.md "Clients of another user"). "" means `dir` + ".sock".
    socket: bool = True
    socket_path: str = ""
    # Who may connect (octal in TOML: 0o666 anyone on the host, 0o660 the socket's group); tokens
    # and tenants apply to what is done with the segments, as on gRPC.
    socket_mode: int = 0o666
    # Connections in all (a Unix user may hold half of them) and segments one connection may hand over.
    max_socket_connections: int = 1024
    max_segments_per_connection: int = 64

    def validate(self) -> None:
        if self.stale_after_s <= 0:
            raise ConfigError("shm.stale_after_s must be positive")
        if not 0 <= self.socket_mode <= 0o777:
            raise ConfigError("shm.socket_mode must be a permission mode (0o000 to 0o777)")
        if self.max_socket_connections < 1 or self.max_segments_per_connection < 1:
            raise ConfigError("shm.max_socket_connections and shm.max_segments_per_connection must be >= 1")


@dataclass(frozen=True, slots=True)
class BulkSection:
    """The bulk path for remote clients: block bytes on plain TCP (or TLS) frames (docs/bulk.md)."""

    enabled: bool = True
    # "" binds the gRPC server's host; port 0 picks a free port (advertised in Info).
    host: str = ""
    port: int = 0
    # Largest frame accepted (one block, or one request's keys); larger ones close the connection.
    # 0: limits.max_block_bytes + 1 MiB.
    max_frame_bytes: int = 0
    # A connection with no request for idle_timeout_s is closed; one whose peer sends or reads
    # nothing for stall_timeout_s in the middle of a frame is cut off and what it held released.
    idle_timeout_s: float = 300.0
    stall_timeout_s: float = 10.0
    # A new connection must complete its HELLO (its TLS handshake included) within hello_timeout_s.
    hello_timeout_s: float = 5.0
    # Deadlines of a whole request (a PUT or a GET), not of one recv or send: it must move its bytes
    # at min_rate_bytes_s on average once min_rate_grace_s has passed (0: no rate rule), and all of
    # them within request_timeout_s. Only time spent waiting on the peer counts (not the server's
    # own waits for the in-flight budget or the tiers). A request too slow is cut off and what it
    # held released.
    min_rate_bytes_s: int = _MiB
    min_rate_grace_s: float = 5.0
    request_timeout_s: float = 120.0
    # Authenticated connections served at once (one thread each); more are refused with RESOURCE_EXHAUSTED.
    max_connections: int = 64
    # Connections whose HELLO has not passed yet, capped apart (slow or unauthenticated peers
    # cannot take max_connections).
    max_unauthenticated_connections: int = 16
    # With auth: one tenant's connections; 0 = a quarter of max_connections.
    tenant_max_connections: int = 0

    @property
    def tenant_share(self) -> int:
        """The connections one tenant may hold at once (with auth)."""
        return self.tenant_max_connections or max(1, self.max_connections // 4)

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError("bulk.port must be 0..65535")
        for name in (
            "idle_timeout_s",
            "stall_timeout_s",
            "hello_timeout_s",
            "min_rate_grace_s",
            "request_timeout_s",
            "max_connections",
            "max_unauthenticated_connections",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"bulk.{name} must be positive")
        if self.min_rate_bytes_s < 0:
            raise ConfigError("bulk.min_rate_bytes_s must not be negative (0: no rate rule)")
        if not 0 <= self.tenant_max_connections <= self.max_connections:
            raise ConfigError("bulk.tenant_max_connections must be in [0, bulk.max_connections]")
        if self.max_frame_bytes < 0:
            raise ConfigError("bulk.max_frame_bytes must not be negative (0: limits.max_block_bytes + 1 MiB)")

    def frame_limit(self, max_block_bytes: int) -> int:
        """The largest frame the listener accepts."""
        return self.max_frame_bytes or max_block_bytes + _MiB


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Everything the server reads at start-up."""

    server: ServerSection = field(default_factory=ServerSection)
    ram: RamSection = field(default_factory=RamSection)
    disk: DiskSection = field(default_factory=DiskSection)
    redis: RedisSection = field(default_factory=RedisSection)
    s3: S3Section = field(default_factory=S3Section)
    limits: LimitsSection = field(default_factory=LimitsSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    health: HealthSection = field(default_factory=HealthSection)
    events: EventsSection = field(default_factory=EventsSection)
    auth: AuthSection = field(default_factory=AuthSection)
    tls: TlsSection = field(default_factory=TlsSection)
    shm: ShmSection = field(default_factory=ShmSection)
    bulk: BulkSection = field(default_factory=BulkSection)
    retention: RetentionSection = field(default_factory=RetentionSection)
    prefetch: PrefetchSection = field(default_factory=PrefetchSection)

    def validate(self) -> ServerConfig:
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate()
        for name in self.health.required:
            if not getattr(self, name).enabled:
                raise ConfigError(f"health.required_tiers names {name}, but {name}.enabled is false")
        if self.bulk.enabled and 0 < self.bulk.max_frame_bytes < self.limits.max_block_bytes + 8:
            raise ConfigError("bulk.max_frame_bytes must hold one largest block (limits.max_block_bytes + 8)")
        if not self.auth.enabled and not self.auth.allow_unauthenticated and not is_loopback(self.server.host):
            raise ConfigError(
                f"refusing to serve {self.server.host} without authentication: enable [auth] (docs/security.md), "
                "or set auth.allow_unauthenticated = true if the network itself is trusted"
            )
        return self


ENV_NOT_FIELDS = {
    "KVCACHE_CONFIG": "the server's TOML file (--config)",
    "KVCACHE_TARGET": "the CLI's server address (docs/cli.md)",
    "KVCACHE_TOKEN": "the SDK's and CLI's API token",
    "KVCACHE_SHM": "the SDK's shared-memory switch (docs/shm.md)",
    "KVCACHE_BULK": "the SDK's bulk-path switch (docs/bulk.md)",
    "KVCACHE_PROCESS_PUTS": "the SDK's switch for puts read out of its own memory (docs/shm.md)",
}
"""KVCACHE_* variables that are not KVCACHE_<SECTION>_<FIELD> config fields; any other unknown one is an error."""

ENV_ROUTER_PREFIX = "KVCACHE_ROUTER_"
"""kvcache-router's variables (docs/router.md): its own config checks them, the server leaves them alone."""


def load_config(
    *,
    path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> ServerConfig:
    """Builds the validated config from defaults, a TOML file, the environment and overrides.

    Args:
        path: A TOML file; when None, KVCACHE_CONFIG from `env` names one, if set.
        env: Environment variables (os.environ in production).
        overrides: {section: {field: value}} from command-line flags.

    Raises:
        ConfigError: for any unknown or invalid setting, naming it.
    """
    env = env or {}
    return load_layered(
        ServerConfig(),
        path=path or env.get("KVCACHE_CONFIG"),
        env=env,
        overrides=overrides,
        prefix="KVCACHE_",
        ignored=lambda var: var in ENV_NOT_FIELDS or var.startswith(ENV_ROUTER_PREFIX),
        docs="docs/tiers.md",
    ).validate()
