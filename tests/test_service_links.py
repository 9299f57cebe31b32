"""kvcache-server and kvcache-router in a Kubernetes pod: the service-link variables the kubelet sets for
the Services of the pod's namespace are not settings, and a typo of a setting is still an error.

Before, a Service named `kvcache` (KVCACHE_PORT=tcp://...) made the server exit 2 ("unknown variable
KVCACHE_PORT; did you mean KVCACHE_BULK_PORT?"), and one named `kvcache-router` did the same to the router.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvcache_client import KVCacheClient
from kvcache_router.config import load_config as load_router_config
from kvcache_server.config import ConfigError
from kvcache_server.config import load_config as load_server_config
from kvcache_server.launcher import ChildServer
from tests.backends import free_port
from tests.conftest import keyed

REPO = Path(__file__).resolve().parent.parent

Port = tuple[str, int, str]  # (name, port, protocol), as in a Service's spec.ports


def service_env(name: str, cluster_ip: str, ports: list[Port]) -> dict[str, str]:
    """The variables the kubelet sets for a Service, as pkg/kubelet/envvars (FromServices and
    makeLinkVariables) writes them: NAME is the Service's name upper-cased with `-` as `_`; the first
    port also gets the unsuffixed names; an IPv6 address is bracketed in URLs (net.JoinHostPort)."""
    stem = name.upper().replace("-", "_")
    address = f"[{cluster_ip}]" if ":" in cluster_ip else cluster_ip
    env = {f"{stem}_SERVICE_HOST": cluster_ip, f"{stem}_SERVICE_PORT": str(ports[0][1])}
    for port_name, port, _ in ports:
        if port_name:
            env[f"{stem}_SERVICE_PORT_{port_name.upper().replace('-', '_')}"] = str(port)
    for i, (_, port, proto) in enumerate(ports):
        url = f"{proto.lower()}://{address}:{port}"
        if i == 0:
            env[f"{stem}_PORT"] = url
        link = f"{stem}_PORT_{port}_{proto.upper()}"
        env |= {link: url, f"{link}_PROTO": proto.lower(), f"{link}_PORT": str(port), f"{link}_ADDR": cluster_ip}
    return env


KVCACHE = service_env(
    "kvcache", "10.96.12.34", [("grpc", 51051, "TCP"), ("bulk", 51052, "TCP"), ("metrics", 9400, "TCP")]
)
ROUTER = service_env("kvcache-router", "10.96.40.2", [("http", 8000, "TCP")])
KUBERNETES = service_env("kubernetes", "10.96.0.1", [("https", 443, "TCP")])
# Services whose names make a link variable look like a field (KVCACHE_SERVER_PORT, KVCACHE_BULK_PORT, ...),
# one of them on an IPv6 cluster IP.
NEIGHBOURS = (
    service_env("kvcache-server", "10.96.7.7", [("", 51051, "TCP")])
    | service_env("kvcache-bulk", "fd00:10:96::8", [("bulk", 51052, "TCP"), ("probe", 51053, "UDP")])
    | service_env("kvcache-metrics", "10.96.7.9", [("prom", 9400, "SCTP")])
    | service_env("kvcache-router-http", "10.96.7.10", [("http", 8000, "TCP")])
)


@pytest.mark.timeout(10)
def test_the_kubelet_sets_exactly_the_variables_of_the_issue() -> None:
    assert KVCACHE["KVCACHE_PORT"] == "tcp://10.96.12.34:51051"
    assert KVCACHE["KVCACHE_PORT_51051_TCP_ADDR"] == "10.96.12.34"
    assert KVCACHE["KVCACHE_SERVICE_PORT_GRPC"] == "51051"
    assert NEIGHBOURS["KVCACHE_BULK_PORT"] == "tcp://[fd00:10:96::8]:51052"
    assert len(KVCACHE) == 2 + 3 + 1 + 3 * 4


def pod_env(*services: dict[str, str], **own: str) -> dict[str, str]:
    """This process's environment without KVCACHE_* variables, plus the services' links and `own`
    (the container's env, which replaces a link of the same name as it does in Kubernetes)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHE_")}
    for links in services:
        env |= links
    return env | own


# -- the loader on its own: exactly the links are skipped ------------------------------------------


@pytest.mark.timeout(10)
def test_service_links_are_exactly_the_kubelets_variables() -> None:
    from kvcache_server.config_loader import service_links

    links = KVCACHE | ROUTER | KUBERNETES | NEIGHBOURS
    assert service_links({**links, "KVCACHE_RAM_CAPACITY_BYTES": "1GiB", "HOME": "/root"}) == set(links)


@pytest.mark.timeout(10)
def test_both_configs_load_beside_every_kvcache_service() -> None:
    env = pod_env(KVCACHE, ROUTER, KUBERNETES, NEIGHBOURS, KVCACHE_RAM_CAPACITY_BYTES="64MiB")
    server = load_server_config(env=env)
    assert server.ram.capacity_bytes == 64 << 20
    assert (server.server.port, server.bulk.port, server.metrics.port) == (51051, 0, 9400)  # the defaults
    router = load_router_config(env={**env, "KVCACHE_ROUTER_WORKERS_DECODE": "http://127.0.0.1:8001"})
    assert router.http.port == 8000 and router.workers.decode == ("http://127.0.0.1:8001",)


@pytest.mark.timeout(10)
def test_a_setting_in_the_pods_own_env_wins_over_a_link_of_the_same_name() -> None:
    assert load_server_config(env=pod_env(NEIGHBOURS, KVCACHE_SERVER_PORT="6000")).server.port == 6000


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        # a typo beside the links: named, with the closest field
        ({"KVCACHE_RAM_CAPACTY_BYTES": "1GiB"}, "KVCACHE_RAM_CAPACTY_BYTES; did you mean KVCACHE_RAM_CAPACITY_BYTES?"),
        # link-shaped names whose values are not what the kubelet writes for that Service
        ({"KVCACHE_PORT_51051_TCP_PORT": "51052"}, "unknown variable KVCACHE_PORT_51051_TCP_PORT"),
        ({"KVCACHE_PORT_51051_TCP_PROTO": "udp"}, "unknown variable KVCACHE_PORT_51051_TCP_PROTO"),
        ({"KVCACHE_PORT_51051_TCP_ADDR": "10.96.12.35"}, "unknown variable KVCACHE_PORT_51051_TCP_ADDR"),
        ({"KVCACHE_PORT": "tcp://10.96.99.99:51051"}, "unknown variable KVCACHE_PORT; did you mean KVCACHE_BULK_PORT?"),
        ({"KVCACHE_PORT": "51051"}, "unknown variable KVCACHE_PORT; did you mean KVCACHE_BULK_PORT?"),
        ({"KVCACHE_SERVICE_PORT_GRPC": "grpc"}, "unknown variable KVCACHE_SERVICE_PORT_GRPC"),
        ({"KVCACHE_PORT_51051_HTTP": "http://10.96.12.34:51051"}, "unknown variable KVCACHE_PORT_51051_HTTP"),
    ],
)
@pytest.mark.timeout(10)
def test_what_is_not_a_link_is_still_an_error(extra: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_server_config(env=pod_env(KVCACHE, **extra))


@pytest.mark.parametrize(
    "partial",
    [
        {"KVCACHE_SERVICE_HOST": "10.96.12.34"},  # a host without its port: a typo of KVCACHE_SERVER_HOST
        {"KVCACHE_SERVICE_HOST": "kvcache.default.svc", "KVCACHE_SERVICE_PORT": "51051"},  # not an IP
        {"KVCACHE_SERVICE_HOST": "10.96.12.34", "KVCACHE_SERVICE_PORT": "0"},
        {"KVCACHE_PORT": "tcp://10.96.12.34:51051"},  # no Service family around it
    ],
)
@pytest.mark.timeout(10)
def test_a_partial_family_is_no_link(partial: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="unknown variable KVCACHE_"):
        load_server_config(env=pod_env(**partial))


# -- the real commands, started with the env exactly as Kubernetes sets it -------------------------


def kvcache_server(env: dict[str, str]) -> ChildServer:
    argv = [sys.executable, "-m", "kvcache_server", "--port", "0", "--log-level", "warning"]
    return ChildServer(
        "kvcache-server",
        [*argv, "--set", "ram.capacity_bytes=64MiB", "--set", "ram.prefault=false"],
        env=env,
        cwd=str(REPO),
    )


@pytest.mark.parametrize(
    "services", [(KVCACHE,), (KVCACHE, ROUTER, KUBERNETES, NEIGHBOURS)], ids=["kvcache", "every-kvcache-service"]
)
@pytest.mark.timeout(60)
def test_kvcache_server_starts_and_serves_beside_the_services(services: tuple[dict[str, str], ...]) -> None:
    child = kvcache_server(pod_env(*services))
    try:
        match = child.launch(re.compile(r" on (\S+:\d+) "), 30)
        assert match is not None
        key, block = keyed(os.urandom(4096))
        with KVCacheClient(match.group(1), timeout_s=10) as client:
            assert [t.name for t in client.stats().tiers] == ["ram"]
            assert client.put_many("k8s", [(key, block)]).stored == 1
            assert [bytes(b) for b in client.get_many("k8s", [key])] == [block]
    finally:
        code = child.stop()
    assert code == 0  # a clean SIGTERM shutdown


@pytest.mark.timeout(60)
def test_kvcache_router_starts_and_serves_beside_the_services() -> None:
    decode = f"http://127.0.0.1:{free_port()}"  # nobody there: the router serves, and says so on /health
    env = pod_env(KVCACHE, ROUTER, KUBERNETES, NEIGHBOURS, KVCACHE_ROUTER_WORKERS_DECODE=decode)
    argv = [sys.executable, "-m", "kvcache_router", "--port", "0", "--log-level", "warning"]
    child = ChildServer("kvcache-router", argv, env=env, cwd=str(REPO))
    try:
        match = child.launch(re.compile(r" serving \S+ on (\S+):(\d+) "), 30)
        assert match is not None
        url = f"http://{match.group(1)}:{match.group(2)}"
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
            assert resp.status == 200 and b"kvcache_router_" in resp.read()
        with pytest.raises(urllib.error.HTTPError) as answer:
            urllib.request.urlopen(f"{url}/health", timeout=10)
        assert answer.value.code == 503
        assert list(json.loads(answer.value.read())["workers"]["decode"]) == [decode]
    finally:
        code = child.stop()
    assert code == 0  # a clean SIGTERM shutdown


@pytest.mark.parametrize(
    ("module", "typo", "hint"),
    [
        ("kvcache_server", "KVCACHE_RAM_CAPACTY_BYTES", "KVCACHE_RAM_CAPACITY_BYTES"),
        ("kvcache_router", "KVCACHE_ROUTER_HTTP_PROT", "KVCACHE_ROUTER_HTTP_PORT"),
    ],
)
@pytest.mark.timeout(60)
def test_a_typo_beside_the_services_still_exits_2_with_the_hint(module: str, typo: str, hint: str) -> None:
    env = pod_env(KVCACHE, ROUTER, KUBERNETES, NEIGHBOURS, KVCACHE_ROUTER_WORKERS_DECODE="http://127.0.0.1:1")
    env[typo] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", module, "--port", "0"], env=env, cwd=REPO, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 2, proc.stderr
    assert f"unknown variable {typo}; did you mean {hint}?" in proc.stderr
