"""Hybrid models: a full-attention and a sliding-window KV-cache group, through vLLM 0.33's real scheduler.

The engine's model has layer 0 in a full-attention group and layer 1 in a sliding-window
group of WINDOW tokens (vLLM's hybrid allocator: both groups' tensors overlay one backing
allocation, a block id belongs to one group). With WINDOW = 8 and 16-token blocks, vLLM
keeps a sliding-window block only while it holds one of the last 7 computed tokens, and
its own prefix cache needs cdiv(8 - 1, 16) = 1 block before a hit point
(SlidingWindowManager.find_longest_cache_hit); the connector's lookup asks for the same.

Every test checks the paged KV slot by slot: the full-attention layer at every position,
the sliding-window layer at every position of every block vLLM holds for it (the null
block stands for the rest).
"""

from __future__ import annotations

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, supports_hma
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec

from kvcache_client import KVCacheClient, chunk_keys
from kvcache_connectors.vllm import KVCacheConnector
from kvcache_core.keys import Namespace
from tests.vllm.harness import (
    BLOCK,
    CHUNK,
    LAYER_NAMES,
    SAMPLED,
    Engine,
    attention_spec,
    bitwise_equal,
    make_engine,
    make_vllm_config,
)

pytestmark = pytest.mark.timeout(60)

WINDOW = 8
PROMPT = list(range(300, 400))  # 100 tokens: chunks [0, 32) [32, 64) [64, 96) and a 4-token tail


def group_namespaces(engine: Engine) -> tuple[Namespace, Namespace]:
    """The namespaces of the (full, sliding) groups, as the scheduler side derives them."""
    full, sliding = (facts.namespaces()[0] for facts in engine.connector._scheduler._groups)
    return full, sliding


def assert_group_kv(engine: Engine, request_id: str, end: int, rank: int = 0) -> None:
    """Layer 0 (full attention) holds the fake model's KV at every position before `end`; layer 1
    (sliding window) at every position of every block vLLM still holds for the request, which
    must cover the window before `end`."""
    assert bitwise_equal(
        engine.paged_kv(request_id, 0, end, rank, layers=[0]), engine.expected_kv(request_id, 0, end, rank, layers=[0])
    )
    table = engine.last_block_ids(request_id, group=1)
    held = [b for b in range(len(table)) if table[b] != 0 and b * BLOCK < end]
    assert held and held[0] * BLOCK <= end - WINDOW + 1, f"the window before {end} is not held: {table}"
    for b in held:
        start, stop = b * BLOCK, min(end, b * BLOCK + BLOCK)
        got = engine.paged_kv(request_id, start, stop, rank, layers=[1])
        assert bitwise_equal(got, engine.expected_kv(request_id, start, stop, rank, layers=[1])), f"block {b}"


def produce(model_dir: str, target: str, *, step_tokens: int = 64, tp_size: int = 1) -> Engine:
    producer = make_engine(
        model_dir,
        tp_size=tp_size,
        role="kv_producer",
        sliding_window=WINDOW,
        max_num_batched_tokens=step_tokens,
        extra={"target": target},
    )
    producer.add("p", PROMPT)
    producer.run()
    return producer


def consume(model_dir: str, target: str, tokens: list[int] = PROMPT, tp_size: int = 1) -> Engine:
    consumer = make_engine(
        model_dir, tp_size=tp_size, role="kv_consumer", sliding_window=WINDOW, extra={"target": target}
    )
    consumer.add("c", tokens)
    consumer.run()
    return consumer


def test_the_connector_is_hma_capable_and_each_group_has_its_own_namespace(model_dir: str, server) -> None:
    producer = produce(model_dir, server.target)
    assert producer.scheduler.kv_cache_manager.coordinator.__class__.__name__ == "HybridKVCacheCoordinator"
    full, sliding = group_namespaces(producer)
    assert (full.num_layers, sliding.num_layers) == (1, 1)
    kinds = (dict(full.extra)["vllm.kv_group"], dict(sliding.extra)["vllm.kv_group"])
    assert kinds == ("full", f"sliding_window:{WINDOW}")
    assert full.name != sliding.name
    with KVCacheClient(server.target, timeout_s=5) as client:
        for namespace, layer in ((full, 0), (sliding, 1)):
            keys = chunk_keys(PROMPT, namespace)
            assert client.lookup(namespace, keys).prefix_length == 4
            for index, (start, end) in enumerate(((0, 32), (32, 64), (64, 96), (96, 100))):
                (chunk,) = client.get_tensors(namespace, keys[index : index + 1])
                expected = producer.expected_kv("p", start, end, layers=[layer])
                assert chunk is not None and bitwise_equal(chunk, expected), (namespace.extra, index)


def test_a_consumer_loads_each_group_bit_exact_and_computes_only_the_last_token(model_dir: str, server) -> None:
    produce(model_dir, server.target)
    consumer = consume(model_dir, server.target)
    assert consumer.computed_positions("c") == [99]
    assert_group_kv(consumer, "c", 100)
    # One request, one lookup; the full group loads its 4 chunks, the sliding group only its window:
    # vLLM holds blocks from (99 - 7) // 16 = 5 on, tokens [80, 99), in chunks 2 and 3.
    assert consumer.stats.data["lookups"] == 1
    assert consumer.stats.data["load_chunks"] == 4 + 2
    assert consumer.stats.data["hit_tokens"] == 99


def test_an_evicted_chunk_outside_the_window_costs_the_sliding_group_nothing(model_dir: str, server) -> None:
    producer = produce(model_dir, server.target)
    full, sliding = group_namespaces(producer)
    with KVCacheClient(server.target, timeout_s=5) as client:
        assert client.delete(sliding, chunk_keys(PROMPT, sliding)[:2]) == 2
    consumer = consume(model_dir, server.target)
    assert consumer.computed_positions("c") == [99]
    assert not consumer.invalid_block_ids()
    assert_group_kv(consumer, "c", 100)

    # The same chunk missing in the full-attention group is a miss: every token before a hit is needed.
    with KVCacheClient(server.target, timeout_s=5) as client:
        assert client.delete(full, chunk_keys(PROMPT, full)[:1]) == 1
    again = consume(model_dir, server.target)
    assert again.computed_positions("c") == list(range(100))
    assert again.stats.data.get("hit_tokens", 0) == 0


def test_a_chunk_missing_inside_the_window_shortens_the_hit_to_what_every_group_can_serve(
    model_dir: str, server
) -> None:
    producer = produce(model_dir, server.target)
    _, sliding = group_namespaces(producer)
    with KVCacheClient(server.target, timeout_s=5) as client:
        assert client.delete(sliding, chunk_keys(PROMPT, sliding)[2:3]) == 1
    consumer = consume(model_dir, server.target)
    # A hit at 99 needs sliding chunks 2 and 3; at 96 (chunks 0..2), chunk 2 too; at 64 the block
    # [48, 64) of chunk 1 only, which is stored: 64 tokens load, vLLM computes the other 36.
    assert consumer.stats.data["hit_tokens"] == 64
    assert not consumer.invalid_block_ids()
    assert consumer.computed_positions("c") == list(range(64, 100))
    assert_group_kv(consumer, "c", 100)


def test_a_chunk_whose_first_blocks_vllm_freed_is_saved_from_the_first_block_it_holds(model_dir: str, server) -> None:
    # Steps of 56 tokens: chunk 1 [32, 64) is computed over two steps, and by the second vLLM has
    # freed the sliding-window blocks [32, 48) (they hold none of the last 7 tokens before 56). The
    # connector saves chunk 1's sliding group from block [48, 64) on: nothing unwritten is ever
    # stored, and that suffix is all a later hit can need of the chunk.
    producer = produce(model_dir, server.target, step_tokens=56)
    full, sliding = group_namespaces(producer)
    with KVCacheClient(server.target, timeout_s=5) as client:
        assert client.lookup(full, chunk_keys(PROMPT, full)).prefix_length == 4
        sliding_keys = chunk_keys(PROMPT, sliding)
        assert client.lookup(sliding, sliding_keys).prefix_length == 4
        (suffix,) = client.get_tensors(sliding, sliding_keys[1:2])
        assert suffix is not None and bitwise_equal(suffix, producer.expected_kv("p", 48, 64, layers=[1]))
    # The whole prompt hits: its window lies in chunks 2 and 3.
    consumer = consume(model_dir, server.target)
    assert consumer.computed_positions("c") == [99]
    assert_group_kv(consumer, "c", 100)
    # A prompt sharing only the first 64 tokens: a hit at 64 needs sliding block [48, 64), the suffix.
    other = consume(model_dir, server.target, PROMPT[:64] + list(range(900, 940)))
    assert other.stats.data["hit_tokens"] == 64
    assert not other.invalid_block_ids()
    assert other.computed_positions("c") == list(range(64, 104))
    assert_group_kv(other, "c", 104)


def test_a_stored_suffix_that_does_not_reach_back_far_enough_fails_its_blocks_and_vllm_recomputes(
    model_dir: str, server
) -> None:
    # A consumer whose sliding layers keep 16 more tokens (vLLM's extra_retained_tokens, for multi-token
    # prediction) shares the namespace but needs [32, 64) of chunk 1 for a hit at 64: the stored suffix
    # [48, 64) does not reach back to 32, so the load fails instead of leaving those blocks unwritten.
    # vLLM 0.33 takes no block ids for several groups: the request is reported failed and recomputed whole.
    produce(model_dir, server.target, step_tokens=56)
    consumer = make_engine(
        model_dir,
        role="kv_consumer",
        sliding_window=WINDOW,
        extra_retained_tokens=16,
        extra={"target": server.target},
    )
    consumer.add("c", PROMPT[:64] + list(range(900, 940)))
    consumer.run()
    assert consumer.failed_requests() == {"c"} and not consumer.invalid_block_ids()
    assert consumer.stats.data["load_failures"] == 1  # chunk 1 of the sliding group
    assert consumer.computed_positions("c") == list(range(104))
    assert_group_kv(consumer, "c", 104)
    assert consumer.connector.open_requests == 0


def test_hybrid_groups_shard_over_tensor_parallel_ranks(model_dir: str, server) -> None:
    produce(model_dir, server.target, tp_size=2)
    consumer = consume(model_dir, server.target, tp_size=2)
    assert consumer.computed_positions("c") == [99]
    for rank in (0, 1):
        assert_group_kv(consumer, "c", 100, rank=rank)
    assert consumer.stats.data["load_chunks"] == 2 * (4 + 2)


def test_a_state_group_is_refused_at_start_up_naming_it(model_dir: str) -> None:
    assert supports_hma(KVCacheConnector)
    kv_cache_config = KVCacheConfig(
        8,
        [],
        [
            KVCacheGroupSpec([LAYER_NAMES[0]], attention_spec()),
            KVCacheGroupSpec(
                [LAYER_NAMES[1]], MambaSpec(block_size=BLOCK, shapes=((4, CHUNK),), dtypes=(torch.float16,))
            ),
        ],
    )
    with pytest.raises(ValueError, match=r"KV-cache group 1 \(MambaSpec.*recurrent-state"):
        KVConnectorFactory.create_connector(make_vllm_config(model_dir), KVConnectorRole.SCHEDULER, kv_cache_config)


def test_a_chunk_is_announced_once_every_group_stored_it(model_dir: str, server) -> None:
    # Steps of 56 tokens: chunk 1's sliding group is stored from block [48, 64) (see above); it counts.
    producer = make_engine(
        model_dir,
        role="kv_producer",
        sliding_window=WINDOW,
        max_num_batched_tokens=56,
        kv_events=True,
        extra={"target": server.target},
    )
    producer.add("p", PROMPT)
    producer.run()
    producer.settle()
    producer.step()  # collects what the workers heard back
    events = producer.kvcache_events()
    # Chunks 0..2 have full blocks and both groups' puts; the 4-token tail has no full block.
    assert [e.token_ids for e in events] == [PROMPT[0:32], PROMPT[32:64], PROMPT[64:96]]
    assert producer.connector.pending_events == 0


def test_write_back_in_a_hybrid_model_serves_the_next_turn_as_far_as_every_group_can(model_dir: str, server) -> None:
    turn1 = make_engine(model_dir, sliding_window=WINDOW, extra={"target": server.target})
    turn1.add("t1", PROMPT, max_tokens=30)  # 130 tokens, 129 with KV
    turn1.run(max_steps=60)
    full, sliding = group_namespaces(turn1)
    conversation = PROMPT + [SAMPLED] * 30
    with KVCacheClient(server.target, timeout_s=5) as client:
        # Chunk 3 [96, 128) was completed by decoding, one token per step: the full group stored it
        # whole; by then vLLM had freed its sliding-window block [96, 112), so that group stored the
        # block it still held, [112, 128).
        assert client.lookup(full, chunk_keys(conversation, full, include_partial=False)).prefix_length == 4
        sliding_keys = chunk_keys(conversation, sliding, include_partial=False)
        assert client.lookup(sliding, sliding_keys).prefix_length == 4
        (suffix,) = client.get_tensors(sliding, sliding_keys[3:4])
        assert suffix is not None and tuple(suffix.shape)[3] == 16

    turn2 = make_engine(model_dir, sliding_window=WINDOW, extra={"target": server.target})
    turn2.add("c", [*conversation, *range(500, 520)])  # 150 tokens
    turn2.run(max_steps=60)
    # A hit at 128 needs sliding block [112, 128) of chunk 3: stored. The 22 tokens after it were never.
    assert turn2.stats.data["hit_tokens"] == 128
    assert turn2.computed_positions("c") == list(range(128, 150))
    assert_group_kv(turn2, "c", 150)


def test_a_model_whose_every_layer_slides_needs_only_the_window_of_the_hit(model_dir: str, server) -> None:
    # One sliding-window group over both layers (Mistral under vLLM's hybrid allocator): no group
    # needs the chunks before the window, so evicted early chunks cost nothing.
    producer = make_engine(
        model_dir, role="kv_producer", sliding_window=WINDOW, all_sliding=True, extra={"target": server.target}
    )
    producer.add("p", PROMPT)
    producer.run()
    (sliding,) = (facts.namespaces()[0] for facts in producer.connector._scheduler._groups)
    assert dict(sliding.extra)["vllm.kv_group"] == f"sliding_window:{WINDOW}"
    with KVCacheClient(server.target, timeout_s=5) as client:
        assert client.delete(sliding, chunk_keys(PROMPT, sliding)[:2]) == 2
    consumer = make_engine(
        model_dir, role="kv_consumer", sliding_window=WINDOW, all_sliding=True, extra={"target": server.target}
    )
    consumer.add("c", PROMPT)
    consumer.run()
    assert consumer.computed_positions("c") == [99]
    assert consumer.stats.data["load_chunks"] == 2  # the window before 99: blocks from 80, chunks 2 and 3
    table = consumer.last_block_ids("c")
    held = [b for b in range(len(table)) if table[b] != 0]
    assert held[0] * BLOCK <= 100 - WINDOW and held[-1] == 6  # the window before 100 is held
    for b in held:
        start, stop = b * BLOCK, min(100, b * BLOCK + BLOCK)
        assert bitwise_equal(consumer.paged_kv("c", start, stop), consumer.expected_kv("c", start, stop)), b
