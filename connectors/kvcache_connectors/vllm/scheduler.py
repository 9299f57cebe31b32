"""The scheduler-side connector: how much of a prompt kvcache holds, and each step's load and save plan.

Runs in vLLM's EngineCore process, on the scheduler's thread, once per engine.

    get_num_new_matched_tokens   key the prompt (every shard's namespace), one Lookup per shard,
                                 answer with the tokens beyond vLLM's local hit that can be loaded
    update_state_after_alloc     turn that answer and the allocated blocks into a load for this step
    build_connector_meta         add the saves: chunks whose last token is computed by this step
    update_connector_output      chunks that failed to load are saved again once recomputed; the
                                 next step's metadata tells the workers the failure is settled
    request_finished             forget the request

Loads are synchronous (vLLM runs them in start_load_kv before the forward pass),
so a step's hit is in the blocks before any token attends to it. The scheduler
never retries a lookup: a failed or late one is a miss, and the circuit breaker
makes an unreachable server cost one `lookup_timeout_s` per cooldown.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from kvcache_client.client import KVCacheClient
from kvcache_connectors.vllm.metadata import ChunkRef, KVCacheConnectorMetadata, RequestTransfer
from kvcache_connectors.vllm.namespaces import Extra, KVFacts
from kvcache_connectors.vllm.stats import Counters
from kvcache_core.breaker import CircuitBreaker
from kvcache_core.errors import KVCacheError
from kvcache_core.keys import chunk_keys

log = logging.getLogger(__name__)


def request_extra(request: Request) -> Extra | None:
    """The request's own namespace facts, or None when its KV is not a function of its token ids.

    A LoRA adapter changes every layer's KV, and so does an image behind placeholder
    tokens: both go into the namespace. Prompt embeddings have no token ids to key.
    """
    if request.prompt_token_ids is None or request.prompt_embeds is not None:
        return None
    extra: list[tuple[str, str]] = []
    if request.lora_request is not None:
        extra.append(("vllm.lora", request.lora_request.lora_name))
    if request.mm_features:
        items = ";".join(f"{f.identifier}@{f.mm_position.offset}" for f in request.mm_features)
        extra.append(("vllm.mm", items))
    return tuple(extra)


@dataclass(frozen=True, slots=True)
class PromptPlan:
    """A prompt's chunks: each chunk's key in every shard's namespace.

    Attributes:
        namespaces: Namespace names, one per shard.
        keys: keys[i][shard] is chunk i's key (the last chunk may be a partial tail).
        num_tokens: Prompt length.
        chunk_tokens: Tokens per full chunk.
    """

    namespaces: tuple[str, ...]
    keys: tuple[tuple[bytes, ...], ...]
    num_tokens: int
    chunk_tokens: int

    def chunk_len(self, index: int) -> int:
        return min(self.chunk_tokens, self.num_tokens - index * self.chunk_tokens)

    def chunk_end(self, index: int) -> int:
        return index * self.chunk_tokens + self.chunk_len(index)

    def tokens_in(self, num_chunks: int) -> int:
        """Tokens covered by the first num_chunks chunks."""
        return min(num_chunks * self.chunk_tokens, self.num_tokens)

    def chunk_ref(self, index: int, start: int, end: int) -> ChunkRef:
        return ChunkRef(index=index, keys=self.keys[index], num_tokens=self.chunk_len(index), start=start, end=end)


@dataclass(frozen=True, slots=True)
class _Lookup:
    """The answer of the last get_num_new_matched_tokens for a request, for update_state_after_alloc."""

    plan: PromptPlan
    stored_chunks: int
    local_tokens: int


@dataclass(slots=True)
class _Tracked:
    """A request admitted with a plan: what it still has to save, where it loaded."""

    plan: PromptPlan
    next_save: int
    loaded_blocks: dict[int, int] = field(default_factory=dict)  # block id -> chunk index loaded into it


class SchedulerSide:
    """The scheduler process's half of KVCacheConnector."""

    def __init__(
        self,
        facts: KVFacts,
        client: KVCacheClient,
        breaker: CircuitBreaker,
        *,
        lookup_timeout_s: float,
        load: bool,
        save: bool,
        save_partial_chunks: bool,
    ) -> None:
        """
        Args:
            facts: The instance's namespace facts.
            client: A client with no retries.
            breaker: Guards every call to the server.
            lookup_timeout_s: Deadline of one Lookup.
            load: Offer hits to vLLM (kv_consumer, kv_both).
            save: Plan saves (kv_producer, kv_both).
            save_partial_chunks: Also save a prompt's final partial chunk.
        """
        self._facts = facts
        self._client = client
        self._breaker = breaker
        self._lookup_timeout_s = lookup_timeout_s
        self._load = load
        self._save = save
        self._save_partial = save_partial_chunks
        self._plans: dict[str, PromptPlan] = {}
        self._lookups: dict[str, _Lookup] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._pending_loads: list[RequestTransfer] = []
        self._settled_failures: set[int] = set()
        self.counters = Counters()

    @property
    def open_requests(self) -> int:
        """Requests this side holds state for; 0 once every request finished (nothing leaks)."""
        return len(self._plans.keys() | self._lookups.keys() | self._tracked.keys())

    # -- hooks ---------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond the local hit that kvcache holds for every shard, loaded synchronously."""
        plan = self._plan(request)
        if plan is None:
            return 0, False
        stored = self._lookup(plan)
        # A memo for update_state_after_alloc, which vLLM calls right after for the same request;
        # calling this again simply replaces it.
        self._lookups[request.request_id] = _Lookup(plan, stored, num_computed_tokens)
        if not self._load:
            return 0, False
        # vLLM must compute at least one token of a sequence itself (its scheduler asserts it for
        # synchronous loads), so a hit of every token loads all but the last: the last chunk is
        # then loaded in part, into a partly filled block, and vLLM computes the final token.
        loadable = min(plan.tokens_in(stored), request.num_tokens - 1)
        return max(0, loadable - num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Starts tracking an admitted request; plans its load when vLLM accepted a hit."""
        lookup = self._lookups.pop(request.request_id, None)
        if lookup is None:
            return
        plan = lookup.plan
        tracked = _Tracked(plan, next_save=lookup.stored_chunks)
        self._tracked[request.request_id] = tracked
        self.counters.lookup_tokens += max(0, plan.num_tokens - lookup.local_tokens)
        self.counters.hit_tokens += num_external_tokens
        if num_external_tokens == 0:
            return
        start = lookup.local_tokens
        end = start + num_external_tokens
        if not self._load or end > plan.tokens_in(lookup.stored_chunks):
            raise ValueError(
                f"request {request.request_id}: vLLM asked to load tokens [{start}, {end}) but kvcache "
                f"offered {plan.tokens_in(lookup.stored_chunks) if self._load else 0}"
            )
        (block_ids,) = blocks.get_block_ids()
        c, bs = plan.chunk_tokens, self._facts.block_size
        indices = range(start // c, (end - 1) // c + 1)
        chunks = tuple(plan.chunk_ref(i, max(start, i * c), min(end, plan.chunk_end(i))) for i in indices)
        num_blocks = math.ceil(end / bs)
        self._pending_loads.append(
            RequestTransfer(request.request_id, plan.namespaces, tuple(block_ids[:num_blocks]), chunks)
        )
        tracked.loaded_blocks = {block_ids[b]: b * bs // c for b in range(start // bs, num_blocks)}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVCacheConnectorMetadata:
        """This step's loads (planned at admission) and saves (chunks completed by this step)."""
        saves = list(self._plan_saves(scheduler_output)) if self._save else []
        meta = KVCacheConnectorMetadata(
            loads=tuple(self._pending_loads),
            saves=tuple(saves),
            settled_load_failures=tuple(sorted(self._settled_failures)),
        )
        self._pending_loads = []
        self._settled_failures = set()
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Chunks whose load failed will be recomputed by vLLM; save them again (repairing the entry)."""
        if not output.invalid_block_ids:
            return
        self._settled_failures |= output.invalid_block_ids
        for tracked in self._tracked.values():
            failed = [chunk for block, chunk in tracked.loaded_blocks.items() if block in output.invalid_block_ids]
            if failed:
                tracked.next_save = min(tracked.next_save, *failed)

    def request_finished(self, request: Request) -> None:
        for table in (self._plans, self._lookups, self._tracked):
            table.pop(request.request_id, None)

    # -- internals -----------------------------------------------------------------------------

    def _plan(self, request: Request) -> PromptPlan | None:
        extra = request_extra(request)
        if extra is None:
            return None
        plan = self._plans.get(request.request_id)
        if plan is not None and plan.num_tokens == request.num_prompt_tokens:
            return plan
        namespaces = self._facts.namespaces(request.cache_salt or "", extra)
        per_shard = [chunk_keys(request.prompt_token_ids, ns) for ns in namespaces]
        plan = PromptPlan(
            namespaces=tuple(ns.name for ns in namespaces),
            keys=tuple(zip(*per_shard, strict=True)),
            num_tokens=request.num_prompt_tokens,
            chunk_tokens=self._facts.chunk_tokens,
        )
        self._plans[request.request_id] = plan
        return plan

    def _lookup(self, plan: PromptPlan) -> int:
        """Chunks stored in every shard's namespace (a prefix); 0 when the server cannot say."""
        if not self._breaker.allow():
            self.counters.lookups_skipped += 1
            return 0
        self.counters.lookups += 1
        stored = len(plan.keys)
        try:
            for shard, namespace in enumerate(plan.namespaces):
                if stored == 0:
                    break
                keys = [chunk[shard] for chunk in plan.keys[:stored]]
                stored = self._client.lookup(namespace, keys, timeout_s=self._lookup_timeout_s).prefix_length
        except KVCacheError as exc:
            self.counters.lookup_failures += 1
            if self._breaker.failure():
                log.warning("kvcache lookup failed (%s); prompts are misses for %.1f s", exc, self._breaker.cooldown_s)
            return 0
        self._breaker.success()
        return stored

    def _plan_saves(self, scheduler_output: SchedulerOutput) -> Iterator[RequestTransfer]:
        for request_id, num_computed in _scheduled(scheduler_output):
            tracked = self._tracked.get(request_id)
            if tracked is None:
                continue
            plan = tracked.plan
            done = min(num_computed + scheduler_output.num_scheduled_tokens[request_id], plan.num_tokens)
            first = last = tracked.next_save
            while (
                last < len(plan.keys)
                and plan.chunk_end(last) <= done
                and (self._save_partial or plan.chunk_len(last) == plan.chunk_tokens)
            ):
                last += 1
            if last == first:
                continue
            block_state = scheduler_output.kv_connector_block_state
            block_ids = block_state.get_block_ids(request_id) if block_state is not None else None
            if block_ids is None:
                raise RuntimeError(f"vLLM gave no block ids for scheduled request {request_id}")
            num_blocks = math.ceil(plan.chunk_end(last - 1) / self._facts.block_size)
            chunks = tuple(plan.chunk_ref(i, i * plan.chunk_tokens, plan.chunk_end(i)) for i in range(first, last))
            tracked.next_save = last
            yield RequestTransfer(request_id, plan.namespaces, tuple(block_ids[0][:num_blocks]), chunks)


def _scheduled(scheduler_output: SchedulerOutput) -> Iterator[tuple[str, int]]:
    """(request id, tokens computed before this step) of every request scheduled in the step."""
    for new in scheduler_output.scheduled_new_reqs:
        yield new.req_id, new.num_computed_tokens
    cached = scheduler_output.scheduled_cached_reqs
    yield from zip(cached.req_ids, cached.num_computed_tokens, strict=True)
