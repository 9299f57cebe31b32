"""The worker-side connector on real paged tensors of every supported backend: save, load elsewhere, compare bits.

Each case builds the per-layer tensors the way vLLM 0.33's model runner does
(allocate_kv_cache, in a physical layout the backend accepts), names the layer's
attention backend in the static forward context as vLLM does, and reads one token
back through that backend's own K/V split, reproduced from its source (the backends'
forward passes need kernels, not available on CPU). A producer worker saves a
request's blocks, a consumer worker loads them into different block ids of its own
cache, and every value must arrive bit for bit, with every other slot untouched.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend
from vllm.v1.attention.backends.mla.flashmla import FlashMLABackend
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
from vllm.v1.attention.backends.triton_attn_diffkv import TritonAttentionDiffKVBackend
from vllm.v1.kv_cache_interface import KVCacheConfig, MLAAttentionSpec
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvcache_client import KVCacheClient, Namespace, chunk_keys, encode_block
from kvcache_connectors.vllm import ChunkRef, KVCacheConnector, KVCacheConnectorMetadata, RequestTransfer
from kvcache_connectors.vllm.layout import PagedKind
from kvcache_core.format import Layout
from kvcache_core.keys import MLA_LAYOUT
from tests.vllm.harness import (
    BLOCK,
    CHUNK,
    HEAD,
    KV_HEADS,
    LAYER_NAMES,
    NUM_LAYERS,
    StandInAttention,
    allocate_caches,
    attention_spec,
    bitwise_equal,
    make_kv_cache_config,
    make_vllm_config,
    make_worker,
)

pytestmark = pytest.mark.timeout(60)

NUM_BLOCKS = 16
TOKENS = list(range(300, 370))  # 70 tokens: chunks of 32, 32 and a 6-token tail; 5 blocks
SRC_BLOCKS = (9, 3, 14, 0, 7)
DST_BLOCKS = (2, 11, 5, 8, 13)
MLA_HEAD = 24

Caches = dict[str, torch.Tensor]


def kernel_entry(cache: torch.Tensor, block: int, offset: int) -> tuple[int, int]:
    """(entry, offset) in a [blocks * bs/kbs, H, kbs, C] tensor whose blocks vLLM split for the kernel."""
    kbs = cache.shape[2]
    return block * (BLOCK // kbs) + offset // kbs, offset % kbs


def split_packed(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches [blocks, kbs, H, D] exactly as FlashAttention (and Triton) split them:
    vllm/v1/attention/backends/flash_attn.py FlashAttentionImpl.forward,
    `key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)`."""
    key_cache, value_cache = cache.transpose(1, 2).split(HEAD, dim=-1)
    return key_cache, value_cache


def split_cpu(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches [blocks, H, kbs, D] exactly as CPU attention splits them:
    vllm/v1/attention/backends/cpu_attn.py CPUAttentionBackendImpl.do_kv_cache_update (and forward),
    `kv_cache.view((num_blocks, num_kv_heads, block_size * 2, -1))` then `.chunk(2, dim=2)`."""
    num_blocks, num_kv_heads, block_size, _ = cache.size()
    return cache.view((num_blocks, num_kv_heads, block_size * 2, -1)).chunk(2, dim=2)


def read_packed(cache: torch.Tensor, block: int, offset: int) -> torch.Tensor:
    entry, o = kernel_entry(cache, block, offset)
    key_cache, value_cache = split_packed(cache)
    return torch.stack([key_cache[entry, o], value_cache[entry, o]])


def read_cpu(cache: torch.Tensor, block: int, offset: int) -> torch.Tensor:
    entry, o = kernel_entry(cache, block, offset)
    key_cache, value_cache = split_cpu(cache)
    return torch.stack([key_cache[entry, :, o], value_cache[entry, :, o]])


def read_mla(cache: torch.Tensor, block: int, offset: int) -> torch.Tensor:
    # model_executor/layers/attention/mla_attention.py MLAAttention.bind_kv_cache: `kv_cache.squeeze(1)`.
    entry, o = kernel_entry(cache, block, offset)
    return cache.squeeze(1)[entry, o]


@dataclass(frozen=True)
class Case:
    """A backend's paged layout: its tensors, and how it reads one token ([2, H, D], MLA: [D])."""

    name: str
    backend: type
    layout: KVCacheLayout
    read: Callable[[torch.Tensor, int, int], torch.Tensor]
    kernel_block_size: int = BLOCK

    @property
    def mla(self) -> bool:
        return self.read is read_mla

    @property
    def kv_cache_config(self) -> KVCacheConfig:
        spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=MLA_HEAD, dtype=torch.bfloat16)
        return make_kv_cache_config(NUM_BLOCKS, spec if self.mla else attention_spec(), self.layout)

    def make(self, config: KVCacheConfig) -> Caches:
        return allocate_caches(config, self.layout, self.kernel_block_size)


CASES = [
    Case("FLASH_ATTN-LBNHC", FlashAttentionBackend, KVCacheLayout.LBNHC, read_packed),
    Case("FLASH_ATTN-LBHNC", FlashAttentionBackend, KVCacheLayout.LBHNC, read_packed),
    Case("FLASH_ATTN-BLNHC", FlashAttentionBackend, KVCacheLayout.BLNHC, read_packed),
    Case("FLASH_ATTN-LBNHC-kernel-block-8", FlashAttentionBackend, KVCacheLayout.LBNHC, read_packed, 8),
    Case("TRITON_ATTN-LBNHC", TritonAttentionBackend, KVCacheLayout.LBNHC, read_packed),
    # The CPU backend accepts only LBHNC (CPUAttentionBackend.supported_kv_cache_layouts).
    Case("CPU_ATTN-LBHNC", CPUAttentionBackend, KVCacheLayout.LBHNC, read_cpu),
    Case("CPU_ATTN-LBHNC-kernel-block-8", CPUAttentionBackend, KVCacheLayout.LBHNC, read_cpu, 8),
    Case("FLASHMLA-LBNHC", FlashMLABackend, KVCacheLayout.LBNHC, read_mla),
    Case("FLASHMLA-LBHNC-kernel-block-8", FlashMLABackend, KVCacheLayout.LBHNC, read_mla, 8),
    Case("CPU_MLA-LBHNC", CPUMLABackend, KVCacheLayout.LBHNC, read_mla),
]
CASE = {case.name: case for case in CASES}


def name_backend(vllm_config, backend: type) -> None:
    """Names each layer's attention backend where vLLM does: the static forward context."""
    context = vllm_config.compilation_config.static_forward_context
    context.update({name: StandInAttention(backend) for name in LAYER_NAMES})


def namespace_for(case: Case, model_dir: str) -> Namespace:
    if case.mla:
        return Namespace(
            model_id=model_dir,
            kv_dtype="bfloat16",
            chunk_tokens=CHUNK,
            num_layers=NUM_LAYERS,
            num_kv_heads=1,
            head_size=MLA_HEAD,
            layout=MLA_LAYOUT,
        )
    return Namespace(
        model_id=model_dir,
        kv_dtype="float16",
        chunk_tokens=CHUNK,
        num_layers=NUM_LAYERS,
        num_kv_heads=KV_HEADS,
        head_size=HEAD,
    )


def fill_random(caches: Caches, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for cache in caches.values():
        cache.copy_(torch.randn(cache.shape, generator=generator).to(cache.dtype))


def transfer(keys: list[bytes], namespace: Namespace, blocks: tuple[int, ...], end: int) -> RequestTransfer:
    """The request's chunks covering tokens [0, end) of TOKENS."""
    chunks = tuple(
        ChunkRef(
            index=i,
            keys=(key,),
            num_tokens=min(CHUNK, len(TOKENS) - i * CHUNK),
            start=i * CHUNK,
            end=min(end, (i + 1) * CHUNK, len(TOKENS)),
        )
        for i, key in enumerate(keys)
        if i * CHUNK < end
    )
    return RequestTransfer("r", (namespace.name,), blocks, chunks)


@dataclass
class Pair:
    """A producer worker with a random cache and a consumer worker with an empty one, same layout."""

    case: Case
    namespace: Namespace
    keys: list[bytes]
    src: KVCacheConnector
    dst: KVCacheConnector
    src_caches: Caches
    dst_caches: Caches

    def token(self, caches: Caches, block: int, offset: int) -> torch.Tensor:
        """One token's KV over all layers: [L, 2, H, D] (MLA: [L, D])."""
        return torch.stack([self.case.read(caches[name], block, offset) for name in LAYER_NAMES])

    def source(self, position: int) -> torch.Tensor:
        return self.token(self.src_caches, SRC_BLOCKS[position // BLOCK], position % BLOCK)

    def loaded(self, position: int) -> torch.Tensor:
        return self.token(self.dst_caches, DST_BLOCKS[position // BLOCK], position % BLOCK)

    def save(self) -> None:
        run_step(self.src, KVCacheConnectorMetadata(saves=(transfer(self.keys, self.namespace, SRC_BLOCKS, 70),)))

    def load(self, end: int = 69) -> set[int]:
        """Loads tokens [0, end) into DST_BLOCKS; returns the block ids reported as failed."""
        meta = KVCacheConnectorMetadata(loads=(transfer(self.keys, self.namespace, DST_BLOCKS, end),))
        return run_step(self.dst, meta)

    def untouched_elsewhere(self, loaded_positions: range) -> bool:
        """Whether every destination token slot but the loaded tokens' still holds zeros."""
        loaded = {(DST_BLOCKS[p // BLOCK], p % BLOCK) for p in loaded_positions}
        return not any(
            self.token(self.dst_caches, block, offset).view(torch.uint8).any()
            for block in range(NUM_BLOCKS)
            for offset in range(BLOCK)
            if (block, offset) not in loaded
        )


def run_step(worker: KVCacheConnector, meta: KVCacheConnectorMetadata) -> set[int]:
    """One step of a worker's connector calls (model runner order), with no model."""
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    worker_side = worker._worker
    assert worker_side is not None and worker_side.wait_idle(10)  # loads and puts run on background threads
    worker.get_finished(set())
    errors = worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    return errors


def make_pair(case: Case, model_dir: str, target: str, **extra: object) -> Pair:
    config = case.kv_cache_config
    vllm_config = make_vllm_config(model_dir, extra={"target": target, **extra})
    name_backend(vllm_config, case.backend)
    src, dst = make_worker(vllm_config, config), make_worker(vllm_config, config)
    src_caches, dst_caches = case.make(config), case.make(config)
    fill_random(src_caches, seed=7)
    src.register_kv_caches(src_caches)
    dst.register_kv_caches(dst_caches)
    namespace = namespace_for(case, model_dir)
    return Pair(case, namespace, chunk_keys(TOKENS, namespace), src, dst, src_caches, dst_caches)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_saved_blocks_load_bit_for_bit_into_other_blocks(case: Case, model_dir: str, server) -> None:
    pair = make_pair(case, model_dir, server.target)
    pair.save()

    # The server holds the canonical layout (docs/format.md), whatever the paged one was.
    token_dim = 1 if case.mla else 3
    with KVCacheClient(server.target, timeout_s=5) as client:
        blocks = client.get_many(pair.namespace, pair.keys)
        stored = client.get_tensors(pair.namespace, pair.keys)
    for i, (block, tensor) in enumerate(zip(blocks, stored, strict=True)):
        assert block is not None and tensor is not None
        assert block[9] == (Layout.MLA if case.mla else Layout.CANONICAL)
        expected = torch.stack([pair.source(p) for p in range(i * CHUNK, min((i + 1) * CHUNK, 70))], dim=token_dim)
        assert bitwise_equal(tensor, expected), f"chunk {i}"

    assert pair.load() == set()
    for p in range(69):  # all but the last token: the tail chunk is loaded in part
        assert bitwise_equal(pair.loaded(p), pair.source(p)), f"token {p}"
    assert pair.untouched_elsewhere(range(69))
    stats = pair.dst.get_kv_connector_stats()
    assert stats is not None and (stats.data["load_chunks"], stats.data.get("load_failures", 0)) == (3, 0)


@pytest.mark.parametrize("kernel_block_size", [BLOCK, 8])
def test_cpu_attention_keys_and_values_written_its_way_are_stored_and_loaded_exactly(
    kernel_block_size: int, model_dir: str, server
) -> None:
    # K and V written through the CPU backend's own split, as its cpu_attn_reshape_and_cache does.
    case = CASE["CPU_ATTN-LBHNC" if kernel_block_size == BLOCK else "CPU_ATTN-LBHNC-kernel-block-8"]
    pair = make_pair(case, model_dir, server.target)
    known = torch.randn((NUM_LAYERS, len(TOKENS), 2, KV_HEADS, HEAD), generator=torch.Generator().manual_seed(3))
    known = known.to(torch.float16)
    for layer, name in enumerate(LAYER_NAMES):
        cache = pair.src_caches[name]
        cache.zero_()
        key_cache, value_cache = split_cpu(cache)
        for p in range(len(TOKENS)):
            entry, o = kernel_entry(cache, SRC_BLOCKS[p // BLOCK], p % BLOCK)
            key_cache[entry, :, o] = known[layer, p, 0]
            value_cache[entry, :, o] = known[layer, p, 1]
    pair.save()

    with KVCacheClient(server.target, timeout_s=5) as client:
        stored = client.get_tensors(pair.namespace, pair.keys)
    for i, tensor in enumerate(stored):
        expected = known[:, i * CHUNK : (i + 1) * CHUNK].permute(0, 2, 3, 1, 4)  # [L, 2, H, T, D]
        assert tensor is not None and bitwise_equal(tensor, expected), f"chunk {i}"

    # All but the last token: block 4 (tokens 64..69) is loaded in part, offsets 0..4.
    assert pair.load() == set()
    for layer, name in enumerate(LAYER_NAMES):
        cache = pair.dst_caches[name]
        key_cache, value_cache = split_cpu(cache)
        for block in range(NUM_BLOCKS):
            for offset in range(BLOCK):
                entry, o = kernel_entry(cache, block, offset)
                kv = torch.stack([key_cache[entry, :, o], value_cache[entry, :, o]])
                position = DST_BLOCKS.index(block) * BLOCK + offset if block in DST_BLOCKS else None
                if position is not None and position < 69:
                    assert bitwise_equal(kv, known[layer, position]), (layer, position)
                else:
                    assert not kv.view(torch.uint8).any(), (layer, block, offset)


def corrupt(server, namespace: Namespace, key: bytes) -> None:
    ram = server.stack.ram
    (block,) = ram.get_many_sync(namespace.name, [key])
    damaged = bytearray(block)
    damaged[len(damaged) // 2] ^= 0x80
    ram.put_many_sync(namespace.name, [(key, bytes(damaged))])


@pytest.mark.parametrize("case", [CASES[0], CASE["CPU_ATTN-LBHNC"], CASE["FLASHMLA-LBNHC"]], ids=lambda c: c.name)
def test_corrupt_chunk_fails_its_blocks_and_every_later_block(case: Case, model_dir: str, server) -> None:
    pair = make_pair(case, model_dir, server.target)
    pair.save()
    corrupt(server, pair.namespace, pair.keys[1])

    # Chunk 1 covers tokens 32..63 (blocks 2, 3); chunk 2 (block 4) is intact but comes after it.
    assert pair.load() == set(DST_BLOCKS[2:5])
    for p in range(32):
        assert bitwise_equal(pair.loaded(p), pair.source(p))
    assert pair.untouched_elsewhere(range(32))
    assert pair.dst._client.corrupt_blocks == 1
    stats = pair.dst.get_kv_connector_stats()
    assert stats is not None and (stats.data["load_chunks"], stats.data["load_failures"]) == (1, 2)


def test_missing_chunk_fails_only_its_own_blocks(model_dir: str, server) -> None:
    pair = make_pair(CASES[1], model_dir, server.target)
    pair.save()
    with KVCacheClient(server.target, timeout_s=5) as client:
        assert client.delete(pair.namespace, [pair.keys[2]]) == 1

    assert pair.load() == {DST_BLOCKS[4]}
    for p in range(64):
        assert bitwise_equal(pair.loaded(p), pair.source(p))
    assert pair.untouched_elsewhere(range(64))


@pytest.mark.parametrize(
    ("shape", "layout"),
    [
        ((NUM_LAYERS, 2, KV_HEADS, CHUNK, HEAD), Layout.CANONICAL),  # a full chunk where the tail belongs
        ((NUM_LAYERS, 2, KV_HEADS, 6, HEAD), Layout.RAW),  # right shape, no layout claim
        ((NUM_LAYERS, 2, 1, 12, HEAD), Layout.CANONICAL),  # same bytes, wrong heads
    ],
    ids=["wrong-tokens", "wrong-layout", "wrong-heads"],
)
def test_valid_block_of_the_wrong_shape_is_refused(shape, layout, model_dir: str, server) -> None:
    pair = make_pair(CASES[0], model_dir, server.target)
    pair.save()
    payload = bytes(2 * torch.Size(shape).numel())
    with KVCacheClient(server.target, timeout_s=5) as client:
        client.put_many(
            pair.namespace,
            [(pair.keys[2], encode_block(payload, key=pair.keys[2], dtype="float16", shape=shape, layout=layout))],
        )

    assert pair.load() == {DST_BLOCKS[4]}
    assert pair.untouched_elsewhere(range(64))


def test_wrong_dtype_block_is_refused(model_dir: str, server) -> None:
    pair = make_pair(CASES[0], model_dir, server.target)
    pair.save()
    shape = (NUM_LAYERS, 2, KV_HEADS, CHUNK, HEAD)
    wrong = encode_block(
        bytes(2 * torch.Size(shape).numel()), key=pair.keys[0], dtype="bfloat16", shape=shape, layout=Layout.CANONICAL
    )
    with KVCacheClient(server.target, timeout_s=5) as client:
        client.put_many(pair.namespace, [(pair.keys[0], wrong)])
    assert pair.load() == set(DST_BLOCKS)


def test_saves_that_may_depend_on_a_failed_load_wait_until_the_scheduler_settled_it(model_dir: str, server) -> None:
    pair = make_pair(CASES[0], model_dir, server.target)
    chunk_1 = transfer(pair.keys, pair.namespace, DST_BLOCKS, 64).chunks[1]
    save = RequestTransfer("r", (pair.namespace.name,), DST_BLOCKS, (chunk_1,))
    load = transfer(pair.keys, pair.namespace, DST_BLOCKS, 32)  # chunk 0, never stored

    # Step N loads chunk 0 (it fails) and would save chunk 1, computed on top of it: dropped.
    assert run_step(pair.dst, KVCacheConnectorMetadata(loads=(load,), saves=(save,))) == set(DST_BLOCKS[:2])
    # Step N+1 was planned before the scheduler saw the failure (asynchronous scheduling): dropped too.
    assert run_step(pair.dst, KVCacheConnectorMetadata(saves=(save,))) == set()
    assert server.stack.ram.stats().puts == 0
    # Once the scheduler has settled the failure, vLLM recomputes, and saving is sound again.
    settled = KVCacheConnectorMetadata(saves=(save,), settled_load_failures=DST_BLOCKS[:2])
    assert run_step(pair.dst, settled) == set()
    assert server.stack.ram.stats().puts == 1
    stats = pair.dst.get_kv_connector_stats()
    assert stats is not None
    assert (stats.data["load_failures"], stats.data["save_failures"], stats.data["save_chunks"]) == (1, 2, 1)


def test_unreachable_server_fails_loads_and_drops_saves_quietly(model_dir: str, dead_target: str) -> None:
    pair = make_pair(CASES[0], model_dir, dead_target, transfer_timeout_s=1.0)
    pair.save()
    assert pair.load() == set(DST_BLOCKS)
    assert pair.untouched_elsewhere(range(0))
    src, dst = pair.src.get_kv_connector_stats(), pair.dst.get_kv_connector_stats()
    assert src is not None and src.data == {"save_failures": 3, "save_s": src.data["save_s"]}
    assert dst is not None and dst.data["load_failures"] == 3


def test_replica_ranks_load_but_only_the_first_rank_of_a_replica_group_saves(model_dir: str, server) -> None:
    # MLA at TP=2: both ranks hold the same latent cache (vLLM reports kv_tp_replicas=2), one shard.
    case = CASE["FLASHMLA-LBNHC"]
    config = case.kv_cache_config
    config.kv_tp_replicas = 2
    ranks = [make_vllm_config(model_dir, extra={"target": server.target}, tp_size=2, rank=r) for r in (0, 1)]
    workers = [make_worker(vllm_config, config) for vllm_config in ranks]
    caches = [case.make(config) for _ in ranks]
    for worker, rank_caches in zip(workers, caches, strict=True):
        fill_random(rank_caches, seed=11)  # identical on both ranks, as replicas are
        worker.register_kv_caches(rank_caches)
    namespace = namespace_for(case, model_dir)  # tp_size 1: one shard for both ranks
    keys = chunk_keys(TOKENS, namespace)
    meta = KVCacheConnectorMetadata(saves=(transfer(keys, namespace, SRC_BLOCKS, 70),))

    run_step(workers[1], meta)
    assert server.stack.ram.stats().puts == 0
    run_step(workers[0], meta)
    assert server.stack.ram.stats().puts == 3


@pytest.mark.parametrize(
    "shape",
    [
        (NUM_BLOCKS, KV_HEADS, BLOCK, HEAD),  # K only
        (NUM_BLOCKS, KV_HEADS + 1, BLOCK, 2 * HEAD),  # another rank's heads
        (NUM_BLOCKS, KV_HEADS, 5, 2 * HEAD),  # kernel block not dividing 16
        (2, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD),  # older vLLM's [2, blocks, bs, H, D]: not FLASH_ATTN's in 0.33
        (NUM_BLOCKS, 2, BLOCK, KV_HEADS, HEAD),  # older vLLM's [blocks, 2, bs, H, D]
    ],
)
def test_a_shape_that_is_not_the_backends_layout_is_refused_at_registration(shape, model_dir: str) -> None:
    worker = make_worker(make_vllm_config(model_dir), make_kv_cache_config(NUM_BLOCKS))
    caches = {name: torch.zeros(shape, dtype=torch.float16) for name in LAYER_NAMES}
    message = (
        f"layer '{LAYER_NAMES[0]}': paged KV tensor of shape {shape} is not attention backend FLASH_ATTN's layout "
        f"{PagedKind.PACKED.value} for 2 KV heads of size 16, block size 16"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        worker.register_kv_caches(caches)


class ForkedFlashAttentionBackend(FlashAttentionBackend):
    """A backend that may read the same shape its own way: a subclass proves nothing."""


@pytest.mark.parametrize(
    "backend", [TritonAttentionDiffKVBackend, ForkedFlashAttentionBackend], ids=["vllm-backend", "subclass"]
)
def test_an_attention_backend_of_unknown_layout_is_refused_at_registration(backend: type, model_dir: str) -> None:
    vllm_config = make_vllm_config(model_dir)
    name_backend(vllm_config, backend)
    config = make_kv_cache_config(NUM_BLOCKS)
    worker = make_worker(vllm_config, config)
    path = f"{backend.__module__}.{backend.__qualname__}"
    message = (
        f"layer '{LAYER_NAMES[0]}': attention backend {backend.get_name()} ({path}) is not supported by "
        "KVCacheConnector: its paged KV layout is unknown to it; supported backends: CPUAttentionBackend, "
        "CPUMLABackend, CutlassMLABackend, FlashAttentionBackend, FlashAttnMLABackend, FlashInferBackend, "
        "FlashInferMLABackend, FlashMLABackend, FlexAttentionBackend, TritonAttentionBackend, TritonMLABackend"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        worker.register_kv_caches(allocate_caches(config, KVCacheLayout.LBNHC))


def test_a_layer_without_a_known_backend_is_refused_at_registration(model_dir: str) -> None:
    vllm_config = make_vllm_config(model_dir)
    config = make_kv_cache_config(NUM_BLOCKS)
    worker = make_worker(vllm_config, config)
    del vllm_config.compilation_config.static_forward_context[LAYER_NAMES[1]]
    with pytest.raises(ValueError, match=f"^layer '{re.escape(LAYER_NAMES[1])}': vLLM exposes no attention backend"):
        worker.register_kv_caches(allocate_caches(config, KVCacheLayout.LBNHC))


def test_an_mla_backend_on_a_plain_attention_spec_is_refused(model_dir: str) -> None:
    vllm_config = make_vllm_config(model_dir)
    name_backend(vllm_config, FlashMLABackend)
    config = make_kv_cache_config(NUM_BLOCKS)
    worker = make_worker(vllm_config, config)
    with pytest.raises(
        ValueError, match="attention backend FLASHMLA is an MLA backend, but the KV-cache spec is not MLA"
    ):
        worker.register_kv_caches(allocate_caches(config, KVCacheLayout.LBNHC))


def test_registration_refuses_a_missing_layer_or_another_dtype(model_dir: str) -> None:
    config = make_kv_cache_config(NUM_BLOCKS)
    worker = make_worker(make_vllm_config(model_dir), config)
    caches = allocate_caches(config, KVCacheLayout.LBNHC)
    with pytest.raises(ValueError, match="no tensor for layer"):
        worker.register_kv_caches({LAYER_NAMES[0]: caches[LAYER_NAMES[0]]})
    with pytest.raises(ValueError, match=r"torch\.bfloat16"):
        worker.register_kv_caches({name: cache.view(torch.bfloat16) for name, cache in caches.items()})
