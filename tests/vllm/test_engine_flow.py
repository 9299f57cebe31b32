"""vLLM's real Scheduler driving KVCacheConnector through whole requests, against a real kvcache server.

Prompts are 100 tokens: with chunk_tokens 32, three full chunks and a 4-token tail;
with vLLM blocks of 16 tokens, blocks 0..5 full and block 6 holding 4 tokens. The
engine prefills at most 64 tokens per step, so a cold prompt takes two steps and its
chunks are saved in the step that computes their last token.
"""

from __future__ import annotations

import socket
import time

import pytest

from kvcache_client import KVCacheClient, Namespace, chunk_keys, encode_block
from kvcache_connectors.vllm import KVCacheConnectorMetadata
from kvcache_core.format import Layout
from tests.conftest import ServerThread
from tests.vllm.harness import CHUNK, HEAD, KV_HEADS, NUM_LAYERS, bitwise_equal, expected_namespace, make_engine

pytestmark = pytest.mark.timeout(60)

PROMPT = list(range(10, 110))


def loads_of(engine, step: int = 0) -> list[tuple[str, list[tuple[int, int, int]]]]:
    """(request id, [(chunk index, start, end)]) of the loads planned in one of the engine's steps."""
    meta = engine.steps[step].output.kv_connector_metadata
    assert isinstance(meta, KVCacheConnectorMetadata)
    return [(t.request_id, [(c.index, c.start, c.end) for c in t.chunks]) for t in meta.loads]


def all_loads(engine, first: int = 0) -> list[tuple[str, list[tuple[int, int, int]]]]:
    """loads_of every step of the engine from step `first` on."""
    return [load for step in range(first, len(engine.steps)) for load in loads_of(engine, step)]


def stored_prefix(server: ServerThread, namespace: Namespace, tokens: list[int]) -> int:
    with KVCacheClient(server.target, timeout_s=5) as client:
        return client.lookup(namespace, chunk_keys(tokens, namespace)).prefix_length


def saved_prompt(model_dir: str, server: ServerThread, tokens: list[int] = PROMPT, **config) -> None:
    """Runs a prompt through a fresh saving engine (kv_both unless role says otherwise)."""
    engine = make_engine(model_dir, extra={"target": server.target, **config.pop("extra", {})}, **config)
    engine.add("producer", tokens)
    engine.run()


def test_cold_prompt_misses_and_saves_every_chunk_in_the_step_that_completes_it(model_dir: str, server) -> None:
    engine = make_engine(model_dir, extra={"target": server.target})
    engine.add("r1", PROMPT)
    steps = engine.run()

    assert [s.output.num_scheduled_tokens["r1"] for s in steps] == [64, 36]
    assert engine.computed_positions("r1") == list(range(100))
    saves = [[(c.index, c.start, c.end) for t in s.output.kv_connector_metadata.saves for c in t.chunks] for s in steps]
    assert saves == [[(0, 0, 32), (1, 32, 64)], [(2, 64, 96), (3, 96, 100)]]
    # Stored under the namespace docs/vllm.md promises, recomputed here from its fields.
    assert stored_prefix(server, expected_namespace(model_dir), PROMPT) == 4
    stats = engine.stats.data
    assert (stats["lookups"], stats.get("hit_tokens", 0), stats["save_chunks"]) == (1, 0, 4)
    assert engine.stats.reduce()["hit_rate"] == 0.0


def test_replica_loads_every_chunk_and_the_tail_and_computes_only_the_last_token(model_dir: str, server) -> None:
    saved_prompt(model_dir, server)
    replica = make_engine(model_dir, extra={"target": server.target})
    replica.add("r2", PROMPT)
    replica.run()

    # A full hit loads all but the last token (vLLM must compute one): the tail chunk in part.
    assert loads_of(replica) == [("r2", [(0, 0, 32), (1, 32, 64), (2, 64, 96), (3, 96, 99)])]
    # Loaded asynchronously: the step that planned it scheduled none of the request's tokens.
    assert not replica.steps[0].output.has_sync_kv_loads
    assert replica.steps[0].output.total_num_scheduled_tokens == 0
    assert replica.computed_positions("r2") == [99]
    assert bitwise_equal(replica.paged_kv("r2", 0, 100), replica.expected_kv("r2", 0, 100))
    stats = replica.stats.data
    assert (stats["hit_tokens"], stats["load_chunks"], stats.get("load_failures", 0)) == (99, 4, 0)
    assert stats.get("save_chunks", 0) == 0  # every chunk was stored already
    assert stats["load_bytes"] == NUM_LAYERS * 2 * KV_HEADS * HEAD * 2 * 100


@pytest.mark.parametrize("length", [1, 2, 20, 32, 64, 65])
def test_prompts_of_any_length_hand_over_all_but_their_last_token(length: int, model_dir: str, server) -> None:
    tokens = PROMPT[:length]
    saved_prompt(model_dir, server, tokens)
    replica = make_engine(model_dir, extra={"target": server.target})
    replica.add("r", tokens)
    replica.run()

    assert replica.stats.data.get("hit_tokens", 0) == length - 1
    assert replica.computed_positions("r") == [length - 1]
    assert bitwise_equal(replica.paged_kv("r", 0, length), replica.expected_kv("r", 0, length))


def test_requests_admitted_together_share_one_get_and_one_put_per_step(model_dir: str, server) -> None:
    saved_prompt(model_dir, server, PROMPT[:40])
    saved_prompt(model_dir, server, PROMPT[50:90])
    replica = make_engine(model_dir, extra={"target": server.target}, max_num_batched_tokens=256)
    client = replica.workers[0]._client
    calls: list[str] = []
    for name in ("leased", "put_many"):
        method = getattr(client, name)
        setattr(client, name, lambda *a, _m=method, _n=name, **k: calls.append(_n) or _m(*a, **k))
    replica.add("a", PROMPT[:40] + list(range(700, 740)))  # chunk 0 stored; chunks 1, 2 new
    replica.add("b", PROMPT[50:90] + list(range(800, 840)))
    steps = replica.run()

    assert len(steps) == 1 and calls == ["leased", "put_many"]
    # Same host: both chunks were read in place from the server's arena, and their leases handed back.
    stats = client.stats()
    assert stats.inplace_bytes_leased > 0 and stats.arena_leases == 0
    assert [(r, [c[0] for c in chunks]) for r, chunks in all_loads(replica)] == [("a", [0]), ("b", [0])]
    for request in ("a", "b"):
        assert replica.computed_positions(request) == list(range(32, 80))
        assert bitwise_equal(replica.paged_kv(request, 0, 80), replica.expected_kv(request, 0, 80))
    assert replica.stats.data["save_chunks"] == 4


def test_local_prefix_hit_is_extended_by_the_stored_tail(model_dir: str, server) -> None:
    engine = make_engine(model_dir, extra={"target": server.target})
    engine.add("r1", PROMPT)
    engine.run()
    first = len(engine.steps)
    engine.add("r2", PROMPT)
    engine.run()

    # vLLM's own cache holds blocks 0..5 (96 tokens); kvcache adds tokens 96..98 from the tail chunk.
    assert all_loads(engine, first) == [("r2", [(3, 96, 99)])]
    assert engine.computed_positions("r2") == [99]
    assert bitwise_equal(engine.paged_kv("r2", 0, 100), engine.expected_kv("r2", 0, 100))


def test_without_partial_chunks_only_full_chunks_are_stored_and_loaded(model_dir: str, server) -> None:
    saved_prompt(model_dir, server, extra={"save_partial_chunks": False})
    assert stored_prefix(server, expected_namespace(model_dir), PROMPT) == 3
    replica = make_engine(model_dir, extra={"target": server.target, "save_partial_chunks": False})
    replica.add("r2", PROMPT)
    replica.run()

    assert loads_of(replica) == [("r2", [(0, 0, 32), (1, 32, 64), (2, 64, 96)])]
    assert replica.computed_positions("r2") == [96, 97, 98, 99]
    assert bitwise_equal(replica.paged_kv("r2", 0, 100), replica.expected_kv("r2", 0, 100))


def test_prompt_sharing_a_prefix_loads_only_the_chunks_it_shares(model_dir: str, server) -> None:
    saved_prompt(model_dir, server)
    other = PROMPT[:70] + list(range(500, 530))  # diverges inside chunk 2
    replica = make_engine(model_dir, extra={"target": server.target})
    replica.add("r2", other)
    replica.run()

    assert loads_of(replica) == [("r2", [(0, 0, 32), (1, 32, 64)])]
    assert replica.computed_positions("r2") == list(range(64, 100))
    assert bitwise_equal(replica.paged_kv("r2", 0, 100), replica.expected_kv("r2", 0, 100))
    # The new prompt's own chunks 2 and 3 were saved for the next one.
    assert stored_prefix(server, expected_namespace(model_dir), other) == 4


def test_cache_salt_separates_prompts_with_equal_tokens(model_dir: str, server) -> None:
    producer = make_engine(model_dir, extra={"target": server.target})
    producer.add("salted", PROMPT, cache_salt="tenant-a")
    producer.run()
    assert stored_prefix(server, expected_namespace(model_dir, cache_salt="tenant-a"), PROMPT) == 4
    assert stored_prefix(server, expected_namespace(model_dir), PROMPT) == 0

    replica = make_engine(model_dir, role="kv_consumer", extra={"target": server.target})
    replica.add("other-salt", PROMPT, cache_salt="tenant-b")
    replica.run()
    replica.add("no-salt", PROMPT)
    replica.run()
    replica.add("same-salt", PROMPT, cache_salt="tenant-a")
    replica.run()

    assert replica.computed_positions("other-salt") == list(range(100))
    # vLLM's own prefix cache keys the salt too, so "no-salt" cannot reuse "other-salt" locally either.
    assert replica.computed_positions("no-salt") == list(range(100))
    assert replica.computed_positions("same-salt") == [99]
    assert bitwise_equal(replica.paged_kv("same-salt", 0, 100), replica.expected_kv("same-salt", 0, 100))


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "grpc"])
def test_prefill_and_decode_instances_hand_over_the_whole_prompt(model_dir: str, server, shm: bool) -> None:
    prefill = make_engine(model_dir, role="kv_producer", extra={"target": server.target, "shm": shm})
    decode = make_engine(model_dir, role="kv_consumer", extra={"target": server.target, "shm": shm})
    prefill.add("p", PROMPT)
    prefill.run()
    puts_after_prefill = server.stack.ram.stats().puts

    decode.add("d", PROMPT)
    decode.run()
    assert loads_of(decode) == [("d", [(0, 0, 32), (1, 32, 64), (2, 64, 96), (3, 96, 99)])]
    assert decode.computed_positions("d") == [99]
    assert bitwise_equal(decode.paged_kv("d", 0, 100), decode.expected_kv("d", 0, 100))
    assert server.stack.ram.stats().puts == puts_after_prefill  # a consumer never saves
    with KVCacheClient(server.target, shm=False) as client:  # the decode worker's KV came in place, or not
        assert (client.stats().inplace_bytes_leased > 0) is shm  # through the block arena (docs/arena.md)

    # A producer never offers hits, even for a prompt it stored itself (only vLLM's local cache).
    prefill.add("p2", PROMPT)
    prefill.run()
    assert loads_of(prefill, step=len(prefill.steps) - 1) == []
    assert prefill.stats.data.get("hit_tokens", 0) == 0


def corrupt(server: ServerThread, namespace: Namespace, key: bytes) -> None:
    """Flips one payload byte of a stored block inside the server's RAM tier (as bad memory would)."""
    ram = server.stack.ram
    (block,) = ram.get_many_sync(namespace.name, [key])
    damaged = bytearray(block)
    damaged[-1] ^= 0x01
    ram.put_many_sync(namespace.name, [(key, bytes(damaged))])


def test_corrupt_chunk_fails_its_blocks_is_recomputed_and_saved_again(model_dir: str, server) -> None:
    saved_prompt(model_dir, server)
    namespace = expected_namespace(model_dir)
    keys = chunk_keys(PROMPT, namespace)
    corrupt(server, namespace, keys[1])

    engine = make_engine(model_dir, extra={"target": server.target}, policy="recompute")
    engine.add("r", PROMPT)
    engine.run()

    block_ids = engine.last_block_ids("r")
    # Chunk 1 (tokens 32..63) and everything after it: blocks 2..6 of the request, reported once,
    # in the pass that reports the load finished.
    (failed,) = [i for i, s in enumerate(engine.steps) if s.invalid_block_ids]
    assert engine.steps[failed].invalid_block_ids == set(block_ids[2:7])
    # The next step tells the workers the scheduler has settled it (vLLM recomputes from block 2).
    assert engine.steps[failed + 1].output.kv_connector_metadata.settled_load_failures == tuple(sorted(block_ids[2:7]))
    assert engine.workers[0]._client.corrupt_blocks == 1
    # The load failed before any token was computed: vLLM computes from token 32; chunk 0 stayed loaded.
    assert engine.computed_positions("r") == list(range(32, 100))
    assert bitwise_equal(engine.paged_kv("r", 0, 100), engine.expected_kv("r", 0, 100))
    stats = engine.stats.data
    assert (stats["load_chunks"], stats["load_failures"]) == (1, 3)
    # The recomputed chunks replaced the damaged entry: it reads back intact.
    with KVCacheClient(server.target, timeout_s=5) as client:
        (tensor,) = client.get_tensors(namespace, [keys[1]])
    assert tensor is not None and bitwise_equal(tensor, engine.expected_kv("r", 32, 64))


def test_block_with_a_valid_checksum_but_the_wrong_shape_is_refused(model_dir: str, server) -> None:
    saved_prompt(model_dir, server)
    namespace = expected_namespace(model_dir)
    keys = chunk_keys(PROMPT, namespace)
    wrong = encode_block(
        bytes(NUM_LAYERS * 2 * KV_HEADS * (CHUNK - 1) * HEAD * 2),
        key=keys[0],
        dtype="float16",
        shape=(NUM_LAYERS, 2, KV_HEADS, CHUNK - 1, HEAD),
        layout=Layout.CANONICAL,
    )
    with KVCacheClient(server.target, timeout_s=5) as client:
        client.put_many(namespace, [(keys[0], wrong)])

    engine = make_engine(model_dir, role="kv_consumer", extra={"target": server.target})
    engine.add("r", PROMPT)
    engine.run()

    assert engine.invalid_block_ids() == set(engine.last_block_ids("r")[:7])
    assert engine.computed_positions("r") == list(range(100))
    assert bitwise_equal(engine.paged_kv("r", 0, 100), engine.expected_kv("r", 0, 100))
    assert engine.stats.data["load_failures"] == 4


def test_a_load_that_fails_after_the_fetch_fails_every_block_it_did_not_write(model_dir: str, server) -> None:
    """The scatter raising (a device out of memory, say) after the chunks arrived intact: the load must not be
    reported as done with no failed block, or vLLM would run the request on whatever its blocks last held."""
    saved_prompt(model_dir, server)
    engine = make_engine(model_dir, role="kv_consumer", extra={"target": server.target})
    side = engine.workers[0]._worker_side()

    def out_of_memory(*args: object) -> None:
        raise RuntimeError("out of memory (simulated)")

    side._scatter = out_of_memory
    engine.add("r", PROMPT)
    engine.run()

    assert engine.invalid_block_ids() == set(engine.last_block_ids("r")[:7])
    assert engine.computed_positions("r") == list(range(100))
    assert bitwise_equal(engine.paged_kv("r", 0, 100), engine.expected_kv("r", 0, 100))
    assert (engine.stats.data.get("load_chunks", 0), engine.stats.data["load_failures"]) == (0, 4)


def test_a_load_that_outlives_its_arena_leases_is_recomputed(model_dir: str, make_server) -> None:
    """Loads read the server's arena in place under read leases. A scatter that ends after a lease
    expired may have read a slot the server reused meanwhile: the job's blocks fail (vLLM recomputes
    them) instead of being trusted; the same load inside the leases' time is served."""
    server = make_server(ram={"capacity_bytes": 256 << 20, "lease_timeout_s": 0.3})
    saved_prompt(model_dir, server)
    engine = make_engine(model_dir, role="kv_consumer", extra={"target": server.target})
    side = engine.workers[0]._worker_side()
    scatter = side._scatter

    def stalled(*args: object) -> None:
        time.sleep(0.5)  # the leases (0.3 s) end meanwhile
        scatter(*args)

    side._scatter = stalled
    engine.add("r", PROMPT)
    engine.run()

    assert engine.invalid_block_ids() == set(engine.last_block_ids("r")[:7])
    assert engine.computed_positions("r") == list(range(100))
    assert bitwise_equal(engine.paged_kv("r", 0, 100), engine.expected_kv("r", 0, 100))
    assert (engine.stats.data.get("load_chunks", 0), engine.stats.data["load_failures"]) == (0, 4)

    side._scatter = scatter  # in time: loaded in place, nothing recomputed
    fresh = make_engine(model_dir, role="kv_consumer", extra={"target": server.target})
    fresh.add("r", PROMPT)
    fresh.run()
    assert fresh.computed_positions("r") == [99]
    assert (fresh.stats.data["load_chunks"], fresh.stats.data.get("load_failures", 0)) == (4, 0)


def test_another_chunks_intact_block_is_refused(model_dir: str, server) -> None:
    """Chunk 1's intact block under chunk 0's key (right shape, dtype and layout): before format v2 it was
    scattered as chunk 0's KV. Now the SDK's key check refuses it and the engine recomputes."""
    saved_prompt(model_dir, server)
    namespace = expected_namespace(model_dir)
    keys = chunk_keys(PROMPT, namespace)
    with KVCacheClient(server.target, timeout_s=5) as client:
        (other,) = client.get_many(namespace.name, [keys[1]])
    assert other is not None
    assert server.stack.ram.put_many_sync(namespace.name, [(keys[0], bytes(other))]) == [True]

    engine = make_engine(model_dir, role="kv_consumer", extra={"target": server.target})
    engine.add("r", PROMPT)
    engine.run()

    assert engine.invalid_block_ids() == set(engine.last_block_ids("r")[:7])
    assert engine.computed_positions("r") == list(range(100))
    assert bitwise_equal(engine.paged_kv("r", 0, 100), engine.expected_kv("r", 0, 100))
    assert engine.stats.data["load_failures"] == 4


def test_unreachable_server_makes_every_prompt_a_miss_without_stalling(model_dir: str, dead_target: str) -> None:
    engine = make_engine(model_dir, extra={"target": dead_target, "lookup_timeout_s": 0.5, "breaker_cooldown_s": 60.0})
    started = time.monotonic()
    for i in range(3):
        engine.add(f"r{i}", [i + 3, *PROMPT])
    engine.run()
    elapsed = time.monotonic() - started

    for i in range(3):
        assert engine.computed_positions(f"r{i}") == list(range(101))
    stats = engine.stats.data
    # One failed lookup opened the breaker: the other prompts were not looked up at all.
    assert (stats["lookups"], stats["lookup_failures"], stats["lookups_skipped"]) == (1, 1, 2)
    assert stats["save_failures"] == 3 * 4 and stats.get("save_chunks", 0) == 0
    assert elapsed < 5.0


def test_server_that_comes_back_is_used_again_after_the_cooldown(model_dir: str, make_server, dead_target) -> None:
    engine = make_engine(model_dir, extra={"target": dead_target, "breaker_cooldown_s": 0.2})
    engine.add("down", PROMPT)
    engine.run()
    assert engine.stats.data["lookup_failures"] == 1
    port = int(dead_target.rsplit(":", 1)[1])
    make_server(server={"port": port}, ram={"capacity_bytes": 64 << 20})

    # The breaker probes at most every 0.2 s and the channel reconnects at the same pace.
    deadline = time.monotonic() + 10
    attempt = 0
    while engine.stats.data.get("save_chunks", 0) == 0:
        assert time.monotonic() < deadline, "the connector did not use the server again"
        time.sleep(0.1)
        attempt += 1
        engine.add(f"up{attempt}", [attempt, *PROMPT])
        engine.run()
    assert engine.stats.data["save_chunks"] == 4
    assert engine.stats.data["lookups"] >= 2


def test_server_that_never_answers_costs_one_timeout_per_cooldown(model_dir: str) -> None:
    with socket.socket() as silent:  # accepts connections (the kernel's backlog) and never speaks
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        target = f"127.0.0.1:{silent.getsockname()[1]}"
        extra = {"target": target, "lookup_timeout_s": 0.3, "transfer_timeout_s": 0.6, "breaker_cooldown_s": 60.0}
        engine = make_engine(model_dir, extra=extra)
        started = time.monotonic()
        for i in range(3):
            engine.add(f"r{i}", [i + 3, *PROMPT])
        engine.run()
        elapsed = time.monotonic() - started

    for i in range(3):
        assert engine.computed_positions(f"r{i}") == list(range(101))
    stats = engine.stats.data
    assert (stats["lookups"], stats["lookup_failures"], stats["lookups_skipped"]) == (1, 1, 2)
    # One lookup deadline (scheduler) and one put deadline (worker), then nothing more.
    assert 0.8 <= elapsed < 3.0
