"""Building and running the server: `create_server(config)` for tests, `serve(config)` for the CLI."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvcache_server import __version__
from kvcache_server.admission import Admission
from kvcache_server.allocator import trim_forever
from kvcache_server.auth import Authenticator, TokenStore
from kvcache_server.bulk import BulkListener
from kvcache_server.config import (
    ServerConfig,
    ShmSection,
    TlsSection,
    is_loopback,
)
from kvcache_server.handoff import HandoffListener, HandoffRegistry
from kvcache_server.interceptor import RequestContextInterceptor
from kvcache_server.metrics import Metrics
from kvcache_server.observe import NullObserver, Observer
from kvcache_server.prefetch import PrefetchLimits
from kvcache_server.registration import add_to_server
from kvcache_server.service import SERVICE_NAME, KVCacheService
from kvcache_server.shm import ShmDirectory
from kvcache_server.shm import default_dir as shm_default_dir
from kvcache_server.stack import TierStack
from kvcache_server.stack_config import build_stack

log = logging.getLogger(__name__)
STARTUP_LOGGER = "kvcache_server.startup"
"""With server.log_json the start-up line is an INFO record of this logger (the CLI also sends it to stdout)."""


@dataclass(slots=True)
class RunningServer:
    """A started server and what a caller needs to talk to it or stop it."""

    server: grpc.aio.Server
    port: int
    stack: TierStack
    health: health.aio.HealthServicer
    config: ServerConfig
    admission: Admission
    metrics: Metrics | None = None
    metrics_port: int = 0
    health_task: asyncio.Task[None] | None = None
    shm: ShmDirectory | None = None
    shm_task: asyncio.Task[None] | None = None
    trim_task: asyncio.Task[None] | None = None
    bulk: BulkListener | None = None
    service: KVCacheService | None = None
    handoff: HandoffListener | None = None
    interceptor: RequestContextInterceptor | None = None

    @property
    def target(self) -> str:
        return f"{self.config.server.host}:{self.port}"

    async def stop(self, grace_s: float | None = None, drain_deadline_s: float | None = None) -> int:
        """Stops taking calls, lets running ones finish, drains write-behind queues, closes tiers.

        Returns:
            Queued writes that could not be written within the drain deadline.
        """
        c = self.config.server
        for task in (self.health_task, self.shm_task, self.trim_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.health.enter_graceful_shutdown()
        if self.bulk is not None:
            await self.bulk.stop()
        await self.server.stop(c.shutdown_grace_s if grace_s is None else grace_s)
        if self.service is not None:
            await self.service.prefetcher.close()
        dropped = await self.stack.close(c.drain_deadline_s if drain_deadline_s is None else drain_deadline_s)
        if self.metrics is not None:
            self.metrics.close()
        if self.handoff is not None:
            await asyncio.to_thread(self.handoff.stop)
        if self.shm is not None:
            self.shm.close()
        return dropped


async def _set_health(servicer: health.aio.HealthServicer, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", SERVICE_NAME):
        await servicer.set(name, status)


async def _watch_health(
    config: ServerConfig, stack: TierStack, servicer: health.aio.HealthServicer, serving: bool
) -> None:
    """SERVING only while every required tier is usable; probes lower tiers even without traffic."""
    while True:
        await stack.probe()
        down = [name for name in config.health.required if not stack.healthy(name)]
        now = not down
        if now != serving:
            await _set_health(servicer, now)
            log.warning("health: %s", "SERVING" if now else f"NOT_SERVING (required tiers down: {down})")
            serving = now
        await asyncio.sleep(config.health.check_interval_s)


async def create_server(config: ServerConfig) -> RunningServer:
    """Builds, binds and starts the server; port 0 in the config picks a free port."""
    limits = config.limits
    max_message = limits.max_message_bytes
    tokens = TokenStore.load(config.auth.tokens_file) if config.auth.enabled else None
    if tokens is None and not is_loopback(config.server.host):
        log.warning("serving %s WITHOUT authentication (auth.allow_unauthenticated)", config.server.host)
    if config.metrics.enabled and not config.tls.enabled and not is_loopback(config.metrics.host):
        log.warning(
            "serving metrics on %s:%d over plain HTTP: anyone who reaches the port reads them "
            "(bind metrics.host to 127.0.0.1, or configure [tls])",
            config.metrics.host,
            config.metrics.port,
        )
    _warn_if_memory_short(config)
    metrics = Metrics(tokens) if config.metrics.enabled else None
    observer: Observer = metrics or NullObserver()
    # Our own admission instead of gRPC's maximum_concurrent_rpcs, which refuses health checks too and
    # knows no tenants (kvcache_server/admission.py).
    share = config.server.tenant_share
    tenant_max = (lambda tenant: tokens.limits(tenant).max_concurrent_rpcs or share) if tokens else None
    admission = Admission(config.server.max_concurrent_rpcs, tenant_max)
    interceptor = RequestContextInterceptor(observer, Authenticator(tokens) if tokens else None, admission)
    server = grpc.aio.server(
        interceptors=[interceptor],
        options=[
            ("grpc.max_receive_message_length", max_message),
            ("grpc.max_send_message_length", max_message),
            ("grpc.max_metadata_size", limits.max_metadata_bytes),
            ("grpc.absolute_max_metadata_size", limits.max_metadata_bytes),
            ("grpc.max_concurrent_streams", limits.max_concurrent_streams),
            ("grpc.so_reuseport", 0),
        ],
    )
    shm = _open_shm(config.shm)
    stack = build_stack(config, observer, tokens, arena_dir=str(shm.path) if shm is not None else None)
    await stack.start()
    pf = config.prefetch
    service = KVCacheService(
        stack,
        limits,
        version=__version__,
        observer=observer,
        shm=shm,
        lease_timeout_s=config.ram.lease_timeout_s,
        prefetch=PrefetchLimits(pf.max_keys, pf.queue_max_keys, pf.workers, pf.timeout_s, limits.get_window_bytes),
    )
    service.prefetcher.start()
    add_to_server(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        server,
    )
    address = f"{config.server.host}:{config.server.port}"
    try:
        if config.tls.enabled:
            port = server.add_secure_port(address, _server_credentials(config.tls))
        else:
            port = server.add_insecure_port(address)
    except RuntimeError as exc:  # grpc raises RuntimeError when no address could be bound
        raise OSError(f"cannot bind {address}: {exc}") from None
    if port == 0:
        raise OSError(f"cannot bind {address}")
    if not config.events.server_id:  # the port bound, when server.port is 0
        stack.events.server_id = f"{socket.gethostname()}:{port}"
    metrics_port = 0
    if metrics is not None:
        metrics.attach(stack, stack.events, service.counters, admission)
        try:
            metrics_port = metrics.serve(config.metrics.host, config.metrics.port, config.tls)
        except OSError as exc:
            raise OSError(f"cannot bind metrics on {config.metrics.host}:{config.metrics.port}: {exc}") from None
    bulk = None
    if config.bulk.enabled:
        bulk = BulkListener(
            config, stack, service.budget, Authenticator(tokens) if tokens else None, block_sizes=service.block_sizes
        )
        await bulk.start()
        service.bulk = bulk
    handoff = _open_handoff(config.shm, shm, tokens)
    service.handoff = handoff
    if bulk is not None and handoff is not None:
        bulk.use_registry(
            handoff.registry, service._counters, service
        )  # PUT_MEM: puts out of registered processes' memory
    await server.start()
    running = RunningServer(
        server=server,
        port=port,
        stack=stack,
        health=health_servicer,
        config=config,
        admission=admission,
        metrics=metrics,
        metrics_port=metrics_port,
        shm=shm,
        bulk=bulk,
        service=service,
        handoff=handoff,
        interceptor=interceptor,
    )
    if shm is not None:
        running.shm_task = asyncio.create_task(_sweep_shm(shm, config.shm.stale_after_s), name="kvcache-shm-sweep")
    # Without required tiers the server can serve at once; with them, only after a probe found them up.
    serving = not config.health.required
    await _set_health(health_servicer, serving)
    if config.server.malloc_trim_interval_s > 0:
        running.trim_task = asyncio.create_task(
            trim_forever(config.server.malloc_trim_interval_s), name="kvcache-malloc-trim"
        )
    running.health_task = asyncio.create_task(
        _watch_health(config, stack, health_servicer, serving), name="kvcache-health"
    )
    return running


_CGROUP = Path("/sys/fs/cgroup")


def memory_limits(cgroup_root: Path = _CGROUP) -> dict[str, int]:
    """What bounds this process's memory: physical RAM and, where set, its cgroup's limit (v2 or v1)."""
    limits: dict[str, int] = {}
    with contextlib.suppress(ValueError, OSError):
        limits["physical memory"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    own, own_v1 = "", ""  # this process's cgroups, "0::/..." (v2) and "N:memory:/..." (v1) in /proc/self/cgroup
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":
                own = path.strip().lstrip("/")
            elif "memory" in controllers.split(","):
                own_v1 = path.strip().lstrip("/")
    v1 = cgroup_root / "memory"
    candidates = [cgroup_root / own / "memory.max", cgroup_root / "memory.max"]
    candidates += [v1 / own_v1 / "memory.limit_in_bytes", v1 / "memory.limit_in_bytes"]
    for path in candidates:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < limits.get("physical memory", 1 << 62):  # "max" / v1's huge value: none
            limits[f"cgroup limit ({path})"] = int(text)
            break
    return limits


def _warn_if_memory_short(config: ServerConfig, cgroup_root: Path = _CGROUP) -> None:
    """Warns when the RAM tier plus the in-flight budget plus the lower tiers' queues (and the disk
    tier's read buffers) exceed the memory there is."""
    queues = sum(s.queue_max_bytes for s in (config.disk, config.redis, config.s3) if s.enabled)
    queues += config.disk.read_buffers_bytes if config.disk.enabled else 0  # its pooled reads (tiers/reuse.py)
    need = config.ram.capacity_bytes + config.limits.inflight_bytes + queues
    for source, available in memory_limits(cgroup_root).items():
        if need > available:
            log.warning(
                "ram.capacity_bytes (%s) + limits.inflight_bytes (%s) + lower tiers' queue_max_bytes "
                "and disk.read_buffers_bytes (%s) = %s "
                "exceeds the %s of %s: the process may be OOM-killed before the RAM tier is full (docs/limits.md)",
                _gib(config.ram.capacity_bytes),
                _gib(config.limits.inflight_bytes),
                _gib(queues),
                _gib(need),
                source,
                _gib(available),
            )


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def _open_shm(section: ShmSection) -> ShmDirectory | None:
    """The shared-memory directory, or None (disabled, or unusable: logged, the server serves without it)."""
    if not section.enabled:
        return None
    path = section.dir or shm_default_dir()
    try:
        return ShmDirectory.open(path)
    except OSError as exc:
        log.warning("shared-memory path off: %s", exc)
        return None


def _open_handoff(section: ShmSection, shm: ShmDirectory | None, tokens: TokenStore | None) -> HandoffListener | None:
    """The segment socket for same-host clients of other users, or None (off, no shm path, or the
    path cannot be bound: logged, those clients use gRPC and the bulk port)."""
    if shm is None or not section.socket:
        return None

    def tenant_of(token: str) -> str | None:
        principal = tokens.authenticate(token) if tokens is not None else None
        return principal.tenant if principal is not None else None

    listener = HandoffListener(
        section.socket_path or f"{shm.path}.sock",
        HandoffRegistry(),
        tenant_of if tokens is not None else None,
        mode=section.socket_mode,
        max_connections=section.max_socket_connections,
        max_segments_per_connection=section.max_segments_per_connection,
    )
    try:
        listener.start()
    except OSError as exc:
        listener.stop()  # its selector
        log.warning("segment socket off (clients of other Unix users use gRPC): %s", exc)
        return None
    return listener


async def _sweep_shm(shm: ShmDirectory, stale_after_s: float) -> None:
    while True:
        await asyncio.to_thread(shm.sweep, stale_after_s)
        await asyncio.sleep(min(60.0, stale_after_s / 2))


def _server_credentials(tls: TlsSection) -> grpc.ServerCredentials:
    client_ca = Path(tls.client_ca_file).read_bytes() if tls.client_ca_file else None
    return grpc.ssl_server_credentials(
        [(Path(tls.key_file).read_bytes(), Path(tls.cert_file).read_bytes())],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


def describe(running: RunningServer) -> str:
    """The one start-up line: what is served where."""
    c = running.config
    tiers = [f"ram {c.ram.capacity_bytes / (1 << 30):.2f} GiB"]
    if c.disk.enabled:
        tiers.append(f"disk {c.disk.dir} {c.disk.capacity_bytes / (1 << 30):.2f} GiB ({c.disk.write_mode})")
    if c.redis.enabled:
        kind = f"redis cluster ({len(c.redis.startup_nodes())} start-up nodes)" if c.redis.cluster else "redis"
        tiers.append(f"{kind} {c.redis.url.split('@')[-1]} ({c.redis.write_mode})")
    if c.s3.enabled:
        tiers.append(f"s3 {c.s3.bucket}/{c.s3.prefix} ({c.s3.write_mode})")
    scheme = "https" if c.tls.enabled else "http"
    metrics = f"; metrics {scheme}://{c.metrics.host}:{running.metrics_port}/metrics" if running.metrics else ""
    security = ("tls" if not c.tls.client_ca_file else "mtls") if c.tls.enabled else "plaintext"
    security += ", auth" if c.auth.enabled else ", no auth"
    security += f"; shm {running.shm.path}" if running.shm is not None else ""
    security += f"; bulk {running.bulk.host}:{running.bulk.port}" if running.bulk is not None else ""
    return (
        f"kvcache-server {__version__} serving {SERVICE_NAME} on {c.server.host}:{running.port} "
        f"(tiers: {', '.join(tiers)}; max block {c.limits.max_block_bytes / (1 << 20):.0f} MiB; {security}{metrics})"
    )


def _tune_interpreter(switch_interval_s: float) -> None:
    """What the server process does to keep its event loop's latency (docs/limits.md, "The event
    loop's latency"): everything allocated until now (modules, the stack, the arena's bookkeeping)
    moves out of the cyclic collector's reach (gc.freeze), so that a full collection walks only
    what calls allocate since; and a thread that holds the GIL is asked to hand it over after
    `switch_interval_s` (CPython's default 5 ms is what the loop could wait behind a worker thread
    for each wake-up). For the server's own process only: create_server alone (tests, embedding)
    leaves the interpreter as it found it."""
    gc.collect()
    gc.freeze()
    if switch_interval_s > 0:
        sys.setswitchinterval(switch_interval_s)


async def serve(config: ServerConfig) -> None:
    """Runs until SIGTERM or SIGINT, then shuts down gracefully."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    running = await create_server(config)
    _tune_interpreter(config.server.switch_interval_s)
    # Printed once the server takes calls and signals are handled: a supervisor may act on it at once.
    if config.server.log_json:
        logging.getLogger(STARTUP_LOGGER).info("%s", describe(running))
    else:
        print(describe(running), flush=True)
    await stop.wait()
    log.info("shutting down (grace %.1fs)", config.server.shutdown_grace_s)
    dropped = await running.stop()
    if dropped:
        log.warning("stopped; %d queued writes to lower tiers were dropped at the drain deadline", dropped)
    else:
        log.info("stopped; all queued writes drained")
