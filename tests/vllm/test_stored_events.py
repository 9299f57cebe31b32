"""KV cache events end to end: a chunk's BlockStored event is published once every shard's put of it is confirmed.

The real Scheduler publishes what the connector's take_events returns (Engine records
the batches in place of vLLM's ZMQ publisher); the workers report their confirmed puts
in kv_connector_worker_meta, aggregated over the ranks as vLLM's KVOutputAggregator does.
Prompts are 100 tokens: chunks of 32 (two blocks of 16) 0..2 and a 4-token tail.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
from vllm.distributed.kv_events import BlockStored

from kvcache_client import KVCacheClient, chunk_keys
from kvcache_client.results import PutResult, TierPutResult
from kvcache_connectors.vllm import scheduler as scheduler_module
from tests.backends import sigstop
from tests.vllm.harness import BLOCK, SAMPLED, Engine, expected_namespace, make_engine
from tests.vllm.test_async_transfers import Gate

pytestmark = pytest.mark.timeout(90)

PROMPT = list(range(10, 110))
LOW_64 = (1 << 64) - 1


def hashes(engine: Engine, request_id: str) -> list[int]:
    """The request's block hashes as vLLM sends them in its events (low 64 bits, as an int)."""
    return [int.from_bytes(h, "big") & LOW_64 for h in engine.requests[request_id].block_hashes]


def stored(block_hashes: list[int], parent: int | None, token_ids: list[int]) -> BlockStored:
    return BlockStored(
        block_hashes=block_hashes,
        parent_block_hash=parent,
        token_ids=token_ids,
        block_size=BLOCK,
        lora_id=None,
        medium="KVCACHE",
        lora_name=None,
        extra_keys=[None] * len(block_hashes),
        group_idx=0,
    )


def drain(engine: Engine) -> None:
    """Waits for the background puts, then one engine step collects what the workers heard back."""
    engine.settle()
    engine.step()


def test_a_prompts_confirmed_chunks_are_published_named_as_vllm_names_its_own_blocks(model_dir: str, server) -> None:
    engine = make_engine(model_dir, extra={"target": server.target}, kv_events=True)
    engine.add("p", PROMPT)
    engine.run()
    drain(engine)
    h = hashes(engine, "p")
    # Chunks 0..2 (blocks 0..5); the tail holds only the partial block 6, which vLLM never hashed.
    assert engine.kvcache_events() == [
        stored(h[0:2], None, PROMPT[0:32]),
        stored(h[2:4], h[1], PROMPT[32:64]),
        stored(h[4:6], h[3], PROMPT[64:96]),
    ]
    # vLLM's own events for the same blocks (its prefix cache, medium GPU) name them identically.
    own = [e for b in engine.published.batches for e in b.events if isinstance(e, BlockStored) and e.medium == "GPU"]
    assert [x for e in own for x in e.block_hashes] == h[:6]
    assert [t for e in own for t in e.token_ids] == PROMPT[:96]
    assert (own[0].parent_block_hash, own[0].extra_keys[0], own[0].group_idx) == (None, None, 0)
    assert engine.connector.pending_events == 0
    engine.close()


def test_decode_write_back_chunks_are_published_too(model_dir: str, server) -> None:
    engine = make_engine(model_dir, extra={"target": server.target}, kv_events=True)
    engine.add("d", PROMPT, max_tokens=50)  # 150 tokens, 149 with KV
    engine.run(max_steps=100)
    drain(engine)
    h = hashes(engine, "d")
    tokens = PROMPT + [SAMPLED] * 50
    assert len(h) == 9
    # Chunk 3 is completed by generated tokens; the final partial chunk (128..148) has one full block.
    assert engine.kvcache_events() == [
        stored(h[0:2], None, tokens[0:32]),
        stored(h[2:4], h[1], tokens[32:64]),
        stored(h[4:6], h[3], tokens[64:96]),
        stored(h[6:8], h[5], tokens[96:128]),
        stored(h[8:9], h[7], tokens[128:144]),
    ]
    namespace = expected_namespace(model_dir)
    with KVCacheClient(server.target, timeout_s=5) as client:
        assert client.lookup(namespace, chunk_keys(tokens[:128], namespace)).prefix_length == 4
    assert engine.connector.pending_events == 0
    engine.close()


def test_a_put_the_hung_server_never_confirmed_is_never_published(model_dir: str, server_process) -> None:
    process, target = server_process
    extra = {"target": target, "lookup_timeout_s": 0.3, "transfer_timeout_s": 0.5, "breaker_cooldown_s": 60.0}
    engine = make_engine(model_dir, extra=extra, kv_events=True)
    gate = Gate(engine.workers[0]._client, "put_many")
    engine.add("p", PROMPT)
    engine.step()  # looked up while the server runs; chunks 0 and 1 are handed to the save thread
    assert gate.entered.wait(10)
    try:
        sigstop(process.pid)
        gate.release.set()  # that put times out; the open breaker skips the later ones
        engine.run()
        drain(engine)
        assert engine.stats.data["save_failures"] == 4
        assert engine.kvcache_events() == []
        assert engine.connector.pending_events == 0  # the workers reported the failures
    finally:
        os.kill(process.pid, signal.SIGCONT)
    for _ in range(3):
        engine.step()
    assert engine.kvcache_events() == []
    engine.close()


def test_a_put_the_server_stored_only_in_part_is_never_published(model_dir: str, server) -> None:
    engine = make_engine(model_dir, extra={"target": server.target}, kv_events=True)
    client = engine.workers[0]._client
    put_many = client.put_many

    def short_of_one(namespace: Any, items: Any, **kwargs: Any) -> PutResult:
        result = put_many(namespace, items, **kwargs)  # the server stores them all; the answer says one less
        n = result.stored - 1
        return PutResult(n, 1, result.bytes_sent, (TierPutResult("ram", stored=n, failed=1),))

    client.put_many = short_of_one
    engine.add("p", PROMPT)
    engine.run()
    drain(engine)
    assert engine.kvcache_events() == []
    assert engine.connector.pending_events == 0
    engine.close()


def run_with_rank_one_held(model_dir: str, target: str) -> tuple[Engine, Gate]:
    """A TP=2 producer that computed the prompt; rank 0's puts are confirmed, rank 1's held at the Gate."""
    engine = make_engine(model_dir, tp_size=2, role="kv_producer", extra={"target": target}, kv_events=True)
    gate = Gate(engine.workers[1]._client, "put_many")
    engine.add("p", PROMPT)
    deadline = time.monotonic() + 30
    while engine.scheduler.has_requests():
        assert time.monotonic() < deadline
        engine.step()
    assert gate.entered.wait(10)
    assert engine.workers[0]._worker_side().wait_idle(10)
    for _ in range(3):
        engine.step()
    return engine, gate


def test_with_two_ranks_a_chunk_is_published_once_both_confirmed_it(model_dir: str, server) -> None:
    engine, gate = run_with_rank_one_held(model_dir, server.target)
    assert engine.kvcache_events() == []  # rank 0 stored chunks 0..2 of its shard, rank 1 none yet
    assert engine.connector.pending_events == 3
    gate.release.set()
    drain(engine)
    h = hashes(engine, "p")
    assert engine.kvcache_events() == [
        stored(h[0:2], None, PROMPT[0:32]),
        stored(h[2:4], h[1], PROMPT[32:64]),
        stored(h[4:6], h[3], PROMPT[64:96]),
    ]
    assert engine.connector.pending_events == 0
    engine.close()


def test_events_still_unconfirmed_long_after_their_request_finished_are_dropped(
    model_dir: str, server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(scheduler_module, "PENDING_EVENT_STEPS", 5)
    engine, gate = run_with_rank_one_held(model_dir, server.target)  # the request finished 3 steps ago
    assert engine.connector.pending_events == 3
    for _ in range(3):
        engine.step()
    assert engine.connector.pending_events == 0
    gate.release.set()  # rank 1's confirmations come too late
    drain(engine)
    assert engine.kvcache_events() == []
    engine.close()
