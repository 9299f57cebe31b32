"""deploy/kubernetes/: every overlay built, valid against the Kubernetes API schema, and in agreement with the
server's and the router's own config loaders, the images and docs/deployment.md.

No cluster is needed. The overlays are built by a small builder here (kustomize's `resources`, `labels`
and strategic-merge `patches`, the only features the overlays use); where `kubectl` is installed its
`kubectl kustomize` must produce the same objects. Every object is validated with kubernetes-validate
(the schemas ship with the package, no network) against Kubernetes KUBERNETES_VERSION, strictly
(unknown fields are errors). Each kvcache container's config is loaded with the server's load_config from
the ConfigMap's TOML and the container's env plus the service-link variables the kubelet injects for the
Services of the overlay (tests/test_service_links.py writes them as the kubelet does).
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvcache_router.config import RouterConfig
from kvcache_router.config import load_config as load_router_config
from kvcache_server.config import ServerConfig, load_config
from tests.test_service_links import Port, service_env

REPO = Path(__file__).resolve().parent.parent
KUBE = REPO / "deploy" / "kubernetes"
BASE = KUBE / "base"
OVERLAYS = {name: KUBE / "overlays" / name for name in ("sidecar", "node", "fleet")}
BUILDS = {"base": BASE, **OVERLAYS}
KUBERNETES_VERSION = "1.30"
SERVER_CONFIG_PATH = "/etc/kvcache/kvcache.toml"
ROUTER_CONFIG_PATH = "/etc/kvcache/router.toml"
_GiB = 1 << 30

# What a secretKeyRef resolves to in these tests: values of the shape each Secret's comment asks for.
SECRETS = {
    ("kvcache-redis", "url"): "redis://:hunter2@redis-cluster-0.redis-cluster:6379",
    ("kvcache-redis", "nodes"): "redis-cluster-1.redis-cluster:6379,redis-cluster-2.redis-cluster:6379",
    ("kvcache-s3", "bucket"): "kvcache",
    ("kvcache-s3", "endpoint_url"): "https://s3.eu-west-1.amazonaws.com",
    ("kvcache-s3", "access_key_id"): "AKIAEXAMPLE",
    ("kvcache-s3", "secret_access_key"): "secret",
    ("kvcache-client-token", "token"): "kvc_example_token",
}

Obj = dict[str, Any]


# -- the builder -----------------------------------------------------------------------------------

# Strategic merge: lists of objects merged item by item on these keys (as the API's patchMergeKey does).
_MERGE_KEYS = {"containers": "name", "initContainers": "name", "volumes": "name", "env": "name",
               "volumeMounts": "mountPath", "ports": "name"}  # fmt: skip


def merge(base: Any, patch: Any, field: str = "") -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            out[key] = merge(base[key], value, key) if key in base else copy.deepcopy(value)
        return out
    key = _MERGE_KEYS.get(field)
    if key and isinstance(base, list) and isinstance(patch, list):
        out_list = [copy.deepcopy(item) for item in base]
        for item in patch:
            at = [i for i, old in enumerate(out_list) if old.get(key) == item.get(key)]
            if at:
                out_list[at[0]] = merge(out_list[at[0]], item)
            else:
                out_list.append(copy.deepcopy(item))
        return out_list
    return copy.deepcopy(patch)


def ident(obj: Obj) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


def build(directory: Path) -> dict[tuple[str, str], Obj]:
    """kustomize's result for `directory`, keyed by (kind, name); only the features the overlays use."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    known = {"apiVersion", "kind", "resources", "patches", "labels"}
    assert set(kustomization) <= known, f"{directory}: the builder does not know {set(kustomization) - known}"
    objects: dict[tuple[str, str], Obj] = {}
    for entry in kustomization.get("resources", []):
        path = directory / entry
        found = build(path).values() if path.is_dir() else yaml.safe_load_all(path.read_text())
        for obj in found:
            assert ident(obj) not in objects, f"{directory}: {ident(obj)} twice"
            objects[ident(obj)] = obj
    for entry in kustomization.get("labels", []):
        assert set(entry) == {"pairs"}, entry  # metadata labels only, not selectors or templates
        for obj in objects.values():
            obj["metadata"]["labels"] = {**obj["metadata"].get("labels", {}), **entry["pairs"]}
    for entry in kustomization.get("patches", []):
        assert set(entry) == {"path"}, entry
        for patch in yaml.safe_load_all((directory / entry["path"]).read_text()):
            target = ident(patch)
            assert target in objects, f"{entry['path']} patches {target}, which is not there"
            if patch.get("$patch") == "delete":
                del objects[target]
            else:
                objects[target] = merge(objects[target], patch)
    return objects


def canonical(value: Any, field: str = "") -> Any:
    """Lists merged by key compared as sets (kustomize puts a patch's new items first, the builder last)."""
    if isinstance(value, dict):
        return {k: canonical(v, k) for k, v in value.items()}
    if isinstance(value, list):
        items = [canonical(v) for v in value]
        key = _MERGE_KEYS.get(field)
        return sorted(items, key=lambda item: str(item.get(key))) if key else items
    return value


def built(name: str) -> dict[tuple[str, str], Obj]:
    return build(BUILDS[name])


def workloads(objects: dict[tuple[str, str], Obj]) -> list[Obj]:
    return [obj for (kind, _), obj in objects.items() if kind in {"Deployment", "DaemonSet", "StatefulSet"}]


def pod(workload: Obj) -> Obj:
    return workload["spec"]["template"]["spec"]


def container(workload: Obj, name: str) -> Obj:
    (found,) = [c for c in pod(workload)["containers"] if c["name"] == name]
    return found


def kvcache_workload(objects: dict[tuple[str, str], Obj]) -> Obj:
    (found,) = [w for w in workloads(objects) if w["metadata"]["name"] == "kvcache"]
    return found


def quantity(text: str) -> int:
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", text)
    assert match, text
    return int(match.group(1)) << {None: 0, "Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40}[match.group(2)]


# -- the pod's environment and the configs ---------------------------------------------------------


def cluster_links(objects: dict[tuple[str, str], Obj]) -> dict[str, str]:
    """The kubelet's service-link variables for every Service of the build plus `kubernetes`."""
    env = service_env("kubernetes", "10.96.0.1", [("https", 443, "TCP")])
    services = [obj for (kind, _), obj in objects.items() if kind == "Service"]
    for i, svc in enumerate(services):
        ports: list[Port] = [(p.get("name", ""), p["port"], p.get("protocol", "TCP")) for p in svc["spec"]["ports"]]
        env |= service_env(svc["metadata"]["name"], f"10.96.12.{30 + i}", ports)
    return env


def container_env(c: Obj, pod_name: str) -> dict[str, str]:
    out = {}
    for var in c.get("env", []):
        if "value" in var:
            out[var["name"]] = var["value"]
        elif "secretKeyRef" in var["valueFrom"]:
            ref = var["valueFrom"]["secretKeyRef"]
            out[var["name"]] = SECRETS[(ref["name"], ref["key"])]
        else:
            assert var["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}, var
            out[var["name"]] = pod_name
    return out


def mounted_file(objects: dict[tuple[str, str], Obj], workload: Obj, c: Obj, path: str, tmp: Path) -> Path:
    """The file a ConfigMap subPath mount puts at `path` in container `c`, written under `tmp`."""
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == path]
    (volume,) = [v for v in pod(workload)["volumes"] if v["name"] == mount["name"]]
    config_map = objects[("ConfigMap", volume["configMap"]["name"])]
    out = tmp / f"{workload['metadata']['name']}-{mount['subPath']}"
    out.write_text(config_map["data"][mount["subPath"]])
    return out


def server_config(name: str, tmp: Path) -> tuple[ServerConfig, dict[tuple[str, str], Obj]]:
    objects = built(name)
    workload = kvcache_workload(objects)
    c = container(workload, "kvcache")
    assert c["args"] == ["--config", SERVER_CONFIG_PATH]
    path = mounted_file(objects, workload, c, SERVER_CONFIG_PATH, tmp)
    # The container's env replaces a link variable of the same name, as in a pod.
    env = cluster_links(objects) | container_env(c, "kvcache-7d4b9c-x2x5q")
    return load_config(path=path, env=env), objects


def router_config(tmp: Path) -> RouterConfig:
    objects = built("fleet")
    workload = objects[("Deployment", "kvcache-router")]
    c = container(workload, "kvcache-router")
    assert c["args"] == ["--config", ROUTER_CONFIG_PATH]
    path = mounted_file(objects, workload, c, ROUTER_CONFIG_PATH, tmp)
    return load_router_config(path=path, env=cluster_links(objects) | container_env(c, "kvcache-router-0"))


def dockerfile_user(name: str) -> tuple[int, int]:
    (line,) = [ln for ln in (REPO / "docker" / name).read_text().splitlines() if ln.startswith("USER ")]
    uid, gid = line.split()[1].split(":")
    return int(uid), int(gid)


# -- building and the schema -----------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(BUILDS))
def test_the_builder_matches_kubectl_kustomize(name: str) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the builder's result is checked by the tests below only")
    out = subprocess.run([kubectl, "kustomize", str(BUILDS[name])], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    theirs = {ident(obj): canonical(obj) for obj in yaml.safe_load_all(out.stdout)}
    assert theirs == {key: canonical(obj) for key, obj in built(name).items()}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(BUILDS))
def test_every_object_is_valid_for_the_stated_kubernetes_version(name: str) -> None:
    objects = built(name)
    assert objects
    for obj in objects.values():
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


@pytest.mark.timeout(60)
def test_the_validator_rejects_a_misspelt_field() -> None:
    """So that the test above means something: strict validation, offline, catches a typo."""
    workload = copy.deepcopy(kvcache_workload(built("base")))
    pod(workload)["securityContext"]["runAsNonroot"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(workload, KUBERNETES_VERSION, strict=True)


# -- the configs against the loaders ---------------------------------------------------------------


@pytest.mark.timeout(30)
def test_the_configmaps_hold_the_toml_files() -> None:
    assert built("base")[("ConfigMap", "kvcache-config")]["data"] == {
        "kvcache.toml": (BASE / "kvcache.toml").read_text()
    }
    assert built("fleet")[("ConfigMap", "kvcache-router-config")]["data"] == {
        "router.toml": (OVERLAYS["fleet"] / "router.toml").read_text()
    }


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", sorted(BUILDS))
def test_the_server_config_loads_beside_the_service_links(name: str, tmp_path: Path) -> None:
    cfg, objects = server_config(name, tmp_path)
    assert "KVCACHE_PORT" in cluster_links(objects)  # the Service named kvcache is there
    assert cfg.auth.enabled and not cfg.auth.allow_unauthenticated
    assert (cfg.server.host, cfg.metrics.host) == ("0.0.0.0", "0.0.0.0")
    ports = {"grpc": cfg.server.port, "bulk": cfg.bulk.port, "metrics": cfg.metrics.port}
    assert ports == {"grpc": 51051, "bulk": 51061, "metrics": 9400} and cfg.bulk.enabled and cfg.metrics.enabled
    service = objects[("Service", "kvcache")]
    assert {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == {
        n: (port, n) for n, port in ports.items()
    }
    c = container(kvcache_workload(objects), "kvcache")
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == ports
    assert (
        service["spec"]["selector"].items()
        <= kvcache_workload(objects)["spec"]["template"]["metadata"]["labels"].items()
    )


@pytest.mark.timeout(30)
def test_the_fleet_servers_share_redis_cluster_and_s3(tmp_path: Path) -> None:
    cfg, objects = server_config("fleet", tmp_path)
    assert cfg.redis.enabled and cfg.redis.cluster and cfg.redis.write_mode == "through"
    assert cfg.redis.url == SECRETS[("kvcache-redis", "url")]
    assert cfg.s3.enabled and cfg.s3.write_mode == "behind" and cfg.s3.bucket == "kvcache"
    assert cfg.events.server_id == "kvcache-7d4b9c-x2x5q"  # each server named by its pod
    env = container(kvcache_workload(objects), "kvcache")["env"]
    secret_backed = {v["name"] for v in env if "secretKeyRef" in v.get("valueFrom", {})}
    assert {"KVCACHE_REDIS_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= secret_backed
    base, _ = server_config("base", tmp_path)
    assert not base.redis.enabled and not base.s3.enabled


@pytest.mark.timeout(30)
def test_the_router_config_loads_beside_the_service_links_and_points_at_kvcache(tmp_path: Path) -> None:
    objects = built("fleet")
    assert "KVCACHE_ROUTER_PORT" in cluster_links(objects)
    cfg = router_config(tmp_path)
    service = objects[("Service", "kvcache-router")]
    assert [(p["name"], p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [
        ("http", cfg.http.port, "http")
    ]
    assert cfg.http.host == "0.0.0.0" and cfg.workers.decode
    server, _ = server_config("fleet", tmp_path)
    assert cfg.kvcache.target == f"kvcache:{server.server.port}"
    env = container(objects[("Deployment", "kvcache-router")], "kvcache-router")["env"]
    token = {"secretKeyRef": {"name": "kvcache-client-token", "key": "token"}}
    assert {"name": cfg.kvcache.token_env, "valueFrom": token} in env


# -- pods: users, the arena, memory, probes --------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", sorted(BUILDS))
def test_pods_run_as_the_images_numeric_user(name: str) -> None:
    images = {"kvcache": "Dockerfile", "kvcache-router": "router.Dockerfile"}
    for workload in workloads(built(name)):
        spec = pod(workload)
        security = spec["securityContext"]
        uid, gid = dockerfile_user(images[workload["metadata"]["name"]])
        assert security["runAsNonRoot"] is True
        assert (security["runAsUser"], security["runAsGroup"], security["fsGroup"]) == (uid, gid, gid)
        for c in spec["containers"]:
            # No container overrides the pod's user: every container of a pod is the same uid.
            assert not {"runAsUser", "runAsGroup"} & set(c.get("securityContext", {})), c["name"]
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert container(workload, workload["metadata"]["name"])["securityContext"]["readOnlyRootFilesystem"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", sorted(BUILDS))
def test_the_arena_emptydir_holds_two_arenas_and_the_segments(name: str, tmp_path: Path) -> None:
    """docs/deployment.md: 2 x ram.capacity_bytes + 1 GiB; in memory; mounted above shm.dir in every container."""
    cfg, objects = server_config(name, tmp_path)
    workload = kvcache_workload(objects)
    (arena,) = [v for v in pod(workload)["volumes"] if v["name"] == "arena"]
    assert arena["emptyDir"]["medium"] == "Memory"
    assert quantity(arena["emptyDir"]["sizeLimit"]) >= 2 * cfg.ram.capacity_bytes + _GiB
    shm_dir = Path(cfg.shm.dir)
    assert cfg.shm.enabled and cfg.shm.share_arena and shm_dir.name == f"kvcache-{dockerfile_user('Dockerfile')[0]}"
    # The server creates shm.dir (0700) inside the mount: an emptyDir's own directory is open to others.
    for c in pod(workload)["containers"]:
        mounts = [m["mountPath"] for m in c["volumeMounts"] if m["name"] == "arena"]
        assert mounts == [str(shm_dir.parent)], c["name"]
    names = {c["name"] for c in pod(workload)["containers"]}
    assert names == ({"kvcache", "vllm"} if name == "sidecar" else {"kvcache"})


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", sorted(BUILDS))
def test_the_memory_limit_covers_the_configured_budgets(name: str, tmp_path: Path) -> None:
    """RAM + in-flight budget + the lower tiers' queues + ~80 MiB (docs/limits.md), as in test_docker."""
    cfg, objects = server_config(name, tmp_path)
    resources = container(kvcache_workload(objects), "kvcache")["resources"]
    limit = quantity(resources["limits"]["memory"])
    assert quantity(resources["requests"]["memory"]) == limit
    queues = sum(s.queue_max_bytes for s in (cfg.redis, cfg.s3) if s.enabled)
    need = cfg.ram.capacity_bytes + cfg.limits.inflight_bytes + queues + (80 << 20)
    assert need <= limit <= need + 2 * _GiB


@pytest.mark.timeout(30)
def test_probes_run_the_cli_health_command_against_the_grpc_port(tmp_path: Path) -> None:
    cfg, objects = server_config("base", tmp_path)
    c = container(kvcache_workload(objects), "kvcache")
    health = ["kvcache", "--target", f"127.0.0.1:{cfg.server.port}", "--timeout", "3", "health"]  # docs/cli.md
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["exec"]["command"] == health
        assert c[probe]["timeoutSeconds"] > 3
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300  # a large arena being pre-faulted
    grace = pod(kvcache_workload(objects))["terminationGracePeriodSeconds"]
    assert grace > cfg.server.shutdown_grace_s + cfg.server.drain_deadline_s


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", sorted(BUILDS))
def test_tokens_come_from_a_secret(name: str, tmp_path: Path) -> None:
    cfg, objects = server_config(name, tmp_path)
    workload = kvcache_workload(objects)
    (mount,) = [m for m in container(workload, "kvcache")["volumeMounts"] if m["name"] == "tokens"]
    assert Path(cfg.auth.tokens_file).parent == Path(mount["mountPath"]) and mount["readOnly"]
    (volume,) = [v for v in pod(workload)["volumes"] if v["name"] == "tokens"]
    assert volume["secret"] == {"secretName": "kvcache-tokens"}


# -- the three shapes ------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_sidecar_vllm_reaches_its_own_server_with_a_token(tmp_path: Path) -> None:
    cfg, objects = server_config("sidecar", tmp_path)
    vllm = container(kvcache_workload(objects), "vllm")
    args = vllm["args"]
    transfer = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector_module_path"] == "kvcache_connectors.vllm"
    assert transfer["kv_connector_extra_config"]["target"] == f"127.0.0.1:{cfg.server.port}"
    assert transfer["kv_load_failure_policy"] == "recompute"
    assert container_env(vllm, "p")["KVCACHE_TOKEN"] == SECRETS[("kvcache-client-token", "token")]


@pytest.mark.timeout(30)
def test_node_is_one_server_per_node_without_host_access() -> None:
    objects = built("node")
    assert [ident(w) for w in workloads(objects)] == [("DaemonSet", "kvcache")]
    daemonset = objects[("DaemonSet", "kvcache")]
    # The same pod as base's Deployment, so the two cannot drift apart.
    assert daemonset["spec"]["template"] == kvcache_workload(built("base"))["spec"]["template"]
    assert not pod(daemonset).get("hostNetwork", False) and not pod(daemonset).get("hostIPC", False)
    assert all("hostPath" not in v for v in pod(daemonset)["volumes"])
    assert objects[("Service", "kvcache")]["spec"]["internalTrafficPolicy"] == "Local"


@pytest.mark.timeout(30)
def test_fleet_has_replicas_a_disruption_budget_and_the_router() -> None:
    objects = built("fleet")
    kvcache = kvcache_workload(objects)
    pdb = objects[("PodDisruptionBudget", "kvcache")]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= kvcache["spec"]["template"]["metadata"]["labels"].items()
    assert kvcache["spec"]["replicas"] > pdb["spec"]["maxUnavailable"] >= 1
    router = objects[("Deployment", "kvcache-router")]
    service = objects[("Service", "kvcache-router")]
    assert service["spec"]["selector"].items() <= router["spec"]["template"]["metadata"]["labels"].items()
    assert container(router, "kvcache-router")["readinessProbe"]["httpGet"]["path"] == "/health"
