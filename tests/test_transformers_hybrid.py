"""Sliding-window and hybrid models through the transformers connector.

Random-weight models whose windows (8 tokens) are shorter than their prompts: Mistral (every layer
sliding), Qwen2 with `use_sliding_window` (full layers then sliding ones) and Gemma2 (alternating).
Chunks hold every layer's KV of every token; a load rebuilds the model's own cache layers, and the
generation from it is exactly the generation without a cache. The P/D proof runs the prefill and
the decode in separate spawned processes, against a kvcache server in a third.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from transformers import (
    DynamicCache,
    FalconH1Config,
    FalconH1ForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from examples._support import KVCacheServerProcess, random_prompt
from kvcache_client import KVCacheClient
from kvcache_connectors.transformers import TransformersKVConnector, cache_kwargs, namespace_for_model
from tests.conftest import ServerThread
from tests.helpers_models import (
    SLIDING_WINDOW,
    VOCAB,
    decode_worker,
    generate,
    in_spawned_process,
    load_model,
    prefill,
    prefill_worker,
    write_sliding_window_model,
)

pytestmark = pytest.mark.timeout(240)

CHUNK = 16
NEW_TOKENS = 10
SMALL = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}


def qwen2_mixed() -> PreTrainedModel:
    torch.manual_seed(1)
    config = Qwen2Config(
        **SMALL,
        num_hidden_layers=4,
        num_key_value_heads=2,
        use_sliding_window=True,
        sliding_window=SLIDING_WINDOW,
        max_window_layers=2,
        initializer_range=0.2,
    )
    return Qwen2ForCausalLM(config).eval()


def gemma2() -> PreTrainedModel:
    torch.manual_seed(2)
    config = Gemma2Config(
        **SMALL, num_hidden_layers=4, num_key_value_heads=2, head_dim=16, sliding_window=SLIDING_WINDOW
    )
    return Gemma2ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_sliding_window_model(tmp_path_factory.mktemp("mistral"))


@pytest.fixture
def client(server: ServerThread) -> Iterator[KVCacheClient]:
    with KVCacheClient(server.target, timeout_s=10) as c:
        yield c


def layer_kinds(cache: DynamicCache) -> list[str]:
    return [type(layer).__name__ for layer in cache.layers]


@pytest.mark.parametrize("build", [qwen2_mixed, gemma2], ids=["qwen2-sliding-layers", "gemma2-alternating"])
def test_a_hybrid_model_saves_every_layer_and_continues_exactly_from_its_own_cache_layers(
    client: KVCacheClient, build
) -> None:
    model = build()
    connector = TransformersKVConnector(client, namespace_for_model(model, model_id=build.__name__, chunk_tokens=CHUNK))
    prompt = random_prompt(45, VOCAB, seed=3)  # 2 full chunks and a tail; the window is 8
    assert connector.save(prompt, prefill(model, prompt)) == 3

    cache, loaded = connector.load(prompt, config=model.config)
    assert loaded == 44 and cache is not None
    own = DynamicCache(config=model.config)
    assert layer_kinds(cache) == layer_kinds(own) and "DynamicSlidingWindowLayer" in layer_kinds(cache)
    # The sliding layers keep what the model's own prefill keeps: the last window - 1 tokens.
    for layer in cache.layers:
        held = SLIDING_WINDOW - 1 if isinstance(layer, DynamicSlidingWindowLayer) else 44
        assert layer.keys.shape[2] == held
    want = generate(model, prompt, NEW_TOKENS, cache=None)
    got = generate(model, prompt, NEW_TOKENS, cache=cache)
    assert got.tokens == want.tokens
    torch.testing.assert_close(got.first_logits, want.first_logits, atol=1e-4, rtol=0)

    # Without the config every layer keeps every token; the model's masks still apply the window.
    full, _ = connector.load(prompt)
    assert full is not None and all(type(layer) is DynamicLayer for layer in full.layers)
    assert generate(model, prompt, NEW_TOKENS, cache=full).tokens == want.tokens


def test_the_models_own_sliding_cache_is_refused_for_saving_naming_the_layer(client: KVCacheClient) -> None:
    model = qwen2_mixed()
    connector = TransformersKVConnector(client, namespace_for_model(model, model_id="qwen2", chunk_tokens=CHUNK))
    prompt = random_prompt(30, VOCAB, seed=4)
    own = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.tensor([prompt]), use_cache=True, **cache_kwargs(model, own))
    with pytest.raises(
        ValueError, match=r"layer 2 is a DynamicSlidingWindowLayer \(window 8\) that kept only its last 7 of 30"
    ):
        connector.save(prompt, own)
    assert client.stats().tier("ram").puts == 0


@pytest.mark.parametrize(
    ("build", "layer"),
    [
        (
            lambda: Qwen3NextForCausalLM(Qwen3NextConfig(**SMALL, num_hidden_layers=4, num_key_value_heads=2)),
            "LinearAttentionLayer",
        ),
        (
            lambda: FalconH1ForCausalLM(FalconH1Config(**SMALL, num_hidden_layers=2, num_key_value_heads=2)),
            "LinearAttentionAndFullAttentionLayer",
        ),
    ],
    ids=["qwen3-next-linear-attention", "falcon-h1-hybrid-state"],
)
def test_models_with_recurrent_state_layers_are_refused_naming_them(build, layer: str) -> None:
    with torch.device("meta"):
        model = build()
    with pytest.raises(ValueError, match=rf"unsupported cache layers \['{layer}'\]"):
        namespace_for_model(model, model_id="state-model")


def test_pd_in_separate_processes_generates_exactly_what_one_process_generates(mistral_dir: str) -> None:
    server = KVCacheServerProcess(ram_capacity="64MiB")
    target = server.start()
    try:
        prompts = [random_prompt(n, VOCAB, seed=500 + n) for n in (20, 48, 61)]  # all longer than the window
        pre = in_spawned_process(prefill_worker, mistral_dir, target, prompts, CHUNK)
        assert pre["stored"] == [2, 3, 4]
        dec = in_spawned_process(decode_worker, mistral_dir, target, prompts, CHUNK, NEW_TOKENS)
        assert len({pre["pid"], dec["pid"], os.getpid()}) == 3
        model = load_model(mistral_dir)
        assert isinstance(model, MistralForCausalLM) and model.config.sliding_window == SLIDING_WINDOW
        for prompt, got in zip(prompts, dec["results"], strict=True):
            want = generate(model, prompt, NEW_TOKENS, cache=None)
            assert got["loaded"] == len(prompt) - 1
            assert got["tokens"] == want.tokens, f"{len(prompt)}-token prompt"
            torch.testing.assert_close(torch.tensor(got["first_logits"]), want.first_logits, atol=1e-4, rtol=0)
    finally:
        assert server.stop() == 0
