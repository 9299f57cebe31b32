"""docs/lmcache.md's command line, parsed as `lmcache server` parses it, and its key example."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.l2_adapters.plugin_l2_adapter import PluginL2AdapterConfig

from kvcache_connectors.lmcache_l2 import KVCacheL2Config
from kvcache_connectors.lmcache_l2.keys import KeyMapper, lmcache_namespace, scope_of

DOC = (Path(__file__).resolve().parents[2] / "docs" / "lmcache.md").read_text()
pytestmark = pytest.mark.timeout(30)


def test_the_documented_command_line_parses_into_the_adapter_config() -> None:
    start = DOC.index("lmcache server --host")
    command = DOC[start : DOC.index("```", start)].replace("\\\n", " ")
    args = shlex.split(command)
    spec = json.loads(args[args.index("--l2-adapter") + 1])
    plugin = PluginL2AdapterConfig.from_dict(spec)
    assert (plugin.module_path, plugin.class_name) == ("kvcache_connectors.lmcache_l2", "KVCacheL2Adapter")
    config = KVCacheL2Config.from_params(plugin.adapter_params)
    assert config.target == "kvcache:51051" and dict(config.namespace_extra) == {"dtype": "bfloat16"}


def test_every_documented_option_is_an_option() -> None:
    table = DOC[DOC.index("## Options") : DOC.index("## The contract")]
    documented = re.findall(r"^\| `(\w+)` \|", table, flags=re.MULTILINE)
    assert documented == list(KVCacheL2Config.__dataclass_fields__)


def test_the_key_example_is_what_the_adapter_computes() -> None:
    key = ObjectKey(
        chunk_hash=bytes(range(32)),
        model_name="meta-llama/Llama-3.1-8B",
        kv_rank=ObjectKey.ComputeKVRank(world_size=1, global_rank=0, local_world_size=1, local_rank=0),
        object_group_id=0,
        cache_salt="tenant-a",
    )
    assert key.kv_rank == 16777472
    ns = lmcache_namespace(scope_of(key))
    block = DOC[DOC.index("```\n6b7663") + 4 :]
    documented = "".join(
        re.match(r"((?:[0-9a-f]{2})+(?: (?:[0-9a-f]{2})+)*)", line).group(1).replace(" ", "")
        for line in block[: block.index("```")].strip().splitlines()
    )
    assert bytes.fromhex(documented) == ns.canonical_bytes()
    assert len(ns.canonical_bytes()) == 179
    assert f"`namespace = {ns.name}`" in DOC
    ((name, _, (kv_key,)),) = KeyMapper().group([key])
    assert name == ns.name
    assert f"`key = {kv_key.hex()}`" in DOC
