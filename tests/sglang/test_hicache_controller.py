"""SGLang's own HiCacheController drives the backend: its backup, prefetch, prefetch-I/O and sync threads.

The controller is SGLang's, built on CPU as the scheduler builds it (a paged allocator over a
device pool, the host pool, --hicache-storage-backend dynamic with the CLI's extra-config JSON);
the single-process parallel layout is stated with get_parallel().override, SGLang's test hook
(no process groups: the controller's rank reductions are then no-ops). The test plays the
scheduler's part between the threads: it allocates the prefetch's host buffer, as
UnifiedRadixCache does, and reads the acks.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from kvcache_connectors.sglang_hicache import Counters, KVCacheHiCacheStorage
from tests.conftest import ServerThread
from tests.sglang.harness import extra_config_json, fill_random, mha_pools, mla_pools, page_bytes

pytestmark = pytest.mark.timeout(60)

PAGE = 4
WAIT_S = 15.0


@pytest.fixture
def controllers(server: ServerThread) -> Iterator[Any]:
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.runtime_context import get_parallel

    made: list[HiCacheController] = []

    def make(kind: str, seed: int) -> HiCacheController:
        device, host = (mha_pools if kind == "mha" else mla_pools)(page_size=PAGE)
        fill_random(host, seed)
        allocator = PagedTokenToKVPoolAllocator(device.size, PAGE, device.dtype, "cpu", device, False)
        extra, *_ = HybridCacheController.parse_storage_backend_extra_config(extra_config_json(server.target))
        parallel = {"tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "attn_dcp_size": 1, "attn_dcp_rank": 0}
        with get_parallel().override(**parallel):
            controller = HiCacheController(
                allocator,
                host,
                PAGE,
                None,  # tp_group: one rank
                threading.Event(),
                storage_backend="dynamic",
                model_name="tiny-model",
                storage_backend_extra_config=extra,
            )
        made.append(controller)
        return controller

    yield make
    for controller in made:
        controller.detach_storage_backend()


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_controller_backs_up_finds_and_prefetches_through_the_backend(controllers, kind: str) -> None:
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    controller = controllers(kind, seed=21)
    backend = controller.storage_backend
    assert isinstance(backend, KVCacheHiCacheStorage)
    assert controller.page_get_func.__name__ == "_page_get_zero_copy"  # "interface_v1": 1
    assert controller.storage_config.is_mla_model is (kind == "mla")
    host = controller.mem_pool_host

    tokens = list(range(1000, 1000 + 5 * PAGE))
    hashes = get_storage_hash_str(tokens, None, page_size=PAGE)
    src = host.alloc(len(tokens))
    controller.write_storage(src, tokens, hash_value=hashes)
    backed_up = controller.ack_backup_queue.get(timeout=WAIT_S)
    assert backed_up.completed_tokens == len(tokens)

    operation = controller.prefetch("req-1", tokens)
    hit = controller.prefetch_hit_queue.get(timeout=WAIT_S)
    assert hit is operation and hit.storage_hit_count == len(tokens) and hit.hash_value == hashes
    # The scheduler's part (UnifiedRadixCache): a host buffer for the hit, then the I/O thread.
    dst = controller.alloc_prefetch_host_buffers(hit, hit.storage_hit_count)
    assert dst is not None
    hit.host_indices = dst
    controller.prefetch_buffer.put(hit)
    acks = []
    while not acks or not acks[-1].completed_req:
        acks.append(controller.ack_prefetch_queue.get(timeout=WAIT_S))
    assert [a.completed_tokens for a in acks if not a.completed_req] == [len(tokens)]
    assert page_bytes(host, dst) == page_bytes(host, src)

    missed = controller.prefetch("req-2", list(range(7000, 7000 + 3 * PAGE)))
    assert controller.prefetch_hit_queue.get(timeout=WAIT_S) is missed
    assert missed.storage_hit_count == 0 and missed.hash_value == []
    counts = backend.counters()
    assert counts[Counters.PAGES_STORED] == counts[Counters.PAGES_LOADED] == 5
    assert counts[Counters.LOOKUPS] == 2 and counts[Counters.PAGES_FOUND] == 5
    assert all(thread.is_alive() for thread in (controller.prefetch_thread, controller.backup_thread))
