"""kvcache as an L2 adapter of LMCache's multiprocess server (lmcache 0.5.x), below LMCache's L1.

    lmcache server ... --l2-adapter '{"type": "plugin", "module_path": "kvcache_connectors.lmcache_l2",
        "class_name": "KVCacheL2Adapter", "adapter_params": {"target": "HOST:51051"}}'

Modules, one job each: config (adapter_params), keys (which kvcache namespace and key an ObjectKey
goes under; the derivation itself is kvcache_connectors.engine_keys), lanes (worker threads with
bounded queues), locks (the locked keys and the leased blocks they hold), counters, adapter (the
L2AdapterInterface, composing them). See docs/lmcache.md.
"""

from kvcache_connectors.lmcache_l2.adapter import Counters, KVCacheL2Adapter
from kvcache_connectors.lmcache_l2.config import KVCacheL2Config

__all__ = ["Counters", "KVCacheL2Adapter", "KVCacheL2Config"]
