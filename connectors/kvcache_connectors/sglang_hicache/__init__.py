"""kvcache as SGLang's HiCache storage backend (the L3 below its host KV pool), sglang 0.5.23.

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
        --hicache-mem-layout page_first --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvcache",
            "module_path": "kvcache_connectors.sglang_hicache", "class_name": "KVCacheHiCacheStorage",
            "interface_v1": 1, "target": "HOST:51051"}'

Modules, one job each: config (the extra config's keys), namespace (which kvcache namespace and
keys SGLang's pages go under; the key mapping itself is kvcache_connectors.engine_keys), pages
(where a page's bytes lie in the host pool), backend (the HiCacheStorage). See docs/sglang.md.
"""

from kvcache_connectors.sglang_hicache.backend import Counters, KVCacheHiCacheStorage
from kvcache_connectors.sglang_hicache.config import HiCacheBackendConfig

__all__ = ["Counters", "HiCacheBackendConfig", "KVCacheHiCacheStorage"]
