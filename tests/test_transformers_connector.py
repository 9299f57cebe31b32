"""The transformers connector in one process against a real server (the `server` fixture): the
canonical layout, prefix hits, salts, damaged chunks, a server that is down, and misuse."""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer

from examples._support import random_prompt
from kvcache_client import KVCacheClient, KVCacheError, Namespace, RetryPolicy, Unavailable
from kvcache_connectors.transformers import (
    TransformersKVConnector,
    cache_from_chunks,
    cache_kwargs,
    chunks_from_cache,
    namespace_for_model,
)
from kvcache_core.format import encode_block
from tests.conftest import ServerThread
from tests.helpers_models import VOCAB, generate, load_model, prefill, write_small_model

pytestmark = pytest.mark.timeout(60)

CHUNK = 16
NEW_TOKENS = 8
LAYERS, KV_HEADS, HEAD_SIZE = 4, 2, 32  # the small model's


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_small_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def model(model_dir: str) -> LlamaForCausalLM:
    return load_model(model_dir)


@pytest.fixture
def client(server: ServerThread) -> Iterator[KVCacheClient]:
    with KVCacheClient(server.target, timeout_s=10) as c:
        yield c


def connect(client: KVCacheClient, model: LlamaForCausalLM, *, cache_salt: str = "") -> TransformersKVConnector:
    return TransformersKVConnector(client, namespace_for_model(model, chunk_tokens=CHUNK, cache_salt=cache_salt))


def kv(cache: DynamicCache, num_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's first `num_tokens` keys and values."""
    return [(layer.keys[..., :num_tokens, :], layer.values[..., :num_tokens, :]) for layer in cache.layers]


def assert_same_kv(a: DynamicCache, b: DynamicCache, num_tokens: int) -> None:
    assert a.get_seq_length() == num_tokens
    for (ka, va), (kb, vb) in zip(kv(a, num_tokens), kv(b, num_tokens), strict=True):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


def assert_continues_exactly(model: LlamaForCausalLM, prompt: list[int], cache: DynamicCache | None) -> None:
    """Generation from `cache` is the generation without one: same tokens, first logits within float error."""
    want = generate(model, prompt, NEW_TOKENS, cache=None)
    got = generate(model, prompt, NEW_TOKENS, cache=cache)
    assert got.tokens == want.tokens
    torch.testing.assert_close(got.first_logits, want.first_logits, atol=1e-4, rtol=0)


# -- namespace -----------------------------------------------------------------------------------------


def test_namespace_comes_from_the_config(model: LlamaForCausalLM, model_dir: str) -> None:
    ns = namespace_for_model(model, chunk_tokens=CHUNK)
    assert (ns.model_id, ns.model_revision, ns.kv_dtype, ns.chunk_tokens) == (model_dir, "", "float32", CHUNK)
    assert (ns.num_layers, ns.num_kv_heads, ns.head_size, ns.tp_size, ns.cache_salt) == (4, 2, 32, 1, "")
    # Another load of the same checkpoint (as another process would) agrees on every key.
    again = namespace_for_model(load_model(model_dir), chunk_tokens=CHUNK)
    assert again == ns and again.fingerprint == ns.fingerprint
    assert namespace_for_model(model, chunk_tokens=CHUNK, model_id="org/model").model_id == "org/model"
    assert namespace_for_model(model, chunk_tokens=CHUNK, cache_salt="a").fingerprint != ns.fingerprint
    assert namespace_for_model(model).chunk_tokens == 256


def test_namespace_of_a_model_built_in_memory() -> None:
    config = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4
    )  # no num_key_value_heads (MHA) and no head_dim: hidden_size // heads
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    with pytest.raises(ValueError, match="model_id"):
        namespace_for_model(model)
    ns = namespace_for_model(model, model_id="mem/llama", chunk_tokens=8)
    assert (ns.kv_dtype, ns.num_layers, ns.num_kv_heads, ns.head_size) == ("bfloat16", 3, 4, 16)


def test_cache_kwargs_names_the_cache_argument(model: LlamaForCausalLM) -> None:
    cache = DynamicCache()
    # The name this transformers' forward takes: `cache` in newer 5.x, `past_key_values` before
    # (vllm 0.33.0 pins transformers < 5.21, which still uses the old name).
    params = inspect.signature(model.forward).parameters
    expected = "cache" if "cache" in params else "past_key_values"
    assert expected in params
    assert cache_kwargs(model, cache) == {expected: cache}
    out = model(torch.tensor([[1, 2, 3]]), use_cache=True, **cache_kwargs(model, cache))
    assert out.past_key_values is cache and cache.get_seq_length() == 3  # the model really used it
    assert cache_kwargs(model, None) == {}


# -- canonical layout ----------------------------------------------------------------------------------


def test_canonical_layout_round_trip(model: LlamaForCausalLM) -> None:
    prompt = random_prompt(37, VOCAB, seed=1)
    cache = prefill(model, prompt)
    chunks = chunks_from_cache(cache, 0, 37, CHUNK)
    assert [tuple(c.shape) for c in chunks] == [(LAYERS, 2, KV_HEADS, t, HEAD_SIZE) for t in (16, 16, 5)]
    # [l, 0, h, t] is layer l's key of head h for the chunk's token t; [l, 1, h, t] its value.
    for i, chunk in enumerate(chunks):
        for layer, (k, v) in enumerate(kv(cache, 37)):
            assert torch.equal(chunk[layer, 0], k[0, :, i * CHUNK : i * CHUNK + chunk.shape[3]])
            assert torch.equal(chunk[layer, 1], v[0, :, i * CHUNK : i * CHUNK + chunk.shape[3]])
    assert_same_kv(cache_from_chunks(chunks, 37), cache, 37)
    # Fewer tokens than the chunks hold: the same as building the whole cache and cropping it.
    cropped = cache_from_chunks(chunks, 37)
    cropped.crop(-7)
    assert_same_kv(cache_from_chunks(chunks, 30), cropped, 30)
    # From a later chunk boundary on: tokens 16..36.
    tail = DynamicCache([(k[..., 16:, :], v[..., 16:, :]) for k, v in kv(cache, 37)])
    assert_same_kv(cache_from_chunks(chunks_from_cache(cache, 16, 37, CHUNK), 21), tail, 21)
    with pytest.raises(ValueError, match="multiple of chunk_tokens"):
        chunks_from_cache(cache, 5, 37, CHUNK)
    with pytest.raises(ValueError, match="not in a cache of 37"):
        chunks_from_cache(cache, 0, 38, CHUNK)
    with pytest.raises(ValueError, match="num_tokens"):
        cache_from_chunks(chunks, 38)


# -- save and load -------------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [1, 5, 16, 33, 48])
def test_save_then_load_continues_exactly(client: KVCacheClient, model: LlamaForCausalLM, length: int) -> None:
    connector = connect(client, model)
    prompt = random_prompt(length, VOCAB, seed=length)
    cache = prefill(model, prompt)
    chunks = -(-length // CHUNK)
    assert connector.save(prompt, cache) == chunks
    assert connector.save(prompt, cache) == 0  # all there: one lookup, nothing sent
    assert (connector.stats.chunks_saved, connector.stats.chunks_skipped) == (chunks, chunks)

    loaded, n = connector.load(torch.tensor([prompt]))
    if length == 1:  # nothing to load: the only token must run to give the first logits
        assert (loaded, n) == (None, 0)
        return
    assert n == length - 1
    assert loaded is not None
    assert_same_kv(loaded, cache, n)  # bit for bit what the prefill computed
    assert connector.stats.tokens_loaded == n and connector.stats.bytes_loaded > 0
    assert_continues_exactly(model, prompt, loaded)


def test_partial_prefix_hit_loads_only_the_shared_full_chunks(client: KVCacheClient, model: LlamaForCausalLM) -> None:
    connector = connect(client, model)
    stored = random_prompt(40, VOCAB, seed=2)  # chunks 0-15, 16-31, and an 8-token tail
    stored_cache = prefill(model, stored)
    assert connector.save(stored, stored_cache) == 3

    sharing = stored[:35] + random_prompt(10, VOCAB, seed=3)
    cache, n = connector.load(sharing)
    assert n == 32 and connector.take_stats().chunks_loaded == 2
    assert cache is not None
    assert_same_kv(cache, stored_cache, 32)
    assert_continues_exactly(model, sharing, cache)

    # A longer prompt does not find the shorter one's tail: that key names "these 8 tokens and no more".
    cache, n = connector.load(stored + random_prompt(5, VOCAB, seed=4))
    assert n == 32
    assert connector.load(stored[:10] + random_prompt(30, VOCAB, seed=5)) == (None, 0)

    # Saving the sharing prompt sends only what follows the shared chunks.
    assert connector.save(sharing, prefill(model, sharing)) == 1
    assert connector.take_stats().chunks_skipped == 2


def test_save_after_generate_serves_the_next_turn(client: KVCacheClient, model: LlamaForCausalLM) -> None:
    connector = connect(client, model)
    prompt = random_prompt(30, VOCAB, seed=6)
    cache = DynamicCache()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10, do_sample=False, **cache_kwargs(model, cache)
        )
    turn = out[0].tolist()  # 40 tokens; the cache holds all but the last, which was never fed back
    assert cache.get_seq_length() == 39
    assert connector.save(turn[:-1], cache) == 3
    # A cache longer than the tokens: its head is used. Chunk 0 is there; the 4-token tail is new.
    assert connector.save(prompt[:20], cache) == 1
    follow_up = turn + random_prompt(12, VOCAB, seed=7)
    loaded, n = connector.load(follow_up)
    assert n == 32  # the two full chunks of the first turn; its 7-token tail names a shorter prompt
    assert_continues_exactly(model, follow_up, loaded)


def test_saves_ask_for_retention_by_the_connector_or_by_the_call(
    client: KVCacheClient, model: LlamaForCausalLM
) -> None:
    """A session that stays (issue #26): the connector's retain_ttl_s makes every save a retained put,
    a save's own retain_ttl_s overrides it (None: not retained); the server's RAM counts them."""

    def retained() -> int:
        return client.stats().tier("ram").retained_blocks

    plain = connect(client, model)
    prompt = random_prompt(40, VOCAB, seed=30)
    assert plain.save(prompt, prefill(model, prompt)) == 3
    assert retained() == 0
    session = TransformersKVConnector(client, plain.namespace, retain_ttl_s=600)
    turn = random_prompt(40, VOCAB, seed=31)
    assert session.save(turn, prefill(model, turn)) == 3
    assert retained() == 3
    other = random_prompt(20, VOCAB, seed=32)
    assert session.save(other, prefill(model, other), retain_ttl_s=None) == 2  # this call: not retained
    assert retained() == 3
    longer = [*other, 1, 2]
    assert plain.save(longer, prefill(model, longer), retain_ttl_s=60) == 1
    assert retained() == 4
    for bad in (0, -1.0, float("inf"), float("nan"), True, "600"):
        with pytest.raises(ValueError, match="retain_ttl_s"):
            TransformersKVConnector(client, plain.namespace, retain_ttl_s=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="retain_ttl_s"):
            plain.save(prompt, prefill(model, prompt), retain_ttl_s=bad)  # type: ignore[arg-type]


def test_cache_salt_isolates(client: KVCacheClient, model: LlamaForCausalLM) -> None:
    prompt = random_prompt(40, VOCAB, seed=8)
    assert connect(client, model, cache_salt="tenant-a").save(prompt, prefill(model, prompt)) == 3
    assert connect(client, model, cache_salt="tenant-b").load(prompt) == (None, 0)
    assert connect(client, model).load(prompt) == (None, 0)
    assert connect(client, model, cache_salt="tenant-a").load(prompt)[1] == 39


# -- damaged chunks and a server that is down ----------------------------------------------------------


def saved_prompt(client: KVCacheClient, model: LlamaForCausalLM) -> tuple[TransformersKVConnector, list[int], list]:
    connector = connect(client, model)
    prompt = random_prompt(64, VOCAB, seed=9)
    assert connector.save(prompt, prefill(model, prompt)) == 4
    return connector, prompt, client.chunk_keys(prompt, connector.namespace)


def test_missing_chunk_in_the_middle_ends_the_prefix(client: KVCacheClient, model: LlamaForCausalLM) -> None:
    connector, prompt, keys = saved_prompt(client, model)
    assert client.delete(connector.namespace, [keys[1]]) == 1
    cache, n = connector.load(prompt)
    assert n == 16  # chunks 2 and 3 are stored, but their KV depends on chunk 1
    assert_continues_exactly(model, prompt, cache)


def test_corrupt_chunk_in_the_middle_ends_the_prefix(
    server: ServerThread, client: KVCacheClient, model: LlamaForCausalLM
) -> None:
    connector, prompt, keys = saved_prompt(client, model)
    block = bytearray(client.get_many(connector.namespace, [keys[1]])[0])
    block[-1] ^= 0x01  # one payload bit
    # Straight into the RAM tier: the server's Put would refuse a block that fails its checksum.
    ram = server.stack.tiers[0]
    assert ram.put_many_sync(connector.namespace.name, [(keys[1], bytes(block))]) == [True]
    cache, n = connector.load(prompt)
    assert n == 16 and client.corrupt_blocks == 1
    assert_continues_exactly(model, prompt, cache)


def test_another_chunks_valid_block_ends_the_prefix(
    server: ServerThread, client: KVCacheClient, model: LlamaForCausalLM
) -> None:
    """The most dangerous misdirection: a block of the right shape, dtype and layout, intact, but made for
    another chunk. Format v2 binds it to its key, so the load stops there instead of using the wrong KV."""
    connector, prompt, keys = saved_prompt(client, model)
    other = client.get_many(connector.namespace, [keys[2]])[0]
    assert other is not None
    ram = server.stack.tiers[0]
    assert ram.put_many_sync(connector.namespace.name, [(keys[1], bytes(other))]) == [True]
    cache, n = connector.load(prompt)
    assert n == 16 and client.corrupt_blocks == 1
    assert_continues_exactly(model, prompt, cache)


def test_chunk_of_the_wrong_shape_ends_the_prefix(client: KVCacheClient, model: LlamaForCausalLM) -> None:
    connector, prompt, keys = saved_prompt(client, model)
    # A valid block of another shape under this namespace's key: a writer's bug, refused as a miss.
    wrong = torch.zeros(LAYERS, 2, KV_HEADS, CHUNK, HEAD_SIZE // 2)
    client.delete(connector.namespace, [keys[1]])
    assert client.put_tensors(connector.namespace, [keys[1]], [wrong]).stored == 1
    assert connector.load(prompt)[1] == 16
    raw = encode_block(b"\0" * 64, key=keys[0], dtype="uint8", shape=(64,))
    client.delete(connector.namespace, [keys[0]])
    assert client.put_many(connector.namespace, [(keys[0], raw)]).stored == 1
    assert connector.load(prompt) == (None, 0)
    assert connector.stats.invalid_chunks == 2


def test_server_down(model: LlamaForCausalLM) -> None:
    gone = ServerThread({})
    target = gone.target
    gone.stop()  # nothing listens on its port now
    prompt = random_prompt(40, VOCAB, seed=10)
    cache = prefill(model, prompt)
    retry = RetryPolicy(max_attempts=2, initial_backoff_s=0.01)
    with KVCacheClient(target, timeout_s=5, retry=retry) as client:
        connector = connect(client, model)
        # load: a miss, counted; the request recomputes.
        assert connector.load(prompt) == (None, 0)
        assert connector.stats.load_failures == 1
        # save: the SDK's typed error; the cache is untouched and generation goes on with it.
        with pytest.raises(Unavailable) as raised:
            connector.save(prompt, cache)
        assert isinstance(raised.value, KVCacheError)
    assert cache.get_seq_length() == 40
    cache.crop(-1)  # generate() must compute the last prompt token itself
    assert_continues_exactly(model, prompt, cache)


# -- misuse ---------------------------------------------------------------------------------------------


def test_misuse_is_refused_before_anything_is_sent(client: KVCacheClient, model: LlamaForCausalLM) -> None:
    connector = connect(client, model)
    prompt = random_prompt(20, VOCAB, seed=11)
    cache = prefill(model, prompt)
    with pytest.raises(ValueError, match="batch"):
        connector.save(torch.tensor([prompt, prompt]), cache)
    with pytest.raises(ValueError, match="batch"):
        connector.load(torch.tensor([prompt, prompt]))
    with pytest.raises(ValueError, match="fewer than the 21"):
        connector.save([*prompt, 1], cache)
    with pytest.raises(ValueError, match="token ids must be in"):
        connector.save([-1, *prompt[1:]], cache)
    bf16 = DynamicCache([(k.to(torch.bfloat16), v.to(torch.bfloat16)) for k, v in kv(cache, 20)])
    with pytest.raises(ValueError, match="bfloat16"):
        connector.save(prompt, bf16)
    with pytest.raises(ValueError, match="has no layers"):
        connector.save(prompt, DynamicCache())
    sliding = Cache(layers=[DynamicSlidingWindowLayer(sliding_window=8) for _ in range(LAYERS)])
    for i, (k, v) in enumerate(kv(cache, 20)):
        sliding.update(k, v, i)
    with pytest.raises(ValueError, match="DynamicSlidingWindowLayer"):
        connector.save(prompt, sliding)
    with pytest.raises(ValueError, match="tp_size"):
        TransformersKVConnector(client, Namespace(**{**connector.namespace.to_dict(), "tp_size": 2, "tp_rank": 1}))
    assert client.stats().tier("ram").puts == 0
