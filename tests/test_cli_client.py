"""`kvcache`, the command line, against a real server: output, files and the exit codes scripts rely on.

Exit codes and stderr are checked on real subprocesses (`python -m kvcache_client.cli`); the rest runs
main(argv) in this process, which is the same code without the interpreter start-up.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvcache_client import KVCacheClient, Namespace, chunk_keys, encode_block
from kvcache_client._cli.bench import Progress, percentile
from kvcache_client._cli.render import hit_ratio, human_bytes, human_duration
from kvcache_client.cli import EXIT_CODES, main
from kvcache_core.keys import HEADS_LAYOUT_VERSION
from kvcache_server.auth import token_digest
from tests.backends import free_port, make_certs
from tests.conftest import ServerThread, raw_block

pytestmark = pytest.mark.timeout(60)

KEY = bytes(range(16))
OTHER = b"\xff" * 16
NS = Namespace(model_id="cli-test", kv_dtype="bfloat16", chunk_tokens=256, num_layers=2, num_kv_heads=1, head_size=4)
NAMESPACE_ARGS = ["--model", "cli-test", "--num-layers", "2", "--num-kv-heads", "1", "--head-size", "4"]


def cli(
    *args: str, target: str | None = None, stdin: bytes | None = None, token: str | None = None
) -> subprocess.CompletedProcess[bytes]:
    """Runs `python -m kvcache_client.cli ARGS` with KVCACHE_TARGET and KVCACHE_TOKEN set as given."""
    env = {k: v for k, v in os.environ.items() if k not in {"KVCACHE_TARGET", "KVCACHE_TOKEN"}}
    if target is not None:
        env["KVCACHE_TARGET"] = target
    if token is not None:
        env["KVCACHE_TOKEN"] = token
    return subprocess.run(
        [sys.executable, "-m", "kvcache_client.cli", *args], input=stdin, capture_output=True, env=env, timeout=30
    )


def run(capsys: pytest.CaptureFixture[str], server: ServerThread, *args: str) -> tuple[int, str, str]:
    """main(["--target", server, *args]) in this process: (exit code, stdout, stderr)."""
    code = main(["--target", server.target, *args])
    out, err = capsys.readouterr()
    return code, out, err


def table_rows(text: str) -> dict[str, list[str]]:
    """The per-tier table of `kvcache stats`: label -> one cell per tier (cells split on 2+ spaces)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("tier "))
    rows = {}
    for line in lines[start:]:
        label, *cells = [c for c in line.split("  ") if c]
        rows[label.strip()] = [c.strip() for c in cells]
    return rows


# -- stats -----------------------------------------------------------------------------------------


def test_stats_table(capsys: pytest.CaptureFixture[str], server: ServerThread) -> None:
    with KVCacheClient(server.target) as client:
        client.put_many("ns", [(KEY, raw_block(KEY, b"x" * 1000))])
        assert client.get_many("ns", [KEY, OTHER])[1] is None
        ram = client.stats().tier("ram")
    code, out, err = run(capsys, server, "stats")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].startswith(f"kvcache-server 0.1.0 at {server.target}, up ")
    assert lines[1] == "limits: max block 64.00 MiB, 65,536 keys per request"
    assert lines[2] == "failed requests: 0; blocks refused on put (checksum): 0"
    assert lines[3] == (
        "retention: 0 refused (share full), 0 expired; prefetch: 0 queued, 0 promoted, 0 dropped, 0 failed"
    )
    rows = table_rows(out)
    assert rows["retained"] == ["0 (0 B)"]
    assert rows["tier"] == ["ram"]
    assert rows["blocks"] == ["1"]
    assert rows["used / capacity"] == [f"{human_bytes(ram.used_bytes)} / 256.00 MiB (0.0%)"]
    assert (rows["hits"], rows["misses"], rows["hit ratio"], rows["puts"]) == (["1"], ["1"], ["50.0%"], ["1"])
    assert rows["queue depth"] == ["0 (0 B)"]
    assert (rows["breaker"], rows["healthy"]) == (["closed"], ["yes"])
    assert list(rows) == [
        "tier",
        "blocks",
        "used / capacity",
        "hits",
        "misses",
        "hit ratio",
        "puts",
        "evictions",
        "retained",
        "retained refused / copied / dropped",
        "rejected",
        "promotions",
        "demotions",
        "queue depth",
        "queue dropped",
        "errors",
        "write errors",
        "skipped",
        "checksum failures",
        "breaker",
        "healthy",
        "bytes read",
        "bytes written",
    ]


def test_stats_json_is_every_counter(capsys: pytest.CaptureFixture[str], server: ServerThread) -> None:
    with KVCacheClient(server.target) as client:
        client.put_many("ns", [(KEY, raw_block(KEY, b"x" * 10))])
        code, out, _ = run(capsys, server, "stats", "--json")
        stats = client.stats()
    assert code == 0
    data = json.loads(out)
    expected = {"target": server.target, **dataclasses.asdict(stats)}
    expected["tiers"] = [{**tier, "hit_ratio": None} for tier in expected["tiers"]]  # no reads yet
    data["uptime_s"] = expected["uptime_s"]
    assert data == expected


# -- put, get, delete ------------------------------------------------------------------------------


def test_put_get_round_trip_of_a_block_file(
    capsys: pytest.CaptureFixture[str], server: ServerThread, tmp_path: Path
) -> None:
    payload = os.urandom(4096)
    block = encode_block(payload, key=KEY, dtype="float16", shape=(2, 1024))
    (tmp_path / "in.blk").write_bytes(block)
    code, out, _ = run(capsys, server, "put", "--namespace", "ns", "--key", KEY.hex(), str(tmp_path / "in.blk"))
    assert (code, out) == (0, f"stored ns/{KEY.hex()} ({len(block):,} bytes): ram stored\n")
    code, out, _ = run(capsys, server, "get", "--namespace", "ns", "--key", KEY.hex(), "-o", str(tmp_path / "out"))
    assert (code, out) == (
        0,
        f"wrote {len(block):,} bytes (block: float16 [2x1024], layout raw) to {tmp_path / 'out'}\n",
    )
    assert (tmp_path / "out").read_bytes() == block
    got = cli("get", "--namespace", "ns", "--key", KEY.hex(), "--payload", target=server.target)
    assert (got.returncode, got.stdout, got.stderr) == (0, payload, b"")


def test_put_raw_wraps_any_bytes_and_reads_stdin(server: ServerThread) -> None:
    data = b"not a block at all"
    put = cli("put", "--namespace", "ns", "--key", KEY.hex(), "--raw", "-", target=server.target, stdin=data)
    assert put.returncode == 0, put.stderr
    with KVCacheClient(server.target) as client:
        assert bytes(client.get_many("ns", [KEY])[0]) == raw_block(KEY, data)  # type: ignore[arg-type]


def test_put_refuses_a_file_that_is_not_a_block(server: ServerThread, tmp_path: Path) -> None:
    (tmp_path / "junk").write_bytes(b"JUNK" * 20)
    put = cli("put", "--namespace", "ns", "--key", KEY.hex(), str(tmp_path / "junk"), target=server.target)
    assert put.returncode == 2
    assert put.stderr.decode() == (
        f"kvcache: {tmp_path / 'junk'} is not a valid block under key {KEY.hex()} (bad magic b'JUNK', "
        "expected b'KVCB'); "
        "--raw stores any bytes as one\n"
    )
    with KVCacheClient(server.target) as client:
        assert client.lookup("ns", [KEY]).prefix_length == 0


def test_get_miss_exits_1(server: ServerThread, tmp_path: Path) -> None:
    got = cli("get", "--namespace", "ns", "--key", KEY.hex(), "-o", str(tmp_path / "out"), target=server.target)
    assert (got.returncode, got.stdout, got.stderr) == (1, b"", f"kvcache: ns/{KEY.hex()}: not found\n".encode())
    assert not (tmp_path / "out").exists()


def test_get_json_needs_an_output_file(capsys: pytest.CaptureFixture[str], server: ServerThread) -> None:
    code, out, err = run(capsys, server, "get", "--json", "--namespace", "ns", "--key", KEY.hex())
    assert (code, out, err) == (2, "", "kvcache: get --json needs -o FILE: stdout carries the block\n")


def test_delete(capsys: pytest.CaptureFixture[str], server: ServerThread) -> None:
    with KVCacheClient(server.target) as client:
        client.put_many("ns", [(KEY, raw_block(KEY, b"a")), (OTHER, raw_block(OTHER, b"b"))])
        code, out, _ = run(capsys, server, "delete", "--namespace", "ns", "--key", KEY.hex(), OTHER.hex(), "00" * 16)
        assert (code, out) == (0, "deleted 2 of 3 keys from ns\n")
        assert client.get_many("ns", [KEY, OTHER]) == [None, None]


# -- lookup ----------------------------------------------------------------------------------------


def test_lookup_of_a_tokens_file(capsys: pytest.CaptureFixture[str], server: ServerThread, tmp_path: Path) -> None:
    tokens = list(range(1000, 1600))  # 2 full chunks of 256 and a tail of 88
    keys = chunk_keys(tokens, NS)
    assert len(keys) == 3
    with KVCacheClient(server.target) as client:
        client.put_many(NS, [(k, raw_block(k, b"kv")) for k in keys[:2]])
    (tmp_path / "tokens.json").write_text(json.dumps(tokens))
    code, out, _ = run(capsys, server, "lookup", *NAMESPACE_ARGS, "--tokens-file", str(tmp_path / "tokens.json"))
    assert code == 0
    assert out == (
        f"namespace      {NS.name}\n"
        "chunks         3 (600 tokens, 256 per chunk, last chunk 88)\n"
        "stored prefix  2 chunks, 512 tokens\n"
        "  chunks 0-1   ram\n"
    )
    (tmp_path / "tokens.txt").write_text(" ".join(map(str, tokens[:300])) + "\n" + ",".join(map(str, tokens[300:])))
    code, out, _ = run(
        capsys, server, "--json", "lookup", *NAMESPACE_ARGS, "--tokens-file", str(tmp_path / "tokens.txt")
    )
    assert code == 0
    assert json.loads(out) == {
        "namespace": NS.name,
        "chunks": 3,
        "tokens": 600,
        "chunk_tokens": 256,
        "prefix_chunks": 2,
        "prefix_tokens": 512,
        "tiers": ["ram", "ram"],
        "keys": [k.hex() for k in keys],
    }


def test_lookup_of_a_head_sharded_namespace(
    capsys: pytest.CaptureFixture[str], server: ServerThread, tmp_path: Path
) -> None:
    tokens = list(range(300))
    v2 = dataclasses.replace(NS, layout_version=HEADS_LAYOUT_VERSION)
    with KVCacheClient(server.target) as client:
        client.put_many(v2, [(k, raw_block(k, b"kv")) for k in chunk_keys(tokens, v2)])
    (tmp_path / "tokens.json").write_text(json.dumps(tokens))
    args = ["--json", "lookup", *NAMESPACE_ARGS, "--tokens-file", str(tmp_path / "tokens.json")]
    code, out, _ = run(capsys, server, *args, "--layout-version", str(HEADS_LAYOUT_VERSION))
    assert (code, json.loads(out)["namespace"], json.loads(out)["prefix_chunks"]) == (0, v2.name, 2)
    code, out, _ = run(capsys, server, *args)  # version 1: another namespace, nothing there
    assert (code, json.loads(out)["prefix_chunks"]) == (0, 0)


def test_lookup_reads_stdin_and_require_hit_exits_1_on_no_hit(server: ServerThread) -> None:
    args = ["lookup", *NAMESPACE_ARGS, "--tokens-file", "-", "--require-hit", "--json"]
    miss = cli(*args, target=server.target, stdin=b"[1, 2, 3]")
    assert miss.returncode == 1
    assert json.loads(miss.stdout)["prefix_chunks"] == 0
    with KVCacheClient(server.target) as client:
        key = chunk_keys([1, 2, 3], NS)[0]
        client.put_many(NS, [(key, raw_block(key, b"kv"))])
    hit = cli(*args, target=server.target, stdin=b"1 2 3")
    assert hit.returncode == 0
    assert json.loads(hit.stdout)["prefix_tokens"] == 3


def test_lookup_of_raw_keys(capsys: pytest.CaptureFixture[str], server: ServerThread, tmp_path: Path) -> None:
    with KVCacheClient(server.target) as client:
        client.put_many("ns", [(KEY, raw_block(KEY, b"a"))])
    (tmp_path / "keys").write_text(f"{KEY.hex()}\n{OTHER.hex()}\n")
    code, out, _ = run(capsys, server, "lookup", "--namespace", "ns", "--keys-file", str(tmp_path / "keys"))
    assert (code, out) == (0, "namespace      ns\nkeys           2\nstored prefix  1 of 2 keys\n  chunk 0      ram\n")


def test_lookup_input_errors_exit_2(capsys: pytest.CaptureFixture[str], server: ServerThread, tmp_path: Path) -> None:
    (tmp_path / "bad").write_text("1 2 x 4")
    code, _, err = run(capsys, server, "lookup", *NAMESPACE_ARGS, "--tokens-file", str(tmp_path / "bad"))
    assert (code, err) == (2, f"kvcache: {tmp_path / 'bad'}: token 2 ('x') is not a non-negative integer\n")
    code, _, err = run(capsys, server, "lookup", "--model", "m", "--num-layers", "2", "--tokens-file", "-")
    assert (code, err) == (2, "kvcache: lookup --model also needs --num-kv-heads, --head-size\n")
    code, _, err = run(capsys, server, "lookup", "--namespace", "ns", "--tokens-file", str(tmp_path / "bad"))
    assert (code, err) == (2, "kvcache: lookup --namespace takes --keys-file (hex keys), not --tokens-file\n")


# -- health, errors and exit codes -----------------------------------------------------------------


def test_health(server: ServerThread) -> None:
    ok = cli("health", target=server.target)
    assert (ok.returncode, ok.stdout, ok.stderr) == (0, b"SERVING\n", b"")
    unknown = cli("health", "--service", "no.such.Service", target=server.target)
    assert (unknown.returncode, unknown.stdout) == (5, b"SERVICE_UNKNOWN\n")


def test_health_not_serving_exits_5(make_server) -> None:
    """A required tier that is down (nothing listens at the Redis URL) makes the server NOT_SERVING."""
    server = make_server(
        redis={"enabled": True, "url": f"redis://127.0.0.1:{free_port()}/0", "timeout_s": 0.2, "breaker_failures": 1},
        health={"required_tiers": "redis"},
    )
    down = cli("--json", "health", target=server.target)
    assert (down.returncode, down.stderr) == (5, b"")
    assert json.loads(down.stdout) == {"target": server.target, "service": "", "status": "NOT_SERVING"}


@pytest.mark.parametrize("command", [["stats"], ["health"], ["get", "--namespace", "ns", "--key", KEY.hex()]])
def test_unreachable_server_exits_3_quickly(command: list[str]) -> None:
    target = f"127.0.0.1:{free_port()}"  # nothing listens there
    start = time.monotonic()
    result = cli("--target", target, "--timeout", "2", *command)
    assert time.monotonic() - start < 10
    assert result.returncode == 3
    assert result.stderr.decode().startswith(f"kvcache: cannot reach the server at {target}: ")
    assert result.stderr.count(b"\n") == 1 and b"Traceback" not in result.stderr


@pytest.mark.parametrize("command", ["stats", "health"])
def test_silent_server_exits_3_after_the_timeout(command: str) -> None:
    with socket.socket() as listener:  # accepts connections, never speaks gRPC
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        target = f"127.0.0.1:{listener.getsockname()[1]}"
        start = time.monotonic()
        result = cli("--target", target, "--timeout", "1", command)
        elapsed = time.monotonic() - start
    assert 1 <= elapsed < 10
    assert (result.returncode, result.stdout) == (3, b"")
    assert result.stderr.decode() == f"kvcache: no answer from the server at {target} within 1s\n"


def test_bad_key_hex_exits_2_with_one_line() -> None:
    result = cli("get", "--namespace", "ns", "--key", "zz")
    assert (result.returncode, result.stdout) == (2, b"")
    assert result.stderr.decode() == (
        "kvcache: argument --key: 'zz' is not a key: expected 32 hex digits (see 'kvcache get --help')\n"
    )
    short = cli("delete", "--namespace", "ns", "--key", "abcd")
    assert short.returncode == 2
    assert "'abcd' is not a key: expected 32 hex digits, got 4" in short.stderr.decode()


def test_server_rejection_exits_4(server: ServerThread) -> None:
    result = cli("put", "--namespace", "not valid", "--key", KEY.hex(), "--raw", "-", target=server.target, stdin=b"x")
    assert result.returncode == 4
    message = result.stderr.decode()
    assert message.startswith("kvcache: the server refused the request: INVALID_ARGUMENT: namespace must be ")
    assert message.count("\n") == 1 and message.endswith("\n")


def test_help_documents_the_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert EXIT_CODES in capsys.readouterr().out
    assert main(["get", "--help"]) == 0
    assert EXIT_CODES in capsys.readouterr().out
    assert main([]) == 2
    assert capsys.readouterr().err == (
        "kvcache: the following arguments are required: COMMAND (see 'kvcache --help')\n"
    )


# -- auth and TLS ----------------------------------------------------------------------------------


def test_token_from_the_environment(make_server, tmp_path: Path) -> None:
    token = "kvc_cli_test_read_write"
    (tmp_path / "tokens.toml").write_text(
        f'[[tokens]]\nname = "cli"\ntenant = "t"\nsha256 = "{token_digest(token).hex()}"\nrights = ["read", "write"]\n'
    )
    server = make_server(auth={"enabled": True, "tokens_file": str(tmp_path / "tokens.toml")})
    args = ["put", "--namespace", "ns", "--key", KEY.hex(), "--raw", "-"]
    anonymous = cli(*args, target=server.target, stdin=b"x")
    assert anonymous.returncode == 4
    assert anonymous.stderr.decode().startswith("kvcache: the server refused the request: UNAUTHENTICATED: ")
    assert anonymous.stderr.decode().endswith(" (set KVCACHE_TOKEN to an API token)\n")
    assert cli(*args, target=server.target, stdin=b"x", token=token).returncode == 0
    got = cli("get", "--namespace", "ns", "--key", KEY.hex(), target=server.target, token=token)
    assert (got.returncode, got.stdout) == (0, raw_block(KEY, b"x"))
    stats = cli("stats", target=server.target, token=token)  # Stats needs the admin right
    assert stats.returncode == 4
    assert stats.stderr.decode().startswith("kvcache: the server refused the request: PERMISSION_DENIED: ")
    health = cli("health", target=server.target)  # health needs no token
    assert (health.returncode, health.stdout) == (0, b"SERVING\n")


def test_mutual_tls(make_server, tmp_path: Path) -> None:
    certs = make_certs(tmp_path)
    ca = str(certs["ca.crt"])
    server = make_server(
        tls={"cert_file": str(certs["server.crt"]), "key_file": str(certs["server.key"]), "client_ca_file": ca}
    )
    client_cert = ["--cert-file", str(certs["client.crt"]), "--key-file", str(certs["client.key"])]
    stats = cli("--ca-file", ca, *client_cert, "stats", "--json", target=server.target)
    assert (stats.returncode, [t["name"] for t in json.loads(stats.stdout)["tiers"]]) == (0, ["ram"])
    health = cli("--ca-file", ca, *client_cert, "health", target=server.target)
    assert (health.returncode, health.stdout) == (0, b"SERVING\n")
    for options in ([], ["--ca-file", ca], ["--ca-file", str(certs["rogue-ca.crt"]), *client_cert]):
        refused = cli("--timeout", "3", *options, "health", target=server.target)
        assert refused.returncode == 3, (options, refused.stderr)
    half = cli("--cert-file", str(certs["client.crt"]), "health", target=server.target)
    assert (half.returncode, half.stderr) == (2, b"kvcache: --cert-file and --key-file go together\n")
    missing = cli("--ca-file", str(tmp_path / "nope.crt"), "health", target=server.target)
    assert (missing.returncode, missing.stderr) == (
        2,
        f"kvcache: --ca-file: cannot read {tmp_path / 'nope.crt'}\n".encode(),
    )


# -- bench -----------------------------------------------------------------------------------------


def test_bench_with_tiny_blocks_cleans_up(capsys: pytest.CaptureFixture[str], server: ServerThread) -> None:
    code, out, err = run(capsys, server, "bench", "--block-bytes", "4KiB", "--blocks", "6", "--batch", "4", "--json")
    assert (code, err) == (0, "")
    data = json.loads(out)
    assert (data["block_bytes"], data["blocks"], data["batch"], data["kept"]) == (4096, 6, 4, False)
    for phase in ("put", "get"):
        assert (data[phase]["calls"], data[phase]["blocks"], data[phase]["missing"]) == (2, 6, 0)
        assert data[phase]["payload_bytes"] == 6 * 4096
        assert 0 < data[phase]["p50_ms"] <= data[phase]["p99_ms"]
        assert data[phase]["mb_s"] > 0
    with KVCacheClient(server.target) as client:
        ram = client.stats().tier("ram")
    assert (ram.puts, ram.hits, ram.blocks) == (6, 6, 0)


def test_bench_keep_and_forced_progress(capsys: pytest.CaptureFixture[str], server: ServerThread) -> None:
    code, out, err = run(capsys, server, "bench", "--block-bytes", "1000", "--blocks", "3", "--keep", "--progress")
    assert code == 0
    title, header, put, get = out.splitlines()
    assert title.startswith(f"bench {server.target}: 3 blocks of 1000 B, 1 per call, namespace kvcache-bench-")
    assert title.endswith(" kept")
    assert header.split() == ["calls", "blocks", "MB/s", "p50", "ms", "p99", "ms"]
    assert put.split()[:3] == ["put", "3", "3"] and get.split()[:3] == ["get", "3", "3"]
    # stderr is not a terminal here: plain lines, no carriage returns or escape codes
    assert "put   33% 1/3 blocks" in err and err.endswith("\n")
    assert "\r" not in err and "\x1b" not in err
    with KVCacheClient(server.target) as client:
        assert client.stats().tier("ram").blocks == 3


@pytest.mark.timeout(10)
def test_bench_progress_on_a_terminal_is_one_bar_rewritten_in_place() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    progress = Progress(stream, True)
    progress.update("put", 1 / 3, "1/3 blocks", force=True)
    progress.close()
    assert stream.getvalue() == "\r\x1b[2Kput  [##########--------------------] 1/3 blocks\r\x1b[2K"


def test_bench_blocks_over_the_servers_limit_exit_4(server: ServerThread) -> None:
    result = cli("bench", "--block-bytes", "64MiB", "--blocks", "1", target=server.target)
    assert result.returncode == 4
    message = result.stderr.decode()
    assert message.startswith("kvcache: the server refused the request: RESOURCE_EXHAUSTED: ")
    assert message.endswith(": 67108912 bytes exceed max_block_bytes=67108864\n")  # 64 MiB + the 48-byte header
    with KVCacheClient(server.target) as client:
        assert client.stats().tier("ram").blocks == 0


# -- rendering helpers -----------------------------------------------------------------------------


def test_human_units() -> None:
    assert [human_bytes(n) for n in (0, 1023, 1024, 1536, 16 << 20, 3 << 40)] == [
        "0 B",
        "1023 B",
        "1.00 KiB",
        "1.50 KiB",
        "16.00 MiB",
        "3.00 TiB",
    ]
    assert [human_duration(s) for s in (4.25, 75, 3723, 93784)] == ["4.2s", "1m 15s", "1h 02m 03s", "1d 2h 03m 04s"]
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.0
    assert percentile(list(range(1, 101)), 99) == 99
    assert percentile([7.0], 99) == 7.0


def test_hit_ratio_before_any_read(server: ServerThread) -> None:
    with KVCacheClient(server.target) as client:
        assert hit_ratio(client.stats().tier("ram")) is None
