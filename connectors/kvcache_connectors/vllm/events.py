"""vLLM KV cache events for what kvcache stored, so KV-aware routers see it.

vLLM's scheduler publishes, every step, its KV-cache manager's events together with
the connector's `take_events()` (vllm/v1/core/sched/scheduler.py), through the
publisher chosen by `--kv-events-config` (ZMQ, msgpack). Routers that score replicas
by cached prefix (llm-d's precise prefix-cache scorer, Dynamo's KV router) index
`BlockStored` events by vLLM's own block hashes, so an event for a stored chunk names
its blocks exactly as the scheduler's prefix cache does: `request.block_hashes`
converted as vLLM converts its own (`maybe_convert_block_hash`: the low 64 bits as an
int by default), the parent hash, the blocks' token ids, LoRA and the extra keys
(multimodal inputs, cache_salt) that entered each hash. Only full blocks have hashes:
a prompt's partial last block, stored inside a partial chunk, has no event.

The medium is MEDIUM_KVCACHE, so a router can tell blocks kvcache holds (reachable by
every replica that shares the server) from the GPU ones the engine reports itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.distributed.kv_events import BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, maybe_convert_block_hash, to_event_extra_keys

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

MEDIUM_KVCACHE = "KVCACHE"


class StoredBlockEvents:
    """Turns "request R's blocks [first, end) are stored in kvcache" into vLLM `BlockStored` events.

    Scheduler side only, on the scheduler's thread. Events wait until `take` (the
    connector's `take_events`, which vLLM calls once per step).
    """

    def __init__(self, block_size: int, *, enabled: bool = True, medium: str = MEDIUM_KVCACHE) -> None:
        """
        Args:
            block_size: vLLM's block size, the size of the blocks `request.block_hashes` hash (the
                connector serves one KV-cache group without context parallelism, so they agree).
            enabled: Whether vLLM publishes KV cache events (`--kv-events-config`); when not,
                `blocks_stored` records nothing.
            medium: The events' medium.
        """
        self._block_size = block_size
        self._enabled = enabled
        self._medium = medium
        self._events: list[KVCacheEvent] = []

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig, block_size: int) -> StoredBlockEvents:
        """Enabled when vLLM publishes KV cache events (`--kv-events-config` with enable_kv_cache_events)."""
        events_config = vllm_config.kv_events_config
        return cls(block_size, enabled=events_config is not None and events_config.enable_kv_cache_events)

    @property
    def enabled(self) -> bool:
        """Whether vLLM publishes KV cache events, so events are recorded."""
        return self._enabled

    def blocks_stored(self, request: Request, first_block: int, end_block: int) -> None:
        """Records that kvcache holds the request's blocks first_block..end_block-1.

        Call it once the server has confirmed the chunks covering them. Blocks vLLM has not
        hashed (a partial last block, or beyond what it computed) are left out.
        """
        event = self.event(request, first_block, end_block)
        if event is not None:
            self._events.append(event)

    def event(self, request: Request, first_block: int, end_block: int) -> BlockStored | None:
        """The `BlockStored` event of the request's hashed blocks in first_block..end_block-1, if any.

        Built from the request as it is now: a caller whose confirmation may come after vLLM
        freed the request builds the event when it plans the save and records it with `add`.
        """
        end_block = min(end_block, len(request.block_hashes))
        if not self._enabled or first_block < 0 or first_block >= end_block:
            return None
        bs = self._block_size
        extra_keys: list[tuple | None] = []
        mm_index = 0
        for block in range(first_block, end_block):
            keys, mm_index = generate_block_hash_extra_keys(request, block * bs, (block + 1) * bs, mm_index)
            extra_keys.append(keys)
        lora = request.lora_request
        return BlockStored(
            block_hashes=[maybe_convert_block_hash(h) for h in request.block_hashes[first_block:end_block]],
            parent_block_hash=(
                maybe_convert_block_hash(request.block_hashes[first_block - 1]) if first_block > 0 else None
            ),
            token_ids=list(request.all_token_ids[first_block * bs : end_block * bs]),
            block_size=bs,
            lora_id=lora.adapter_id if lora else None,
            medium=self._medium,
            lora_name=lora.name if lora else None,
            extra_keys=to_event_extra_keys(extra_keys),
            group_idx=0,
            session_id=request.session_id,
        )

    def add(self, event: BlockStored | None) -> None:
        """Records an event built earlier by `event`."""
        if event is not None and self._enabled:
            self._events.append(event)

    def take(self) -> list[KVCacheEvent]:
        """The events recorded since the last call, oldest first."""
        events, self._events = self._events, []
        return events
