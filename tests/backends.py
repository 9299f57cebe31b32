"""Real backend processes for tests: redis-server and moto's S3 server, each on a free port.

Under CI=true a missing backend fails the test (CI installs them); elsewhere it skips.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def require_binary(name: str) -> str:
    path = shutil.which(name) or (
        str(Path(sys.executable).parent / name) if (Path(sys.executable).parent / name).exists() else None
    )
    if path is None:
        message = f"{name} is not installed (make test installs it)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check, timeout_s: float = 15.0, what: str = "backend") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise TimeoutError(f"{what} did not come up within {timeout_s}s")


class _Backend:
    """A backend child process that tests can pause (SIGSTOP), resume, kill and restart on its port."""

    proc: subprocess.Popen[bytes] | None = None

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class RedisProcess(_Backend):
    """redis-server with no persistence, on a fixed port so it can be killed and restarted."""

    def __init__(self, *extra_args: str, port: int | None = None) -> None:
        self.binary = require_binary("redis-server")
        self.port = port or free_port()
        self.extra_args = list(extra_args)
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            *self.extra_args,
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(self._up, what="redis-server")

    def _up(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                reply = s.recv(64)
                return reply.startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False

    def client(self, **kwargs):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)


class S3Process(_Backend):
    """moto's standalone S3 API server over HTTP (the same boto3 code path as production)."""

    def __init__(self, port: int | None = None) -> None:
        self.binary = require_binary("moto_server")
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "-H", "127.0.0.1", "-p", str(self.port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        wait_for(self._up, what="moto_server")

    def _up(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"moto_server exited with {self.proc.returncode}")
        try:
            urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=0.5)
        except OSError:
            return False
        return True

    def client(self):
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1", config=Config(s3={"addressing_style": "path"})
        )

    def stop(self) -> None:
        self.kill()  # moto keeps nothing worth a graceful exit


S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def make_certs(tmp: Path) -> dict[str, Path]:
    """Test PKI made with the openssl CLI: a CA, a server certificate for 127.0.0.1 and localhost,
    a client certificate from the same CA, and a client certificate from an unrelated CA."""
    openssl = require_binary("openssl")

    def sh(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=tmp, check=True, capture_output=True)

    def ca(name: str) -> None:
        sh(
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.crt",
            "-subj",
            f"/CN={name}",
        )

    def leaf(name: str, signer: str, san: str) -> None:
        sh(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN={name}",
        )
        (tmp / f"{name}.cnf").write_text(f"subjectAltName={san}\n")
        sh(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            f"{signer}.crt",
            "-CAkey",
            f"{signer}.key",
            "-CAcreateserial",
            "-days",
            "1",
            "-out",
            f"{name}.crt",
            "-extfile",
            f"{name}.cnf",
        )

    ca("ca")
    ca("rogue-ca")
    leaf("server", "ca", "IP:127.0.0.1,DNS:localhost")
    leaf("client", "ca", "DNS:kvcache-client")
    leaf("rogue-client", "rogue-ca", "DNS:kvcache-client")
    names = [
        "ca.crt",
        "rogue-ca.crt",
        "server.crt",
        "server.key",
        "client.crt",
        "client.key",
        "rogue-client.crt",
        "rogue-client.key",
    ]
    return {name: tmp / name for name in names}


def rss_bytes(pid: int) -> int:
    """Resident memory of a process, from /proc."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")
