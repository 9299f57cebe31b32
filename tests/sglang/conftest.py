"""Fixtures for the SGLang HiCache backend tests (the kvcache server fixtures come from tests/conftest.py).

These tests import the real sglang==0.5.23, installed CPU-only by scripts/install_sglang_cpu.sh.
Its modules are imported once, here, with tests/sglang/cpu_shim.py's Triton and torchvision
stand-ins in place, which are taken out again right after (so the rest of the suite never sees
them). Where sglang is missing the tests are not collected (one line at the end of the report
says so); under CI (CI=1) a missing sglang is an error instead, so the suite cannot pass without
them.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}
SGLANG_MISSING = importlib.util.find_spec("sglang") is None
if SGLANG_MISSING:
    if IN_CI:
        raise ImportError("tests/sglang need sglang==0.5.23: run scripts/install_sglang_cpu.sh on this venv first")
    collect_ignore_glob = ["test_*.py"]
else:
    from tests.sglang.cpu_shim import import_modules
    from tests.sglang.harness import SGLANG_MODULES

    import_modules(SGLANG_MODULES)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if SGLANG_MISSING:
        terminalreporter.write_line(
            "tests/sglang: NOT RUN, sglang is not installed (see scripts/install_sglang_cpu.sh)"
        )
