"""Lookups, loads and saves that never stall vLLM: the real Scheduler, the worker-side connector, a real server.

Prompts are 100 tokens (chunks of 32: three full and a 4-token tail), as in
test_engine_flow. A `Gate` holds one client call on its way to the server, so a
test decides when a background transfer proceeds; `Timer` adds up the wall time
spent inside a connector's methods (the thread vLLM calls them on).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from vllm.v1.request import RequestStatus

from kvcache_client import KVCacheClient, chunk_keys
from tests.backends import sigstop
from tests.vllm.harness import Engine, bitwise_equal, expected_namespace, make_engine

pytestmark = pytest.mark.timeout(90)

PROMPT = list(range(10, 110))
SHORT = list(range(300, 340))  # 40 tokens: one chunk and an 8-token tail

SCHEDULER_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
)
WORKER_HOOKS = (
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_block_ids_with_load_errors",
)


class Gate:
    """Holds every call of obj.name until `release` is set (at most 20 s); `entered` is set by the first."""

    def __init__(self, obj: Any, name: str) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        method = getattr(obj, name)

        def gated(*args: Any, **kwargs: Any) -> Any:
            self.entered.set()
            self.release.wait(20)
            return method(*args, **kwargs)

        setattr(obj, name, gated)


class Timer:
    """Adds up the seconds spent in the named methods of obj, and counts the calls."""

    def __init__(self, obj: Any, names: tuple[str, ...]) -> None:
        self.seconds = 0.0
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        for name in names:
            setattr(obj, name, self._wrap(name, getattr(obj, name)))

    def _wrap(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
                self.calls.append((name, args))

        return timed


def saved_prompt(model_dir: str, target: str, tokens: list[int] = PROMPT) -> None:
    engine = make_engine(model_dir, extra={"target": target})
    engine.add("producer", tokens)
    engine.run()


def status(engine: Engine, request_id: str) -> RequestStatus:
    return engine.requests[request_id].status


def test_a_request_waiting_for_blocks_is_looked_up_exactly_once(model_dir: str, server) -> None:
    """Old code: one Lookup per step while "b" waited for blocks (one per get_num_new_matched_tokens)."""
    engine = make_engine(model_dir, extra={"target": server.target}, num_blocks=12)  # 11 usable blocks
    lookups = Timer(engine.connector._client, ("lookup",))
    asked = Timer(engine.connector._scheduler, ("get_num_new_matched_tokens",))
    engine.add("a", PROMPT, max_tokens=20)  # holds 7..8 blocks while it decodes
    engine.add("b", [7, *PROMPT[1:]])  # needs 7: waits until "a" finished
    engine.run()

    asks_for_b = sum(1 for _, args in asked.calls if args[0].request_id == "b")
    assert asks_for_b >= 5  # vLLM asked again in every step "b" waited
    assert len(lookups.calls) == 2 and engine.stats.data["lookups"] == 2
    assert engine.computed_positions("b") == list(range(100))


def test_a_load_runs_in_the_background_while_other_requests_decode(model_dir: str, server) -> None:
    """Old code: the Get ran inside the step (start_load_kv), so the step blocked on the gate and
    "ld" was scheduled at once with a synchronous load instead of waiting for remote KV."""
    saved_prompt(model_dir, server.target)
    replica = make_engine(model_dir, extra={"target": server.target})
    replica.add("dec", SHORT, max_tokens=12)
    replica.step()  # prefills "dec"
    gate = Gate(replica.workers[0]._client, "leased")
    replica.add("ld", PROMPT)
    replica.step()  # admits "ld": its load is handed to the load thread
    assert gate.entered.wait(10)

    for _ in range(5):
        record = replica.step()
        assert status(replica, "ld") is RequestStatus.WAITING_FOR_REMOTE_KVS
        assert dict(record.output.num_scheduled_tokens) == {"dec": 1}  # "dec" keeps decoding
    gate.release.set()
    replica.run()

    assert replica.computed_positions("ld") == [99]
    assert bitwise_equal(replica.paged_kv("ld", 0, 100), replica.expected_kv("ld", 0, 100))
    assert replica.computed_positions("dec") == list(range(40 + 11))
    assert bitwise_equal(replica.paged_kv("dec", 0, 40), replica.expected_kv("dec", 0, 40))
    stats = replica.stats.data
    assert (stats["hit_tokens"], stats["load_chunks"], stats.get("load_failures", 0)) == (99, 4, 0)


def test_a_hung_server_never_stalls_the_engine(model_dir: str, server_process) -> None:
    """The server SIGSTOPped while a load is in flight: other requests keep decoding, the load fails
    over to recompute at its deadline, a new prompt's lookup (its first block never stored) is a
    miss from the presence index, without waiting for the hung server.

    Old code: start_load_kv waited for the Get's deadline on the model runner's thread, and every
    step's Put did too (the worker hooks took seconds, "dec" did not decode meanwhile)."""
    process, target = server_process
    saved_prompt(model_dir, target)
    lookup_timeout_s, transfer_timeout_s = 0.3, 1.0
    extra = {
        "target": target,
        "lookup_timeout_s": lookup_timeout_s,
        "transfer_timeout_s": transfer_timeout_s,
        "breaker_cooldown_s": 60.0,
    }
    engine = make_engine(model_dir, extra=extra)
    scheduler_time = Timer(engine.connector._scheduler, SCHEDULER_HOOKS)
    lookups = Timer(engine.connector._client, ("lookup",))
    worker_time = Timer(engine.workers[0], WORKER_HOOKS)
    engine.add("dec", SHORT, max_tokens=400)
    engine.step()
    gate = Gate(engine.workers[0]._client, "leased")
    engine.add("ld", PROMPT)
    engine.step()
    assert gate.entered.wait(10)
    try:
        sigstop(process.pid)
        gate.release.set()
        engine.add("late", [5, *PROMPT[1:]])
        waiting_steps = []
        intact: dict[str, bool] = {}  # checked when the request finishes, before its blocks are reused
        deadline = time.monotonic() + 20
        while len(intact) < 2:
            assert time.monotonic() < deadline
            record = engine.step()
            if status(engine, "ld") is RequestStatus.WAITING_FOR_REMOTE_KVS:
                waiting_steps.append(record)
            for r in ("ld", "late"):
                if r not in intact and engine.requests[r].is_finished():
                    intact[r] = bitwise_equal(engine.paged_kv(r, 0, 100), engine.expected_kv(r, 0, 100))
            time.sleep(0.01)
        assert intact == {"ld": True, "late": True}
        assert len(waiting_steps) >= 5
        assert all(s.output.num_scheduled_tokens.get("dec") == 1 for s in waiting_steps)
        assert engine.computed_positions("ld") == list(range(100))  # recomputed: the Get missed its deadline
        assert engine.computed_positions("late") == list(range(100))  # a miss (the presence index's)
        # The scheduler's thread spent at most one lookup deadline per Lookup it made (3: "dec",
        # "ld" while the server ran, "late" once it hung), plus one for its own work.
        assert len(lookups.calls) == 3
        assert scheduler_time.seconds <= lookup_timeout_s * (len(lookups.calls) + 1)
        # The model runner's thread never waited for the server: its hooks took less than one deadline.
        assert worker_time.seconds < transfer_timeout_s
    finally:
        os.kill(process.pid, signal.SIGCONT)
    engine.max_tokens = 1
    engine.run(max_steps=500)
    stats = engine.stats.data
    # "late"'s first block was never stored: the server's presence index (docs/presence.md) answers it
    # a miss on this host without asking the hung server, so no lookup failed (before the index: 1).
    assert (stats["lookups"], stats.get("lookup_failures", 0), stats["load_failures"]) == (3, 0, 4)


def test_saves_are_put_in_the_background_and_a_full_queue_drops_the_oldest(model_dir: str, server) -> None:
    """With the Put held: the engine runs both requests to the end and frees every block, and with a
    queue of one step the saves queued behind the held one are dropped, oldest first, counted.

    Old code: the Put ran in wait_for_save, so the first step blocked on the gate (20 s) and nothing
    was ever dropped (save_dropped did not exist)."""
    engine = make_engine(model_dir, extra={"target": server.target, "save_queue_steps": 1})
    gate = Gate(engine.workers[0]._client, "put_many")
    engine.add("r1", PROMPT)
    engine.step()  # chunks 0, 1 of r1: the save thread takes them and waits at the gate
    assert gate.entered.wait(10)
    engine.step()  # chunks 2, 3 of r1: queued
    other = list(range(200, 300))
    engine.add("r2", other)
    while engine.scheduler.has_requests():  # r2's chunks 0, 1 drop r1's 2, 3; its 2, 3 drop its 0, 1
        engine.step()
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == engine.num_blocks - 1  # every block free, puts still held
    gate.release.set()
    engine.settle()

    stats = engine.stats.data
    assert (stats["save_chunks"], stats["save_dropped"], stats["save_failures"]) == (4, 4, 4)
    namespace = expected_namespace(model_dir)
    with KVCacheClient(server.target, timeout_s=5) as client:
        assert client.lookup(namespace, chunk_keys(PROMPT, namespace)).prefix_length == 2
        assert client.lookup(namespace, chunk_keys(other, namespace)[2:]).prefix_length == 2


def test_a_follow_up_turn_reuses_the_whole_conversation_but_the_tokens_after_the_last_chunk(
    model_dir: str, server
) -> None:
    """Turn 1: 100 prompt tokens, 40 generated (KV for 139: the last one is never computed).
    Turn 2 on a fresh replica: prompt + answer + 30 new tokens (170) hits 4 full chunks (128).

    Old code: only the prompt was saved, so turn 2 hit its 3 full prompt chunks (96 tokens)."""
    engine = make_engine(model_dir, extra={"target": server.target})
    engine.add("turn1", PROMPT, max_tokens=40)
    engine.run(max_steps=60)
    answer = list(engine.requests["turn1"].output_token_ids)
    assert len(answer) == 40
    # Its final partial chunk was saved in the step after it finished, which held its blocks until
    # the workers reported it sent (copied out), then freed them.
    (last,) = [s.output.kv_connector_metadata for s in engine.steps if s.output.kv_connector_metadata.sent]
    assert last.sent == ("turn1",) and [(c.index, c.start, c.end) for t in last.saves for c in t.chunks] == [
        (4, 128, 139)
    ]
    assert engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == engine.num_blocks - 1

    replica = make_engine(model_dir, extra={"target": server.target})
    history = PROMPT + answer + list(range(500, 530))
    replica.add("turn2", history)
    replica.run()
    assert replica.stats.data["hit_tokens"] == 128
    assert replica.computed_positions("turn2") == list(range(128, 170))
    assert bitwise_equal(replica.paged_kv("turn2", 0, 170), replica.expected_kv("turn2", 0, 170))

    # Turn 1's final partial chunk (tokens 128..138, prompt + output) was saved when it finished.
    namespace = expected_namespace(model_dir)
    with KVCacheClient(server.target, timeout_s=5) as client:
        keys = chunk_keys(PROMPT + answer[:39], namespace)
        assert len(keys) == 5 and client.lookup(namespace, keys).prefix_length == 5


def test_a_consumer_configured_to_write_back_saves_only_what_it_generates(model_dir: str, server) -> None:
    """Old code: write_back was an unknown key (a consumer never saved)."""
    consumer = make_engine(model_dir, role="kv_consumer", extra={"target": server.target, "write_back": True})
    consumer.add("r", PROMPT, max_tokens=40)
    consumer.run(max_steps=60)

    namespace = expected_namespace(model_dir)
    keys = chunk_keys(PROMPT + list(consumer.requests["r"].output_token_ids)[:39], namespace)
    with KVCacheClient(server.target, timeout_s=5) as client:
        stored = [client.lookup(namespace, [key]).prefix_length for key in keys]
    assert stored == [0, 0, 0, 1, 1]  # chunk 3 (96..127, completed by output) and the final partial
    assert consumer.stats.data["save_chunks"] == 2


def handed_off_prefill(model_dir: str, target: str) -> tuple[Engine, Gate, dict[str, Any]]:
    """A prefill instance that computed PROMPT and answered while its puts are held at a gate."""
    prefill = make_engine(model_dir, role="kv_producer", extra={"target": target})
    gate = Gate(prefill.workers[0]._client, "put_many")
    prefill.add("p", PROMPT)
    while prefill.scheduler.has_requests():
        prefill.step()
    assert gate.entered.wait(10)  # the save thread holds the prompt's first put
    return prefill, gate, prefill.kv_transfer_params["p"]


def test_a_decode_instance_waits_for_a_prefill_still_being_written_then_loads_it(model_dir: str, server) -> None:
    """Old code: the producer returned no kv_transfer_params (and its put ran inside the step);
    the consumer's lookup found nothing and recomputed the prompt."""
    prefill, gate, params = handed_off_prefill(model_dir, server.target)
    assert params == {
        "kvcache_handoff": {
            "chunks": 4,
            "last_key": chunk_keys(PROMPT, expected_namespace(model_dir))[3].hex(),
            "heads_per_block": [2],
        }
    }
    decode = make_engine(model_dir, role="kv_consumer", extra={"target": server.target, "handoff_timeout_s": 20.0})
    decode.add("d", PROMPT, kv_transfer_params=params)
    for _ in range(5):  # the decode engine keeps stepping; "d" waits for its KV
        decode.step()
        assert status(decode, "d") is RequestStatus.WAITING_FOR_REMOTE_KVS
        time.sleep(0.02)
    gate.release.set()
    prefill.settle()
    decode.run()

    assert decode.computed_positions("d") == [99]
    assert bitwise_equal(decode.paged_kv("d", 0, 100), decode.expected_kv("d", 0, 100))
    stats = decode.stats.data
    assert (stats["lookups"], stats["hit_tokens"], stats["load_chunks"], stats.get("load_failures", 0)) == (1, 99, 4, 0)


def test_a_decode_instance_recomputes_a_prefill_that_arrives_after_its_deadline(model_dir: str, server) -> None:
    """Old code: as above, the prompt was recomputed, but without waiting (no hand-off at all)."""
    prefill, gate, params = handed_off_prefill(model_dir, server.target)
    try:
        decode = make_engine(model_dir, role="kv_consumer", extra={"target": server.target, "handoff_timeout_s": 0.3})
        decode.add("d", PROMPT, kv_transfer_params=params)
        decode.run()
        assert decode.computed_positions("d") == list(range(100))
        assert bitwise_equal(decode.paged_kv("d", 0, 100), decode.expected_kv("d", 0, 100))
        stats = decode.stats.data
        assert (stats["hit_tokens"], stats.get("load_chunks", 0), stats["load_failures"]) == (99, 0, 4)
        assert decode.invalid_block_ids() == set(decode.last_block_ids("d")[:7])
    finally:
        gate.release.set()
    prefill.settle()
