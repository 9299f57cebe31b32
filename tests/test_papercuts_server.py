"""A new user's first hour with the server: typos, oversized caps, open ports, log lines, metric names, packaging."""

from __future__ import annotations

import json
import logging
import re
import signal
import subprocess
import sys
import tomllib
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from kvcache_server import __version__
from kvcache_server.app import _warn_if_memory_short, memory_limits
from kvcache_server.cli import main
from kvcache_server.config import ENV_NOT_FIELDS, ConfigError, load_config
from tests.conftest import ServerThread

ROOT = Path(__file__).resolve().parent.parent
RFC3339_MS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


# -- 1. environment variables ------------------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("var", "closest"),
    [
        ("KVCACHE_RAM_CAPACITY", "KVCACHE_RAM_CAPACITY_BYTES"),
        ("KVCACHE_METRIC_ENABLED", "KVCACHE_METRICS_ENABLED"),
        ("KVCACHE_SERVER_PROT", "KVCACHE_SERVER_PORT"),
    ],
)
def test_a_mistyped_environment_variable_is_an_error_naming_the_field(var: str, closest: str) -> None:
    with pytest.raises(ConfigError, match=f"unknown variable {var}; did you mean {closest}\\?"):
        load_config(env={var: "1"})


@pytest.mark.timeout(30)
def test_variables_that_are_not_fields_are_allowed_and_others_refused() -> None:
    env = dict.fromkeys(ENV_NOT_FIELDS, "0") | {"KVCACHE_REDIS_PASSWORD": "secret", "PATH": "/bin"}
    env["KVCACHE_CONFIG"] = ""  # no file
    assert load_config(env=env).redis.password == "secret"
    with pytest.raises(ConfigError, match="unknown variable KVCACHE_WHATEVER; names are KVCACHE_<SECTION>_<FIELD>"):
        load_config(env={"KVCACHE_WHATEVER": "1"})


@pytest.mark.timeout(30)
def test_the_cli_exits_2_on_a_mistyped_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVCACHE_RAM_CAPACITY", "2GiB")
    assert main(["--port", "0"]) == 2
    assert "did you mean KVCACHE_RAM_CAPACITY_BYTES?" in capsys.readouterr().err


# -- 2. memory -------------------------------------------------------------------------------------


def _memory_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "OOM" in r.getMessage()]


@pytest.mark.timeout(60)
def test_a_ram_cap_above_the_machine_warns_with_the_numbers_and_cannot_be_preallocated(
    make_server: Callable[..., ServerThread], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvcache_server.app")
    physical = memory_limits()["physical memory"]
    # The block arena is allocated at start-up (docs/arena.md): a cap the machine cannot hold is an
    # error that says which setting to lower, after the warning with the numbers.
    with pytest.raises(OSError, match=r"block arena of ram\.capacity_bytes = 4096\.00 GiB"):
        make_server(ram={"capacity_bytes": "4TiB"}, shm={"enabled": False})
    (message,) = [m for m in _memory_warnings(caplog) if "physical memory" in m]
    assert "ram.capacity_bytes (4096.00 GiB)" in message and "limits.inflight_bytes (0.25 GiB)" in message
    assert f"physical memory of {physical / (1 << 30):.2f} GiB" in message


@pytest.mark.timeout(60)
def test_a_ram_cap_that_fits_does_not_warn(
    make_server: Callable[..., ServerThread], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvcache_server.app")
    make_server(ram={"capacity_bytes": "16MiB"}, shm={"enabled": False})
    assert _memory_warnings(caplog) == []


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("relative", "value", "warns"),
    [
        ("memory.max", str(1 << 30), True),  # cgroup v2
        ("memory.max", "max", False),
        ("memory/memory.limit_in_bytes", str(1 << 30), True),  # cgroup v1
        ("memory/memory.limit_in_bytes", "9223372036854771712", False),  # v1's "no limit"
    ],
)
def test_the_cgroup_limit_counts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, relative: str, value: str, warns: bool
) -> None:
    path = tmp_path / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(value + "\n")
    caplog.set_level(logging.WARNING, logger="kvcache_server.app")
    # 1 GiB RAM + 256 MiB in flight + the S3 queue (1 GiB): above a 1 GiB limit, below any machine here.
    config = load_config(env={}, overrides={"s3": {"enabled": True, "bucket": "b"}})
    _warn_if_memory_short(config, tmp_path)
    found = [m for m in _memory_warnings(caplog) if "cgroup limit" in m]
    assert bool(found) is warns
    if warns:
        assert "lower tiers' queue_max_bytes and disk.read_buffers_bytes (1.00 GiB) = 2.25 GiB exceeds" in found[0]
        assert found[0].endswith(
            "of 1.00 GiB: the process may be OOM-killed before the RAM tier is full (docs/limits.md)"
        )


@pytest.mark.timeout(30)
def test_the_disk_tiers_read_buffers_count_in_the_memory_bound(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "memory.max").write_text(str(1 << 30) + "\n")
    caplog.set_level(logging.WARNING, logger="kvcache_server.app")
    disk = {
        "enabled": True,
        "dir": str(tmp_path / "disk"),
        "queue_max_bytes": 256 << 20,
        "read_buffers_bytes": 512 << 20,
    }
    _warn_if_memory_short(load_config(env={}, overrides={"disk": disk}), tmp_path)
    found = [m for m in _memory_warnings(caplog) if "cgroup limit" in m]
    # 1 GiB RAM + 256 MiB in flight + the disk's 256 MiB queue + its 512 MiB of read buffers
    assert len(found) == 1 and "disk.read_buffers_bytes (0.75 GiB) = 2.00 GiB exceeds" in found[0], found


# -- 3. the metrics port ---------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("host", "warns"), [("0.0.0.0", True), ("127.0.0.1", False)])
def test_plain_http_metrics_on_a_public_address_warn(
    make_server: Callable[..., ServerThread], caplog: pytest.LogCaptureFixture, host: str, warns: bool
) -> None:
    caplog.set_level(logging.WARNING, logger="kvcache_server.app")
    make_server(metrics={"enabled": True, "host": host, "port": 0}, shm={"enabled": False})
    found = [r.getMessage() for r in caplog.records if "over plain HTTP" in r.getMessage()]
    assert found == (
        [
            f"serving metrics on {host}:0 over plain HTTP: anyone who reaches the port reads them "
            "(bind metrics.host to 127.0.0.1, or configure [tls])"
        ]
        if warns
        else []
    )


# -- 4. JSON logs ----------------------------------------------------------------------------------


def _json_lines(text: str) -> list[dict[str, str]]:
    records = [json.loads(line) for line in text.splitlines()]  # every line, or json raises
    for record in records:
        assert RFC3339_MS.match(record["ts"]), record
        assert {"level", "logger", "request_id", "msg"} <= set(record)
    return records


@pytest.mark.timeout(60)
def test_json_logs_are_json_on_every_line_of_both_streams() -> None:
    # Warnings from kvcache_server.app: metrics served over plain HTTP on 0.0.0.0.
    argv = [sys.executable, "-m", "kvcache_server", "--log-json", "--port", "0", "--ram-capacity", "64MiB"]
    argv += ["--set", "metrics.enabled=true", "--set", "metrics.host=0.0.0.0", "--set", "metrics.port=0"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
        assert " serving kvcache.v1.KVCache on 127.0.0.1:" in first["msg"]
    finally:
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert _json_lines(stdout) == []  # the start-up line was the only one
    records = _json_lines(stderr)
    assert [r["logger"] for r in records if r["msg"] == first["msg"]] == ["kvcache_server.startup"]
    levels = {(r["level"], r["logger"]) for r in records}
    assert ("warning", "kvcache_server.app") in levels and ("info", "kvcache_server.app") in levels  # "stopped"


@pytest.mark.timeout(60)
def test_json_logs_carry_warnings_and_tracebacks_in_one_line() -> None:
    code = (
        "import warnings\n"
        "from kvcache_server.cli import setup_logging\n"
        "from kvcache_server.config import load_config\n"
        "setup_logging(load_config(env={}, overrides={'server': {'log_json': True}}))\n"
        "warnings.warn('a papercut')\n"
        "raise RuntimeError('boom')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert result.returncode == 1 and result.stdout == ""
    warning, crash = _json_lines(result.stderr)
    assert (warning["level"], warning["logger"]) == ("warning", "py.warnings") and "a papercut" in warning["msg"]
    assert (crash["level"], crash["logger"]) == ("critical", "kvcache_server.crash")
    assert crash["exc"].startswith("Traceback (most recent call last):") and crash["exc"].endswith("RuntimeError: boom")


# -- 5. metric names -------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_metric_names(make_server: Callable[..., ServerThread]) -> None:
    server = make_server(metrics={"enabled": True, "port": 0}, shm={"enabled": False})
    url = f"http://127.0.0.1:{server.running.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    assert {"kvcache_tier_read_bytes_total", "kvcache_tier_written_bytes_total", "kvcache_build_info"} <= names
    assert not [n for n in names if "bytes_read" in n or "bytes_written" in n or n.endswith("_created")]
    python = ".".join(map(str, sys.version_info[:3]))
    assert f'kvcache_build_info{{python="{python}",version="{__version__}"}} 1.0' in text.splitlines()


# -- 6. packaging ----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_the_license_is_an_spdx_string_and_building_warns_of_nothing(tmp_path: Path) -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["license"] == "Apache-2.0"
    assert "setuptools>=77" in pyproject["build-system"]["requires"]  # the first to take SPDX strings
    # What `pip install -e .` runs first: setuptools reading pyproject.toml into metadata.
    code = f"from setuptools import build_meta; print(build_meta.prepare_metadata_for_build_wheel({str(tmp_path)!r}))"
    result = subprocess.run(
        [sys.executable, "-W", "always", "-c", code], capture_output=True, text=True, timeout=50, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    assert "deprecat" not in (result.stdout + result.stderr).lower()
    metadata = (tmp_path / result.stdout.split()[-1] / "METADATA").read_text()
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
