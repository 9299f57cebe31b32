"""Builders for the vLLM connector tests: real vLLM 0.33 objects on CPU, a fake model, an engine loop.

`Engine` is one vLLM instance without a model: vLLM's real Scheduler (which builds
the scheduler-side connector through kv_connector_module_path), a worker-side
connector built by vLLM's KVConnectorFactory, and CPU KV caches allocated by vLLM's
own allocate_kv_cache. Each step replays the model runner's connector calls in
vLLM's order (kv_connector_model_runner_mixin._get_kv_connector_output) around a
fake forward pass that writes, for every computed token, KV that is a deterministic
function of the token's whole prefix: two prompts sharing a prefix share its KV,
and a value loaded into the wrong slot can never match by accident.

The fake model writes and reads the paged tensors with its own per-token indexing
(`write_token` / `read_token`), independent of the connector's layout code.

Longer than the project's ~500-line module guideline: the engine replays vLLM's whole step (scheduler,
every rank's connector hooks, the output aggregation) for plain, hybrid and tensor-parallel models, and
every vLLM test file builds on the same one.
"""

from __future__ import annotations

import collections
import functools
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.config.cache import MambaCacheMode
from vllm.config.kv_events import KVEventsConfig
from vllm.config.parallel import ParallelConfig
from vllm.distributed.kv_events import EventPublisher, KVEventBatch
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, KVConnectorWorkerMetadata
from vllm.utils.hashing import sha256
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.mla.flashmla import FlashMLABackend
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

from kvcache_connectors.vllm import KVCacheConnector, KVCacheConnectorStats
from kvcache_core.keys import HEADS_LAYOUT_VERSION, Namespace

BLOCK = 16
NUM_LAYERS = 2
KV_HEADS = 2  # the tiny model's KV heads (all of them at TP=1)
HEAD = 16  # hidden 64 / 4 attention heads
EOS = 2
LAYER_NAMES = tuple(f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS))
MAMBA_LAYER_NAMES = (LAYER_NAMES[0], "model.layers.1.mixer")  # a hybrid with state: attention, then a Mamba layer
CHUNK = 32  # chunk_tokens in most tests: two vLLM blocks
SAMPLED = 901  # the token the fake model samples


TINY_MODEL = {  # the tiny model's shapes, as a transformers config takes them
    "hidden_size": KV_HEADS * 2 * HEAD,
    "intermediate_size": 128,
    "num_hidden_layers": NUM_LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": KV_HEADS,
    "vocab_size": 1000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float16",
    "bos_token_id": 1,
    "eos_token_id": EOS,
    "tie_word_embeddings": False,
}


def write_model_dir(path: Path) -> str:
    """A model directory holding only the config.json of a tiny Llama (enough for ModelConfig offline)."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **TINY_MODEL}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def make_vllm_config(
    model_dir: str,
    *,
    role: str = "kv_both",
    extra: dict[str, Any] | None = None,
    tp_size: int = 1,
    rank: int = 0,
    policy: str = "recompute",
    max_num_batched_tokens: int = 64,
    kv_events: bool = False,
) -> VllmConfig:
    """A VllmConfig for the tiny model with KVCacheConnector loaded through kv_connector_module_path;
    with kv_events, KV cache events on (as --kv-events-config does; Engine records what is published)."""
    model_config = ModelConfig(
        model=model_dir, tokenizer=model_dir, skip_tokenizer_init=True, dtype="float16", max_model_len=2048, seed=0
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=2048,
        is_encoder_decoder=False,
        enable_chunked_prefill=True,
    )
    cache_config = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
    cache_config.kv_cache_layout = "LBNHC"  # the engine resolves this before building connectors
    transfer = KVTransferConfig(
        kv_connector="KVCacheConnector",
        kv_connector_module_path="kvcache_connectors.vllm",
        kv_role=role,
        kv_load_failure_policy=policy,
        kv_connector_extra_config={"chunk_tokens": CHUNK, **(extra or {})},
    )
    config = VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        parallel_config=ParallelConfig(tensor_parallel_size=tp_size),
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
    )
    config.parallel_config.rank = rank  # what vLLM's worker sets in each worker process
    if kv_events:
        config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    return config


def attention_spec(num_kv_heads: int = KV_HEADS, head_size: int = HEAD) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=num_kv_heads, head_size=head_size, dtype=torch.float16)


def make_kv_cache_config(
    num_blocks: int, spec: AttentionSpec | None = None, layout: KVCacheLayout = KVCacheLayout.LBNHC
) -> KVCacheConfig:
    """One KV-cache group over LAYER_NAMES, with backing tensors placed as vLLM plans them for `layout`."""
    spec = spec or attention_spec()
    page = spec.page_size_bytes
    n = len(LAYER_NAMES)
    if layout.is_layer_compact:
        tensor = KVCacheTensor(
            size=page * num_blocks * n, layers=list(LAYER_NAMES), layer_stride=page * num_blocks, block_stride=page
        )
    else:
        tensor = KVCacheTensor(
            size=page * num_blocks * n, layers=list(LAYER_NAMES), layer_stride=page, block_stride=page * n
        )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYER_NAMES), spec)],
        kv_cache_layout=layout.name,
    )


def hybrid_kv_cache_config(
    num_blocks: int,
    window: int,
    num_kv_heads: int = KV_HEADS,
    extra_retained_tokens: int = 0,
    all_sliding: bool = False,
) -> KVCacheConfig:
    """A hybrid model's KV-cache config as vLLM's hybrid allocator builds it: layer 0 in a full-attention
    group, layer 1 in a sliding-window group of `window` tokens, both layers' tensors overlaying one
    backing allocation (a block id belongs to one group at a time, so groups share the memory)."""
    full = attention_spec(num_kv_heads=num_kv_heads)
    sliding = SlidingWindowSpec(
        block_size=BLOCK,
        num_kv_heads=num_kv_heads,
        head_size=HEAD,
        dtype=torch.float16,
        sliding_window=window,
        extra_retained_tokens=extra_retained_tokens,
    )
    page = full.page_size_bytes
    if all_sliding:  # every layer slides (Mistral): one group, as vLLM builds it
        return make_kv_cache_config(num_blocks, sliding)
    return _one_layer_per_group(num_blocks, page, [(LAYER_NAMES[0], full), (LAYER_NAMES[1], sliding)])


def _one_layer_per_group(num_blocks: int, page: int, groups: list[tuple[str, Any]]) -> KVCacheConfig:
    """A config of one layer per group, each layer its own tensor of `num_blocks` pages of `page` bytes."""
    tensors = [
        KVCacheTensor(size=page * num_blocks, layers=[name], layer_stride=page * num_blocks, block_stride=page)
        for name, _ in groups
    ]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec([name], spec) for name, spec in groups],
        kv_cache_layout=KVCacheLayout.LBNHC.name,
    )


def mamba_kv_cache_config(
    num_blocks: int,
    state_shapes: tuple[tuple[int, ...], ...],
    state_dtypes: tuple[torch.dtype, ...],
    mamba_cache_mode: MambaCacheMode = "align",
    max_model_len: int = 2048,
) -> KVCacheConfig:
    """A Mamba hybrid's KV-cache config as vLLM's hybrid allocator builds it: layer 0 (MAMBA_LAYER_NAMES[0])
    in a full-attention group, layer 1 (a Mamba layer, MAMBA_LAYER_NAMES[1]) in a MambaSpec group whose
    state page is padded to the attention page (all groups share one page size, and one backing
    allocation). In "align" mode (prefix caching on) the Mamba group's block is the attention block, one
    state per block; in "none" mode a request's state is one block as long as the model."""
    full = attention_spec()
    page = full.page_size_bytes
    mamba = MambaSpec(
        block_size=BLOCK if mamba_cache_mode == "align" else max_model_len,
        shapes=state_shapes,
        dtypes=state_dtypes,
        page_size_padded=page,
        mamba_cache_mode=mamba_cache_mode,
    )
    assert mamba.real_page_size_bytes <= page
    return _one_layer_per_group(num_blocks, page, [(MAMBA_LAYER_NAMES[0], full), (MAMBA_LAYER_NAMES[1], mamba)])


def allocate_caches(
    kv_cache_config: KVCacheConfig, layout: KVCacheLayout, kernel_block_size: int = BLOCK
) -> dict[str, torch.Tensor]:
    """Per-layer paged tensors exactly as vLLM 0.33's model runner allocates and views them (a Mamba group's
    blocks are not split: prepare_kernel_block_sizes)."""
    kernel_block_sizes = [
        g.kv_cache_spec.block_size if isinstance(g.kv_cache_spec, MambaSpec) else kernel_block_size
        for g in kv_cache_config.kv_cache_groups
    ]
    return allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout, kernel_block_sizes)


@dataclass(frozen=True)
class StandInAttention:
    """An attention layer of the static forward context, as far as the connector reads it."""

    backend: type

    def get_attn_backend(self) -> type:
        return self.backend


def make_worker(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> KVCacheConnector:
    """A worker-side connector; layers not yet in the static forward context get the GPU default backend
    (FlashAttention, FlashMLA for MLA), whose layout allocate_caches' tensors have."""
    context = vllm_config.compilation_config.static_forward_context
    for group in kv_cache_config.kv_cache_groups:
        mla = isinstance(group.kv_cache_spec, MLAAttentionSpec)
        for name in group.layer_names:
            context.setdefault(name, StandInAttention(FlashMLABackend if mla else FlashAttentionBackend))
    connector = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
    assert isinstance(connector, KVCacheConnector)
    return connector


def expected_namespace(model_dir: str, *, cache_salt: str = "", chunk_tokens: int = CHUNK) -> Namespace:
    """The namespace docs/vllm.md promises for the tiny model, spelled out field by field: head-sharded
    (kvcache.canonical v2), all KV heads, whatever the TP size."""
    return Namespace(
        model_id=model_dir,
        kv_dtype="float16",
        chunk_tokens=chunk_tokens,
        num_layers=NUM_LAYERS,
        num_kv_heads=KV_HEADS,
        head_size=HEAD,
        cache_salt=cache_salt,
        layout_version=HEADS_LAYOUT_VERSION,
    )


# -- the fake model ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=65536)
def token_kv(prefix: tuple[int, ...], num_kv_heads: int = KV_HEADS) -> torch.Tensor:
    """KV of the last token of `prefix`: [layers, 2, heads, head_size] float16, a function of the whole prefix."""
    seed = xxhash.xxh3_64_intdigest(np.asarray(prefix, dtype="<u4").tobytes())
    generator = torch.Generator().manual_seed(seed & (2**63 - 1))
    return torch.randn(NUM_LAYERS, 2, num_kv_heads, HEAD, generator=generator).to(torch.float16)


def prompt_kv(tokens: Sequence[int], start: int, end: int) -> torch.Tensor:
    """Canonical KV [layers, 2, heads, end - start, head_size] of tokens[start:end] of a prompt."""
    return torch.stack([token_kv(tuple(tokens[: p + 1])) for p in range(start, end)], dim=3)


def write_token(cache: torch.Tensor, block: int, offset: int, kv: torch.Tensor) -> None:
    """kv [2, H, D] into a vLLM 0.33 packed tensor [blocks, H, block_size, 2 * D] (K first, then V)."""
    cache[block, :, offset, :HEAD] = kv[0]
    cache[block, :, offset, HEAD:] = kv[1]


def read_token(cache: torch.Tensor, block: int, offset: int) -> torch.Tensor:
    return torch.stack([cache[block, :, offset, :HEAD], cache[block, :, offset, HEAD:]])


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# -- the engine --------------------------------------------------------------------------------


class RecordingPublisher(EventPublisher):
    """Keeps every batch vLLM's scheduler publishes (in place of its ZMQ publisher)."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[KVEventBatch] = []

    def publish(self, events: KVEventBatch) -> None:
        self.batches.append(events)

    def shutdown(self) -> None:
        pass


@dataclass
class StepRecord:
    output: SchedulerOutput
    invalid_block_ids: set[int]
    computed: dict[str, range]  # request id -> positions the fake model computed
    block_ids: dict[str, list[int]]  # request id -> its blocks (of group 0) during the step
    group_block_ids: dict[str, tuple[list[int], ...]] = field(default_factory=dict)  # every group's
    failed_recving: set[str] = field(default_factory=set)  # requests whose load failed (hybrid models)


@dataclass
class Engine:
    """One vLLM instance: the real Scheduler, one worker-side connector per TP rank with its CPU
    caches (rank r holds KV heads r*h .. r*h+h-1), and a fake model.

    Build it with `make_engine`; `configs[r]` is rank r's VllmConfig (configs[0] builds the scheduler).
    With a `sliding_window`, the model is hybrid (hybrid_kv_cache_config): layer 0 full attention,
    layer 1 sliding window, each in its own KV-cache group.
    """

    configs: Sequence[VllmConfig]
    num_blocks: int = 64
    sliding_window: int | None = None
    extra_retained_tokens: int = 0
    all_sliding: bool = False
    scheduler: Scheduler = field(init=False)
    workers: list[KVCacheConnector] = field(init=False)
    caches: list[dict[str, torch.Tensor]] = field(init=False)
    kv_cache_config: KVCacheConfig = field(init=False)
    steps: list[StepRecord] = field(default_factory=list)
    stats: KVCacheConnectorStats = field(default_factory=KVCacheConnectorStats)
    requests: dict[str, Request] = field(default_factory=dict)
    max_tokens: int = 1
    kv_transfer_params: dict[str, dict[str, Any]] = field(default_factory=dict)  # of finished requests
    # Workers still to report a request (vLLM's KVOutputAggregator: every worker must report it).
    _sending: collections.Counter[str] = field(default_factory=collections.Counter)
    _recving: collections.Counter[str] = field(default_factory=collections.Counter)
    _failed_recving: set[str] = field(default_factory=set)
    published: RecordingPublisher = field(default_factory=RecordingPublisher)

    def __post_init__(self) -> None:
        heads = self.heads_per_rank
        if self.sliding_window is None:
            kv_cache_config = make_kv_cache_config(self.num_blocks, attention_spec(num_kv_heads=heads))
        else:
            kv_cache_config = hybrid_kv_cache_config(
                self.num_blocks, self.sliding_window, heads, self.extra_retained_tokens, self.all_sliding
            )
        # More ranks than KV heads: vLLM replicates each head over consecutive ranks.
        kv_cache_config.kv_tp_replicas = max(1, len(self.configs) // KV_HEADS)
        self.kv_cache_config = kv_cache_config
        for config in self.configs:
            config.cache_config.num_gpu_blocks = self.num_blocks
        self.scheduler = Scheduler(
            vllm_config=self.configs[0],
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.configs[0]),
            block_size=BLOCK,
            log_stats=True,
        )
        self.scheduler.kv_event_publisher = self.published
        self.workers = [make_worker(config, kv_cache_config) for config in self.configs]
        self.caches = [allocate_caches(kv_cache_config, KVCacheLayout.LBNHC) for _ in self.configs]
        for worker, caches in zip(self.workers, self.caches, strict=True):
            worker.register_kv_caches(caches)

    @property
    def heads_per_rank(self) -> int:
        return max(1, KV_HEADS // len(self.configs))

    def first_head(self, rank: int) -> int:
        """The first KV head rank `rank` holds (heads are replicated over ranks when there are more ranks)."""
        return (
            rank * KV_HEADS // len(self.configs)
            if len(self.configs) <= KV_HEADS
            else rank // (len(self.configs) // KV_HEADS)
        )

    @property
    def connector(self) -> KVCacheConnector:
        """The scheduler-side connector vLLM built."""
        connector = self.scheduler.connector
        assert isinstance(connector, KVCacheConnector)
        return connector

    def add(
        self,
        request_id: str,
        tokens: Sequence[int],
        *,
        cache_salt: str | None = None,
        max_tokens: int | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> Request:
        params = SamplingParams(max_tokens=max_tokens or self.max_tokens, extra_args=None)
        if kv_transfer_params is not None:
            params.extra_args = {"kv_transfer_params": kv_transfer_params}
        params.update_from_generation_config({}, EOS)
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(tokens),
            sampling_params=params,
            pooling_params=None,
            cache_salt=cache_salt,
            block_hasher=get_request_block_hasher(BLOCK, sha256),
        )
        self.requests[request_id] = request
        self.scheduler.add_request(request)
        return request

    def step(self) -> StepRecord:
        """One engine step: every worker's connector calls in vLLM's order, outputs aggregated as vLLM does
        (a request is finished sending or receiving once every worker reported it, as vLLM's
        KVOutputAggregator counts; kv_transfer_params of finished requests are kept)."""
        out = self.scheduler.schedule()
        for worker in self.workers:
            worker.bind_connector_metadata(out.kv_connector_metadata)
            if out.has_sync_kv_loads:
                worker.start_load_kv(None)
        computed, block_ids = self._forward(out)
        invalid: set[int] = set()
        sending: set[str] = set()
        recving: set[str] = set()
        worker_stats = KVCacheConnectorStats()
        worker_meta: KVConnectorWorkerMetadata | None = None
        for worker in self.workers:
            if not out.has_sync_kv_loads:
                worker.start_load_kv(None)
            worker.wait_for_save()
            # As vLLM's model runner (kv_connector_model_runner_mixin): the transfer results, then the
            # failed blocks; failed receives are kept until every worker finished the request
            # (KVOutputAggregator's _failed_recving_pending).
            results = worker.get_transfer_results(out.finished_req_ids)
            self._failed_recving |= results.failed_recving
            finished = (results.finished_sending, results.finished_recving)
            for reported, pending, done in zip(
                finished, (self._sending, self._recving), (sending, recving), strict=True
            ):
                for request_id in reported or ():
                    pending[request_id] += 1
                    if pending[request_id] == len(self.workers):
                        del pending[request_id]
                        done.add(request_id)
            invalid |= worker.get_block_ids_with_load_errors()
            stats = worker.get_kv_connector_stats()
            if stats is not None:
                worker_stats.aggregate(stats)
            # As KVOutputAggregator: the first worker's metadata accumulates every other's.
            meta = worker.build_connector_worker_meta()
            if worker_meta is None:
                worker_meta = meta
            elif meta is not None:
                worker_meta = worker_meta.aggregate(meta)
            worker.clear_connector_metadata()
        failed_recving = self._failed_recving & recving
        self._failed_recving -= failed_recving
        kv_output = KVConnectorOutput(
            finished_sending=sending or None,
            finished_recving=recving or None,
            failed_recving=failed_recving,
            invalid_block_ids=invalid,
            kv_connector_stats=None if worker_stats.is_empty() else worker_stats,
            kv_connector_worker_meta=worker_meta,
        )
        req_ids = list(out.num_scheduled_tokens)
        sampled = [[SAMPLED] if computed[r].stop >= self.requests[r].num_tokens else [] for r in req_ids]
        runner_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_output,
        )
        for engine_output in self.scheduler.update_from_output(out, runner_output).values():
            for output in engine_output.outputs:
                if output.kv_transfer_params is not None:
                    self.kv_transfer_params[output.request_id] = output.kv_transfer_params
            stats = engine_output.scheduler_stats
            if stats is not None and stats.kv_connector_stats:
                self.stats.aggregate(KVCacheConnector.build_kv_connector_stats(stats.kv_connector_stats))
        group0 = {r: list(b[0]) for r, b in block_ids.items()}
        record = StepRecord(out, invalid, computed, group0, block_ids, failed_recving)
        self.steps.append(record)
        return record

    def run(self, max_steps: int = 40, timeout_s: float = 30.0) -> list[StepRecord]:
        """Steps until every request finished and vLLM let go of its blocks, then waits for the
        workers' background saves; returns this run's steps that scheduled tokens (all of them
        stay in `steps`).

        Steps that schedule no token (every request waiting for its KV) do not count against
        max_steps; they are paced by a short sleep and bounded by timeout_s.
        """
        first = len(self.steps)
        busy = 0
        deadline = time.monotonic() + timeout_s
        while self.scheduler.has_requests():
            assert busy < max_steps, "requests still running after max_steps"
            assert time.monotonic() < deadline, "requests still waiting after timeout_s"
            if self.step().output.total_num_scheduled_tokens:
                busy += 1
            else:
                time.sleep(0.002)
        self.settle()
        assert self.connector.open_requests == 0, "the connector kept state of finished requests"
        return [s for s in self.steps[first:] if s.output.total_num_scheduled_tokens]

    def kvcache_events(self, first: int = 0) -> list[Any]:
        """The connector's events (medium KVCACHE) in the batches published since batch `first`."""
        return [e for batch in self.published.batches[first:] for e in batch.events if e.medium == "KVCACHE"]

    def failed_requests(self, first: int = 0) -> set[str]:
        """Every request reported as failed to load (failed_recving) since step `first`."""
        return {r for s in self.steps[first:] for r in s.failed_recving}

    def invalid_block_ids(self, first: int = 0) -> set[int]:
        """Every block reported as failed to load since step `first`."""
        return {b for s in self.steps[first:] for b in s.invalid_block_ids}

    def settle(self, timeout_s: float = 30.0) -> None:
        """Waits until every worker's background loads and saves are done; adds their counters to `stats`."""
        for worker in self.workers:
            wait_idle = getattr(worker._worker_side(), "wait_idle", None)  # None: a synchronous connector
            assert wait_idle is None or wait_idle(timeout_s), "background transfers still running"
            stats = worker.get_kv_connector_stats()
            if stats is not None:
                self.stats.aggregate(stats)

    def close(self) -> None:
        for worker in self.workers:
            worker.shutdown()

    def _forward(self, out: SchedulerOutput) -> tuple[dict[str, range], dict[str, tuple[list[int], ...]]]:
        """Writes the fake model's KV for every token the step computes; returns the positions and blocks."""
        starts = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        computed: dict[str, range] = {}
        blocks: dict[str, tuple[list[int], ...]] = {}
        h = self.heads_per_rank
        for request_id, count in out.num_scheduled_tokens.items():
            tokens = list(self.requests[request_id].all_token_ids)
            group_blocks = tuple(list(b) for b in self.scheduler.kv_cache_manager.get_block_ids(request_id))
            blocks[request_id] = group_blocks
            positions = range(starts[request_id], starts[request_id] + count)
            for p in positions:
                kv = token_kv(tuple(tokens[: p + 1]))
                for rank, caches in enumerate(self.caches):
                    first = self.first_head(rank)
                    heads = kv[:, :, first : first + h]
                    for layer, name in enumerate(LAYER_NAMES):
                        block_ids = group_blocks[self.group_of(layer)]
                        write_token(caches[name], block_ids[p // BLOCK], p % BLOCK, heads[layer])
            computed[request_id] = positions
        for worker, caches in zip(self.workers, self.caches, strict=bool(self.workers)):
            for name in LAYER_NAMES:  # the per-layer hooks, as the attention layers call them
                worker.wait_for_layer_load(name)
                worker.save_kv_layer(name, caches[name], None)
        return computed, blocks

    def computed_positions(self, request_id: str) -> list[int]:
        """Every position the fake model computed for the request, over all steps."""
        return [p for step in self.steps for p in step.computed.get(request_id, ())]

    def group_of(self, layer: int) -> int:
        """The KV-cache group of a layer (0 unless the model is hybrid: then layer 1 is group 1)."""
        return 0 if len(self.kv_cache_config.kv_cache_groups) == 1 else layer

    def last_block_ids(self, request_id: str, group: int = 0) -> list[int]:
        """The request's blocks in the last step that scheduled it (still holding its KV after it finished)."""
        step = next(step for step in reversed(self.steps) if request_id in step.block_ids)
        return step.group_block_ids[request_id][group] if step.group_block_ids else step.block_ids[request_id]

    def paged_kv(
        self, request_id: str, start: int, end: int, rank: int = 0, layers: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Canonical KV [layers, 2, heads of the rank, end - start, head_size] of a request, from the paged caches
        (of the given layers, each read through its group's blocks; default all)."""
        caches = self.caches[rank]
        layers = range(NUM_LAYERS) if layers is None else layers
        tables = {layer: self.last_block_ids(request_id, self.group_of(layer)) for layer in layers}
        return torch.stack(
            [
                torch.stack(
                    [read_token(caches[LAYER_NAMES[layer]], tables[layer][p // BLOCK], p % BLOCK) for layer in layers]
                )
                for p in range(start, end)
            ],
            dim=3,
        )

    def expected_kv(
        self, request_id: str, start: int, end: int, rank: int = 0, layers: Sequence[int] | None = None
    ) -> torch.Tensor:
        """What the fake model computes for those tokens, for that rank's heads (and the given layers)."""
        h, first = self.heads_per_rank, self.first_head(rank)
        kv = prompt_kv(self.requests[request_id].prompt_token_ids, start, end)[:, :, first : first + h]
        return kv if layers is None else kv[list(layers)]


def make_engine(
    model_dir: str,
    *,
    tp_size: int = 1,
    num_blocks: int = 64,
    sliding_window: int | None = None,
    extra_retained_tokens: int = 0,
    all_sliding: bool = False,
    **config: Any,
) -> Engine:
    """An Engine whose ranks share one configuration (make_vllm_config's keywords); hybrid with a sliding_window."""
    configs = [make_vllm_config(model_dir, tp_size=tp_size, rank=rank, **config) for rank in range(tp_size)]
    return Engine(
        configs,
        num_blocks=num_blocks,
        sliding_window=sliding_window,
        extra_retained_tokens=extra_retained_tokens,
        all_sliding=all_sliding,
    )
