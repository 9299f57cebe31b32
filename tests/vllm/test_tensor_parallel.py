"""Tensor parallelism: each rank stores its own heads under its own namespace; a hit is one every rank has.

The tiny model has 2 KV heads, so at TP=2 each rank holds one, and its chunks go under
the namespace with tp_size=2, tp_rank=r, num_kv_heads=1.
"""

from __future__ import annotations

import pytest

from kvcache_client import KVCacheClient, chunk_keys
from tests.vllm.harness import bitwise_equal, expected_namespace, make_engine

pytestmark = pytest.mark.timeout(60)

PROMPT = list(range(40, 140))


def shard_namespace(model_dir: str, rank: int):
    return expected_namespace(model_dir, tp_size=2, tp_rank=rank, num_kv_heads=1)


def test_each_rank_saves_its_heads_under_its_own_namespace_and_loads_them_back(model_dir: str, server) -> None:
    producer = make_engine(model_dir, tp_size=2, role="kv_producer", extra={"target": server.target})
    producer.add("p", PROMPT)
    producer.run()

    with KVCacheClient(server.target, timeout_s=5) as client:
        for rank in (0, 1):
            namespace = shard_namespace(model_dir, rank)
            keys = chunk_keys(PROMPT, namespace)
            assert client.lookup(namespace, keys).prefix_length == 4
            (first,) = client.get_tensors(namespace, keys[:1])
            assert first is not None and bitwise_equal(first, producer.expected_kv("p", 0, 32, rank=rank))

    consumer = make_engine(model_dir, tp_size=2, role="kv_consumer", extra={"target": server.target})
    consumer.add("c", PROMPT)
    consumer.run()
    assert consumer.computed_positions("c") == [99]
    for rank in (0, 1):
        assert bitwise_equal(consumer.paged_kv("c", 0, 100, rank=rank), consumer.expected_kv("c", 0, 100, rank=rank))
    # Two ranks, four chunks each; the scheduler looked the prompt up once, in both namespaces.
    assert (consumer.stats.data["load_chunks"], consumer.stats.data["lookups"]) == (8, 1)


def test_a_chunk_missing_on_one_rank_shortens_the_hit_for_all(model_dir: str, server) -> None:
    producer = make_engine(model_dir, tp_size=2, role="kv_producer", extra={"target": server.target})
    producer.add("p", PROMPT)
    producer.run()
    namespace = shard_namespace(model_dir, 1)
    with KVCacheClient(server.target, timeout_s=5) as client:
        assert client.delete(namespace, chunk_keys(PROMPT, namespace)[2:3]) == 1

    consumer = make_engine(model_dir, tp_size=2, role="kv_consumer", extra={"target": server.target})
    consumer.add("c", PROMPT)
    steps = consumer.run()
    # Rank 0 still has chunks 0..3, rank 1 only 0..1: both load 64 tokens, none fails.
    assert consumer.stats.data["hit_tokens"] == 64
    assert all(not step.invalid_block_ids for step in steps)
    assert consumer.computed_positions("c") == list(range(64, 100))
    for rank in (0, 1):
        assert bitwise_equal(consumer.paged_kv("c", 0, 100, rank=rank), consumer.expected_kv("c", 0, 100, rank=rank))
