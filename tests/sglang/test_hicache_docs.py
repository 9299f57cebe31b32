"""docs/sglang.md says what the code does: its command line loads the backend, its facts table is the namespace's."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

from kvcache_connectors.sglang_hicache import HiCacheBackendConfig, KVCacheHiCacheStorage
from kvcache_connectors.sglang_hicache.namespace import sglang_facts
from tests.sglang.harness import mha_host_pool, mla_host_pool, storage_config

pytestmark = pytest.mark.timeout(30)

DOC = (Path(__file__).resolve().parents[2] / "docs" / "sglang.md").read_text()


def test_the_documented_command_line_loads_the_backend() -> None:
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    match = re.search(r"--hicache-storage-backend-extra-config '(\{.*?\})'", DOC, re.S)
    assert match, "docs/sglang.md has no extra-config JSON"
    extra, *_ = HybridCacheController.parse_storage_backend_extra_config(match.group(1))
    module = importlib.import_module(extra["module_path"])
    assert getattr(module, extra["class_name"]) is KVCacheHiCacheStorage
    config = HiCacheBackendConfig.from_extra_config(extra)
    assert config.interface_v1 and config.target == "KVCACHE_HOST:51051"


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_the_facts_table_is_the_namespace(kind: str) -> None:
    section = DOC[DOC.index("## Keys") : DOC.index("## Installing")]
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", section, re.M))
    pool = mha_host_pool() if kind == "mha" else mla_host_pool()
    config = storage_config('{"target": "h:1"}', is_mla=kind == "mla")
    facts = sglang_facts(config, pool, segment_bytes=[1], sglang_version="0", extra={"k": "v"})
    assert set(facts) - {"extra.k"} == documented
    assert "`extra.<k>`" in section


def test_the_cpu_stand_ins_are_gone_after_sglang_is_imported() -> None:
    from tests.sglang import cpu_shim

    assert not cpu_shim._FINDERS and not cpu_shim._STUBBED
    for name in ("triton", "torchvision"):
        spec = importlib.util.find_spec(name)
        assert spec is None or not isinstance(spec.loader, cpu_shim._StubFinder), name
