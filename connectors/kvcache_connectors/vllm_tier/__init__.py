"""kvcache as a secondary tier under vLLM 0.33's own OffloadingConnector (below its CPU tier).

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8589934592,
        "secondary_tiers": [{"type": "KVCacheTier", "module_path": "kvcache_connectors.vllm_tier",
                             "target": "HOST:51051"}]}}'

Modules, one job each: config (the tier entry's keys), namespace (which kvcache namespace
vLLM's chunks go under; the key mapping itself is kvcache_connectors.engine_keys), tier (the
SecondaryTierManager). See docs/vllm-tier.md.
"""

from kvcache_connectors.vllm_tier.config import KVCacheTierConfig
from kvcache_connectors.vllm_tier.tier import KVCacheTier, TierMetrics

__all__ = ["KVCacheTier", "KVCacheTierConfig", "TierMetrics"]
