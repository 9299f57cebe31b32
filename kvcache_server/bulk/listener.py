"""The bulk listener: binds the port, wraps TLS, admits connections, runs one Session thread each.

Started by the app next to the gRPC server (kvcache_server.app) with the same TLS certificate and
key and the same tokens; its address is advertised in Info (bulk_port, bulk_host, bulk_tls). A
connection takes an unauthenticated place at accept (kvcache_server.bulk.admission; the oldest
unauthenticated connection is evicted when they are all taken) and gives its place back when its
thread ends; its TLS handshake counts against bulk.hello_timeout_s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import threading
import time
from typing import Any

import grpc

from kvcache_core import bulkwire as bw
from kvcache_server.auth import Authenticator
from kvcache_server.budget import MemoryBudget
from kvcache_server.config import ServerConfig, TlsSection
from kvcache_server.handoff import HandoffRegistry
from kvcache_server.pipeline import Counters
from kvcache_server.pipeline.get import BlockSizes
from kvcache_server.stack import TierStack

from .admission import ConnectionAdmission
from .session import BulkCounters, Session, Shared
from .sink import ArenaSink, BlockSink

log = logging.getLogger(__name__)

_ACCEPT_POLL_S = 0.25
"""How often the accept thread looks whether the listener is stopping."""
_JOIN_S = 5.0


def server_tls_context(tls: TlsSection) -> ssl.SSLContext:
    """The gRPC server's certificate and key (and client CA for mTLS) as an ssl context."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tls.cert_file, tls.key_file)
    if tls.client_ca_file:
        context.load_verify_locations(tls.client_ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class BulkListener:
    """The bulk path's TCP listener and its sessions."""

    def __init__(
        self,
        config: ServerConfig,
        stack: TierStack,
        budget: MemoryBudget,
        authenticator: Authenticator | None,
        sink: BlockSink | None = None,
        block_sizes: BlockSizes | None = None,
    ) -> None:
        self._config = config
        self.counters = BulkCounters()
        self.sink = sink or ArenaSink(stack)
        self._stack = stack
        self._budget = budget
        self._block_sizes = block_sizes or BlockSizes()
        self._authenticator = authenticator
        self._shared: Shared | None = None
        self._tls = server_tls_context(config.tls) if config.tls.enabled else None
        bulk = config.bulk
        self.admission: ConnectionAdmission[threading.Thread] = ConnectionAdmission(
            bulk.max_connections,
            bulk.max_unauthenticated_connections,
            bulk.tenant_share if authenticator is not None else None,
            evict=self._evict,
        )
        self._sock: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._sessions: dict[threading.Thread, socket.socket] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self.port = 0

    @property
    def host(self) -> str:
        return self._config.bulk.host or self._config.server.host

    @property
    def advertised_host(self) -> str:
        """What Info names: empty (the client's gRPC host) when the listener binds every interface."""
        return "" if self.host in ("0.0.0.0", "::", "") else self.host

    @property
    def tls(self) -> bool:
        return self._tls is not None

    async def start(self) -> int:
        """Binds (port 0: a free one) and starts accepting; returns the port.

        Raises:
            OSError: the address cannot be bound.
        """
        bulk = self._config.bulk
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, bulk.port))
        except OSError as exc:
            sock.close()
            raise OSError(f"cannot bind bulk on {self.host}:{bulk.port}: {exc.strerror}") from None
        sock.listen(min(socket.SOMAXCONN, 2 * (bulk.max_connections + bulk.max_unauthenticated_connections)))
        sock.settimeout(_ACCEPT_POLL_S)
        self._sock = sock
        self.port = sock.getsockname()[1]
        shared = Shared(
            loop=asyncio.get_running_loop(),
            stack=self._stack,
            sink=self.sink,
            budget=self._budget,
            limits=self._config.limits,
            bulk=bulk,
            authenticator=self._authenticator,
            counters=self.counters,
            admission=self.admission,
            block_sizes=self._block_sizes,
            lease_timeout_s=self._config.ram.lease_timeout_s,
        )
        self._shared = shared
        self._accept_thread = threading.Thread(
            target=self._accept_forever, args=(shared,), name="kvcache-bulk-accept", daemon=True
        )
        self._accept_thread.start()
        return self.port

    def use_registry(self, registry: HandoffRegistry, put_counters: Counters, service: Any) -> None:
        """The segment socket's registrations, for PUT_MEM (the socket opens after this listener), and
        the service's Put counters, which a PUT_MEM moves as a gRPC Put of the same ranges does."""
        if self._shared is not None:
            self._shared.registry = registry
            self._shared.put_counters = put_counters
            self._shared.service = service

    def _accept_forever(self, shared: Shared) -> None:
        assert self._sock is not None
        while not self._stopping.is_set():
            try:
                conn, addr = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stopping.is_set():
                    return
                log.exception("bulk: accept failed")
                continue
            self._admit(conn, f"{addr[0]}:{addr[1]}", shared)

    def _admit(self, conn: socket.socket, peer: str, shared: Shared) -> None:
        accepted_at = time.monotonic()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        thread = threading.Thread(
            target=self._serve, args=(conn, peer, shared, accepted_at), name=f"kvcache-bulk {peer}", daemon=True
        )
        refusal = self.admission.open(thread)
        if refusal is not None:
            self.counters.add("refused_connections")
            log.info("bulk %s: refused: %s", peer, refusal)
            if self._tls is None:  # a TLS peer would need a handshake first: it just sees the close
                payload = bw.error(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], refusal)
                with contextlib.suppress(OSError):
                    conn.settimeout(1.0)
                    conn.sendall(bw.header(bw.FrameType.ERROR, len(payload)) + payload)
            conn.close()
            return
        with self._lock:
            self._sessions[thread] = conn
        self.counters.add("accepted")
        self.counters.add("connections")
        thread.start()

    def _evict(self, thread: threading.Thread) -> None:
        """Ends an unauthenticated connection evicted for a newer one (ConnectionAdmission.open): an
        ERROR frame (plaintext: a TLS peer mid-handshake has nothing to read it on), then its socket
        is shut down, which ends its session's wait for the rest of its HELLO."""
        with self._lock:
            conn = self._sessions.get(thread)
        if conn is None:
            return
        self.counters.add("evicted")
        log.info("bulk %s: evicted before its HELLO was done", thread.name)
        if self._tls is None:  # its session thread only receives until its HELLO is done
            limit = self._config.bulk.max_unauthenticated_connections
            payload = bw.error(
                grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                f"evicted before its HELLO was done: bulk.max_unauthenticated_connections={limit} newer "
                "connections arrived",
            )
            with contextlib.suppress(OSError):
                conn.send(bw.header(bw.FrameType.ERROR, len(payload)) + payload, socket.MSG_DONTWAIT)
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)

    def _serve(self, conn: socket.socket, peer: str, shared: Shared, accepted_at: float) -> None:
        session: Session | None = None
        me = threading.current_thread()
        try:
            if self._tls is not None:
                # CPython bounds a whole handshake by the socket's timeout (not each read of it).
                conn.settimeout(self._config.bulk.hello_timeout_s)
                try:
                    conn = self._tls.wrap_socket(conn, server_side=True)
                except TimeoutError:
                    shared.counters.add("cut_off")
                    shared.counters.add("cut_off_hello")
                    log.warning("bulk %s: no TLS handshake within bulk.hello_timeout_s; cut off", peer)
                    conn.close()
                    return
                except (OSError, ssl.SSLError) as exc:
                    shared.counters.add("aborted")
                    log.info("bulk %s: TLS handshake failed: %s", peer, exc)
                    conn.close()
                    return
                with self._lock:
                    self._sessions[me] = conn
            session = Session(conn, peer, shared, accepted_at, me)
            session.run()
        finally:
            with self._lock:
                self._sessions.pop(me, None)
            if session is not None and session.authenticated:
                self.admission.close(me, session.tenant, authenticated=True)
            else:
                self.admission.close(me, None, authenticated=False)
            self.counters.add("connections", -1)

    async def stop(self) -> None:
        """Stops accepting, ends every connection (their requests fail; nothing half-received is
        committed) and waits for the session threads, off the event loop."""
        self._stopping.set()
        if self._sock is not None:
            self._sock.close()
        with self._lock:
            sessions = dict(self._sessions)
        for conn in sessions.values():
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        threads = [t for t in (self._accept_thread, *sessions) if t is not None]

        def join() -> None:
            for t in threads:
                t.join(_JOIN_S)

        await asyncio.to_thread(join)
