"""Fixtures for the LMCache L2 adapter tests (the kvcache server fixtures come from tests/conftest.py).

These tests import the real lmcache==0.5.6, installed CPU-only by scripts/install_lmcache_cpu.sh.
Where lmcache is missing they are not collected (one line at the end of the report says so); under
CI (CI=1) a missing lmcache is installed into this interpreter's environment by that script first,
and an install that fails is an error, so the suite cannot pass without these tests.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# LMCache reads these at import: no banner, no usage reports, its INFO lines kept out of test logs.
os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

ROOT = Path(__file__).resolve().parents[2]
IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}
LMCACHE_MISSING = importlib.util.find_spec("lmcache") is None
if LMCACHE_MISSING and IN_CI:
    subprocess.run([str(ROOT / "scripts" / "install_lmcache_cpu.sh"), sys.prefix], check=True, timeout=900)
    importlib.invalidate_caches()
    LMCACHE_MISSING = importlib.util.find_spec("lmcache") is None
    if LMCACHE_MISSING:
        raise ImportError("tests/lmcache need lmcache==0.5.6: scripts/install_lmcache_cpu.sh did not install it")
if LMCACHE_MISSING:
    collect_ignore_glob = ["test_*.py"]


# LMCache's loggers each attach OpenTelemetry's deprecated LoggingHandler (one warning per logger).
OTEL_LOGGING_WARNING = "ignore:`LoggingHandler` in `opentelemetry-sdk` is deprecated:DeprecationWarning"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.path).parents:
            item.add_marker(pytest.mark.filterwarnings(OTEL_LOGGING_WARNING))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if LMCACHE_MISSING:
        terminalreporter.write_line(
            "tests/lmcache: NOT RUN, lmcache is not installed (see scripts/install_lmcache_cpu.sh)"
        )


@pytest.fixture
def make_adapter() -> Iterator[Callable[..., object]]:
    """Factory: make_adapter(target=..., **adapter_params) -> a KVCacheL2Adapter, closed after the test."""
    from kvcache_connectors.lmcache_l2 import KVCacheL2Adapter

    made: list[KVCacheL2Adapter] = []

    def factory(**params: object) -> KVCacheL2Adapter:
        adapter = KVCacheL2Adapter(params)
        made.append(adapter)
        return adapter

    yield factory
    for adapter in made:
        adapter.close()
