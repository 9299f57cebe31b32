"""Two requests or two engines whose KV differs never share a namespace; one engine gets one namespace in
every process.

The request facts (vllm.mm, vllm.lora) join user-supplied strings, so they must be injective: found in
review, one image "a@1;b" at offset 2 and two images "a"@1 and "b"@2 both gave vllm.mm "a@1;b@2" (the
second request would be served the first one's KV), and vllm.lora held the adapter's name only (two
instances loading other weights under one name shared KV).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.v1.request import Request

from kvcache_connectors.vllm.config import KVCacheConnectorConfig
from kvcache_connectors.vllm.namespaces import KVFacts
from kvcache_connectors.vllm.scheduler import request_extra
from kvcache_core.keys import chunk_keys
from tests.vllm.harness import BLOCK, make_kv_cache_config, make_vllm_config

PROMPT = list(range(40))

# Strings made of the separators, the escape character and what an escape looks like.
PIECES = ["a", "1", "@", ";", "%", "%40", "%3B", "%25", ":", "é"]
ADVERSARIAL = st.lists(st.sampled_from(PIECES), max_size=6).map("".join)


def request(*, images: Sequence[tuple[str, int]] = (), lora: LoRARequest | None = None) -> Request:
    features = [
        MultiModalFeatureSpec(data=None, modality="image", identifier=ident, mm_position=PlaceholderRange(offset, 1))
        for ident, offset in images
    ]
    return Request(
        request_id="r",
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        prompt_token_ids=PROMPT,
        mm_features=features or None,
        lora_request=lora,
    )


def facts(model_dir: str) -> KVFacts:
    vllm_config = make_vllm_config(model_dir)
    config = KVCacheConnectorConfig.from_extra_config(
        vllm_config.kv_transfer_config.kv_connector_extra_config, block_size=BLOCK
    )
    return KVFacts.from_vllm(vllm_config, make_kv_cache_config(8), config)


def keyed(group: KVFacts, req: Request) -> tuple[str, bytes]:
    """The request's namespace name and its prompt's first chunk key, as the scheduler computes them."""
    extra = request_extra(req)
    assert extra is not None
    (namespace,) = group.namespaces("", extra)
    return namespace.name, chunk_keys(PROMPT, namespace)[0]


def unescape(s: str) -> str:
    return re.sub("%(25|40|3B)", lambda m: {"25": "%", "40": "@", "3B": ";"}[m.group(1)], s)


def decode_mm(value: str) -> list[tuple[str, int]]:
    """docs/vllm.md's vllm.mm read back: ";" between items, "@" before each offset, identifiers unescaped."""
    items = []
    for item in value.split(";"):
        identifier, offset = item.split("@")  # an escaped identifier holds neither separator
        assert re.fullmatch("[0-9]+", offset), value
        items.append((unescape(identifier), int(offset)))
    return items


# -- vllm.mm ----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_one_image_named_with_separators_and_two_images_get_different_namespaces(model_dir: str) -> None:
    group = facts(model_dir)
    one = keyed(group, request(images=[("a@1;b", 2)]))
    two = keyed(group, request(images=[("a", 1), ("b", 2)]))
    assert one[0] != two[0], "one image 'a@1;b'@2 and two images 'a'@1, 'b'@2 share a namespace"
    assert one[1] != two[1]
    # Plain identifiers (vLLM's hex digests, UUIDs) are written as they are.
    assert request_extra(request(images=[("9f1c", 3), ("0a1b-c2", 40)])) == (("vllm.mm", "9f1c@3;0a1b-c2@40"),)


@pytest.mark.timeout(60)
def test_multimodal_facts_are_injective_over_every_short_adversarial_list() -> None:
    """Every list of at most two items, identifiers of up to 3 characters of "1", "@", ";", "%", "a", offsets 1
    and 12: no two give one vllm.mm value."""
    identifiers = ["".join(p) for n in range(4) for p in itertools.product("1@;%a", repeat=n)]
    items = list(itertools.product(identifiers, (1, 12)))
    seen: dict[str, tuple[tuple[str, int], ...]] = {}
    for images in itertools.chain(((i,) for i in items), itertools.product(items, repeat=2)):
        ((_, value),) = request_extra(request(images=list(images)))
        assert seen.setdefault(value, images) == images, f"{images} and {seen[value]} both give {value!r}"
    assert len(seen) == len(items) + len(items) ** 2


@pytest.mark.timeout(120)
@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(ADVERSARIAL, st.integers(0, 10**6)), min_size=1, max_size=4))
def test_multimodal_facts_decode_back_to_the_items(images: list[tuple[str, int]]) -> None:
    ((key, value),) = request_extra(request(images=images))
    assert key == "vllm.mm" and decode_mm(value) == images


# -- vllm.lora --------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_adapters_of_one_name_with_other_weights_get_different_namespaces(model_dir: str) -> None:
    group = facts(model_dir)
    sql_v1 = keyed(group, request(lora=LoRARequest("sql", 1, "/adapters/sql-v1")))
    sql_v2 = keyed(group, request(lora=LoRARequest("sql", 1, "/adapters/sql-v2")))
    assert sql_v1[0] != sql_v2[0], "two adapters named 'sql' with other weights share a namespace"
    # lora_int_id is per process: the same adapter under another id is the same KV.
    assert keyed(group, request(lora=LoRARequest("sql", 7, "/adapters/sql-v1"))) == sql_v1
    assert request_extra(request(lora=LoRARequest("sql", 1, "/adapters/sql-v1"))) == (
        ("vllm.lora", "sql@/adapters/sql-v1"),
    )


@pytest.mark.timeout(120)
@settings(max_examples=300, deadline=None)
@given(ADVERSARIAL, ADVERSARIAL.filter(bool), ADVERSARIAL, ADVERSARIAL.filter(bool))
def test_lora_facts_are_injective(name_a: str, path_a: str, name_b: str, path_b: str) -> None:
    def value(name: str, path: str) -> str:
        ((key, v),) = request_extra(request(lora=LoRARequest(name, 1, path)))
        assert key == "vllm.lora"
        name_part, path_part = v.split("@")
        assert (unescape(name_part), unescape(path_part)) == (name, path)
        return v

    assert (value(name_a, path_a) == value(name_b, path_b)) == ((name_a, path_a) == (name_b, path_b))
