"""KVCacheConnector: vLLM's KV-connector (v1) contract, served by a kvcache server.

vLLM builds one instance per process from `--kv-transfer-config`
(`"kv_connector": "KVCacheConnector", "kv_connector_module_path": "kvcache_connectors.vllm"`)
and calls the hooks below. Scheduler-side hooks run in the EngineCore process, on
the scheduler's thread; worker-side hooks run in every worker (one per TP rank),
on the model runner's thread. Each role's work lives in its own module
(scheduler.py, worker.py); this class parses the configuration once and routes.

Scheduler process (role SCHEDULER), per step, in this order:
    get_num_new_matched_tokens(request, num_computed_tokens)
        One Lookup per namespace (per KV-cache group) of the prompt's chunks, once per request (the answer is kept
        while it waits); returns the tokens beyond vLLM's block-aligned local hit that every
        shard can load, asynchronously (load_async=True whenever there is something to load).
        Never the whole sequence: a full hit loads all tokens but the last.
    update_state_after_alloc(request, blocks, num_external_tokens)
        Plans the request's load into its blocks; starts tracking what it has to save.
    build_connector_meta(scheduler_output) -> KVCacheConnectorMetadata
        The step's loads, plus saves of every chunk whose last token this step computes.
    update_connector_output(connector_output)
        Blocks that failed to load: their chunks are saved again once recomputed. Chunks every
        shard's put stored (kv_connector_worker_meta): their BlockStored events, built when
        the save was planned, go to take_events.
    request_finished_all_groups(request, block_ids) -> (delay_free, kv_transfer_params)
        Forgets the request. Blocks are freed at once (each step's saves are copied out within
        the step), unless write-back saves its final partial chunk in the next step: then
        delay_free is True and the workers report the request in get_finished once copied out.
        A producer's kv_transfer_params name the prompt chunks it saved or is still putting
        ({"kvcache_handoff": {"chunks", "last_key"}}); a consumer given them waits for those.
    get_kv_connector_stats()
        Lookup counters since the last call.

Worker processes (role WORKER):
    register_kv_caches(kv_caches)               once, at start-up: detects the paged layout
    start_load_kv(forward_context)              queues the step's loads (fetch, check, scatter) on the load thread
    wait_for_layer_load(layer_name)             nothing to wait for: loaded requests are not in the batch
    save_kv_layer(layer_name, kv_layer, ...)    nothing: saves are gathered in wait_for_save
    wait_for_save()                             after the forward pass: gather into host staging, queue the put
    get_transfer_results(finished_req_ids)      requests whose load is done (and, for a hybrid model, those
                                                whose load failed); finished requests whose last chunk was
                                                copied out
    get_block_ids_with_load_errors()            blocks whose chunk was missing, corrupt or wrong
    build_connector_worker_meta()               chunks whose put the server confirmed or failed, for
                                                the scheduler side's KV cache events
    get_kv_connector_stats()                    load and save counters since the last call
    shutdown()                                  closes the channel

Hybrid models: the connector is SupportsHMA, so vLLM keeps its hybrid memory allocator
on; each KV-cache group has its own namespaces and is looked up, loaded and saved under
vLLM's rule for it (scheduler.py). A group the connector cannot serve exactly is refused
when vLLM builds the connector (namespaces.kv_groups).

Both: build_kv_connector_stats(data) rebuilds the stats vLLM ships between processes;
requires_kv_delivery is False (a best-effort cache: a dropped save is a later miss).

Roles: kv_producer saves, kv_consumer loads, kv_both does both. Failures never stop
the engine: an unreachable or slow server makes lookups misses, loads fail (vLLM
recomputes with kv_load_failure_policy="recompute") and saves are dropped, all
counted, with a circuit breaker so the server's timeout is paid once per cooldown.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvcache_client.client import KVCacheClient
from kvcache_client.retry import NO_RETRY
from kvcache_client.targets import FailoverTransport, split_targets, target_transports
from kvcache_connectors.vllm.config import KVCacheConnectorConfig
from kvcache_connectors.vllm.events import StoredBlockEvents
from kvcache_connectors.vllm.metadata import KVCacheConnectorMetadata, StoredChunks
from kvcache_connectors.vllm.namespaces import kv_groups
from kvcache_connectors.vllm.scheduler import SchedulerSide
from kvcache_connectors.vllm.stats import KVCacheConnectorStats
from kvcache_connectors.vllm.worker import WorkerSide
from kvcache_core.breaker import CircuitBreaker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


def connect(config: KVCacheConnectorConfig) -> KVCacheClient:
    """A client that never retries, on a channel that reconnects at the breaker's pace.

    gRPC backs off reconnecting to an unreachable server by up to 120 s by default, and
    fails calls at once meanwhile; capping the back-off at breaker_cooldown_s means the
    breaker's probe after a restart of the server finds the channel connecting again.
    """
    backoff_ms = max(1, round(config.breaker_cooldown_s * 1000))
    reconnect = [
        ("grpc.initial_reconnect_backoff_ms", backoff_ms),
        ("grpc.min_reconnect_backoff_ms", backoff_ms),
        ("grpc.max_reconnect_backoff_ms", backoff_ms),
    ]
    targets = split_targets(config.target)  # several: the node's own server first (kvcache_client.targets)
    # Off this host, KV bytes travel on each server's bulk port when it has one (docs/bulk.md; KVCACHE_BULK=0: gRPC).
    transports = target_transports(
        targets, token=config.api_token(), tls=config.tls_config(), shm=config.shm, channel_options=reconnect
    )
    transport = transports[0] if len(transports) == 1 else FailoverTransport(transports, targets)
    return KVCacheClient(config.target, timeout_s=config.transfer_timeout_s, retry=NO_RETRY, transport=transport)


class KVCacheConnector(KVConnectorBase_V1, SupportsHMA):
    """A vLLM KV connector that loads prompt prefixes from, and saves them to, a kvcache server."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        """Parses kv_connector_extra_config and builds this role's half.

        Raises:
            ValueError: a bad configuration key, or a model or parallel setup the connector
                cannot serve (see KVCacheConnectorConfig and namespaces.kv_groups).
        """
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = self._kv_transfer_config
        # The KV-cache manager's block size is its spec's (a backend may have changed --block-size).
        groups = kv_cache_config.kv_cache_groups
        block_size = groups[0].kv_cache_spec.block_size if groups else vllm_config.cache_config.block_size
        config = KVCacheConnectorConfig.from_extra_config(transfer.kv_connector_extra_config, block_size=block_size)
        groups = kv_groups(vllm_config, kv_cache_config, config)
        facts = groups[0]
        self._config = config
        self._client = connect(config)
        cooldown = config.breaker_cooldown_s
        breaker = CircuitBreaker(failure_threshold=1, reset_s=cooldown, max_reset_s=cooldown)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self.kv_events = StoredBlockEvents.from_vllm(vllm_config, facts.block_size)  # drained by take_events
        if role is KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(
                groups,
                self._client,
                breaker,
                lookup_timeout_s=config.lookup_timeout_s,
                load=transfer.is_kv_consumer,
                save=transfer.is_kv_producer,
                save_partial_chunks=config.save_partial_chunks,
                write_back=config.write_back if config.write_back is not None else transfer.is_kv_producer,
                handoff_timeout_s=config.handoff_timeout_s,
                events=self.kv_events,
                retain_ttl_s=config.retain_ttl_s,
                max_retain_ttl_s=config.max_retain_ttl_s,
            )
        else:
            tp_rank = vllm_config.parallel_config.rank % facts.tp_size
            self._worker = WorkerSide(
                groups,
                self._client,
                breaker,
                tp_rank=tp_rank,
                transfer_timeout_s=config.transfer_timeout_s,
                staging_bytes=config.staging_bytes,
                max_queued_saves=config.save_queue_steps,
            )

    @property
    def config(self) -> KVCacheConnectorConfig:
        """The parsed kv_connector_extra_config."""
        return self._config

    @property
    def open_requests(self) -> int:
        """Requests the scheduler side holds state for (0 when idle; 0 on a worker)."""
        return 0 if self._scheduler is None else self._scheduler.open_requests

    @property
    def pending_events(self) -> int:
        """KV cache events waiting for every shard's confirmation (0 on a worker)."""
        return 0 if self._scheduler is None else self._scheduler.pending_events

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # -- worker side ---------------------------------------------------------------------------

    def _worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("a worker-side hook was called on the scheduler-side KVCacheConnector")
        return self._worker

    def _metadata(self) -> KVCacheConnectorMetadata:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVCacheConnectorMetadata):
            raise TypeError(f"KVCacheConnector got metadata of type {type(meta).__name__}")
        return meta

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker_side().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._metadata()
        self._worker_side().start_load_kv(meta.loads, meta.settled_load_failures)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are asynchronous: a request whose KV is loading is not in the batch, so no layer waits."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        """Saves are gathered in wait_for_save (see worker.py for why), so a layer hands nothing over."""

    def wait_for_save(self) -> None:
        if self.has_connector_metadata():
            self._worker_side().wait_for_save(self._metadata().saves)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """What vLLM's model runner collects after each step: finished saves and loads, and (for a
        hybrid model, whose failures cannot be reported as block ids) the loads that failed."""
        sent = self._metadata().sent if self.has_connector_metadata() else ()
        sending, received, failed = self._worker_side().get_transfer_results(sent)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=received, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_side().take_load_errors()

    def build_connector_worker_meta(self) -> StoredChunks | None:
        """The chunks this worker's puts stored or failed since the last step (vLLM aggregates
        every worker's and hands them to the scheduler side's update_connector_output)."""
        return self._worker_side().take_stored_chunks()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        self._client.close()

    # -- scheduler side ------------------------------------------------------------------------

    def _scheduler_side(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("a scheduler-side hook was called on a worker-side KVCacheConnector")
        return self._scheduler

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler_side().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler_side().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler_side().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler_side().update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side().request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """SupportsHMA: vLLM calls this instead of request_finished, with the block ids of every group."""
        return self._scheduler_side().request_finished(request, block_ids)

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        """Learns vLLM's null block, which stands for a sliding-window group's freed blocks."""
        super().bind_gpu_block_pool(gpu_block_pool)
        if self._scheduler is not None:
            self._scheduler.bind_block_pool(gpu_block_pool.null_block.block_id)

    def take_events(self) -> list[KVCacheEvent]:
        """BlockStored events (medium KVCACHE) for the blocks kvcache stored since the last step;
        vLLM publishes them with its own KV cache events (`--kv-events-config`)."""
        return self.kv_events.take()

    # -- stats (both) --------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVCacheConnectorStats | None:
        scheduler = self._scheduler
        data = scheduler.counters.drain() if scheduler is not None else self._worker_side().drain_counters()
        return None if data is None else KVCacheConnectorStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVCacheConnectorStats:
        return KVCacheConnectorStats(data=dict(data or {}))
