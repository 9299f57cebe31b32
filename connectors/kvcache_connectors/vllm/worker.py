"""The worker-side connector: moves chunks between the kvcache server and this rank's paged KV cache.

Runs in every vLLM worker process (one per TP rank). The hooks run on the model
runner's thread and never call the server: every Get and Put runs on one of two
background threads (transfers.py), each with a bounded queue.

    register_kv_caches   detect each layer's paged layout; refuse one it does not know

A hybrid model's KV-cache groups are kept apart: each has its layers, its chunk shape and
its namespaces, and every RequestTransfer names the group it fills or drains.
    start_load_kv        hand the step's loads to the load thread: one Get per namespace,
                         every chunk checked, the good ones scattered into their blocks; a
                         chunk that is missing, corrupt or of the wrong shape fails its blocks
                         and every later block of that request's load. Each load has a
                         deadline (transfer_timeout_s); a P/D hand-off may poll for chunks
                         still being written, up to its own deadline.
    wait_for_save        after the forward pass: one gather per layer of every token to save
                         into reused host staging memory, then hand it to the save thread
                         (one Put per namespace); a full queue drops the oldest save, counted
    get_finished         requests whose load is done (finished receiving) and finished
                         requests whose last chunk was copied out this step (finished sending)
    get_block_ids_with_load_errors   the failed blocks of the loads get_finished reports, for
                         vLLM to recompute (reported in the same pass, as vLLM requires)
    build_connector_worker_meta      the chunks whose put the server confirmed (or that failed)
                         since the last step, for the scheduler side's KV cache events

Scattering on the load thread does not race the forward pass. vLLM 0.33's scheduler
(vllm/v1/core/sched/scheduler.py, Scheduler.schedule) parks a request with an asynchronous
load in WAITING_FOR_REMOTE_KVS: load_kv_async sets num_new_tokens = 0 and the request is
skipped, never appended to `running`; its blocks are allocated with delay_cache_blocks, so
no other request can hit them; and vLLM frees them, even for an aborted request, only
after the load is reported in finished_recving. No forward pass reads or writes those
blocks until get_finished has reported the request. On CUDA the scatter runs on its own
stream, synchronized before the load counts as done.

Tokens computed after a failed load attended to whatever the failed blocks held, so
no chunk of a request holding such a block is saved until the scheduler has settled
the failure (vLLM recomputes from the first failed block): with asynchronous
scheduling the step after a failure was planned before the scheduler knew of it.

A save is gathered after the forward pass rather than per layer in save_kv_layer:
the step's blocks do not change until the step ends, the gather is a few index
kernels, and it keeps working when vLLM runs full CUDA graphs, which skip the
per-layer hooks (so the connector needs no piecewise graphs). The gather copies the
bytes out before wait_for_save returns (on CUDA, queued on the compute stream ahead of
any later kernel), so the blocks may be freed and reused as soon as the step ends; only
a finished request's last chunk, saved in the step after it finished, holds its blocks
(request_finished delays their free until get_finished reports the request as sent).

Longer than the project's ~500-line module guideline: loads and saves of every KV-cache group share the
staging, the unsettled-block bookkeeping and the job threads, which are kept in one place on purpose.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from kvcache_client.arena import LeasedBlocks
from kvcache_client.client import KVCacheClient
from kvcache_client.results import PutResult
from kvcache_client.tensors import block_to_tensor, tensor_block_parts
from kvcache_connectors.vllm.layout import PagedLayout, paged_layout, token_slots
from kvcache_connectors.vllm.metadata import ChunkId, ChunkRef, RequestTransfer, StoredChunks
from kvcache_connectors.vllm.namespaces import KVFacts
from kvcache_connectors.vllm.stats import Counters
from kvcache_connectors.vllm.transfers import Job, JobThread, StagingPool
from kvcache_core.blockwire import BlockData
from kvcache_core.breaker import CircuitBreaker
from kvcache_core.errors import KVCacheError
from kvcache_core.format import DType, Layout, decode_block

log = logging.getLogger(__name__)

POLL_S = 0.02
"""How often a P/D hand-off load asks again for chunks its producer is still writing."""


def chunk_ids(saves: Sequence[RequestTransfer]) -> list[ChunkId]:
    return [(s.request_id, c.index, c.num_tokens) for s in saves for c in s.chunks]


def put_confirmed(result: PutResult, num_blocks: int) -> bool:
    """Whether a put's blocks are all stored: one tier took every one of them before the call
    returned (a block only queued for a write-behind tier may still be dropped). A server that
    reports no tiers counts them all as stored or not; the result never says which blocks."""
    if result.tiers:
        return any(tier.stored == num_blocks for tier in result.tiers)
    return result.stored == num_blocks


@dataclass(slots=True)
class _LoadJob:
    """One step's loads, run on the load thread; read by the model runner's thread once done."""

    loads: tuple[RequestTransfer, ...]
    deadline: float
    failed: set[int] = field(default_factory=set)
    counters: Counters = field(default_factory=Counters)


class WorkerSide:
    """One worker process's half of KVCacheConnector."""

    def __init__(
        self,
        groups: Sequence[KVFacts],
        client: KVCacheClient,
        breaker: CircuitBreaker,
        *,
        tp_rank: int,
        transfer_timeout_s: float,
        staging_bytes: int = 1 << 30,
        max_queued_saves: int = 8,
        max_queued_loads: int = 64,
    ) -> None:
        """
        Args:
            groups: The namespace facts of each KV-cache group, in vLLM's group order.
            client: A client with no retries.
            breaker: Guards every call to the server.
            tp_rank: This worker's tensor-parallel rank.
            transfer_timeout_s: Deadline of one Get or Put, from when the hook handed it over.
            staging_bytes: Host memory for gathered saves not yet put.
            max_queued_saves: Steps of saves waiting for the save thread.
            max_queued_loads: Steps of loads waiting for the load thread.
        """
        self._groups = tuple(groups)
        facts = self._groups[0]
        self._facts = facts  # what every group shares: block size, chunk tokens, shards
        self._client = client
        self._breaker = breaker
        self._shard = facts.shard_of(tp_rank)
        self._writer = facts.is_writer(tp_rank)
        self._timeout_s = transfer_timeout_s
        self._layers: dict[int, list[tuple[torch.Tensor, PagedLayout]]] = {}  # group -> its layers
        self._load_errors: set[int] = set()  # this step's, until vLLM collects them
        self._unsettled: set[int] = set()  # failed blocks the scheduler has not yet settled
        self.counters = Counters()
        self._loader = JobThread("kvcache-load", max_queued_loads)
        self._saver = JobThread("kvcache-save", max_queued_saves * len(self._groups))  # a job per group and step
        self._staging_bytes = staging_bytes
        self._staging: StagingPool | None = None  # built when the caches' device is known
        self._lock = threading.Lock()  # guards what the job threads hand back:
        self._done_loads: list[_LoadJob] = []
        self._job_counters = Counters()
        self._reports = StoredChunks()  # puts confirmed or failed, until build_connector_worker_meta
        self._load_stream: torch.cuda.Stream | None = None
        self._loading: set[int] = set()  # blocks of loads handed over and not yet reported

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Keeps each layer's tensor with its attention backend's layout, in the chunk's layer order.

        Raises:
            ValueError: a layer of the KV-cache group is missing, has another dtype, an attention
                backend whose layout this connector does not know, or a shape not that layout's.
        """
        missing = [name for f in self._groups for name in f.layer_names if name not in kv_caches]
        if missing:
            raise ValueError(f"register_kv_caches: no tensor for layer(s) {missing}")
        groups: dict[int, list[tuple[torch.Tensor, PagedLayout]]] = {}
        for f in self._groups:
            layers = groups[f.group] = []
            for name in f.layer_names:
                cache = kv_caches[name]
                if cache.dtype != f.torch_dtype:
                    raise ValueError(
                        f"layer {name!r}: paged KV tensor is {cache.dtype}, the KV-cache spec {f.torch_dtype}"
                    )
                layout = paged_layout(
                    name,
                    f.attention_backend(name),
                    tuple(cache.shape),
                    num_kv_heads=f.num_kv_heads,
                    head_size=f.head_size,
                    block_size=f.block_size,
                    mla=f.mla,
                )
                layers.append((cache, layout))
            log.info(
                "kvcache connector: group %d (%s), %d layers, paged layout %s",
                f.group,
                "full attention" if f.sliding_window is None else f"sliding window of {f.sliding_window}",
                len(layers),
                layers[0][1].kind.name,
            )
        self._layers = groups

    # -- loads ---------------------------------------------------------------------------------

    def start_load_kv(self, loads: Sequence[RequestTransfer], settled_failures: Sequence[int] = ()) -> None:
        """Hands the step's loads to the load thread; get_finished reports each request once done.

        Args:
            loads: The step's loads (each request's blocks wait in WAITING_FOR_REMOTE_KVS).
            settled_failures: Failed blocks of earlier steps that vLLM now recomputes.
        """
        self._unsettled.difference_update(settled_failures)
        if not loads:
            return
        # A hand-off's wait comes on top: its last Get still has the whole transfer deadline.
        job = _LoadJob(tuple(loads), time.monotonic() + self._timeout_s + max(t.wait_s for t in loads))
        self._loading.update(b for t in loads for b in t.block_ids)
        if not self._loader.submit(Job(run=lambda: self._run_load(job), drop=lambda: self._fail_load(job))):
            log.warning("kvcache load queue full; %d request(s) recompute their prompts", len(loads))
            self._fail_load(job)

    def get_finished(self, sent: Sequence[str] = ()) -> tuple[set[str] | None, set[str] | None]:
        """(finished sending, finished receiving) of get_transfer_results."""
        sending, received, _ = self.get_transfer_results(sent)
        return sending or None, received or None

    def get_transfer_results(self, sent: Sequence[str] = ()) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving): the given requests whose last save
        was copied out this step, the requests whose load ended since the last call, and those of them
        whose load failed somewhere.

        With one KV-cache group a failed load is reported by its blocks (get_block_ids_with_load_errors,
        which vLLM calls right after, in the same pass), and vLLM recomputes from the first failed
        block; vLLM 0.33 refuses block ids for several groups (they are not unique across groups),
        so a hybrid model's failed loads are reported as failed requests, which vLLM recomputes whole.
        """
        with self._lock:
            done, self._done_loads = self._done_loads, []
        received: set[str] = set()
        failed: set[str] = set()
        bs = self._facts.block_size
        for job in done:
            self._loading.difference_update(b for t in job.loads for b in t.block_ids)
            self.counters.add(job.counters)
            self._unsettled |= job.failed
            if len(self._groups) == 1:
                self._load_errors |= job.failed
            else:
                for t in job.loads:
                    if not job.failed.isdisjoint(t.block_ids[t.start // bs : math.ceil(t.end / bs)]):
                        failed.add(t.request_id)
            received.update(t.request_id for t in job.loads)
        return set(sent), received, failed

    def take_load_errors(self) -> set[int]:
        """Block ids that failed to load, of the loads get_finished reported."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_stored_chunks(self) -> StoredChunks | None:
        """The chunks this shard's puts stored or failed since the last call; None when there are none."""
        with self._lock:
            reports, self._reports = self._reports, StoredChunks()
        return reports if reports.stored or reports.failed else None

    def _report(self, stored: Sequence[ChunkId] = (), failed: Sequence[ChunkId] = (), group: int = 0) -> None:
        shard = frozenset((group * self._facts.num_shards + self._shard,))
        with self._lock:
            for chunk in stored:  # a hybrid model's groups each report the chunk: their streams add up
                self._reports.stored[chunk] = self._reports.stored.get(chunk, frozenset()) | shard
            self._reports.failed.update(failed)

    def drain_counters(self) -> dict[str, int | float] | None:
        """Counters since the last call, the save thread's included."""
        with self._lock:
            self.counters.add(self._job_counters)
            self._job_counters = Counters()
        return self.counters.drain()

    def wait_idle(self, timeout_s: float) -> bool:
        """Waits until both job threads are idle (tests, benchmarks, shutdown); whether they are."""
        deadline = time.monotonic() + timeout_s
        return self._loader.idle(timeout_s) and self._saver.idle(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        self._loader.close()
        self._saver.close()

    def _fail_load(self, job: _LoadJob) -> None:
        bs = self._facts.block_size
        for transfer in job.loads:
            job.failed.update(transfer.block_ids[transfer.start // bs : math.ceil(transfer.end / bs)])
            job.counters.load_failures += len(transfer.chunks)
        with self._lock:
            self._done_loads.append(job)

    def _run_load(self, job: _LoadJob) -> None:
        """On the load thread: fetch, check and scatter one step's loads, then report the job done.

        Whatever fails after the fetch (a tensor that does not fit, the scatter, an out-of-memory on
        the device) fails every block of the job's transfers: a load is reported as done only with
        each block it did not write in `failed`, or vLLM would run the request on blocks that hold
        whatever KV they last held.
        """
        started = time.perf_counter()
        loaded = Counters()  # counted into the job's only once the scatter succeeded
        # On the server's host the fetched blocks are views of its arena under read leases (one
        # copy: the scatter into vLLM's blocks); they are handed back once the job is scattered.
        leases = contextlib.ExitStack()
        leased: list[LeasedBlocks] = []  # each leased() call's blocks, to check their leases held throughout
        try:
            fetched = self._fetch(job, leases, leased)
            # Per group: the slots and the values to scatter into its layers.
            blocks: dict[int, list[torch.Tensor]] = {}
            offsets: dict[int, list[torch.Tensor]] = {}
            values: dict[int, list[torch.Tensor]] = {}
            bs, c = self._facts.block_size, self._facts.chunk_tokens
            for transfer in job.loads:
                token_dim = self._token_dim(transfer.group)
                namespace = transfer.namespace_for(self._shard)
                units = self._groups[transfer.group].units(self._shard, transfer.heads_per_block)
                for position, chunk in enumerate(transfer.chunks):
                    found = [fetched.get((namespace, chunk.keys[u])) for u in units]
                    parts = [p for p in found if p is not None]
                    fetched_bytes = sum(p.nbytes for p in parts)
                    # A block holds the chunk's last T tokens: all of them, or a sliding-window group's
                    # suffix (saved from the first block vLLM still held), which must reach back to start.
                    chunk_end = chunk.index * c + chunk.num_tokens
                    tensor = None
                    if len(parts) == len(found) and all(chunk_end - p.shape[token_dim] <= chunk.start for p in parts):
                        count = chunk.end - chunk.start
                        parts = [
                            p.narrow(token_dim, chunk.start - chunk_end + p.shape[token_dim], count) for p in parts
                        ]
                        # A rank's heads, from its blocks of consecutive heads: [L, 2, h, T, D] (MLA: one block).
                        tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
                    if tensor is None:
                        # This chunk and every later one of the request: vLLM recomputes from the first bad block.
                        job.failed.update(transfer.block_ids[chunk.start // bs : math.ceil(transfer.end / bs)])
                        job.counters.load_failures += len(transfer.chunks) - position
                        break
                    b, o = token_slots(transfer.block_ids, chunk.start, chunk.end, bs)
                    blocks.setdefault(transfer.group, []).append(b)
                    offsets.setdefault(transfer.group, []).append(o)
                    values.setdefault(transfer.group, []).append(tensor)
                    loaded.load_chunks += 1
                    loaded.load_bytes += fetched_bytes
            for group, group_values in values.items():
                self._scatter(
                    group,
                    torch.cat(blocks[group]),
                    torch.cat(offsets[group]),
                    torch.cat(group_values, dim=self._token_dim(group)),
                )
            if any(blocks.expired() for blocks in leased):
                # The scatter ended after a lease did: the server may have reused that slot while it
                # was read, so none of the job's blocks is trusted (vLLM recomputes them).
                raise TimeoutError("loads outlived their arena leases")
            job.counters.load_chunks += loaded.load_chunks
            job.counters.load_bytes += loaded.load_bytes
        except Exception:
            log.exception("kvcache load failed; vLLM recomputes the job's blocks")
            bs = self._facts.block_size
            for transfer in job.loads:
                job.failed.update(transfer.block_ids[transfer.start // bs : math.ceil(transfer.end / bs)])
            job.counters.load_failures += loaded.load_chunks  # the chunks it had fetched but did not write
        finally:
            leases.close()  # the job's tensors are scattered (or dropped): nothing reads the views again
            job.counters.load_s += time.perf_counter() - started
            with self._lock:
                self._done_loads.append(job)

    def _fetch(
        self, job: _LoadJob, leases: contextlib.ExitStack, leased: list[LeasedBlocks]
    ) -> dict[tuple[str, bytes], torch.Tensor]:
        """The job's chunks that arrived intact and in the expected shape, by (namespace, key);
        blocks read in place stay leased until `leases` is closed, and each call's blocks are
        appended to `leased`.

        A chunk of a transfer with `wait_s` (a P/D hand-off whose producer is still writing it)
        that is not stored yet is asked for again every poll_s, until that wait or the job's
        deadline ends; any other missing chunk fails at once.
        """
        wanted: dict[str, dict[bytes, tuple[ChunkRef, RequestTransfer]]] = {}  # namespace -> block key -> its chunk
        waits: dict[str, float] = {}
        for transfer in job.loads:
            namespace = transfer.namespace_for(self._shard)
            units = self._groups[transfer.group].units(self._shard, transfer.heads_per_block)
            by_key = wanted.setdefault(namespace, {})
            for chunk in transfer.chunks:
                for u in units:
                    by_key[chunk.keys[u]] = (chunk, transfer)
            waits[namespace] = max(waits.get(namespace, 0.0), transfer.wait_s)
        out: dict[tuple[str, bytes], torch.Tensor] = {}
        started = time.monotonic()
        for namespace, by_key in wanted.items():
            wait_until = min(job.deadline, started + waits[namespace])
            missing = dict(by_key)
            while missing:
                remaining = job.deadline - time.monotonic()
                if remaining <= 0 or not self._breaker.allow():
                    return out
                try:
                    blocks = leases.enter_context(self._client.leased(namespace, list(missing), timeout_s=remaining))
                    leased.append(blocks)
                except KVCacheError as exc:
                    if self._breaker.failure():
                        log.warning("kvcache get failed (%s); loads fail for %.1f s", exc, self._breaker.cooldown_s)
                    return out
                self._breaker.success()
                for (key, (chunk, transfer)), block in zip(list(missing.items()), blocks, strict=True):
                    if block is None:
                        continue
                    del missing[key]
                    if self._acceptable(block, key, chunk, transfer):
                        out[(namespace, key)] = block_to_tensor(block, verify=False)  # the SDK verified it
                if not missing or time.monotonic() + POLL_S > wait_until:
                    break
                time.sleep(POLL_S)
        return out

    def _block_layout(self, group: int) -> Layout:
        return Layout.MLA if self._groups[group].mla else Layout.CANONICAL

    def _token_dim(self, group: int) -> int:
        """Tokens are dimension 1 of an MLA chunk [L, T, D], dimension 3 of a canonical one [L, 2, H, T, D]."""
        return 1 if self._groups[group].mla else 3

    def _device(self) -> torch.device:
        return next(iter(self._layers.values()))[0][0].device

    def _acceptable(self, block: bytes, key: bytes, chunk: ChunkRef, transfer: RequestTransfer) -> bool:
        """Whether a verified block holds its part of this chunk in our layout: a block with a valid
        checksum can still be the wrong thing (another writer's bug), and scattering it would corrupt KV."""
        header, _ = decode_block(block, verify=False)
        group = transfer.group
        facts = self._groups[group]
        shape = facts.chunk_shape(chunk.num_tokens, heads=transfer.heads_per_block)
        expected = (self._block_layout(group), DType.from_name(facts.kv_dtype), shape)
        got = (header.layout, header.dtype, header.shape)
        if got == expected:
            return True
        # A sliding-window group's block may hold only the chunk's last tokens (at least one).
        dim = self._token_dim(group)
        if facts.sliding and len(header.shape) == len(shape) and 1 <= header.shape[dim] < chunk.num_tokens:
            suffix = (*shape[:dim], header.shape[dim], *shape[dim + 1 :])
            if got == (*expected[:2], suffix):
                return True
        log.error(
            "kvcache chunk %s refused: %s %s %s, expected %s %s %s",
            key.hex(),
            header.layout.name,
            header.dtype.name,
            header.shape,
            expected[0].name,
            expected[1].name,
            expected[2],
        )
        return False

    def _scatter(self, group: int, blocks: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor) -> None:
        layers = self._layers[group]
        device = self._device()
        if device.type != "cuda":
            blocks, offsets, values = blocks.to(device), offsets.to(device), values.to(device)
            for layer, (cache, layout) in enumerate(layers):
                layout.scatter(cache, blocks, offsets, values[layer])
            return
        if self._load_stream is None:
            self._load_stream = torch.cuda.Stream(device)
        with torch.cuda.stream(self._load_stream):
            blocks, offsets, values = blocks.to(device), offsets.to(device), values.to(device)
            for layer, (cache, layout) in enumerate(layers):
                layout.scatter(cache, blocks, offsets, values[layer])
        self._load_stream.synchronize()  # the KV is in place before get_finished reports the request

    # -- saves ---------------------------------------------------------------------------------

    def wait_for_save(self, saves: Sequence[RequestTransfer]) -> None:
        """Copies the step's completed chunks to host staging memory and queues their Put.

        Never waits for the server. When the save queue or the staging memory is full, the
        oldest queued save is dropped (counted in save_dropped); a save that still does not
        fit is dropped itself.
        """
        if not saves or not self._writer:
            return
        # Blocks still loading, or whose load failed and is not settled, hold no KV to save.
        good: list[RequestTransfer] = []
        held: list[RequestTransfer] = []
        for s in saves:
            sound = self._unsettled.isdisjoint(s.block_ids) and self._loading.isdisjoint(s.block_ids)
            (good if sound else held).append(s)
        self.counters.save_failures += sum(len(s.chunks) for s in held)
        self._report(failed=chunk_ids(held))
        for facts in self._groups:  # a job per group: each has its own chunk shape
            group = [s for s in good if s.group == facts.group]
            if group:
                self._save_group(facts, group)

    def _save_group(self, facts: KVFacts, good: list[RequestTransfer]) -> None:
        """Gathers one group's chunks of the step into staging memory and queues their Put."""
        num_chunks = sum(len(s.chunks) for s in good)
        # The breaker is consulted on the save thread (a probe taken here would be lost there).
        num_tokens = sum(c.end - c.start for s in good for c in s.chunks)
        shape = facts.chunk_shape(num_tokens)
        nbytes = math.prod(shape) * facts.torch_dtype.itemsize
        staging = self._staging_pool()
        buffer = staging.take(nbytes)
        while (buffer is None or self._saver.full) and (old := self._saver.drop_oldest()) is not None:
            old.drop()
            buffer = buffer if buffer is not None else staging.take(nbytes)
        if buffer is None:
            self.counters.save_failures += num_chunks
            self.counters.save_dropped += num_chunks
            self._report(failed=chunk_ids(good))
            return
        started = time.perf_counter()
        staged = buffer[:nbytes].view(facts.torch_dtype).view(shape)
        ready = self._gather(facts.group, good, staged)
        self.counters.save_s += time.perf_counter() - started
        job = Job(
            run=lambda: self._run_save(good, staged, buffer, ready),
            drop=lambda: self._drop_save(good, buffer, ready),
        )
        if not self._saver.submit(job):  # closed
            job.drop()

    def _staging_pool(self) -> StagingPool:
        if self._staging is None:
            pin = self._device().type == "cuda"
            self._staging = StagingPool(self._staging_bytes, pin=pin)
        return self._staging

    def _drop_save(
        self, saves: Sequence[RequestTransfer], buffer: torch.Tensor, ready: torch.cuda.Event | None
    ) -> None:
        if ready is not None:
            ready.synchronize()  # the copy into the buffer must end before the buffer is reused
        self._staging_pool().give_back(buffer)
        num_chunks = sum(len(s.chunks) for s in saves)
        self._report(failed=chunk_ids(saves))
        with self._lock:
            self._job_counters.save_failures += num_chunks
            self._job_counters.save_dropped += num_chunks

    def _run_save(
        self,
        saves: Sequence[RequestTransfer],
        staged: torch.Tensor,
        buffer: torch.Tensor,
        ready: torch.cuda.Event | None,
    ) -> None:
        """On the save thread: one Put per namespace and retention (requests may ask for different ones)."""
        counters = Counters()
        started = time.perf_counter()
        try:
            if ready is not None:
                ready.synchronize()
            # One put per (namespace, retain_ttl_s): the chunks of each put, for the scheduler's events.
            items: dict[tuple[str, float], list[tuple[bytes, BlockData]]] = {}
            ids: dict[tuple[str, float], list[ChunkId]] = {}
            position = 0
            group = saves[0].group  # a save job holds one group's chunks
            token_dim, block_layout = self._token_dim(group), self._block_layout(group)
            facts = self._groups[group]
            for transfer in saves:
                put = (transfer.namespace_for(self._shard), transfer.retain_ttl_s)
                namespace = items.setdefault(put, [])
                namespace_ids = ids.setdefault(put, [])
                g = transfer.heads_per_block or facts.num_kv_heads
                units = facts.units(self._shard, g)
                for chunk in transfer.chunks:
                    tensor = staged.narrow(token_dim, position, chunk.end - chunk.start)
                    for u in units:  # the rank's heads as blocks of g consecutive heads (MLA: one block)
                        part = tensor if facts.mla else tensor.narrow(2, (u - units.start) * g, g)
                        namespace.append((chunk.keys[u], tensor_block_parts(part, chunk.keys[u], block_layout)))
                    namespace_ids.append((transfer.request_id, chunk.index, chunk.num_tokens))
                    position += chunk.end - chunk.start
            for put, blocks in items.items():
                namespace, retain_ttl_s = put
                num_chunks = len(ids[put])  # counted in chunks: each is len(blocks) // num_chunks blocks
                if not self._breaker.allow():  # a put of this job failed already
                    counters.save_failures += num_chunks
                    self._report(failed=ids[put])
                    continue
                try:
                    result = self._client.put_many(
                        namespace, blocks, timeout_s=self._timeout_s, retain_ttl_s=retain_ttl_s or None
                    )
                except KVCacheError as exc:
                    counters.save_failures += num_chunks
                    self._report(failed=ids[put])
                    if self._breaker.failure():
                        log.warning(
                            "kvcache put failed (%s); saves are dropped for %.1f s", exc, self._breaker.cooldown_s
                        )
                    continue
                self._breaker.success()
                if put_confirmed(result, len(blocks)):
                    self._report(stored=ids[put], group=group)
                else:
                    self._report(failed=ids[put])
                stored_chunks = (
                    num_chunks if result.stored == len(blocks) else result.stored * num_chunks // len(blocks)
                )
                counters.save_chunks += stored_chunks
                if retain_ttl_s:
                    counters.save_retained_chunks += stored_chunks
                counters.save_failures += num_chunks - stored_chunks
                counters.save_bytes += result.bytes_sent
        finally:
            self._staging_pool().give_back(buffer)
            counters.save_s += time.perf_counter() - started
            with self._lock:
                self._job_counters.add(counters)

    def _gather(self, group: int, saves: Sequence[RequestTransfer], staged: torch.Tensor) -> torch.cuda.Event | None:
        """Every token of one group to save, in canonical layout, into `staged` on the host: [L, 2, H, T, D]
        (MLA: [L, T, D]). On CUDA the copies are queued on the current stream; the returned
        event marks their end."""
        bs = self._facts.block_size
        slots = [token_slots(s.block_ids, c.start, c.end, bs) for s in saves for c in s.chunks]
        blocks = torch.cat([b for b, _ in slots])
        offsets = torch.cat([o for _, o in slots])
        device = self._device()
        cuda = device.type == "cuda"
        blocks, offsets = blocks.to(device), offsets.to(device)
        for layer, (cache, layout) in enumerate(self._layers[group]):
            staged[layer].copy_(layout.gather(cache, blocks, offsets), non_blocking=cuda)
        if not cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event
