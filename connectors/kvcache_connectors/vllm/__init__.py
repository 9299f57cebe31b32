"""kvcache's vLLM KV connector (vLLM 0.33's KV-connector v1 API).

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVCacheConnector",
        "kv_connector_module_path": "kvcache_connectors.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"target": "HOST:51051"}}'

Modules, one job each: config (the extra-config keys), namespaces (which namespace a
shard's KV goes under), layout (paged tensors <-> canonical chunks), metadata (the
scheduler -> worker plan), scheduler and worker (each role's hooks), stats,
connector (the vLLM class that routes the hooks). See docs/vllm.md.
"""

from kvcache_connectors.vllm.config import KVCacheConnectorConfig
from kvcache_connectors.vllm.connector import KVCacheConnector
from kvcache_connectors.vllm.metadata import ChunkRef, KVCacheConnectorMetadata, RequestTransfer
from kvcache_connectors.vllm.stats import KVCacheConnectorStats

__all__ = [
    "ChunkRef",
    "KVCacheConnector",
    "KVCacheConnectorConfig",
    "KVCacheConnectorMetadata",
    "KVCacheConnectorStats",
    "RequestTransfer",
]
