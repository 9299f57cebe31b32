"""vLLM 0.33's OffloadingConnector worker on a CPU: everything vLLM's own except the device copy.

vLLM's CPUOffloadingWorker (vllm/v1/kv_offload/cpu/gpu_worker.py) moves blocks between the engine's
KV cache and its CPU tier with a CUDA copy kernel (`_custom_ops.swap_blocks_batch`) on CUDA streams
timed by CUDA events, pins the CPU tier with cudaHostRegister, and refuses to start anywhere else
(`CPUOffloadingSpec.get_worker` checks the platform; `SingleDirectionOffloadingHandler` asserts
`is_cuda`). On this CPU-only machine `CPUWorkerTieringSpec` (vLLM's TieringOffloadingSpec, loaded by
`spec_name` + `spec_module_path` as any out-of-tree spec is) replaces exactly those device pieces:

- the copy: each (src, dst, size) descriptor that vLLM's own `_fill_direct_ops` / `_fill_canonical_ops`
  computed is done with one `memmove`, synchronously, when the handler submits it;
- streams and events: a stream that orders nothing (the copy is done when submitted) and an event
  that records a clock (so vLLM's `transfer_time` is real), both done at once;
- pinning: off (`PIN_MEMORY` False), as on a machine without a device;
- the one-rank worker barrier: a no-op (one worker has no peer to wait for).

Everything else is vLLM's: the connector's scheduler and worker sides, the block addressing, the job
bookkeeping, the shared CPU region, the TieringOffloadingManager and its secondary tiers. The copy
is synchronous where CUDA's is ordered on a stream after the compute stream; vLLM submits stores of
a step's KV only after its forward (`start_load_kv` runs after it for asynchronous loads) and loads
before the request is scheduled, so the order the kernel would see is the one memmove sees.
"""

from __future__ import annotations

import contextlib
import ctypes
import time
import types
from typing import Any

import torch
from typing_extensions import override
from vllm.v1.kv_offload.base import CanonicalKVCaches, CanonicalKVCacheTensor, OffloadingWorker
from vllm.v1.kv_offload.cpu import gpu_worker as _gpu_worker
from vllm.v1.kv_offload.cpu import spec as _cpu_spec
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec


class _HostStream:
    """A stream on which work is done when submitted: nothing to wait for."""

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass


class _HostEvent:
    """An event recorded on a _HostStream: complete once recorded; records the time it was."""

    def __init__(self, enable_timing: bool = False) -> None:
        self._at = time.perf_counter()

    def record(self, stream: Any = None) -> None:
        self._at = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _HostEvent) -> float:
        return (end._at - self._at) * 1e3  # milliseconds, as torch.Event's


class _HostPlatform:
    """The parts of vLLM's current_platform the offloading handler calls."""

    Stream = _HostStream

    @staticmethod
    def current_stream() -> _HostStream:
        return _HostStream()

    @staticmethod
    def stream(stream: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    @staticmethod
    def is_xpu() -> bool:
        return False

    @staticmethod
    def is_rocm() -> bool:
        return False


class _TorchWithHostEvents(types.ModuleType):
    """`torch` as the handler's module sees it, with torch.Event a _HostEvent."""

    Event = _HostEvent

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _memmove_batch(
    src_ptrs: torch.Tensor, dst_ptrs: torch.Tensor, sizes: torch.Tensor, is_src_access_order_any: bool = False
) -> None:
    """What vLLM's swap_blocks_batch does on a device, on host memory: dst[i] <- src[i], sizes[i] bytes."""
    for src, dst, size in zip(src_ptrs.tolist(), dst_ptrs.tolist(), sizes.tolist(), strict=True):
        ctypes.memmove(dst, src, size)


class _EngineTensor(torch.Tensor):
    """The engine's KV cache as the handler checks it: on CPU here, standing where a CUDA tensor is."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


_PATCHES: tuple[tuple[types.ModuleType, str, Any], ...] = (
    (_gpu_worker, "current_platform", _HostPlatform()),
    (_gpu_worker, "torch", _TorchWithHostEvents("torch")),
    (_gpu_worker, "ops", types.SimpleNamespace(swap_blocks_batch=_memmove_batch)),
    (_gpu_worker, "PIN_MEMORY", False),
    (_cpu_spec, "_all_workers_barrier", lambda: None),
)


def install() -> None:
    """Replaces the device pieces in vLLM's offloading worker module for this process (idempotent)."""
    for module, name, value in _PATCHES:
        setattr(module, name, value)


class CPUWorkerTieringSpec(TieringOffloadingSpec):
    """vLLM's TieringOffloadingSpec whose worker runs on a CPU (see the module's docstring)."""

    @override
    def _uses_shared_region(self) -> bool:
        return True  # the worker's CPU tier is the region the scheduler's manager reads, as on CUDA

    @override
    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if not self._worker:
            install()
            engine = CanonicalKVCaches(
                tensors=[
                    CanonicalKVCacheTensor(t.tensor.as_subclass(_EngineTensor), t.page_size_bytes)
                    for t in kv_caches.tensors
                ],
                group_data_refs=kv_caches.group_data_refs,
            )
            self._worker = self.create_worker(engine)
        return self._worker
