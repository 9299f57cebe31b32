"""The router's configuration: one typed, frozen config, read once at start-up, as the server's is.

Sources, later ones winning: built-in defaults, a TOML file (`--config` or KVCACHE_ROUTER_CONFIG),
environment variables, command-line flags. Every field has one name in each source:

    TOML                                  environment                           flag
    [http] port = 8000                    KVCACHE_ROUTER_HTTP_PORT=8000         --set http.port=8000  (or --port)
    [workers] prefill = ["http://p:8000"] KVCACHE_ROUTER_WORKERS_PREFILL=...    --prefill http://p:8000 (repeatable)

Lists take a TOML array or a comma-separated string; fields ending in `_bytes` take sizes ("8MiB").
Unknown sections, fields and KVCACHE_ROUTER_* variables are errors (kvcache-server, in turn, leaves
KVCACHE_ROUTER_* variables to the router).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from kvcache_core.keys import CANONICAL_LAYOUT, HEADS_LAYOUT_VERSION, LAYOUT_VERSION, MLA_LAYOUT, Namespace
from kvcache_server.config_loader import ConfigError, load_layered, parse_assignment

ENV_PREFIX = "KVCACHE_ROUTER_"
ENV_CONFIG = "KVCACHE_ROUTER_CONFIG"

__all__ = ["ENV_PREFIX", "ConfigError", "RouterConfig", "load_config"]

_MAX_JSON_DEPTH = 512


@dataclass(frozen=True, slots=True)
class HttpSection:
    """The router's own HTTP server."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0 picks a free port (printed at start-up)
    max_body_bytes: int = 8 << 20  # a larger request body gets 413
    # A request body must arrive whole within this once the router reads it, else 408 (a total
    # deadline, not one per read: a body trickled a byte at a time is cut all the same).
    body_timeout_s: float = 10.0
    # Requests holding a body before their request slot: being read, or read and waiting for a slot.
    # Bodies are read outside the request slots (a slow client holds no slot); this bounds the
    # memory they hold, max_concurrent_bodies x max_body_bytes (docs/router.md).
    max_concurrent_bodies: int = 64
    # Nesting of a body's JSON (the object itself is 1); deeper gets 400 json_too_deep.
    max_json_depth: int = 64
    # Objects and arrays in a body's JSON; more gets 400 json_too_large. Parsed, each costs ~70 bytes
    # whatever its size in the body (8 MiB of "{}," is 194 MiB of dicts): this bounds that.
    max_json_containers: int = 100_000
    # A client's own kv_transfer_params (the P/D hand-off the router computes) reach the workers
    # only when true; by default they are dropped, and counted.
    allow_client_kv_transfer_params: bool = False
    log_level: str = "info"
    log_json: bool = False  # one JSON object per log line (kvcache-server's format, plus the request's facts)
    # Requests handled at once; more wait for a slot up to queue_timeout_s, then get 503. The wait
    # for room to read the body (max_concurrent_bodies) counts in the same queue_timeout_s.
    max_concurrent_requests: int = 256
    queue_timeout_s: float = 30.0
    # After SIGTERM: no new connections; requests in flight may finish within this, then are cut.
    shutdown_grace_s: float = 20.0

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"http.port must be in [0, 65535], got {self.port}")
        for name in (
            "max_body_bytes",
            "body_timeout_s",
            "max_concurrent_bodies",
            "max_json_containers",
            "max_concurrent_requests",
            "queue_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"http.{name} must be positive")
        # Parsed JSON is walked, and re-encoded for the workers, by recursive code: keep far below
        # Python's recursion limit.
        if not 1 <= self.max_json_depth <= _MAX_JSON_DEPTH:
            raise ConfigError(f"http.max_json_depth must be in [1, {_MAX_JSON_DEPTH}], got {self.max_json_depth}")
        if self.shutdown_grace_s < 0:
            raise ConfigError("http.shutdown_grace_s must not be negative")
        if self.log_level.lower() not in {"debug", "info", "warning", "error", "critical"}:
            raise ConfigError(f"http.log_level {self.log_level!r} is not a log level")


@dataclass(frozen=True, slots=True)
class WorkersSection:
    """The OpenAI-compatible workers behind the router, and the deadlines of every call to them."""

    prefill: tuple[str, ...] = ()  # base URLs, e.g. "http://vllm-prefill:8000"; none: decode only
    decode: tuple[str, ...] = ()
    connect_timeout_s: float = 2.0  # every upstream call: to open the connection
    tokenize_timeout_s: float = 5.0  # a /tokenize call, whole
    prefill_timeout_s: float = 120.0  # a prefill (max_tokens 1) call, whole
    prefill_attempts: int = 2  # prefill workers tried per request before going decode-only
    # A decode call: the longest a worker may stay silent (before its response headers, and between
    # two reads of its body), and the whole call.
    decode_read_timeout_s: float = 120.0
    decode_timeout_s: float = 600.0
    health_interval_s: float = 2.0
    health_timeout_s: float = 2.0
    # Consecutive failed health checks that eject a worker; one success brings it back. A worker
    # that refuses a request's connection is ejected at once.
    health_failures: int = 2

    def validate(self) -> None:
        if not self.decode:
            raise ConfigError("workers.decode needs at least one URL (--decode)")
        for url in (*self.prefill, *self.decode):
            parsed = urlparse(url)
            if parsed.scheme not in ("http", "https") or not parsed.netloc or parsed.path not in ("", "/"):
                raise ConfigError(f"workers: {url!r} is not a base URL like http://host:port")
        for name in (
            "connect_timeout_s",
            "tokenize_timeout_s",
            "prefill_timeout_s",
            "decode_read_timeout_s",
            "decode_timeout_s",
            "health_interval_s",
            "health_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"workers.{name} must be positive")
        if self.prefill_attempts < 1 or self.health_failures < 1:
            raise ConfigError("workers.prefill_attempts and workers.health_failures must be >= 1")


_NAMESPACE_SOURCES = ("worker", "config")


@dataclass(frozen=True, slots=True)
class KVCacheSection:
    """The kvcache server the router asks how much of a prompt is stored."""

    target: str = ""  # host:port; empty: no lookups (always prefill)
    lookup_timeout_s: float = 0.5  # a late answer counts as nothing stored
    # "worker": read the namespace from a worker's GET /kvcache/namespace (examples/openai_worker.py);
    # "config": from [namespace] (vLLM workers, which do not publish theirs).
    namespace_source: str = "worker"
    token_env: str = "KVCACHE_TOKEN"  # environment variable with the API token of a server with auth
    tls: bool = False
    tls_ca_file: str = ""
    # Sessions (docs/router.md): the longest retention a client's hint may ask for (a longer one is cut).
    max_retain_ttl_s: float = 3600.0
    # After a turn's answer went out whole: a Prefetch of the prompt's blocks into the server's RAM.
    # Off by default: one more call per turn, which pays only where a lower tier (disk, Redis, S3)
    # holds what RAM let go and the session's next turn comes back.
    prefetch_after_turn: bool = False
    prefetch_timeout_s: float = 2.0  # one prefetch's deadline
    prefetch_max_keys: int = 4096  # blocks one prefetch names (the prompt's first); the server's [prefetch] max_keys
    max_concurrent_prefetches: int = 64  # prefetches running at once; one more is dropped (counted)

    def validate(self) -> None:
        if self.lookup_timeout_s <= 0:
            raise ConfigError("kvcache.lookup_timeout_s must be positive")
        for name in ("max_retain_ttl_s", "prefetch_timeout_s", "prefetch_max_keys", "max_concurrent_prefetches"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"kvcache.{name} must be positive")
        if self.max_retain_ttl_s == float("inf"):
            raise ConfigError("kvcache.max_retain_ttl_s must be finite")
        if self.namespace_source not in _NAMESPACE_SOURCES:
            raise ConfigError(
                f"kvcache.namespace_source must be one of {_NAMESPACE_SOURCES}, got {self.namespace_source!r}"
            )
        if self.tls_ca_file and not Path(self.tls_ca_file).is_file():
            raise ConfigError(f"kvcache.tls_ca_file: {self.tls_ca_file} is not a readable file")


@dataclass(frozen=True, slots=True)
class NamespaceSection:
    """The workers' namespace (docs/keys.md) when kvcache.namespace_source = "config".

    For vLLM workers: the engine's facts as its connector reads them (docs/vllm.md): num_kv_heads
    the KV heads of one rank, tp_size the workers' tensor-parallel size, kv_heads_per_block the
    connector's (0: its default, a rank's heads). The vLLM connector stores kvcache.canonical v2,
    head-sharded: one namespace of all the model's heads whatever the TP size, each chunk as blocks
    of kv_heads_per_block heads; the router looks up the first head block of each chunk (rank 0's),
    which every rank saves with the rest. kvcache.mla keeps one namespace per shard (shard 0's here).
    """

    model_id: str = ""
    model_revision: str = ""
    kv_dtype: str = ""
    chunk_tokens: int = 256
    num_layers: int = 0
    num_kv_heads: int = 0
    head_size: int = 0
    tp_size: int = 1
    layout: str = CANONICAL_LAYOUT
    kv_heads_per_block: int = 0
    # "key=value" pairs, the connector's namespace_extra (and what it adds itself, e.g. the quantization).
    extra: tuple[str, ...] = ()

    def build(self) -> Namespace:
        """The Namespace these fields describe.

        Raises:
            ConfigError: a field is missing or invalid.
        """
        pairs = {}
        for item in self.extra:
            key, sep, value = item.partition("=")
            if not sep:
                raise ConfigError(f"namespace.extra: {item!r} is not key=value")
            pairs[key] = value
        try:
            return Namespace(
                model_id=self.model_id,
                model_revision=self.model_revision,
                kv_dtype=self.kv_dtype,
                chunk_tokens=self.chunk_tokens,
                num_layers=self.num_layers,
                num_kv_heads=self.num_kv_heads * self.tp_size if self.head_sharded else self.num_kv_heads,
                head_size=self.head_size,
                tp_size=1 if self.head_sharded else self.tp_size,
                tp_rank=0,
                layout=self.layout,
                layout_version=HEADS_LAYOUT_VERSION if self.head_sharded else LAYOUT_VERSION,
                extra=pairs,
            )
        except ValueError as exc:
            raise ConfigError(f"[namespace]: {exc}") from None

    @property
    def head_sharded(self) -> bool:
        """Whether the workers store chunks as head blocks (kvcache.canonical v2, the vLLM connector's)."""
        return self.layout == CANONICAL_LAYOUT

    def head_block(self) -> tuple[int, int] | None:
        """(heads per stored block, all heads) of the block a lookup asks for; None when each key is a whole chunk.

        Raises:
            ConfigError: kv_heads_per_block does not divide a rank's heads.
        """
        if not self.head_sharded:
            return None
        per_block = self.kv_heads_per_block or self.num_kv_heads
        if per_block < 1 or self.num_kv_heads % per_block:
            raise ConfigError(
                f"namespace.kv_heads_per_block ({self.kv_heads_per_block}) must divide "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        total = self.num_kv_heads * self.tp_size
        return None if per_block == total else (per_block, total)

    def validate(self) -> None:
        if self.layout not in (CANONICAL_LAYOUT, MLA_LAYOUT):
            raise ConfigError(f"namespace.layout must be {CANONICAL_LAYOUT!r} or {MLA_LAYOUT!r}")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Everything the router reads at start-up."""

    http: HttpSection = field(default_factory=HttpSection)
    workers: WorkersSection = field(default_factory=WorkersSection)
    kvcache: KVCacheSection = field(default_factory=KVCacheSection)
    namespace: NamespaceSection = field(default_factory=NamespaceSection)

    def validate(self) -> RouterConfig:
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate()
        if self.kvcache.target and self.kvcache.namespace_source == "config":
            self.namespace.build()
            self.namespace.head_block()
        return self


def assignments(items: list[str]) -> dict[str, dict[str, str]]:
    """`--set section.field=value` flags as {section: {field: value}}."""
    out: dict[str, dict[str, str]] = {}
    for item in items:
        section, name, value = parse_assignment(item)
        out.setdefault(section, {})[name] = value
    return out


def load_config(
    *,
    path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> RouterConfig:
    """Builds the validated config from defaults, a TOML file, the environment and overrides.

    Args:
        path: A TOML file; when None, KVCACHE_ROUTER_CONFIG from `env` names one, if set.
        env: Environment variables (os.environ in production).
        overrides: {section: {field: value}} from command-line flags.

    Raises:
        ConfigError: for any unknown or invalid setting, naming it.
    """
    env = env or {}
    return load_layered(
        RouterConfig(),
        path=path or env.get(ENV_CONFIG),
        env=env,
        overrides=overrides,
        prefix=ENV_PREFIX,
        ignored=lambda var: var == ENV_CONFIG,
        docs="docs/router.md",
    ).validate()
