"""The connector's settings: `kv_connector_extra_config` parsed once into a frozen dataclass.

    --kv-transfer-config '{"kv_connector": "KVCacheConnector",
                           "kv_connector_module_path": "kvcache_connectors.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"target": "10.0.0.5:51051", "chunk_tokens": 256}}'

Every key is optional; an unknown key, a wrong type or a value out of range is a
ValueError that names the key, raised when vLLM builds the connector (at start-up),
never later in the serving path. docs/vllm.md lists the keys with their defaults.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvcache_client.client import DEFAULT_TARGET
from kvcache_client.connection import TLSConfig

DEFAULT_CHUNK_TOKENS = 256
"""Target chunk size; the default chunk is the smallest multiple of vLLM's block size at least this large."""

RESERVED_EXTRA_PREFIX = "vllm."
"""Namespace `extra` keys the connector sets itself (LoRA name, multimodal inputs, cache dtype, quantization)."""


@dataclass(frozen=True, slots=True)
class KVCacheConnectorConfig:
    """Settings of one vLLM instance's connector (the scheduler and every worker parse the same dict).

    Attributes:
        target: The kvcache server, "host:port" (any gRPC target string); or several, comma-separated,
            the node's own first, to fail over between servers that share their tiers (docs/deployment.md).
        lookup_timeout_s: Deadline of the scheduler's Lookup of a prompt. The scheduler
            never retries: a late or failed lookup is a miss.
        transfer_timeout_s: Deadline of a worker's Get (loads) or Put (saves) of one step.
        breaker_cooldown_s: After a failed call, the process stops calling the server for
            this long (lookups are misses, loads fail fast, saves are dropped), then probes
            it with one call; so a dead server costs one timeout per cooldown, not one per request.
        chunk_tokens: Tokens per stored chunk, a multiple of vLLM's block size. Part of the
            namespace: instances that share KV must use the same value.
        model_id: Model identity in the namespace; None takes vLLM's `--model` (set it when
            instances load the same checkpoint from different paths).
        model_revision: Checkpoint revision in the namespace; None takes vLLM's `--revision` or "".
        namespace_extra: Further (key, value) facts that must separate KV, e.g. a deployment tag.
        save_partial_chunks: Also store a prompt's final chunk when it holds fewer than
            chunk_tokens tokens. A P/D decode instance needs it to skip the whole prompt;
            an offloading instance can turn it off to spend no storage on tails that only an
            identical prompt can reuse.
        token_env: Environment variable holding the API token (default KVCACHE_TOKEN); keeps the
            token out of the command line, where --kv-transfer-config is visible to every user.
        token: The API token itself, when an environment variable is not an option.
        tls: Connect with TLS, verifying the server against tls_ca_file or the system roots.
        tls_ca_file, tls_cert_file, tls_key_file: CA bundle; client certificate and key for mTLS.
        shm: Move KV bytes through shared memory when the server runs on this host and shares its
            shm directory with this process (docs/shm.md); otherwise, or when false, over gRPC.
        save_queue_steps: Steps of gathered saves a worker queues for its save thread; when full,
            the oldest queued save is dropped (counted), never the engine blocked.
        staging_bytes: Host memory per worker for gathered saves not yet put (pinned on CUDA);
            when full, the oldest queued save is dropped.
        write_back: Also save the chunks that generated tokens complete and, when a request
            finishes, its final partial chunk, so a follow-up turn reuses the whole conversation.
            None: on for roles that save (kv_producer, kv_both), off for a kv_consumer, which
            then saves only what it generates when set to true.
        handoff_timeout_s: How long a consumer's load waits for chunks that a producer's
            kv_transfer_params name and that are not stored yet (its puts are in flight);
            then the missing chunks are recomputed.
        kv_heads_per_block: KV heads per stored block of a chunk (head-sharded storage, docs/vllm.md
            "Mixed tensor parallelism"); must divide the KV heads of one rank. None: all of a rank's
            heads in one block, the cheapest for instances of equal TP size. A deployment mixing TP
            sizes sets it to the head count of its largest TP size's rank on the instances that save,
            so every rank of every instance loads exactly its own heads.
        retain_ttl_s: Ask the server to retain every request's saved chunks in RAM for this long
            (PutRequest.retain_ttl_s, docs/tiers.md "Sessions that stay"); None: only requests whose
            kv_transfer_params carry a hint (kvcache_retain_ttl_s or cache_control) are retained.
        max_retain_ttl_s: The longest retention a request's hint may ask for; a longer one is cut to it.
    """

    target: str = DEFAULT_TARGET
    lookup_timeout_s: float = 0.5
    transfer_timeout_s: float = 30.0
    breaker_cooldown_s: float = 5.0
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    model_id: str | None = None
    model_revision: str | None = None
    namespace_extra: tuple[tuple[str, str], ...] = ()
    save_partial_chunks: bool = True
    token_env: str = "KVCACHE_TOKEN"
    token: str | None = field(default=None, repr=False)
    tls: bool = False
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    shm: bool = True
    save_queue_steps: int = 8
    staging_bytes: int = 1 << 30
    write_back: bool | None = None
    handoff_timeout_s: float = 5.0
    kv_heads_per_block: int | None = None
    retain_ttl_s: float | None = None
    max_retain_ttl_s: float = 3600.0

    def tls_config(self) -> TLSConfig | bool:
        if not self.tls:
            return False
        return TLSConfig(ca_file=self.tls_ca_file, cert_file=self.tls_cert_file, key_file=self.tls_key_file)

    def api_token(self) -> str | None:
        return self.token if self.token is not None else os.environ.get(self.token_env) or None

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any], *, block_size: int) -> KVCacheConnectorConfig:
        """Parses `kv_connector_extra_config`.

        Args:
            extra: The dict given to vLLM.
            block_size: vLLM's KV block size (tokens); chunk_tokens must be a multiple of it.

        Raises:
            ValueError: an unknown key, or a value of the wrong type or out of range.
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown key(s) {unknown}; known keys: {sorted(known)}")
        chunk_tokens = _positive_int(extra, "chunk_tokens", default_chunk_tokens(block_size))
        if chunk_tokens % block_size:
            raise ValueError(
                f"kv_connector_extra_config['chunk_tokens'] = {chunk_tokens} must be a multiple of "
                f"vLLM's block size {block_size}"
            )
        max_retain_ttl_s = _positive_float(extra, "max_retain_ttl_s", 3600.0)
        retain_ttl_s = None if extra.get("retain_ttl_s") is None else _positive_float(extra, "retain_ttl_s", 1.0)
        if retain_ttl_s is not None and retain_ttl_s > max_retain_ttl_s:
            raise ValueError(
                f"{_where('retain_ttl_s')} = {retain_ttl_s} exceeds {_where('max_retain_ttl_s')} = {max_retain_ttl_s}"
            )
        return cls(
            target=_string(extra, "target", DEFAULT_TARGET, allow_empty=False),
            lookup_timeout_s=_positive_float(extra, "lookup_timeout_s", 0.5),
            transfer_timeout_s=_positive_float(extra, "transfer_timeout_s", 30.0),
            breaker_cooldown_s=_positive_float(extra, "breaker_cooldown_s", 5.0),
            chunk_tokens=chunk_tokens,
            model_id=_optional_string(extra, "model_id", allow_empty=False),
            model_revision=_optional_string(extra, "model_revision", allow_empty=True),
            namespace_extra=_string_map(extra, "namespace_extra"),
            save_partial_chunks=_bool(extra, "save_partial_chunks", True),
            token_env=_string(extra, "token_env", "KVCACHE_TOKEN", allow_empty=False),
            token=_optional_string(extra, "token", allow_empty=False),
            tls=_bool(extra, "tls", False),
            tls_ca_file=_optional_string(extra, "tls_ca_file", allow_empty=False),
            tls_cert_file=_optional_string(extra, "tls_cert_file", allow_empty=False),
            tls_key_file=_optional_string(extra, "tls_key_file", allow_empty=False),
            shm=_bool(extra, "shm", True),
            save_queue_steps=_positive_int(extra, "save_queue_steps", 8),
            staging_bytes=_positive_int(extra, "staging_bytes", 1 << 30),
            write_back=None if extra.get("write_back") is None else _bool(extra, "write_back", True),
            handoff_timeout_s=_positive_float(extra, "handoff_timeout_s", 5.0),
            kv_heads_per_block=(
                None if extra.get("kv_heads_per_block") is None else _positive_int(extra, "kv_heads_per_block", 1)
            ),
            retain_ttl_s=retain_ttl_s,
            max_retain_ttl_s=max_retain_ttl_s,
        )


def default_chunk_tokens(block_size: int) -> int:
    """The smallest multiple of block_size that is at least DEFAULT_CHUNK_TOKENS."""
    return block_size * math.ceil(DEFAULT_CHUNK_TOKENS / block_size)


def _where(key: str) -> str:
    return f"kv_connector_extra_config[{key!r}]"


def _string(extra: Mapping[str, Any], key: str, default: str, *, allow_empty: bool) -> str:
    value = extra.get(key, default)
    if not isinstance(value, str):
        raise ValueError(f"{_where(key)} must be a string, got {type(value).__name__}")
    if not value and not allow_empty:
        raise ValueError(f"{_where(key)} must not be empty")
    return value


def _optional_string(extra: Mapping[str, Any], key: str, *, allow_empty: bool) -> str | None:
    if extra.get(key) is None:
        return None
    return _string(extra, key, "", allow_empty=allow_empty)


def _positive_float(extra: Mapping[str, Any], key: str, default: float) -> float:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{_where(key)} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{_where(key)} must be a positive number of seconds, got {value}")
    return float(value)


def _positive_int(extra: Mapping[str, Any], key: str, default: int) -> int:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{_where(key)} must be an integer, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{_where(key)} must be positive, got {value}")
    return value


def _bool(extra: Mapping[str, Any], key: str, default: bool) -> bool:
    value = extra.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"{_where(key)} must be true or false, got {value!r}")
    return value


def _string_map(extra: Mapping[str, Any], key: str) -> tuple[tuple[str, str], ...]:
    value = extra.get(key, {})
    if not isinstance(value, Mapping):
        raise ValueError(f"{_where(key)} must be an object of strings, got {type(value).__name__}")
    for k, v in value.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise ValueError(f"{_where(key)} must map strings to strings, got {k!r}: {v!r}")
        if k.startswith(RESERVED_EXTRA_PREFIX):
            raise ValueError(f"{_where(key)} key {k!r}: keys starting with {RESERVED_EXTRA_PREFIX!r} are reserved")
    return tuple(sorted(value.items()))
