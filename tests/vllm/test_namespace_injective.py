"""Two requests or two engines whose KV differs never share a namespace; one engine gets one namespace in
every process.

The request facts (vllm.mm, vllm.lora) join user-supplied strings, so they must be injective: found in
review, one image "a@1;b" at offset 2 and two images "a"@1 and "b"@2 both gave vllm.mm "a@1;b@2" (the
second request would be served the first one's KV), and vllm.lora held the adapter's name only (two
instances loading other weights under one name shared KV). The vLLM tier wrote a callable hf_overrides
with str(), which holds its address: every process had its own namespace, and no hits.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import json
import re
import subprocess
import sys
import textwrap
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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
from tests.vllm.tier_harness import offloading_config, tier_entry

ROOT = Path(__file__).resolve().parents[2]
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


# -- the vLLM tier: hf_overrides --------------------------------------------------------------


def longer_context(config: Any) -> Any:
    """A callable hf_overrides, as vLLM takes it (applied to the HF config)."""
    config.max_position_embeddings = 4096
    return config


def tier_namespace(model_dir: str, hf_overrides: object) -> tuple[str, str]:
    """The tier's hf_overrides fact and namespace name, built under an engine config with these overrides."""
    import vllm.config.vllm as vllm_config_module

    from kvcache_connectors.vllm_tier.namespace import vllm_namespace

    oc = offloading_config(model_dir, tier_entry("127.0.0.1:1"))
    saved = vllm_config_module._current_vllm_config
    model = types.SimpleNamespace(revision="main", quantization=None, hf_overrides=hf_overrides)
    vllm_config_module._current_vllm_config = types.SimpleNamespace(model_config=model)  # type: ignore[assignment]
    try:
        ns = vllm_namespace(types.SimpleNamespace(config=oc), chunk_bytes=1 << 16)  # type: ignore[arg-type]
    finally:
        vllm_config_module._current_vllm_config = saved
    return dict(ns.facts)["hf_overrides"], ns.name


@pytest.mark.timeout(240)
def test_a_callable_override_gives_one_namespace_in_every_process(model_dir: str) -> None:
    here = tier_namespace(model_dir, longer_context)
    assert here[0] == "tests.vllm.test_namespace_injective.longer_context"
    child = textwrap.dedent(
        f"""
        import json, sys
        from tests.vllm.test_namespace_injective import longer_context, tier_namespace
        print(json.dumps(tier_namespace({model_dir!r}, longer_context)))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", child], cwd=ROOT, capture_output=True, text=True, timeout=200, check=True
    ).stdout
    assert tuple(json.loads(out.strip().splitlines()[-1])) == here


@pytest.mark.timeout(60)
def test_freshly_created_equivalent_callables_give_one_namespace(model_dir: str, tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "kvcache_probe_overrides.py").write_text("def rope(config):\n    return config\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("kvcache_probe_overrides")
    first = module.rope
    second = importlib.reload(module).rope  # a new function object; `first` stays alive elsewhere
    assert first is not second
    assert tier_namespace(model_dir, first) == tier_namespace(model_dir, second)
    assert tier_namespace(model_dir, first)[0] == "kvcache_probe_overrides.rope"
    sys.modules.pop("kvcache_probe_overrides")


@pytest.mark.timeout(60)
def test_dict_overrides_are_json_and_their_order_does_not_matter(model_dir: str) -> None:
    a = tier_namespace(model_dir, {"rope_scaling": {"type": "yarn", "factor": 4.0}, "max_position_embeddings": 8})
    b = tier_namespace(model_dir, {"max_position_embeddings": 8, "rope_scaling": {"factor": 4.0, "type": "yarn"}})
    assert a == b and a[0] == '{"max_position_embeddings": 8, "rope_scaling": {"factor": 4.0, "type": "yarn"}}'
    assert tier_namespace(model_dir, None)[0] == "" and tier_namespace(model_dir, {})[0] == "{}"


def _outer() -> Any:
    def nested(config: Any) -> Any:
        return config

    return nested


class _CallableObject:
    def __call__(self, config: Any) -> Any:
        return config


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "overrides",
    [
        lambda config: config,
        _outer(),
        functools.partial(longer_context),
        _CallableObject(),
        _CallableObject().__call__,
        {"rope_theta": object()},
        {"torch_dtype": {"nested": [1, object()]}},
        {1: "int key"},
        {"rope_theta": float("nan")},
        "a string",
    ],
    ids=["lambda", "nested", "partial", "object", "bound", "dict_object", "nested_object", "int_key", "nan", "str"],
)
def test_overrides_no_other_process_could_spell_alike_are_refused(model_dir: str, overrides: object) -> None:
    with pytest.raises(ValueError, match="hf_overrides"):
        tier_namespace(model_dir, overrides)
