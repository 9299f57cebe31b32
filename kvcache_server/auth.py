"""Authentication, rights, tenants and per-tenant rate limits.

Clients present an API token as gRPC metadata `authorization: Bearer <token>`.
The server keeps only SHA-256 hashes of tokens (tokens are long random strings,
so a fast hash is enough; nothing at rest lets anyone call the server). Each
token belongs to one tenant and carries rights:

    read   Lookup, Get, Prefetch, WatchEvents (only the tenant's own events), LeaseGet, LeaseRelease
    write  Put, Delete, ArenaReserve, ArenaCommit
    admin  Stats (server-wide counters, all tenants); per-namespace series on the metrics port

The health service and reflection need no token.

The tokens file (TOML), e.g. made with `python -m kvcache_server.auth new-token`:

    [[tokens]]
    name = "prefill-workers"            # shown in logs, never the token
    tenant = "team-a"
    sha256 = "9f86d081884c7d65..."      # hex SHA-256 of the token
    rights = ["read", "write"]

    [tenants.team-a]
    ram_quota_bytes = "4GiB"            # team-a's share of the RAM tier (its floods evict its own blocks)
    requests_per_s = 2000.0             # token bucket; 0 = unlimited
    burst = 4000
    max_concurrent_rpcs = 256           # calls running at once; 0 = server.tenant_max_concurrent_rpcs
    max_event_subscribers = 16          # WatchEvents streams; 0 = events.tenant_max_subscribers
"""

from __future__ import annotations

import argparse
import contextvars
import enum
import hashlib
import hmac
import re
import secrets
import sys
import threading
import time
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvcache_server.config import ConfigError, parse_size

TENANT_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
"""Tenant names: lowercase, no ':' (the server scopes namespaces as "<tenant>:<namespace>")."""


class Right(enum.StrEnum):
    READ = "read"
    WRITE = "write"
    ADMIN = "admin"


RATE_FREE_METHODS = frozenset({"Info"})
"""Not charged to the tenant's request rate: the SDK asks Info once per connection (and once more
after a server restart) to learn the shm directory, the arena and its presence index (docs/presence.md),
so a tenant's budget stays its own calls'. Info still has a bucket of its own per tenant, at the same
rate, so that a flood of Info calls is bounded too."""

METHOD_RIGHTS: Mapping[str, Right] = {
    "Lookup": Right.READ,
    "Get": Right.READ,
    "Prefetch": Right.READ,
    "WatchEvents": Right.READ,
    "Put": Right.WRITE,
    "Delete": Right.WRITE,
    "LeaseGet": Right.READ,
    "LeaseRelease": Right.READ,
    "ArenaReserve": Right.WRITE,
    "ArenaCommit": Right.WRITE,
    "Stats": Right.ADMIN,
}


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: the token's name, its tenant and rights."""

    name: str
    tenant: str
    rights: frozenset[Right]


current_principal: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("kvcache_principal", default=None)
"""The authenticated caller of the running RPC (None with auth off); set by the interceptor."""


@dataclass(frozen=True, slots=True)
class TenantLimits:
    ram_quota_bytes: int = 0  # 0: no quota of its own
    requests_per_s: float = 0.0  # 0: unlimited
    burst: int = 0  # bucket size; defaults to 2 s of requests_per_s
    max_concurrent_rpcs: int = 0  # 0: the server's per-tenant default
    max_event_subscribers: int = 0  # 0: the server's per-tenant default


@dataclass(frozen=True, slots=True)
class _Token:
    name: str
    digest: bytes
    principal: Principal


class AuthError(Exception):
    """A call refused by authentication or authorisation; `code_name` is the gRPC status to answer."""

    def __init__(self, code_name: str, message: str) -> None:
        super().__init__(message)
        self.code_name = code_name


def token_digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


@dataclass(slots=True)
class TokenStore:
    """Tokens (as hashes) and tenant limits, loaded once at start-up."""

    tokens: list[_Token] = field(default_factory=list)
    tenants: dict[str, TenantLimits] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path) -> TokenStore:
        try:
            data = tomllib.loads(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read tokens file {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"tokens file {path} is not valid TOML: {exc}") from None
        return cls.from_dict(data, str(path))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "tokens") -> TokenStore:
        unknown = set(data) - {"tokens", "tenants"}
        if unknown:
            raise ConfigError(f"{source}: unknown keys {sorted(unknown)}")
        store = cls()
        seen: set[bytes] = set()
        for i, entry in enumerate(data.get("tokens", [])):
            where = f"{source}: tokens[{i}]"
            extra = set(entry) - {"name", "tenant", "sha256", "rights"}
            if extra:
                raise ConfigError(f"{where}: unknown fields {sorted(extra)}")
            tenant = str(entry.get("tenant", ""))
            if not TENANT_NAME.match(tenant):
                raise ConfigError(f"{where}: tenant {tenant!r} must match {TENANT_NAME.pattern}")
            try:
                digest = bytes.fromhex(str(entry.get("sha256", "")))
            except ValueError:
                digest = b""
            if len(digest) != 32:
                raise ConfigError(f"{where}: sha256 must be 64 hex characters (the hash, never the token)")
            if digest in seen:
                raise ConfigError(f"{where}: duplicate token hash")
            seen.add(digest)
            try:
                rights = frozenset(Right(r) for r in entry.get("rights", []))
            except ValueError:
                raise ConfigError(f"{where}: rights must be among {[r.value for r in Right]}") from None
            if not rights:
                raise ConfigError(f"{where}: a token needs at least one right")
            name = str(entry.get("name", f"token-{i}"))
            store.tokens.append(_Token(name, digest, Principal(name, tenant, rights)))
        for tenant, limits in data.get("tenants", {}).items():
            where = f"{source}: tenants.{tenant}"
            if not TENANT_NAME.match(tenant):
                raise ConfigError(f"{where}: tenant name must match {TENANT_NAME.pattern}")
            extra = set(limits) - {f.name for f in fields(TenantLimits)}
            if extra:
                raise ConfigError(f"{where}: unknown fields {sorted(extra)}")
            rate = float(limits.get("requests_per_s", 0.0))
            parsed = TenantLimits(
                ram_quota_bytes=parse_size(limits.get("ram_quota_bytes", 0)),
                requests_per_s=rate,
                burst=int(limits.get("burst", max(1, round(2 * rate)))),
                max_concurrent_rpcs=int(limits.get("max_concurrent_rpcs", 0)),
                max_event_subscribers=int(limits.get("max_event_subscribers", 0)),
            )
            if any(getattr(parsed, f.name) < 0 for f in fields(parsed)):
                raise ConfigError(f"{where}: limits must be >= 0")
            store.tenants[tenant] = parsed
        if not store.tokens:
            raise ConfigError(f"{source}: no tokens; with auth enabled nobody could call the server")
        return store

    def authenticate(self, token: str) -> Principal | None:
        """The token's principal, or None. Compares against every hash in constant time."""
        digest = token_digest(token)
        found: Principal | None = None
        for entry in self.tokens:
            if hmac.compare_digest(entry.digest, digest):
                found = entry.principal
        return found

    def limits(self, tenant: str) -> TenantLimits:
        return self.tenants.get(tenant, TenantLimits())


class RateLimiter:
    """Token buckets per tenant (thread-safe; the metrics thread never calls it)."""

    def __init__(self, store: TokenStore) -> None:
        self._store = store
        self._buckets: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, last refill time)
        self._lock = threading.Lock()

    def allow(self, tenant: str, now: float | None = None) -> bool:
        limits = self._store.limits(tenant)
        if limits.requests_per_s <= 0:
            return True
        now = time.monotonic() if now is None else now
        with self._lock:
            tokens, last = self._buckets.get(tenant, (float(limits.burst), now))
            tokens = min(float(limits.burst), tokens + (now - last) * limits.requests_per_s)
            allowed = tokens >= 1.0
            self._buckets[tenant] = (tokens - 1.0 if allowed else tokens, now)
            return allowed


class Authenticator:
    """Decides whether a call may run: token, right, rate limit."""

    def __init__(self, store: TokenStore) -> None:
        self.store = store
        self._limiter = RateLimiter(store)
        self._info_limiter = RateLimiter(store)  # RATE_FREE_METHODS: a bucket of their own

    def check(self, method: str, metadata: Mapping[str, str]) -> Principal:
        """The caller's principal for `method`.

        Raises:
            AuthError: UNAUTHENTICATED (no or unknown token), PERMISSION_DENIED
                (missing right), RESOURCE_EXHAUSTED (tenant over its request rate).
        """
        header = metadata.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise AuthError("UNAUTHENTICATED", "missing credentials: send 'authorization: Bearer <token>' metadata")
        principal = self.store.authenticate(token.strip())
        if principal is None:
            raise AuthError("UNAUTHENTICATED", "invalid token")
        needed = METHOD_RIGHTS.get(method)
        if needed is not None and needed not in principal.rights:
            raise AuthError(
                "PERMISSION_DENIED", f"token {principal.name!r} lacks the {needed.value!r} right for {method}"
            )
        limiter = self._info_limiter if method in RATE_FREE_METHODS else self._limiter
        if not limiter.allow(principal.tenant):
            rate = self.store.limits(principal.tenant).requests_per_s
            raise AuthError("RESOURCE_EXHAUSTED", f"tenant {principal.tenant!r} exceeds its rate limit ({rate:g}/s)")
        return principal


def main(argv: list[str] | None = None) -> int:
    """`python -m kvcache_server.auth new-token --tenant T --rights read,write`: a token and its file entry."""
    parser = argparse.ArgumentParser(prog="python -m kvcache_server.auth")
    sub = parser.add_subparsers(dest="command", required=True)
    new = sub.add_parser("new-token", help="print a new random token and the [[tokens]] entry for it")
    new.add_argument("--tenant", required=True)
    new.add_argument("--name", default="")
    new.add_argument("--rights", default="read,write")
    hashed = sub.add_parser("hash", help="print the sha256 of a token read from stdin")
    del hashed
    args = parser.parse_args(argv)
    if args.command == "hash":
        print(token_digest(sys.stdin.readline().strip()).hex())
        return 0
    if not TENANT_NAME.match(args.tenant):
        parser.error(f"tenant must match {TENANT_NAME.pattern}")
    rights = [r.strip() for r in args.rights.split(",") if r.strip()]
    for r in rights:
        Right(r)
    token = "kvc_" + secrets.token_urlsafe(32)
    print(f"token (give it to the client; it is not stored anywhere): {token}", file=sys.stderr)
    print("[[tokens]]")
    print(f'name = "{args.name or args.tenant}"')
    print(f'tenant = "{args.tenant}"')
    print(f'sha256 = "{token_digest(token).hex()}"')
    print(f"rights = {rights!r}".replace("'", '"'))
    return 0


if __name__ == "__main__":
    sys.exit(main())
