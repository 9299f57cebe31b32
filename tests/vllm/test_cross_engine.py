"""One canonical layout, two engines: KV saved by the transformers connector loads through the vLLM connector.

A real (tiny, random-weight) Llama computes a prompt's KV in transformers; the transformers
connector stores it; the vLLM connector's worker path, on vLLM 0.33's own paged tensors, loads
it into its blocks. Every K and V value in the target slots must equal what the model computed,
bit for bit: the same keys, the same canonical chunks, read by an engine that never saw the model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvcache_client import KVCacheClient, chunk_keys
from kvcache_connectors.transformers import TransformersKVConnector, namespace_for_model
from kvcache_connectors.vllm import ChunkRef, KVCacheConnectorMetadata, RequestTransfer
from tests.vllm.harness import (
    BLOCK,
    CHUNK,
    HEAD,
    KV_HEADS,
    LAYER_NAMES,
    NUM_LAYERS,
    allocate_caches,
    expected_namespace,
    make_kv_cache_config,
    make_vllm_config,
    make_worker,
    read_token,
)

pytestmark = pytest.mark.timeout(120)

PROMPT = [(37 * i + 11) % 1000 for i in range(70)]  # 70 tokens: chunks of 32, 32 and a 6-token tail
DST_BLOCKS = (6, 1, 12, 3, 9)


@pytest.fixture(scope="module")
def real_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Weights and config of a tiny Llama with the harness's shapes, saved as a user's checkpoint is."""
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=KV_HEADS * 2 * HEAD,
        intermediate_size=128,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=KV_HEADS,
        vocab_size=1000,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        initializer_range=0.1,
    )
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).to(torch.float16).save_pretrained(path)
    return str(path)


def test_kv_saved_by_transformers_loads_bitwise_through_the_vllm_worker(real_model_dir: str, server) -> None:
    model = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float16).eval()
    namespace = namespace_for_model(model, model_id=real_model_dir, chunk_tokens=CHUNK)
    with torch.no_grad():
        cache = model(torch.tensor([PROMPT]), use_cache=True).past_key_values
    with KVCacheClient(server.target) as client:
        assert TransformersKVConnector(client, namespace).save(PROMPT, cache) == 3

    vllm_config = make_vllm_config(str(Path(real_model_dir)), extra={"target": server.target})
    kv_cache_config = make_kv_cache_config(16)
    worker = make_worker(vllm_config, kv_cache_config)
    caches = allocate_caches(kv_cache_config, KVCacheLayout.LBNHC)
    worker.register_kv_caches(caches)
    # The namespace the transformers connector derived from the model's config is the one the vLLM
    # connector derives from vLLM's configs (tests/vllm check the vLLM side against expected_namespace).
    assert namespace == expected_namespace(real_model_dir)

    keys = chunk_keys(PROMPT, namespace)
    end = len(PROMPT) - 1  # vLLM computes the last prompt token itself
    chunks = tuple(
        ChunkRef(
            index=i,
            keys=(key,),
            num_tokens=min(CHUNK, len(PROMPT) - i * CHUNK),
            start=i * CHUNK,
            end=min(end, (i + 1) * CHUNK),
        )
        for i, key in enumerate(keys)
    )
    worker.bind_connector_metadata(
        KVCacheConnectorMetadata(loads=(RequestTransfer("r", (namespace.name,), DST_BLOCKS, chunks),))
    )
    worker.start_load_kv(None)
    worker.wait_for_save()
    assert worker._worker is not None and worker._worker.wait_idle(10)  # loads run on a background thread
    assert worker.get_finished(set()) == (None, {"r"})
    assert worker.get_block_ids_with_load_errors() == set()
    worker.clear_connector_metadata()

    for layer, name in enumerate(LAYER_NAMES):
        keys_hf, values_hf = cache.layers[layer].keys[0], cache.layers[layer].values[0]  # [H, T, D]
        for position in range(end):
            loaded = read_token(caches[name], DST_BLOCKS[position // BLOCK], position % BLOCK)  # [2, H, D]
            assert torch.equal(loaded[0].view(torch.int16), keys_hf[:, position].view(torch.int16)), (layer, position)
            assert torch.equal(loaded[1].view(torch.int16), values_hf[:, position].view(torch.int16)), (layer, position)
