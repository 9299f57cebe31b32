"""What the scheduler tells the workers each step: which chunks to load into and save from which blocks.

The scheduler-side connector builds one `KVCacheConnectorMetadata` per step; vLLM
ships it to every worker with the step's SchedulerOutput. It is self-contained (a
worker keeps no per-request state between steps) and carries each chunk's key in
the keys of every block of it (every shard's heads), so a worker needs only its shard index to act on it.

A hybrid model's request moves one RequestTransfer per KV-cache group: each group has its
own namespaces, keys and block ids, and a sliding-window group moves only the chunks
inside its window (docs/vllm.md, "Hybrid models").

    request tokens  0 ............................................ L-1
    chunks          |  chunk 0  |  chunk 1  |  chunk 2  | tail |
    blocks          |b0|b1|b2|b3|b4|b5|b6|b7|b8|b9|..
    a ChunkRef      index=1, tokens [start, end) within [1*C, 1*C + num_tokens)

Token t of the request lives in block block_ids[t // block_size] at offset t % block_size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass(frozen=True, slots=True)
class ChunkRef:
    """One stored chunk and the part of it to move.

    Attributes:
        index: Chunk number within the prompt; the chunk covers tokens from index * chunk_tokens.
        keys: The keys of the chunk's stored blocks in the transfer's group: one per block of
            heads_per_block KV heads (head-sharded), or one per shard (MLA); see KVFacts.units.
        num_tokens: Tokens of the chunk (those its key names): chunk_tokens, or fewer for a tail.
        start: First token to move (absolute position in the request). A sliding-window group
            saves a chunk from the first block vLLM still holds, so its stored block may hold
            only the chunk's last end - start tokens.
        end: One past the last token to move.
    """

    index: int
    keys: tuple[bytes, ...]
    num_tokens: int
    start: int
    end: int


ChunkId = tuple[str, int, int]
"""A saved chunk as the workers report it back: (request id, chunk index, tokens it holds).

The token count tells apart chunks of the same index: a prompt's partial tail, the full
chunk that generated tokens complete later, and a finished request's final partial chunk."""


@dataclass(frozen=True, slots=True)
class RequestTransfer:
    """The chunks of one request to move this step.

    Attributes:
        request_id: vLLM's request id.
        namespaces: The request's namespace names in the group: one (head-sharded), or one per shard (MLA).
        block_ids: The request's block ids in the group, at least up to the last token moved.
        chunks: In token order; without gaps, except where a sliding-window group's save starts a
            chunk past its freed first blocks.
        wait_s: For a load: how long a worker may keep asking for chunks not stored yet (a P/D
            hand-off whose producer is still writing them); 0 fails a missing chunk at once.
        group: The KV-cache group (vLLM's kv_cache_group_id) whose layers the chunks fill.
        heads_per_block: KV heads per stored block; None: a shard's heads in one block (ignored for MLA).
        retain_ttl_s: For a save: the retention its puts ask of the server (PutRequest.retain_ttl_s), from
            the request's hint or the connector's retain_ttl_s setting; 0 asks for none.
    """

    request_id: str
    namespaces: tuple[str, ...]
    block_ids: tuple[int, ...]
    chunks: tuple[ChunkRef, ...]
    wait_s: float = 0.0
    group: int = 0
    heads_per_block: int | None = None
    retain_ttl_s: float = 0.0

    def namespace_for(self, shard: int) -> str:
        """The namespace a shard's blocks are in."""
        return self.namespaces[shard if len(self.namespaces) > 1 else 0]

    @property
    def start(self) -> int:
        return self.chunks[0].start

    @property
    def end(self) -> int:
        return self.chunks[-1].end


@dataclass(frozen=True, slots=True)
class KVCacheConnectorMetadata(KVConnectorMetadata):
    """One step's work for every worker.

    Attributes:
        loads: Chunks to fetch and scatter into blocks in the background (asynchronous loads).
        saves: Chunks whose tokens are all computed by the end of this step: gathered
            from blocks after the forward pass and stored in the background.
        sent: Finished requests whose blocks vLLM keeps for this step's saves (request_finished
            returned True): every worker reports them in get_finished once the saves are copied out.
        settled_load_failures: Block ids whose failed loads the scheduler has processed since
            the last step: vLLM recomputes them from here on, so saves from them are sound again.
    """

    loads: tuple[RequestTransfer, ...] = ()
    saves: tuple[RequestTransfer, ...] = ()
    sent: tuple[str, ...] = ()
    settled_load_failures: tuple[int, ...] = ()


@dataclass(slots=True)
class StoredChunks(KVConnectorWorkerMetadata):
    """What the workers' save threads heard back from the server since the last step.

    Workers build it in build_connector_worker_meta; vLLM's KVOutputAggregator merges every
    worker's with `aggregate` and hands the result to the scheduler side in
    KVConnectorOutput.kv_connector_worker_meta.

    Attributes:
        stored: Per chunk, the streams whose put of it the server confirmed (every block stored
            before the call returned); stream = group * shards + shard.
        failed: Chunks some shard did not store (put failed or partly stored, save dropped or
            refused): they are never announced.
    """

    stored: dict[ChunkId, frozenset[int]] = field(default_factory=dict)
    failed: set[ChunkId] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> StoredChunks:
        if not isinstance(other, StoredChunks):
            raise TypeError(f"cannot aggregate StoredChunks with {type(other).__name__}")
        stored = dict(self.stored)
        for chunk, shards in other.stored.items():
            stored[chunk] = stored.get(chunk, frozenset()) | shards
        return StoredChunks(stored, self.failed | other.failed)
