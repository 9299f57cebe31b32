"""Builders for the secondary-tier tests: vLLM 0.33's real TieringOffloadingSpec on CPU with the kvcache tier below it.

vLLM's OffloadingConnector worker (the GPU <-> CPU copies, vllm/v1/kv_offload/cpu/gpu_worker.py) needs
CUDA streams and CUDA tensors, so these tests stand in for it in one place only: `Instance.fill`
writes a chunk's bytes into the primary CPU row vLLM's manager allocated, where the worker's copy
would have put them. Everything else is vLLM's own: its config translation (build_offloading_config),
its spec factory, its TieringOffloadingManager and CPU primary tier, its SecondaryTierFactory.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config
from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.base import JobResult
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

from kvcache_connectors.vllm_tier import KVCacheTier
from tests.vllm.harness import make_kv_cache_config, make_vllm_config

TIER_TYPE = "KVCacheTier"
MODULE_PATH = "kvcache_connectors.vllm_tier"
END_STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def tier_entry(target: str, **options: Any) -> dict[str, Any]:
    """One `secondary_tiers` entry naming the kvcache tier by type and module path (no registration)."""
    return {"type": TIER_TYPE, "module_path": MODULE_PATH, "target": target, **options}


def offloading_config(
    model_dir: str, entry: dict[str, Any], *, kv_events: bool = False, num_blocks: int = 64, kv_cache_config=None
):
    """vLLM's OffloadingConfig for the tiny model: OffloadingConnector, TieringOffloadingSpec, one tier
    (`kv_cache_config`: another model's groups, e.g. harness.hybrid_kv_cache_config)."""
    vllm_config = make_vllm_config(
        model_dir,
        extra={"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1 << 20, "secondary_tiers": [entry]},
        kv_events=kv_events,
    )
    transfer = vllm_config.kv_transfer_config
    transfer.kv_connector = "OffloadingConnector"
    transfer.kv_connector_module_path = None
    transfer.engine_id = str(uuid.uuid4())  # each instance its own shared primary region
    return build_offloading_config(vllm_config, kv_cache_config or make_kv_cache_config(num_blocks))


def block_hash(i: int, prompt: int = 0) -> bytes:
    """A 32-byte stand-in for vLLM's sha256 block hash of block i of a prompt."""
    return torch.tensor([prompt, i], dtype=torch.int64).numpy().tobytes().ljust(32, b"\x5a")


def offload_keys(n: int, prompt: int = 0) -> list[OffloadKey]:
    return [make_offload_key(block_hash(i, prompt), 0) for i in range(n)]


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


@dataclass
class Instance:
    """One vLLM instance's offloading manager (scheduler side) with the kvcache tier below its CPU tier."""

    manager: TieringOffloadingManager

    @classmethod
    def build(cls, model_dir: str, entry: dict[str, Any], **kwargs: Any) -> Instance:
        spec = OffloadingSpecFactory.create_spec(offloading_config(model_dir, entry, **kwargs))
        manager = spec.get_manager()
        assert isinstance(manager, TieringOffloadingManager)
        return cls(manager)

    @property
    def tier(self) -> KVCacheTier:
        (tier,) = self.manager.secondary_tiers
        assert isinstance(tier, KVCacheTier)
        return tier

    @property
    def rows(self) -> torch.Tensor:
        """The primary CPU tier's buffer as [num_chunks, chunk_bytes] uint8 (shares its memory)."""
        view = self.manager.primary_tier.get_kv_memoryview()
        return torch.frombuffer(view.cast("B"), dtype=torch.uint8).view(view.shape[0], -1)

    def store(self, ctx: ReqContext, keys: list[OffloadKey], chunks: list[torch.Tensor]) -> None:
        """What the engine does for a computed prompt: prepare_store, the worker's copy, complete_store."""
        out = self.manager.prepare_store(keys, ctx)
        assert out is not None and list(out.keys_to_store) == keys
        assert isinstance(out.store_spec, CPULoadStoreSpec)
        for row, chunk in zip(out.store_spec.chunk_ids, chunks, strict=True):
            self.rows[int(row)].copy_(chunk)  # the GPU -> CPU worker's copy
        self.manager.complete_store(keys, ctx)
        self.manager.on_schedule_end(END_STEP)

    def settle(self, timeout_s: float = 10.0) -> None:
        """Steps (on_schedule_end) until no tier job is in flight."""

        def idle() -> bool:
            self.manager.on_schedule_end(END_STEP)
            return not self.manager.has_pending_work()

        wait_for(idle, timeout_s, "tier jobs")

    def lookup(self, ctx: ReqContext, key: OffloadKey, timeout_s: float = 10.0) -> LookupResult:
        """The manager's lookup, stepped until it is no longer deferred (RETRY / HIT_PENDING)."""
        result: list[LookupResult] = []

        def resolved() -> bool:
            result[:] = [self.manager.lookup(key, ctx)]
            if result[0] in (LookupResult.RETRY, LookupResult.HIT_PENDING):
                self.manager.on_schedule_end(END_STEP)
                return False
            return True

        wait_for(resolved, timeout_s, "a lookup")
        return result[0]

    def loaded_rows(self, ctx: ReqContext, keys: list[OffloadKey]) -> list[torch.Tensor]:
        """prepare_load (what the GPU <-> CPU worker would read), the rows' bytes, complete_load."""
        spec = self.manager.prepare_load(keys, ctx)
        assert isinstance(spec, CPULoadStoreSpec)
        out = [self.rows[int(r)].clone() for r in spec.chunk_ids]
        self.manager.complete_load(keys, ctx)
        return out

    def close(self) -> None:
        self.manager.shutdown()


def finished(tier: KVCacheTier, count: int, timeout_s: float) -> list[JobResult]:
    """Exactly `count` job results from the tier, polled through get_finished_jobs within timeout_s."""
    results: list[JobResult] = []

    def enough() -> bool:
        results.extend(tier.get_finished_jobs())
        return len(results) >= count

    wait_for(enough, timeout_s, f"{count} job results")
    time.sleep(0.05)
    results.extend(tier.get_finished_jobs())
    assert len(results) == count, results
    return results
