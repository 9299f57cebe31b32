"""Fixtures for the vLLM connector tests (the kvcache server fixtures come from tests/conftest.py).

These tests import the real vllm==0.33.0, installed CPU-only by scripts/install_vllm_cpu.sh.
Where vLLM is missing they are not collected (one line at the end of the report says so);
under CI (CI=1) a missing vLLM is an error instead, so the suite cannot pass without them.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from pathlib import Path

import pytest

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}
VLLM_MISSING = importlib.util.find_spec("vllm") is None
if VLLM_MISSING:
    if IN_CI:
        raise ImportError("tests/vllm need vllm==0.33.0: run scripts/install_vllm_cpu.sh on this venv first")
    collect_ignore_glob = ["test_*.py"]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if VLLM_MISSING:
        terminalreporter.write_line("tests/vllm: NOT RUN, vllm is not installed (see scripts/install_vllm_cpu.sh)")


@pytest.fixture(scope="session", autouse=True)
def _vllm_none_hash() -> None:
    """vLLM's prefix-cache hashing needs its NONE_HASH seeded once per process (EngineCore does this)."""
    if VLLM_MISSING:
        return
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Llama's config.json, all ModelConfig needs offline."""
    from tests.vllm.harness import write_model_dir

    return write_model_dir(Path(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture
def dead_target() -> str:
    """host:port where nothing listens (a port just released by the OS)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"127.0.0.1:{port}"
