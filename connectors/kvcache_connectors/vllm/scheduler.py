"""The scheduler-side connector: how much of a prompt kvcache holds, and each step's load and save plan.

Runs in vLLM's EngineCore process, on the scheduler's thread, once per engine.

    get_num_new_matched_tokens   key the prompt (every group's namespaces), one Lookup per
                                 namespace (remembered while the request waits), answer with
                                 the tokens beyond vLLM's local hit that can be loaded, asynchronously
    update_state_after_alloc     turn that answer and the allocated blocks into a load; read the
                                 request's retention hint (kv_transfer_params), which its saves carry
    build_connector_meta         add the saves: chunks whose last token is computed by this step,
                                 generated tokens' included (write-back), and the final partial
                                 chunk of each request that finished in the last step
    update_connector_output      chunks that failed to load are saved again once recomputed; the
                                 next step's metadata tells the workers the failure is settled;
                                 chunks every shard's put stored become KV cache events
    request_finished             forget the request; with write-back, plan its final partial
                                 chunk (prompt + output) and keep its blocks until it is copied out;
                                 a producer returns the P/D hand-off (kv_transfer_params naming the
                                 prompt chunks it saved or is still putting), which a consumer's
                                 lookup trusts and its load waits for (bounded by handoff_timeout_s)

Loads are asynchronous: vLLM parks a request with a hit in WAITING_FOR_REMOTE_KVS
(scheduling none of its tokens) while the workers fetch and scatter its chunks in
the background, and admits it once every worker reported it in get_finished. The
scheduler never retries a lookup and asks at most once per request and token
sequence: a failed or late answer is a miss, remembered like a hit, and the circuit
breaker makes an unreachable server cost one `lookup_timeout_s` per cooldown.

Hybrid models (several KV-cache groups, vLLM's hybrid memory allocator): the hit is the
longest prefix every group can serve under vLLM's own rule for it. A full-attention
group needs every chunk before the hit point; a sliding-window group only the blocks
vLLM keeps allocated below it (KVFacts.needed_from), so an evicted early chunk costs it
nothing. Loads and saves move one RequestTransfer per group, with that group's blocks;
a sliding-window group loads only its window, and saves a chunk from the first block vLLM
still holds (it frees those that left the window: the null block in its table), so nothing
unwritten is ever stored. A hybrid model's failed loads arrive as failed requests
(failed_recving): vLLM recomputes them whole.

KV cache events (with --kv-events-config): each planned save of a chunk with full
blocks gets its BlockStored event built at once, from the request as it is then (the
confirmation may come after vLLM freed it). The event waits until every shard's writer
reported the chunk stored (the workers' StoredChunks, in kv_connector_worker_meta),
and is dropped when any shard reports it failed, or PENDING_EVENT_STEPS steps after
its request finished.

Longer than the project's ~500-line module guideline: the scheduler side's per-request state machine
(lookups, async loads, saves, write-back, hand-off, pending events) is one lifecycle that vLLM drives
through these methods; split, each part would reach into the others' request records.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_events import BlockStored
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from kvcache_client.client import KVCacheClient
from kvcache_connectors.vllm.events import StoredBlockEvents
from kvcache_connectors.vllm.metadata import ChunkRef, KVCacheConnectorMetadata, RequestTransfer, StoredChunks
from kvcache_connectors.vllm.namespaces import Extra, KVFacts, lora_fact, mm_fact
from kvcache_connectors.vllm.stats import Counters
from kvcache_core.breaker import CircuitBreaker
from kvcache_core.errors import KVCacheError
from kvcache_core.hints import transfer_params_ttl_s
from kvcache_core.keys import chunk_key, chunk_keys

log = logging.getLogger(__name__)

PENDING_EVENT_STEPS = 256
"""Steps a finished request's unconfirmed events wait for their confirmation (the puts run in the
background, behind at most save_queue_steps queued saves); later ones are dropped, never sent."""


def request_extra(request: Request) -> Extra | None:
    """The request's own namespace facts, or None when its KV is not a function of its token ids.

    A LoRA adapter changes every layer's KV, and so does an image behind placeholder
    tokens: both go into the namespace (lora_fact, mm_fact). Prompt embeddings have no
    token ids to key.
    """
    if request.prompt_token_ids is None or request.prompt_embeds is not None:
        return None
    extra: list[tuple[str, str]] = []
    if (lora := request.lora_request) is not None:
        extra.append(("vllm.lora", lora_fact(lora.lora_name, lora.lora_path)))
    if request.mm_features:
        extra.append(("vllm.mm", mm_fact((f.identifier, f.mm_position.offset) for f in request.mm_features)))
    return tuple(extra)


GroupKeys = tuple[tuple[bytes, ...], ...]
"""One chunk's keys: [group][namespace of the group]."""


@dataclass(frozen=True, slots=True)
class PromptPlan:
    """A prompt's chunks: each chunk's key in every group's namespaces.

    A group has one namespace (head-sharded), or one per shard (MLA): [group][n] below. The keys
    are chunk keys, which chain; the keys of a chunk's stored blocks derive from them
    (KVFacts.unit_keys).

    Attributes:
        namespaces: Namespace names, [group][n].
        keys: keys[i][group][n] is chunk i's key (the last chunk may be a partial tail).
        num_tokens: Prompt length.
        chunk_tokens: Tokens per full chunk.
        roots: Each namespace's fingerprint, [group][n] (the parent of chunk 0's key).
    """

    namespaces: tuple[tuple[str, ...], ...]
    keys: tuple[GroupKeys, ...]
    num_tokens: int
    chunk_tokens: int
    roots: GroupKeys = ()

    def chunk_len(self, index: int) -> int:
        return min(self.chunk_tokens, self.num_tokens - index * self.chunk_tokens)

    def chunk_end(self, index: int) -> int:
        return index * self.chunk_tokens + self.chunk_len(index)

    def tokens_in(self, num_chunks: int) -> int:
        """Tokens covered by the first num_chunks chunks."""
        return min(num_chunks * self.chunk_tokens, self.num_tokens)

    def chunk_ref(self, facts: KVFacts, index: int, start: int, end: int) -> ChunkRef:
        """Tokens [start, end) of chunk `index` in a group, with the keys of its stored blocks."""
        keys = facts.unit_keys(self.keys[index][facts.group], facts.heads_per_block)
        return ChunkRef(index=index, keys=keys, num_tokens=self.chunk_len(index), start=start, end=end)


HANDOFF_PARAM = "kvcache_handoff"
"""The kv_transfer_params key a producer returns from request_finished (see handoff_params)."""


@dataclass(frozen=True, slots=True)
class _Answer:
    """A request's lookup answer, kept while the request exists and its plan is the same object.

    Attributes:
        plan: The prompt's chunks.
        stored_chunks: Chunks to offer: stored, or named by the producer's hand-off.
        awaited: Whether some of them may still be on their way (a P/D hand-off).
    """

    plan: PromptPlan
    stored_chunks: int
    awaited: bool = False


def handoff_params(plan: PromptPlan, num_chunks: int, heads_per_block: list[int]) -> dict[str, Any]:
    """What a producer tells the consumer of a P/D hand-off: its first num_chunks chunks are saved
    or being saved, as blocks of heads_per_block[group] KV heads. The consumer checks the last key
    against its own plan of the same prompt, and the block sizes against its own."""
    last_key = plan.keys[num_chunks - 1][0][0].hex()
    return {HANDOFF_PARAM: {"chunks": num_chunks, "last_key": last_key, "heads_per_block": heads_per_block}}


def handed_off_chunks(request: Request, plan: PromptPlan, heads_per_block: list[int]) -> int:
    """Chunks of the prompt a producer named in the request's kv_transfer_params; 0 when none, when
    they are not this plan's (another prompt, namespace or chunk size), or when the producer stores
    blocks of other sizes than this instance reads (waiting for them would be in vain)."""
    params = request.kv_transfer_params
    handoff = params.get(HANDOFF_PARAM) if isinstance(params, dict) else None
    if not isinstance(handoff, dict):
        return 0
    chunks, last_key = handoff.get("chunks"), handoff.get("last_key")
    if not isinstance(chunks, int) or not 0 < chunks <= len(plan.keys):
        return 0
    if plan.keys[chunks - 1][0][0].hex() != last_key:
        return 0
    theirs = handoff.get("heads_per_block", heads_per_block)
    if theirs != heads_per_block:
        log.warning(
            "kvcache: request %s was prefilled by an instance storing blocks of %s KV heads, this one reads %s; "
            "set kv_heads_per_block alike on both (docs/vllm.md, Mixed tensor parallelism)",
            request.request_id,
            theirs,
            heads_per_block,
        )
        return 0
    return chunks


@dataclass(frozen=True, slots=True)
class _Lookup:
    """The answer of the last get_num_new_matched_tokens for a request, for update_state_after_alloc."""

    plan: PromptPlan
    stored_chunks: int
    local_tokens: int
    awaited: bool = False


@dataclass(slots=True)
class _Tracked:
    """A request admitted with a plan: what it still has to save, where it loaded.

    Chunk indices count over the whole sequence (prompt, then generated tokens): full chunk
    i holds tokens [i * C, (i + 1) * C). The prompt's partial tail, when it has one, is a
    chunk of its own (same index, fewer tokens, another key), saved once the prompt is computed.
    """

    request: Request
    plan: PromptPlan
    next_save: int  # first full chunk not saved yet
    tail_due: bool  # the prompt's partial tail is still to save
    loaded_blocks: dict[int, int] = field(default_factory=dict)  # block id -> chunk index loaded into it
    generated_keys: list[GroupKeys] = field(default_factory=list)  # full chunks past the prompt's
    retain_ttl_s: float = 0.0  # the retention its saves ask for (0: none)


@dataclass(slots=True)
class _PendingEvent:
    """A planned save's BlockStored event and the streams (group, shard) whose put the server confirmed."""

    event: BlockStored
    shards: frozenset[int] = frozenset()


class SchedulerSide:
    """The scheduler process's half of KVCacheConnector."""

    def __init__(
        self,
        groups: Sequence[KVFacts],
        client: KVCacheClient,
        breaker: CircuitBreaker,
        *,
        lookup_timeout_s: float,
        load: bool,
        save: bool,
        save_partial_chunks: bool,
        write_back: bool = False,
        handoff_timeout_s: float = 0.0,
        events: StoredBlockEvents | None = None,
        retain_ttl_s: float | None = None,
        max_retain_ttl_s: float = 3600.0,
    ) -> None:
        """
        Args:
            groups: The namespace facts of each KV-cache group, in vLLM's group order.
            client: A client with no retries.
            breaker: Guards every call to the server.
            lookup_timeout_s: Deadline of one Lookup.
            load: Offer hits to vLLM (kv_consumer, kv_both).
            save: Plan saves of prompts (kv_producer, kv_both).
            save_partial_chunks: Also save a prompt's final partial chunk.
            write_back: Also save the chunks that generated tokens complete, and a finished
                request's final partial chunk (a kv_consumer saves only those).
            handoff_timeout_s: How long a load may wait for chunks a producer's hand-off names
                that are not stored yet.
            events: Where BlockStored events of confirmed chunks go (None or disabled: nowhere).
            retain_ttl_s: The retention every request's saves ask for when its kv_transfer_params
                carry no hint (None: none).
            max_retain_ttl_s: The longest retention a hint may ask for; a longer one is cut to it.
        """
        self._groups = tuple(groups)
        self._facts = self._groups[0]  # the facts all groups share: block size, chunk tokens, shards
        self._null_block = 0  # vLLM's null block (BlockPool.null_block), see bind_block_pool
        self._heads_per_block = [facts.heads_per_block for facts in self._groups]  # as the hand-off names them
        self._client = client
        self._breaker = breaker
        self._lookup_timeout_s = lookup_timeout_s
        self._load = load
        self._save = save
        self._save_partial = save_partial_chunks
        self._write_back = write_back
        self._handoff_timeout_s = handoff_timeout_s
        self._retain_ttl_s = retain_ttl_s
        self._max_retain_ttl_s = max_retain_ttl_s
        self._finishing: list[RequestTransfer] = []  # final partial chunks of finished requests
        self._plans: dict[str, PromptPlan] = {}
        self._lookups: dict[str, _Lookup] = {}
        self._answers: dict[str, _Answer] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._pending_loads: list[RequestTransfer] = []
        self._settled_failures: set[int] = set()
        self._events = events if events is not None and events.enabled else None
        # Request id -> (chunk index, tokens) -> its event until confirmed; the step each finished.
        self._pending: dict[str, dict[tuple[int, int], _PendingEvent]] = {}
        self._finished_at: dict[str, int] = {}
        self._step = 0  # build_connector_meta calls
        self.counters = Counters()

    @property
    def open_requests(self) -> int:
        """Requests this side holds state for; 0 once every request finished (nothing leaks)."""
        return len(self._plans.keys() | self._lookups.keys() | self._answers.keys() | self._tracked.keys())

    @property
    def pending_events(self) -> int:
        """Events of planned saves not yet confirmed by every shard (bounded: see PENDING_EVENT_STEPS)."""
        return sum(len(events) for events in self._pending.values())

    def bind_block_pool(self, null_block_id: int) -> None:
        """Records vLLM's null block: the id a sliding-window group's table holds for freed blocks."""
        self._null_block = null_block_id

    # -- hooks ---------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond the local hit that kvcache holds for every shard, loaded asynchronously.

        vLLM calls this for a waiting request in every step until it admits it (a request
        held back for blocks, or preempted and waiting again): the first answer for the
        request's tokens is reused, so the scheduler's thread asks the server once.
        """
        plan = self._plan(request)
        if plan is None:
            return 0, False
        answer = self._answers.get(request.request_id)
        if answer is None or answer.plan is not plan:
            stored = self._lookup(plan)
            # A P/D hand-off: the producer's saves of these chunks may still be in flight. Offer
            # them anyway; the asynchronous load waits for them (bounded), then vLLM recomputes.
            named = handed_off_chunks(request, plan, self._heads_per_block) if self._load else 0
            answer = _Answer(plan, max(stored, named), awaited=named > stored)
            self._answers[request.request_id] = answer
        stored = answer.stored_chunks
        # A memo for update_state_after_alloc, which vLLM calls right after for the same request;
        # calling this again simply replaces it.
        self._lookups[request.request_id] = _Lookup(plan, stored, num_computed_tokens, answer.awaited)
        if not self._load:
            return 0, False
        # vLLM must compute at least one token of a sequence itself, so a hit of every token
        # loads all but the last: the last chunk is then loaded in part, into a partly filled
        # block, and vLLM computes the final token.
        loadable = min(plan.tokens_in(stored), request.num_tokens - 1)
        num_tokens = max(0, loadable - num_computed_tokens)
        return num_tokens, num_tokens > 0

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Starts tracking an admitted request; plans its load when vLLM accepted a hit.

        For an asynchronous load vLLM calls this twice: at admission with the hit, and again
        with 0 external tokens when the loaded request is scheduled; the second call finds
        no fresh lookup memo and changes nothing.
        """
        lookup = self._lookups.pop(request.request_id, None)
        if lookup is None:
            return
        plan = lookup.plan
        c = plan.chunk_tokens
        # Chunks stored already are not saved again; a consumer saves only what it generates.
        next_save = min(lookup.stored_chunks, plan.num_tokens // c)
        if not self._save:
            next_save = max(next_save, plan.num_tokens // c)
        tail_due = (
            self._save and self._save_partial and plan.num_tokens % c > 0 and lookup.stored_chunks < len(plan.keys)
        )
        tracked = _Tracked(request, plan, next_save=next_save, tail_due=tail_due, retain_ttl_s=self._retention(request))
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
        c, bs = plan.chunk_tokens, self._facts.block_size
        num_blocks = math.ceil(end / bs)
        wait_s = self._handoff_timeout_s if lookup.awaited else 0.0
        for facts, block_ids in zip(self._groups, blocks.get_block_ids(), strict=True):
            # A sliding-window group loads only the blocks vLLM allocated for its window.
            first = max(start, facts.needed_from(end))
            for b in range(first // bs, num_blocks):
                if block_ids[b] == self._null_block:
                    first = (b + 1) * bs
            if first >= end:
                continue
            indices = range(first // c, (end - 1) // c + 1)
            chunks = tuple(plan.chunk_ref(facts, i, max(first, i * c), min(end, plan.chunk_end(i))) for i in indices)
            self._pending_loads.append(
                RequestTransfer(
                    request.request_id,
                    plan.namespaces[facts.group],
                    tuple(block_ids[:num_blocks]),
                    chunks,
                    wait_s,
                    group=facts.group,
                    heads_per_block=facts.heads_per_block,
                )
            )
            tracked.loaded_blocks.update({block_ids[b]: b * bs // c for b in range(first // bs, num_blocks)})

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVCacheConnectorMetadata:
        """This step's loads (planned at admission) and saves (chunks completed by this step)."""
        saves = list(self._plan_saves(scheduler_output)) if self._save or self._write_back else []
        meta = KVCacheConnectorMetadata(
            loads=tuple(self._pending_loads),
            saves=(*saves, *self._finishing),
            sent=tuple(t.request_id for t in self._finishing),
            settled_load_failures=tuple(sorted(self._settled_failures)),
        )
        self._finishing = []
        self._pending_loads = []
        self._settled_failures = set()
        self._step += 1
        expired = [r for r, step in self._finished_at.items() if self._step - step > PENDING_EVENT_STEPS]
        for request_id in expired:
            del self._finished_at[request_id]
            self._pending.pop(request_id, None)
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Records the events of chunks every shard stored. Chunks whose load failed will be
        recomputed by vLLM; save them again (repairing the entry)."""
        if isinstance(output.kv_connector_worker_meta, StoredChunks):
            self._confirm(output.kv_connector_worker_meta)
        for request_id in output.failed_recving or ():
            # A hybrid model's failed load (vLLM recomputes the request from its first token): its
            # blocks are settled, every chunk is saved again, and a retry is offered nothing.
            tracked = self._tracked.get(request_id)
            if tracked is not None:
                self._settled_failures |= tracked.loaded_blocks.keys()
                tracked.next_save = 0
                plan = tracked.plan
                tracked.tail_due = self._save and self._save_partial and plan.num_tokens % plan.chunk_tokens > 0
            answer = self._answers.get(request_id)
            if answer is not None:
                self._answers[request_id] = _Answer(answer.plan, 0)
        if not output.invalid_block_ids:
            return
        self._settled_failures |= output.invalid_block_ids
        for request_id, tracked in self._tracked.items():
            failed = [chunk for block, chunk in tracked.loaded_blocks.items() if block in output.invalid_block_ids]
            if failed:
                tracked.next_save = min(tracked.next_save, *failed)
                tail = len(tracked.plan.keys) - 1
                if self._save and self._save_partial and tracked.plan.chunk_len(tail) < tracked.plan.chunk_tokens:
                    tracked.tail_due = tracked.tail_due or tail in failed
                # vLLM may send the request back to the waiting queue (nothing of it loaded):
                # offer it no more than what loaded, or it would load the same chunk again.
                answer = self._answers.get(request_id)
                if answer is not None:
                    self._answers[request_id] = _Answer(answer.plan, min(answer.stored_chunks, *failed))

    def request_finished(
        self, request: Request, block_ids: Sequence[Sequence[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Forgets the request, given its block ids per KV-cache group. Returns (keep its blocks,
        kv_transfer_params):

        - keep its blocks until the workers copied out its final partial chunk (write-back),
          which the next step saves and the workers report as sent;
        - a producer names the prompt chunks it saved or is saving (their puts run in the
          background), so a P/D consumer's load waits for them instead of missing them.
        """
        tracked = self._tracked.get(request.request_id)
        for table in (self._plans, self._lookups, self._answers, self._tracked):
            table.pop(request.request_id, None)
        if tracked is None:
            return False, None
        delay_free = self._save_final_chunk(request, block_ids, tracked)
        if request.request_id in self._pending:
            self._finished_at[request.request_id] = self._step
        plan = tracked.plan
        params = None
        if self._save:
            full = plan.num_tokens // plan.chunk_tokens
            saved = min(tracked.next_save, full)  # a prefix: full chunks, then the tail
            if saved == full < len(plan.keys) and self._save_partial and not tracked.tail_due:
                saved += 1
            if saved:
                params = handoff_params(plan, saved, self._heads_per_block)
        return delay_free, params

    def _save_final_chunk(self, request: Request, block_ids: Sequence[Sequence[int]], tracked: _Tracked) -> bool:
        """Plans the save of a finished request's final partial chunk; whether there is one."""
        if not self._write_back:
            return False
        # Tokens with KV; the last sampled token has none. A tail of prompt tokens only was saved
        # with the prompt (or is not wanted); a request still loading has computed nothing past it.
        num_computed = request.num_computed_tokens
        c = tracked.plan.chunk_tokens
        index, length = divmod(num_computed, c)
        if length == 0 or num_computed <= tracked.plan.num_tokens:
            return False
        tokens = request.all_token_ids[index * c : num_computed]
        parents = self._full_keys(tracked, index - 1) if index else tracked.plan.roots
        keys = tuple(tuple(chunk_key(parent, tokens) for parent in group) for group in parents)
        transfers = self._group_transfers(
            request,
            tracked.plan,
            block_ids,
            [ChunkRef(index=index, keys=(), num_tokens=length, start=index * c, end=num_computed)],
            [keys],
            tracked.retain_ttl_s,
        )
        self._finishing.extend(transfers)
        return bool(transfers)

    # -- internals -----------------------------------------------------------------------------

    def _retention(self, request: Request) -> float:
        """The retention a request's saves ask for: its kv_transfer_params' hint (kvcache_retain_ttl_s, or
        a cache_control object), capped at max_retain_ttl_s; else the connector's retain_ttl_s; 0 for none.

        A malformed hint never fails the request (the engine serves it as if it had none): it is
        logged and counted in retain_hints_ignored.
        """
        try:
            hint = transfer_params_ttl_s(request.kv_transfer_params)
        except ValueError as exc:
            self.counters.retain_hints_ignored += 1
            log.warning("kvcache: request %s: retention hint ignored: %s", request.request_id, exc)
            hint = None
        ttl = hint if hint is not None else self._retain_ttl_s
        return 0.0 if ttl is None else min(ttl, self._max_retain_ttl_s)

    def _expect_event(self, request: Request, chunk: ChunkRef) -> None:
        """Builds the event of a chunk about to be saved: its full blocks, which vLLM has hashed."""
        if self._events is None:
            return
        bs, first = self._facts.block_size, chunk.index * self._facts.chunk_tokens
        event = self._events.event(request, first // bs, (first + chunk.num_tokens) // bs)
        if event is not None:
            self._pending.setdefault(request.request_id, {})[(chunk.index, chunk.num_tokens)] = _PendingEvent(event)

    def _confirm(self, reports: StoredChunks) -> None:
        """Records the events of chunks now stored by every shard; forgets those a shard failed."""
        if self._events is None:
            return
        for request_id, index, num_tokens in reports.failed:
            self._forget_event(request_id, (index, num_tokens))
        for (request_id, index, num_tokens), shards in sorted(reports.stored.items()):
            pending = self._pending.get(request_id, {}).get((index, num_tokens))
            if pending is None or (request_id, index, num_tokens) in reports.failed:
                continue
            pending.shards |= shards
            if len(pending.shards) == len(self._groups) * self._facts.num_shards:
                self._events.add(pending.event)
                self._forget_event(request_id, (index, num_tokens))

    def _forget_event(self, request_id: str, chunk: tuple[int, int]) -> None:
        events = self._pending.get(request_id)
        if events is None:
            return
        events.pop(chunk, None)
        if not events:
            del self._pending[request_id]
            self._finished_at.pop(request_id, None)

    def _plan(self, request: Request) -> PromptPlan | None:
        extra = request_extra(request)
        if extra is None:
            return None
        plan = self._plans.get(request.request_id)
        if plan is not None and plan.num_tokens == request.num_prompt_tokens:
            return plan
        salt = request.cache_salt or ""
        namespaces = [facts.namespaces(salt, extra) for facts in self._groups]
        # keys[i][group][shard]
        per_group = [
            tuple(zip(*(chunk_keys(request.prompt_token_ids, ns) for ns in group), strict=True)) for group in namespaces
        ]
        plan = PromptPlan(
            namespaces=tuple(tuple(ns.name for ns in group) for group in namespaces),
            keys=tuple(zip(*per_group, strict=True)),
            num_tokens=request.num_prompt_tokens,
            chunk_tokens=self._facts.chunk_tokens,
            roots=tuple(tuple(ns.fingerprint for ns in group) for group in namespaces),
        )
        self._plans[request.request_id] = plan
        return plan

    def _lookup(self, plan: PromptPlan) -> int:
        """The most chunks a hit may cover: every group can serve the hit at their end under
        vLLM's rule for it, in every shard; 0 when the server cannot say.

        Full-attention groups need every chunk of the prefix; a sliding-window group needs
        the chunks from the first block vLLM keeps for the hit point (KVFacts.needed_from)
        up to it. When one of those is missing, no hit whose window holds it can be served,
        so the hit shrinks to end before it and the windows are asked again (each round
        shrinks it, so this ends; one round, one Lookup per namespace, in the common case).
        """
        if not self._breaker.allow():
            self.counters.lookups_skipped += 1
            return 0
        self.counters.lookups += 1
        stored = len(plan.keys)
        c = plan.chunk_tokens
        try:
            for facts in self._groups:
                if not facts.sliding:
                    stored = self._stored_run(plan, facts, 0, stored)
            settled = False
            while stored and not settled:
                settled = True
                first = min(plan.tokens_in(stored), plan.num_tokens - 1)
                for facts in (f for f in self._groups if f.sliding):
                    lo = facts.needed_from(first) // c
                    found = self._stored_run(plan, facts, lo, stored)
                    if found < stored - lo:
                        stored, settled = lo + found, False
                        break
        except KVCacheError as exc:
            self.counters.lookup_failures += 1
            if self._breaker.failure():
                log.warning("kvcache lookup failed (%s); prompts are misses for %.1f s", exc, self._breaker.cooldown_s)
            return 0
        self._breaker.success()
        return stored

    def _stored_run(self, plan: PromptPlan, facts: KVFacts, lo: int, hi: int) -> int:
        """How many of a group's chunks lo, lo + 1, ... (before hi) every shard has all blocks of:
        one Lookup per namespace (one for a head-sharded group, whose blocks of every shard it asks
        for at once, chunk by chunk)."""
        found = hi - lo
        names = plan.namespaces[facts.group]
        for n, namespace in enumerate(names):
            if found <= 0:
                break
            blocks = [
                facts.unit_keys(chunk[facts.group], facts.heads_per_block) for chunk in plan.keys[lo : lo + found]
            ]
            keys = [key for units in blocks for key in (units if len(names) == 1 else units[n : n + 1])]
            width = len(keys) // found
            found = self._client.lookup(namespace, keys, timeout_s=self._lookup_timeout_s).prefix_length // width
        return max(found, 0)

    def _full_keys(self, tracked: _Tracked, index: int) -> GroupKeys:
        """Every group's keys of full chunk `index` of the request's sequence (prompt and output)."""
        plan, c = tracked.plan, tracked.plan.chunk_tokens
        prompt_chunks = plan.num_tokens // c
        if index < prompt_chunks:
            return plan.keys[index]
        tokens = tracked.request.all_token_ids
        while len(tracked.generated_keys) <= index - prompt_chunks:
            i = prompt_chunks + len(tracked.generated_keys)
            parents = self._full_keys(tracked, i - 1) if i else plan.roots
            chunk = tokens[i * c : (i + 1) * c]
            tracked.generated_keys.append(
                tuple(tuple(chunk_key(parent, chunk) for parent in group) for group in parents)
            )
        return tracked.generated_keys[index - prompt_chunks]

    def _plan_saves(self, scheduler_output: SchedulerOutput) -> Iterator[RequestTransfer]:
        for request_id, num_computed in _scheduled(scheduler_output):
            tracked = self._tracked.get(request_id)
            if tracked is None:
                continue
            plan, c = tracked.plan, tracked.plan.chunk_tokens
            done = num_computed + scheduler_output.num_scheduled_tokens[request_id]
            done = min(done, tracked.request.num_tokens if self._write_back else plan.num_tokens)
            chunks: list[ChunkRef] = []
            keys: list[GroupKeys] = []
            for i in range(tracked.next_save, done // c):
                chunks.append(ChunkRef(index=i, keys=(), num_tokens=c, start=i * c, end=i * c + c))
                keys.append(self._full_keys(tracked, i))
            tracked.next_save = max(tracked.next_save, done // c)
            if tracked.tail_due and done >= plan.num_tokens:
                tail = len(plan.keys) - 1
                chunks.append(
                    ChunkRef(index=tail, keys=(), num_tokens=plan.chunk_len(tail), start=tail * c, end=plan.num_tokens)
                )
                keys.append(plan.keys[tail])
                tracked.tail_due = False
            if not chunks:
                continue
            block_state = scheduler_output.kv_connector_block_state
            block_ids = block_state.get_block_ids(request_id) if block_state is not None else None
            if block_ids is None:
                raise RuntimeError(f"vLLM gave no block ids for scheduled request {request_id}")
            yield from self._group_transfers(tracked.request, plan, block_ids, chunks, keys, tracked.retain_ttl_s)

    def _group_transfers(
        self,
        request: Request,
        plan: PromptPlan,
        block_ids: Sequence[Sequence[int]],
        chunks: Sequence[ChunkRef],
        keys: Sequence[GroupKeys],
        retain_ttl_s: float = 0.0,
    ) -> list[RequestTransfer]:
        """The saves of these chunks (keys[j] is chunks[j]'s, [group][shard]): one transfer per group,
        each asking for the request's retention.

        A sliding-window group's table holds the null block where vLLM already freed a block that
        fell out of the window: such a chunk is saved from its first block vLLM still holds on
        (a block of the chunk's last tokens only, ChunkRef.start past the chunk's first token).
        That suffix is all any later hit needs of the chunk: vLLM frees a block only once every
        later position's window starts after it. A chunk saved in every group gets its
        BlockStored event.
        """
        bs = self._facts.block_size
        transfers: list[RequestTransfer] = []
        saved_in = [0] * len(chunks)
        for facts, group_blocks in zip(self._groups, block_ids, strict=True):
            refs = []
            for j, chunk in enumerate(chunks):
                first_block = chunk.start // bs
                blocks = group_blocks[first_block : math.ceil(chunk.end / bs)]
                start = chunk.start
                if facts.sliding and self._null_block in blocks:
                    freed = max(k for k, block in enumerate(blocks) if block == self._null_block)
                    start = (first_block + freed + 1) * bs
                    if start >= chunk.end:
                        continue
                keys_j = facts.unit_keys(keys[j][facts.group], facts.heads_per_block)
                refs.append(dataclasses.replace(chunk, keys=keys_j, start=start))
                saved_in[j] += 1
            if refs:
                num_blocks = math.ceil(refs[-1].end / bs)
                namespaces = plan.namespaces[facts.group]
                blocks = tuple(group_blocks[:num_blocks])
                transfers.append(
                    RequestTransfer(
                        request.request_id,
                        namespaces,
                        blocks,
                        tuple(refs),
                        group=facts.group,
                        heads_per_block=facts.heads_per_block,
                        retain_ttl_s=retain_ttl_s,
                    )
                )
        for chunk, groups in zip(chunks, saved_in, strict=True):
            if groups == len(self._groups):
                self._expect_event(request, chunk)
        return transfers


def _scheduled(scheduler_output: SchedulerOutput) -> Iterator[tuple[str, int]]:
    """(request id, tokens computed before this step) of every request scheduled in the step."""
    for new in scheduler_output.scheduled_new_reqs:
        yield new.req_id, new.num_computed_tokens
    cached = scheduler_output.scheduled_cached_reqs
    yield from zip(cached.req_ids, cached.num_computed_tokens, strict=True)
