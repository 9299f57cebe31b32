"""The Grafana dashboard and the Prometheus rules in deploy/ (issue #27): they parse, and they name only
metrics a real server and a real router export.

promtool (Debian's `prometheus` package; `make test` installs it) checks the rules file, and the
dashboard's expressions written into a throwaway rules file (it parses PromQL offline that way). The
metric names are taken out of every expression and looked up among the sample names of /metrics of a
kvcache server (RAM over Redis) and a kvcache-router (two fake vLLM workers) after both served traffic:
sample names are what Prometheus stores, so a histogram is named by `_bucket`/`_sum`/`_count` and a
counter by `_total`, as the expressions must name them.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from examples._support import RouterProcess
from kvcache_client import KVCacheClient
from kvcache_core.format import encode_block
from kvcache_core.keys import chunk_keys
from kvcache_router.config import NamespaceSection
from tests.backends import RedisProcess, require_binary, wait_for
from tests.conftest import ServerThread, keyed
from tests.test_router_hostile import CHUNK, MODEL, FakeWorker

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "prometheus" / "kvcache-rules.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "kvcache.json"

# Series Prometheus writes itself for every target; no exporter prints them.
PROMETHEUS_OWN = {"up"}
# Grafana's interval variables, outside string literals: replaced by a duration before parsing.
GRAFANA_INTERVALS = ("$__rate_interval", "$__interval", "$__range")

_KEYWORDS = {
    # binary operators and modifiers
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool",
    # aggregation operators (may be followed by `by (...)` rather than `(`)
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
    "quantile", "limitk", "limit_ratio",
    # number literals
    "inf", "nan",
}  # fmt: skip


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (recording-rule names included).

    String literals go first (their text is no name), then label matchers (`{...}`: label names),
    ranges and subqueries (`[...]`), and the label lists of by/without/on/ignoring/group_left/
    group_right; what remains is names, functions (followed by `(`), keywords and numbers.
    """
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)
    text = re.sub(r"\{[^{}]*\}", "{}", text)
    text = re.sub(r"\[[^\[\]]*\]", "[]", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", r"\1", text)
    names = set()
    for m in re.finditer(r"(?<![\w:.])([A-Za-z_:][\w:]*)(\s*\()?", text):
        word, call = m.group(1), m.group(2)
        if call is None and word.lower() not in _KEYWORDS:
            names.add(word)
    return names


def test_metric_names_come_out_of_promql_and_nothing_else() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, tier) (rate(a_seconds_bucket{tier="x(y)", op=~"get|put"}[5m] offset 1h)))'
        " / on (instance) group_left (tier) b_total > bool 0.5"
        " and max_over_time(c:ratio:rate5m[1h:5m]) or sum(d) without (job) unless count(e{le='by'}) > 1e3"
        ' or label_replace(f, "dst", "$1", "src", "(.*)") or -Inf < +nan'
    )
    assert metric_names(expr) == {"a_seconds_bucket", "b_total", "c:ratio:rate5m", "d", "e", "f"}


# -- the files ---------------------------------------------------------------------------------------------


def _rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # a collapsed row holds its panels


def _dashboard_exprs() -> dict[str, str]:
    """Every PromQL expression of the dashboard, by where it is: panel targets and variable queries."""
    dash = json.loads(DASHBOARD.read_text())
    out = {}
    for panel in _panels(dash["panels"]):
        for target in panel.get("targets", []):
            out[f"panel {panel['title']!r} {target['refId']}"] = target["expr"]
    for var in dash["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
        assert m is not None, f"variable {var['name']}: {query}"
        out[f"variable {var['name']}"] = m.group(1)
    return out


def _grafana_to_promql(expr: str) -> str:
    """The expression as Prometheus receives it: interval variables replaced, none left outside strings."""
    for name in GRAFANA_INTERVALS:
        expr = expr.replace(name, "5m")
    outside_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    assert "$" not in outside_strings, f"a Grafana variable outside a label matcher: {expr}"
    return expr


def _promtool_check_rules(path: Path) -> subprocess.CompletedProcess[str]:
    promtool = require_binary("promtool")
    return subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(60)
def test_the_rules_pass_promtool() -> None:
    done = _promtool_check_rules(RULES)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout
    rules = _rules()
    assert {r["alert"] for r in rules if "alert" in r} >= {
        "KVCacheServerDown",
        "KVCacheTierBreakerOpen",
        "KVCacheHitRatioCollapse",
        "KVCacheInflightRefusals",
        "KVCacheArenaPinnedHigh",
        "KVCacheWriteBehindDrops",
        "KVCacheRouterUpstreamFailures",
    }
    for rule in rules:
        if "alert" in rule:
            assert rule["annotations"]["summary"], rule["alert"]
            assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule["alert"]


@pytest.mark.timeout(60)
def test_the_dashboard_is_grafana_json_whose_every_expression_parses(tmp_path: Path) -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "kvcache" and dash["title"] == "kvcache"
    panels = list(_panels(dash["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    variables = {v["name"] for v in dash["templating"]["list"]}
    for panel in panels:
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]), panel["title"]
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert ref_ids and len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            used = set(re.findall(r"\$\{?(\w+)", target["expr"])) - {name[1:] for name in GRAFANA_INTERVALS}
            assert used <= variables, f"{panel['title']}: undefined variables {used - variables}"

    exprs = _dashboard_exprs()
    names = [f"dashboard_expr_{i}" for i in range(len(exprs))]
    rules = [{"record": n, "expr": _grafana_to_promql(e)} for n, e in zip(names, exprs.values(), strict=True)]
    path = tmp_path / "dashboard-exprs.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = _promtool_check_rules(path)
    where = dict(zip(names, exprs, strict=True))
    assert done.returncode == 0, f"{done.stdout}{done.stderr}\n(rule names: {where})"
    assert f"SUCCESS: {len(rules)} rules found" in done.stdout


# -- against a real server and router ----------------------------------------------------------------------


def _sample_names(url: str) -> set[str]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


def _post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, str]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            resp.read()
            return resp.status, dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers)


def _hang_up_mid_stream(router_url: str) -> None:
    """A client that leaves once its streamed answer has begun (kvcache_router_client_disconnects_total)."""
    host, port = router_url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "slow-decode-stream", "stream": True}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(head.encode() + b"\r\n\r\n" + body)
        received = b""
        while b"data: " not in received:
            piece = s.recv(65536)
            assert piece, received
            received += piece


@pytest.mark.timeout(150)
def test_every_metric_the_dashboard_and_rules_name_is_exported(make_server, redis_server: RedisProcess) -> None:
    server: ServerThread = make_server(
        metrics={"enabled": True, "port": 0}, redis={"enabled": True, "url": redis_server.url, "timeout_s": 3.0}
    )
    fields = {"model_id": MODEL, "kv_dtype": "float16", "chunk_tokens": CHUNK, "num_layers": 1}
    fields |= {"num_kv_heads": 1, "head_size": 2}
    namespace = NamespaceSection(**fields).build()  # type: ignore[arg-type]
    flags = [f"--set=namespace.{k}={v}" for k, v in fields.items()] + ["--set=kvcache.namespace_source=config"]
    stored = list(range(100, 100 + 2 * CHUNK + 8))  # three chunks, the first two stored: route=skip
    with (
        FakeWorker("prefill") as prefill,
        FakeWorker("decode") as decode,
        RouterProcess([prefill.url], [decode.url], server.target, *flags) as router,
        KVCacheClient(server.target, timeout_s=10) as client,
    ):
        # The server: puts, lookups, gets and deletes of its own, then the router's lookups.
        blocks = [keyed(os.urandom(512 + i)) for i in range(4)]
        client.put_many("monitoring", blocks)
        assert client.lookup("monitoring", [k for k, _ in blocks]).prefix_length == 4
        assert sum(b is not None for b in client.get_many("monitoring", [k for k, _ in blocks])) == 4
        client.delete("monitoring", [blocks[0][0]])
        keys = chunk_keys(stored, namespace)[:2]
        client.put_many(namespace, [(k, encode_block(b"\0" * 16, dtype="float16", shape=(8,), key=k)) for k in keys])

        # The router: a short prompt, a stored prefix, a prefill, a client that leaves, a failing worker.
        url = f"{router.url}/v1/completions"
        assert _post(url, {"prompt": list(range(1, 6)), "max_tokens": 1})[1]["X-KVCache-Route"] == "short"
        assert _post(url, {"prompt": stored, "max_tokens": 1})[1]["X-KVCache-Route"] == "skip"
        assert _post(url, {"prompt": list(range(500, 500 + 2 * CHUNK + 1)), "max_tokens": 1})[0] == 200
        _hang_up_mid_stream(router.url)
        assert _post(url, {"prompt": "fail-decode-500", "max_tokens": 1})[0] >= 500

        def router_names() -> set[str]:
            return _sample_names(f"{router.url}/metrics")

        wait_for(
            lambda: (
                {"kvcache_router_client_disconnects_total", "kvcache_router_upstream_failures_total"} <= router_names()
            ),
            timeout_s=20,
            what="the router's disconnect and failure counters",
        )
        exported = _sample_names(f"http://127.0.0.1:{server.running.metrics_port}/metrics") | router_names()

    recorded = {rule["record"] for rule in _rules() if "record" in rule}
    named: dict[str, set[str]] = {}
    sources = {f"rule {r.get('record') or r.get('alert')}": r["expr"] for r in _rules()}
    sources |= {f"dashboard {where}": _grafana_to_promql(e) for where, e in _dashboard_exprs().items()}
    for where, expr in sources.items():
        for name in metric_names(expr):
            named.setdefault(name, set()).add(where)
    assert len(named) > 40, sorted(named)  # the extraction found the expressions' names at all
    missing = {
        name: sorted(where)
        for name, where in named.items()
        if name not in exported and name not in PROMETHEUS_OWN and not (":" in name and name in recorded)
    }
    assert not missing, f"named but not exported: {missing}"
    # The list, by name: each is on the dashboard.
    on_dashboard = set().union(*(metric_names(_grafana_to_promql(e)) for e in _dashboard_exprs().values()))
    assert on_dashboard >= {
        "kvcache_tier_lookup_late_hits_total",
        "kvcache_inflight_bytes",
        "kvcache_inflight_peak_bytes",
        "kvcache_inflight_refused_total",
        "kvcache_cut_off_calls_total",
        "kvcache_tier_breaker_state",
        "kvcache_arena_leases",
        "kvcache_router_prefill_skipped_total",
        "kvcache_router_short_prompts_total",
        "kvcache_router_client_disconnects_total",
        "kvcache_namespace_lookup_keys_total",
        "kvcache_request_duration_seconds_bucket",
        "kvcache_tier_operation_duration_seconds_bucket",
    }
