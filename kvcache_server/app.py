"""Building and running the server: `create_server(config)` for tests, `serve(config)` for the CLI."""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvcache_proto import kvcache_pb2_grpc as pb_grpc
from kvcache_server import __version__
from kvcache_server.config import ServerConfig
from kvcache_server.service import SERVICE_NAME, KVCacheService
from kvcache_server.stack import TierStack
from kvcache_server.tiers.ram import RamTier

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RunningServer:
    """A started server and what a caller needs to talk to it or stop it."""

    server: grpc.aio.Server
    port: int
    stack: TierStack
    health: health.aio.HealthServicer
    config: ServerConfig

    @property
    def target(self) -> str:
        return f"{self.config.server.host}:{self.port}"

    async def stop(self, grace_s: float | None = None) -> None:
        """Stops taking calls, lets running ones finish within the grace period, closes tiers."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(self.config.server.shutdown_grace_s if grace_s is None else grace_s)
        await self.stack.close()


def build_stack(config: ServerConfig) -> TierStack:
    return TierStack([RamTier(config.ram.capacity_bytes)])


async def create_server(config: ServerConfig) -> RunningServer:
    """Builds, binds and starts the server; port 0 in the config picks a free port."""
    max_message = config.limits.max_message_bytes
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", max_message),
            ("grpc.max_send_message_length", max_message),
            ("grpc.so_reuseport", 0),
        ],
        maximum_concurrent_rpcs=config.server.max_concurrent_rpcs,
    )
    stack = build_stack(config)
    pb_grpc.add_KVCacheServicer_to_server(KVCacheService(stack, config.limits, version=__version__), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        server,
    )
    address = f"{config.server.host}:{config.server.port}"
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as exc:  # grpc raises RuntimeError when no address could be bound
        raise OSError(f"cannot bind {address}: {exc}") from None
    if port == 0:
        raise OSError(f"cannot bind {address}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(server=server, port=port, stack=stack, health=health_servicer, config=config)


def describe(running: RunningServer) -> str:
    """The one start-up line: what is served where."""
    c = running.config
    return (
        f"kvcache-server {__version__} serving {SERVICE_NAME} on {c.server.host}:{running.port} "
        f"(tiers: ram {c.ram.capacity_bytes / (1 << 30):.2f} GiB; "
        f"max block {c.limits.max_block_bytes / (1 << 20):.0f} MiB)"
    )


async def serve(config: ServerConfig) -> None:
    """Runs until SIGTERM or SIGINT, then shuts down gracefully."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    running = await create_server(config)
    # Printed once the server takes calls and signals are handled: a supervisor may act on it at once.
    print(describe(running), flush=True)
    await stop.wait()
    log.info("shutting down (grace %.1fs)", config.server.shutdown_grace_s)
    await running.stop()
    log.info("stopped")
