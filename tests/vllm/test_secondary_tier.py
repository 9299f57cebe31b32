"""kvcache as a vLLM 0.33 secondary tier (kvcache_connectors.vllm_tier) against vLLM's real classes and a real server.

The tier is loaded the way vLLM loads an out-of-tree tier (`type` + `module_path`, vLLM's
SecondaryTierFactory) and driven through the SecondaryTierManager interface, then through
vLLM's own TieringOffloadingManager over its CPU primary tier (tests/vllm/tier_harness.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from vllm.v1.kv_offload.base import LookupResult, Medium, OffloadKey, ReqContext, make_offload_key
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager, TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvcache_client import KVCacheClient
from kvcache_connectors.vllm_tier import KVCacheTier, TierMetrics
from tests.backends import sigstop
from tests.vllm.harness import BLOCK, hybrid_kv_cache_config
from tests.vllm.tier_harness import (
    END_STEP,
    Instance,
    block_hash,
    finished,
    offload_keys,
    offloading_config,
    tier_entry,
)

ROWS = 8


class Tier:
    """A KVCacheTier built by vLLM's factory over a primary buffer of real tensor bytes."""

    def __init__(
        self, model_dir: str, entry: dict[str, Any], *, kv_events: bool = False, kv_cache_config: Any = None
    ) -> None:
        config = offloading_config(model_dir, entry, kv_events=kv_events, kv_cache_config=kv_cache_config)
        self.chunk_bytes = config.worker_kv_bytes_per_block * config.cache.blocks_per_chunk
        self.buffer = torch.zeros(ROWS, self.chunk_bytes, dtype=torch.uint8)
        spec = OffloadingSpecFactory.create_spec(config)
        tier = SecondaryTierFactory.create_secondary_tier(entry, memoryview(self.buffer.numpy()), spec)
        assert isinstance(tier, KVCacheTier)
        self.tier = tier
        self._job_id = 0

    def job(self, keys: list[OffloadKey], rows: list[int], *, load: bool, req: str = "r") -> TransferJob:
        self._job_id += 1
        return TransferJob(self._job_id, keys, torch.tensor(rows, dtype=torch.int32).numpy(), load, ReqContext(req))

    def lookup(self, key: OffloadKey, req: str, timeout_s: float = 10.0) -> LookupResult:
        """The tier's lookup, with on_schedule_end between tries (vLLM flushes the batch there)."""
        ctx = ReqContext(req)
        deadline = time.monotonic() + timeout_s
        while (result := self.tier.lookup(key, ctx)) is LookupResult.RETRY:
            assert time.monotonic() < deadline, "lookup stayed RETRY"
            self.tier.on_schedule_end(END_STEP)
            time.sleep(0.005)
        return result

    def counters(self) -> dict[str, int]:
        stats = self.tier.get_stats()
        return {} if stats is None else {k: int(v) for k, v in stats.reduce().items()}


def chunks(n: int, seed: int, nbytes: int) -> list[torch.Tensor]:
    """Real KV-like tensors (float16 values) as the raw bytes of one chunk each."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(nbytes // 2, generator=gen, dtype=torch.float32).half().view(torch.uint8) for _ in range(n)]


@pytest.fixture
def tiers(model_dir: str) -> Iterator[list[Tier]]:
    built: list[Tier] = []
    yield built
    for t in built:
        t.tier.shutdown()


@pytest.mark.timeout(60)
def test_store_lookup_load_round_trip_through_the_interface(model_dir, server, tiers) -> None:
    """Stores from one tier's buffer, loads into another's (a second engine): byte-identical; misses are misses."""
    entry = tier_entry(server.target, enable_kv_events=True)
    writer = Tier(model_dir, entry, kv_events=True)
    reader = Tier(model_dir, entry)
    tiers += [writer, reader]
    assert isinstance(writer.tier, SecondaryTierManager)
    assert KVCacheTier.medium is Medium.STORAGE
    assert KVCacheTier.cache_hit_source is CacheHitSource.EXTERNAL_UNSPECIFIED
    assert writer.tier.namespace.name == reader.tier.namespace.name  # same model and layout: shared

    keys = offload_keys(4)
    data = chunks(4, seed=1, nbytes=writer.chunk_bytes)
    for row, chunk in zip([1, 3, 5, 7], data, strict=True):
        writer.buffer[row].copy_(chunk)
    writer.tier.submit_store(writer.job(keys, [1, 3, 5, 7], load=False))
    assert writer.tier.has_pending_work()
    (stored,) = finished(writer.tier, 1, timeout_s=10)
    assert stored.success and stored.transfer_bytes == 4 * writer.chunk_bytes
    assert not writer.tier.has_pending_work()
    (event,) = list(writer.tier.take_events())
    assert event.keys == keys and event.medium is Medium.STORAGE and not event.removed
    assert list(writer.tier.take_events()) == []

    assert [reader.lookup(k, "a") for k in keys] == [LookupResult.HIT] * 4
    missing = offload_keys(2, prompt=9)
    assert [reader.lookup(k, "b") for k in missing] == [LookupResult.MISS] * 2

    reader.buffer.fill_(0xEE)
    reader.tier.submit_load(reader.job(keys, [0, 2, 4, 6], load=True))
    (loaded,) = finished(reader.tier, 1, timeout_s=10)
    assert loaded.success and loaded.successful_keys is None
    for row, chunk in zip([0, 2, 4, 6], data, strict=True):
        assert torch.equal(reader.buffer[row], chunk)
    assert bool((reader.buffer[[1, 3, 5, 7]] == 0xEE).all())  # rows not asked for are untouched

    # A load of one stored and one missing chunk: the stored one loads, the missing one is reported.
    reader.buffer.fill_(0xEE)
    reader.tier.submit_load(reader.job([keys[0], missing[0]], [0, 1], load=True, req="c"))
    (partial,) = finished(reader.tier, 1, timeout_s=10)
    assert not partial.success and list(partial.successful_keys) == [keys[0]]
    assert torch.equal(reader.buffer[0], data[0]) and bool((reader.buffer[1] == 0xEE).all())

    assert writer.counters() == {TierMetrics.STORED_CHUNKS: 4}
    assert reader.counters() == {
        TierMetrics.LOADED_CHUNKS: 5,
        TierMetrics.LOAD_FAILED_JOBS: 1,
        TierMetrics.LOAD_MISSING_CHUNKS: 1,
    }
    assert set(KVCacheTier.build_metric_definitions({})) == set(TierMetrics.DOCS)
    info = dict(reader.tier.config_info())
    assert info == {"kvcache_target": server.target, "kvcache_namespace": reader.tier.namespace.name}


@pytest.mark.timeout(60)
def test_retain_ttl_s_makes_every_store_a_retained_put(model_dir, server, tiers) -> None:
    """A session that stays (issue #26), beneath vLLM's offloading manager: `retain_ttl_s` in the
    tier's entry retains every chunk it stores; without it none is; a bad value is refused at start-up."""
    plain = Tier(model_dir, tier_entry(server.target))
    kept = Tier(model_dir, tier_entry(server.target, retain_ttl_s=900))
    tiers += [plain, kept]
    with KVCacheClient(server.target) as probe:
        plain.tier.submit_store(plain.job(offload_keys(2, prompt=20), [0, 1], load=False))
        assert finished(plain.tier, 1, timeout_s=10)[0].success
        assert probe.stats().tier("ram").retained_blocks == 0
        kept.tier.submit_store(kept.job(offload_keys(3, prompt=21), [0, 1, 2], load=False))
        assert finished(kept.tier, 1, timeout_s=10)[0].success
        assert probe.stats().tier("ram").retained_blocks == 3
    with pytest.raises(ValueError, match="retain_ttl_s"):
        Tier(model_dir, tier_entry(server.target, retain_ttl_s=-1))


@pytest.mark.timeout(60)
def test_layouts_and_models_never_share_bytes(model_dir, tmp_path, server, tiers) -> None:
    """Another chunk size, another model directory or another namespace_extra: other namespaces, misses."""
    from tests.vllm.harness import write_model_dir

    base = Tier(model_dir, tier_entry(server.target))
    tiers.append(base)
    keys = offload_keys(1)
    base.buffer[0].copy_(chunks(1, seed=2, nbytes=base.chunk_bytes)[0])
    base.tier.submit_store(base.job(keys, [0], load=False))
    assert finished(base.tier, 1, timeout_s=10)[0].success

    other_model = Tier(write_model_dir(tmp_path / "other"), tier_entry(server.target))
    other_extra = Tier(model_dir, tier_entry(server.target, namespace_extra={"lora": "sql"}))
    tiers += [other_model, other_extra]
    names = {t.tier.namespace.name for t in (base, other_model, other_extra)}
    assert len(names) == 3
    for t in (other_model, other_extra):
        assert t.lookup(keys[0], "x") is LookupResult.MISS
        assert t.tier.namespace.key(keys[0]) != base.tier.namespace.key(keys[0])


@pytest.mark.timeout(60)
def test_vllm_factory_loads_the_tier_from_type_and_module_path(model_dir, server) -> None:
    """vLLM's TieringOffloadingSpec builds the tier from the config entry alone, options parsed."""
    entry = tier_entry(server.target, timeout_s=2.5, model_revision="abc")
    assert SecondaryTierFactory.get_tier_class(entry) is KVCacheTier
    instance = Instance.build(model_dir, entry)
    try:
        assert instance.tier.config.timeout_s == 2.5 and instance.tier.config.model_revision == "abc"
        assert instance.tier.tier_type == "KVCacheTier"
    finally:
        instance.close()
    with pytest.raises(ValueError, match="unknown kvcache tier option"):
        Instance.build(model_dir, tier_entry(server.target, timeout=1))


@pytest.mark.timeout(90)
def test_a_stopped_server_makes_failures_and_misses_never_wrong_bytes(model_dir, make_server, tiers) -> None:
    """The server stops after a store and a HIT: the load fails through JobResult, in bounded time,
    its rows untouched; new lookups are misses; stores fail; drain and shutdown return."""
    server = make_server(ram={"capacity_bytes": 64 << 20})
    t = Tier(model_dir, tier_entry(server.target, timeout_s=1.0, lookup_timeout_s=0.5))
    tiers.append(t)
    keys = offload_keys(3)
    data = chunks(3, seed=3, nbytes=t.chunk_bytes)
    for row, chunk in enumerate(data):
        t.buffer[row].copy_(chunk)
    t.tier.submit_store(t.job(keys, [0, 1, 2], load=False))
    assert finished(t.tier, 1, timeout_s=10)[0].success
    assert [t.lookup(k, "hit") for k in keys] == [LookupResult.HIT] * 3

    server.stop()
    t.buffer[3:].fill_(0xEE)
    started = time.monotonic()
    t.tier.submit_load(t.job(keys, [3, 4, 5], load=True, req="hit"))
    (failed,) = finished(t.tier, 1, timeout_s=10)
    assert time.monotonic() - started < 5.0
    assert not failed.success and not failed.successful_keys
    assert bool((t.buffer[3:] == 0xEE).all())  # nothing written into the promoted rows
    # The failed keys' cached HITs are misses now: vLLM will not promote them again.
    assert [t.tier.lookup(k, ReqContext("hit")) for k in keys] == [LookupResult.MISS] * 3

    assert t.lookup(offload_keys(1, prompt=5)[0], "new", timeout_s=10) is LookupResult.MISS
    t.tier.submit_store(t.job(keys, [0, 1, 2], load=False, req="s"))
    (store,) = finished(t.tier, 1, timeout_s=10)
    assert not store.success
    t.tier.drain_jobs()
    assert not t.tier.has_pending_work()
    assert t.counters() == {
        TierMetrics.STORED_CHUNKS: 3,
        TierMetrics.LOAD_FAILED_JOBS: 1,
        TierMetrics.LOAD_MISSING_CHUNKS: 3,
        TierMetrics.LOOKUP_FAILURES: 1,
        TierMetrics.STORE_FAILED_JOBS: 1,
    }


@pytest.mark.timeout(90)
def test_one_instance_stores_another_loads_from_kvcache_alone(model_dir, server) -> None:
    """vLLM's TieringOffloadingManager: instance A's CPU tier cascades a prompt's chunks to kvcache;
    instance B (its own, empty CPU tier) finds them only in kvcache, promotes them into its CPU
    tier and reads back A's exact bytes; a prompt nobody stored is a miss in both tiers."""
    entry = tier_entry(server.target)
    a = Instance.build(model_dir, entry)
    b = Instance.build(model_dir, entry)
    try:
        keys = offload_keys(6, prompt=1)
        data = chunks(6, seed=4, nbytes=a.rows.shape[1])
        ctx_a = ReqContext("a")
        a.manager.on_new_request(ctx_a)
        a.store(ctx_a, keys, data)
        a.settle()
        a.manager.on_request_finished(ctx_a)
        with KVCacheClient(server.target) as client:
            assert client.lookup(a.tier.namespace.name, a.tier.namespace.keys(keys)).prefix_length == 6

        ctx_b = ReqContext("b")
        b.manager.on_new_request(ctx_b)
        assert all(b.manager.primary_tier.lookup(k, ctx_b) is LookupResult.MISS for k in keys)  # B's CPU tier: empty
        assert [b.lookup(ctx_b, k) for k in keys] == [LookupResult.HIT] * 6
        got = b.loaded_rows(ctx_b, keys)
        assert all(torch.equal(x, y) for x, y in zip(got, data, strict=True))
        assert b.lookup(ctx_b, offload_keys(1, prompt=2)[0]) is LookupResult.MISS
        b.settle()
        b.manager.on_request_finished(ctx_b)
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(60)
def test_checkpoints_that_differ_outside_the_offloading_config_never_share_bytes(
    model_dir, server, tiers, monkeypatch
) -> None:
    """The revision, the quantization and hf_overrides are not in vLLM's OffloadingConfig, yet change
    the K/V of the same tokens (and the key-bound checksum would pass): the tier reads them from the
    engine's current vLLM config, so each gives another namespace; a tier built without an engine's
    config never shares one with a tier built under it. (Found in review: they shared namespace and keys.)"""
    import types

    import vllm.config.vllm as vllm_config_module

    def built_under(**model: object) -> str:
        fake = types.SimpleNamespace(model_config=types.SimpleNamespace(**model))  # what the tier reads
        monkeypatch.setattr(vllm_config_module, "_current_vllm_config", fake)
        t = Tier(model_dir, tier_entry(server.target))
        tiers.append(t)
        return t.tier.namespace.name

    base = {"revision": "main", "quantization": None, "hf_overrides": {}}
    names = [
        built_under(**base),
        built_under(**{**base, "revision": "v2"}),
        built_under(**{**base, "quantization": "fp8"}),
        built_under(**{**base, "hf_overrides": {"rope_theta": 1e6}}),
    ]
    monkeypatch.setattr(vllm_config_module, "_current_vllm_config", None)
    no_engine = Tier(model_dir, tier_entry(server.target))
    tiers.append(no_engine)
    names.append(no_engine.tier.namespace.name)
    assert len(set(names)) == 5, names
    assert built_under(**base) == names[0]  # the same facts, the same namespace


@pytest.mark.timeout(60)
def test_a_hung_server_costs_one_timeout_per_cooldown_not_one_per_job(model_dir, tiers) -> None:
    """A real server process SIGSTOPped (it accepts connections, answers nothing): of 5 loads queued
    at once, the first waits out its 1 s deadline and opens the breaker, the other 4 fail without a
    call, and the lookups that follow are misses without one (found in review: each load retried up
    to its deadline, so 64 queued jobs kept drain_jobs and shutdown for 64 x 5 s)."""
    import os
    import signal

    from kvcache_server.launcher import LocalKVCacheServer

    with LocalKVCacheServer("--ram-capacity", "64MiB") as server:
        t = Tier(model_dir, tier_entry(server.target, timeout_s=1.0, lookup_timeout_s=0.5, breaker_cooldown_s=60))
        tiers.append(t)
        assert t.lookup(offload_keys(1, prompt=7)[0], "warm") is LookupResult.MISS  # connected, answering
        pid = server.proc.pid
        sigstop(pid)
        try:
            for i in range(5):
                t.tier.submit_load(t.job(offload_keys(1, prompt=10 + i), [i], load=True, req=f"l{i}"))
            results = finished(t.tier, 5, timeout_s=30)
            assert [r.success for r in results] == [False] * 5
            assert t.tier._breaker.skipped == 4
            assert t.lookup(offload_keys(1, prompt=20)[0], "after") is LookupResult.MISS
            assert t.tier._breaker.skipped == 5
            t.tier.drain_jobs()
            assert t.counters()[TierMetrics.LOAD_FAILED_JOBS] == 5
        finally:
            os.kill(pid, signal.SIGCONT)


@pytest.mark.timeout(60)
def test_hybrid_groups_full_and_sliding_window_through_the_tier(model_dir, server, tiers) -> None:
    """A hybrid model (full attention + sliding window, vLLM's own group configs): one namespace for
    both groups, keys never shared between groups, and a sliding-window group's chunks past a miss
    (its early chunks fell out of the window and were never stored) are found one by one, where a
    full-attention group stops at its first miss."""
    hybrid = hybrid_kv_cache_config(64, window=2 * BLOCK)
    entry = tier_entry(server.target)
    t = Tier(model_dir, entry, kv_cache_config=hybrid)
    tiers.append(t)
    assert t.tier._sliding_groups == frozenset({1})  # from vLLM's own OffloadingConfig
    full = [make_offload_key(block_hash(i), 0) for i in range(4)]
    sliding = [make_offload_key(block_hash(i), 1) for i in range(4)]
    assert len(set(t.tier.namespace.keys(full + sliding))) == 8  # same hash, two groups: two keys
    data = chunks(4, seed=5, nbytes=t.chunk_bytes)
    # The full group stores chunks 0, 1 and 3; the sliding group only its in-window tail, 2 and 3.
    stored = [full[0], full[1], full[3], sliding[2], sliding[3]]
    rows = [0, 1, 3, 4, 5]
    for row, key in zip(rows, stored, strict=True):
        t.buffer[row].copy_(data[(full + sliding).index(key) % 4])
    t.tier.submit_store(t.job(stored, rows, load=False))
    (done,) = finished(t.tier, 1, timeout_s=10)
    assert done.success
    hits = t.tier.lookup_batch(full + sliding, ReqContext("h"))
    # Full attention: the prefix 0, 1 (3 is past the miss at 2); sliding: 2 and 3 past the misses at 0, 1.
    assert hits == [True, True, False, False, False, False, True, True]
    t.buffer.fill_(0)
    t.tier.submit_load(t.job([sliding[2], sliding[3]], [6, 7], load=True, req="h"))
    (loaded,) = finished(t.tier, 1, timeout_s=10)
    assert loaded.success
    assert torch.equal(t.buffer[6], data[2]) and torch.equal(t.buffer[7], data[3])


@pytest.mark.timeout(60)
def test_a_job_deadline_grows_with_its_bytes(model_dir, server, tiers) -> None:
    """timeout_s is the deadline of a job's call plus its bytes at min_rate_bytes_s: a large job is
    not failed by a deadline sized for a small one, and a small one still fails fast."""
    t = Tier(model_dir, tier_entry(server.target, timeout_s=0.5, min_rate_bytes_s=1 << 20))
    tiers.append(t)
    assert t.tier._job_timeout_s(0) == 0.5
    assert t.tier._job_timeout_s(4 << 20) == pytest.approx(4.5)
    with pytest.raises(ValueError, match="min_rate_bytes_s"):
        Tier(model_dir, tier_entry(server.target, min_rate_bytes_s=0))
