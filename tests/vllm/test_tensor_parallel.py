"""Tensor parallelism, head-sharded: one namespace whatever the TP size, blocks of KV heads in it.

The tiny model has 2 KV heads. At TP=2 each rank holds one and saves it as its own block of
each chunk (head_block_key(chunk key, rank, 1, 2)); at TP=1 the one rank holds both, as one
block under the chunk key itself (the default) or as two 1-head blocks (kv_heads_per_block 1);
at TP=4 vLLM replicates each head over two ranks, which load the same 1-head block. Every test
checks every rank's paged KV bit for bit against the fake model's.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvcache_client import KVCacheClient, chunk_keys
from kvcache_client.client import KVCacheClient as SDKClient
from kvcache_core.keys import head_block_key
from tests.vllm.harness import KV_HEADS, Engine, bitwise_equal, expected_namespace, make_engine

pytestmark = pytest.mark.timeout(60)

PROMPT = list(range(40, 140))  # 100 tokens: 4 chunks of 32 (the last a 4-token tail)


def head_keys(model_dir: str, head: int, heads_per_block: int = 1) -> list[bytes]:
    namespace = expected_namespace(model_dir)
    return [head_block_key(key, head, heads_per_block, KV_HEADS) for key in chunk_keys(PROMPT, namespace)]


def run(model_dir: str, target: str, role: str, tp_size: int, request_id: str, **extra: object) -> Engine:
    engine = make_engine(model_dir, tp_size=tp_size, role=role, extra={"target": target, **extra})
    engine.add(request_id, PROMPT)
    engine.run()
    return engine


def assert_every_rank_holds_the_prompt(engine: Engine) -> None:
    for rank in range(len(engine.workers)):
        got, want = engine.paged_kv("c", 0, 100, rank=rank), engine.expected_kv("c", 0, 100, rank=rank)
        assert got.shape[2] == engine.heads_per_rank and bitwise_equal(got, want), f"rank {rank}"


@pytest.fixture
def gets(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, int]]]:
    """Every read the SDK makes for the connector (leased: in place where it can): (namespace, number of keys)."""
    calls: list[tuple[str, int]] = []
    original = SDKClient.leased

    def counting(self, namespace, keys, **kwargs):
        calls.append((str(namespace), len(keys)))
        return original(self, namespace, keys, **kwargs)

    monkeypatch.setattr(SDKClient, "leased", counting)
    yield calls


def test_each_rank_saves_its_heads_as_blocks_of_one_namespace_and_loads_them_back(
    model_dir: str, server, gets: list[tuple[str, int]]
) -> None:
    producer = run(model_dir, server.target, "kv_producer", 2, "p")
    namespace = expected_namespace(model_dir)
    with KVCacheClient(server.target, timeout_s=5) as client:
        for rank in (0, 1):
            keys = head_keys(model_dir, rank)
            assert client.lookup(namespace, keys).prefix_length == 4
            (first,) = client.get_tensors(namespace, keys[:1])
            assert first is not None and bitwise_equal(first, producer.expected_kv("p", 0, 32, rank=rank))
        # No block holds both heads: at TP=2 no chunk is stored whole.
        assert client.lookup(namespace, chunk_keys(PROMPT, namespace)).prefix_length == 0

    gets.clear()
    consumer = run(model_dir, server.target, "kv_consumer", 2, "c")
    assert consumer.computed_positions("c") == [99]
    assert_every_rank_holds_the_prompt(consumer)
    # Two ranks, four chunks each; the scheduler looked the prompt up once; equal TP sizes: one Get per
    # rank, of one block per chunk.
    assert (consumer.stats.data["load_chunks"], consumer.stats.data["lookups"]) == (8, 1)
    assert gets == [(namespace.name, 4), (namespace.name, 4)]


def test_a_block_missing_for_one_rank_shortens_the_hit_for_all(model_dir: str, server) -> None:
    run(model_dir, server.target, "kv_producer", 2, "p")
    with KVCacheClient(server.target, timeout_s=5) as client:
        assert client.delete(expected_namespace(model_dir), head_keys(model_dir, 1)[2:3]) == 1

    consumer = make_engine(model_dir, tp_size=2, role="kv_consumer", extra={"target": server.target})
    consumer.add("c", PROMPT)
    steps = consumer.run()
    # Rank 0 still has chunks 0..3, rank 1 only 0..1: both load 64 tokens, none fails.
    assert consumer.stats.data["hit_tokens"] == 64
    assert all(not step.invalid_block_ids for step in steps)
    assert consumer.computed_positions("c") == list(range(64, 100))
    assert_every_rank_holds_the_prompt(consumer)


def test_a_tp2_producers_chunks_load_bit_exact_into_tp1_and_tp4_consumers(
    model_dir: str, server, gets: list[tuple[str, int]]
) -> None:
    # TP=2's ranks hold one head each: its default blocks are 1-head blocks. A TP=1 consumer loads them
    # with kv_heads_per_block 1 (its two heads from two blocks per chunk, in one Get); a TP=4 consumer,
    # whose ranks hold one (replicated) head, loads them with its defaults.
    namespace = expected_namespace(model_dir)
    run(model_dir, server.target, "kv_producer", 2, "p")

    gets.clear()
    tp1 = run(model_dir, server.target, "kv_consumer", 1, "c", kv_heads_per_block=1)
    assert tp1.computed_positions("c") == [99]
    assert_every_rank_holds_the_prompt(tp1)
    assert gets == [(namespace.name, 8)]  # 4 chunks x 2 one-head blocks, one Get

    gets.clear()
    tp4 = run(model_dir, server.target, "kv_consumer", 4, "c")
    assert tp4.computed_positions("c") == [99]
    assert_every_rank_holds_the_prompt(tp4)
    assert gets == [(namespace.name, 4)] * 4  # each rank: its head's block of each chunk
    assert tp4.stats.data["load_chunks"] == 4 * 4


def test_a_tp1_producer_with_one_head_blocks_feeds_a_tp2_consumer(model_dir: str, server) -> None:
    run(model_dir, server.target, "kv_producer", 1, "p", kv_heads_per_block=1)
    consumer = run(model_dir, server.target, "kv_consumer", 2, "c")
    assert consumer.computed_positions("c") == [99]
    assert_every_rank_holds_the_prompt(consumer)


def test_blocks_of_another_granularity_are_a_miss_never_a_misread(model_dir: str, server) -> None:
    # The TP=2 producer stored 1-head blocks; a TP=1 consumer on its defaults wants whole chunks
    # (2-head blocks under the chunk keys): nothing matches, so it computes the prompt itself.
    run(model_dir, server.target, "kv_producer", 2, "p")
    consumer = run(model_dir, server.target, "kv_consumer", 1, "c")
    assert consumer.computed_positions("c") == list(range(100))
    assert consumer.stats.data.get("hit_tokens", 0) == 0
    assert_every_rank_holds_the_prompt(consumer)


def test_a_hand_off_between_instances_of_other_block_sizes_is_not_waited_for(
    model_dir: str, server, caplog: pytest.LogCaptureFixture
) -> None:
    producer = run(model_dir, server.target, "kv_producer", 2, "p")
    params = producer.kv_transfer_params["p"]
    assert params["kvcache_handoff"]["heads_per_block"] == [1]
    # A TP=1 consumer on its defaults reads 2-head blocks: the hand-off names none it could load, so
    # its load does not wait handoff_timeout_s for them; it computes the prompt at once, and says why.
    consumer = make_engine(
        model_dir, tp_size=1, role="kv_consumer", extra={"target": server.target, "handoff_timeout_s": 30.0}
    )
    consumer.add("c", PROMPT, kv_transfer_params=params)
    consumer.run(timeout_s=10)
    assert consumer.computed_positions("c") == list(range(100))
    assert "set kv_heads_per_block alike on both" in caplog.text
    # Set alike, the same hand-off loads.
    matched = make_engine(
        model_dir, tp_size=1, role="kv_consumer", extra={"target": server.target, "kv_heads_per_block": 1}
    )
    matched.add("c", PROMPT, kv_transfer_params=params)
    matched.run()
    assert matched.computed_positions("c") == [99]
    assert_every_rank_holds_the_prompt(matched)
