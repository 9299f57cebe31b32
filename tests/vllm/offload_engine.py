"""One vLLM 0.33 engine on a CPU with vLLM's own OffloadingConnector and the kvcache tier below its CPU tier.

`OffloadEngine` is vLLM's real Scheduler (which builds OffloadingConnector's scheduler side and its
TieringOffloadingManager: CPU primary tier, kvcache secondary tier), the connector's worker side built
by vLLM's KVConnectorFactory over CPU KV caches allocated by vLLM's allocate_kv_cache, and a real
model: a tiny random-weight transformers model (a Llama; a Qwen2 whose layers all slide; one with a
full and a sliding layer, each its own KV-cache group) that computes every token's K and V from the
paged cache and samples greedily, or a Mamba hybrid whose recurrent state lives in vLLM's Mamba cache
(tests/vllm/state_model.py). The worker's GPU <-> CPU copy runs on the CPU (tests/vllm/cpu_offload.py
says exactly what that replaces). Each step replays the model runner's connector calls in vLLM's order
(kv_connector_model_runner_mixin._get_kv_connector_output, handle_preemptions before it), after the
runner's zeroing and copies of KV-cache blocks.

The model computes one token per forward, attending to the fp16 K/V of every earlier position read
from the paged cache (the Mamba hybrid also from the state after the token before): a token's KV and
logits depend on its prefix's cached bytes alone, not on how the scheduler cut the prompt into steps,
so a run that loads a prefix from kvcache and a run without any cache must give the same greedy tokens
and the same logits bit for bit (`logits`: a digest of every logit vector a request sampled from). A
wrong prefix changes the tokens; one wrong bit of one loaded value, which greedy tokens may survive,
changes the logits.

Run as a script (`python -m tests.vllm.offload_engine SPEC.json`) it is one engine process: it reads
the prompts, runs them, and prints one JSON line with the tokens and what it loaded. With `--fork-server`
it imports vLLM, torch and transformers once (9 s of every engine process here) and then, for each
SPEC.json path read from stdin, forks a new process that runs that engine alone (its own CPU tier, its
own everything: nothing of one engine is in the next) with stdout and stderr in SPEC.json.out and
SPEC.json.err, and answers each path with the child's exit status on a line of its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from vllm import SamplingParams
from vllm.config import KVTransferConfig
from vllm.config.cache import MambaCacheMode
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, resolve_kv_cache_block_sizes
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import copy_kv_cache_blocks_inplace

from tests.vllm.harness import (
    BLOCK,
    EOS,
    HEAD,
    KV_HEADS,
    LAYER_NAMES,
    MAMBA_LAYER_NAMES,
    NUM_LAYERS,
    TINY_MODEL,
    StandInAttention,
    allocate_caches,
    hybrid_kv_cache_config,
    make_kv_cache_config,
    make_vllm_config,
    mamba_kv_cache_config,
    read_token,
    write_model_dir,
    write_token,
)
from tests.vllm.state_model import STATE_DTYPES, STATE_SHAPES, StateModel, save_state_model

OFFLOAD_BLOCK = 2 * BLOCK  # tokens per offloaded chunk: two vLLM blocks
SPEC = {"spec_name": "CPUWorkerTieringSpec", "spec_module_path": "tests.vllm.cpu_offload"}


WINDOW = 40  # tokens of the sliding-window layers: not a multiple of a chunk, so windows start mid-chunk
LAYER_TYPES = {  # the models the tests run: every layer full, every layer sliding (Mistral-like), one of each
    "full": ("full_attention",) * NUM_LAYERS,
    "sliding": ("sliding_attention",) * NUM_LAYERS,
    "hybrid": ("full_attention", "sliding_attention"),
    "mamba": ("full_attention", "mamba"),  # a Mamba hybrid: its state in a MambaSpec group (tests/vllm/state_model.py)
}


def save_tiny_model(path: Path, kind: str = "full") -> str:
    """A tiny random-weight model (fixed seed) with the harness's shapes, saved as a user's checkpoint is:
    a Llama for "full", a Qwen2 with sliding-window layers (WINDOW tokens) for "sliding" and "hybrid", the
    attention + recurrent StateModel for "mamba"."""
    if kind == "mamba":
        write_model_dir(path)
        save_state_model(path)
        (path / "kind").write_text(kind)
        return str(path)
    torch.manual_seed(0)
    shapes: dict[str, Any] = {**TINY_MODEL, "initializer_range": 0.2}
    if kind == "full":
        model: Any = LlamaForCausalLM(LlamaConfig(**shapes))
    else:
        config = Qwen2Config(
            **shapes, use_sliding_window=True, sliding_window=WINDOW, layer_types=list(LAYER_TYPES[kind])
        )
        model = Qwen2ForCausalLM(config)
    model.save_pretrained(path)
    (path / "kind").write_text(kind)
    return str(path)


def tier_extra(target: str | None, **tier_options: Any) -> dict[str, Any]:
    """kv_connector_extra_config: the CPU tier (vLLM's) and the kvcache tier below it (by type + module path)."""
    extra: dict[str, Any] = {**SPEC, "cpu_bytes_to_use": 1 << 20, "block_size": OFFLOAD_BLOCK}
    if target is not None:
        extra["secondary_tiers"] = [
            {
                "type": "KVCacheTier",
                "module_path": "kvcache_connectors.vllm_tier",
                "target": target,
                **tier_options,
            }
        ]
    return extra


class GreedyModel:
    """The tiny model, one token per forward over K/V read from the paged cache (see the module's docstring)."""

    def __init__(self, model_dir: str) -> None:
        torch.set_num_threads(1)  # one thread: the same sums in the same order in every process
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
        self.model.eval()
        self.kind = (Path(model_dir) / "kind").read_text()
        # The first position each layer reads for position p: a sliding layer attends to p - WINDOW + 1 .. p.
        self.window = [WINDOW if t == "sliding_attention" else None for t in LAYER_TYPES[self.kind]]

    @torch.no_grad()
    def token(
        self, caches: dict[str, torch.Tensor], tables: Sequence[Sequence[int]], tokens: Sequence[int], p: int
    ) -> tuple[int, bytes]:
        """Computes position p from the K/V of 0..p-1 in `caches` (layer l's blocks: tables[l]), writes its K/V
        there; returns the greedy next token and the logits' bytes. A sliding layer's positions before its
        window are never read (vLLM may have freed their blocks, or never loaded them): zeros stand there,
        which the model's mask leaves out."""
        cache = DynamicCache()
        if p:
            for layer, name in enumerate(LAYER_NAMES):
                window = self.window[layer]
                first = 0 if window is None else max(0, p - window + 1)
                kv = torch.zeros(2, KV_HEADS, p, HEAD, dtype=torch.float16)
                for q in range(first, p):
                    block = tables[layer][q // BLOCK]
                    assert block != 0, f"position {q} of layer {layer} is in vLLM's null block"
                    kv[:, :, q] = read_token(caches[name], block, q % BLOCK)
                cache.update(kv[0].unsqueeze(0).float(), kv[1].unsqueeze(0).float(), layer)  # [1, H, p, D]
        out = self.model(
            input_ids=torch.tensor([[tokens[p]]]),
            position_ids=torch.tensor([[p]]),
            past_key_values=cache,
            use_cache=True,
        )
        for layer, name in enumerate(LAYER_NAMES):
            keys, values = out.past_key_values.layers[layer].keys, out.past_key_values.layers[layer].values
            kv = torch.stack([keys[0, :, p], values[0, :, p]]).to(torch.float16)  # [2, H, D]
            write_token(caches[name], tables[layer][p // BLOCK], p % BLOCK, kv)
        logits = out.logits[0, -1]
        return int(logits.argmax()), logits.numpy().tobytes()


@dataclass
class OffloadEngine:
    """One engine (see the module's docstring). `target` None: no connector and no prefix caching at all
    (the reference run)."""

    model_dir: str
    target: str | None
    num_blocks: int = 64
    tier_options: dict[str, Any] = field(default_factory=dict)
    model: GreedyModel | StateModel = field(init=False)
    scheduler: Scheduler = field(init=False)
    worker: Any = field(init=False)
    caches: dict[str, torch.Tensor] = field(init=False)
    groups: int = field(init=False)  # KV-cache groups: 1, or 2 for the hybrid models (one per layer)
    hash_block_size: int = field(init=False)
    mamba_cache_mode: MambaCacheMode = field(init=False)  # the "mamba" model's: "align" with a connector, else "none"
    zero_loaded_states: bool = False  # fault injection: zero each state page a load wrote, once it is written
    zeroed_states: int = 0  # state blocks zero_loaded_states zeroed
    requests: dict[str, Request] = field(default_factory=dict)
    loaded: dict[str, int] = field(default_factory=dict)  # request -> tokens it had when first computed
    logits: dict[str, Any] = field(default_factory=dict)  # request -> sha256 over the logits it sampled from
    invalid_block_ids: set[int] = field(default_factory=set)
    connector_hit_tokens: int = 0  # tokens vLLM's scheduler counted as the connector's hits
    # The connector's jobs, as its scheduler side sent them to the worker: ("load" | "store", request, blocks
    # per KV-cache group, index of each group's first block in the request's table).
    transfers: list[tuple[str, str, list[int], list[int]]] = field(default_factory=list)
    steps: int = 0

    def __post_init__(self) -> None:
        init_none_hash(sha256)
        kind = (Path(self.model_dir) / "kind").read_text()
        self.model = StateModel(self.model_dir) if kind == "mamba" else GreedyModel(self.model_dir)
        # vLLM derives the Mamba cache mode from prefix caching: "align" with it (the connector's engines),
        # "none" without (the reference).
        self.mamba_cache_mode = "none" if self.target is None else "align"
        config = make_vllm_config(self.model_dir, extra=tier_extra(self.target, **self.tier_options))
        if self.target is None:
            config.kv_transfer_config = None
            config.cache_config.enable_prefix_caching = False
        else:
            config.kv_transfer_config = KVTransferConfig(
                kv_connector="OffloadingConnector",
                kv_role="kv_both",
                engine_id=str(uuid.uuid4()),  # its own CPU tier region: nothing of another engine's
                kv_connector_extra_config=tier_extra(self.target, **self.tier_options),
            )
        if kind == "full":
            kv_cache_config = make_kv_cache_config(self.num_blocks)
        elif kind == "mamba":
            config.cache_config.mamba_cache_mode = self.mamba_cache_mode
            kv_cache_config = mamba_kv_cache_config(
                self.num_blocks, STATE_SHAPES, STATE_DTYPES, self.mamba_cache_mode, config.model_config.max_model_len
            )
        else:
            kv_cache_config = hybrid_kv_cache_config(self.num_blocks, WINDOW, all_sliding=kind == "sliding")
        self.groups = len(kv_cache_config.kv_cache_groups)
        config.cache_config.num_gpu_blocks = self.num_blocks
        # As vLLM's EngineCore: the scheduler's block size (LCM of the groups') and the hashes' (BLOCK in every
        # engine here but the Mamba hybrid's reference, whose state block is as long as the model).
        scheduler_block_size, self.hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, config)
        self.scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(config),
            block_size=scheduler_block_size,
            hash_block_size=self.hash_block_size,
            log_stats=True,
        )
        self.caches = allocate_caches(kv_cache_config, KVCacheLayout.LBNHC)
        self.worker = None
        if self.target is not None:
            context = config.compilation_config.static_forward_context
            for name in LAYER_NAMES if kind != "mamba" else MAMBA_LAYER_NAMES[:1]:
                context.setdefault(name, StandInAttention(FlashAttentionBackend))
            self.worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config)
            self.worker.register_kv_caches(self.caches)

    def add(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        params.update_from_generation_config({}, EOS)
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(tokens),
            sampling_params=params,
            pooling_params=None,
            block_hasher=get_request_block_hasher(self.hash_block_size, sha256),
        )
        self.requests[request_id] = request
        self.scheduler.add_request(request)

    def step(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        kv_output = None
        if self.worker is not None:
            self.worker.handle_preemptions(out.kv_connector_metadata)
        self._update_blocks(out)
        if self.worker is not None:
            self.worker.bind_connector_metadata(out.kv_connector_metadata)
            self._record_transfers(out.kv_connector_metadata)
            if out.has_sync_kv_loads:
                self.worker.start_load_kv(None)
        sampled = self._forward(out)
        if self.worker is not None:
            if not out.has_sync_kv_loads:
                self.worker.start_load_kv(None)
            self.worker.wait_for_save()
            if self.zero_loaded_states:  # this step's loads are done: the copies are synchronous here
                self._zero_loaded_states(out.kv_connector_metadata)
            results = self.worker.get_transfer_results(out.finished_req_ids)
            invalid = self.worker.get_block_ids_with_load_errors()
            self.invalid_block_ids |= invalid
            kv_output = KVConnectorOutput(
                finished_sending=results.finished_sending,
                finished_recving=results.finished_recving,
                failed_recving=results.failed_recving,
                invalid_block_ids=invalid,
                kv_connector_stats=self.worker.get_kv_connector_stats(),
                kv_connector_worker_meta=self.worker.build_connector_worker_meta(),
            )
            self.worker.clear_connector_metadata()
        req_ids = list(out.num_scheduled_tokens)
        runner_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[sampled.get(r, []) for r in req_ids],
            kv_connector_output=kv_output,
        )
        for engine_output in self.scheduler.update_from_output(out, runner_output).values():
            stats = engine_output.scheduler_stats
            if stats is not None and stats.connector_prefix_cache_stats is not None:
                self.connector_hit_tokens += stats.connector_prefix_cache_stats.hits
        self.steps += 1
        return out

    def run(self, timeout_s: float = 60.0, on_idle: Any = None) -> dict[str, list[int]]:
        """Steps until every request finished; the greedy tokens of each. `on_idle(engine)` runs on each step
        that scheduled no token (requests waiting for a lookup or a load)."""
        deadline = time.monotonic() + timeout_s
        while self.scheduler.has_requests() or (self.worker is not None and self._pending()):
            assert time.monotonic() < deadline, f"requests still running after {timeout_s} s"
            if not self.step().total_num_scheduled_tokens:
                if on_idle is not None:
                    on_idle(self)
                time.sleep(0.002)
        return {r: list(q.output_token_ids) for r, q in self.requests.items()}

    def logit_digests(self) -> dict[str, str]:
        return {r: h.hexdigest() for r, h in self.logits.items()}

    def close(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        connector = self.scheduler.connector
        if connector is not None:
            connector.shutdown()

    def _pending(self) -> bool:
        """Stores still in flight (the scheduler lets go of finished requests only once they are saved)."""
        manager = self.scheduler.connector.connector_scheduler.manager
        return bool(manager.has_pending_work())

    def _record_transfers(self, metadata: Any) -> None:
        for kind, jobs, spec in (("load", metadata.load_jobs, "dst_spec"), ("store", metadata.store_jobs, "src_spec")):
            for job in jobs.values():
                blocks = getattr(job, spec)  # the engine's side of the job: a GPULoadStoreSpec
                self.transfers.append((kind, job.req_id, list(blocks.group_sizes), list(blocks.block_indices)))

    def _zero_loaded_states(self, metadata: Any) -> None:
        for job in metadata.load_jobs.values():
            blocks = job.dst_spec  # blocks per group, in group order: the Mamba group's are group 1's
            first = blocks.group_sizes[0]
            for block_id in blocks.block_ids[first : first + blocks.group_sizes[1]].tolist():
                self.caches[MAMBA_LAYER_NAMES[1]][block_id].zero_()
                self.zeroed_states += 1

    def _update_blocks(self, out: SchedulerOutput) -> None:
        """What vLLM's model runner does to the KV cache before a step (gpu_model_runner's _update_states): zero
        the new blocks the scheduler lists (for Mamba layers, whose state is read before it is written), then
        the block copies it asks for (vLLM's own copy_kv_cache_blocks_inplace)."""
        for block_id in out.new_block_ids_to_zero or ():
            for cache in self.caches.values():
                cache[block_id].zero_()
        if out.kv_cache_block_copies:
            copy_kv_cache_blocks_inplace(self.caches.values(), self.num_blocks, out.kv_cache_block_copies)

    def _forward(self, out: SchedulerOutput) -> dict[str, list[int]]:
        starts = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        sampled: dict[str, list[int]] = {}
        for request_id, count in out.num_scheduled_tokens.items():
            request = self.requests[request_id]
            self.loaded.setdefault(request_id, starts[request_id])
            tokens = list(request.all_token_ids)
            groups = self.scheduler.kv_cache_manager.get_block_ids(request_id)
            start = starts[request_id]
            if isinstance(self.model, StateModel):
                last, logits = self.model.run_step(
                    self.caches, MAMBA_LAYER_NAMES, groups, tokens, start, start + count, self.mamba_cache_mode
                )
            else:
                tables = [groups[0 if self.groups == 1 else layer] for layer in range(NUM_LAYERS)]
                last, logits = 0, b""
                for p in range(start, start + count):
                    last, logits = self.model.token(self.caches, tables, tokens, p)
            if starts[request_id] + count >= request.num_tokens:
                sampled[request_id] = [last]
                self.logits.setdefault(request_id, hashlib.sha256()).update(logits)
        return sampled


def main(spec_path: str) -> None:
    """One engine process: SPEC.json holds model_dir, target (or null), prompts {id: tokens}, max_tokens,
    and optionally kill_pid (SIGKILLed the kill_on_idle_step-th time a step schedules no token, requests
    waiting for the tier's lookups; or, with kill_on_load, as the kvcache tier submits its first load,
    after a HIT), tier_options, timeout_s and zero_loaded_states (see OffloadEngine)."""
    spec = json.loads(Path(spec_path).read_text())
    engine = OffloadEngine(
        spec["model_dir"],
        spec["target"],
        tier_options=spec.get("tier_options", {}),
        zero_loaded_states=spec.get("zero_loaded_states", False),
    )
    killed: list[float] = []
    idle_steps = [0]

    def kill() -> None:
        if not killed:
            os.kill(spec["kill_pid"], signal.SIGKILL)
            killed.append(time.monotonic())

    def on_idle(engine: OffloadEngine) -> None:
        idle_steps[0] += 1
        if spec.get("kill_on_idle_step") == idle_steps[0]:
            kill()

    if spec.get("kill_on_load"):  # the server dies as the kvcache tier starts its first load (after a HIT)
        (tier,) = engine.scheduler.connector.connector_scheduler.manager.secondary_tiers
        submit_load = tier.submit_load

        def kill_then_load(job: Any) -> None:
            kill()
            submit_load(job)

        tier.submit_load = kill_then_load

    for request_id, tokens in spec["prompts"].items():
        engine.add(request_id, tokens, spec["max_tokens"])
    started = time.monotonic()
    tokens = engine.run(timeout_s=spec.get("timeout_s", 60.0), on_idle=on_idle)
    result = {
        "tokens": tokens,
        "loaded": engine.loaded,
        "logits": engine.logit_digests(),
        "connector_hit_tokens": engine.connector_hit_tokens,
        "transfers": engine.transfers,
        "zeroed_states": engine.zeroed_states,
        "invalid_block_ids": sorted(engine.invalid_block_ids),
        "killed": bool(killed),
        "seconds": time.monotonic() - started,
        "pid": os.getpid(),
    }
    engine.close()
    print(json.dumps(result), flush=True)


def fork_server() -> None:
    """Each line of stdin a SPEC.json path: one forked engine process per line, its exit status printed."""
    for line in sys.stdin:
        spec_path = line.strip()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the engine process: nothing of the fork server's pipes, the spec's files instead
            code = 1
            try:
                with open(spec_path + ".out", "wb") as out, open(spec_path + ".err", "wb") as err:
                    os.dup2(out.fileno(), 1)
                    os.dup2(err.fileno(), 2)
                    os.close(0)
                try:
                    main(spec_path)
                    code = 0
                except BaseException:
                    import traceback

                    traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--fork-server":
        fork_server()
    else:
        main(sys.argv[1])
