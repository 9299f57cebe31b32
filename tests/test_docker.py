"""docker/: the image and the compose deployment agree with each other, with the server and with the connector.

No Docker engine is needed (none runs here): docker-compose.yml is parsed with PyYAML, the Dockerfiles'
JSON-form instructions are read as JSON, the TOML files go through the server's own load_config, and the
image's ENTRYPOINT + CMD and its HEALTHCHECK command are run directly on this machine.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from kvcache_router.config import load_config as load_router_config
from kvcache_server.config import ConfigError, ServerConfig, load_config

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parent.parent
DOCKER = REPO / "docker"
COMPOSE_CONFIG = DOCKER / "kvcache.toml"
IMAGE_CONFIG_PATH = "/etc/kvcache/kvcache.toml"
_VARIABLE = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")


# -- reading the files -----------------------------------------------------------------------------


def interpolate(value: str, env: dict[str, str] | None = None) -> str:
    """Compose's ${VAR:-default}, with the variables in `env` set (none: the values the files ship with)."""
    return _VARIABLE.sub(lambda m: (env or {}).get(m.group(1), m.group(2) or ""), value)


def compose() -> dict[str, Any]:
    return yaml.safe_load((DOCKER / "docker-compose.yml").read_text())


def service(name: str) -> dict[str, Any]:
    return compose()["services"][name]


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def one(dockerfile: Path, instruction: str) -> str:
    found = [args for word, args in instructions(dockerfile) if word == instruction]
    assert len(found) == 1, f"{dockerfile.name}: expected one {instruction}, found {found}"
    return found[0]


def published(svc: dict[str, Any]) -> dict[int, tuple[str, int]]:
    """Container port -> (host address, host port) from short-syntax "ADDR:HOST:CONTAINER" entries."""
    out = {}
    for entry in svc["ports"]:
        address, host_port, container_port = interpolate(entry).split(":")
        out[int(container_port)] = (address, int(host_port))
    return out


def config() -> ServerConfig:
    return load_config(path=COMPOSE_CONFIG, env={})


def kv_transfer_config(worker: dict[str, Any]) -> dict[str, Any]:
    command = worker["command"]
    return json.loads(command[command.index("--kv-transfer-config") + 1])


# -- the compose deployment ------------------------------------------------------------------------


def test_services() -> None:
    assert set(compose()["services"]) == {
        "kvcache", "redis", "minio", "minio-init", "hf-cache-init", "vllm-prefill", "vllm-decode", "router"
    }  # fmt: skip


def test_kvcache_service_config_ports_and_mount() -> None:
    cfg = config()
    kvcache = service("kvcache")
    assert kvcache["build"] == {"context": "..", "dockerfile": "docker/Dockerfile"}
    assert (DOCKER / ".." / kvcache["build"]["dockerfile"]).resolve() == DOCKER / "Dockerfile"
    # Metrics are plain HTTP: loopback inside the container, not published (docs/deployment.md, "Metrics").
    assert (cfg.server.host, cfg.metrics.enabled, cfg.metrics.host) == ("0.0.0.0", True, "127.0.0.1")
    # gRPC and the bulk port, each published under its own number: Info advertises the bulk port as is.
    assert published(kvcache) == {
        cfg.server.port: ("127.0.0.1", cfg.server.port),
        cfg.bulk.port: ("127.0.0.1", cfg.bulk.port),
    }
    assert cfg.bulk.enabled and cfg.bulk.port == 51061 and not cfg.bulk.host
    assert (cfg.server.port, cfg.metrics.port) == (51051, 9400)
    assert kvcache["volumes"][0] == f"./kvcache.toml:{IMAGE_CONFIG_PATH}:ro"
    assert json.loads(one(DOCKER / "Dockerfile", "CMD")) == ["--config", IMAGE_CONFIG_PATH]
    assert kvcache["depends_on"] == {
        "redis": {"condition": "service_healthy"},
        "minio": {"condition": "service_healthy"},
        "minio-init": {"condition": "service_completed_successfully"},
    }


def test_the_docs_services_table_lists_every_port() -> None:
    """docs/deployment.md's services table names each service's published ports and the server's metrics port."""
    doc = (REPO / "docs" / "deployment.md").read_text()
    table = doc[doc.index("## The services") :].split("\n\n")[1]
    rows = {line.split("|")[1].strip().strip("`"): line.split("|")[4] for line in table.splitlines()[2:]}
    cfg = config()
    for name, svc in compose()["services"].items():
        for _, host_port in published(svc).values() if "ports" in svc else ():
            assert str(host_port) in rows[name], (name, host_port)
    assert all(str(p) in rows["kvcache"] for p in (cfg.server.port, cfg.bulk.port, cfg.metrics.port))


def test_memory_limit_covers_the_configured_budgets() -> None:
    """mem_limit >= RAM + in-flight budget + the lower tiers' queues + ~80 MiB baseline (docs/limits.md)."""
    cfg = config()
    limit = service("kvcache")["mem_limit"]
    match = re.fullmatch(r"(\d+)([mg])", limit)
    assert match, limit
    limit_bytes = int(match.group(1)) << {"m": 20, "g": 30}[match.group(2)]
    queues = sum(s.queue_max_bytes for s in (cfg.redis, cfg.s3) if s.enabled)
    need = cfg.ram.capacity_bytes + cfg.limits.inflight_bytes + queues + (80 << 20)
    assert need <= limit_bytes <= need + (1 << 30)  # covered, without a large unexplained margin


def test_stop_grace_period_covers_the_shutdown() -> None:
    cfg = config()
    grace = service("kvcache")["stop_grace_period"]
    assert re.fullmatch(r"\d+s", grace)
    assert int(grace[:-1]) > cfg.server.shutdown_grace_s + cfg.server.drain_deadline_s


def test_redis_tier_points_at_the_redis_service() -> None:
    cfg = config()
    url = urlparse(cfg.redis.url)
    assert cfg.redis.enabled
    assert (url.scheme, url.hostname, url.port) == ("redis", "redis", 6379)
    redis = service("redis")
    assert redis["image"] == "redis:7"
    command = [interpolate(word) for word in redis["command"]]
    assert command[0] == "redis-server" and "--port" not in command  # so it listens on 6379
    options = dict(zip(command[1::2], command[2::2], strict=True))
    assert options == {"--save": "", "--appendonly": "no", "--maxmemory": "4gb", "--maxmemory-policy": "allkeys-lru"}


def test_s3_tier_points_at_minio_and_the_bucket_minio_init_creates() -> None:
    cfg = config()
    endpoint = urlparse(cfg.s3.endpoint_url)
    assert (cfg.s3.enabled, cfg.s3.path_style, cfg.s3.write_mode) == (True, True, "behind")
    assert (endpoint.scheme, endpoint.hostname, endpoint.port) == ("http", "minio", 9000)
    minio = service("minio")
    assert minio["command"] == ["server", "/data", "--console-address", ":9001"]  # API on the default 9000
    init = service("minio-init")
    assert init["image"].startswith("minio/mc:")
    assert init["depends_on"] == {"minio": {"condition": "service_healthy"}}
    script = " ".join(init["command"])
    assert "mc alias set local http://minio:9000 " in script
    assert re.findall(r"mc mb --ignore-existing local/(\S+)", script) == [cfg.s3.bucket]


def test_kvcache_uses_the_minio_credentials() -> None:
    minio_env = service("minio")["environment"]
    assert service("minio-init")["environment"] == minio_env
    env = service("kvcache")["environment"]
    assert env["AWS_ACCESS_KEY_ID"] == minio_env["MINIO_ROOT_USER"]
    assert env["AWS_SECRET_ACCESS_KEY"] == minio_env["MINIO_ROOT_PASSWORD"]
    assert len(interpolate(minio_env["MINIO_ROOT_PASSWORD"])) >= 8  # MinIO refuses shorter root passwords


def test_vllm_workers_share_kv_through_the_kvcache_service() -> None:
    cfg = config()
    roles = {}
    for name in ("vllm-prefill", "vllm-decode"):
        worker = service(name)
        transfer = kv_transfer_config(worker)
        roles[name] = transfer.pop("kv_role")
        assert transfer == {
            "kv_connector": "KVCacheConnector",
            "kv_connector_module_path": "kvcache_connectors.vllm",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"target": f"kvcache:{cfg.server.port}"},
        }
        assert importlib.util.find_spec(transfer["kv_connector_module_path"]) is not None
        assert worker["entrypoint"] == ["vllm", "serve"]
        assert interpolate(worker["command"][0]) == "/models/model"
        assert interpolate(worker["volumes"][0]) == "./models:/models:ro"
        assert worker["depends_on"] == {
            "kvcache": {"condition": "service_healthy"},
            "hf-cache-init": {"condition": "service_completed_successfully"},
        }
        assert worker["build"] == {"context": "..", "dockerfile": "docker/vllm.Dockerfile"}
        (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
        assert (device["driver"], device["capabilities"]) == ("nvidia", ["gpu"])
    assert roles == {"vllm-prefill": "kv_producer", "vllm-decode": "kv_consumer"}
    gpus = [
        interpolate(service(n)["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"][0]) for n in roles
    ]
    assert gpus == ["0", "1"]
    assert sorted(published(service(n))[8000][1] for n in roles) == [8100, 8200]


def server_uid() -> int:
    (line,) = [ln for ln in (DOCKER / "Dockerfile").read_text().splitlines() if "useradd" in ln]
    return int(re.search(r"--uid (\d+)", line).group(1))  # type: ignore[union-attr]


def test_the_workers_share_the_servers_block_arena() -> None:
    """Same user, same tmpfs at the server's shm.dir: the workers map the arena and move KV in place."""
    cfg = config()
    uid = server_uid()
    assert cfg.shm.enabled and cfg.shm.share_arena and cfg.shm.dir == ""  # the default: /dev/shm/kvcache-<uid>
    shm_dir = f"/dev/shm/kvcache-{uid}"
    mount = f"kvcache-shm:{shm_dir}"
    assert mount in service("kvcache")["volumes"]
    for name in ("vllm-prefill", "vllm-decode"):
        worker = service(name)
        assert worker["user"] == f"{uid}:{uid}"  # the arena is 0400 and its directory 0700
        assert mount in worker["volumes"]
        assert worker["environment"]["HF_HOME"] == "/hf-cache" and "hf-cache:/hf-cache" in worker["volumes"]
        assert importlib.util.find_spec("kvcache_connectors.vllm") is not None
    volume = compose()["volumes"]["kvcache-shm"]
    assert (volume["driver"], volume["driver_opts"]["type"], volume["driver_opts"]["device"]) == (
        "local",
        "tmpfs",
        "tmpfs",
    )
    opts = dict(o.split("=") for o in volume["driver_opts"]["o"].split(","))
    assert (opts["uid"], opts["gid"], opts["mode"]) == (str(uid), str(uid), "0700")  # what ShmDirectory.open accepts
    size = int(opts["size"].rstrip("g")) << 30
    # Two arenas (a restarted server's new one while workers still map the old) and per-call segments.
    assert size >= 2 * cfg.ram.capacity_bytes + (1 << 30)
    init = service("hf-cache-init")
    assert init["command"] == ["chown", f"{uid}:{uid}", "/hf-cache"] and init["restart"] == "no"


def test_the_connector_accepts_the_extra_config() -> None:
    connector_config = pytest.importorskip("kvcache_connectors.vllm.config")
    for name in ("vllm-prefill", "vllm-decode"):
        extra = kv_transfer_config(service(name))["kv_connector_extra_config"]
        parsed = connector_config.KVCacheConnectorConfig.from_extra_config(extra, block_size=16)
        assert parsed.target == f"kvcache:{config().server.port}"


def test_vllm_image_adds_exactly_the_sdk_dependencies() -> None:
    dockerfile = DOCKER / "vllm.Dockerfile"
    assert one(dockerfile, "FROM") == "vllm/vllm-openai:v0.33.0"
    run = one(dockerfile, "RUN")
    assert "pip install --no-deps /tmp/kvcache " in run
    installed = {word for word in shlex.split(run) if re.match(r"^[a-z][a-z0-9_-]*[<>=]", word)}
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert installed == set(project["dependencies"])


# -- the image -------------------------------------------------------------------------------------


def test_server_image_definition() -> None:
    dockerfile = DOCKER / "Dockerfile"
    assert one(dockerfile, "FROM") == "python:3.11-slim"
    assert 'pip install "/src[server]"' in " ".join(args for word, args in instructions(dockerfile) if word == "RUN")
    assert json.loads(one(dockerfile, "ENTRYPOINT")) == ["kvcache-server"]
    cfg = config()
    assert set(map(int, one(dockerfile, "EXPOSE").split())) == {cfg.server.port, cfg.metrics.port}
    user = one(dockerfile, "USER")
    assert user not in {"root", "0"} and not user.startswith(("root:", "0:"))
    (useradd,) = [args for word, args in instructions(dockerfile) if word == "RUN" and args.startswith("useradd ")]
    # Numeric, so that a pod's runAsNonRoot can verify it (deploy/kubernetes/): the uid useradd gives, and
    # the same number as gid (useradd --user-group takes the uid as gid when it is free, as it is here).
    assert re.fullmatch(r"[1-9]\d*:[1-9]\d*", user), user
    uid, gid = user.split(":")
    assert uid == gid
    assert "--system" in useradd.split() and f"--uid {uid}" in useradd and "--user-group" in useradd.split()
    word_order = [word for word, _ in instructions(dockerfile)]
    assert word_order.index("USER") < word_order.index("ENTRYPOINT")


def test_healthcheck_runs_the_cli_health_command() -> None:
    healthcheck = one(DOCKER / "Dockerfile", "HEALTHCHECK")
    options, _, command = healthcheck.partition(" CMD ")
    assert re.findall(r"--(\w+(?:-\w+)?)=", options) == ["interval", "timeout", "start-period", "retries"]
    argv = json.loads(command)
    assert argv[0] == "kvcache" and argv[-1] == "health"
    env = one(DOCKER / "Dockerfile", "ENV")
    assert f"KVCACHE_TARGET=127.0.0.1:{config().server.port}" in env.split()


def test_image_config_refuses_open_serving_without_opt_in() -> None:
    """docker/standalone.toml, baked into the image: RAM only, same ports, no silent unauthenticated serving."""
    path = DOCKER / "standalone.toml"
    copies = [args for word, args in instructions(DOCKER / "Dockerfile") if word == "COPY"]
    assert f"docker/standalone.toml {IMAGE_CONFIG_PATH}" in copies
    with pytest.raises(ConfigError) as info:
        load_config(path=path, env={})
    assert "without authentication" in str(info.value)
    cfg = load_config(path=path, env={"KVCACHE_AUTH_ALLOW_UNAUTHENTICATED": "true"})
    assert (cfg.redis.enabled, cfg.s3.enabled, cfg.server.port, cfg.metrics.port) == (False, False, 51051, 9400)


def test_every_package_is_installed_by_the_image() -> None:
    """The image installs the project non-editable: a package missing from pyproject is missing there."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    roots = {name: REPO / path for name, path in setuptools["package-dir"].items()}
    roots.update({name: REPO / name for name in ("kvcache_core", "kvcache_server", "kvcache_proto", "kvcache_router")})
    found = set()
    for name, root in roots.items():
        for init in root.rglob("__init__.py"):
            relative = init.parent.relative_to(root)
            found.add(".".join([name, *relative.parts]))
    assert found - set(setuptools["packages"]) == set()
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["kvcache-server"] == "kvcache_server.cli:main"
    assert scripts["kvcache"] == "kvcache_client.cli:main"  # the HEALTHCHECK's command
    assert scripts["kvcache-router"] == "kvcache_router.cli:main"  # the router image's ENTRYPOINT


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "vllm.Dockerfile", "router.Dockerfile"])
def test_every_image_copies_every_package(dockerfile: str) -> None:
    """Each image's pip install sees every source folder pyproject ships, through its build context's filter."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    sources = {
        setuptools["package-dir"].get(p.split(".")[0], p.split(".")[0]).split("/")[0] for p in setuptools["packages"]
    }
    copied = {args.split()[0] for word, args in instructions(DOCKER / dockerfile) if word == "COPY"}
    assert sources - copied == set()
    allowed = set((DOCKER / f"{dockerfile}.dockerignore").read_text().split())
    assert {f"!{name}/" for name in sources} - allowed == set()


def _exe(name: str, module: str) -> list[str]:
    path = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    return [path] if path else [sys.executable, "-m", module]


def test_image_command_serves_and_passes_its_healthcheck() -> None:
    """The image's ENTRYPOINT + CMD with the compose config, Redis/S3/metrics off and a free loopback port."""
    dockerfile = DOCKER / "Dockerfile"
    entrypoint = json.loads(one(dockerfile, "ENTRYPOINT"))
    cmd = [str(COMPOSE_CONFIG) if arg == IMAGE_CONFIG_PATH else arg for arg in json.loads(one(dockerfile, "CMD"))]
    overrides = ["--set", "redis.enabled=false", "--set", "s3.enabled=false", "--set", "metrics.enabled=false"]
    argv = (
        _exe(entrypoint[0], "kvcache_server")
        + entrypoint[1:]
        + cmd
        + overrides
        + ["--host", "127.0.0.1", "--port", "0"]
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHE_")}
    server = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = server.stdout.readline()  # type: ignore[union-attr]
        # The RAM size is docker/kvcache.toml's: the command read the compose config.
        match = re.search(r" on (127\.0\.0\.1:\d+) \(tiers: ram 8\.00 GiB;", line)
        assert match, line
        healthcheck = json.loads(one(dockerfile, "HEALTHCHECK").partition(" CMD ")[2])
        probe = subprocess.run(
            _exe(healthcheck[0], "kvcache_client.cli") + healthcheck[1:],
            capture_output=True,
            text=True,
            timeout=30,
            env={**env, "KVCACHE_TARGET": match.group(1)},
        )
        assert (probe.returncode, probe.stdout, probe.stderr) == (0, "SERVING\n", "")
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            assert server.wait(timeout=20) == 0
        finally:
            if server.poll() is None:
                server.kill()
    assert "Traceback" not in server.stderr.read()  # type: ignore[union-attr]


# -- the router ------------------------------------------------------------------------------------

ROUTER_CONFIG = DOCKER / "router.toml"
ROUTER_CONFIG_PATH = "/etc/kvcache/router.toml"


def router_config() -> Any:
    """docker/router.toml read as the router service reads it: with the service's environment."""
    env = {k: interpolate(v) for k, v in service("router")["environment"].items()}
    return load_router_config(path=ROUTER_CONFIG, env=env)


def worker_port(name: str) -> int:
    command = [interpolate(arg) for arg in service(name)["command"]]
    return int(command[command.index("--port") + 1])


def test_router_fronts_the_vllm_workers_and_the_kvcache_service() -> None:
    router = service("router")
    assert router["build"] == {"context": "..", "dockerfile": "docker/router.Dockerfile"}
    assert router["volumes"] == [f"./router.toml:{ROUTER_CONFIG_PATH}:ro"]
    cfg = router_config()
    assert cfg.workers.prefill == (f"http://vllm-prefill:{worker_port('vllm-prefill')}",)
    assert cfg.workers.decode == (f"http://vllm-decode:{worker_port('vllm-decode')}",)
    assert cfg.kvcache.target == f"kvcache:{config().server.port}"
    # The namespace the vLLM connector derives: its model_id is vLLM's --model (docs/vllm.md).
    assert cfg.kvcache.namespace_source == "config"
    namespace = cfg.namespace.build()
    assert namespace.model_id == interpolate(service("vllm-decode")["command"][0]) == "/models/model"
    connector_config = pytest.importorskip("kvcache_connectors.vllm.config")
    extra = kv_transfer_config(service("vllm-decode"))["kv_connector_extra_config"]
    assert connector_config.KVCacheConnectorConfig.from_extra_config(extra, block_size=16).chunk_tokens == (
        namespace.chunk_tokens
    )
    assert published(router) == {cfg.http.port: ("127.0.0.1", 8000)}
    assert cfg.http.host == "0.0.0.0"  # inside the container only: published on 127.0.0.1
    assert router["depends_on"]["kvcache"] == {"condition": "service_healthy"}
    assert {router["depends_on"][n]["condition"] for n in ("vllm-prefill", "vllm-decode")} == {"service_started"}


def test_router_image_definition() -> None:
    dockerfile = DOCKER / "router.Dockerfile"
    assert one(dockerfile, "FROM") == "python:3.11-slim"
    assert 'pip install "/src[router]"' in " ".join(args for word, args in instructions(dockerfile) if word == "RUN")
    assert json.loads(one(dockerfile, "ENTRYPOINT")) == ["kvcache-router"]
    assert json.loads(one(dockerfile, "CMD")) == ["--config", ROUTER_CONFIG_PATH]
    assert re.fullmatch(r"[1-9]\d*:[1-9]\d*", one(dockerfile, "USER"))  # numeric, not root
    healthcheck = json.loads(one(dockerfile, "HEALTHCHECK").partition(" CMD ")[2])
    port = router_config().http.port
    assert f"127.0.0.1:{port}/health" in healthcheck[-1] and one(dockerfile, "EXPOSE") == str(port)


# -- the fleet: docker-compose.fleet.yml ---------------------------------------------------------------

FLEET_CONFIG = DOCKER / "fleet.toml"


def fleet() -> dict[str, Any]:
    return yaml.safe_load((DOCKER / "docker-compose.fleet.yml").read_text())["services"]


def fleet_nodes() -> list[str]:
    return sorted(n for n in fleet() if n.startswith("kvcache-"))


def test_fleet_services() -> None:
    assert set(fleet()) == {
        *(f"kvcache-{i}" for i in (1, 2, 3)),
        *(f"vllm-{i}" for i in (1, 2, 3)),
        *(f"redis-{i}" for i in range(1, 7)),
        "redis-cluster-init",
        "minio",
        "minio-init",
        "hf-cache-init",
    }


def test_fleet_workers_share_their_own_nodes_block_arena() -> None:
    """Before, the fleet gave its workers no arena (no shared tmpfs, another uid): each vllm-N now
    runs as the server's user with its node's kvcache-shm-N at the server's shm.dir."""
    uid = server_uid()
    shm_dir = f"/dev/shm/kvcache-{uid}"
    services = fleet()
    volumes = yaml.safe_load((DOCKER / "docker-compose.fleet.yml").read_text())["volumes"]
    capacity = load_config(path=FLEET_CONFIG, env={}).ram.capacity_bytes
    for i in (1, 2, 3):
        mount = f"kvcache-shm-{i}:{shm_dir}"
        assert mount in services[f"kvcache-{i}"]["volumes"]
        worker = services[f"vllm-{i}"]
        assert worker["user"] == f"{uid}:{uid}" and mount in worker["volumes"]
        assert worker["environment"]["HF_HOME"] == "/hf-cache" and "hf-cache:/hf-cache" in worker["volumes"]
        assert not any(f"kvcache-shm-{j}:" in v for v in worker["volumes"] for j in (1, 2, 3) if j != i)
        opts = dict(o.split("=") for o in volumes[f"kvcache-shm-{i}"]["driver_opts"]["o"].split(","))
        assert (opts["uid"], opts["gid"], opts["mode"]) == (str(uid), str(uid), "0700")
        assert int(opts["size"].rstrip("g")) << 30 >= 2 * capacity + (1 << 30)


def test_fleet_servers_share_the_redis_cluster_and_minio_and_name_themselves() -> None:
    services = fleet()
    redis_nodes = sorted(n for n in services if re.fullmatch(r"redis-\d", n))
    ids, ports, bulk_ports = set(), set(), set()
    for name in fleet_nodes():
        svc = services[name]
        assert svc["volumes"][0] == f"./fleet.toml:{IMAGE_CONFIG_PATH}:ro"
        cfg = load_config(path=FLEET_CONFIG, env={k: interpolate(str(v)) for k, v in svc["environment"].items()})
        assert cfg.redis.enabled and cfg.redis.cluster and cfg.redis.write_mode == "through"
        assert cfg.redis.startup_nodes() == [(n, 6379) for n in redis_nodes]
        assert (cfg.s3.enabled, urlparse(cfg.s3.endpoint_url).hostname, cfg.s3.bucket) == (True, "minio", "kvcache")
        ids.add(cfg.events.server_id)
        ports.add(published(svc)[cfg.server.port])
        # The bulk port is published under its own number (Info advertises it as the server binds it).
        assert cfg.bulk.enabled and published(svc)[cfg.bulk.port] == ("127.0.0.1", cfg.bulk.port)
        bulk_ports.add(cfg.bulk.port)
        assert svc["depends_on"] == {
            "redis-cluster-init": {"condition": "service_completed_successfully"},
            "minio": {"condition": "service_healthy"},
            "minio-init": {"condition": "service_completed_successfully"},
        }
        queues = cfg.redis.queue_max_bytes + cfg.s3.queue_max_bytes
        need = cfg.ram.capacity_bytes + cfg.limits.inflight_bytes + queues + (80 << 20)
        assert need <= int(svc["mem_limit"][:-1]) << 30 <= need + (1 << 30)
    assert ids == {"node-1", "node-2", "node-3"}
    assert len(ports) == 3 and len(bulk_ports) == 3


def _disk_mount(svc: dict[str, Any], config: Path) -> str:
    """The host side of the volume mounted at the disk tier's directory, with DISK_TIER=true."""
    assert interpolate(svc["environment"]["KVCACHE_DISK_ENABLED"]) == "false"  # off unless turned on
    operator = {"DISK_TIER": "true"}  # what the operator sets in compose's environment
    cfg = load_config(path=config, env={k: interpolate(str(v), operator) for k, v in svc["environment"].items()})
    assert cfg.disk.enabled and cfg.disk.capacity_bytes == 64 << 30
    mounts = [interpolate(v).rsplit(":", 1) for v in svc["volumes"]]
    (host,) = [h for h, inside in mounts if inside == cfg.disk.dir]
    return host


def test_the_disk_tier_directory_is_a_mounted_volume_per_server() -> None:
    """With DISK_TIER=true, the server's own config loader puts disk.dir on a host folder mounted into the
    container (the tier's blocks outlive the container), one folder per server in the fleet."""
    assert _disk_mount(service("kvcache"), COMPOSE_CONFIG) == "./kvcache-disk"
    hosts = {_disk_mount(fleet()[name], FLEET_CONFIG) for name in fleet_nodes()}
    assert hosts == {f"./kvcache-disk/node-{i}" for i in (1, 2, 3)}


def test_fleet_redis_is_a_cluster_of_three_masters_with_a_replica_each() -> None:
    services = fleet()
    redis_nodes = sorted(n for n in services if re.fullmatch(r"redis-\d", n))
    for name in redis_nodes:
        command = [interpolate(str(word)) for word in services[name]["command"]]
        assert command[0] == "redis-server" and "--port" not in command
        options = dict(zip(command[1::2], command[2::2], strict=True))
        assert options["--cluster-enabled"] == "yes"
        assert options["--cluster-announce-hostname"] == name
        assert options["--cluster-require-full-coverage"] == "no"  # a lost shard leaves the rest serving
        assert int(options["--cluster-node-timeout"]) <= 5000
        assert (options["--save"], options["--appendonly"], options["--maxmemory-policy"]) == ("", "no", "allkeys-lru")
    init = services["redis-cluster-init"]
    assert set(init["depends_on"]) == set(redis_nodes)
    script = " ".join(init["command"])
    assert re.search(r"for n in ((?:redis-\d ?)+);", script).group(1).split() == redis_nodes
    assert "--cluster create $$nodes --cluster-replicas 1 --cluster-yes" in script


def test_fleet_workers_try_their_own_server_first_then_the_others() -> None:
    from kvcache_client.targets import split_targets
    from kvcache_connectors.vllm.config import KVCacheConnectorConfig

    services = fleet()
    nodes = fleet_nodes()
    for i, node in enumerate(nodes, start=1):
        worker = services[f"vllm-{i}"]
        transfer = kv_transfer_config(worker)
        targets = split_targets(transfer["kv_connector_extra_config"]["target"])
        assert targets[0] == f"{node}:51051"
        assert sorted(targets) == [f"{n}:51051" for n in nodes]
        assert worker["depends_on"] == {
            node: {"condition": "service_healthy"},
            "hf-cache-init": {"condition": "service_completed_successfully"},
        }
        assert transfer["kv_role"] == "kv_both"
        KVCacheConnectorConfig.from_extra_config(transfer["kv_connector_extra_config"], block_size=16)
