"""grpc.health.v1.Health/Watch through the server's interceptor, and client-side health checking."""

from __future__ import annotations

import json

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvcache_proto import kvcache_pb2 as pb
from kvcache_proto import kvcache_pb2_grpc as pb_grpc
from tests.conftest import ServerThread

pytestmark = pytest.mark.timeout(60)

SERVING = health_pb2.HealthCheckResponse.SERVING


def test_watch_streams_the_serving_status(server: ServerThread) -> None:
    """Watch's handler writes with context.write(); the interceptor used to `async for` over it: UNKNOWN."""
    with grpc.insecure_channel(server.target) as channel:
        stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
        first = next(stream)
        assert first.status == SERVING
        stream.cancel()
        kv = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service="kvcache.v1.KVCache"), timeout=10
        )
        assert next(kv).status == SERVING
        kv.cancel()


def test_a_channel_with_client_side_health_checking_connects(server: ServerThread) -> None:
    config = {
        "healthCheckConfig": {"serviceName": "kvcache.v1.KVCache"},
        "loadBalancingConfig": [{"round_robin": {}}],
    }
    options = [("grpc.service_config", json.dumps(config)), ("grpc.enable_retries", 0)]
    with grpc.insecure_channel(server.target, options=options) as channel:
        grpc.channel_ready_future(channel).result(timeout=10)
        info = pb_grpc.KVCacheStub(channel).Info(pb.InfoRequest(), timeout=10, wait_for_ready=True)
        assert info.max_block_bytes > 0
