"""Real backend processes for tests: redis-server and moto's S3 server, each on a free port.

Under CI=true a missing backend fails the test (CI installs them); elsewhere it skips.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import weakref
from collections.abc import Sequence
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


def sigstop(pid: int, timeout_s: float = 5.0) -> None:
    """SIGSTOP `pid` and wait until every one of its threads is stopped. kill() returns once the signal
    is queued: until the thread the kernel chose to take it runs (a loaded machine may not schedule it
    for milliseconds), the process's other threads go on running and may still answer a request."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while True:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                stat = (task / "stat").read_text()
            except FileNotFoundError:  # a thread that ended
                continue
            states.append(stat[stat.rindex(")") + 2])  # the field after the command name
        if all(state in "Tt" for state in states):
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"process {pid} not stopped within {timeout_s}s: thread states {states}")
        time.sleep(0.001)


class _Backend:
    """A backend child process that tests can pause (SIGSTOP), resume, kill and restart on its port."""

    proc: subprocess.Popen[bytes] | None = None

    def pause(self) -> None:
        assert self.proc is not None
        sigstop(self.proc.pid)

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

    def __init__(
        self, *extra_args: str, port: int | None = None, tls_ca: Path | None = None, password: str = ""
    ) -> None:
        """`tls_ca`: the server speaks only TLS on `port` (extra_args set it up); clients verify with this CA."""
        self.binary = require_binary("redis-server")
        self.port = port or free_port()
        self.extra_args = list(extra_args)
        self.tls_ca = tls_ca
        self.password = password
        # Its own working directory: a replica writes the RDB it receives there (and a redis-server
        # started in a directory holding a dump.rdb would load it).
        self.workdir = tempfile.mkdtemp(prefix="kvcache-redis-")
        weakref.finalize(self, shutil.rmtree, self.workdir, True)  # kept across restarts, removed with it
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
            "--dir",
            self.workdir,
            *self.extra_args,
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=self.workdir)
        wait_for(self._up, what="redis-server")

    def _up(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as raw:
                s = raw
                if self.tls_ca is not None:
                    import ssl

                    s = ssl.create_default_context(cafile=str(self.tls_ca)).wrap_socket(
                        raw, server_hostname="127.0.0.1"
                    )
                s.sendall(b"PING\r\n")
                reply = s.recv(64)
                return reply.startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False

    def client(self, **kwargs):
        import redis

        if self.tls_ca is not None:
            kwargs = {"ssl": True, "ssl_ca_certs": str(self.tls_ca), **kwargs}
        if self.password:
            kwargs = {"password": self.password, **kwargs}
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


def cluster_port() -> int:
    """A free port whose cluster-bus port (port + 10000) is free too."""
    import random

    for _ in range(200):
        port = random.randint(20000, 40000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


class RedisClusterProcesses:
    """A real Redis Cluster on loopback: `masters` masters with one replica each, joined by redis-cli.

    Fast failover (cluster-node-timeout `node_timeout_ms`), and masters without a live copy leave the
    rest serving (cluster-require-full-coverage no). Each node is a RedisProcess, so tests can kill,
    pause and restart single nodes; `nodes[:masters]` start as masters, nodes[masters + i] replicates nodes[i].
    """

    def __init__(
        self,
        tmp: Path,
        *,
        masters: int = 3,
        node_timeout_ms: int = 1000,
        certs: dict[str, Path] | None = None,
        password: str = "",
        ports: Sequence[int] = (),
    ) -> None:
        """`certs` (make_certs): every node speaks only TLS, bus and replication too; `password`:
        requirepass and masterauth on every node; `ports`: the first nodes' ports (the rest are free ones)."""
        cli = require_binary("redis-cli")
        self.nodes: list[RedisProcess] = []
        self.tls_ca = certs["ca.crt"] if certs else None
        self.password = password
        secure: list[str] = []
        cli_flags: list[str] = []
        if certs:
            secure += ["--tls-cluster", "yes", "--tls-replication", "yes", "--tls-auth-clients", "no"]
            secure += ["--tls-cert-file", str(certs["server.crt"]), "--tls-key-file", str(certs["server.key"])]
            secure += ["--tls-ca-cert-file", str(certs["ca.crt"])]
            cli_flags += ["--tls", "--cacert", str(certs["ca.crt"])]
        if password:
            secure += ["--requirepass", password, "--masterauth", password]
            cli_flags += ["-a", password, "--no-auth-warning"]
        try:
            for i in range(2 * masters):
                port = ports[i] if i < len(ports) else cluster_port()
                workdir = tmp / f"node-{i}"
                workdir.mkdir(parents=True)
                listen = ["--port", "0", "--tls-port", str(port)] if certs else []
                self.nodes.append(
                    RedisProcess(
                        *listen,
                        *secure,
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        str(workdir / "nodes.conf"),
                        "--dir",
                        str(workdir),
                        "--cluster-node-timeout",
                        str(node_timeout_ms),
                        "--cluster-require-full-coverage",
                        "no",
                        "--cluster-replica-validity-factor",
                        "0",
                        "--repl-diskless-sync-delay",  # replicas sync at once, not after 5 s
                        "0",
                        port=port,
                        tls_ca=self.tls_ca,
                        password=password,
                    )
                )
            addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
            subprocess.run(
                [cli, *cli_flags, "--cluster", "create", *addresses, "--cluster-replicas", "1", "--cluster-yes"],
                check=True,
                capture_output=True,
                timeout=60,
            )
            wait_for(self._settled, timeout_s=30, what="redis cluster state ok on every node")
        except BaseException:
            self.stop()
            raise
        self.masters = masters

    def _settled(self) -> bool:
        for node in self.nodes:
            try:
                info = node.client(socket_timeout=1).execute_command("CLUSTER INFO")
            except Exception:  # not up yet
                return False
            if info.get("cluster_state") != "ok" or int(info.get("cluster_slots_ok", 0)) != 16384:
                return False
        return True

    def wait_replicas_known(self) -> None:
        """Waits until every node's slot map names a replica for every range: replicas show there once
        they have synced (~8 s after the cluster forms), and a client reads its replicas from it."""

        def known() -> bool:
            for node in self.live():
                ranges = node.client(socket_timeout=1).execute_command("CLUSTER SLOTS")
                if len(ranges) != self.masters or any(len(r) < 4 for r in ranges):
                    return False
            return True

        wait_for(known, timeout_s=30, what="every replica in every node's slot map")

    @property
    def url(self) -> str:
        """A start-up node's URL (the tier finds the others from it), with the password and TLS scheme."""
        scheme = "rediss" if self.tls_ca else "redis"
        auth = f":{self.password}@" if self.password else ""
        return f"{scheme}://{auth}127.0.0.1:{self.nodes[0].port}/0"

    @property
    def startup_nodes(self) -> str:
        """Every node as host:port, comma-separated (redis.cluster_nodes)."""
        return ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def overrides(self, **extra: object) -> dict[str, object]:
        """The [redis] settings of a kvcache server using this cluster."""
        tls = {"tls_ca_file": str(self.tls_ca)} if self.tls_ca else {}
        return {"enabled": True, "cluster": True, "url": self.url, "cluster_nodes": self.startup_nodes, **tls, **extra}

    def live(self) -> list[RedisProcess]:
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    def role(self, node: RedisProcess) -> str:
        return node.client(socket_timeout=1).execute_command("ROLE")[0].decode()

    def masters_now(self) -> list[RedisProcess]:
        """The live nodes whose role is master now."""
        out = []
        for node in self.live():
            try:
                if self.role(node) == "master":
                    out.append(node)
            except Exception:  # a node going down meanwhile
                continue
        return out

    def replica_of(self, master: RedisProcess) -> RedisProcess:
        """The live node replicating `master` now."""
        for node in self.live():
            role = node.client(socket_timeout=1).execute_command("ROLE")
            if role[0] == b"slave" and int(role[2]) == master.port:
                return node
        raise LookupError(f"no live replica of 127.0.0.1:{master.port}")

    def flushall(self) -> None:
        for node in self.masters_now():
            node.client(socket_timeout=2).flushall()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


class KVServerProcess:
    """`python -m kvcache_server` in a child process (the real command), on a free port."""

    def __init__(self, *settings: str, user: int | None = None) -> None:
        """`user`: the uid (and gid) the server runs as, through setpriv (this process must be root);
        else this process's."""
        argv = [sys.executable, "-m", "kvcache_server", "--port", "0", "--log-level", "warning"]
        if user is not None:
            argv = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *argv]
        for setting in settings:
            argv += ["--set", setting]
        repo = Path(__file__).resolve().parent.parent
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=repo)
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        match = re.search(r" on (\S+:\d+)", line)
        if not match:
            self.stop()
            raise RuntimeError(f"kvcache-server did not start: {line!r}")
        self.target = match.group(1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class SentinelProcess(_Backend):
    """One `redis-server --sentinel` watching `master` (quorum 1), failing over after `down_after_ms`."""

    def __init__(self, tmp: Path, master: RedisProcess, *, name: str = "kvcache", down_after_ms: int = 1000) -> None:
        self.binary = require_binary("redis-server")
        self.port = free_port()
        self.name = name
        self.conf = tmp / f"sentinel-{self.port}.conf"  # sentinel rewrites it: its own writable file
        self.conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\n"
            f"sentinel monitor {name} 127.0.0.1 {master.port} 1\n"
            f"sentinel down-after-milliseconds {name} {down_after_ms}\n"
            f"sentinel failover-timeout {name} 5000\n"
        )
        self.proc = subprocess.Popen(
            [self.binary, str(self.conf), "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp
        )
        wait_for(self._up, what="redis sentinel")

    def _up(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"redis sentinel exited with {self.proc.returncode}")
        try:
            return self.master_port() is not None
        except OSError:
            return False

    def master_port(self) -> int | None:
        """The port of the master this sentinel names now."""
        import redis

        try:
            reply = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1).execute_command(
                "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.name
            )
        except redis.RedisError:
            return None
        return int(reply[1]) if reply else None
