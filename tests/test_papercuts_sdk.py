"""Papercuts of a new user's first hour: the SDK, the CLI's bench and --help, the examples."""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import math
import re
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

from kvcache_client import AsyncKVCacheClient, KVCacheClient
from kvcache_client.cli import build_parser, main
from tests.conftest import ServerThread, keyed

# -- bench counts only the bytes that moved ----------------------------------------------------------


def block_cost(make_server: Callable[..., ServerThread]) -> int:
    """What one 1000-byte bench block costs a RAM tier (block, its message, entry overhead), measured."""
    probe = make_server(ram={"capacity_bytes": 1 << 20})
    assert main(["--target", probe.target, "bench", "--block-bytes", "1000", "--blocks", "1", "--keep"]) == 0
    with KVCacheClient(probe.target) as client:
        return client.stats().tier("ram").used_bytes


@pytest.mark.timeout(60)
def test_bench_counts_only_the_blocks_that_moved(
    capsys: pytest.CaptureFixture[str], make_server: Callable[..., ServerThread]
) -> None:
    # 24 blocks of 1000 B put one per call into a RAM tier that holds 15 of them: LRU evicts the first 9.
    server = make_server(ram={"capacity_bytes": 15 * block_cost(make_server) + 100})
    capsys.readouterr()
    code = main(["--target", server.target, "bench", "--block-bytes", "1000", "--blocks", "24", "--json"])
    out, err = capsys.readouterr()
    assert code == 1
    data = json.loads(out)
    assert data["put"] | {"seconds": 0, "mb_s": 0, "p50_ms": 0, "p99_ms": 0} == {
        "calls": 24, "blocks": 24, "payload_bytes": 24_000, "missing": 0,
        "seconds": 0, "mb_s": 0, "p50_ms": 0, "p99_ms": 0,
    }  # fmt: skip
    get = data["get"]
    assert (get["calls"], get["blocks"], get["missing"], get["payload_bytes"]) == (24, 24, 9, 15_000)
    assert get["mb_s"] == round(15_000 / get["seconds"] / 1e6, 3)
    assert err == (
        "kvcache: bench: 9 of 24 gets missed; the working set (23.44 KiB) may not fit the server's RAM tier\n"
    )


# -- timeout_s: one meaning everywhere ----------------------------------------------------------------

BAD_TIMEOUT = "timeout_s must be positive, or None for the client's default; got {!r}"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad", [0, 0.0, -1.0, math.nan])
def test_a_per_call_timeout_that_is_not_positive_is_refused(server: ServerThread, bad: float) -> None:
    key, block = keyed(b"x" * 64)
    with KVCacheClient(server.target) as client:
        calls: list[Callable[[], object]] = [
            lambda: client.lookup("ns", [key], timeout_s=bad),
            lambda: client.put_many("ns", [(key, block)], timeout_s=bad),
            lambda: client.get_many("ns", [key], timeout_s=bad),
            lambda: client.delete("ns", [key], timeout_s=bad),
            lambda: client.stats(timeout_s=bad),
            lambda: client.lookup("ns", [], timeout_s=bad),  # refused before the empty-request shortcut
        ]
        for call in calls:
            with pytest.raises(ValueError) as info:
                call()
            assert str(info.value) == BAD_TIMEOUT.format(bad)
        assert client.put_many("ns", [(key, block)], timeout_s=None).stored == 1  # None: the default
        assert client.stats().tier("ram").puts == 1  # nothing refused was sent
    with pytest.raises(ValueError, match=r"^timeout_s must be positive$"):
        KVCacheClient(server.target, timeout_s=0)


@pytest.mark.timeout(30)
def test_a_per_call_timeout_that_is_not_positive_is_refused_async(server: ServerThread) -> None:
    key, block = keyed(b"x" * 64)

    async def run() -> list[str]:
        messages = []
        async with AsyncKVCacheClient(server.target) as client:
            for call in (
                lambda: client.lookup("ns", [key], timeout_s=0),
                lambda: client.put_many("ns", [(key, block)], timeout_s=-2.5),
                lambda: client.get_many("ns", [], timeout_s=0),
                lambda: client.delete("ns", [key], timeout_s=0),
                lambda: client.stats(timeout_s=0),
            ):
                with pytest.raises(ValueError) as info:
                    await call()
                messages.append(str(info.value))
            assert (await client.put_many("ns", [(key, block)], timeout_s=None)).stored == 1
            assert (await client.stats()).tier("ram").puts == 1
        return messages

    assert asyncio.run(run()) == [BAD_TIMEOUT.format(t) for t in (0, -2.5, 0, 0, 0)]
    with pytest.raises(ValueError, match=r"^timeout_s must be positive$"):
        AsyncKVCacheClient(server.target, timeout_s=0)


# -- AsyncKVCacheClient outside a running loop --------------------------------------------------------


@pytest.mark.timeout(30)
def test_async_client_built_outside_a_loop_works_inside_one(server: ServerThread) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # touches no event loop: not even a DeprecationWarning
        client = AsyncKVCacheClient(server.target)  # no running loop here
    key, block = keyed(b"y" * 100)

    async def use() -> bytes:
        assert (await client.put_many("ns", [(key, block)])).stored == 1
        (got,) = await client.get_many("ns", [key])
        assert got is not None
        return bytes(got)

    async def elsewhere() -> str:
        with pytest.raises(RuntimeError) as info:
            await client.stats()
        return str(info.value)

    async def close() -> None:
        await client.close()

    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(use()) == block
        assert asyncio.run(elsewhere()) == (
            "this AsyncKVCacheClient is bound to the event loop it was first used in; make one client per event loop"
        )
        loop.run_until_complete(close())
        with pytest.raises(ValueError, match=r"^this AsyncKVCacheClient is closed$"):
            loop.run_until_complete(use())
    finally:
        loop.close()


@pytest.mark.timeout(30)
def test_async_client_built_outside_a_loop_in_asyncio_run(server: ServerThread) -> None:
    client = AsyncKVCacheClient(server.target)

    async def main() -> int:
        async with client:
            return (await client.stats()).tier("ram").blocks

    assert asyncio.run(main()) == 0


# -- every public call says what it raises ------------------------------------------------------------


@pytest.mark.timeout(10)
@pytest.mark.parametrize("cls", [KVCacheClient, AsyncKVCacheClient])
def test_every_public_method_documents_what_it_raises(cls: type) -> None:
    # chunk_keys too: it validates token ids. The class docstring sums the rule up for help().
    names = sorted(n for n, v in vars(cls).items() if callable(getattr(cls, n)) and not n.startswith("_"))
    assert names == sorted([
        "chunk_keys", "close", "connect", "delete", "get_into", "get_many", "get_tensors",
        "leased", "lookup", "prefetch", "put_many", "put_payloads", "put_tensors", "stats",
    ])  # fmt: skip
    for name in [*names, "__init__"]:
        doc = inspect.getdoc(getattr(cls, name)) or ""
        assert "\nRaises:\n" in doc, f"{cls.__name__}.{name}"
    methods = [n for n in names if n not in {"chunk_keys", "close", "connect"}]
    for name in methods:
        raises = (inspect.getdoc(getattr(cls, name)) or "").split("\nRaises:\n")[1]
        assert "ValueError: `timeout_s` is not positive" in raises or "`timeout_s` not positive" in raises
        assert (
            ("Unavailable" in raises and "DeadlineExceeded" in raises)
            or "as put_many" in raises
            or ("as get_many" in raises)
        ), f"{cls.__name__}.{name}"
    summary = inspect.getdoc(cls) or ""
    for word in ("ValueError", "kvcache_client.errors", "Unavailable", "DeadlineExceeded", "never an exception"):
        assert word in summary
    assert "RuntimeError: the client is bound to another event loop" in (
        inspect.getdoc(AsyncKVCacheClient.lookup) or ""
    )


# -- tensors from get_tensors: read-only by contract, and what a write does ---------------------------


@pytest.mark.timeout(30)
def test_writing_a_got_tensor_changes_only_this_clients_received_bytes(server: ServerThread) -> None:
    torch = pytest.importorskip("torch")
    from kvcache_client.tensors import block_to_tensor
    from kvcache_core.errors import ChecksumMismatch
    from kvcache_core.format import verify_block

    original = torch.arange(2 * 2 * 4 * 8, dtype=torch.float32).reshape(2, 2, 1, 8, 4)
    key = bytes(range(16))
    with KVCacheClient(server.target, shm=False) as client:  # the gRPC path; tests/test_shm.py has shm's
        client.put_tensors("ns", [key], [original])
        (block,) = client.get_many("ns", [key])
        assert block is not None and block.readonly
        t = block_to_tensor(block, verify=False)
        mine = t.clone()
        mine.add_(1)  # the way to modify: a clone
        assert torch.equal(t, original) and torch.equal(mine, original + 1)
        t.add_(1)  # not refused: it writes into the received message, under the read-only memoryview
        assert torch.equal(t, original + 1)
        assert torch.equal(block_to_tensor(block, verify=False), original + 1)  # every view of that block
        with pytest.raises(ChecksumMismatch):
            verify_block(block, key)
        (again,) = client.get_tensors("ns", [key])  # the server's copy is untouched
        assert again is not None and torch.equal(again, original)


# -- --help: every option has a text, and shows its default -------------------------------------------

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
COMMANDS = ["stats", "lookup", "put", "get", "delete", "bench", "health"]


def option_entries(help_text: str) -> dict[str, str]:
    """argparse's option entries of a --help text: the flags as written -> their help text ("" if none)."""
    entries: dict[str, str] = {}
    flags = None
    for line in help_text.splitlines():
        if re.match(r"^  -", line):
            flags, _, text = line.strip().partition("  ")
            entries[flags] = text.strip()
        elif flags is not None and re.match(r"^ {20,}\S", line):  # a continuation line of the entry
            entries[flags] = f"{entries[flags]} {line.strip()}".strip()
        else:
            flags = None
    return entries


@pytest.mark.timeout(30)
@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_every_cli_option_has_a_help_text_and_its_default(
    capsys: pytest.CaptureFixture[str], command: str | None
) -> None:
    assert main([command, "--help"] if command else ["--help"]) == 0
    entries = option_entries(capsys.readouterr().out)
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    actions = (sub.choices[command] if command else parser)._actions
    assert "-h, --help" in entries and len(entries) == len([a for a in actions if a.option_strings])
    assert [flags for flags, text in entries.items() if not text] == []
    # Whatever has a real default (not None, off or SUPPRESS) says it in its help.
    with_default = [a for a in actions if a.default not in (None, False, argparse.SUPPRESS, [], "")]
    assert [a.dest for a in with_default if "default" not in (a.help or "")] == []
    if command == "lookup":
        assert {flags: entries[flags] for flags in ("--tp-size N", "--tp-rank R", "--cache-salt SALT")} == {
            "--tp-size N": "tensor-parallel world size (default 1)",
            "--tp-rank R": "this shard's tensor-parallel rank (default 0)",
            "--cache-salt SALT": "per-tenant or per-request isolation string (default: none)",
        }


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("script", "options"), [("make_random_model.py", 5), ("pd_disaggregation.py", 8), ("prefix_reuse.py", 9)]
)
def test_every_example_option_has_a_help_text_and_its_default(script: str, options: int) -> None:
    result = subprocess.run(
        [sys.executable, script, "--help"], cwd=EXAMPLES, capture_output=True, text=True, timeout=50
    )
    assert (result.returncode, result.stderr) == (0, "")
    entries = option_entries(result.stdout)
    assert len(entries) == options  # -h included
    assert [flags for flags, text in entries.items() if not text] == []
    # Every option but --help and the required --out shows its default.
    assert [f for f, text in entries.items() if "default" not in text and f not in {"-h, --help", "--out OUT"}] == []


@pytest.mark.timeout(10)
def test_client_reprs_name_target_and_transport_choices_never_the_token() -> None:
    with KVCacheClient("host-a:51051", token="sekret-token", shm=False, timeout_s=5.0) as client:
        assert repr(client) == "KVCacheClient(target='host-a:51051', tls=False, shm=False, bulk=True, timeout_s=5.0)"
    aclient = AsyncKVCacheClient("host-b:1", token="sekret-token", tls=True, bulk=False)
    assert repr(aclient) == "AsyncKVCacheClient(target='host-b:1', tls=True, shm=True, bulk=False, timeout_s=30.0)"
    assert "sekret" not in repr(client) + repr(aclient)
