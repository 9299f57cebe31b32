"""vLLM's own OffloadingConnector with the kvcache tier below its CPU tier, engine to engine, greedy tokens compared.

Each engine is its own process (tests/vllm/offload_engine.py, forked from one that imported vLLM once):
vLLM 0.33's Scheduler and OffloadingConnector (scheduler and worker sides), vLLM's TieringOffloadingManager
with its CPU tier and the kvcache tier, CPU KV caches, and a tiny random-weight model that samples greedily (a Llama, a
Qwen2 whose layers all slide, a full + sliding hybrid, and a Mamba hybrid whose recurrent state lives in
vLLM's Mamba cache in "align" mode: tests/vllm/state_model.py). Only the worker's device copy runs on
the CPU (tests/vllm/cpu_offload.py). The kvcache server is a real `python -m kvcache_server` process. A
prompt stored by one engine process is loaded by another from kvcache alone (a new process: its CPU
tier holds nothing), and its greedy tokens are those of an engine without any connector; a server
SIGKILLed while requests wait for it is a recompute with the same tokens, in bounded time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvcache_client import KVCacheClient
from tests.vllm.harness import (
    BLOCK,
    LAYER_NAMES,
    MAMBA_LAYER_NAMES,
    allocate_caches,
    make_kv_cache_config,
    mamba_kv_cache_config,
)
from tests.vllm.offload_engine import LAYER_TYPES, GreedyModel, OffloadEngine, save_tiny_model
from tests.vllm.state_model import STATE_DTYPES, STATE_SHAPES, StateModel, state_views

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[2]
P1 = [(37 * i + 11) % 1000 for i in range(70)]  # 70 tokens: two 32-token chunks are stored, 6 tokens are not
P2 = P1[:64] + [(53 * i + 7) % 1000 for i in range(30)]  # shares P1's two chunks, then its own
P3 = [(71 * i + 5) % 1000 for i in range(100)]  # three chunks of its own
PROMPTS = {"p1": P1, "p2": P2, "p3": P3}
LOADABLE = {"p1": 64, "p2": 64, "p3": 96}  # whole 32-token chunks of each prompt, at least one token left to compute
# Chunks kvcache holds after the storing engine, per model: p1/p2's two and p3's three for full attention;
# a sliding group's only in its window (WINDOW = 40 tokens before the first token computed: p1's chunks
# 0-1, p3's 1-2); the hybrid model's full group and sliding group; the Mamba hybrid's full group and one
# state per chunk boundary where vLLM's scheduler ended a step (p1's after 64 tokens, p3's after 32 and 96).
CHUNKS = {"full": 5, "sliding": 4, "hybrid": 9, "mamba": 8}
# Chunks kvcache serves to the loading engine: all of them, but for the Mamba group only the state at the
# end of each hit (vLLM's window of one state: p1's after 64 tokens, p3's after 96).
SERVED = {**CHUNKS, "mamba": 7}
# The loading engine's loads, as vLLM's connector sent them to its worker: request, blocks per KV-cache
# group, the index of each group's first block in the request's table.
LOADS = {
    "full": [("p1", [4], [0]), ("p3", [6], [0])],
    "sliding": [("p1", [3], [1]), ("p3", [3], [3])],
    "hybrid": [("p1", [4, 3], [0, 1]), ("p3", [6, 3], [0, 3])],
    "mamba": [("p1", [4, 1], [0, 3]), ("p3", [6, 1], [0, 5])],  # one state block: the state after 64, 96 tokens
}
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {kind: save_tiny_model(tmp_path_factory.mktemp(f"tiny-{kind}"), kind) for kind in LAYER_TYPES}


@pytest.fixture(scope="module")
def references(model_dirs: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Per model: greedy tokens (and logit digests) of an engine without any KV connector or prefix caching."""
    out = {}
    for kind, path in model_dirs.items():
        engine = OffloadEngine(path, None)
        for request_id, tokens in PROMPTS.items():
            engine.add(request_id, tokens, MAX_TOKENS)
        out[kind] = {"tokens": engine.run(), "logits": engine.logit_digests()}
        assert engine.loaded == dict.fromkeys(PROMPTS, 0)
    return out


@pytest.fixture
def llama_dir(model_dirs: dict[str, str]) -> str:
    return model_dirs["full"]


@pytest.fixture
def reference(references: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return references["full"]


class EngineProcesses:
    """Engine processes forked from one that imported vLLM, torch and transformers once
    (`python -m tests.vllm.offload_engine --fork-server`): each engine is still a process of its own,
    without the 9 s of imports each one took here."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.server: subprocess.Popen[str] | None = None

    def run(self, spec_path: Path, timeout_s: float = 180.0) -> int:
        if self.server is None or self.server.poll() is not None:
            with self.log.open("a") as log:
                self.server = subprocess.Popen(
                    [sys.executable, "-m", "tests.vllm.offload_engine", "--fork-server"],
                    cwd=REPO,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    text=True,
                    start_new_session=True,  # its engine processes with it: one killpg ends both
                )
        assert self.server.stdin is not None and self.server.stdout is not None
        self.server.stdin.write(f"{spec_path}\n")
        self.server.stdin.flush()
        ready, _, _ = select.select([self.server.stdout], [], [], timeout_s)
        line = self.server.stdout.readline() if ready else ""
        if not line:
            self.close()
            raise AssertionError(f"no engine result within {timeout_s} s: {self.log.read_text()[-4000:]}")
        return int(line)

    def close(self) -> None:
        if self.server is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.server.pid, signal.SIGKILL)
            self.server.wait(10)
            self.server = None


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcesses]:
    processes = EngineProcesses(tmp_path_factory.mktemp("engines") / "fork-server.log")
    yield processes
    processes.close()


def run_engine(
    engines: EngineProcesses, tmp_path: Path, name: str, llama_dir: str, target: str | None, **spec: Any
) -> dict[str, Any]:
    """One engine process over PROMPTS; its JSON result."""
    path = tmp_path / f"{name}.json"
    path.write_text(
        json.dumps({"model_dir": llama_dir, "target": target, "prompts": PROMPTS, "max_tokens": MAX_TOKENS, **spec})
    )
    returncode = engines.run(path)
    assert returncode == 0, Path(f"{path}.err").read_text()[-4000:]
    return json.loads(Path(f"{path}.out").read_text().strip().splitlines()[-1])


def ram_hits(target: str) -> int:
    with KVCacheClient(target, timeout_s=10) as client:
        return next(t.hits for t in client.stats().tiers if t.name == "ram")


def test_greedy_tokens_and_logits_depend_on_the_prefix_kv(llama_dir: str, reference: dict[str, Any]) -> None:
    """The comparisons below have teeth: P1 decoded over another prompt's KV for its first 64 tokens gives
    other greedy tokens; over its own KV with one bit of one value flipped, other logits."""
    model = GreedyModel(llama_dir)
    blocks = [list(range(1, 17))] * 2  # every layer's table (block 0 is vLLM's null block)

    def decode(prefix_tokens: list[int], change: tuple[int, int] | None = None) -> tuple[list[int], str]:
        caches = allocate_caches(make_kv_cache_config(17), KVCacheLayout.LBNHC)
        for p in range(64):
            model.token(caches, blocks, prefix_tokens, p)
        if change is not None:  # one fp16 value of one position's K, in layer 0, nudged by one ulp
            position, head = change
            k = caches[LAYER_NAMES[0]][blocks[0][position // BLOCK], head, position % BLOCK]
            k.view(torch.int16)[0] += 1
        tokens, digest = list(P1), hashlib.sha256()
        for p in range(64, len(P1) + MAX_TOKENS - 1):
            token, logits = model.token(caches, blocks, tokens, p)
            if p >= len(P1) - 1:
                tokens.append(token)
                digest.update(logits)
        return tokens[len(P1) :], digest.hexdigest()

    expected = (reference["tokens"]["p1"], reference["logits"]["p1"])
    assert decode(P1) == expected  # the same computation, outside the engine
    assert decode(P3[:64] + P1[64:])[0] != expected[0]
    assert decode(P1, change=(5, 1))[1] != expected[1]


def test_the_mamba_hybrids_tokens_depend_on_the_state_and_the_kv(
    model_dirs: dict[str, str], references: dict[str, dict[str, Any]]
) -> None:
    """The Mamba hybrid's comparisons have teeth too: P1 decoded after its first 64 tokens, which leave
    their K/V in the attention group and the state after token 63 in one block of the state group (as in
    "align" mode), gives the reference's tokens and logits, as does the model with no cache at all; with
    that state block zeroed, other greedy tokens; with one value of the state off by a thousandth, other logits; over
    another prompt's K/V with P1's own state, other greedy tokens."""
    model = StateModel(model_dirs["mamba"])
    tables = (list(range(1, 9)), list(range(9, 17)))  # the attention group's blocks, the state group's
    state_block = tables[1][64 // BLOCK - 1]  # holds the state after 64 tokens

    def prefill(tokens: list[int]) -> dict[str, torch.Tensor]:
        caches = allocate_caches(mamba_kv_cache_config(17, STATE_SHAPES, STATE_DTYPES), KVCacheLayout.LBNHC)
        model.run_step(caches, MAMBA_LAYER_NAMES, tables, tokens, 0, 64, "align")
        return caches

    def decode(caches: dict[str, torch.Tensor]) -> tuple[list[int], str]:
        tokens, digest = list(P1), hashlib.sha256()
        for p in range(64, len(P1) + MAX_TOKENS - 1):
            token, logits = model.run_step(caches, MAMBA_LAYER_NAMES, tables, tokens, p, p + 1, "align")
            if p >= len(P1) - 1:
                tokens.append(token)
                digest.update(logits)
        return tokens[len(P1) :], digest.hexdigest()

    expected = (references["mamba"]["tokens"]["p1"], references["mamba"]["logits"]["p1"])
    assert model.generate(P1, MAX_TOKENS) == expected  # the reference engine's, with no cache of any kind
    assert decode(prefill(P1)) == expected  # the same computation, outside the engine
    zeroed = prefill(P1)
    zeroed[MAMBA_LAYER_NAMES[1]][state_block].zero_()
    assert decode(zeroed)[0] != expected[0]
    flipped = prefill(P1)
    _, ssm = state_views(flipped[MAMBA_LAYER_NAMES[1]][state_block])
    # One fp32 value of the state nudged by 2^13 ulps (one part in about a thousand). A nudge of one
    # ulp changed the logits on AVX2 hosts, and on an AVX-512 one (2026-12-07) was rounded away within
    # the five tokens of decay before the first digested logits: the test was the CPU's, not the cache's.
    ssm.view(torch.int32)[5] += 1 << 13
    assert decode(flipped)[1] != expected[1]
    other_kv = prefill(P3[:64])
    own = prefill(P1)
    other_kv[MAMBA_LAYER_NAMES[1]][state_block] = own[MAMBA_LAYER_NAMES[1]][state_block]
    assert decode(other_kv)[0] != expected[0]


@pytest.mark.parametrize("kind", list(LAYER_TYPES))
def test_a_prompt_stored_by_one_engine_process_loads_in_another_from_kvcache_alone(
    model_dirs: dict[str, str],
    references: dict[str, dict[str, Any]],
    server_process,
    engines: EngineProcesses,
    tmp_path: Path,
    kind: str,
) -> None:
    """For a full-attention model, one whose layers all slide, a hybrid one (a full and a sliding
    group) and a Mamba hybrid (a full group and a state group, mamba_cache_mode "align"): the loading
    engine's tokens and logits are the reference's, every loadable token came through the connector,
    from kvcache, with the blocks (and, for the Mamba hybrid, the one state block) vLLM loads."""
    _, target = server_process
    llama_dir, reference = model_dirs[kind], references[kind]
    stored = run_engine(engines, tmp_path, "store", llama_dir, target)
    assert (stored["tokens"], stored["logits"]) == (reference["tokens"], reference["logits"])
    assert stored["connector_hit_tokens"] == 0  # nothing there yet (p2 reuses p1's blocks on the "GPU")
    with KVCacheClient(target, timeout_s=10) as client:
        (ram,) = [t for t in client.stats().tiers if t.name == "ram"]
    assert ram.blocks == CHUNKS[kind]

    hits = ram_hits(target)
    loaded = run_engine(engines, tmp_path, "load", llama_dir, target)
    assert loaded["pid"] != stored["pid"]  # another process: its CPU tier holds nothing
    assert (loaded["tokens"], loaded["logits"]) == (reference["tokens"], reference["logits"])
    assert loaded["loaded"] == LOADABLE
    assert loaded["invalid_block_ids"] == []
    assert loaded["connector_hit_tokens"] == 64 + 96  # p1's and p3's (p2 then reuses p1's blocks on the "GPU")
    assert ram_hits(target) - hits == SERVED[kind]  # all from kvcache: its CPU tier was new
    loads = sorted((r, sizes, first) for job, r, sizes, first in loaded["transfers"] if job == "load")
    assert loads == LOADS[kind]


@pytest.mark.parametrize("kill", [{"kill_on_idle_step": 1}, {"kill_on_load": True}])
def test_a_server_killed_while_requests_wait_for_it_is_a_recompute_with_the_same_tokens(
    llama_dir: str,
    reference: dict[str, Any],
    server_process,
    engines: EngineProcesses,
    tmp_path: Path,
    kill: dict[str, Any],
) -> None:
    """The kvcache server is SIGKILLed by the loading engine while its requests wait for it: the
    first time a step schedules nothing (lookups in flight), or as the tier starts its first load, after its
    lookups said HIT. What was not loaded is computed again, the tokens and logits are the reference's,
    and the run ends (the engine's own deadline, 60 s, is an assertion)."""
    process, target = server_process
    assert run_engine(engines, tmp_path, "store", llama_dir, target)["logits"] == reference["logits"]
    tier = {"timeout_s": 2.0, "lookup_timeout_s": 1.0}
    after = run_engine(
        engines,
        tmp_path,
        "killed",
        llama_dir,
        target,
        kill_pid=process.pid,
        **kill,
        tier_options=tier,
        timeout_s=60.0,
    )
    assert after["killed"]
    assert process.wait(10) == -9
    assert (after["tokens"], after["logits"]) == (reference["tokens"], reference["logits"])
    assert after["connector_hit_tokens"] == 0  # nothing came from the dead server
    assert after["invalid_block_ids"] == []  # the failed load was a miss before any block was loaded


def test_a_mamba_state_loaded_from_kvcache_is_one_the_tokens_depend_on(
    model_dirs: dict[str, str],
    references: dict[str, dict[str, Any]],
    server_process,
    engines: EngineProcesses,
    tmp_path: Path,
) -> None:
    """The Mamba hybrid's loading engine again, with each state page its loads wrote zeroed as soon as it
    is written (the state vLLM would have had, had its connector not loaded it): p1's and p3's greedy
    tokens are not the reference's, and no request's logits are (p2 reuses p1's blocks, and its state)."""
    _, target = server_process
    model_dir, reference = model_dirs["mamba"], references["mamba"]
    assert run_engine(engines, tmp_path, "store", model_dir, target)["logits"] == reference["logits"]
    zeroed = run_engine(engines, tmp_path, "zeroed", model_dir, target, zero_loaded_states=True)
    assert zeroed["zeroed_states"] == 2  # p1's state after 64 tokens, p3's after 96
    assert zeroed["loaded"] == LOADABLE
    for request_id in ("p1", "p3"):
        assert zeroed["tokens"][request_id] != reference["tokens"][request_id]
    for request_id in PROMPTS:
        assert zeroed["logits"][request_id] != reference["logits"][request_id]
