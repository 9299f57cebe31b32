"""Builders for the L2 adapter tests: LMCache's own ObjectKeys and host buffers, and eventfd waits."""

from __future__ import annotations

import os
import select
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.memory_allocators.host_memory_allocator import HostMemoryAllocator
from lmcache.v1.memory_management import MemoryObj

# One chunk of a small model as LMCache's L1 lays it out: [2 (K, V), layers, tokens, hidden].
CHUNK_SHAPE = torch.Size([2, 2, 16, 128])
CHUNK_DTYPE = torch.bfloat16
CHUNK_BYTES = CHUNK_SHAPE.numel() * CHUNK_DTYPE.itemsize  # 16 KiB


class Buffers:
    """LMCache's host allocator over one region; buffers are MemoryObjs of CHUNK_SHAPE."""

    def __init__(self, size_bytes: int = 16 << 20) -> None:
        self.allocator = HostMemoryAllocator(size_bytes)
        self._held: list[MemoryObj] = []

    def empty(self, n: int, shape: torch.Size = CHUNK_SHAPE) -> list[MemoryObj]:
        out = []
        for _ in range(n):
            obj = self.allocator.allocate(shape, CHUNK_DTYPE)
            assert obj is not None, "test allocator full"
            obj.tensor.view(torch.uint8).view(-1).zero_()
            out.append(obj)
        self._held += out
        return out

    def filled(self, seeds: list[int]) -> list[MemoryObj]:
        out = self.empty(len(seeds))
        for obj, seed in zip(out, seeds, strict=True):
            data = torch.randint(
                0, 256, (obj.get_size(),), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
            )
            obj.tensor.view(torch.uint8).view(-1).copy_(data)
        return out

    def close(self) -> None:
        for obj in self._held:  # LMCache warns about buffers collected with references left
            obj.ref_count_down()
        self._held.clear()


def object_keys(
    n: int, *, first: int = 0, model: str = "org/tiny", rank: int = 0, group: int = 0, salt: str = ""
) -> list[ObjectKey]:
    """n ObjectKeys whose chunk hashes are 32 bytes derived from first, first + 1, ..."""
    return [
        ObjectKey(
            chunk_hash=(first + i).to_bytes(4, "big") * 8,
            model_name=model,
            kv_rank=rank,
            object_group_id=group,
            cache_salt=salt,
        )
        for i in range(n)
    ]


def readable(fd: int, timeout_s: float) -> bool:
    """Whether the eventfd became readable within timeout_s; consumes its count when it did."""
    ready, _, _ = select.select([fd], [], [], timeout_s)
    if not ready:
        return False
    os.eventfd_read(fd)
    return True


def wait_result(query: Callable[[int], Any], task_id: int, fd: int, timeout_s: float = 10.0) -> Any:
    """Waits on `fd` until query(task_id) answers; the answer (LMCache's controllers do the same)."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = query(task_id)
        if result is not None:
            return result
        left = deadline - time.monotonic()
        assert left > 0, f"task {task_id} did not complete within {timeout_s} s"
        readable(fd, left)


_STORE_RESULTS: weakref.WeakKeyDictionary[Any, dict[int, Any]] = weakref.WeakKeyDictionary()


def wait_store(adapter: Any, task_id: int, timeout_s: float = 10.0) -> Any:
    """The L2StoreResult of one store task. pop_completed_store_tasks returns each result once, so
    the results popped while waiting for another task are kept for their own wait."""
    done = _STORE_RESULTS.setdefault(adapter, {})

    def query(tid: int) -> Any:
        done.update(adapter.pop_completed_store_tasks())
        return done.pop(tid, None)

    return wait_result(query, task_id, adapter.get_store_event_fd(), timeout_s)


def bits(bitmap: Any) -> list[int]:
    return [int(bitmap.test(i)) for i in range(bitmap.size())]


def eventually(predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
