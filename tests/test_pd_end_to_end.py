"""Proof of the P/D hand-off: a decode process continuing from a prefill process's KV, fetched through
a kvcache server, generates exactly what one process generates without any cache.

Everything is real: the server is `python -m kvcache_server --port 0` in a child process, the prefill
and decode workers are spawned interpreters that load the model from disk as a user would, and the
reference runs here, in a third process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from examples._support import KVCacheServerProcess, random_prompt
from kvcache_client import KVCacheClient
from kvcache_connectors.transformers import namespace_for_model
from tests.helpers_models import (
    VOCAB,
    decode_worker,
    generate,
    in_spawned_process,
    load_model,
    prefill_worker,
    write_small_model,
)

# Each spawned interpreter spends ~6 s importing torch and transformers on a 2-core machine.
pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[1]
CHUNK = 16
NEW_TOKENS = 12
# Shorter than a chunk, exactly one, several and a tail, exactly three, several and a one-token tail.
LENGTHS = (5, 16, 37, 48, 65)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_small_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def kv_server() -> Iterator[str]:
    server = KVCacheServerProcess(ram_capacity="256MiB")
    target = server.start()
    try:
        yield target
    finally:
        assert server.stop() == 0, "the server did not shut down cleanly on SIGTERM"


def test_decode_process_generates_exactly_what_one_process_generates(model_dir: str, kv_server: str) -> None:
    prompts = [random_prompt(n, VOCAB, seed=1000 + n) for n in LENGTHS]
    # Never prefilled: shares two full chunks and three more tokens with the 48-token prompt.
    sharing = prompts[3][:35] + random_prompt(20, VOCAB, seed=7)

    pre = in_spawned_process(prefill_worker, model_dir, kv_server, prompts, CHUNK)
    assert pre["stored"] == [-(-n // CHUNK) for n in LENGTHS]  # every chunk, the partial tails included
    dec = in_spawned_process(decode_worker, model_dir, kv_server, [*prompts, sharing], CHUNK, NEW_TOKENS)
    assert len({pre["pid"], dec["pid"], os.getpid()}) == 3

    model = load_model(model_dir)
    expected_loaded = [n - 1 for n in LENGTHS] + [32]
    for prompt, loaded, got in zip([*prompts, sharing], expected_loaded, dec["results"], strict=True):
        want = generate(model, prompt, NEW_TOKENS, cache=None)
        assert got["loaded"] == loaded, f"{len(prompt)}-token prompt"
        assert got["tokens"] == want.tokens, f"{len(prompt)}-token prompt"
        torch.testing.assert_close(torch.tensor(got["first_logits"]), want.first_logits, atol=1e-4, rtol=0)

    # The decode process stored nothing: the server holds exactly the prefill's chunks.
    with KVCacheClient(kv_server, timeout_s=10) as client:
        ns = namespace_for_model(model, chunk_tokens=CHUNK)
        assert client.lookup(ns, client.chunk_keys(sharing, ns)).prefix_length == 2
        assert client.stats().tier("ram").blocks == sum(pre["stored"])


def run_example(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        capture_output=True,
        text=True,
        timeout=200,
        cwd=ROOT,
    )


def test_pd_disaggregation_example(model_dir: str, kv_server: str) -> None:
    proc = run_example(
        "pd_disaggregation.py",
        *("--model", model_dir, "--target", kv_server, "--prompt-tokens", "70", "--chunk-tokens", str(CHUNK)),
        *("--new-tokens", "6", "--seed", "3", "--check"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "loaded 69 tokens" in proc.stdout and "computed 1;" in proc.stdout, proc.stdout
    assert "generated identical tokens" in proc.stdout, proc.stdout


def test_prefix_reuse_example(model_dir: str, kv_server: str) -> None:
    proc = run_example(
        "prefix_reuse.py",
        *("--model", model_dir, "--target", kv_server, "--system-tokens", "64", "--questions", "3"),
        *("--question-tokens", "10", "--new-tokens", "4", "--chunk-tokens", str(CHUNK), "--seed", "11"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line.split()[:1] in (["0"], ["1"], ["2"])]
    # request, prompt, loaded, computed, ...: the first computes all 74 tokens, the others the 10 of their question.
    assert [row[:4] for row in rows] == [["0", "74", "0", "74"], ["1", "74", "64", "10"], ["2", "74", "64", "10"]]
    assert all(row[-1] == "yes" for row in rows), proc.stdout
    assert "leaked" not in proc.stderr, proc.stderr  # issue 27: it once ended with a leaked-semaphore warning
