"""The worker-side connector: moves chunks between the kvcache server and this rank's paged KV cache.

Runs in every vLLM worker process (one per TP rank), on the model runner's thread.

    register_kv_caches   detect each layer's paged layout; refuse one it does not know
    start_load_kv        before the forward pass: one Get per namespace for the step's loads,
                         checks every chunk, scatters the good ones into their blocks; a chunk
                         that is missing, corrupt or of the wrong shape fails its blocks and
                         every later block of that request's load
    wait_for_save        after the forward pass: one gather per layer of every token to save,
                         one copy to host, one Put per namespace; it returns once the server
                         answered, so a P/D decode instance asked next finds the prompt stored
    get_block_ids_with_load_errors   the failed blocks, for vLLM to recompute

Tokens computed after a failed load attended to whatever the failed blocks held, so
no chunk of a request holding such a block is saved until the scheduler has settled
the failure (vLLM recomputes from the first failed block): with asynchronous
scheduling the step after a failure was planned before the scheduler knew of it.

A save is gathered after the forward pass rather than per layer in save_kv_layer:
the step's blocks do not change until the step ends, the gather is a few index
kernels, and it keeps working when vLLM runs full CUDA graphs, which skip the
per-layer hooks (so the connector needs no piecewise graphs).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence

import torch

from kvcache_client.client import KVCacheClient
from kvcache_client.tensors import block_to_tensor, tensor_block_parts
from kvcache_connectors.vllm.layout import PagedLayout, detect_layout, token_slots
from kvcache_connectors.vllm.metadata import ChunkRef, RequestTransfer
from kvcache_connectors.vllm.namespaces import KVFacts
from kvcache_connectors.vllm.stats import Counters
from kvcache_core.blockwire import BlockData
from kvcache_core.breaker import BreakerState, CircuitBreaker
from kvcache_core.errors import KVCacheError
from kvcache_core.format import DType, Layout, decode_block

log = logging.getLogger(__name__)


class WorkerSide:
    """One worker process's half of KVCacheConnector."""

    def __init__(
        self,
        facts: KVFacts,
        client: KVCacheClient,
        breaker: CircuitBreaker,
        *,
        tp_rank: int,
        transfer_timeout_s: float,
    ) -> None:
        """
        Args:
            facts: The instance's namespace facts.
            client: A client with no retries.
            breaker: Guards every call to the server.
            tp_rank: This worker's tensor-parallel rank.
            transfer_timeout_s: Deadline of one Get or Put.
        """
        self._facts = facts
        self._client = client
        self._breaker = breaker
        self._shard = facts.shard_of(tp_rank)
        self._writer = facts.is_writer(tp_rank)
        self._timeout_s = transfer_timeout_s
        self._block_layout = Layout.MLA if facts.mla else Layout.CANONICAL
        self._block_dtype = DType.from_name(facts.kv_dtype)
        # Tokens are dimension 1 of an MLA chunk [L, T, D], dimension 3 of a canonical one [L, 2, H, T, D].
        self._token_dim = 1 if facts.mla else 3
        self._layers: list[tuple[torch.Tensor, PagedLayout]] = []
        self._load_errors: set[int] = set()  # this step's, until vLLM collects them
        self._unsettled: set[int] = set()  # failed blocks the scheduler has not yet settled
        self.counters = Counters()

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Keeps each layer's tensor with its detected layout, in the chunk's layer order.

        Raises:
            ValueError: a layer of the KV-cache group is missing, has another dtype, or a layout
                this connector does not know.
        """
        f = self._facts
        missing = [name for name in f.layer_names if name not in kv_caches]
        if missing:
            raise ValueError(f"register_kv_caches: no tensor for layer(s) {missing}")
        layers = []
        for name in f.layer_names:
            cache = kv_caches[name]
            if cache.dtype != f.torch_dtype:
                raise ValueError(f"layer {name!r}: paged KV tensor is {cache.dtype}, the KV-cache spec {f.torch_dtype}")
            layout = detect_layout(
                name,
                tuple(cache.shape),
                num_kv_heads=f.num_kv_heads,
                head_size=f.head_size,
                block_size=f.block_size,
                mla=f.mla,
            )
            layers.append((cache, layout))
        self._layers = layers
        log.info("kvcache connector: %d layers, paged layout %s", len(layers), layers[0][1].kind.name)

    # -- loads ---------------------------------------------------------------------------------

    def start_load_kv(self, loads: Sequence[RequestTransfer], settled_failures: Sequence[int] = ()) -> None:
        """Fetches the step's chunks and writes them into their blocks (synchronously).

        Args:
            loads: The step's loads.
            settled_failures: Failed blocks of earlier steps that vLLM now recomputes.
        """
        self._unsettled.difference_update(settled_failures)
        if not loads:
            return
        started = time.perf_counter()
        fetched = self._fetch(loads)
        blocks: list[torch.Tensor] = []
        offsets: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        bs, c = self._facts.block_size, self._facts.chunk_tokens
        for transfer in loads:
            for position, chunk in enumerate(transfer.chunks):
                tensor = fetched.get((transfer.namespaces[self._shard], chunk.keys[self._shard]))
                if tensor is None:
                    # This chunk and every later one of the request: vLLM recomputes from the first bad block.
                    failed = transfer.block_ids[chunk.start // bs : math.ceil(transfer.end / bs)]
                    self._load_errors.update(failed)
                    self._unsettled.update(failed)
                    self.counters.load_failures += len(transfer.chunks) - position
                    break
                b, o = token_slots(transfer.block_ids, chunk.start, chunk.end, bs)
                blocks.append(b)
                offsets.append(o)
                first = chunk.start - chunk.index * c
                values.append(tensor.narrow(self._token_dim, first, chunk.end - chunk.start))
                self.counters.load_chunks += 1
                self.counters.load_bytes += tensor.nbytes
        if values:
            self._scatter(torch.cat(blocks), torch.cat(offsets), torch.cat(values, dim=self._token_dim))
        self.counters.load_s += time.perf_counter() - started

    def take_load_errors(self) -> set[int]:
        """Block ids that failed to load since the last call."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def _fetch(self, loads: Sequence[RequestTransfer]) -> dict[tuple[str, bytes], torch.Tensor]:
        """The step's chunks that arrived intact and in the expected shape, by (namespace, key)."""
        wanted: dict[str, dict[bytes, ChunkRef]] = {}
        for transfer in loads:
            by_key = wanted.setdefault(transfer.namespaces[self._shard], {})
            for chunk in transfer.chunks:
                by_key[chunk.keys[self._shard]] = chunk
        out: dict[tuple[str, bytes], torch.Tensor] = {}
        if not self._breaker.allow():
            return out
        for namespace, by_key in wanted.items():
            try:
                blocks = self._client.get_many(namespace, list(by_key), timeout_s=self._timeout_s)
            except KVCacheError as exc:
                if self._breaker.failure():
                    log.warning("kvcache get failed (%s); loads fail for %.1f s", exc, self._breaker.cooldown_s)
                return out
            for (key, chunk), block in zip(by_key.items(), blocks, strict=True):
                if block is not None and self._acceptable(block, chunk):
                    out[(namespace, key)] = block_to_tensor(block, verify=False)  # the SDK verified it under `key`
        self._breaker.success()
        return out

    def _acceptable(self, block: bytes, chunk: ChunkRef) -> bool:
        """Whether a verified block holds this chunk in our layout: a block with a valid checksum
        can still be the wrong thing (another writer's bug), and scattering it would corrupt KV."""
        header, _ = decode_block(block, verify=False)
        expected = self._facts.chunk_shape(chunk.num_tokens)
        if (header.layout, header.dtype, header.shape) == (self._block_layout, self._block_dtype, expected):
            return True
        log.error(
            "kvcache chunk %s refused: %s %s %s, expected %s %s %s",
            chunk.keys[self._shard].hex(),
            header.layout.name,
            header.dtype.name,
            header.shape,
            self._block_layout.name,
            self._block_dtype.name,
            expected,
        )
        return False

    def _scatter(self, blocks: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor) -> None:
        device = self._layers[0][0].device
        blocks, offsets, values = blocks.to(device), offsets.to(device), values.to(device)
        for layer, (cache, layout) in enumerate(self._layers):
            layout.scatter(cache, blocks, offsets, values[layer])

    # -- saves ---------------------------------------------------------------------------------

    def wait_for_save(self, saves: Sequence[RequestTransfer]) -> None:
        """Stores the step's completed chunks; returns when the server has answered."""
        if not saves or not self._writer:
            return
        good = [s for s in saves if self._unsettled.isdisjoint(s.block_ids)]
        self.counters.save_failures += sum(len(s.chunks) for s in saves) - sum(len(s.chunks) for s in good)
        if not good:
            return
        if not self._breaker.allow():
            self.counters.save_failures += sum(len(s.chunks) for s in good)
            return
        started = time.perf_counter()
        staged = self._gather(good)
        items: dict[str, list[tuple[bytes, BlockData]]] = {}
        position = 0
        for transfer in good:
            namespace = items.setdefault(transfer.namespaces[self._shard], [])
            for chunk in transfer.chunks:
                tensor = staged.narrow(self._token_dim, position, chunk.end - chunk.start)
                key = chunk.keys[self._shard]
                namespace.append((key, tensor_block_parts(tensor, key, self._block_layout)))
                position += chunk.end - chunk.start
        for namespace, blocks in items.items():
            if self._breaker.state is BreakerState.OPEN:  # a put of this step failed already
                self.counters.save_failures += len(blocks)
                continue
            try:
                result = self._client.put_many(namespace, blocks, timeout_s=self._timeout_s)
            except KVCacheError as exc:
                self.counters.save_failures += len(blocks)
                if self._breaker.failure():
                    log.warning("kvcache put failed (%s); saves are dropped for %.1f s", exc, self._breaker.cooldown_s)
                continue
            self._breaker.success()
            self.counters.save_chunks += result.stored
            self.counters.save_failures += len(blocks) - result.stored
            self.counters.save_bytes += result.bytes_sent
        self.counters.save_s += time.perf_counter() - started

    def _gather(self, saves: Sequence[RequestTransfer]) -> torch.Tensor:
        """Every token to save, in canonical layout on the host: [L, 2, H, T, D] (MLA: [L, T, D])."""
        bs = self._facts.block_size
        slots = [token_slots(s.block_ids, c.start, c.end, bs) for s in saves for c in s.chunks]
        blocks = torch.cat([b for b, _ in slots])
        offsets = torch.cat([o for _, o in slots])
        staged = torch.empty(self._facts.chunk_shape(len(blocks)), dtype=self._facts.torch_dtype)
        device = self._layers[0][0].device
        blocks, offsets = blocks.to(device), offsets.to(device)
        for layer, (cache, layout) in enumerate(self._layers):
            staged[layer].copy_(layout.gather(cache, blocks, offsets))
        return staged
