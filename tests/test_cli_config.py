"""`kvcache-server` as users run it, and the config sources with their precedence."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvcache_client import KVCacheClient
from kvcache_server.config import DEFAULT_PORT, ConfigError, load_config, parse_size

pytestmark = pytest.mark.timeout(60)


def start(args: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], str]:
    exe = shutil.which("kvcache-server")
    cmd = [exe] if exe else [sys.executable, "-m", "kvcache_server"]
    proc = subprocess.Popen(cmd + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()  # type: ignore[union-attr]
    return proc, line


def stop(proc: subprocess.Popen[str], sig: int = signal.SIGTERM) -> int:
    proc.send_signal(sig)
    try:
        return proc.wait(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_no_arguments_serves_ram_only_on_the_default_port() -> None:
    if not port_free(DEFAULT_PORT):
        pytest.fail(f"default port {DEFAULT_PORT} is taken on this machine; cannot test the no-argument start")
    proc, line = start([])
    try:
        assert line.startswith("kvcache-server ")
        assert f"on 127.0.0.1:{DEFAULT_PORT} " in line and "ram 1.00 GiB" in line
        with grpc.insecure_channel(f"127.0.0.1:{DEFAULT_PORT}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with KVCacheClient(f"127.0.0.1:{DEFAULT_PORT}") as client:
            assert [t.name for t in client.stats().tiers] == ["ram"]
    finally:
        assert stop(proc) == 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signals_shut_down_gracefully(sig: int) -> None:
    proc, line = start(["--port", "0"])
    assert "serving kvcache.v1.KVCache" in line
    assert stop(proc, sig) == 0
    assert "Traceback" not in proc.stderr.read()  # type: ignore[union-attr]


def test_flags_env_and_file(tmp_path: Path) -> None:
    config = tmp_path / "kvcache.toml"
    config.write_text('[ram]\ncapacity_bytes = "256MiB"\n[limits]\nmax_block_bytes = "8MiB"\n')
    env = {"PATH": "/usr/bin:/bin", "KVCACHE_RAM_CAPACITY_BYTES": "512MiB"}
    proc, line = start(["--config", str(config), "--port", "0"], env={**env, **_pythonpath()})
    try:
        # env (512 MiB) beats the file (256 MiB); the file's max block applies.
        assert "ram 0.50 GiB" in line and "max block 8 MiB" in line
    finally:
        assert stop(proc) == 0


def _pythonpath() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k in {"PYTHONPATH", "VIRTUAL_ENV", "HOME"}}


def test_bad_config_exits_2_with_a_message(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[ram]\ncapacity = 5\n")
    proc, _ = start(["--config", str(bad)])
    assert proc.wait(timeout=15) == 2
    assert "unknown field ram.capacity" in proc.stderr.read()  # type: ignore[union-attr]


def test_port_in_use_exits_1() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc, _ = start(["--port", str(port)])
        assert proc.wait(timeout=15) == 1
        assert "cannot bind" in proc.stderr.read()  # type: ignore[union-attr]


def test_precedence_defaults_file_env_overrides(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        '[server]\nport = 7000\nhost = "0.0.0.0"\n[ram]\ncapacity_bytes = 1000000\n'
        "[auth]\nallow_unauthenticated = true\n"
    )
    assert load_config(env={}).server.port == DEFAULT_PORT
    assert load_config(path=path, env={}).server.port == 7000
    cfg = load_config(path=path, env={"KVCACHE_SERVER_PORT": "7001"}, overrides={"ram": {"capacity_bytes": "2MiB"}})
    assert (cfg.server.port, cfg.server.host, cfg.ram.capacity_bytes) == (7001, "0.0.0.0", 2 << 20)
    assert load_config(env={"KVCACHE_CONFIG": str(path)}).server.port == 7000
    assert load_config(env={"KVCACHE_SERVER_LOG_JSON": "yes"}).server.log_json is True


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"overrides": {"nope": {"x": 1}}}, "unknown section [nope]"),
        ({"overrides": {"server": {"port": "eighty"}}}, "server.port"),
        ({"overrides": {"server": {"port": 70000}}}, "server.port must be in"),
        ({"overrides": {"ram": {"capacity_bytes": "lots"}}}, "is not a size"),
        ({"overrides": {"ram": {"capacity_bytes": 0}}}, "must be positive"),
        ({"overrides": {"server": {"log_level": "loud"}}}, "not a log level"),
        ({"env": {"KVCACHE_SERVER_LOG_JSON": "maybe"}}, "not a boolean"),
        ({"path": "/nonexistent/kvcache.toml"}, "cannot read config file"),
        ({"overrides": {"server": {"host": "0.0.0.0"}}}, "refusing to serve 0.0.0.0 without authentication"),
        ({"overrides": {"auth": {"enabled": True}}}, "auth.enabled needs auth.tokens_file"),
        ({"overrides": {"tls": {"cert_file": "/nonexistent.pem", "key_file": "/k"}}}, "is not a readable file"),
        ({"overrides": {"tls": {"cert_file": "/etc/hostname"}}}, "go together"),
    ],
)
def test_invalid_settings_are_named(kwargs: dict, fragment: str) -> None:
    kwargs.setdefault("env", {})
    with pytest.raises(ConfigError) as info:
        load_config(**kwargs)
    assert fragment in str(info.value)


def test_sizes() -> None:
    assert parse_size("4GiB") == 4 << 30
    assert parse_size("1.5 MB") == 1_500_000
    assert parse_size(123) == 123
    assert parse_size("512") == 512


def test_the_readmes_configuration_sample_is_a_valid_config(tmp_path: Path) -> None:
    """The TOML a user copies from the README's Configuration section loads, every tier in it on."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme[readme.index("## Configuration") :]
    sample = section[section.index("```toml\n") + len("```toml\n") : section.index("```\n", section.index("```toml"))]
    (tmp_path / "kvcache.toml").write_text(sample)
    cfg = load_config(path=tmp_path / "kvcache.toml", env={})
    assert cfg.ram.capacity_bytes == 1 << 30
    assert (cfg.disk.enabled, cfg.disk.dir, cfg.disk.capacity_bytes) == (True, "/var/lib/kvcache/disk", 512 << 30)
    assert cfg.redis.enabled and cfg.s3.enabled and cfg.shm.enabled and cfg.bulk.enabled
