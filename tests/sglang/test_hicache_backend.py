"""The kvcache HiCache backend against a real kvcache server, with real SGLang host pools, loaded by SGLang's factory.

Each test builds host KV pools the way SGLang's assembler does (a CPU device pool, then its host
mirror, page-first), parses the extra-config JSON with SGLang's own parser, builds the backend
through StorageBackendFactory.create_backend("dynamic", ...) and registers the pool, as
HiCacheController.attach_storage_backend does; then drives the calls the controller makes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import torch

from kvcache_client import KVCacheClient
from kvcache_connectors.sglang_hicache import Counters, HiCacheBackendConfig, KVCacheHiCacheStorage
from tests.conftest import ServerThread
from tests.sglang.harness import (
    extra_config_json,
    fill_random,
    load_backend,
    mha_host_pool,
    mla_host_pool,
    page_bytes,
    page_keys,
    storage_config,
)

pytestmark = pytest.mark.timeout(60)

POOLS = {"mha": mha_host_pool, "mla": mla_host_pool}


@pytest.fixture
def backends(server: ServerThread) -> Iterator[Callable[..., KVCacheHiCacheStorage]]:
    """Factory: backends(kind, layout=..., tp_rank=..., ..., seed=...) -> a registered backend on `server`."""
    made: list[KVCacheHiCacheStorage] = []

    def make(
        kind: str,
        *,
        layout: str = "page_first",
        seed: int = 0,
        tp_rank: int = 0,
        tp_size: int = 1,
        model_name: str = "tiny-model",
        pool_args: dict | None = None,
        **options: object,
    ) -> KVCacheHiCacheStorage:
        pool = POOLS[kind](layout=layout, **(pool_args or {}))
        fill_random(pool, seed)
        config = storage_config(
            extra_config_json(server.target, **options),
            is_mla=kind == "mla",
            tp_rank=tp_rank,
            tp_size=tp_size,
            model_name=model_name,
            layout=layout,
            enable_storage_metrics=True,
        )
        backend = load_backend(config, pool)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()


def indices(first_page: int, pages: int, page_size: int = 4) -> torch.Tensor:
    """Host indices of `pages` consecutive pages from `first_page`, as the controller passes them."""
    return torch.arange(first_page * page_size, (first_page + pages) * page_size, dtype=torch.int64)


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_set_exists_get_roundtrip_is_byte_identical(backends, kind: str, layout: str) -> None:
    backend = backends(kind, layout=layout, seed=1)
    pool = backend.mem_pool_host
    keys = page_keys(f"{kind}-{layout}", 5)
    src, dst = indices(0, 5), indices(8, 5)
    before = page_bytes(pool, src)
    assert page_bytes(pool, dst) != before  # random data differs: the load has to write it

    assert backend.batch_exists(keys) == 0
    assert backend.batch_set_v1(keys, src) == [True] * 5
    assert backend.batch_exists(keys) == 5
    assert backend.batch_get_v1(keys, dst) == [True] * 5
    assert page_bytes(pool, dst) == before
    assert page_bytes(pool, src) == before  # the store did not change its source

    counts = backend.counters()
    assert counts[Counters.PAGES_STORED] == 5
    assert counts[Counters.PAGES_LOADED] == 5
    assert counts[Counters.PAGES_FOUND] == 5
    assert counts[Counters.PAGES_MISSING] == 0
    segments = 2 if kind == "mha" else 1
    assert backend.mem_pool_host is pool and backend._pages is not None
    assert backend._pages.segments == segments
    assert sum(backend._pages.segment_bytes) * 5 == sum(len(b) for b in before)
    stats = backend.get_stats()  # SGLang's StorageMetrics, drained
    assert stats.backup_pgs == [5] and stats.prefetch_pgs == [5]
    assert backend.get_stats().backup_pgs == []


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_a_miss_is_false_and_zero(backends, kind: str) -> None:
    backend = backends(kind, seed=2)
    pool = backend.mem_pool_host
    stored, never = page_keys("stored", 4), page_keys("never", 3)
    assert backend.batch_set_v1(stored[:2], indices(0, 2)) == [True, True]

    assert backend.batch_exists(never) == 0
    assert not backend.exists(never[0])
    assert backend.batch_exists(stored) == 2  # consecutive hits from the start
    dst = indices(10, 3)
    untouched = page_bytes(pool, dst)
    assert backend.batch_get_v1(never, dst) == [False, False, False]
    assert page_bytes(pool, dst) == untouched
    # A stored page after a miss is not loaded: the controller uses only the leading run.
    assert backend.batch_get_v1([stored[0], never[0], stored[1]], dst) == [True, False, False]
    assert backend.get(never[0], pool.get_dummy_flat_data_page()) is None
    counts = backend.counters()
    assert counts[Counters.PAGES_MISSING] == 3 + 2 + 1
    assert counts[Counters.LOOKUP_FAILURES] == counts[Counters.LOAD_FAILURES] == 0


def test_batch_exists_is_answered_from_the_presence_index(backends, server: ServerThread) -> None:
    """Same host: batch_exists reads the server's presence index (docs/presence.md), no RPC; with the
    server's loop busy for 1 s it still answers at once (before: each call waited for the loop)."""
    backend = backends("mha", seed=3)
    stored, never = page_keys("stored-idx", 4), page_keys("never-idx", 2)
    assert backend.batch_set_v1(stored[:3], indices(0, 3)) == [True, True, True]
    assert backend.batch_exists(stored) == 3  # the index is mapped (Info) by now
    server.loop.call_soon_threadsafe(time.sleep, 1.0)
    time.sleep(0.05)
    start = time.monotonic()
    assert (backend.batch_exists(stored), backend.batch_exists(never), backend.batch_exists(stored[:1])) == (3, 0, 1)
    assert time.monotonic() - start < 0.3
    assert backend._client.presence.counters.local >= 4


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_generic_path_reads_and_writes_the_same_blocks(backends, kind: str) -> None:
    backend = backends(kind, seed=3)
    pool = backend.mem_pool_host
    keys = page_keys(f"generic-{kind}", 3)
    assert backend.batch_set_v1(keys[:2], indices(0, 2)) == [True, True]
    flat = [pool.get_dummy_flat_data_page() for _ in range(2)]
    assert backend.batch_get(keys[:2], flat) == flat  # SGLang's generic get into dummy pages
    assert [f.view(torch.uint8).numpy().tobytes() for f in flat] == page_bytes(pool, indices(0, 2))

    page = pool.get_data_page(int(indices(5, 1)[0]), flat=True)  # the generic set's flat page
    assert backend.batch_set([keys[2]], [page])
    assert backend.batch_get_v1([keys[2]], indices(12, 1)) == [True]
    assert page_bytes(pool, indices(12, 1)) == page_bytes(pool, indices(5, 1))
    assert backend.batch_set([keys[2]], [torch.zeros(3)]) is False  # not a page: refused, no I/O
    assert backend.counters()[Counters.BAD_REQUESTS] == 1


def ram_puts(client: KVCacheClient) -> int:
    return next(t.puts for t in client.stats().tiers if t.name == "ram")


def test_retain_ttl_s_makes_every_store_a_retained_put(backends, server: ServerThread) -> None:
    """A session that stays (issue #26), beneath SGLang: `retain_ttl_s` in the extra config retains
    every page the backend stores; without it none is; a bad value is refused when the backend loads."""
    with KVCacheClient(server.target) as client:

        def retained() -> int:
            return client.stats().tier("ram").retained_blocks

        assert backends("mha", seed=6).batch_set_v1(page_keys("plain", 3), indices(0, 3)) == [True] * 3
        assert retained() == 0
        kept = backends("mha", seed=7, retain_ttl_s="10m")
        assert kept.config.retain_ttl_s == 600.0
        assert kept.batch_set_v1(page_keys("kept", 3), indices(0, 3)) == [True] * 3
        assert retained() == 3 * kept._pages.segments  # every segment's block of every page
    for bad in (0, -5, "forever", True, float("nan")):
        with pytest.raises(ValueError, match="retain_ttl_s"):
            backends("mha", retain_ttl_s=bad)


def test_mla_two_ranks_write_once(backends, server: ServerThread) -> None:
    writer = backends("mla", seed=4, tp_rank=0, tp_size=2)
    replica = backends("mla", seed=5, tp_rank=1, tp_size=2)
    assert writer.storage_config.is_storage_writer and not replica.storage_config.is_storage_writer
    assert writer.namespace == replica.namespace  # MLA rows are the same on every rank
    keys = page_keys("mla-ranks", 4)
    with KVCacheClient(server.target) as client:
        puts = ram_puts(client)
        assert replica.batch_set_v1(keys, indices(0, 4)) == [True] * 4  # the replica sends nothing
        assert ram_puts(client) == puts
        assert replica.batch_exists(keys) == 0
        assert replica.counters()[Counters.REPLICA_PAGES_SKIPPED] == 4
        assert writer.batch_set_v1(keys, indices(0, 4)) == [True] * 4
        assert ram_puts(client) == puts + 4  # one block per MLA page, written once
    assert replica.batch_exists(keys) == 4
    assert replica.batch_get_v1(keys, indices(6, 4)) == [True] * 4
    assert page_bytes(replica.mem_pool_host, indices(6, 4)) == page_bytes(writer.mem_pool_host, indices(0, 4))
    other_tp = backends("mla", tp_rank=0, tp_size=4)  # another TP size reads the same rows
    assert other_tp.batch_exists(keys) == 4


def test_pages_never_shared_across_models_ranks_layouts_or_page_sizes(backends) -> None:
    base = backends("mha", seed=6)
    keys = page_keys("isolation", 2)
    assert base.batch_set_v1(keys, indices(0, 2)) == [True, True]
    others = {
        "model": backends("mha", model_name="another-model"),
        "tp rank": backends("mha", tp_rank=1, tp_size=2),
        "tp size": backends("mha", tp_rank=0, tp_size=2),
        "layout": backends("mha", layout="page_first_direct"),
        "page size": backends("mha", pool_args={"page_size": 8}),
        "dtype": backends("mha", pool_args={"dtype": torch.float16}),
        "heads": backends("mha", pool_args={"heads": 4}),
        "attention": backends("mla"),
        "extra": backends("mha", namespace_extra={"lora": "adapter-1"}),
        "revision": backends("mha", model_revision="abc123"),
    }
    names = {base.namespace.name} | {b.namespace.name for b in others.values()}
    assert len(names) == len(others) + 1
    for why, other in others.items():
        assert other.batch_exists(keys) == 0, why
    again = backends("mha", seed=7)  # same model and layout: shares
    assert again.namespace == base.namespace and again.batch_exists(keys) == 2


def test_config_is_parsed_once_and_refuses_what_it_does_not_know(server: ServerThread) -> None:
    config = HiCacheBackendConfig.from_extra_config(
        {"backend_name": "kvcache", "module_path": "m", "class_name": "C", "interface_v1": 1, "target": "h:1"}
    )
    assert config.interface_v1 and config.target == "h:1" and config.timeout_s == 5.0
    with pytest.raises(ValueError, match="unknown kvcache HiCache option"):
        HiCacheBackendConfig.from_extra_config({"target": "h:1", "timeout": 3})
    with pytest.raises(ValueError, match="target"):
        HiCacheBackendConfig.from_extra_config({"interface_v1": 1})
    with pytest.raises(ValueError, match="timeout_s"):
        HiCacheBackendConfig.from_extra_config({"target": "h:1", "timeout_s": 0})
    with pytest.raises(ValueError, match="page-first host layout"):
        load_backend(
            storage_config(extra_config_json(server.target), is_mla=False, layout="layer_first"),
            mha_host_pool(layout="layer_first"),
        )
