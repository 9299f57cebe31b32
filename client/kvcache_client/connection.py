"""How the SDK reaches a server: channel options, TLS and the API token.

    KVCacheClient("kv.internal:51051", token="kvc_...", tls=TLSConfig(ca_file="ca.pem"))

The token defaults to the KVCACHE_TOKEN environment variable and travels as
`authorization: Bearer <token>` metadata on every call. With TLS the server's
certificate is always verified (against `ca_file`, or the system's roots); for
mTLS give the client's own certificate and key.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from kvcache_client.messages import channel_options
from kvcache_client.transport import Metadata

TOKEN_ENV = "KVCACHE_TOKEN"


@dataclass(frozen=True, slots=True)
class TLSConfig:
    """TLS settings of a client.

    Attributes:
        ca_file: PEM bundle that signed the server's certificate; None uses the system roots.
        cert_file: This client's certificate (PEM), for servers that require mTLS.
        key_file: This client's private key (PEM).
        server_name: Name to verify the certificate against, when it differs from the target's host.
    """

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("TLSConfig.cert_file and key_file go together")

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: str | None) -> bytes | None:
            return Path(path).read_bytes() if path else None

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.ca_file),
            private_key=read(self.key_file),
            certificate_chain=read(self.cert_file),
        )


RECONNECT_BACKOFF_MS = (100, 1000)
"""How soon a channel tries again to reach a server it lost: first after 100 ms, at most every second."""


def describe(target: str, *, tls: TLSConfig | bool, shm: bool, bulk: bool, custom: bool, timeout_s: float) -> str:
    """The fields of a client's repr: where it connects and how, never its token."""
    if custom:
        return f"target={target!r}, transport=custom, timeout_s={timeout_s}"
    return f"target={target!r}, tls={bool(tls)}, shm={shm}, bulk={bulk}, timeout_s={timeout_s}"


def auth_metadata(token: str | None) -> Metadata:
    """The metadata carrying `token`, or the KVCACHE_TOKEN environment variable's, or none."""
    token = token if token is not None else os.environ.get(TOKEN_ENV)
    return (("authorization", f"Bearer {token}"),) if token else ()


def _options(max_message_bytes: int, tls: TLSConfig | None) -> list[tuple[str, int | str]]:
    options = channel_options(max_message_bytes)
    # gRPC waits 1 s, then up to 120 s, before reconnecting to a server that went away: a restarted
    # sidecar would stay unreachable long after it is back. Retry within 100 ms .. 1 s instead. (Not
    # grpc.min_reconnect_backoff_ms: it is also the connect timeout, which must stay generous.)
    options += [
        ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
        ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1]),
    ]
    if tls is not None and tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return options


def make_channel(
    target: str,
    *,
    tls: TLSConfig | bool,
    max_message_bytes: int,
    extra_options: Sequence[tuple[str, int | str]] = (),
) -> grpc.Channel:
    config = TLSConfig() if tls is True else tls or None
    options = [*_options(max_message_bytes, config), *extra_options]
    if config is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, config.credentials(), options=options)


def make_aio_channel(target: str, *, tls: TLSConfig | bool, max_message_bytes: int) -> grpc.aio.Channel:
    config = TLSConfig() if tls is True else tls or None
    options = _options(max_message_bytes, config)
    if config is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, config.credentials(), options=options)


def aio_channel_factory(
    target: str, *, tls: TLSConfig | bool, max_message_bytes: int
) -> Callable[[], grpc.aio.Channel]:
    """make_aio_channel, deferred: a grpc.aio channel binds to the event loop running when it is made,
    so AsyncKVCacheClient makes it on first use. TLS files are read now, so a bad one fails here.

    Raises:
        OSError: a TLS file cannot be read.
    """
    config = TLSConfig() if tls is True else tls or None
    options = _options(max_message_bytes, config)
    if config is None:
        return lambda: grpc.aio.insecure_channel(target, options=options)
    credentials = config.credentials()
    return lambda: grpc.aio.secure_channel(target, credentials, options=options)
