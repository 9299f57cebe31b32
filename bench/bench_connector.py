"""How long vLLM's model runner spends inside the kvcache connector's worker hooks, per step.

    .venv/bin/python bench/bench_connector.py [--requests 8] [--prompt 256] [--decode 32]

One run, three drives of the same requests through vLLM 0.33's real Scheduler and the
worker-side connector (tests/vllm/harness.py: CPU KV caches, a fake model), against a real
`python -m kvcache_server` subprocess:

    no connector   the same drive with no KV connector at all (the baseline step time)
    server up      half the prompts were stored before (loads in flight), the rest are
                   cold (saves in flight), every request decodes
    server hung    the same, with the server SIGSTOPped right after the requests were
                   admitted: loads miss their deadline and are recomputed, puts time out

For each, the table gives the steps, the mean wall time of a step (the harness's whole
step: scheduler, fake forward pass, hooks; the fake model's KV is warmed up first), the
time per step in the scheduler-side connector (lookups are real calls on the scheduler's
thread), and the time per step inside each worker hook (start_load_kv,
wait_for_layer_load, save_kv_layer, wait_for_save, get_finished): what the connector adds
to the model runner's thread. The tiny model of the harness (2 layers, 2 KV heads of 16)
keeps chunks small: this measures the hooks' overhead and that they never wait for the
server, not transfer bandwidth. Step times are wall times on a shared machine: compare
the hook columns, which are the connector's own.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.structured_output import StructuredOutputManager

from kvcache_client import KVCacheClient
from tests.vllm.harness import (
    BLOCK,
    Engine,
    allocate_caches,
    attention_spec,
    make_engine,
    make_kv_cache_config,
    make_vllm_config,
    write_model_dir,
)

HOOKS = ("start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_finished")
SCHEDULER_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
)


class NoConnectorEngine(Engine):
    """The harness's engine with no KV connector: vLLM's Scheduler and the fake model only."""

    def __post_init__(self) -> None:
        config = self.configs[0]
        config.kv_transfer_config = None
        config.cache_config.num_gpu_blocks = self.num_blocks
        kv_cache_config = make_kv_cache_config(self.num_blocks, attention_spec())
        self.scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK,
            log_stats=True,
        )
        self.workers = []
        self.caches = [allocate_caches(kv_cache_config, KVCacheLayout.LBNHC)]


class HookTimer:
    """Seconds spent in each of the named hooks, recorded per step."""

    def __init__(self, worker: Any, hooks: tuple[str, ...] = HOOKS) -> None:
        self.hooks = hooks
        self.current = dict.fromkeys(hooks, 0.0)
        for name in hooks:
            setattr(worker, name, self._wrap(name, getattr(worker, name)))

    def _wrap(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.current[name] += time.perf_counter() - started

        return timed

    def take(self) -> dict[str, float]:
        out, self.current = self.current, dict.fromkeys(self.hooks, 0.0)
        return out


def prompts(count: int, length: int, base: int) -> list[list[int]]:
    return [[(base + 7919 * i + 31 * t) % 997 + 3 for t in range(length)] for i in range(count)]


def drive(
    engine: Engine, requests: list[list[int]], decode: int, *, after_first: Callable[[], None] | None = None
) -> dict[str, Any]:
    """Adds every request, steps until all finished; per-step wall time and hook times."""
    timer = HookTimer(engine.workers[0]) if engine.workers else None
    scheduler_timer = HookTimer(engine.connector, SCHEDULER_HOOKS) if engine.workers else None
    for i, tokens in enumerate(requests):
        engine.add(f"r{i}", tokens, max_tokens=decode)
    step_s: list[float] = []
    hooks: list[dict[str, float]] = []
    scheduler_s: list[float] = []
    deadline = time.monotonic() + 60
    while engine.scheduler.has_requests():
        assert time.monotonic() < deadline, "drive did not finish"
        started = time.perf_counter()
        record = engine.step()
        if record.output.total_num_scheduled_tokens:
            step_s.append(time.perf_counter() - started)
            hooks.append(timer.take() if timer else dict.fromkeys(HOOKS, 0.0))
            scheduler_s.append(sum(scheduler_timer.take().values()) if scheduler_timer else 0.0)
        elif timer:
            timer.take()
            time.sleep(0.001)
        if after_first is not None:
            after_first()
            after_first = None
    return {"steps": len(step_s), "step_s": step_s, "hooks": hooks, "scheduler_s": scheduler_s}


def start_server() -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "kvcache_server", "--port", str(port), "--ram-capacity", "256MiB"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    target = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    with KVCacheClient(target, timeout_s=1) as client:
        while True:
            try:
                client.stats()
                return process, target
            except Exception:
                if time.monotonic() > deadline or process.poll() is not None:
                    process.kill()
                    raise RuntimeError("kvcache_server did not start") from None
                time.sleep(0.1)


def row(name: str, result: dict[str, Any]) -> str:
    steps = max(1, result["steps"])
    mean_step = sum(result["step_s"]) / steps * 1e3
    per_hook = {h: sum(s[h] for s in result["hooks"]) / steps * 1e3 for h in HOOKS}
    worst = max((sum(s.values()) for s in result["hooks"]), default=0.0) * 1e3
    mean_scheduler = sum(result["scheduler_s"]) / steps * 1e3
    cells = [f"{name:<13}", f"{result['steps']:>5}", f"{mean_step:>8.2f}", f"{mean_scheduler:>9.3f}"]
    cells += [f"{sum(per_hook.values()):>8.3f}"]
    cells += [f"{worst:>8.3f}"] + [f"{per_hook[h]:>{len(h)}.3f}" for h in HOOKS]
    return " | ".join(cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--decode", type=int, default=32)
    args = parser.parse_args()
    init_none_hash(sha256)
    model_dir = write_model_dir(Path(tempfile.mkdtemp(prefix="bench-connector-")))
    half = args.requests // 2
    stored = prompts(half, args.prompt, 11)
    fresh = prompts(args.requests - half, args.prompt, 5000)
    hung = prompts(args.requests - half, args.prompt, 9000)
    extra = {"lookup_timeout_s": 0.2, "transfer_timeout_s": 1.0, "breaker_cooldown_s": 60.0}
    num_blocks = args.requests * ((args.prompt + args.decode) // BLOCK + 2) + 8

    process, target = start_server()
    results: dict[str, dict[str, Any]] = {}
    try:

        def baseline() -> NoConnectorEngine:
            config = make_vllm_config(model_dir, max_num_batched_tokens=512)
            return NoConnectorEngine([config], num_blocks=num_blocks)

        # Warm the fake model's per-prefix KV cache with every sequence, so no drive pays for it.
        drive(baseline(), stored + fresh, args.decode)
        drive(baseline(), hung, args.decode)
        results["no connector"] = drive(baseline(), stored + fresh, args.decode)

        seeder = make_engine(model_dir, extra={"target": target, **extra}, num_blocks=num_blocks)
        for i, tokens in enumerate(stored):
            seeder.add(f"seed{i}", tokens)
        seeder.run(max_steps=200)
        up = make_engine(
            model_dir, extra={"target": target, **extra}, num_blocks=num_blocks, max_num_batched_tokens=512
        )
        results["server up"] = drive(up, stored + fresh, args.decode)
        up.settle()

        down = make_engine(
            model_dir, extra={"target": target, **extra}, num_blocks=num_blocks, max_num_batched_tokens=512
        )
        stopped = False

        def stop() -> None:
            nonlocal stopped
            os.kill(process.pid, signal.SIGSTOP)
            stopped = True

        try:
            results["server hung"] = drive(down, stored + hung, args.decode, after_first=stop)
        finally:
            if stopped:
                os.kill(process.pid, signal.SIGCONT)
        down.settle()
        down_stats = dict(down.stats.data)
    finally:
        os.kill(process.pid, signal.SIGCONT)
        process.terminate()
        process.wait(10)

    header = ["drive", "steps", "step ms", "sched. ms", "hooks ms", "worst ms", *HOOKS]
    print(
        f"{args.requests} requests of {args.prompt} prompt tokens (half stored), {args.decode} generated each; "
        "ms per step that scheduled tokens"
    )
    print(
        "sched. ms: in the scheduler-side connector (scheduler thread); hooks ms: in the worker hooks "
        "(model runner thread); worst ms: the slowest step's hooks"
    )
    widths = [13, 5, 8, 9, 8, 8, *(len(h) for h in HOOKS)]
    print(
        " | ".join(f"{h:<{w}}" if i == 0 else f"{h:>{w}}" for i, (h, w) in enumerate(zip(header, widths, strict=True)))
    )
    for name, result in results.items():
        print(row(name, result))
    keys = ("lookups", "lookup_failures", "load_chunks", "load_failures", "save_chunks", "save_failures")
    print("server hung, connector counters:", {k: down_stats.get(k, 0) for k in keys})


if __name__ == "__main__":
    main()
