"""Lets sglang==0.5.23 import on a CPU-only machine with no Triton and no torchvision (tests only).

SGLang imports `triton` at the top of `sglang.srt.utils.common` (so every sglang module needs it)
and `torchvision` from a few model configs that `sglang.srt.mem_cache.memory_pool` pulls in
through `sglang.srt.configs`. Neither has a CPU build on PyPI that fits torch 2.13.0+cpu (triton
is the CUDA compiler; PyPI's torchvision links libtorch_cuda), and neither runs on the storage
path under test: host pools are plain CPU tensors, and the backend moves their bytes.

So, before the first sglang import, `install()` puts in place:

- SGLang's own Triton stand-in, the `_MockModule` of `sglang/_platform_stubs.py` (what SGLang
  installs on Apple Silicon, where Triton does not exist either): any `triton.*` attribute is a
  stub, `@triton.jit` is a pass-through decorator. Loaded from its file, without importing the
  `sglang` package (whose `__init__` imports Triton).
- a torchvision stand-in of the same kind, with the one real thing transformers reads at import
  (`InterpolationMode`, whose members it maps PIL filters to).

Nothing here runs a kernel: a test that reached one would fail on a stub, not pass on it. On a
machine with real Triton and torchvision, `install()` changes nothing.
"""

from __future__ import annotations

import enum
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

_STUBBED: set[str] = set()
_FINDERS: list[importlib.abc.MetaPathFinder] = []


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers imports of the stubbed top-level packages (and their submodules) with mock modules."""

    def __init__(self, mock_module_type: type[ModuleType]) -> None:
        self._mock = mock_module_type

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.partition(".")[0] not in _STUBBED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return self._mock(spec.name)

    def exec_module(self, module: ModuleType) -> None:
        return None


def _sglang_platform_stubs() -> ModuleType:
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        raise ImportError("sglang is not installed (scripts/install_sglang_cpu.sh)")
    path = Path(spec.origin).parent / "_platform_stubs.py"
    stub_spec = importlib.util.spec_from_file_location("_kvcache_sglang_platform_stubs", path)
    assert stub_spec is not None and stub_spec.loader is not None
    module = importlib.util.module_from_spec(stub_spec)
    sys.modules[stub_spec.name] = module  # its dataclasses resolve their module through sys.modules
    stub_spec.loader.exec_module(module)
    return module


class InterpolationMode(enum.Enum):
    """torchvision.transforms.InterpolationMode's members (transformers maps PIL filters to them)."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class _Constexpr:
    """tl.constexpr as an annotation and a value wrapper (as SGLang's own stub defines it)."""

    def __init__(self, value: object = None) -> None:
        self.value = value


def install() -> list[str]:
    """Stubs Triton and torchvision where they are missing; returns the names stubbed (idempotent)."""
    missing = [
        name for name in ("triton", "torchvision") if name not in sys.modules and importlib.util.find_spec(name) is None
    ]
    if not missing:
        return sorted(_STUBBED)
    stubs = _sglang_platform_stubs()
    _STUBBED.update(missing)
    finder = _StubFinder(stubs._MockModule)
    _FINDERS.append(finder)
    sys.meta_path.insert(0, finder)
    if "triton" in missing:
        triton = importlib.import_module("triton")
        triton.__version__ = "3.0.0"
        triton.cdiv = stubs._cdiv
        triton.next_power_of_2 = stubs._next_power_of_2
        triton.Config = stubs._Config
        importlib.import_module("triton.language").constexpr = _Constexpr
    if "torchvision" in missing:
        importlib.import_module("torchvision").__version__ = "0.0.0+kvcache-stub"
        importlib.import_module("torchvision.transforms").InterpolationMode = InterpolationMode
        importlib.import_module("torchvision.transforms.functional").InterpolationMode = InterpolationMode
    return sorted(_STUBBED)


def uninstall() -> None:
    """Takes the stand-ins out of the import system again, once sglang's modules are imported.

    The modules that imported them keep their references; everything imported later (other
    tests' vLLM, transformers, torch.compile) finds no Triton and no torchvision, as before
    install(). The answers torch and transformers cached while the stubs were in place are
    dropped.
    """
    for finder in _FINDERS:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
    _FINDERS.clear()
    for name in [n for n in sys.modules if n.partition(".")[0] in _STUBBED]:
        del sys.modules[name]
    _STUBBED.clear()
    for module_name, names in (
        ("torch.utils._triton", None),  # has_triton_package and the checks built on it
        ("transformers.utils.import_utils", ("is_torchvision_v2_available",)),
    ):
        module = sys.modules.get(module_name)
        if module is None:
            continue
        for name in names or tuple(vars(module)):
            cached = getattr(module, name, None)
            if callable(getattr(cached, "cache_clear", None)):
                cached.cache_clear()


def import_modules(names: tuple[str, ...]) -> None:
    """Imports sglang modules with the stand-ins in place, then takes them out (uninstall)."""
    install()
    try:
        for name in names:
            importlib.import_module(name)
    finally:
        uninstall()
