"""KV cache events for stored blocks: vLLM's own block hashes, on the wire as vLLM's publisher sends them.

The reference for every field is vLLM 0.33's own BlockPool with KV events on: the
events for blocks kvcache stored must name the blocks exactly as the events a router
already receives from the engine's prefix cache, differing only in the medium.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import zmq
from vllm import SamplingParams
from vllm.config.kv_events import KVEventsConfig
from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.lora.request import LoRARequest
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.request import Request

from kvcache_connectors.vllm import KVCacheConnector
from kvcache_connectors.vllm.events import MEDIUM_KVCACHE, StoredBlockEvents
from tests.vllm.harness import BLOCK, make_kv_cache_config, make_vllm_config

pytestmark = pytest.mark.timeout(60)

PROMPT = list(range(500, 570))  # 70 tokens: 4 full blocks of 16 and a 6-token partial block
LOW_64 = (1 << 64) - 1


def make_request(**kwargs: Any) -> Request:
    request = Request(
        request_id="r",
        prompt_token_ids=list(PROMPT),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
        **kwargs,
    )
    assert len(request.block_hashes) == 4
    return request


def vllm_own_event(request: Request) -> BlockStored:
    """The BlockStored vLLM's prefix cache emits when it caches the request's 4 full blocks."""
    pool = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=BLOCK, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(
        request, blocks, num_cached_blocks=0, num_full_blocks=4, block_size=BLOCK, kv_cache_group_id=0
    )
    (event,) = pool.take_events()
    assert isinstance(event, BlockStored)
    return event


def publish_and_receive(events: list) -> KVEventBatch:
    """Encodes a batch as vLLM's ZmqEventPublisher does (vllm/distributed/kv_events.py,
    _publisher_thread: `msgspec.msgpack.Encoder().encode(event)`), and decodes it as a subscriber."""
    payload = msgspec.msgpack.Encoder().encode(KVEventBatch(ts=1234.5, events=events))
    return msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload)


def test_stored_blocks_are_named_by_the_schedulers_block_hashes_exactly_as_vllm_names_them() -> None:
    request = make_request()
    events = StoredBlockEvents(BLOCK)
    events.blocks_stored(request, 0, 2)  # chunk 0: blocks 0, 1
    events.blocks_stored(request, 2, 5)  # chunks 1 and the tail: blocks 2, 3 and the unhashed partial block 4
    batch = publish_and_receive(events.take())
    assert events.take() == []

    hashes = [int.from_bytes(h, "big") & LOW_64 for h in request.block_hashes]
    first, second = batch.events
    assert (batch.ts, batch.data_parallel_rank) == (1234.5, None)
    assert first == BlockStored(
        block_hashes=hashes[:2],
        parent_block_hash=None,
        token_ids=PROMPT[:32],
        block_size=BLOCK,
        lora_id=None,
        medium="KVCACHE",
        lora_name=None,
        extra_keys=[None, None],
        group_idx=0,
    )
    assert second == BlockStored(
        block_hashes=hashes[2:4],
        parent_block_hash=hashes[1],
        token_ids=PROMPT[32:64],
        block_size=BLOCK,
        lora_id=None,
        medium="KVCACHE",
        lora_name=None,
        extra_keys=[None, None],
        group_idx=0,
    )
    # vLLM's own event for the same blocks names them identically (only the medium differs).
    own = vllm_own_event(request)
    assert (own.block_hashes, own.parent_block_hash, own.token_ids) == (hashes, None, PROMPT[:64])
    assert (own.block_size, own.group_idx, own.extra_keys, own.medium) == (BLOCK, 0, [None] * 4, "GPU")


def test_salted_lora_requests_carry_the_extra_keys_vllm_hashed() -> None:
    lora = LoRARequest(lora_name="sql-adapter", lora_int_id=7, lora_path="/adapters/sql")
    request = make_request(cache_salt="tenant-a", lora_request=lora)
    events = StoredBlockEvents(BLOCK)
    events.blocks_stored(request, 0, 4)
    (event,) = publish_and_receive(events.take()).events

    own = vllm_own_event(request)
    assert (
        event.extra_keys
        == own.extra_keys
        == [("sql-adapter", "tenant-a"), ("sql-adapter",), ("sql-adapter",), ("sql-adapter",)]
    )
    assert (event.lora_id, event.lora_name) == (own.lora_id, own.lora_name) == (7, "sql-adapter")
    assert event.block_hashes == own.block_hashes
    assert event.block_hashes != [int.from_bytes(h, "big") & LOW_64 for h in make_request().block_hashes]


def test_the_wire_format_a_router_decodes() -> None:
    # Routers (llm-d, Dynamo) decode the msgpack untyped: the batch is an array, each event a
    # map tagged with its type; fields left at their defaults are omitted.
    request = make_request()
    events = StoredBlockEvents(BLOCK)
    events.blocks_stored(request, 3, 4)
    payload = msgspec.msgpack.Encoder().encode(KVEventBatch(ts=2.0, events=events.take()))
    hashes = [int.from_bytes(h, "big") & LOW_64 for h in request.block_hashes]
    assert msgspec.msgpack.decode(payload) == [
        2.0,
        [
            {
                "type": "BlockStored",
                "block_hashes": [hashes[3]],
                "parent_block_hash": hashes[2],
                "token_ids": PROMPT[48:64],
                "block_size": BLOCK,
                "lora_id": None,
                "medium": MEDIUM_KVCACHE,
                "lora_name": None,
                "extra_keys": [None],
                "group_idx": 0,
            }
        ],
        None,  # data_parallel_rank: an array keeps every position
    ]


@pytest.mark.parametrize(("first", "end"), [(4, 5), (5, 9), (2, 2), (3, 1)])
def test_ranges_without_hashed_blocks_emit_nothing(first: int, end: int) -> None:
    events = StoredBlockEvents(BLOCK)
    events.blocks_stored(make_request(), first, end)
    assert events.take() == []


def test_nothing_is_recorded_when_vllm_publishes_no_kv_events() -> None:
    events = StoredBlockEvents(BLOCK, enabled=False)
    events.blocks_stored(make_request(), 0, 4)
    events.add(StoredBlockEvents(BLOCK).event(make_request(), 0, 4))
    assert events.take() == []


def test_an_event_built_at_planning_is_recorded_later_unchanged() -> None:
    request = make_request()
    events = StoredBlockEvents(BLOCK)
    planned = events.event(request, 0, 2)
    assert events.take() == []
    events.add(planned)
    assert events.take() == [planned]


@pytest.mark.parametrize("enabled", [True, False])
def test_the_scheduler_side_connector_drains_its_events_in_take_events(enabled: bool, model_dir: str) -> None:
    vllm_config = make_vllm_config(model_dir)
    vllm_config.kv_events_config = KVEventsConfig(enable_kv_cache_events=enabled, publisher="zmq")
    connector = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.SCHEDULER, make_kv_cache_config(16))
    assert isinstance(connector, KVCacheConnector)
    request = make_request()
    connector.kv_events.blocks_stored(request, 0, 4)
    taken = connector.take_events()
    assert [event.block_hashes for event in taken] == (
        [[int.from_bytes(h, "big") & LOW_64 for h in request.block_hashes]] if enabled else []
    )
    assert connector.take_events() == []
    connector.shutdown()


def test_vllms_zmq_publisher_carries_the_events_to_a_subscriber(tmp_path) -> None:
    # vLLM's own publisher, as the scheduler uses it, over ipc (no port to pick): PUB/SUB drops what is
    # sent before the subscription is in place, so the batch is sent again until one arrives (bounded).
    endpoint = f"ipc://{tmp_path}/kv-events"
    publisher = ZmqEventPublisher(data_parallel_rank=0, endpoint=endpoint, topic="kv-events")
    subscriber = zmq.Context.instance().socket(zmq.SUB)
    try:
        subscriber.connect(endpoint)
        subscriber.setsockopt(zmq.SUBSCRIBE, b"kv-events")
        request = make_request()
        events = StoredBlockEvents(BLOCK)
        events.blocks_stored(request, 0, 4)
        batch = KVEventBatch(ts=3.0, events=events.take())
        for _ in range(100):
            publisher.publish(batch)
            if subscriber.poll(50):
                break
        topic, seq, payload = subscriber.recv_multipart()
        received = msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload)
    finally:
        subscriber.close(linger=0)
        publisher.shutdown()
    assert topic == b"kv-events" and len(seq) == 8
    assert received == batch
    (event,) = received.events
    assert (event.medium, event.block_hashes) == (
        "KVCACHE",
        [int.from_bytes(h, "big") & LOW_64 for h in request.block_hashes],
    )
