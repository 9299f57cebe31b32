"""Builders for the HiCache tests: real SGLang host KV pools, storage configs and the backend as SGLang loads it.

Nothing here imports sglang at import time (conftest imports SGLANG_MODULES first, with the CPU
stand-ins in place); the builders import what conftest has already loaded.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

import torch

# Every sglang module the tests and the backend use, imported once by conftest.
SGLANG_MODULES = (
    "sglang.srt.mem_cache.hicache_storage",
    "sglang.srt.mem_cache.storage",
    "sglang.srt.mem_cache.storage.backend_factory",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.mem_cache.pool_host.mla",
    "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller",
    "sglang.srt.managers.cache_controller",
    "sglang.srt.observability.metrics_collector",
    "sglang.srt.mem_cache.allocator",
    "sglang.srt.mem_cache.deepseek_v4_memory_pool",  # imported by HiCacheController.attach_storage_backend
    "sglang.srt.distributed.parallel_state",  # and by its sync groups
    "sglang.srt.mem_cache.utils",
    "kvcache_connectors.sglang_hicache",
)

MODULE_PATH = "kvcache_connectors.sglang_hicache"
# The host memory the pools are booked against (SGLang's host_memory_budget_scope), instead of
# this machine's free memory less SGLang's 10 GiB reserve: the pools here are a few KiB.
HOST_BUDGET_BYTES = 64 << 20
CLASS_NAME = "KVCacheHiCacheStorage"


def extra_config_json(target: str, **options: Any) -> str:
    """The --hicache-storage-backend-extra-config value a user passes (docs/sglang.md)."""
    config = {
        "backend_name": "kvcache",
        "module_path": MODULE_PATH,
        "class_name": CLASS_NAME,
        "interface_v1": 1,
        "target": target,
        **options,
    }
    return json.dumps(config)


def mha_host_pool(**geometry: Any) -> Any:
    """An MHA host pool (mha_pools' second half)."""
    return mha_pools(**geometry)[1]


def mla_host_pool(**geometry: Any) -> Any:
    """An MLA host pool (mla_pools' second half)."""
    return mla_pools(**geometry)[1]


def mha_pools(
    *,
    layout: str = "page_first",
    page_size: int = 4,
    tokens: int = 64,
    heads: int = 2,
    head_dim: int = 8,
    layers: int = 3,
    dtype: torch.dtype = torch.bfloat16,
) -> Any:
    """A CPU MHA device pool and its host pool, built as SGLang's assembler does (_mha_host_inputs)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls

    device = MHATokenToKVPool(
        tokens, page_size, dtype, heads, head_dim, layers, "cpu", False, start_layer=0, end_layer=layers
    )
    info = device.get_device_pool_infos()[0].buffer_info
    with host_memory_budget_scope(HOST_BUDGET_BYTES):
        host = get_mha_host_pool_cls(info)(
            info,
            2.0,  # --hicache-ratio
            0,  # --hicache-size
            page_size,
            layout,
            pin_memory=False,  # no CUDA to register host memory with
            device="cpu",
            device_capacity_tokens=device.size,
            start_layer=device.start_layer,
            end_layer=device.end_layer,
            write_back_staging=device.hicache_write_back_staging,
        )
    return device, host


def mla_pools(
    *,
    layout: str = "page_first",
    page_size: int = 4,
    tokens: int = 64,
    kv_lora_rank: int = 16,
    qk_rope_head_dim: int = 8,
    layers: int = 3,
    dtype: torch.dtype = torch.bfloat16,
) -> Any:
    """A CPU MLA device pool and its host pool, built as SGLang's assembler does (_build_mha_mla_host_pool)."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    device = MLATokenToKVPool(
        tokens, page_size, dtype, kv_lora_rank, qk_rope_head_dim, layers, "cpu", False, start_layer=0, end_layer=layers
    )
    with host_memory_budget_scope(HOST_BUDGET_BYTES):
        host = MLATokenToKVPoolHost(
            device.get_device_pool_infos()[0].buffer_info,
            2.0,
            0,
            page_size,
            layout,
            pin_memory=False,
            device="cpu",
            device_capacity_tokens=device.size,
            start_layer=device.start_layer,
            end_layer=device.end_layer,
            target_layer_num=device.layer_num,
            override_kv_cache_dim=device.kv_cache_dim,
        )
    return device, host


def fill_random(host_pool: Any, seed: int) -> None:
    """Fills the whole host pool with random values (a fixed seed)."""
    generator = torch.Generator().manual_seed(seed)
    buffer = host_pool.kv_buffer
    buffer.copy_(torch.randn(buffer.shape, generator=generator, dtype=torch.float32).to(buffer.dtype))


def storage_config(
    extra_config_cli: str,
    *,
    is_mla: bool,
    tp_rank: int = 0,
    tp_size: int = 1,
    model_name: str | None = "tiny-model",
    layout: str = "page_first",
    enable_storage_metrics: bool = False,
) -> Any:
    """HiCacheStorageConfig as HiCacheController._generate_storage_config makes it (no DP, PP, CP)."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    # The same parser SGLang runs on --hicache-storage-backend-extra-config.
    extra_config, *_ = HybridCacheController.parse_storage_backend_extra_config(extra_config_cli)
    extra_config.pop("tp_lcm_size", None)  # as _generate_storage_config does
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=is_mla,
        enable_storage_metrics=enable_storage_metrics,
        is_page_first_layout=layout == "page_first",
        model_name=model_name,
        extra_config=extra_config,
    )


def load_backend(config: Any, host_pool: Any) -> Any:
    """The backend as HiCacheController.attach_storage_backend builds and registers it."""
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    backend = StorageBackendFactory.create_backend("dynamic", config, host_pool)
    backend.register_mem_pool_host(host_pool)
    backend.on_host_pools_registered()
    return backend


def page_keys(prefix: str, n: int) -> list[str]:
    """n SGLang-style page keys (hex strings, as get_hash_str makes them)."""
    from sglang.srt.mem_cache.utils import get_hash_str

    keys: list[str] = []
    last = None
    for i in range(n):
        last = get_hash_str([zlib.crc32(prefix.encode()) & 0xFFFF, i], prior_hash=last)
        keys.append(last)
    return keys


def page_bytes(host_pool: Any, host_indices: torch.Tensor) -> list[bytes]:
    """The bytes of each page at host_indices (through the pool's own flat page view)."""
    size = host_pool.page_size
    return [
        host_pool.get_data_page(int(host_indices[i]), flat=True).view(torch.uint8).numpy().tobytes()
        for i in range(0, host_indices.numel(), size)
    ]
